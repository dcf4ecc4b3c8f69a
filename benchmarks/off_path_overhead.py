"""The patched scheduler with the warm-up off against the stock release's, on a real
Scheduler on CPU driving synthetic decode requests for a few thousand steps (CPU time of
schedule() + update_from_output()); and the served-step trace's cost: the adapter
(KvWarmScheduler) with the trace on against the adapter with it off, the same stream,
counting the CPU time of every thread of the engine's process, and apart from it the CPU
time of the trace's writer process (its own process, on another core: what it costs the
host, not the step; docs/validate-reference.md#what-the-trace-costs).

Runs inside a release venv (`nox -s bench-S -- off_path_overhead`); the stock wheel's
venv comes from the cache (made on first use). Each side runs in its own process, the
two alternating; each run schedules the same request stream and prints its time and a
digest of what it scheduled at every step (the fastest of a few drives in that
process). The digests must be equal (same scheduled tokens every step). Medians over the
runs. The trace's cost is reported per step, in microseconds, and against a decode step
of TRACE_STEP_MS (the target: within 1 % of it; docs/validate-reference.md#what-the-trace-costs).
`--quick` (or KVWARM_BENCH_QUICK=1): 500 steps, one run per side, one drive. The last line
is the JSON result.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
# The stock side's venv holds vLLM alone: the test support reaches it by path, not install.
TEST_SUPPORT = HERE.parents[1] / "tests" / "support"
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

LIVE_REQUESTS, MAX_TOKENS = 32, 200
FULL, QUICK = (3000, 5, 3), (500, 1, 1)  # steps per drive, runs per side, drives per run
TARGET_RATIO = 1.01
# The step the trace's cost is held against: a short decode step (a small model at a small
# batch on a GPU takes a few milliseconds; longer steps make the share smaller).
TRACE_STEP_MS = 5.0
SIDES = ("scheduler", "adapter", "traced")  # vLLM's Scheduler; the adapter, trace off; trace on


def drive_scheduler(steps: int, side: str = "scheduler") -> dict:
    """One run: keep LIVE_REQUESTS requests going for `steps` steps; time schedule() +
    update_from_output() and digest every step's scheduled tokens. `side`: one of SIDES."""
    with tempfile.TemporaryDirectory() as tmp:
        return _drive(Path(tmp), steps, side)


def _drive(tmp: Path, steps: int, side: str) -> dict:
    from kvwarm_testing.real_kv import make_request, make_scheduler, runner_output

    cls, config = None, None
    if side != "scheduler":
        from vllm.kvwarm.scheduler import KvWarmScheduler

        cls = KvWarmScheduler
        config = {"kvwarm_trace": {"out": str(tmp / "trace")}} if side == "traced" else None
    scheduler = make_scheduler(
        tmp, num_blocks=2048, max_num_seqs=LIVE_REQUESTS, scheduler_cls=cls, additional_config=config
    )
    next_id, digest, tokens = 0, hashlib.sha256(), 0

    def add_request() -> None:
        nonlocal next_id
        request = make_request(f"r{next_id}", 16 + (next_id * 37) % 300, token=next_id % 200)
        request.sampling_params.max_tokens = MAX_TOKENS
        request.max_tokens = MAX_TOKENS
        scheduler.add_request(request)
        next_id += 1

    for _ in range(LIVE_REQUESTS):
        add_request()
    children = _children_cpu()
    started = time.process_time()  # CPU time: other processes on the host do not count
    for _ in range(steps):
        output = scheduler.schedule()
        scheduled = sorted(output.num_scheduled_tokens.items())
        digest.update(repr(scheduled).encode())
        tokens += output.total_num_scheduled_tokens
        req_ids = [rid for rid, _ in scheduled]
        sampled = [
            [1] if scheduler.requests[rid].num_computed_tokens >= scheduler.requests[rid].num_prompt_tokens else []
            for rid in req_ids
        ]
        outputs = scheduler.update_from_output(output, runner_output(req_ids, sampled)).values()
        finished = sum(o.finish_reason is not None for batch in outputs for o in batch.outputs)
        for _ in range(finished):
            add_request()
    if side == "traced":  # the writer's last lines are part of the cost; its process has ended
        scheduler.kvwarm_trace.close()
    elapsed = time.process_time() - started
    return {
        "seconds": elapsed,
        "children_seconds": _children_cpu() - children,
        "digest": digest.hexdigest(),
        "tokens": tokens,
        "requests": next_id,
    }


