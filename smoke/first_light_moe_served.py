"""(k) of the first light, issue 61: Qwen3-30B-A3B's shape (dummy weights, smoke/gpu_models.py)
served by the OpenAI server through KvWarmAsyncScheduler with CUDA graphs, the served-step
trace on, under vLLM's own load (vllm.benchmarks.serve: random prompts longer than
--max-num-batched-tokens, so chunked prefill mixes steps) at two rates, the engine core, the
frontend and the client on cores apart (placement.py; printed). Then tables swept
`--grid-from` the trace on the same engine arguments, with the warm-up on and off (one boot
with `--ab` where `sweep --help` lists it, else two), each held against the trace by
`validate` (and the real one again on the forward phase: where a gap lives), issue 61's lines
printed beside each figure (served_lines.py), and the real table's collection time against
the fake one's. The CPU dry run runs it scaled, the platform's override of async scheduling
lifted (first_light_engine.launch), so the same loop and adapter run.

Rates: the first load offers the plan's estimate of saturation (shape_plans.QWEN3.near); the
second offers `below_share` of the throughput the first achieved, so it is below saturation
whatever the estimate missed. Both loads run into one trace.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import placement
from first_light_engine import kit_settings, matching_adapter, run_sweep, shape_models
from first_light_report import Result, engine_log_facts
from first_light_served import TRACE_KEY, _free_port, _wait_healthy, _with_config, validate_available
from kvwarm_testing.engine import engine_env, lift_cpu_overrides
from served_lines import acceptance, printed
from shape_plans import SERVED, ServedPlan

SKIP_SECONDS = 10  # the trace's first seconds (the server idle, its first shapes) left out of grid and validate
NAME = "qwen3"


def served_cli(args, plan: ServedPlan, folder: Path) -> list[str]:
    cli = ["--model", str(folder), "--load-format", "dummy", "--dtype", "bfloat16", "--seed", "0"]
    cli += ["--max-model-len", str(plan.max_model_len), "--max-num-seqs", str(plan.max_num_seqs)]
    cli += ["--max-num-batched-tokens", str(plan.batched_tokens), "--enable-prefix-caching", "--enable-expert-parallel"]
    if args.device == "cpu":
        return [*cli, "--enforce-eager"]
    settings = kit_settings(args.site)
    cli += [*settings["engine_args"], "--cudagraph-capture-sizes", *(str(s) for s in plan.capture)]
    cli += ["--gpu-memory-utilization", "0.9"]
    if settings["additional_config"]:
        cli += ["--additional-config", json.dumps(settings["additional_config"])]
    return cli


def _load(args, port: int, plan: ServedPlan, folder: Path, rate: float, name: str, where) -> dict | None:
    out = args.work / "served-moe"
    bench = [sys.executable, str(Path(__file__).with_name("first_light_served.py")), "bench", "--backend", "vllm"]
    bench += ["--base-url", f"http://127.0.0.1:{port}", "--model", NAME, "--tokenizer", str(folder)]
    bench += ["--dataset-name", "random", "--random-input-len", str(plan.input_len)]
    bench += ["--random-output-len", str(plan.output_len), "--num-prompts", str(plan.requests)]
    bench += ["--request-rate", f"{rate:.3f}", "--seed", "0", "--ignore-eos", "--save-result", "--disable-tqdm"]
    bench += ["--result-dir", str(out), "--result-filename", f"bench-{name}.json"]
    env = {**os.environ, **engine_env(args.device)}
    with (args.work / "logs" / f"served-moe-bench-{name}.log").open("w") as log:
        rc = subprocess.run(
            bench,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            check=False,
            preexec_fn=placement.client_affinity(where),
        ).returncode
    path = out / f"bench-{name}.json"
    if rc != 0 or not path.exists():
        return None
    found = json.loads(path.read_text())
    keys = ("completed", "duration", "request_throughput", "median_ttft_ms", "median_tpot_ms", "p99_ttft_ms")
    return {"offered_rate": round(rate, 3), **{k: found.get(k) for k in keys}}


def _serve(args, plan: ServedPlan, folder: Path, cli: list[str], adapter: str, where) -> tuple[dict, str | None]:
    """The server under both loads; (facts, the failure or None)."""
    trace = args.work / "served-moe" / "trace"
    port, log = _free_port(), args.work / "logs" / "served-moe-server.log"
    cmd = [sys.executable, str(Path(__file__).with_name("first_light_engine.py")), "serve"]
    cmd += [*_with_config(cli, {TRACE_KEY: {"out": str(trace)}}), "--scheduler-cls", adapter]
    cmd += ["--port", str(port), "--served-model-name", NAME]
    facts: dict = {"placement_plan": placement.words(where)}
    started = time.monotonic()
    with log.open("w") as handle:
        server = subprocess.Popen(
            cmd, env={**os.environ, **engine_env(args.device)}, stdout=handle, stderr=subprocess.STDOUT, process_group=0
        )
    pinner = placement.Pinner(server.pid, where)
    try:
        if not _wait_healthy(port, server, 900):
            return facts, f"the server did not come up (exit {server.poll()}); see {log.name}"
        facts["boot_seconds"] = round(time.monotonic() - started, 1)
        facts["placement"] = pinner.placement()
        print("[first light] served-moe placement:\n  " + "\n  ".join(facts["placement"]), flush=True)
        near = _load(args, port, plan, folder, plan.near, "near", where)
        if near is None:
            return facts, "the first load failed; see served-moe-bench-near.log"
        below_rate = max(0.1, plan.below_share * (near["request_throughput"] or plan.near))
        below = _load(args, port, plan, folder, below_rate, "below", where)
        facts["loads"] = {"near": near, "below": below}
        if below is None:
            return facts, "the second load failed; see served-moe-bench-below.log"
        short = [n for n, r in facts["loads"].items() if r["completed"] != plan.requests]
        return facts, (f"loads {short} did not complete {plan.requests} requests" if short else None)
    finally:
        pinner.stop()
        os.killpg(server.pid, signal.SIGINT)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        facts |= engine_log_facts(log)


def ab_available() -> bool:
    """Whether this build's sweep takes the warm-up on and off in one boot (`--ab`, issue 58)."""
    done = subprocess.run(
        [sys.executable, "-m", "vllm.kvwarm", "sweep", "--help"], capture_output=True, text=True, check=False
    )
    return "--ab" in done.stdout


