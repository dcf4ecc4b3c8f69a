"""The warm-up gate on real engine configs, and a sweep configured through additional_config
(the way `vllm serve --scheduler-cls ... --additional-config` runs it) on a real Scheduler."""

from __future__ import annotations

import json

import pytest
from kvwarm_testing.real_kv import in_use, make_request, make_scheduler, step_scheduler
from vllm.kvwarm.record import vocabulary
from vllm.kvwarm.record.schema import validate
from vllm.kvwarm.scheduler import KvWarmScheduler
from vllm.kvwarm.sweep import gate
from vllm.kvwarm.sweep.settings import SettingsError


@pytest.fixture(autouse=True)
def _hashing():
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    init_none_hash(sha256)


def _config(tmp_path, experts: int = 0, expert_parallel: bool = False, prefix_caching: bool = True):
    config = make_scheduler(tmp_path).vllm_config
    config.model_config.hf_config.num_local_experts = experts
    config.parallel_config.enable_expert_parallel = expert_parallel
    config.cache_config.enable_prefix_caching = prefix_caching
    return config


@pytest.mark.parametrize(
    ("warmup", "experts", "expert_parallel", "prefix_caching", "reason"),
    [
        ("off", 8, True, True, vocabulary.FLAG_OFF),
        ("on", 0, True, True, vocabulary.DENSE_MODEL),
        ("on", 8, False, True, vocabulary.MOE_TP_BALANCED),
        ("on", 8, True, False, vocabulary.PREFIX_CACHING_DISABLED),
        ("on", 8, True, True, None),
        ("force", 0, False, True, None),  # force skips the two cost-saving heuristics ...
        ("force", 0, False, False, vocabulary.PREFIX_CACHING_DISABLED),  # ... never the correctness checks
    ],
)
def test_the_model_gate_gives_upstreams_reasons_in_order(
    tmp_path, warmup, experts, expert_parallel, prefix_caching, reason
):
    config = _config(tmp_path, experts, expert_parallel, prefix_caching)
    assert gate.model_gate_reason(config, warmup) == reason


def test_expert_counts_are_found_under_every_upstream_key_and_in_a_text_config():
    from types import SimpleNamespace

    assert gate.expert_count(SimpleNamespace(n_routed_experts=64)) == 64
    assert gate.expert_count(SimpleNamespace(text_config=SimpleNamespace(moe_num_experts=16))) == 16
    assert gate.expert_count(SimpleNamespace(num_experts=None, hidden_size=64)) == 0


def test_the_content_probe_stops_once_it_has_enough_tokens():
    seen = []

    def encode(text):
        seen.append(text)
        return list(range(len(text)))

    assert gate.content_reason(["a" * 10, "b" * 10, "c" * 10], encode, need=15) is None and len(seen) == 2
    assert gate.content_reason(["a" * 10], encode, need=15) == "content_too_shallow: 10 tokens < 15"


def _points(tmp_path, *points) -> str:
    path = tmp_path / "points.json"
    path.write_text(
        json.dumps({"schema_version": 1, "decode": [{"total_kv_read_tokens": k, "batch_size": b} for k, b in points]})
    )
    return str(path)


def _drive(scheduler, limit: int = 300) -> None:
    for _ in range(limit):
        if not scheduler.has_requests():
            return
        step_scheduler(scheduler)
    raise AssertionError("the sweep did not finish")


def test_a_sweep_from_additional_config_with_warm_up_off_writes_a_legacy_artifact(tmp_path, monkeypatch):
    monkeypatch.setenv("DYN_BENCH_KV_WARMUP", "off")
    monkeypatch.delenv("DYN_BENCH_KV_WARMUP_DATASET", raising=False)  # not needed without chains
    out = tmp_path / "out"
    spec = {"points": _points(tmp_path, (300, 2), (90, 3)), "out": str(out)}
    scheduler = make_scheduler(
        tmp_path, num_blocks=128, scheduler_cls=KvWarmScheduler, additional_config={"kvwarm_sweep": spec}
    )
    _drive(scheduler)
    artifact = json.loads((out / "sweep.json").read_text())
    validate(artifact)
    meta = artifact["kvwarm"]
    assert artifact["status"] == "complete" and meta["reset_prefix_cache"] is True
    assert (meta["enabled"], meta["warm_eligible"], meta["skip_reason"]) == (False, False, "flag_off")
    assert meta["points_real_kv"] == 0 and meta["stages"] == [] and meta["dataset"] is None
    assert [r["kv_seed_regime"] for r in artifact["results"]] == ["legacy", "legacy"]
    assert in_use(scheduler.kv_cache_manager.block_pool) == {}


