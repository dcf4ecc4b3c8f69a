"""The stand-in base: where the official image cannot be pulled (CI), a local image with
its layout (system Python, the stock release wheel in site-packages, `vllm serve`), made
with debootstrap and buildah (daemonless, vfs storage under the cache), and the real
images/Dockerfile built on it and checked from outside."""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from .errors import BuildError
from .fetch import fetch
from .host_tools import ensure_host_tools
from .image_builders import Builder, image_config, inspect_image, run_command
from .images import build_image
from .releases import Release

# Debian bookworm's python3 is 3.11, like the deps venv whose site-packages it gets; uv
# because the official image installs with it.
STANDIN_SUITE = "bookworm"
STANDIN_PACKAGES = ("python3", "python3-pip")
STANDIN_PYTHON = "3.11"
STANDIN_UV = "uv==0.13.9"
STANDIN_KEY_LABEL = "io.kvwarm.standin-key"


def debian_mirror() -> str:
    return os.environ.get("KVWARM_DEBIAN_MIRROR", "http://deb.debian.org/debian")


def standin_builder(cache: Path) -> Builder:
    """buildah with its own storage under the cache: vfs and chroot isolation work in an
    unprivileged container without a daemon, and nothing touches other image stores."""
    store = cache / "images" / "storage"
    return Builder("buildah", ("buildah", "--root", str(store / "root"), "--runroot", str(store / "run"),
                               "--storage-driver", "vfs"), ("--isolation", "chroot"))


def ensure_rootfs(cache: Path, log=print) -> Path:
    """A minimal Debian with python3 and pip, made once per cache by debootstrap."""
    tarball = cache / "images" / f"{STANDIN_SUITE}-minbase-{'-'.join(STANDIN_PACKAGES)}.tar"
    if tarball.exists():
        return tarball
    tarball.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvwarm-rootfs-", dir=tarball.parent) as tmp:
        root = Path(tmp) / "rootfs"
        run_command(["debootstrap", "--variant=minbase", f"--include={','.join(STANDIN_PACKAGES)}",
                     STANDIN_SUITE, str(root), debian_mirror()], log=log, capture=True)
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
            shutil.rmtree(root / junk, ignore_errors=True)
        partial = Path(tmp) / "rootfs.tar"
        run_command(["tar", "-C", str(root), "-cf", str(partial), "."], log=log)
        os.replace(partial, tarball)  # complete or absent
    log(f"made {tarball.name} in {time.monotonic() - started:.0f} s")
    return tarball


def _uv_wheel(cache: Path, log=print) -> Path:
    folder = cache / "images" / "uv"
    pattern = f"uv-{STANDIN_UV.partition('==')[2]}-*.whl"
    if not list(folder.glob(pattern)):
        run_command([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:",
                     "-d", str(folder), STANDIN_UV], log=log)
    return next(folder.glob(pattern))


