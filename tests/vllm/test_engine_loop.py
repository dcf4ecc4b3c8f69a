"""The adapter that runs matches the engine's loop: the sweep command picks the class for the
async scheduling vLLM resolves (its own config code, each release's), an adapter built for
the other loop refuses to start, naming both ways out, and the artifact records the loop. On
the real classes; the CPU platform's override of async scheduling is lifted where a test
needs CUDA's default."""

from __future__ import annotations

import json

import pytest
from kvwarm_testing.engine import keep_async_scheduling
from kvwarm_testing.real_kv import EngineLoop, in_use, make_scheduler, tiny_llama_config
from vllm.kvwarm.record.schema import validate
from vllm.kvwarm.scheduler import AdapterMismatch, KvWarmAsyncScheduler, KvWarmScheduler
from vllm.kvwarm.sweep.command import engine_args_from, engine_config

SYNC = "vllm.kvwarm.scheduler.KvWarmScheduler"
ASYNC = "vllm.kvwarm.scheduler.KvWarmAsyncScheduler"


@pytest.fixture
def as_on_cuda(monkeypatch):
    keep_async_scheduling(monkeypatch)


def _resolved(tmp_path, *args: str):
    model = tiny_llama_config(tmp_path / "tiny-llama")
    argv = ["--model", str(model), "--skip-tokenizer-init", "--dtype", "float32", *args]
    config = engine_config(engine_args_from(argv, {"out": str(tmp_path / "out")}))
    return config.scheduler_config.scheduler_cls, config.scheduler_config.async_scheduling


def test_the_command_picks_the_async_adapter_where_vllm_turns_async_scheduling_on(tmp_path, as_on_cuda, engine_cli):
    """Nothing asked: vLLM's default (on, where nothing rules it out) and the async adapter."""
    assert _resolved(tmp_path) == (ASYNC, True)


def test_the_command_picks_the_sync_adapter_where_async_scheduling_is_off(tmp_path, as_on_cuda, engine_cli):
    assert _resolved(tmp_path, "--no-async-scheduling") == (SYNC, False)


def test_on_the_cpu_platform_the_command_picks_the_sync_adapter_whatever_is_asked(tmp_path, engine_cli):
    assert _resolved(tmp_path, "--async-scheduling") == (SYNC, False)


def test_a_scheduler_class_given_is_kept(tmp_path, as_on_cuda, engine_cli):
    assert _resolved(tmp_path, "--scheduler-cls", SYNC) == (SYNC, True)  # the adapter refuses it at start


@pytest.mark.parametrize(
    "cls, async_scheduling, ways_out",
    [
        (KvWarmScheduler, True, [f"--scheduler-cls {ASYNC}", "--no-async-scheduling"]),
        (KvWarmAsyncScheduler, False, [f"--scheduler-cls {SYNC}", "--async-scheduling"]),
    ],
    ids=["sync-class-async-loop", "async-class-sync-loop"],
)
def test_an_adapter_built_for_the_other_loop_refuses_to_start_naming_both_ways_out(
    tmp_path, cls, async_scheduling, ways_out
):
    with pytest.raises(AdapterMismatch) as refused:
        make_scheduler(tmp_path, scheduler_cls=cls, async_scheduling=async_scheduling)
    for way_out in ways_out:
        assert way_out in str(refused.value)


@pytest.mark.parametrize("cls", [KvWarmScheduler, KvWarmAsyncScheduler], ids=["sync", "async"])
def test_an_adapter_built_for_its_loop_serves_it_every_step(tmp_path, cls):
    """Each class in its own loop's order (the batch queue for the async one): a request of a
    20-token prompt and 5 tokens is served with no step scheduled empty until it ends (the
    sync class under the batch queue gets every other step empty: the refusal above keeps it
    out), with its 5 tokens, one a step after its prompt's."""
    from kvwarm_testing.recorded import add
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    init_none_hash(sha256)
    scheduler = make_scheduler(tmp_path, scheduler_cls=cls)
    steps = EngineLoop(scheduler, batch_queue=cls is KvWarmAsyncScheduler)
    add(scheduler, "r", 20, max_tokens=5, token=3)
    request = scheduler.requests["r"]
    for _ in range(50):
        if not steps.busy():
            break
        steps.step()
    served = [o.num_scheduled_tokens.get("r") for o in steps.outputs]
    last = max(i for i, tokens in enumerate(served) if tokens)
    assert served[: last + 1] == [20, 1, 1, 1, 1]  # after it only the loop's last, empty schedule()s
    assert request.is_finished() and request.num_output_tokens == 5
    assert in_use(scheduler.kv_cache_manager.block_pool) == {}


@pytest.mark.parametrize(
    "cls, loop",
    [
        (KvWarmScheduler, {"loop": "sync", "async_scheduling": False, "batch_queue_size": 1}),
        (KvWarmAsyncScheduler, {"loop": "batch_queue", "async_scheduling": True, "batch_queue_size": 2}),
    ],
    ids=["sync", "async-batch-queue"],
)
def test_the_artifact_records_the_loop_the_sweep_ran_under_and_the_adapter(tmp_path, monkeypatch, cls, loop):
    """A sweep configured through additional_config (as under `vllm serve`), stepped in its
    loop's order; fake KV (warm-up off), so no dataset is needed."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    init_none_hash(sha256)
    monkeypatch.setenv("DYN_BENCH_KV_WARMUP", "off")
    points = tmp_path / "points.json"
    points.write_text(json.dumps({"schema_version": 1, "decode": [{"total_kv_read_tokens": 90, "batch_size": 3}]}))
    out = tmp_path / "out"
    spec = {"kvwarm_sweep": {"points": str(points), "out": str(out)}}
    scheduler = make_scheduler(tmp_path, num_blocks=128, scheduler_cls=cls, additional_config=spec)
    steps = EngineLoop(scheduler, batch_queue=loop["loop"] == "batch_queue")
    for _ in range(200):
        if not steps.busy():
            break
        steps.step()
    artifact = json.loads((out / "sweep.json").read_text())
    validate(artifact)
    assert artifact["status"] == "complete" and [r["kv_seed_regime"] for r in artifact["results"]] == ["legacy"]
    assert artifact["kvwarm"]["engine_loop"] == {**loop, "scheduler_cls": f"vllm.kvwarm.scheduler.{cls.__name__}"}
    assert in_use(scheduler.kv_cache_manager.block_pool) == {}
