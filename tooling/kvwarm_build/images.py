"""Drop-in images: images/Dockerfile on a release's official base, with the patched wheel.

The build runs with whichever OCI builder is here (docker buildx, podman, buildah). Where
the official base cannot be pulled (CI), `build_on_standin` makes a local stand-in with the
official layout (system Python, the stock release wheel in site-packages, `vllm serve`) and
builds the very same Dockerfile on it with buildah, then checks the result from outside.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from . import project
from .errors import BuildError
from .fetch import fetch
from .releases import Release
from .repack import WheelName

DOCKERFILE = project.ROOT / "images" / "Dockerfile"
SERIES_LABEL = "io.kvwarm.series-digest"
# What the official image keeps and ours must not change.
KEPT = ("Entrypoint", "Cmd", "User", "WorkingDir")

# The stand-in base: Debian bookworm's python3 is 3.11, like the deps venv whose
# site-packages it gets; uv because the official image installs with it.
STANDIN_SUITE = "bookworm"
STANDIN_PACKAGES = ("python3", "python3-pip")
STANDIN_PYTHON = "3.11"
STANDIN_UV = "uv==0.13.9"
DEBIAN_MIRROR = os.environ.get("KVWARM_DEBIAN_MIRROR", "http://deb.debian.org/debian")


@dataclass(frozen=True)
class Builder:
    name: str  # docker | podman | buildah
    command: tuple[str, ...]  # the tool with its global options
    build_options: tuple[str, ...] = ()

    def build_argv(self, dockerfile: Path, tag: str, args: dict[str, str], context: Path) -> list[str]:
        verb = {"docker": ("buildx", "build", "--load"), "podman": ("build",), "buildah": ("bud",)}[self.name]
        argv = [*self.command, *verb, *self.build_options, "-f", str(dockerfile), "-t", tag]
        for key, value in args.items():
            argv += ["--build-arg", f"{key}={value}"]
        return argv + [str(context)]


def detect_builder(path: str | None = None) -> Builder:
    """docker buildx, else podman, else buildah (first found on PATH)."""
    docker = shutil.which("docker", path=path)
    if docker and subprocess.run([docker, "buildx", "version"], capture_output=True).returncode == 0:
        return Builder("docker", (docker,))
    for name in ("podman", "buildah"):
        found = shutil.which(name, path=path)
        if found:
            return Builder(name, (found,))
    raise BuildError(
        "no image builder found: looked for docker buildx (docker with its buildx plugin), podman "
        "and buildah on PATH" + (" (docker is there, but `docker buildx version` fails)" if docker else ""),
        "install one of them, e.g. `apt-get install -y buildah` (as root it builds without a daemon; "
        "set STORAGE_DRIVER=vfs BUILDAH_ISOLATION=chroot inside a container)",
    )


def _run(argv: list[str], log=print, capture: bool = False) -> str:
    log("  $ " + " ".join(argv))
    result = subprocess.run(argv, text=True, capture_output=capture)
    if result.returncode != 0:
        detail = (result.stderr or "").strip()[-2000:] if capture else "(output above)"
        raise BuildError(f"`{' '.join(argv[:4])} ...` failed ({result.returncode}): {detail}",
                         "fix what the builder says above and run again")
    return result.stdout if capture else ""


def _inspect(builder: Builder, image: str) -> dict | None:
    argv = {"buildah": [*builder.command, "inspect", "--type", "image", image]}.get(
        builder.name, [*builder.command, "image", "inspect", image])
    result = subprocess.run(argv, capture_output=True, text=True)
    if result.returncode != 0:
        return None
    data = json.loads(result.stdout)
    return data[0] if isinstance(data, list) else data


def image_config(builder: Builder, image: str) -> dict:
    """Entrypoint, Cmd, User, WorkingDir, Labels and digest of a local image."""
    data = _inspect(builder, image)
    if data is None:
        raise BuildError(f"image {image} not found by {builder.name}", "build or pull it first")
    if builder.name == "buildah":
        config, digest = data["OCIv1"].get("config", {}), data.get("FromImageDigest", "")
    else:
        config = data.get("Config", {})
        repo = (data.get("RepoDigests") or [""])[0]
        digest = data.get("Digest") or repo.partition("@")[2]
    out = {key: config.get(key) or None for key in KEPT}
    out["Labels"] = config.get("Labels") or {}
    out["Digest"] = digest
    return out


def _untagged(ref: str) -> str:
    """name:tag -> name (a registry port's colon comes before the last slash)."""
    name, _, tag = ref.rpartition(":")
    return name if name and "/" not in tag else ref


def qualified(ref: str) -> str:
    """Docker Hub short names in full (vllm/vllm-openai -> docker.io/vllm/vllm-openai):
    podman and buildah refuse short names unless registries.conf says where to look."""
    first, slash, rest = ref.partition("/")
    if not slash:
        return f"docker.io/library/{ref}"
    if "." in first or ":" in first or first == "localhost":
        return ref
    return f"docker.io/{ref}"


def resolve_base(builder: Builder, ref: str, log=print) -> tuple[str, str]:
    """(the reference to build FROM, its digest): a ref pinned by digest is kept; otherwise
    the image is pulled when missing and pinned to the digest the builder holds, so the
    label names exactly the base the build used."""
    if "@" in ref:
        return ref, ref.rpartition("@")[2]
    if _inspect(builder, ref) is None:
        log(f"  $ {builder.name} pull {ref}")
        if subprocess.run([*builder.command, "pull", ref]).returncode != 0:
            raise BuildError(f"{builder.name} could not pull the base image {ref} (output above)",
                             "check access to its registry (or log in); pass --base with a reachable copy, "
                             "or where no registry is reachable run the stand-in build (nox -s image-standin-X.Y)")
    digest = image_config(builder, ref)["Digest"]
    if not digest:
        raise BuildError(f"base image {ref} has no digest", "pin it in releases.toml as name@sha256:...")
    return f"{_untagged(ref)}@{digest}", digest


def created_time() -> str:
    """RFC 3339 UTC: SOURCE_DATE_EPOCH when set (reproducible labels), else now."""
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    moment = datetime.fromtimestamp(int(epoch), timezone.utc) if epoch else datetime.now(timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def source_url() -> str:
    env = os.environ.get("KVWARM_SOURCE_URL")
    if env:
        return env
    out = subprocess.run(["git", "remote", "get-url", "origin"], cwd=project.ROOT, capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


def build_args(release: Release, wheel: Path, record: dict, base: str, base_digest: str) -> dict[str, str]:
    """Every ARG of images/Dockerfile, from releases.toml, the built wheel and git."""
    name = WheelName.parse(wheel.name)
    if name.version != release.patched_version or record.get("version") != name.version:
        raise BuildError(f"{wheel.name} is not {release.patched_version} (its record says {record.get('version')})",
                         f"rebuild it: nox -s build-{release.short}")
    return {
        "VLLM_VERSION": release.version,
        "KVWARM_BUILD": str(release.build),
        "VLLM_DIST": name.dist,
        "WHEEL": wheel.name,
        "BASE_IMAGE": base,
        "BASE_DIGEST": base_digest,
        "KVWARM_SERIES_DIGEST": record["series_digest"],
        "REVISION": project.revision(),
        "CREATED": created_time(),
        "SOURCE": source_url(),
    }


def expected_labels(args: dict[str, str]) -> dict[str, str]:
    return {
        "org.opencontainers.image.base.name": args["BASE_IMAGE"],
        "org.opencontainers.image.base.digest": args["BASE_DIGEST"],
        "org.opencontainers.image.version": f"{args['VLLM_VERSION']}+kvwarm.{args['KVWARM_BUILD']}",
        "org.opencontainers.image.revision": args["REVISION"],
        "org.opencontainers.image.created": args["CREATED"],
        "org.opencontainers.image.source": args["SOURCE"],
        SERIES_LABEL: args["KVWARM_SERIES_DIGEST"],
    }


def default_tag(base: str, release: Release) -> str:
    """vllm/vllm-openai:vX.Y.Z -> vllm/vllm-openai-kvwarm:vX.Y.Z-kvwarm.N (a tag has no '+')."""
    repo = _untagged(base.partition("@")[0])
    return f"{repo}-kvwarm:v{release.version}-{release.label}"


def config_problems(built: dict, base: dict, labels: dict[str, str]) -> list[str]:
    problems = [f"{key} is {built[key]!r}, the base image's is {base[key]!r}"
                for key in KEPT if built[key] != base[key]]
    for key, value in labels.items():
        if built["Labels"].get(key) != value:
            problems.append(f"label {key} is {built['Labels'].get(key)!r}, expected {value!r}")
    return problems


def build_image(builder: Builder, release: Release, wheel: Path, record: dict, base_ref: str,
                tag: str | None = None, log=print) -> tuple[str, dict[str, str]]:
    """Build images/Dockerfile with `wheel`; check the image keeps the base's entrypoint,
    command, user and workdir and carries the labels. Returns (tag, build args)."""
    base, digest = resolve_base(builder, qualified(base_ref), log=log)
    args = build_args(release, wheel, record, base, digest)
    tag = tag or default_tag(base_ref, release)
    with tempfile.TemporaryDirectory(prefix="kvwarm-image-") as context:
        # The context is the wheel alone: nothing else of the project is sent or copied.
        if wheel.stat().st_dev == os.stat(context).st_dev:
            os.link(wheel, Path(context) / wheel.name)
        else:
            shutil.copy(wheel, context)
        started = time.monotonic()
        _run(builder.build_argv(DOCKERFILE, tag, args, Path(context)), log=log)
    log(f"built {tag} in {time.monotonic() - started:.0f} s")
    problems = config_problems(image_config(builder, tag), image_config(builder, base), expected_labels(args))
    if problems:
        raise BuildError(f"image {tag}: " + "; ".join(problems), "fix images/Dockerfile")
    log(f"{tag}: labels as expected; entrypoint, cmd, user and workdir kept from {base}")
    return tag, args


# --- the stand-in base (buildah only: it can assemble an image from a folder, daemonless) ---

def ensure_host_tools(log=print) -> None:
    """buildah and debootstrap, installed with apt-get when missing and we are root."""
    missing = [tool for tool in ("buildah", "debootstrap") if shutil.which(tool) is None]
    if not missing:
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise BuildError(f"the stand-in image build needs {' and '.join(missing)}",
                         f"install them (Debian/Ubuntu: apt-get install -y {' '.join(missing)})")
    log(f"installing {' '.join(missing)} with apt-get (the stand-in build needs them)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for argv in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", *missing]):
        log("  $ " + " ".join(argv))
        subprocess.run(argv, check=True, env=env, stdout=subprocess.DEVNULL)


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
        _run(["debootstrap", "--variant=minbase", f"--include={','.join(STANDIN_PACKAGES)}",
              STANDIN_SUITE, str(root), DEBIAN_MIRROR], log=log, capture=True)
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
            shutil.rmtree(root / junk, ignore_errors=True)
        partial = Path(tmp) / "rootfs.tar"
        _run(["tar", "-C", str(root), "-cf", str(partial), "."], log=log)
        os.replace(partial, tarball)  # complete or absent
    log(f"made {tarball.name} in {time.monotonic() - started:.0f} s")
    return tarball


def _uv_wheel(cache: Path, log=print) -> Path:
    folder = cache / "images" / "uv"
    pattern = f"uv-{STANDIN_UV.partition('==')[2]}-*.whl"
    if not list(folder.glob(pattern)):
        _run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:",
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
    existing = _inspect(builder, name)
    if existing and image_config(builder, name)["Labels"].get("io.kvwarm.standin-key") == key:
        log(f"{name} is up to date")
        return name
    started = time.monotonic()
    ctr = _run([*builder.command, "from", "scratch"], log=log, capture=True).strip()
    try:
        mount = Path(_run([*builder.command, "mount", ctr], log=log, capture=True).strip())
        _run(["tar", "-C", str(mount), "-xf", str(rootfs)], log=log)
        site = mount / "usr" / "local" / "lib" / f"python{STANDIN_PYTHON}" / "dist-packages"
        site.mkdir(parents=True, exist_ok=True)
        _run(["cp", "-a", f"{deps_site}/.", str(site)], log=log)
        wheels = mount / "tmp" / "kvwarm-wheels"
        wheels.mkdir(parents=True)
        for wheel in (stock, uv):
            shutil.copy(wheel, wheels)
        # The release's vllm like the official image's: pip-installed into the system Python.
        _run([*builder.command, "run", "--isolation", "chroot", ctr, "--", "python3", "-m", "pip", "install",
              "-q", "--no-index", "--no-deps", "--break-system-packages", f"/tmp/kvwarm-wheels/{stock.name}",
              f"/tmp/kvwarm-wheels/{uv.name}"], log=log)
        shutil.rmtree(wheels)
        _run([*builder.command, "config", "--entrypoint", '["vllm", "serve"]',
              "--workingdir", "/vllm-workspace", "--env", "VLLM_USAGE_SOURCE=production-docker-image",
              "--label", f"io.kvwarm.standin-key={key}", ctr], log=log)
        if existing:
            _run([*builder.command, "rmi", "-f", name], log=log)
        _run([*builder.command, "commit", "-q", "--rm", ctr, name], log=log)
    except BaseException:
        subprocess.run([*builder.command, "rm", ctr], capture_output=True)
        raise
    log(f"made {name} in {time.monotonic() - started:.0f} s")
    return name


def run_inside(builder: Builder, image: str, commands: list[list[str]], env: dict[str, str], log=print) -> None:
    """Run commands in a working container of `image` (the built image's own filesystem)."""
    ctr = _run([*builder.command, "from", image], log=log, capture=True).strip()
    try:
        for argv in commands:
            flags = [f for key, value in env.items() for f in ("--env", f"{key}={value}")]
            _run([*builder.command, "run", "--isolation", "chroot", *flags, ctr, "--", *argv], log=log)
    finally:
        subprocess.run([*builder.command, "rm", ctr], capture_output=True)


def build_on_standin(release: Release, wheel: Path, record: dict, cache: Path, deps_site: Path,
                     keep: bool = False, log=print) -> None:
    """The real Dockerfile on a stand-in base, then from outside: the labels and the kept
    entrypoint (build_image), the validator and `python -m vllm.kvwarm info` inside."""
    started = time.monotonic()
    ensure_host_tools(log=log)
    builder = standin_builder(cache)
    base = ensure_standin(builder, release, cache, deps_site, log=log)
    tag, args = build_image(builder, release, wheel, record, base, tag=f"localhost/kvwarm-standin-built:{release.version}", log=log)
    try:
        check = ["python3", "-m", "vllm.kvwarm", "selfcheck", "--dist", args["VLLM_DIST"],
                 "--expect-version", release.patched_version, "--expect-series-digest", args["KVWARM_SERIES_DIGEST"]]
        # The cuda wheel on a CPU host: some releases read their target device from here.
        run_inside(builder, tag, [check, ["python3", "-m", "vllm.kvwarm", "info"]],
                   {"VLLM_TARGET_DEVICE": "cpu"}, log=log)
    finally:
        if not keep:
            subprocess.run([*builder.command, "rmi", "-f", tag], capture_output=True)
    log(f"stand-in image checks passed for {release.patched_version} in {time.monotonic() - started:.0f} s")
