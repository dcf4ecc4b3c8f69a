"""A shared venv with what vLLM imports on CPU, and venvs layered on top of it.

Installing torch and vLLM's pure-Python dependencies takes minutes and gigabytes, so it
happens once per cache in a "deps" venv without vLLM. Every venv that needs vLLM (the
validator's throwaway venv, unit and upstream-test venvs) gets a .pth line pointing at the
deps venv and installs only a vLLM wheel itself (`--no-deps`).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

from .errors import BuildError

# CPU torch (pip's configured find-links has it) and what `import vllm` and the v1 core
# scheduler classes pull in; see docs/maintaining.md for where each comes from.
TORCH = ["torch==2.13.0"]
DEPS = [
    "numpy", "packaging", "regex", "psutil", "pyzmq", "urllib3", "msgspec", "pydantic",
    "cbor2", "transformers>=5.5.3", "aiohttp", "requests", "openai-harmony", "openai>=2.0.0",
    "pillow", "pybase64", "cachetools", "cloudpickle", "uvloop", "py-cpuinfo",
    "prometheus_client", "llguidance>=1.7.0,<1.8.0", "einops", "tokenizers", "sentencepiece",
]
# Their own pins would drag in triton and a CUDA torch; vLLM needs neither on CPU.
NO_DEPS = ["xgrammar>=0.2.1,<1.0.0", "apache-tvm-ffi"]
_COMPLETE = ".kvwarm-complete"


def deps_key() -> str:
    return hashlib.sha256(repr((TORCH, DEPS, NO_DEPS, sys.version_info[:2])).encode()).hexdigest()[:12]


def pip_install(python: Path, *args: str, log=print) -> None:
    cmd = [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q", *args]
    log("  $ pip install " + " ".join(args))
    result = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if result.returncode != 0:
        tail = "\n".join(result.stdout.splitlines()[-20:])
        raise BuildError(f"pip install {' '.join(args)} failed:\n{tail}", "check network access to PyPI and retry")


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def site_packages(python: Path) -> Path:
    out = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    )
    return Path(out.stdout.strip())


def ensure_venv(venv: Path, install, what: str, log=print) -> Path:
    """`venv`'s site-packages, made on first use by install(python); the marker is written
    last, so a half-made venv is removed and made again."""
    if (venv / _COMPLETE).exists():
        return site_packages(venv_python(venv))
    if venv.exists():
        log(f"removing incomplete {venv}")
        shutil.rmtree(venv)
    log(f"creating {what} {venv} (once per cache; a few minutes)")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv_python(venv)
    install(python)
    (venv / _COMPLETE).write_text(venv.name + "\n")
    return site_packages(python)


def ensure_deps_venv(cache: Path, log=print) -> Path:
    """The deps venv's site-packages, created on first use."""
    def install(python: Path) -> None:
        pip_install(python, *TORCH, log=log)
        pip_install(python, *DEPS, log=log)
        pip_install(python, "--no-deps", *NO_DEPS, log=log)

    return ensure_venv(cache / "venvs" / f"vllm-deps-{deps_key()}", install,
                       "the shared vLLM dependency venv", log=log)


def layer_on_deps(python: Path, deps_site: Path) -> None:
    """Make `python`'s venv see the deps venv's packages (after its own)."""
    (site_packages(python) / "_kvwarm_deps.pth").write_text(f"{deps_site}\n")


def current_python() -> Path:
    return Path(sys.executable)


def ensure_layered_venv(venv: Path, deps_site: Path, installs: list[list[str]], log=print) -> Path:
    """A venv on top of the deps venv with `installs` (pip argument lists) done in order.

    Recreated whenever what it should hold changes; the marker is written last, so a
    half-made venv is made again.
    """
    python = venv_python(venv)
    marker = venv / _COMPLETE
    wanted = json.dumps([str(deps_site), installs])
    if marker.exists() and marker.read_text() == wanted:
        return python
    log(f"creating {venv}")
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    layer_on_deps(python, deps_site)
    for args in installs:
        pip_install(python, *args, log=log)
    marker.write_text(wanted)
    return python