def test_a_dense_model_is_measured_on_fake_kv_with_the_gates_reason(tmp_path, monkeypatch):
    dataset = tmp_path / "sharegpt.json"
    dataset.write_text(
        json.dumps([{"conversations": [{"from": "human", "value": "x" * 80 + str(n)}]} for n in range(8)])
    )
    monkeypatch.setenv("DYN_BENCH_KV_WARMUP_DATASET", str(dataset))
    monkeypatch.delenv("DYN_BENCH_KV_WARMUP", raising=False)
    out = tmp_path / "out"
    scheduler = make_scheduler(
        tmp_path,
        num_blocks=128,
        scheduler_cls=KvWarmScheduler,
        additional_config={"kvwarm_sweep": {"points": _points(tmp_path, (64, 2)), "out": str(out)}},
    )
    _drive(scheduler)
    artifact = json.loads((out / "sweep.json").read_text())
    meta = artifact["kvwarm"]
    assert (meta["enabled"], meta["warm_eligible"], meta["skip_reason"]) == (True, False, vocabulary.DENSE_MODEL)
    assert meta["dataset"]["collection_pool"] == "conversation_sha256_even" and len(meta["dataset"]["sha256"]) == 64
    (row,) = artifact["results"]
    assert row["kv_seed_regime"] == "fake_fallback" and row["sample_reasons"] == ["kvwarm_fake_fallback"]
    assert meta["points_fake_fallback"] == 1


