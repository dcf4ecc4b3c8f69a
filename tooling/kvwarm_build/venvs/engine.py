"""The dependency venv the real CPU engine runs on, one per release.

The cpu flavour's kernels are ABI-locked to the torch its wheel pins. That torch is what the
venv gets (deps.cpu_torch); where no index we reach has it, releases.toml names a
`torch_fallback` that loads the same kernels (a CUDA build of the same version runs on CPU).
Everything else is the cpu wheel's own Requires-Dist less GPU-only packages. vLLM itself is
not in here: engine sessions layer this venv under their own (see deps.layer_on_deps) and
install the patched wheel `--no-deps`.
"""

from __future__ import annotations

from pathlib import Path

from ..digests import cache_key
from ..fetch import fetch
from ..releases import Release
from .deps import TORCH_FAMILY, cpu_torch, ensure_layered_venv, ensure_venv, wheel_requirements
from .installer import install, uninstall


def engine_venv_path(release: Release, cache: Path, torch: str, requirements: list[str]) -> Path:
    return cache / "venvs" / f"engine-deps-{release.version}-{cache_key(torch, requirements, release.test_pins)}"


def ensure_engine_deps(release: Release, cache: Path, log=print) -> Path:
    """Site-packages of the release's engine dependency venv, made on first use
    (minutes, and a few GB for a CUDA torch)."""
    flavour = release.flavour("cpu")
    wheel = fetch(flavour.wheel, cache / "downloads", log=log)
    requirements = wheel_requirements(wheel)
    torch = cpu_torch(flavour, log=log)
    torch_pin = f"torch=={torch}"

    def fill(python: Path) -> None:
        # Keep that torch (and the release's test pins) whatever the requirements pull in.
        constraints = python.parents[1] / "kvwarm-constraints.txt"
        constraints.write_text("\n".join([torch_pin, *release.test_pins]) + "\n")
        install(python, "-c", str(constraints), torch_pin, *requirements, log=log)
        uninstall(python, *sorted(TORCH_FAMILY - {"torch"}))  # uv skips what is not there

    return ensure_venv(
        engine_venv_path(release, cache, torch, requirements),
        fill,
        f"the CPU engine venv for vLLM {release.version} ({torch_pin})",
        log=log,
    )


def stock_engine_venv(release: Release, cache: Path, log=print) -> Path:
    """Python of a venv with the official cpu-flavour wheel on the engine dependency venv:
    the reference a patched build's engine output is compared with."""
    wheel = fetch(release.flavour("cpu").wheel, cache / "downloads", log=log)
    return ensure_layered_venv(
        cache / "venvs" / f"stock-engine-{release.version}",
        ensure_engine_deps(release, cache, log=log),
        [["--no-deps", str(wheel)]],
        log=log,
    )
