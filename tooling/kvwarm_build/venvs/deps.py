"""The venvs vLLM runs in here: a deps venv per set of pins, and venvs layered on top of it.

Installing torch and vLLM's dependencies takes minutes and gigabytes, so it happens once per
cache and set of pins in a "deps" venv without vLLM. Its requirements are the release wheel's
own `Requires-Dist` less what only serves a GPU (GPU_ONLY), with the torch the release pins
(cpu_torch) and the release's test pins as constraints: a release that imports something
new needs no edit here. Every venv that needs vLLM (the validator's throwaway venv, unit and
upstream-test venvs) gets a .pth line pointing at the deps venv and installs only a vLLM
wheel itself (`--no-deps`). uv does the installing (installer.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import importlib.metadata
import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from ..digests import cache_key
from ..errors import BuildError
from ..fetch import sha256_of
from .installer import install, installed, uninstall

# What a release wheel requires that only serves a GPU or that the index has only as a CUDA
# build (kernels, NVIDIA libraries). The venvs here run vLLM's Python on CPU without them;
# torch itself is installed on its own (cpu_torch), the rest of its family is left out
# (PyPI's builds break `import vllm` beside a CPU torch: transformers fails on torchvision::nms).
TORCH_FAMILY = frozenset({"torch", "torchvision", "torchaudio", "torchcodec"})
GPU_ONLY = TORCH_FAMILY | {
    "pynvvideocodec",
    "tilelang",
    "nvtx",
    "fastsafetensors",
    "instanttensor",
    "quack-kernels",
    "tokenspeed-mla",
    "humming-kernels",
    "triton",
    "xformers",
}
GPU_ONLY_PREFIXES = ("nvidia-", "flashinfer-", "cupy-")
_COMPLETE = ".kvwarm-complete"


def gpu_only(name: str) -> bool:
    name = canonicalize_name(name)
    return name in GPU_ONLY or name.startswith(GPU_ONLY_PREFIXES)


def wheel_requirements(wheel: Path) -> list[str]:
    """The wheel's unconditional requirements for this host, GPU-only ones left out."""
    with zipfile.ZipFile(wheel) as zf:
        name = next((n for n in zf.namelist() if n.endswith(".dist-info/METADATA")), None)
        if name is None:
            raise BuildError(f"{wheel.name} has no METADATA", "delete it from the cache and build again")
        metadata = zf.read(name).decode()
    wanted = []
    for line in metadata.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.partition(":")[2].strip())
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if not gpu_only(req.name):
            req.marker = None
            wanted.append(str(req))
    return wanted


@functools.cache
def torch_versions() -> frozenset[str]:
    """Every torch version pip's configured indexes and find-links offer."""
    out = subprocess.run(
        [sys.executable, "-m", "pip", "index", "versions", "torch"], capture_output=True, text=True, check=False
    )
    found = re.search(r"^Available versions: (.*)$", out.stdout, re.MULTILINE)
    if out.returncode != 0 or not found:
        raise BuildError(
            f"cannot list torch versions on the package indexes: {out.stderr.strip()[-500:]}",
            "check network access to the index (pip config list shows which)",
        )
    return frozenset(v.strip() for v in found.group(1).split(","))


def cpu_torch(flavour, log=print, available=None) -> str:
    """The torch a venv for this flavour gets: the CPU build of the version it pins where an
    index has it, else the flavour's `torch_fallback` from releases.toml (said when used)."""
    wanted = flavour.torch if flavour.torch.endswith("+cpu") else f"{flavour.torch}+cpu"
    if wanted in (torch_versions() if available is None else available):
        return wanted
    if flavour.torch_fallback is None:
        raise BuildError(
            f"no index we reach has torch {wanted}, the CPU build of the torch {flavour.wheel.file} pins",
            "set torch_fallback for that flavour in releases.toml (a torch that runs its code on CPU)",
        )
    log(
        f"torch {wanted} is on no index we reach: using torch_fallback {flavour.torch_fallback} "
        f"from releases.toml ({flavour.wheel.file})"
    )
    return flavour.torch_fallback


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def site_packages(python: Path) -> Path:
    out = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    )
    return Path(out.stdout.strip())


@contextlib.contextmanager
def venv_lock(venv: Path, log=print):
    """Held while `venv` is made, so processes sharing a cache (KVWARM_CACHE_DIR) never make
    one venv at once: the second waits, then finds it made. An flock on VENV.lock beside it,
    released when its holder exits, however it exits; the file stays (removing it would
    race with a process about to lock it)."""
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.with_name(venv.name + ".lock"), "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"waiting for another process making {venv}")
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def install_wheel(python: Path, wheel: Path, cache: Path, log=print) -> None:
    """A built wheel into python's venv over whatever it holds: --no-deps (the dependencies
    come from a layered deps venv), byte-compiled. Its files are hard-linked from one unpack
    per wheel digest under `cache`/unpacked (uv's cache of that digest), so the venvs that
    hold one build (the unit tests', the upstream gate's, the engine sessions') share one
    copy on disk; a new build of the same name drops the old unpack (venvs on it keep their
    links)."""
    digest = sha256_of(wheel)[:16]
    unpacks = cache / "unpacked" / wheel.name
    with venv_lock(unpacks, log=log):
        for old in unpacks.glob("*"):
            if old.name != digest:
                shutil.rmtree(old, ignore_errors=True)
        install(python, "--no-deps", "--reinstall", str(wheel), cache=unpacks / digest, log=log)


