"""The trace setting: where a served engine's step trace goes, and how large it may grow.

    --additional-config '{"kvwarm_trace": {"out": DIR, "max_file_mb": 64, "files": 8}}'

or, for a launcher that cannot pass additional_config, DYN_BENCH_TRACE_DIR=DIR (with
DYN_BENCH_TRACE_MAX_FILE_MB, DYN_BENCH_TRACE_FILES and DYN_BENCH_TRACE_MAX_PENDING_MB). Where both are given the
additional_config wins. A value that is not what it must be is a TraceSettingsError naming
it, what it got and the fix: the engine does not start on a setting it cannot honour.

Bounds: each file is closed at `max_file_mb` and rotated (docs/validate-reference.md#the-trace); at
most `files` files per rank are kept, the oldest removed, so a rank's trace never holds
more than about max_file_mb x files. `max_pending_mb` bounds what waits in the engine's
process for the writer process (served.writer): a writer that falls that far behind has
steps dropped until it catches up, and the gap recorded.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

CONFIG_KEY = "kvwarm_trace"
DIR_ENV = "DYN_BENCH_TRACE_DIR"
MAX_FILE_MB_ENV = "DYN_BENCH_TRACE_MAX_FILE_MB"
FILES_ENV = "DYN_BENCH_TRACE_FILES"
MAX_PENDING_MB_ENV = "DYN_BENCH_TRACE_MAX_PENDING_MB"
DEFAULT_MAX_FILE_MB = 64
DEFAULT_FILES = 8
DEFAULT_MAX_PENDING_MB = 32  # about 30,000 steps of 32 requests waiting for the writer process
KEYS = ("out", "max_file_mb", "files", "max_pending_mb")
MIN_BYTES = 4096  # the least a file or the bound may be (one page)


class TraceSettingsError(ValueError):
    pass


@dataclass(frozen=True)
class TraceSettings:
    out: Path
    max_file_bytes: int = DEFAULT_MAX_FILE_MB << 20
    files: int = DEFAULT_FILES  # per rank and launch, the current one included
    max_pending_bytes: int = DEFAULT_MAX_PENDING_MB << 20  # waiting in the engine's process


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _positive(value, what: str, fix: str, whole: bool) -> float:
    kinds = (int,) if whole else (int, float)
    if isinstance(value, str):
        try:
            value = int(value) if whole else float(value)
        except ValueError:
            # "8.5" for a count is a number, just not a whole one: say which
            kind = "not a whole number" if whole and _is_number(value) else "not a number"
            raise TraceSettingsError(f"{what}={value!r} is {kind}; {fix}") from None
    if isinstance(value, bool) or not isinstance(value, kinds) or not value > 0:
        raise TraceSettingsError(f"{what}={value!r} must be a positive {'integer' if whole else 'number'}; {fix}")
    return value


def trace_settings(additional_config, environ: Mapping[str, str] | None = None) -> TraceSettings | None:
    """The engine's trace setting (None: no trace), from its additional_config or the
    environment."""
    environ = os.environ if environ is None else environ
    spec = additional_config.get(CONFIG_KEY) if isinstance(additional_config, dict) else None
    where = f'additional_config["{CONFIG_KEY}"]'
    if spec is None:
        if not environ.get(DIR_ENV):
            return None
        spec = {"out": environ[DIR_ENV]}
        spec.update({"max_file_mb": environ[MAX_FILE_MB_ENV]} if environ.get(MAX_FILE_MB_ENV) else {})
        spec.update({"files": environ[FILES_ENV]} if environ.get(FILES_ENV) else {})
        spec.update({"max_pending_mb": environ[MAX_PENDING_MB_ENV]} if environ.get(MAX_PENDING_MB_ENV) else {})
        where = DIR_ENV
    example = (
        '{"out": DIR} (and optionally "max_file_mb": MB per file, "files": files kept per rank, '
        '"max_pending_mb": MB of steps that may wait for the writer process)'
    )
    if not isinstance(spec, dict) or not isinstance(spec.get("out"), str) or not spec["out"]:
        raise TraceSettingsError(f"{where} must be {example}, got {spec!r}")
    unknown = sorted(set(spec) - set(KEYS))
    if unknown:
        raise TraceSettingsError(f"{where} has unknown key(s) {', '.join(unknown)}; it takes {example}")
    size = _positive(
        spec.get("max_file_mb", DEFAULT_MAX_FILE_MB),
        f"{where}.max_file_mb" if where != DIR_ENV else MAX_FILE_MB_ENV,
        f"give the size in MiB at which a trace file is rotated (default {DEFAULT_MAX_FILE_MB})",
        whole=False,
    )
    files = _positive(
        spec.get("files", DEFAULT_FILES),
        f"{where}.files" if where != DIR_ENV else FILES_ENV,
        f"give how many files per rank to keep, the current one included (default {DEFAULT_FILES})",
        whole=True,
    )
    pending = _positive(
        spec.get("max_pending_mb", DEFAULT_MAX_PENDING_MB),
        f"{where}.max_pending_mb" if where != DIR_ENV else MAX_PENDING_MB_ENV,
        f"give the MiB of steps that may wait for the trace's writer process (default {DEFAULT_MAX_PENDING_MB})",
        whole=False,
    )
    return TraceSettings(
        Path(spec["out"]).expanduser(),
        max(MIN_BYTES, int(size * (1 << 20))),
        int(files),
        max(MIN_BYTES, int(pending * (1 << 20))),
    )
