"""What the tests of `python -m vllm.kvwarm export` share (test_export*.py): a sweep's rows
and artifacts written as the sweep writes them (its ArtifactWriter and the meta it fills;
rows with their graph record, phases, sample kind and split), one rank or every rank of a
data-parallel sweep, and the Dynamo files exported from them."""

from __future__ import annotations

import json
import statistics
from unittest import mock

from vllm.kvwarm.record import vocabulary as v
from vllm.kvwarm.record.artifact import PointRow
from vllm.kvwarm.record.combined import write_combined
from vllm.kvwarm.record.export import write as export
from vllm.kvwarm.record.export.input import load_sweep
from vllm.kvwarm.record.shape import GraphConfig, balanced
from vllm.kvwarm.sweep.gc_hold import GcHold
from vllm.kvwarm.sweep.provenance import RankLayout
from vllm.kvwarm.sweep.writer import ArtifactWriter

RESOLVED = {
    "block_sizes": {"0:FullAttentionSpec": 16},
    "max_num_seqs": 8,
    "max_num_batched_tokens": 512,
    "max_model_len": 1024,
    "dtype": "bfloat16",
    "kv_cache_dtype": "auto",
    "enable_prefix_caching": True,
    "enforce_eager": True,
    "cudagraph_mode": "CUDAGraphMode.NONE",
    "cudagraph_capture_sizes": [],
    "num_gpu_blocks": 500,
    "kv_cache_tokens": 8000,
}


# What a sweep on an eager engine records per row: the graph its shape expects (none) and the
# median of each phase over its samples (decode: whole windows; prefill: its shots' windows).
EAGER = {
    "expected_cudagraph_mode": "NONE",
    "expected_capture_size": None,
    "padding_tokens": 0,
    "reasons": [v.CUDAGRAPH_DISABLED],
    "observed_cudagraph_mode": None,
    "observed_size": None,
}


EAGER_ENGINE = GraphConfig.of("NONE", "NONE", "NONE", [], 8, 512)  # sweep.graphs' record of an eager engine


def _phases(median: float, forward: float) -> dict:
    return {"schedule": 0.0005, "forward": forward, "update": 0.0003, "sweep": 0.0001, "other": median * 0.01}


def decode_row(k: int, b: int, times=(0.010, 0.012, 0.011), stamps=None, graph=EAGER) -> PointRow:
    stamps = [v.STAMP_REAL_KV] if stamps is None else stamps
    median = statistics.median_high(times)
    return PointRow(
        k,
        b,
        v.REAL_KV,
        list(stamps),
        list(times),
        median,
        phases=_phases(median, median * 0.9),
        graph=None if graph is None else dict(graph),
        sample_kind=v.STEP,
    )


def prefill_row(n: int, p: int, b: int, times=(0.02, 0.03, 0.025), graph=EAGER) -> PointRow:
    """A prefill row as the sweep writes it: its samples are its shots' forward phases, and
    its split the requests' prefixes (whole 16-token blocks) and new tokens."""
    regime = v.REAL_PREFIX if p else v.NOT_APPLICABLE
    median = statistics.median_high(times)
    blocks = [p // 16 // b + (i < p // 16 % b) for i in range(b)]
    return PointRow(
        p,
        b,
        regime,
        [v.STAMP_PREFILL_REAL_SEED] if p else [],
        list(times),
        median,
        point_type=v.PREFILL,
        total_prefill_tokens=n,
        phases=_phases(median * 1.2, median),
        graph=None if graph is None else dict(graph),
        sample_kind=v.SHOT_FORWARD,
        split={"prefix_tokens": [16 * x for x in blocks], "new_tokens": balanced(n, b)},
    )


def write_rank(
    folder,
    rows,
    *,
    rank=0,
    size=1,
    status=v.COMPLETE,
    resolved=RESOLVED,
    times=("2026-12-02T09:00:00Z", "2026-12-02T09:00:04Z"),
    error=None,
    graphs=EAGER_ENGINE,
    exchange=None,
):
    """One rank's artifact as the sweep writes it: through its ArtifactWriter, whose meta
    the sweep fills (noisy_spread, the collector's record, the engine's graphs; graphs=None:
    an artifact from before the sweep recorded them). The plot is not drawn (the export
    never reads it)."""
    layout = RankLayout(size, rank, 1, 1, False)
    out = folder.parent if size > 1 else folder
    writer = ArtifactWriter(str(out), {"points": "p.json", "model": "/m"}, str(folder) if size > 1 else None, layout)
    writer.meta.enabled, writer.meta.warm_eligible = True, True
    writer.meta.giant_kv_repeats, writer.meta.giant_kv_threshold = 3, 1_000_000
    writer.meta.batch_semantics, writer.meta.global_batch_factor = "per_rank", size
    writer.meta.cudagraph = graphs.record() if graphs is not None else None
    writer.meta.gc = GcHold().record()
    writer.meta.exchange = exchange
    writer.meta.reset_prefix_cache = status == v.COMPLETE
    writer.run = {"started_at": times[0], "finished_at": None, "engine_args": {"given": [], "resolved": resolved}}
    writer.rows = list(rows)
    with (
        mock.patch("vllm.kvwarm.sweep.writer.utc_now", return_value=times[1]),
        mock.patch("vllm.kvwarm.record.plot.write_plot"),
    ):
        writer.write(status, error)
    return json.loads(writer.artifact_path.read_text())


def dp_sweep(root, rows_per_rank, **kwargs):
    for rank, rows in enumerate(rows_per_rank):
        write_rank(root / f"dp{rank}", rows, rank=rank, size=len(rows_per_rank), **kwargs)
    write_combined(root, len(rows_per_rank))
    return root


def dynamo_files(root, out, kind=None):
    return [json.loads(p.read_text()) for p in export.write_dynamo(load_sweep(root), out, kind)]
