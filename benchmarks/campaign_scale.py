"""A sweep's cost per row at campaign scale: N decode points on fake KV (the rows' own cost, not
the model's), on one rank of the real CPU engine (the tiny MoE, built and stepped as the sweep
command builds and steps it: its adapter, its SweepRun, its artifact writer) and on two
data-parallel ranks through the real TCPStore exchange (the real Schedulers stepped in one
process, the model runner's part played: kvwarm_testing.rank_sweeps, as test_long_sweep).

Per side it prints (kvwarm_testing.campaign says how each is taken):
- rows per minute per decile of the sweep, and the last decile's over the first;
- the first and the last decile's points swept again, each on its own from fresh: their time
  per row there over their time per row here, and the last's over the first's; a flat cost
  per row keeps it at 1 (target: 0.9 or more). The raw rates move along a table (its later
  rungs run narrower and shallower points), so they alone would hide a cost that grows;
- the engine thread's longest stall at a point boundary (target: 50 ms or less), the same
  without the artifact writer's writes in it, and the longest boundary from end to end; the
  writer's longest write and its share of each decile's time;
- resident memory (VmRSS) per 10,000 rows: its growth from the end of the first decile to
  the end, over the rows between.

The points: distinct decode points, as a table holds them (a repeated point is refused): one
rank B 1 to 32 at contexts of 2 to 99 tokens a request; two ranks B 1 to 8 at K from 2B to
1,500, as test_long_sweep.

Full run (docs/measurements/campaign-scale.md): `--points 50000 --dp-points 10000`. Quick mode
(`--quick`, CI): 1,500 points on one rank, 800 per rank at DP = 2. The last line is the JSON
result: the one rank's last/first ratio against the fresh sweep, target 0.9 or more.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from _engine import release_label, run_in_temp_dir  # importing it sets the engine's environment
from kvwarm_testing import tiny_models

from kvwarm_build.sessions import quick_mode

NEEDS_ENGINE = True  # noxfile: run in the release's CPU engine venv

QUICK = quick_mode(sys.argv, os.environ)
TARGET_RATIO, TARGET_STALL_MS = 0.9, 50.0
ENGINE_ARGS = [
    "--dtype",
    "float32",
    "--max-model-len",
    "1024",
    "--block-size",
    "32",
    "--max-num-seqs",
    "32",
    "--max-num-batched-tokens",
    "256",
    "--enforce-eager",
    "--enable-expert-parallel",
    "--seed",
    "0",
]


class Patches:
    """What rank_runs asks of pytest's MonkeyPatch (setenv, setattr, context), undone by undo():
    the engine's venv has no pytest."""

    def __init__(self):
        self._undo: list = []

    def setenv(self, name: str, value: str) -> None:
        old = os.environ.get(name)
        self._undo.append(lambda: os.environ.pop(name, None) if old is None else os.environ.update({name: old}))
        os.environ[name] = value

    def setattr(self, target, name: str, value) -> None:
        old = getattr(target, name)
        self._undo.append(lambda: setattr(target, name, old))
        setattr(target, name, value)

    @contextmanager
    def context(self):
        local = Patches()
        try:
            yield local
        finally:
            local.undo()

    def undo(self) -> None:
        while self._undo:
            self._undo.pop()()


def decode_points(batches: range, contexts: range) -> list[tuple[int, int]]:
    """Distinct (K, B): every K a batch of B requests at these contexts a request reads."""
    return [(k, b) for b in batches for k in range(b * contexts.start, b * contexts.stop)]


def points_file(path: Path, points: list[tuple[int, int]]) -> Path:
    decode = [{"total_kv_read_tokens": k, "batch_size": b} for k, b in points]
    path.write_text(json.dumps({"schema_version": 1, "decode": decode}))
    return path


def one_rank(tmp: Path, count: int) -> dict:
    """`count` points swept by the sweep command's own engine, adapter and run, in process;
    then its first and last decile's points, each swept fresh in the same engine."""
    from kvwarm_testing.campaign import Watch, ends, figures
    from kvwarm_testing.engine import fp32_moe_refusal
    from vllm.kvwarm.sweep.command import engine_args_from, engine_config
    from vllm.kvwarm.sweep.run import SweepRun
    from vllm.v1.engine.llm_engine import LLMEngine

    os.environ["DYN_BENCH_KV_WARMUP"] = "off"  # fake KV: no chains, no dataset
    tmp.mkdir(parents=True)
    model = tiny_models.make_tiny_qwen3_moe(tmp / "tiny-moe", kv_heads=8)
    points = decode_points(range(1, 33), range(2, 100))
    assert len(points) >= count, f"at most {len(points)} distinct points on one rank"
    argv = ["--model", str(model), *ENGINE_ARGS]
    if fp32_moe_refusal():  # this CPU's fused MoE takes bf16 layers only
        argv[argv.index("float32")] = "bfloat16"
    spec = {"points": str(points_file(tmp / "long.json", points[:count])), "out": str(tmp / "long")}
    engine = LLMEngine.from_vllm_config(engine_config(engine_args_from(argv, spec)), disable_log_stats=True)
    core = engine.engine_core.engine_core
    scheduler = core.scheduler

    def sweep(spec: dict, planned: int) -> Watch:
        if scheduler.kvwarm_run is None or scheduler.kvwarm_sweep.done:  # a later sweep, as a test adapter takes one
            scheduler.kvwarm_run = SweepRun(scheduler, spec)
            scheduler.kvwarm_sweep = scheduler.kvwarm_run.sweep
        scheduler.kvwarm_run.points_log.quiet = True  # this benchmark prints its own lines
        watch = Watch(scheduler, scheduler.kvwarm_sweep, scheduler.kvwarm_run.writer)
        while scheduler.has_requests():
            core.step_fn()
            watch.note_memory(len(watch.rows), planned)
        artifact = json.loads((Path(spec["out"]) / "sweep.json").read_text())
        if artifact["status"] != "complete" or len(artifact["results"]) != planned:
            sys.exit(f"the one-rank sweep of {spec['points']} ended {artifact['status']}: {artifact['error']}")
        return watch

    long = sweep(spec, count)
    fresh = [
        sweep({"points": str(points_file(tmp / f"{name}.json", taken)), "out": str(tmp / name)}, len(taken))
        for name, taken in zip(("first", "last"), ends(long))
    ]
    engine.engine_core.shutdown()
    return figures([long], [fresh[0]], [fresh[1]])


