"""The served-step trace on the real CPU engine: a tiny MoE behind vLLM's OpenAI server (its
own processes), loaded by vLLM's own client (`vllm.benchmarks.serve`: Poisson arrivals of
random prompts longer than --max-num-batched-tokens, so prompts are chunked and steps mix).

The trace holds every step the engine ran, held against the server's own Prometheus count
of engine steps: vllm:iteration_tokens_total is observed once per message of request
outputs the frontend receives from the engine core (AsyncLLM's output handler makes its
IterationStats only for a message with outputs; the same on every release in the table),
and the engine core sends one such message per step that produced a request output.
So the rule: the count equals the traced steps that sent an output (`outputs` > 0); the
others are prefill steps whose every chunk was a partial prompt (no token sampled), which
the test checks too. The tokens the steps sent add up to vllm:generation_tokens_total.

Runs in the `command` group (its engine in processes of its own).
"""

from __future__ import annotations

import json

import pytest
from kvwarm_testing.multi_rank import ADAPTER, api_server, engine_args
from kvwarm_testing.served import load_args, metric, random_dataset, run_load, settled, trace_lines

pytestmark = pytest.mark.command

REQUESTS = 40  # a few dozen: the benchmark (benchmarks/served_vs_table.py) runs hundreds


def test_the_trace_holds_every_step_the_server_counts(tmp_path):
    from kvwarm_testing.engine import fp32_moe_refusal, skip_where_refused
    from kvwarm_testing.tiny_models import make_tiny_qwen3_moe

    skip_where_refused(fp32_moe_refusal())
    model = make_tiny_qwen3_moe(tmp_path / "tiny-moe")
    trace = tmp_path / "trace"
    args = engine_args(
        model,
        "--scheduler-cls",
        ADAPTER,
        "--additional-config",
        json.dumps({"kvwarm_trace": {"out": str(trace)}}),
    )
    budget = int(args[args.index("--max-num-batched-tokens") + 1])
    with api_server(args, {}, tmp_path / "server.log") as server:
        load = load_args(server.url, str(model), random_dataset(2 * budget, 12, 0.5), REQUESTS, rate=20)
        result = run_load(load, tmp_path / "load.log")
        assert result["completed"] == REQUESTS and not result["failed"]

        def counts():
            _, steps = trace_lines(trace)
            return (
                len(steps),
                metric(server.url, "vllm:iteration_tokens_total_count"),
                metric(server.url, "vllm:generation_tokens_total"),
            )

        settled(counts)
        header, steps = trace_lines(trace)
        counted = metric(server.url, "vllm:iteration_tokens_total_count")
        generated = metric(server.url, "vllm:generation_tokens_total")
    assert header["type"] == "kvwarm_trace" and header["model"] == str(model)
    assert header["engine_loop"]["loop"] == "sync"
    assert header["log_stats"] is True
    # under a server vLLM's CPU platform runs the model in a worker process: a table for this
    # trace must be swept with the same executor (validate refuses another)
    assert header["engine"]["resolved"]["distributed_executor_backend"] == "mp"
    assert [s.number for s in steps] == list(range(len(steps)))
    sent = [s for s in steps if s.outputs]
    silent = [s for s in steps if not s.outputs]
    assert len(sent) == counted  # the rule, both ways
    assert sum(s.outputs for s in steps) == generated
    assert silent and all(s.decode_requests == 0 and s.prefill_requests for s in silent)
    mixed = [s for s in steps if s.decode_requests and s.prefill_requests]
    assert mixed and any(s.continuations for s in steps)
    assert max(s.prefill_new_tokens for s in steps) <= budget
    # every window but those after an idle wait (the first included) has its wall and phases
    assert sum(s.wall is None for s in steps) < len(steps) / 4
    for s in steps:
        if s.wall is not None:
            assert sum(s.phases.values()) == pytest.approx(s.wall, rel=1e-3, abs=1e-6)
            assert s.phases["forward"] > 0