def ensure_venv(venv: Path, fill, what: str, log=print, python: str = sys.executable) -> Path:
    """`venv`'s site-packages, made on first use (by `python`'s venv module) and filled by
    fill(venv's python) under venv_lock; the marker is written last, so a half-made venv
    is removed and made again."""
    marker = venv / _COMPLETE
    if not marker.exists():
        with venv_lock(venv, log=log):
            if not marker.exists():  # else another process made it while this one waited
                if venv.exists():
                    log(f"removing incomplete {venv}")
                    shutil.rmtree(venv)
                log(f"creating {what} {venv} (once per cache; a minute or two)")
                subprocess.run([python, "-m", "venv", "--without-pip", str(venv)], check=True)
                fill(venv_python(venv))
                marker.write_text(venv.name + "\n")
    return site_packages(venv_python(venv))


def deps_inputs(release, cache: Path, log=print) -> tuple[str, list[str], list[str]]:
    """(torch, requirements, constraints) of the release's deps venv, from its cuda wheel."""
    from ..fetch import fetch

    flavour = release.flavour("cuda")
    wheel = fetch(flavour.wheel, cache / "downloads", log=log)
    torch = cpu_torch(flavour, log=log)
    return torch, wheel_requirements(wheel), [f"torch=={torch}", *release.test_pins]


def deps_key(inputs) -> str:
    # "resolved": requirements installed with their dependencies, GPU-only ones removed after.
    return cache_key(inputs, "resolved")


def remove_gpu_only(python: Path, keep: str = "torch") -> None:
    """Uninstall what dependencies pulled in that only serves a GPU (xgrammar needs triton on
    x86_64 Linux), `keep` excepted."""
    uninstall(python, *sorted(n for n in installed(python) if gpu_only(n) and canonicalize_name(n) != keep))


def ensure_deps_venv(release, cache: Path, log=print) -> Path:
    """The release's deps venv's site-packages, created on first use (shared by every release
    with the same requirements and pins)."""
    inputs = torch, requirements, constraints = deps_inputs(release, cache, log=log)

    def fill(python: Path) -> None:
        pinned = python.parents[1] / "kvwarm-constraints.txt"
        pinned.write_text("\n".join(constraints) + "\n")
        # One resolution, so every requirement agrees with the release's own pins.
        install(python, "-c", str(pinned), f"torch=={torch}", *requirements, log=log)
        remove_gpu_only(python)

    return ensure_venv(
        cache / "venvs" / f"vllm-deps-{deps_key(inputs)}",
        fill,
        f"the vLLM dependency venv for {release.version}'s pins ({', '.join(constraints)})",
        log=log,
    )


def layer_on_deps(python: Path, deps_site: Path) -> None:
    """Make `python`'s venv see the deps venv's packages (after its own)."""
    (site_packages(python) / "_kvwarm_deps.pth").write_text(f"{deps_site}\n")


def current_python() -> Path:
    return Path(sys.executable)


def deps_constraints(deps_site: Path, args: list[str]) -> list[str]:
    """Pins of what the deps venv holds, for a layer's install `args` to resolve against:
    uv sees only the layer's own packages, so without them what it pulls in could differ
    from the deps venv's. What `args` names itself is left out (the layer's own choice),
    and a `--no-deps` install resolves nothing."""
    if "--no-deps" in args:
        return []
    named = set()
    for arg in args:
        with contextlib.suppress(ValueError):
            named.add(canonicalize_name(Requirement(arg).name))
    found = {
        canonicalize_name(d.metadata["Name"]): d.version
        for d in importlib.metadata.distributions(path=[str(deps_site)])
    }
    return [f"{name}=={version}" for name, version in sorted(found.items()) if name not in named]


def ensure_layered_venv(venv: Path, deps_site: Path, installs: list[list[str]], log=print) -> Path:
    """A venv on top of the deps venv with `installs` (uv pip install argument lists) done in
    order, each resolved against what the deps venv holds (deps_constraints).

    Recreated (under venv_lock) whenever what it should hold changes; the marker is written
    last, so a half-made venv is made again.
    """
    python = venv_python(venv)
    marker = venv / _COMPLETE
    wanted = json.dumps([str(deps_site), installs])

    def current() -> bool:
        return marker.exists() and marker.read_text() == wanted

    if not current():
        with venv_lock(venv, log=log):
            if not current():  # else another process made it while this one waited
                log(f"creating {venv}")
                subprocess.run([sys.executable, "-m", "venv", "--clear", "--without-pip", str(venv)], check=True)
                layer_on_deps(python, deps_site)
                for step, args in enumerate(installs):
                    pins = venv / f"kvwarm-deps-pins-{step}.txt"
                    pins.write_text("\n".join(deps_constraints(deps_site, args)) + "\n")
                    install(python, "-c", str(pins), *args, log=log)
                marker.write_text(wanted)
    return python
