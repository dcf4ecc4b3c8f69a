"""`python -m vllm.kvwarm sweep --grid-from TRACE` on the real CPU engine: a tiny MoE swept
over the shapes of a trace made here (the recorder's format, its header carrying this build,
host and torch), its table then held against the trace by `validate` with every step inside
the table's range; and a trace of another model refused before the engine loads.

Runs in its own pytest process (`-m command`): the command starts its own engine.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kvwarm_testing.multi_rank import engine_args

pytestmark = pytest.mark.command

CAPS = '{"decode_batches": 4, "kv_ladder": 2, "prefill_batches": 1, "prefill_tokens": 2, "prefix_depths": 2}'


def moe_args(model: Path) -> list[str]:
    """The tiny MoE's engine as the other command tests start it, with expert parallel."""
    return engine_args(model, "--enable-expert-parallel")


def served_trace(folder, model) -> None:
    """A trace of this engine as the recorder heads one (build, hardware and torch of this
    process; the resolved arguments the command's are known to give on CPU), with decode,
    prefill and mixed steps."""
    import torch
    from kvwarm_testing.traces import header, step, write_trace
    from vllm.kvwarm import build_record
    from vllm.kvwarm.sweep.provenance import hardware

    head = header(model=str(model), build=build_record(), hardware=hardware(), torch=torch.__version__)
    head["engine"] = {
        "given": moe_args(model),
        "resolved": {
            "dtype": "float32",
            "max_num_batched_tokens": 256,
            "enforce_eager": True,
            "model_type": "qwen3_moe",
            "architectures": ["Qwen3MoeForCausalLM"],
            "async_scheduling": False,  # the CPU platform forces the sync loop
        },
    }
    head["layout"]["expert_parallel"] = True
    decode = [(1, 60), (2, 240), (3, 450), (2, 100), (4, 800)]
    prefill = [(1, 48, 0), (1, 120, 64), (1, 80, 32)]
    steps = [step(0, None, (1, 59))]
    steps += [step(i, 4.0, d) for i, d in enumerate(decode, start=1)]
    steps += [step(i, 6.0, (0, 0), p) for i, p in enumerate(prefill, start=6)]
    steps.append(step(9, 7.0, (2, 200), (1, 64, 0)))
    write_trace(folder, steps, head=head)


def test_a_grid_from_a_trace_gives_a_table_that_covers_every_traced_step(tmp_path, monkeypatch):
    from kvwarm_testing.engine import fp32_moe_refusal, skip_where_refused
    from kvwarm_testing.tiny_models import make_tiny_qwen3_moe, write_sharegpt
    from vllm.kvwarm.record.schema import validate as check_schema
    from vllm.kvwarm.record.validate.validation import validate
    from vllm.kvwarm.sweep.command import run

    skip_where_refused(fp32_moe_refusal())
    model = make_tiny_qwen3_moe(tmp_path / "tiny-qwen3-moe")
    trace, out = tmp_path / "trace", tmp_path / "out"
    served_trace(trace, model)
    monkeypatch.setenv("DYN_BENCH_KV_WARMUP_DATASET", str(write_sharegpt(tmp_path / "sharegpt.json")))
    monkeypatch.setenv("DYN_BENCH_GIANT_KV_REPEATS", "3")
    monkeypatch.delenv("DYN_BENCH_KV_WARMUP", raising=False)  # an MoE with EP: the gate admits it
    assert run(["--grid-from", str(trace), "--grid-caps", CAPS, "--out", str(out), *moe_args(model)]) == 0
    artifact = json.loads((out / "sweep.json").read_text())
    check_schema(artifact)
    assert artifact["status"] == "complete" and artifact["skipped_points"] == []
    grid = json.loads((out / "grid.json").read_text())
    assert {p["batch_size"] for p in grid["decode"]} == {1, 2, 3, 4}
    assert {(p["total_prefill_tokens"], p["total_kv_read_tokens"]) for p in grid["prefill"]} == {
        (48, 0),
        (48, 64),
        (120, 0),
        (120, 64),
    }
    assert grid["mixed"] == [  # over the one mixed step
        {
            "decode": {"total_kv_read_tokens": 200, "batch_size": 2},
            "prefill": {"total_prefill_tokens": 64, "total_kv_read_tokens": 0, "batch_size": 1},
        }
    ]
    assert artifact["kvwarm"]["grid"]["trace"] == str(trace)
    assert {r["kv_seed_regime"] for r in artifact["results"]} <= {"real_kv", "real_prefix", "not_applicable"}
    result = validate(str(out), str(trace))
    summary = result.summary()
    assert summary["steps"] == 9 and summary["coverage"] == 100.0
    assert summary["mixed_predictor"] == "measured" and summary["decode_mape"] is not None


def test_a_trace_of_another_model_is_refused_before_the_engine_loads(tmp_path, capsys, monkeypatch):
    from kvwarm_testing.tiny_models import make_tiny_llama
    from kvwarm_testing.traces import step, write_trace
    from vllm.kvwarm.sweep.command import run
    from vllm.v1.engine.llm_engine import LLMEngine

    def no_engine(*args, **kwargs):
        raise AssertionError("the engine started: the trace was not refused first")

    monkeypatch.setattr(LLMEngine, "from_engine_args", no_engine)
    monkeypatch.setenv("DYN_BENCH_KV_WARMUP", "off")  # no dataset needed
    trace, out = tmp_path / "trace", tmp_path / "out"
    write_trace(trace, [step(0, None, (1, 10)), step(1, 5.0, (1, 11))])  # of /models/tiny-qwen3-moe
    other = make_tiny_llama(tmp_path / "tiny-llama")
    assert run(["--grid-from", str(trace), "--out", str(out), *moe_args(other)]) == 2
    err = capsys.readouterr().err
    assert "the trace ran another engine: model (trace 'tiny-qwen3-moe', given 'tiny-llama')" in err
    assert "expert_parallel (trace False, given True)" in err
    assert json.loads((out / "sweep.json").read_text())["status"] == "failed"
