"""The graph each timed sample ran in, as the model runner reports it: the real
ModelRunnerOutput of the patched release, carrying the release's own CUDAGraphStat (vLLM
fills `cudagraph_stats` with --cudagraph-metrics; here the played runner fills it), stepped
through the adapter on a real Scheduler. Each row records per sample [mode, padded tokens],
its median sample's mode and size beside the graph its shape expects, and is stamped where
the two differ; where the runner reports nothing the row says why (and where the release's
output has no such field, that instead). Probed, never by version: this file runs on every
release tier."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from kvwarm_testing.real_kv import make_scheduler, model_output
from vllm.kvwarm.record import vocabulary as v
from vllm.kvwarm.record.artifact import KvwarmMeta, build_artifact, results_csv
from vllm.kvwarm.record.schema import validate
from vllm.kvwarm.record.shape import GraphConfig
from vllm.kvwarm.scheduler import KvWarmScheduler
from vllm.kvwarm.sweep.controller import Sweep
from vllm.kvwarm.sweep.plan import SweepConfig
from vllm.kvwarm.sweep.points import DecodePoint, PrefillPoint
from vllm.kvwarm.sweep.timing import NO_FIELD, NOT_FILLED
from vllm.v1.outputs import ModelRunnerOutput

SIZES = (1, 2, 4, 8)
# decode batches in full graphs, other steps in piecewise ones, at 1, 2, 4 and 8 tokens
GRAPHS = GraphConfig("FULL_AND_PIECEWISE", "FULL", "PIECEWISE", SIZES, SIZES, SIZES, 8, 256)
HAS_FIELD = "cudagraph_stats" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}


@pytest.fixture(autouse=True)
def _hashing():
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    init_none_hash(sha256)


def graph_stat(tokens: int):
    """The release's CUDAGraphStat as its GPU runner fills it for a step of `tokens`: a
    uniform decode batch of 1 to 8 in a full graph padded to the next size, anything else
    in a piecewise graph (up to 8 tokens; eager past it), unpadded there."""
    from vllm.compilation.cuda_graph import CUDAGraphStat

    padded = next((s for s in SIZES if s >= tokens), tokens)
    return CUDAGraphStat(
        num_unpadded_tokens=tokens, num_padded_tokens=padded, num_paddings=padded - tokens, runtime_mode="FULL"
    )


def sweep_rows(tmp_path, stats) -> list[dict]:
    """A decode point (2 requests) and a prefill point (64 new tokens) swept through the
    adapter, each step's real ModelRunnerOutput given `stats(output)` as its
    cudagraph_stats (None: left as the runner leaves it without metrics); the artifact's rows."""
    scheduler = make_scheduler(tmp_path, num_blocks=192, scheduler_cls=KvWarmScheduler)
    sweep = Sweep(
        [DecodePoint(200, 2), PrefillPoint(64, 0, 1)],
        lambda i, n: [(7 * i + 3 * t) % 200 + 2 for t in range(n)],
        SweepConfig(steady_steps=3, max_model_len=1024),
        clock=itertools.count().__next__,
        progress=lambda _: None,
        tail_tokens=[(11 * t) % 190 + 5 for t in range(500)],
        vocab_size=256,
        graphs=GRAPHS,
    )
    scheduler.kvwarm_sweep = sweep
    for _ in range(600):
        if not scheduler.has_requests():
            break
        output = scheduler.schedule()
        runner = model_output(scheduler, output)
        if stats is not None:
            runner = dataclasses.replace(runner, cudagraph_stats=stats(output))
        scheduler.update_from_output(output, runner)
    assert sweep.done
    artifact = build_artifact(sweep.rows, KvwarmMeta(), {"points": "p.json"}, "complete")
    validate(artifact)
    return artifact


@pytest.mark.skipif(not HAS_FIELD, reason="the release's ModelRunnerOutput has no cudagraph_stats (the next test)")
def test_each_sample_records_the_graph_the_runner_reported_beside_the_one_expected(tmp_path):
    artifact = sweep_rows(tmp_path, lambda output: graph_stat(output.total_num_scheduled_tokens))
    decode, prefill = sorted(artifact["results"], key=lambda r: r["point"]["point_type"])
    # two decodes: expected and ran in the full graph of 2
    assert decode["graph"]["observed"] == [["FULL", 2]] * 3
    assert (decode["graph"]["expected_cudagraph_mode"], decode["graph"]["expected_capture_size"]) == ("FULL", 2)
    assert (decode["graph"]["observed_cudagraph_mode"], decode["graph"]["observed_size"], decode["graph"]["why"]) == (
        "FULL",
        2,
        None,
    )
    assert v.GRAPH_MISMATCH not in decode["sample_reasons"]
    # 64 new tokens: past the largest piecewise size, so eager expected; the runner said FULL
    assert prefill["graph"]["observed"] == [["FULL", 64]] * 3
    graph = prefill["graph"]
    assert (graph["expected_cudagraph_mode"], graph["observed_cudagraph_mode"]) == ("NONE", "FULL")
    assert prefill["sample_reasons"][-1] == v.GRAPH_MISMATCH
    lines = results_csv(artifact["results"]).decode().splitlines()
    assert lines[0].endswith(",observed_cudagraph_mode,observed_size")
    assert sorted(line.rsplit(",", 2)[1:] for line in lines[1:]) == [["FULL", "2"], ["FULL", "64"]]


def test_without_a_report_of_the_graph_each_row_says_why(tmp_path):
    artifact = sweep_rows(tmp_path, None)  # the real output as the runner leaves it without metrics
    why = NOT_FILLED if HAS_FIELD else NO_FIELD
    for row in artifact["results"]:
        graph = row["graph"]
        assert (graph["observed"], graph["observed_cudagraph_mode"], graph["observed_size"]) == (None, None, None)
        assert graph["why"] == why and graph["expected_cudagraph_mode"] in ("FULL", "NONE")
        assert v.GRAPH_MISMATCH not in row["sample_reasons"]
