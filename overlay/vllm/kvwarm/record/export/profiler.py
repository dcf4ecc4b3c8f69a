"""A sweep as the Dynamo pre-deployment profiler's interpolation tables, the planner's
fallback when no worker serves its self-benchmark:

  selected_prefill_interpolation/raw_data.npz  prefill_isl, prefill_ttft (ms), prefill_thpt_per_gpu
  selected_decode_interpolation/raw_data.npz   x_kv_usage, y_context_length, z_itl (ms),
                                               z_thpt_per_gpu, max_kv_tokens ([N])
  prefill_raw_data.json, decode_raw_data.json  the same as JSON (max_kv_tokens a number)

The TTFT table is the prefill rows of one request with no prefix (B = 1, P = 0: the
profiler's ISL sweep); the ITL surface is every decode row. Under data parallel a point's
time is its slowest rank's median (the group steps together); B is per rank.

Plain data: numpy only (imported when the files are written).
"""

from __future__ import annotations

import io
import json
from pathlib import Path

from .. import vocabulary as v
from ..files import write_atomically
from .dynamo_engine import resolved_args
from .dynamo_rows import median, points_over_ranks
from .input import ExportError

PREFILL_DIR = "selected_prefill_interpolation"
DECODE_DIR = "selected_decode_interpolation"
NPZ = "raw_data.npz"
PREFILL_JSON = "prefill_raw_data.json"
DECODE_JSON = "decode_raw_data.json"


def _times_ms(sweep, kind: str) -> list[tuple[tuple, float]]:
    """(point key, the slowest rank's median in ms) per point measured on every rank."""
    everywhere, measured, _, _ = points_over_ranks(sweep, kind)
    return [(key, max(median(m[key]) for m in measured) * 1e3) for key in everywhere]


def _gpus(artifact: dict) -> int:
    """The GPUs one rank's engine spans."""
    layout = artifact.get("layout") or {}
    return int(layout.get("tensor_parallel_size") or 1) * int(layout.get("pipeline_parallel_size") or 1)


def pool_tokens(sweep) -> int | None:
    """The KV pool in tokens (the smallest rank's), where every rank's record has it."""
    pools = [resolved_args(a).get("kv_cache_tokens") for a in sweep.ranks]
    return min(pools) if pools and all(isinstance(p, int) and p > 0 for p in pools) else None


def tables(sweep, max_kv_tokens: int | None = None) -> tuple[dict | None, dict | None]:
    """The prefill and decode tables as lists (None where the sweep has no such rows)."""
    failed = [str(p) for p, a in zip(sweep.paths, sweep.ranks) if a.get("status") != v.COMPLETE]
    if failed:
        raise ExportError(
            f"{', '.join(failed)}: the sweep did not complete; the profiler's tables carry no "
            "validity flag, so only a complete sweep is exported to them (`--to dynamo` marks a "
            "failed sweep as such)"
        )
    gpus = _gpus(sweep.ranks[0])
    prefill = sorted((key[3], ms) for key, ms in _times_ms(sweep, v.PREFILL) if key[1] == 0 and key[2] == 1)
    prefill_table = None
    if prefill:
        prefill_table = {
            "prefill_isl": [float(n) for n, _ in prefill],
            "prefill_ttft": [ms for _, ms in prefill],
            "prefill_thpt_per_gpu": [n / ms * 1e3 / gpus for n, ms in prefill],
        }
    decode = sorted(_times_ms(sweep, v.DECODE), key=lambda e: (e[0][2], e[0][1]))
    decode_table = None
    if decode:
        pool = max_kv_tokens or pool_tokens(sweep)
        if not pool:
            raise ExportError(
                f"{sweep.paths[0]}: the artifact does not record the KV pool "
                "(config.engine_args.resolved.kv_cache_tokens; sweeps before it do not): pass "
                "--max-kv-tokens N, the engine's KV cache size in tokens"
            )
        decode_table = {
            "x_kv_usage": [key[1] / pool for key, _ in decode],
            "y_context_length": [key[1] / key[2] for key, _ in decode],
            "z_itl": [ms for _, ms in decode],
            "z_thpt_per_gpu": [key[2] / ms * 1e3 / gpus for key, ms in decode],
            "max_kv_tokens": int(pool),
        }
    if prefill_table is None and decode_table is None:
        raise ExportError(
            f"{sweep.root}: no decode row and no prefill row of one request without prefix "
            "(B = 1, P = 0) measured on every rank: nothing for the profiler's tables"
        )
    return prefill_table, decode_table


def _npz(arrays: dict) -> bytes:
    import numpy as np

    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def write_tables(sweep, out: Path, max_kv_tokens: int | None = None) -> list[Path]:
    import numpy as np

    prefill, decode = tables(sweep, max_kv_tokens)
    written = []
    if prefill is not None:
        (out / PREFILL_DIR).mkdir(parents=True, exist_ok=True)
        arrays = {key: np.asarray(values, dtype=np.float64) for key, values in prefill.items()}
        written += [out / PREFILL_DIR / NPZ, out / PREFILL_JSON]
        write_atomically(written[-2], _npz(arrays))
        write_atomically(written[-1], json.dumps(prefill, indent=2).encode())
    if decode is not None:
        (out / DECODE_DIR).mkdir(parents=True, exist_ok=True)
        arrays = {key: np.asarray(values, dtype=np.float64) for key, values in decode.items() if key != "max_kv_tokens"}
        arrays["max_kv_tokens"] = np.asarray([decode["max_kv_tokens"]], dtype=np.int64)
        written += [out / DECODE_DIR / NPZ, out / DECODE_JSON]
        write_atomically(written[-2], _npz(arrays))
        write_atomically(written[-1], json.dumps(decode, indent=2).encode())
    return written