def _tables(args, cli: list[str], trace: Path, where) -> tuple[dict, str | None]:
    """The tables swept --grid-from the trace, warm-up on and off: {folder name: facts}."""
    grid = ["--grid-from", str(trace), "--skip-seconds", str(SKIP_SECONDS), *cli]
    arms = (
        {"ab": (["--ab"], {})} if ab_available() else {"real": ([], {}), "fake": ([], {"DYN_BENCH_KV_WARMUP": "off"})}
    )
    tables = {}
    for name, (flag, env) in arms.items():
        started = time.monotonic()
        rc, artifact, log = run_sweep(args, f"served-moe-{name}", [*flag, *grid], env, launch=True, where=where)
        tables[name] = {"sweep_exit": rc, "wall_seconds": round(time.monotonic() - started, 1)}
        if rc != 0 or artifact is None:
            return tables, f"the {name} table failed (exit {rc}); see {log.name}"
    return tables, None


def _validate(args, table: Path, trace: Path, basis: str) -> dict | None:
    out = args.work / "served-moe" / f"validate-{table.name}-{basis}"
    cmd = [sys.executable, "-m", "vllm.kvwarm", "validate", str(table), str(trace), "--json", "--out", str(out)]
    cmd += ["--basis", basis, "--skip-seconds", str(SKIP_SECONDS)]
    with (args.work / "logs" / f"served-moe-validate-{table.name}-{basis}.log").open("w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
    path = out / "validate.json"
    return json.loads(path.read_text()) if rc == 0 and path.exists() else None


def _held(args, trace: Path, tables: dict) -> tuple[list[str], dict]:
    """Every table folder the sweeps wrote (an --ab sweep may write two), validated; the
    printed lines and {table: its facts}."""
    lines, found = [], {}
    for artifact in sorted((args.work / "sweeps").glob("served-moe-*/**/sweep.json")):
        table, data = artifact.parent, json.loads(artifact.read_text())
        rows = data["results"]
        warm = "on" if (data.get("kvwarm") or {}).get("enabled") else "off"
        facts = {
            "warm_up": warm,
            "rows": {k: sum(r["point"]["point_type"] == k for r in rows) for k in ("decode", "prefill", "mixed")},
            "regimes": sorted({r["kv_seed_regime"] for r in rows}),
        }
        for basis in ("step", "forward") if warm == "on" else ("step",):
            record = _validate(args, table, trace, basis)
            if record is None:
                facts[f"validate_{basis}"] = "failed (see its log)"
                continue
            facts[f"validate_{basis}"] = record["summary"]
            facts[f"lines_{basis}"] = [[line, ok] for line, ok in acceptance(record)]
            lines += printed(f"{table.name} (warm-up {warm}, basis {basis})", record)
        found[table.name] = facts
    return lines, found


def step_served_moe(args) -> Result:
    plan, folder = SERVED[args.device], shape_models(args)["qwen3"]
    missing = validate_available()
    if missing:
        return Result("served-moe", "skip", detail=missing)
    lift_cpu_overrides(("scheduler_config.async_scheduling",))  # the adapter for the loop CUDA runs
    cli = served_cli(args, plan, folder)
    adapter, where = matching_adapter(cli), placement.cores()
    (args.work / "served-moe").mkdir(parents=True, exist_ok=True)
    print(f"[first light] served-moe: sized {plan.estimate(ab_available())}; {placement.words(where)}", flush=True)
    facts, failure = _serve(args, plan, folder, cli, adapter, where)
    facts["adapter"] = adapter
    if failure:
        return Result("served-moe", "fail", detail=failure, facts=facts)
    trace = args.work / "served-moe" / "trace"
    facts["tables"], failure = _tables(args, cli, trace, where)
    if failure:
        return Result("served-moe", "fail", detail=failure, facts=facts)
    lines, facts["validated"] = _held(args, trace, facts["tables"])
    print("[first light] served-moe, issue 61's lines:\n" + "\n".join(lines), flush=True)
    walls = {name: t["wall_seconds"] for name, t in facts["tables"].items()}
    loads = ", ".join(
        f"{n} {r['offered_rate']}/s -> {r['request_throughput']:.2f}/s" for n, r in facts["loads"].items()
    )
    detail = f"{plan.requests} x 2 requests ({loads}; {adapter.rsplit('.', 1)[1]}); tables {walls} s"
    missed = sum(ok is False for t in facts["validated"].values() for _, ok in t.get("lines_step", []))
    detail += f"; {len(facts['validated'])} table(s) validated, {missed} line(s) missed"
    return Result("served-moe", "pass" if facts["validated"] else "fail", detail=detail, facts=facts)


STEPS = {"served-moe": step_served_moe}
