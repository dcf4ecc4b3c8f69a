"""Engine processes: the case one runs (run_case, in a process started as
`step_fidelity.py --case NAME`), and the main process's start and read-back of each (run_engine)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from kvwarm_testing import tiny_models

from .cases import ALLOCATORS, CAPTURE_SIZES, CASES, Settings, ladder
from .paired import PairedRun

# The script an engine process runs (`--case`): the benchmark's entry point.
ENTRY = Path(__file__).resolve().parent.parent / "step_fidelity.py"


def isolate_this_thread() -> None:
    """Leave this thread's CPU to it: every other thread of the process (vLLM's gloo groups
    start several loop threads, each waking about 100 times a second) goes to the other CPUs."""
    here, main = os.sched_getaffinity(0), threading.get_native_id()
    others = set(range(os.cpu_count() or 1)) - here
    if not others:
        sys.exit("--isolate needs a CPU besides the measuring one")
    for tid in (int(t) for t in os.listdir("/proc/self/task")):
        if tid != main:
            with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
                os.sched_setaffinity(tid, others)


def run_case(name: str, out: Path, settings: Settings) -> None:
    from vllm.kvwarm.kv.layout import group_layouts
    from vllm.kvwarm.kv.state_mode import STATE_ENV, decide_state_mode
    from vllm.kvwarm.sweep.dataset import ChainText, load_dataset
    from vllm.v1.engine.llm_engine import LLMEngine

    case = CASES[name]
    if settings.flush_denormal:
        import torch

        torch.set_flush_denormal(True)
    if settings.pin:  # every thread of the engine (one OpenMP thread: the caller's) on one CPU
        os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
    with tempfile.TemporaryDirectory() as tmp:
        model = getattr(tiny_models, case.maker)(Path(tmp) / name)
        conversations, _ = load_dataset(tiny_models.write_sharegpt(Path(tmp) / "sharegpt.json"))
        started = time.perf_counter()
        engine = LLMEngine.from_engine_args(engine_args(model, case, settings))
        start_seconds = time.perf_counter() - started
        if settings.pin and settings.isolate:
            isolate_this_thread()
        core = engine.engine_core.engine_core
        loop = engine_loop(core)
        tokenizer = engine.get_tokenizer()
        text = ChainText(conversations, lambda s: tokenizer.encode(s, add_special_tokens=False))
        kvm = core.scheduler.kv_cache_manager
        points = ladder(case, settings)
        results = []
        for mode in settings.modes or case.modes if case.hybrid() else case.modes:
            lending = None
            if mode is not None:
                decision = decide_state_mode(kvm, group_layouts(kvm), {STATE_ENV: mode})
                if decision.mode != mode:
                    results.append({"mode": mode, "refused": decision.reason})
                    continue
                lending = decision.lending
            results += PairedRun(core, text, settings, mode, lending).run(points)
            if not core.scheduler.reset_prefix_cache():
                sys.exit(f"reset_prefix_cache() failed after mode {mode}: blocks still in use")
        huge_pages = _huge_pages_kib()
    for r in results:
        for side in ("shadow", "natural"):
            if side in r:
                r[side] = r[side].__dict__
    out.write_text(
        json.dumps(
            {
                "case": name,
                "engine_start_seconds": start_seconds,
                "huge_pages_kib": huge_pages,
                "loop": loop,
                "points": results,
            }
        )
    )


def engine_args(model: Path, case, settings: Settings):
    """The case's engine. By default one step at a time (EngineCore.step) through the sync
    adapter, asked for: on CUDA vLLM would resolve async scheduling on. With gpu_defaults,
    async scheduling at vLLM's default (on: the batch queue; on the CPU engine the platform's
    override is lifted for this process) through the adapter matching the loop vLLM
    resolves, and on CUDA graphs of a few sizes (the CPU engine stays eager)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.kvwarm.sweep.provenance import adapter_for
    from vllm.platforms import current_platform

    if not settings.gpu_defaults:
        sync = "vllm.kvwarm.scheduler.KvWarmScheduler"
        return EngineArgs(model=str(model), scheduler_cls=sync, async_scheduling=False, **case.engine)
    from kvwarm_testing.engine import lift_cpu_overrides

    lift_cpu_overrides(("scheduler_config.async_scheduling",))
    kwargs = dict(case.engine)
    if current_platform.is_cuda():
        kwargs["enforce_eager"] = False
        kwargs["compilation_config"] = {"cudagraph_capture_sizes": CAPTURE_SIZES}
        for key in ("gpu_memory_utilization", "kv_cache_memory_bytes"):
            if getattr(settings, key) is not None:
                kwargs[key] = getattr(settings, key)
    adapter = adapter_for(EngineArgs(model=str(model), **kwargs).create_engine_config())
    return EngineArgs(model=str(model), scheduler_cls=adapter, **kwargs)


def engine_loop(core) -> dict:
    """The loop the engine core runs and what it was built with (the result records it)."""
    config = core.vllm_config
    return {
        "loop": "batch_queue" if core.batch_queue is not None else "sync",
        "scheduler_cls": f"{type(core.scheduler).__module__}.{type(core.scheduler).__name__}",
        "async_scheduling": bool(config.scheduler_config.async_scheduling),
        "cudagraph_mode": str(config.compilation_config.cudagraph_mode),
        "enforce_eager": bool(config.model_config.enforce_eager),
    }


def _huge_pages_kib() -> int:
    """How much of this process's memory transparent huge pages back (the KV cache, if any)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    return 0


def uptime() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f}, {five:.2f}, {fifteen:.2f}"


def run_engine(name: str, run: int, tmp: Path, settings: Settings, in_process: bool = False) -> dict:
    """One engine's measurements: in a process of its own (two engines cannot share one), or
    in this one where it is the only engine (the quick mode: one vLLM import less)."""
    out = tmp / f"{name}-{run}.json"
    started = time.perf_counter()
    if in_process:
        if settings.allocator != "glibc":
            sys.exit(f"the {settings.allocator} allocator needs an engine process of its own")
        run_case(name, out, settings)
    else:
        args = [sys.executable, str(ENTRY), "--case", name, "--out", str(out), "--settings", settings.to_json()]
        env = {**os.environ, **ALLOCATORS[settings.allocator]}
        done = subprocess.run(args, capture_output=True, text=True, check=False, env=env)
        if done.returncode != 0:
            sys.exit(f"the {name} engine (run {run}) failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    result = json.loads(out.read_text())
    result["run"], result["wall_seconds"] = run, time.perf_counter() - started
    print(
        f"  {name} run {run}: {result['wall_seconds']:.0f} s (engine start {result['engine_start_seconds']:.0f} s; "
        f"{result['huge_pages_kib'] >> 10} MiB on huge pages); {uptime()}",
        flush=True,
    )
    return result
