"""The served side: the patched CPU engine behind vLLM's OpenAI server with the trace on,
loaded by vLLM's own client with random and ShareGPT-format prompts at Poisson arrivals,
the worker on a core of its own or not; what the trace and the server counted.

Pinned, as a real host pins an engine: once the server is up, every thread of the engine-core
process (its main thread, which runs the model, its input, output and ZMQ threads, the
trace's writer) is moved to the last core, every thread of the API server process to the
others, and the client starts there (sched_setaffinity per thread: a mask is per thread;
VLLM_CPU_OMP_THREADS_BIND=<that core> too, though on its own it left the engine core's main
thread on every core here). The server is not restricted before it starts: its engine core
would inherit the mask. Where each engine-core thread may run is read back from /proc and
printed. Unpinned: nobody is pinned (VLLM_CPU_OMP_THREADS_BIND=nobind), server, client and
engine share every core.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
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
    load_average: tuple[float, float, float] = (0.0, 0.0, 0.0)


def engine_args(model: Path, budget: int) -> list[str]:
    """The engine arguments the server and both tables share: the engine tests' (tiny model,
    eager, prefix caching), experts in parallel (the warm-up's gate), the adapter, `budget`."""
    args = multi_rank.engine_args(model, "--enable-expert-parallel", "--scheduler-cls", ADAPTER)
    args[args.index("--max-num-batched-tokens") + 1] = str(budget)
    return args


def cores() -> tuple[set[int], int | None]:
    """(the cores the rest runs on, the worker's core) when pinned; None where one core is all."""
    mine = sorted(os.sched_getaffinity(0))
    return (set(mine[:-1]), mine[-1]) if len(mine) > 1 else (set(mine), None)


def pinning_env(pinned: bool) -> dict[str, str]:
    _, worker = cores()
    return {"VLLM_CPU_OMP_THREADS_BIND": str(worker) if pinned and worker is not None else "nobind"}


def thread_cores(pid: int) -> dict[str, str]:
    """Each thread name of a process with the cores it may run on (/proc)."""
    found: dict[str, set[str]] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            allowed = next(
                line.split(":", 1)[1].strip()
                for line in (task / "status").read_text().splitlines()
                if line.startswith("Cpus_allowed_list")
            )
        except (OSError, StopIteration):
            continue
        found.setdefault(allowed, set()).add(name)
    return {cpus: ", ".join(sorted(names)[:6]) + (" ..." if len(names) > 6 else "") for cpus, names in found.items()}


def pin_threads(pid: int, cpus: set[int]) -> None:
    """Every thread of process `pid` onto `cpus` (an affinity mask is per thread)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cpus)
        except OSError:  # gone meanwhile
            continue


def engine_core_pid(server_pid: int) -> int | None:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getsid(int(entry.name)) == server_pid and b"EngineCore" in (entry / "cmdline").read_bytes():
                    return int(entry.name)
            except OSError:
                continue
    return None


def serve(model: Path, dataset: Path, out: Path, load: Load, pinned: bool) -> Served:
    """Serve both loads with the trace on; check the trace against the server's own count."""
    trace = out / "trace"
    out.mkdir(parents=True, exist_ok=True)
    args = [*engine_args(model, load.budget), "--additional-config", json.dumps({"kvwarm_trace": {"out": str(trace)}})]
    rest, worker = cores()
    on = rest if pinned and worker is not None else None
    with api_server(args, pinning_env(pinned), out / "server.log") as server:
        core = engine_core_pid(server.pid)
        if on:
            if core is None:
                raise SystemExit(f"no engine-core process under the API server {server.pid}: cannot pin it")
            pin_threads(core, {worker})
            pin_threads(server.pid, on)
        placement = (
            f"pinned: engine core on core {worker}, API server and client on cores {sorted(rest)} "
            "(sched_setaffinity per thread once the server is up)"
            if on
            else "unpinned: VLLM_CPU_OMP_THREADS_BIND=nobind, server, client and engine on every core"
        )
        if core is not None:
            placement += "; engine-core threads: " + "; ".join(f"[{c}] {n}" for c, n in thread_cores(core).items())
        served = Served(trace, pinned, placement)
        datasets = [
            random_dataset(2 * load.budget, load.output_len, 0.5),
            sharegpt_dataset(dataset, load.output_len),
        ]
        for i, data in enumerate(datasets):
            argv = load_args(server.url, str(model), data, load.requests, load.rate, seed=i)
            served.loads.append(run_load(argv, out / f"load{i}.log", cpus=on))

        def counts():
            return len(trace_lines(trace)[1]), metric(server.url, "vllm:iteration_tokens_total_count")

        served.steps, served.counted = settled(counts)
    _, steps = trace_lines(trace)
    served.sending = sum(1 for s in steps if s.outputs)
    served.mixed = sum(1 for s in steps if s.decode_requests and s.prefill_requests)
    served.load_average = os.getloadavg()
    return served
