"""`python -m vllm.kvwarm sweep` on the real CPU engine with async scheduling as CUDA has it
(vLLM's default): the CPU platform turns it off, and here that override is lifted, so the real
EngineCore steps its batch queue (schedule n+1 before update n) over the real CPU runner,
which runs vLLM's async output path as it stands. The command must pick the async adapter and
record the loop, and every timed sample must hold what it claims, checked against the model
runner's own forwards, timed here around CPUModelRunner.execute_model on the sweep's clock:

- a decode sample is one served step: it holds one whole forward of the point's B requests
  (under the batch queue, the next step's; the last one's too);
- a prefill sample runs from the end of the schedule() that scheduled the shot to its output,
  so it holds that shot's own forward (the CPU runner computes it at submission);
- no step mixes a point's requests with any other, and a point's requests run their
  admission, timed and trailing steps, never more.

Runs in the command's own pytest process (`-m command`): the command starts its own engine.
"""

from __future__ import annotations

import json
import time

import pytest

pytestmark = pytest.mark.command

STEPS = 3
DECODE = [(300, 2), (90, 3)]  # (K, B)
PREFILL = [(96, 128, 2), (64, 0, 2)]  # (N, P, B)


def _record_forwards(monkeypatch) -> list[tuple[dict, float]]:
    """Every forward the CPU runner computes: the step's requests (id: tokens) and how long."""
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    forwards = []
    execute = CPUModelRunner.execute_model

    def timed(self, scheduler_output, *args, **kwargs):
        start = time.perf_counter()
        try:
            return execute(self, scheduler_output, *args, **kwargs)
        finally:
            if scheduler_output.total_num_scheduled_tokens:
                forwards.append((dict(scheduler_output.num_scheduled_tokens), time.perf_counter() - start))

    monkeypatch.setattr(CPUModelRunner, "execute_model", timed)
    return forwards


def test_under_the_batch_queue_every_sample_holds_the_forward_it_times(tmp_path, monkeypatch):
    from kvwarm_testing.engine import keep_async_scheduling
    from kvwarm_testing.tiny_models import make_tiny_llama, write_sharegpt
    from vllm.kvwarm.kv.injector import SHADOW_PREFIX
    from vllm.kvwarm.record.schema import validate
    from vllm.kvwarm.sweep.command import run
    from vllm.kvwarm.sweep.prefill import PREFILL_PREFIX

    keep_async_scheduling(monkeypatch)
    forwards = _record_forwards(monkeypatch)
    points = tmp_path / "points.json"
    points.write_text(
        json.dumps(
            {
                "schema_version": 1,
                "decode": [{"total_kv_read_tokens": k, "batch_size": b} for k, b in DECODE],
                "prefill": [
                    {"total_prefill_tokens": n, "total_kv_read_tokens": p, "batch_size": b} for n, p, b in PREFILL
                ],
            }
        )
    )
    monkeypatch.setenv("DYN_BENCH_KV_WARMUP_DATASET", str(write_sharegpt(tmp_path / "sharegpt.json")))
    monkeypatch.setenv("DYN_BENCH_GIANT_KV_REPEATS", str(STEPS))
    monkeypatch.setenv("DYN_BENCH_KV_WARMUP", "force")  # a dense model: the gate would skip it
    out = tmp_path / "out"
    model = make_tiny_llama(tmp_path / "tiny-llama")
    engine = ["--model", str(model), "--dtype", "float32", "--enforce-eager", "--max-model-len", "1024"]
    engine += ["--block-size", "32", "--max-num-seqs", "8", "--max-num-batched-tokens", "256"]
    assert run(["--points", str(points), "--out", str(out), *engine, "--enable-prefix-caching", "--seed", "0"]) == 0
    artifact = json.loads((out / "sweep.json").read_text())
    validate(artifact)
    assert artifact["status"] == "complete" and artifact["skipped_points"] == []
    rows = {
        (r["point"]["point_type"], r["point"]["batch_size"], r["point"]["total_prefill_tokens"]): r
        for r in artifact["results"]
    }
    assert len(rows) == len(DECODE) + len(PREFILL)

    shots = [(ids, seconds) for ids, seconds in forwards if any(r.startswith(PREFILL_PREFIX) for r in ids)]
    decode_steps = [(ids, seconds) for ids, seconds in forwards if any(r.startswith(SHADOW_PREFIX) for r in ids)]
    # no step mixes the sweep's requests with others
    for ids, _ in shots:
        assert len({r.rsplit("_", 1)[0] for r in ids}) == 1, f"a step ran {sorted(ids)}"
    for ids, _ in decode_steps:
        assert all(r.startswith(SHADOW_PREFIX) for r in ids), f"a step ran {sorted(ids)}"
    # each shadow: its admission step, the timed steps and the one after them, never more
    runs: dict[str, int] = {}
    for ids, _ in decode_steps:
        for r in ids:
            runs[r] = runs.get(r, 0) + 1
    assert len(runs) == sum(b for _, b in DECODE) and set(runs.values()) == {1 + STEPS + 1}

    # prefill: the shots of each point in order (a warm one, then the timed ones); each timed
    # sample holds its own shot's whole forward
    for n, _, b in PREFILL:
        point_shots = [seconds for ids, seconds in shots if len(ids) == b and sum(ids.values()) == n]
        row = rows[("prefill", b, n)]
        assert len(point_shots) == 1 + STEPS
        for sample, forward in zip(row["steady_seconds"], point_shots[1:]):
            assert sample >= forward, (row["steady_seconds"], point_shots)
    # decode: every sample holds one whole forward of the point's B requests, one token each
    for _, b in DECODE:
        point_forwards = [seconds for ids, seconds in decode_steps if len(ids) == b and set(ids.values()) == {1}]
        row = rows[("decode", b, 0)]
        assert min(row["steady_seconds"]) >= min(point_forwards), (row["steady_seconds"], point_forwards)
    assert artifact["kvwarm"]["engine_loop"] == {
        "loop": "batch_queue",
        "scheduler_cls": "vllm.kvwarm.scheduler.KvWarmAsyncScheduler",
        "async_scheduling": True,
        "batch_queue_size": 2,
    }