@pytest.mark.parametrize(
    ("env", "points", "needle"),
    [
        ({"DYN_BENCH_KV_WARMUP": "maybe"}, ((64, 2),), "DYN_BENCH_KV_WARMUP='maybe'"),
        ({"DYN_BENCH_KV_WARMUP": "off"}, ((4_000, 2),), "beyond max_model_len 1024"),
        ({"DYN_BENCH_KV_WARMUP_DATASET": "/nonexistent/sharegpt.json"}, ((64, 2),), "not found"),
        ({"DYN_BENCH_KV_WARMUP": "off"}, ((64, 9),), "batch size(s) [9] exceed max_num_seqs 8"),
    ],
)
def test_bad_input_stops_the_scheduler_and_the_artifact_says_why(tmp_path, monkeypatch, env, points, needle):
    monkeypatch.delenv("DYN_BENCH_KV_WARMUP", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    out = tmp_path / "out"
    with pytest.raises(ValueError) as raised:
        make_scheduler(
            tmp_path,
            scheduler_cls=KvWarmScheduler,
            additional_config={"kvwarm_sweep": {"points": _points(tmp_path, *points), "out": str(out)}},
        )
    assert needle in str(raised.value)
    artifact = json.loads((out / "sweep.json").read_text())
    validate(artifact)
    assert artifact["status"] == "failed" and needle in artifact["error"]


def test_a_malformed_sweep_config_names_the_key_and_the_expected_shape(tmp_path):
    with pytest.raises(SettingsError, match=r'additional_config\["kvwarm_sweep"\] must be'):
        make_scheduler(tmp_path, scheduler_cls=KvWarmScheduler, additional_config={"kvwarm_sweep": {"out": "x"}})


def failing_on_the_second_point(tmp_path, monkeypatch, *points):
    """A sweep configured through additional_config (fake KV: no dataset) whose second
    point fails as it is queued; returns the scheduler and the output folder."""
    monkeypatch.setenv("DYN_BENCH_KV_WARMUP", "off")
    out = tmp_path / "out"
    scheduler = make_scheduler(
        tmp_path,
        num_blocks=128,
        scheduler_cls=KvWarmScheduler,
        additional_config={"kvwarm_sweep": {"points": _points(tmp_path, *points), "out": str(out)}},
    )
    sweep, start_point = scheduler.kvwarm_sweep, scheduler.kvwarm_sweep._start_point

    def fail_on_the_second_point(*args):
        if sweep.rows:
            raise RuntimeError("the worker went away")
        return start_point(*args)

    sweep._start_point = fail_on_the_second_point
    return scheduler, out


def test_a_failure_mid_sweep_keeps_the_rows_measured_before_it_and_the_engine_serves_on(tmp_path, monkeypatch):
    scheduler, out = failing_on_the_second_point(tmp_path, monkeypatch, (300, 2), (200, 2), (100, 2))
    sweep = scheduler.kvwarm_sweep
    _drive(scheduler)  # the error is recorded, never raised into the engine
    artifact = json.loads((out / "sweep.json").read_text())
    validate(artifact)
    assert artifact["status"] == "failed" and artifact["error"] == "RuntimeError: the worker went away"
    assert [r["point"]["total_kv_read_tokens"] for r in artifact["results"]] == [300]
    assert (out / "sweep.csv").read_text().count("\n") == 2  # header and the measured row
    assert sweep.done and in_use(scheduler.kv_cache_manager.block_pool) == {}
    assert_serves(scheduler)


def assert_serves(scheduler) -> None:
    """The scheduler still runs an ordinary request to its end."""
    scheduler.add_request(make_request("user-1", 38))
    _drive(scheduler)
    assert "user-1" not in scheduler.requests and in_use(scheduler.kv_cache_manager.block_pool) == {}


def test_a_failed_artifact_write_ends_the_sweep_as_failed_and_the_engine_serves_on(tmp_path, monkeypatch):
    from vllm.kvwarm.sweep import writer as writer_module

    monkeypatch.setenv("DYN_BENCH_KV_WARMUP", "off")
    out = tmp_path / "out"
    scheduler = make_scheduler(
        tmp_path,
        num_blocks=128,
        scheduler_cls=KvWarmScheduler,
        additional_config={"kvwarm_sweep": {"points": _points(tmp_path, (300, 2), (200, 2)), "out": str(out)}},
    )
    write, calls = writer_module.write_atomically, []

    def disk_full_once_rows_exist(path, data):
        """The running sweep.json's writes (the final one is record.artifact's)."""
        calls.append(path.name)
        if calls.count("sweep.json") == 2:  # the first row's write
            raise OSError(28, "No space left on device")
        return write(path, data)

    monkeypatch.setattr(writer_module, "write_atomically", disk_full_once_rows_exist)
    _drive(scheduler)
    artifact = json.loads((out / "sweep.json").read_text())
    assert artifact["status"] == "failed"
    assert "writing the artifact to" in artifact["error"] and "No space left on device" in artifact["error"]
    assert scheduler.kvwarm_sweep.done and in_use(scheduler.kv_cache_manager.block_pool) == {}
    assert_serves(scheduler)


def test_the_command_records_a_failure_inside_a_sweep_hook_once(tmp_path, monkeypatch):
    """The sweep command's in-process loop (sweep_command._step) over a real scheduler, the
    engine core's part played by a stand-in: the adapter records the failure; the loop
    must not record it again."""
    from types import SimpleNamespace

    from vllm.kvwarm.sweep import command as sweep_command
    from vllm.kvwarm.sweep.writer import ArtifactWriter

    scheduler, _ = failing_on_the_second_point(tmp_path, monkeypatch, (300, 2), (200, 2))
    statuses, write = [], ArtifactWriter.write
    monkeypatch.setattr(
        ArtifactWriter,
        "write",
        lambda self, status, error=None: (statuses.append(status), write(self, status, error))[1],
    )
    core_stand_in = SimpleNamespace(scheduler=scheduler, step_fn=lambda: step_scheduler(scheduler))
    assert sweep_command._step(core_stand_in) == "failed"
    assert statuses.count("failed") == 1
