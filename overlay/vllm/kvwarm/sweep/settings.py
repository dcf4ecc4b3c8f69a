"""The warm-up's environment variables (names as existing collectors use them).

Values are checked when read: an unknown value is a SettingsError that names the
variable, the value and what it accepts. The DYN_BENCH_KV_WARMUP_RANK_* variables say how
data-parallel ranks meet (sweep.exchange). DYN_BENCH_KV_WARMUP_STATE is not read here: it
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
# Untimed steps of a point's own shape before its timed ones (decode steps, prefill and mixed
# shots), beyond the one warm step every point has: a host whose cores run slower for a while
# after the engine pauses between points needs them for rows of the steady state served
# steps run in (docs/sweep.md#settle-steps).
SETTLE_ENV = "DYN_BENCH_KV_WARMUP_SETTLE_STEPS"
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
# How data-parallel ranks meet (docs/ranks.md): "store", torch's TCPStore hosted by rank 0 at
# vLLM's DP master address; "files", small files in a shared OUT (for sites that cannot open a port).
RANK_SYNC_ENV = "DYN_BENCH_KV_WARMUP_RANK_SYNC"
RANK_SYNC_VALUES = ("store", "files")
# The store's port, the same on every rank (default: derived from vLLM's DP master port).
RANK_SYNC_PORT_ENV = "DYN_BENCH_KV_WARMUP_RANK_SYNC_PORT"
# Seconds a rank waits for the others at one boundary before it gives up.
RANK_TIMEOUT_ENV = "DYN_BENCH_KV_WARMUP_RANK_TIMEOUT"
DEFAULT_RANK_TIMEOUT = 300
# Seconds a rank waits for the others to start: to reach the store, and at the first boundary
# (engines of one launch start seconds or minutes apart); default: the rank timeout.
RANK_START_TIMEOUT_ENV = "DYN_BENCH_KV_WARMUP_RANK_START_TIMEOUT"

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
    rank_sync: str = "store"  # store | files
    rank_sync_port: int | None = None  # None: derived from the DP master port
    rank_timeout: int = DEFAULT_RANK_TIMEOUT
    rank_start_timeout: int | None = None  # None: the rank timeout
    settle_steps: int = 0  # untimed steps of each point's shape before its timed ones

    @property
    def point_steps(self) -> int:
        """The steps of a point's shape after its warm one: settling, then timed."""
        return self.settle_steps + self.steady_steps

    @property
    def start_timeout(self) -> int:
        return self.rank_timeout if self.rank_start_timeout is None else self.rank_start_timeout


def _int(
    environ: Mapping[str, str], name: str, default: int | None, minimum: int, says: str | None = None
) -> int | None:
    """`says`: the default in words, where it is not a number."""
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    says = says or str(default)
    try:
        value = int(raw.strip())
    except ValueError:
        raise SettingsError(f"{name}={raw!r} is not an integer (default {says})") from None
    if value < minimum:
        raise SettingsError(f"{name}={raw!r} is out of range: it must be an integer >= {minimum} (default {says})")
    return value


def _port(environ: Mapping[str, str]) -> int | None:
    raw = environ.get(RANK_SYNC_PORT_ENV)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw.strip())
    except ValueError:
        raise SettingsError(f"{RANK_SYNC_PORT_ENV}={raw!r} is not a TCP port number (1 to 65535)") from None
    if not 1 <= value <= 65535:
        raise SettingsError(f"{RANK_SYNC_PORT_ENV}={raw!r} is out of range: a TCP port is 1 to 65535")
    return value


def read_settings(environ: Mapping[str, str] | None = None) -> Settings:
    environ = os.environ if environ is None else environ
    raw = environ.get(WARMUP_ENV, "on")
    warmup = WARMUP_VALUES.get(raw.strip().lower())
    if warmup is None:
        raise SettingsError(f"{WARMUP_ENV}={raw!r} is not one of on, off, force (or 1/0, true/false, yes/no)")
    raw = environ.get(RANK_SYNC_ENV, "")
    rank_sync = raw.strip().lower() or RANK_SYNC_VALUES[0]
    if rank_sync not in RANK_SYNC_VALUES:
        raise SettingsError(
            f"{RANK_SYNC_ENV}={raw!r} is not one of {', '.join(RANK_SYNC_VALUES)} (default {RANK_SYNC_VALUES[0]})"
        )
    return Settings(
        warmup=warmup,
        steady_steps=_int(environ, REPEATS_ENV, default=3, minimum=1),
        settle_steps=_int(environ, SETTLE_ENV, default=0, minimum=0),
        giant_kv_threshold=_int(environ, THRESHOLD_ENV, default=1_000_000, minimum=0),
        dataset=environ.get(DATASET_ENV) or None,
        gc_hold=_switch(environ, GC_ENV, default=True),
        rank_sync=rank_sync,
        rank_sync_port=_port(environ),
        rank_timeout=_int(environ, RANK_TIMEOUT_ENV, default=DEFAULT_RANK_TIMEOUT, minimum=1),
        rank_start_timeout=_int(environ, RANK_START_TIMEOUT_ENV, None, 1, f"{RANK_TIMEOUT_ENV}'s value"),
    )


def _switch(environ: Mapping[str, str], name: str, default: bool) -> bool:
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = SWITCH_VALUES.get(raw.strip().lower())
    if value is None:
        raise SettingsError(f"{name}={raw!r} is not one of on, off (or 1/0, true/false, yes/no)")
    return value
