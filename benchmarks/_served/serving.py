"""The served side: the patched CPU engine behind vLLM's OpenAI server with the trace on,
warmed with one step of every token count its budget allows (every_size), then loaded by
vLLM's own client with random and ShareGPT-format prompts at Poisson arrivals, the worker on
a core of its own or not; what the trace and the server counted.

Pinned or not as benchmarks/_served/pinning.py says (the executor's worker process on a core
of its own, everything else on the others); the client runs beside the server.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from kvwarm_testing import multi_rank
from kvwarm_testing.multi_rank import ADAPTER, api_server
from kvwarm_testing.served import (
    load_args,
    metric,
    random_dataset,
    run_load,
    settled,
    sharegpt_dataset,
    trace_lines,
)

from .pinning import cores, pin_session, pinning_env
from .pinning import placement as where
from .runqueue import RunQueue


@dataclass(frozen=True)
class Load:
    requests: int  # per dataset (random, then ShareGPT)
    rate: float  # requests per second, Poisson
    output_len: int
    budget: int  # --max-num-batched-tokens: random prompts are about twice as long


@dataclass
class Served:
    trace: Path
    pinned: bool
    placement: str  # in words, for the output
    loads: list[dict] = field(default_factory=list)
    steps: int = 0
    counted: float = 0.0  # the server's vllm:iteration_tokens_total count
    sending: int = 0  # traced steps that sent a request output (what that count counts)
    mixed: int = 0
    runqueue: dict = field(default_factory=dict)  # the engine's waits for a CPU under the loads (runqueue.py)
    load_average: tuple[float, float, float] = (0.0, 0.0, 0.0)
    warm_up_seconds: float = 0.0  # the trace's first seconds: the warm-up (every_size), not the loads


def engine_args(model: Path, budget: int) -> list[str]:
    """The engine arguments the server and both tables share: the engine tests' (tiny model,
    eager, prefix caching), experts in parallel (the warm-up's gate), the adapter, `budget`,
    and the executor a CPU server resolves to (the model in a worker process: pinning.py)."""
    args = multi_rank.engine_args(
        model, "--enable-expert-parallel", "--scheduler-cls", ADAPTER, "--distributed-executor-backend", "mp"
    )
    args[args.index("--max-num-batched-tokens") + 1] = str(budget)
    return args


def every_size(url: str, model: Path, budget: int) -> None:
    """One request of each prompt length from 1 to `budget`, one at a time, one output token:
    each a step of its own token count. On the CPU engine a step pays about 2.5 ms the first
    time its process runs its count (vLLM's CPU linears have oneDNN make a kernel for it:
    docs/measurements/served-vs-table.md), and an engine served for hours has run every count its budget
    allows; so has this one before its loads. No two prompts share a first token, so none
    hits the prefix cache (a hit would run fewer tokens)."""
    vocab = json.loads((model / "tokenizer.json").read_text())["model"]["vocab"]
    ids = sorted(vocab.values())[len(vocab) // 4 :]  # past the byte tokens, below the vocabulary's end
    if budget > len(ids):  # first tokens would repeat
        raise SystemExit(f"a token budget of {budget} passes the {len(ids)} first tokens the warm-up can give")
    for length in range(1, budget + 1):
        prompt = [ids[(31 * length + 17 * i) % len(ids)] for i in range(length)]
        body = json.dumps({"model": str(model), "prompt": prompt, "max_tokens": 1, "temperature": 0}).encode()
        request = urllib.request.Request(
            f"{url}/v1/completions", body, {"Content-Type": "application/json"}, method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                response.read()
        except urllib.error.HTTPError as err:
            raise SystemExit(f"the warm-up's prompt of {length} token(s) was refused: {err.read().decode()}") from None


def trace_age(trace: Path) -> float:
    """Seconds from the trace's start (its header's started_at) to now."""
    started = trace_lines(trace)[0]["started_at"].replace("Z", "+00:00")
    return time.time() - datetime.fromisoformat(started).timestamp()


def serve(model: Path, dataset: Path, out: Path, load: Load, pinned: bool) -> Served:
    """Serve both loads with the trace on; check the trace against the server's own count."""
    trace = out / "trace"
    out.mkdir(parents=True, exist_ok=True)
    args = [*engine_args(model, load.budget), "--additional-config", json.dumps({"kvwarm_trace": {"out": str(trace)}})]
    rest, worker = cores()
    on = rest if pinned and worker is not None else None
    with api_server(args, pinning_env(pinned), out / "server.log") as server:
        if on and not pin_session(server.pid):
            raise SystemExit(f"no executor worker process under the API server {server.pid}: cannot pin it")
        placement = (
            f"pinned: the executor's worker on core {worker}, API server, engine core and client on cores "
            f"{sorted(rest)} (sched_setaffinity per thread once the server is up)"
            if on
            else "unpinned: VLLM_CPU_OMP_THREADS_BIND=nobind, server, client and engine on every core"
        )
        placement += "; threads: " + where(server.pid)
        served = Served(trace, pinned, placement)
        every_size(server.url, model, load.budget)
        served.warm_up_seconds = trace_age(trace)  # every warm-up step's update ended before its response
        datasets = [
            random_dataset(2 * load.budget, load.output_len, 0.5),
            sharegpt_dataset(dataset, load.output_len),
        ]
        with RunQueue(server.pid) as waits:
            for i, data in enumerate(datasets):
                argv = load_args(server.url, str(model), data, load.requests, load.rate, seed=i)
                served.loads.append(run_load(argv, out / f"load{i}.log", cpus=on))
        served.runqueue = waits.figures()

        def counts():
            return len(trace_lines(trace)[1]), metric(server.url, "vllm:iteration_tokens_total_count")

        served.steps, served.counted = settled(counts)
    _, steps = trace_lines(trace)
    served.sending = sum(1 for s in steps if s.outputs)
    served.mixed = sum(1 for s in steps if s.decode_requests and s.prefill_requests)
    served.load_average = os.getloadavg()
    return served