def two_ranks(tmp: Path, count: int) -> dict:
    """`count` distinct points on each of two ranks through the real TCPStore exchange; then
    its first and last decile's points, each swept fresh on two new ranks."""
    from kvwarm_testing.campaign import Watch, ends, figures
    from kvwarm_testing.rank_sweeps import artifacts, rank_runs, view
    from kvwarm_testing.real_kv import step_scheduler

    def sweep(folder: Path, points: list) -> list[Watch]:
        folder.mkdir(parents=True)
        patches = Patches()
        try:
            schedulers, out = rank_runs(folder, patches, points, timeout=600)
            watches = [Watch(s, s.kvwarm_sweep, s.kvwarm_run.writer) for s in schedulers]
            for scheduler in schedulers:
                scheduler.kvwarm_run.points_log.quiet = True
            while busy := [s for s in schedulers if s.has_requests()]:
                for scheduler in busy:
                    step_scheduler(scheduler)
                watches[0].note_memory(sum(len(w.rows) for w in watches), 2 * len(points))
            combined = view(schedulers[0])
            per_rank, _ = artifacts(out, "store")
        finally:
            patches.undo()
        done = [len(a["results"]) for a in per_rank]
        if combined["status"] != "complete" or done != [len(points)] * 2:
            sys.exit(f"the two-rank sweep in {folder} ended {combined['status']}: {done} rows of {len(points)}")
        return watches

    points = [(k, b) for b in range(1, 9) for k in range(2 * b, min(1000 * b, 1500))][:count]
    assert len(points) == count, f"at most {len(points)} distinct points at DP = 2"
    long = sweep(tmp / "long", points)
    first, last = (
        sweep(tmp / name, [(k, b) for k, b in taken]) for name, taken in zip(("first", "last"), ends(long[0]))
    )
    return figures(long, first, last)


def main() -> None:
    from kvwarm_testing.campaign import lines

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--points", type=int, default=1500 if QUICK else 50_000, help="points on one rank")
    p.add_argument("--dp-points", type=int, default=800 if QUICK else 10_000, help="points per rank at DP = 2")
    p.add_argument("--only", choices=("one", "dp"), help="one side only")
    args = p.parse_args([a for a in sys.argv[1:] if a != "--quick"])
    release, sides = release_label(), {}

    def run(tmp: Path) -> None:
        if args.only != "dp":
            sides["one rank"] = one_rank(tmp / "one", args.points)
            print("\n".join(lines("one rank (real CPU engine, tiny MoE)", sides["one rank"])), flush=True)
        if args.only != "one":
            sides["DP = 2"] = two_ranks(tmp / "dp", args.dp_points)
            print("\n".join(lines("DP = 2 (TCPStore exchange, scheduler harness)", sides["DP = 2"])), flush=True)

    started = time.monotonic()
    run_in_temp_dir(run)
    load = os.getloadavg()
    print(f"{time.monotonic() - started:.0f} s in all; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    name, side = next(iter(sides.items()))
    kind = "one_rank" if name == "one rank" else "dp2"
    print(
        json.dumps(
            {
                "metric": f"campaign_scale_{kind}_{side['rows']}rows_{release}" + ("_quick" if QUICK else ""),
                "value": round(side["relative_ratio"], 3),
                "unit": "last/first decile, rows against a fresh sweep's",
                "baseline": round(side["ratio"], 3),
                "ratio": round(side["relative_ratio"], 3),
                "target": f"ratio >= {TARGET_RATIO}; stall <= {TARGET_STALL_MS:g} ms (longest "
                f"{max(s['stall_ms'] for s in sides.values()):.1f} ms, "
                f"{max(s['stall_less_writes_ms'] for s in sides.values()):.1f} ms without the writer's writes)",
            }
        )
    )


if __name__ == "__main__":
    main()
