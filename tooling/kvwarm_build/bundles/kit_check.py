"""The kit's acceptance on a CPU host: a fresh venv of the kit's Python holding only the
host's package set (the kit file's freeze, installed --no-deps, exactly those versions),
the kit installed into it offline by its own installer, the selfcheck, then the kit file's
imports (vLLM's engine, the scheduler adapter, the OpenAI server, the serving benchmark).

The venv is cached per freeze file and Python (a minute from uv's cache, several GB for
torch's CUDA libraries); host packages the kit file's [check] skip_host names (GBs that
vLLM never imports: JAX, CuPy, ...) stay out of it. A package the kit's paths import that
is neither the host's nor the kit's shows here as a failed import.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from packaging.utils import canonicalize_name

from ..digests import cache_key
from ..errors import BuildError
from ..venvs.deps import ensure_venv, venv_python
from ..venvs.installer import install
from .kit import MANIFEST, part_folder
from .kit_spec import KitSpec
from .resolve import read_have


def find_python(spec: KitSpec, given: str | None) -> str:
    """The real interpreter (not a shim) of the kit's Python version here."""
    wanted = given or f"python{spec.python_version}"
    found = shutil.which(wanted)
    probe = "import sys; print(sys.executable); print('%d.%d' % sys.version_info[:2])"
    done = subprocess.run([found, "-c", probe], capture_output=True, text=True, check=False) if found else None
    lines = done.stdout.split() if done is not None and done.returncode == 0 else []
    if len(lines) != 2 or lines[1] != spec.python_version:
        raise BuildError(
            f"no working {wanted} here (found {found or 'none'}): the kit's host runs Python {spec.python_version}",
            f"install it (`pyenv install {spec.python_version}`, and with pyenv's shims set PYENV_VERSION "
            "to include it), or pass --python",
        )
    return lines[0]


def host_pins(spec: KitSpec) -> list[str]:
    """The freeze file's pins without the check's skips; local labels dropped (torch's
    +cu130 is PyPI's plain 2.11.0)."""
    have = read_have(spec.have)
    return [f"{name}=={version.public}" for name, version in sorted(have.items()) if name not in spec.check_skip]


def host_venv(spec: KitSpec, cache: Path, python: str, log=print) -> Path:
    """The python of a cached venv holding the host's package set, made on first use."""
    pins = host_pins(spec)

    def fill(venv_python_path: Path) -> None:
        listing = venv_python_path.parents[1] / "host-freeze.txt"
        listing.write_text("\n".join(pins) + "\n")
        install(venv_python_path, "--no-deps", "-r", str(listing), log=log)

    venv = cache / "venvs" / f"kit-host-{cache_key(pins, python)}"
    ensure_venv(venv, fill, f"the host's package set ({len(pins)} packages, {spec.have.name})", log=log, python=python)
    return venv_python(venv)


def kit_manifest(kit: Path) -> dict:
    path = kit / part_folder(1) / MANIFEST
    if not path.is_file():
        raise BuildError(
            f"{kit} holds no kit ({path} is missing)",
            "make it first: nox -s kit-S, S the kit file's release (or kvwarm-build kit)",
        )
    return json.loads(path.read_text())


def check_kit(spec: KitSpec, kit: Path, cache: Path, python: str | None = None, log=print) -> None:
    """Install the kit offline into a fresh folder on the host's package set, selfcheck,
    import the kit file's modules; a BuildError names what failed."""
    manifest = kit_manifest(kit)
    host = host_venv(spec, cache, find_python(spec, python), log=log)
    with tempfile.TemporaryDirectory(prefix="kvwarm-kit-check-") as tmp:
        site = Path(tmp) / "site"
        # No index, no proxy: the installer must need nothing but the parts.
        offline = {
            **os.environ,
            "PIP_NO_INDEX": "1",
            "HTTPS_PROXY": "http://127.0.0.1:9",
            "HTTP_PROXY": "http://127.0.0.1:9",
        }
        cmd = [str(host), str(kit / part_folder(1) / "install.py"), "--target", str(site), "--work", tmp]
        wheels, parts = len(manifest["wheels"]), len(manifest["parts"])
        log(f"installing {wheels} wheel(s) from {parts} part(s) offline: {' '.join(cmd)}")
        if subprocess.run(cmd, env=offline, check=False).returncode != 0:
            raise BuildError(
                f"the kit in {kit} did not install on the host's package set", "see the installer's output above"
            )
        env = {**offline, **manifest["settings"]["env"], "PYTHONPATH": str(site)}
        # One process imports them all (vLLM's import is most of the time), each one tried.
        probe = (
            "import importlib, sys\n"
            "for name in sys.argv[1:]:\n"
            "    try:\n"
            "        importlib.import_module(name)\n"
            "        print('ok', name, flush=True)\n"
            "    except Exception as err:\n"
            "        why = str(err).splitlines()[0] if str(err) else ''\n"
            "        print('FAILED', name, type(err).__name__, why, flush=True)\n"
        )
        done = subprocess.run(
            [str(host), "-c", probe, *spec.check_imports], env=env, cwd=tmp, capture_output=True, text=True, check=False
        )
        verdicts = [line for line in done.stdout.splitlines() if line.startswith(("ok ", "FAILED "))]
        for line in verdicts:
            log(f"import {line}")
        failed = [line.removeprefix("FAILED ") for line in verdicts if line.startswith("FAILED ")]
        if len(verdicts) != len(spec.check_imports):
            failed.append(f"the import check ended early (exit {done.returncode}): {done.stderr.strip()[-500:]}")
        if failed:
            raise BuildError(
                "on the host's package set with the kit, these imports fail:\n  " + "\n  ".join(failed),
                "carry what they need (the kit file's [carry]) or fix the host's freeze file",
            )
    carried = ", ".join(sorted(canonicalize_name(w["name"]) for w in manifest["wheels"]))
    imports = len(spec.check_imports)
    log(f"kit {kit}: installed offline on the host's package set; selfcheck and {imports} imports ok ({carried})")