def _children_cpu() -> float:
    """CPU seconds of this process's children that have ended (the trace's writer process)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_side(python: str, steps: int, repeats: int, side: str = "scheduler") -> dict:
    path = os.pathsep.join(filter(None, [str(TEST_SUPPORT), os.environ.get("PYTHONPATH")]))
    out = subprocess.run(
        [python, str(HERE), "--worker", str(steps), str(repeats), side],
        capture_output=True,
        text=True,
        env=dict(os.environ, VLLM_TARGET_DEVICE="cpu", PYTHONPATH=path),
        check=False,  # a failed side is reported with its output
    )
    if out.returncode != 0:
        sys.exit(f"benchmark worker under {python} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    from kvwarm_build import project
    from kvwarm_build.releases import find_release, load_releases
    from kvwarm_build.sessions import quick_mode
    from kvwarm_build.upstream.stock_check import stock_venv

    quick = quick_mode(sys.argv, os.environ)
    steps, runs, repeats = QUICK if quick else FULL

    release = find_release(
        load_releases(project.RELEASES), os.environ.get("KVWARM_RELEASE") or load_releases(project.RELEASES)[-1].version
    )
    stock = str(stock_venv(release, project.cache_dir(), log=print))
    sides = {
        "stock": (stock, "scheduler"),
        "patched": (sys.executable, "scheduler"),
        "adapter": (sys.executable, "adapter"),
        "traced": (sys.executable, "traced"),
    }
    print(
        f"release {release.version}: {steps} steps, {LIVE_REQUESTS} live requests, {runs} alternating runs per side",
        flush=True,
    )
    results: dict[str, list[dict]] = {name: [] for name in sides}
    for run in range(runs):
        for name, (python, side) in sides.items():
            result = run_side(python, steps, repeats, side)
            results[name].append(result)
            print(
                f"  run {run + 1} {name}: {result['seconds']:.3f} s"
                + (f" (writer process {result['children_seconds']:.3f} s)" if side == "traced" else "")
                + f", {result['tokens']} tokens, {result['requests']} requests",
                flush=True,
            )
    digests = {r["digest"] for rs in results.values() for r in rs}
    if len(digests) != 1:
        sys.exit("the patched scheduler scheduled different tokens than the stock one")
    print("same scheduled tokens at every step in every run", flush=True)
    ours = statistics.median(r["seconds"] for r in results["patched"])
    baseline = statistics.median(r["seconds"] for r in results["stock"])
    adapter = statistics.median(r["seconds"] for r in results["adapter"])
    traced = statistics.median(r["seconds"] for r in results["traced"])
    trace_us = (traced - adapter) / steps * 1e6
    writer_us = statistics.median(r["children_seconds"] for r in results["traced"]) / steps * 1e6
    print(
        f"the trace: {trace_us:.1f} us per step of {LIVE_REQUESTS} requests in the engine's process (every "
        f"thread), {traced / adapter:.3f}x the adapter's, {trace_us / (TRACE_STEP_MS * 10):.2f} % of a "
        f"{TRACE_STEP_MS:g} ms step (target: within 1 %); its writer process {writer_us:.1f} us of CPU per "
        "step on another core (its start included)",
        flush=True,
    )
    for name, runs in results.items():
        times = [r["seconds"] for r in runs]
        print(
            f"{name}: median {statistics.median(times):.3f} s, min {min(times):.3f} s, "
            f"spread {(max(times) - min(times)) / statistics.median(times):.0%} of the median "
            "(a ratio closer to 1 than this spread is within this host's noise)",
            flush=True,
        )
    print(
        json.dumps(
            {
                "metric": f"off_path_scheduler_overhead_{release.short}" + ("_quick" if quick else ""),
                "value": round(ours, 3),
                "unit": "s",
                "baseline": round(baseline, 3),
                "ratio": round(ours / baseline, 3),
                "target": f"ratio <= {TARGET_RATIO:g}",
                "trace_us_per_step": round(trace_us, 1),
                "trace_share_of_step": round(trace_us / (TRACE_STEP_MS * 1e3), 4),
                "trace_writer_process_us_per_step": round(writer_us, 1),
                "trace_target": f"trace_share_of_step <= 0.01 (of a {TRACE_STEP_MS:g} ms step)",
            }
        )
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        # The fastest of a few drives in one process: interference only ever adds time.
        steps, repeats = map(int, sys.argv[2:4])
        side = sys.argv[4] if len(sys.argv) > 4 else "scheduler"
        drives = [drive_scheduler(steps, side) for _ in range(repeats)]
        print(json.dumps(min(drives, key=lambda d: d["seconds"])))
    else:
        main()
