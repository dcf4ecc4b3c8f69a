"""uv fills the venvs vLLM runs in here, from the indexes pip is configured with.

pip takes about three minutes on two cores to fill a deps venv: one core unzips and
byte-compiles every file. uv unpacks on every core and links what its cache already holds,
so venvs that share pins (the releases' deps venvs, the venvs layered on them) cost one
unpack per package. What is left is byte-compiling, which these venvs keep: every test
process imports torch and vLLM again, and a host that sets PYTHONDONTWRITEBYTECODE never
writes what an import compiles.

The indexes stay the user's: pip's index-url, extra-index-url, find-links, constraint and
cert, as `pip config list` gives them (its files and its PIP_* variables), with pip's rule
of taking the best version over every index (uv's `unsafe-best-match`: uv's own default
takes a package from the first index that lists it).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
from pathlib import Path

from ..errors import BuildError
from ..fetch import pip_config

# pip's precedence for one option: its variables, then [install], then [global].
_SECTIONS = (":env:", "install", "global")
# pip's options uv takes too: uv's option, the variable that sets it (for the uv runs this
# module does not start: nox's uv backend installing a session's packages), and what parts
# that variable's values.
_OPTIONS = {
    "index-url": ("--index-url", "UV_INDEX_URL", " "),
    "extra-index-url": ("--extra-index-url", "UV_EXTRA_INDEX_URL", " "),
    "find-links": ("--find-links", "UV_FIND_LINKS", ","),
    "constraint": ("--constraint", "UV_CONSTRAINT", " "),
}
# pip's rule: the best version over every index.
_STRATEGY = "unsafe-best-match"


def pip_setting(config: dict[str, str], name: str) -> list[str]:
    """The values pip would use for option `name` (whitespace-separated, as pip reads them)."""
    for section in _SECTIONS:
        value = config.get(f"{section}.{name}")
        if value:
            return str(value).split()
    return []


def _settings(config: dict[str, str]) -> dict[str, list[str]]:
    """pip's values of each of _OPTIONS that `config` sets (one index-url, as pip takes)."""
    found = {name: pip_setting(config, name) for name in _OPTIONS}
    found["index-url"] = found["index-url"][:1]
    return {name: values for name, values in found.items() if values}


def index_options(config: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """uv's arguments and environment for pip's configuration `config`."""
    args = [arg for name, values in _settings(config).items() for value in values for arg in (_OPTIONS[name][0], value)]
    cert = pip_setting(config, "cert")
    env = {"SSL_CERT_FILE": cert[0]} if cert and not os.environ.get("SSL_CERT_FILE") else {}
    return [*args, "--index-strategy", _STRATEGY], env


def uv_environment(config: dict[str, str]) -> dict[str, str]:
    """uv's variables for pip's configuration `config`, pip's best-match rule and its cert."""
    env = {"UV_INDEX_STRATEGY": _STRATEGY}
    for name, values in _settings(config).items():
        _, variable, separator = _OPTIONS[name]
        env[variable] = separator.join(values)
    cert = pip_setting(config, "cert")
    if cert:
        env["SSL_CERT_FILE"] = cert[0]
    return env


@functools.cache
def _configured() -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    args, env = index_options(pip_config())
    return tuple(args), tuple(env.items())


def uv_cache(venv: Path) -> Path:
    """UV_CACHE_DIR if set, else a folder beside the venv: uv hard-links from its cache, which
    needs one file system."""
    return Path(os.environ["UV_CACHE_DIR"]) if os.environ.get("UV_CACHE_DIR") else venv.parent / ".uv-cache"


def _uv_pip(
    python: Path, command: str, *args: str, indexes: bool = False, cache: Path | None = None
) -> subprocess.CompletedProcess:
    from uv import find_uv_bin  # here: nox imports this module where uv may not be installed

    index_args, index_env = _configured() if indexes else ((), ())
    env = {**os.environ, **dict(index_env), "UV_CACHE_DIR": str(cache or uv_cache(python.parents[1]))}
    cmd = [find_uv_bin(), "pip", command, "--python", str(python), *index_args, *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)


# What uv prints when the disk filled (errno 28): then the fix is space, not the index.
_DISK_FULL = ("No space left on device", "os error 28")


def failure_fix(output: str, fix: str, venv: Path) -> str:
    """The fix to print for a failed uv run: `fix`, or where space is short and how much."""
    if not any(mark in output for mark in _DISK_FULL):
        return fix
    existing = next(path for path in (venv, *venv.parents) if path.exists())
    free = shutil.disk_usage(existing).free / 2**30
    return (
        f"free disk space ({free:.1f} GiB free at {venv} now; docs/sessions.md gives what a CI "
        "run needs), or point KVWARM_CACHE_DIR and TMPDIR at a larger disk"
    )


def _checked(result: subprocess.CompletedProcess, what: str, fix: str, venv: Path) -> str:
    if result.returncode != 0:
        output = result.stdout + result.stderr
        tail = "\n".join(output.splitlines()[-20:])
        raise BuildError(f"uv pip {what} failed:\n{tail}", failure_fix(output, fix, venv))
    return result.stdout


def install(
    python: Path,
    *args: str,
    compile_bytecode: bool = True,
    local: bool = False,
    cache: Path | None = None,
    log=print,
) -> None:
    """`uv pip install ARGS` into python's venv, byte-compiled unless told not to (a venv
    imported once). local: local wheel files only, so no index is asked and nothing is kept
    in uv's cache: copied in, as pip does (a throwaway venv). cache: uv's cache to link
    from, instead of uv_cache's."""
    log("  $ uv pip install " + " ".join(args))
    options = [
        *(["--compile-bytecode"] if compile_bytecode else []),
        *(["--no-index", "--no-cache", "--link-mode", "copy"] if local else []),
    ]
    result = _uv_pip(python, "install", "-q", *options, *args, indexes=not local, cache=cache)
    _checked(
        result,
        f"install {' '.join(args)}",
        "check network access to the package index (`pip config list` shows which) and retry",
        python.parents[1],
    )


def uninstall(python: Path, *names: str) -> None:
    if names:
        _checked(
            _uv_pip(python, "uninstall", "-q", *names),
            f"uninstall {' '.join(names)}",
            f"remove {python.parents[1]}",
            python.parents[1],
        )


def installed(python: Path) -> list[str]:
    """The names of the distributions in python's venv."""
    venv = python.parents[1]
    listing = _checked(_uv_pip(python, "list", "--format", "json"), "list", f"remove {venv}", venv)
    return [d["name"] for d in json.loads(listing)]