def ensure_standin(builder: Builder, release: Release, cache: Path, deps_site: Path, log=print) -> str:
    """localhost/kvwarm-standin:X.Y.Z: Debian python3, the deps venv's packages in the system
    site-packages, uv, the STOCK release cuda wheel, `vllm serve` as entrypoint. Reused while
    its inputs (a key label) are unchanged."""
    if not deps_site.name == "site-packages" or f"python{STANDIN_PYTHON}" not in deps_site.parts:
        raise BuildError(f"the deps venv {deps_site} is not Python {STANDIN_PYTHON}",
                         f"run the tooling with Python {STANDIN_PYTHON}, the stand-in's (Debian {STANDIN_SUITE})")
    name = f"localhost/kvwarm-standin:{release.version}"
    stock = fetch(release.flavour("cuda").wheel, cache / "downloads", log=log)
    rootfs, uv = ensure_rootfs(cache, log=log), _uv_wheel(cache, log=log)
    key = hashlib.sha256(repr((rootfs.name, str(deps_site), stock.name, uv.name)).encode()).hexdigest()[:16]
    existing = inspect_image(builder, name)
    if existing and image_config(builder, name)["Labels"].get(STANDIN_KEY_LABEL) == key:
        log(f"{name} is up to date")
        return name
    started = time.monotonic()
    ctr = builder.run("from", "scratch", log=log, capture=True).strip()
    try:
        mount = Path(builder.run("mount", ctr, log=log, capture=True).strip())
        run_command(["tar", "-C", str(mount), "-xf", str(rootfs)], log=log)
        site = mount / "usr" / "local" / "lib" / f"python{STANDIN_PYTHON}" / "dist-packages"
        site.mkdir(parents=True, exist_ok=True)
        run_command(["cp", "-a", f"{deps_site}/.", str(site)], log=log)
        wheels = mount / "tmp" / "kvwarm-wheels"
        wheels.mkdir(parents=True)
        for wheel in (stock, uv):
            shutil.copy(wheel, wheels)
        # The release's vllm like the official image's: pip-installed into the system Python.
        builder.run("run", "--isolation", "chroot", ctr, "--", "python3", "-m", "pip", "install",
                    "-q", "--no-index", "--no-deps", "--break-system-packages", f"/tmp/kvwarm-wheels/{stock.name}",
                    f"/tmp/kvwarm-wheels/{uv.name}", log=log)
        shutil.rmtree(wheels)
        builder.run("config", "--entrypoint", '["vllm", "serve"]',
                    "--workingdir", "/vllm-workspace", "--env", "VLLM_USAGE_SOURCE=production-docker-image",
                    "--label", f"{STANDIN_KEY_LABEL}={key}", ctr, log=log)
        if existing:
            builder.run("rmi", "-f", name, log=log)
        builder.run("commit", "-q", "--rm", ctr, name, log=log)
    except BaseException:
        builder.remove_container(ctr)
        raise
    log(f"made {name} in {time.monotonic() - started:.0f} s")
    return name


def run_inside(builder: Builder, image: str, commands: list[list[str]], env: dict[str, str], log=print) -> None:
    """Run commands in a working container of `image` (the built image's own filesystem)."""
    ctr = builder.run("from", image, log=log, capture=True).strip()
    try:
        for argv in commands:
            flags = [f for key, value in env.items() for f in ("--env", f"{key}={value}")]
            builder.run("run", "--isolation", "chroot", *flags, ctr, "--", *argv, log=log)
    finally:
        builder.remove_container(ctr)


def build_and_check(builder: Builder, release: Release, wheel: Path, record: dict, base: str,
                    keep: bool = False, log=print) -> None:
    """images/Dockerfile on `base`, then from outside: the labels and the kept entrypoint
    (build_image), the selfcheck and `python -m vllm.kvwarm info` inside."""
    tag, args = build_image(builder, release, wheel, record, base,
                            tag=f"localhost/kvwarm-standin-built:{release.version}", log=log)
    try:
        check = ["python3", "-m", "vllm.kvwarm", "selfcheck", "--dist", args["VLLM_DIST"],
                 "--expect-version", release.patched_version, "--expect-series-digest", args["KVWARM_SERIES_DIGEST"]]
        # The cuda wheel on a CPU host: 0.28 reads its target device from here.
        run_inside(builder, tag, [check, ["python3", "-m", "vllm.kvwarm", "info"]],
                   {"VLLM_TARGET_DEVICE": "cpu"}, log=log)
    finally:
        if not keep:
            builder.remove_image(tag)


def build_on_standin(release: Release, wheel: Path, record: dict, cache: Path, deps_site: Path,
                     keep: bool = False, log=print) -> None:
    """The real Dockerfile on a stand-in base, checked from outside (build_and_check)."""
    started = time.monotonic()
    ensure_host_tools(("buildah", "debootstrap"), "the stand-in image build", log=log)
    builder = standin_builder(cache)
    base = ensure_standin(builder, release, cache, deps_site, log=log)
    build_and_check(builder, release, wheel, record, base, keep=keep, log=log)
    log(f"stand-in image checks passed for {release.patched_version} in {time.monotonic() - started:.0f} s")
