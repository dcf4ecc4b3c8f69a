"""The warm-up's environment variables (names as existing collectors use them).

Values are checked when read: an unknown value is a SettingsError that names the
variable, the value and what it accepts. DYN_BENCH_KV_WARMUP_STATE is not read here: it
only matters on layouts with state groups, where an invalid value becomes the gate's
`state_mode_invalid` (see state_mode).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

WARMUP_ENV = "DYN_BENCH_KV_WARMUP"
REPEATS_ENV = "DYN_BENCH_GIANT_KV_REPEATS"
THRESHOLD_ENV = "DYN_BENCH_GIANT_KV_THRESHOLD"
DATASET_ENV = "DYN_BENCH_KV_WARMUP_DATASET"
# on (default): Python's collector is held out of the timed steps (sweep.gc_hold); off: the
# sweep leaves it as the engine has it.
GC_ENV = "DYN_BENCH_KV_WARMUP_GC"
SWITCH_VALUES = {
    "on": True,
    "1": True,
    "true": True,
    "yes": True,
    "off": False,
    "0": False,
    "false": False,
    "no": False,
}

# on: real KV where the gate admits the model; off: every point on fake KV (A/B runs);
# force: real KV even where the gate's cost-saving heuristics would skip (dense models).
WARMUP_VALUES = {
    "on": "on",
    "1": "on",
    "true": "on",
    "yes": "on",
    "off": "off",
    "0": "off",
    "false": "off",
    "no": "off",
    "force": "force",
}


class SettingsError(ValueError):
    pass


@dataclass(frozen=True)
class Settings:
    warmup: str  # on | off | force
    steady_steps: int  # timed steady steps per point (the median is kept)
    giant_kv_threshold: int
    dataset: str | None
    gc_hold: bool = True


def _int(environ: Mapping[str, str], name: str, default: int, minimum: int) -> int:
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        raise SettingsError(f"{name}={raw!r} is not an integer (default {default})") from None
    if value < minimum:
        raise SettingsError(f"{name}={raw!r} is out of range: it must be an integer >= {minimum} (default {default})")
    return value


def read_settings(environ: Mapping[str, str] | None = None) -> Settings:
    environ = os.environ if environ is None else environ
    raw = environ.get(WARMUP_ENV, "on")
    warmup = WARMUP_VALUES.get(raw.strip().lower())
    if warmup is None:
        raise SettingsError(f"{WARMUP_ENV}={raw!r} is not one of on, off, force (or 1/0, true/false, yes/no)")
    return Settings(
        warmup=warmup,
        steady_steps=_int(environ, REPEATS_ENV, default=3, minimum=1),
        giant_kv_threshold=_int(environ, THRESHOLD_ENV, default=1_000_000, minimum=0),
        dataset=environ.get(DATASET_ENV) or None,
        gc_hold=_switch(environ, GC_ENV, default=True),
    )


def _switch(environ: Mapping[str, str], name: str, default: bool) -> bool:
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = SWITCH_VALUES.get(raw.strip().lower())
    if value is None:
        raise SettingsError(f"{name}={raw!r} is not one of on, off (or 1/0, true/false, yes/no)")
    return value
