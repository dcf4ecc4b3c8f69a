"""What a real-KV table costs against a fake-KV one: the same points swept with the warm-up on
and off, alternated in one run of one engine, and where the real side's extra time goes.

Runs inside a release's engine venv (`nox -s bench-S -- table_cost`; NEEDS_ENGINE). One
in-process CPU engine of the tiny MoE (random weights, attention only) serves every sweep. A
sweep is a SweepRun as the adapter builds it from `additional_config` (rows on disk, the
artifact, a generated grid laid in the pool), driven by the engine's own steps. Each step is
put in the bucket of the sweep's phase once its schedule() ran (sweep.phase: a rung's chain
build, a restage of them, exact state's catch-ups, a point's own steps, the steps between),
timed from step_fn()'s start to its end.

The bound of the builds: one prefill of the chains' tokens at the engine's own prefill rate,
measured in the same run: after each real sweep the chains it built (its rungs' tokens, in its
order) are sent again as plain requests of one token, salted apart from the sweep's, and
prefilled; their prefix reuse across rungs is the sweep's own (chain i of a deeper rung
extends chain i of the one before). Making and adding the requests is timed with their steps,
as a build's is; the tokens are given (their text is not tokenized in the bound's time).

Workloads: a decode grid to 32,768 tokens of KV (B = 1, 4 and 16); a `--grid` with prefill
points (laid around capture sizes given for it: the CPU platform has none); with the full run,
a points file of 1,000 points and more (decode and prefill), whose whole ratio is the result.
The sides alternate (the real one first in odd rounds), three rounds, the median round's
figures printed (a round's by its whole ratio); --quick (or
KVWARM_BENCH_QUICK=1): a smaller decode grid and grid, one round. Targets, printed beside the
figures and held on each figure's least over the rounds (a shared host's noise only adds time):
chain builds within 1.1x their bound, the real points' own steps within 1.3x the fake ones'.
The time the sweeps spend tokenizing their chains' text is printed apart (inside their builds'
schedule(), or before). The last line is the JSON result.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

from _engine import kvwarm_engine, release_label, run_in_temp_dir  # importing it sets the engine's environment
from kvwarm_testing import tiny_models

from kvwarm_build.sessions import quick_mode

NEEDS_ENGINE = True  # noxfile: run in the release's CPU engine venv

QUICK = quick_mode(sys.argv, os.environ)
ROUNDS = 1 if QUICK else 3
MAX_MODEL_LEN, BLOCK, BATCHED_TOKENS, MAX_SEQS = 4096, 32, 2048, 32
BUILD_TARGET, POINTS_TARGET = 1.1, 1.3
BUCKETS = ("build", "restage", "catch_up", "points", "between")
GRID_CAPS = {"decode_batches": 3, "kv_ladder": 3, "prefill_tokens": 3, "mixed": 1, "capture_sizes": [1, 2, 4, 8]}
if not QUICK:
    GRID_CAPS = {
        "decode_batches": 6,
        "kv_ladder": 6,
        "prefill_tokens": 6,
        "mixed": 2,
        "capture_sizes": [1, 2, 4, 8, 16],
    }


def ladder(batch: int, top: int, count: int) -> list[int]:
    """`count` K values from 2B to `top`, spaced geometrically (whole, distinct)."""
    low = 2 * batch
    return sorted({round(low * (top / low) ** (j / max(1, count - 1))) for j in range(count)})


def decode_grid() -> dict:
    """Decode points to 32,768 tokens of KV (B = 16 at 2,048 a request); quick: to 4,096."""
    batches, per = ((1, 8), 3) if QUICK else ((1, 4, 16), 6)
    top = 4096 if QUICK else 32768
    points = [(k, b) for b in batches for k in ladder(b, min(top, b * 2000), per)]
    return {"schema_version": 1, "decode": [{"total_kv_read_tokens": k, "batch_size": b} for k, b in points]}


def big_grid() -> dict:
    """1,000 points and more: decode at eight batch sizes along a K ladder each, prefill at
    three batch sizes, eight new-token counts and four prefix depths."""
    decode = [(k, b) for b in (1, 2, 3, 4, 6, 8, 12, 16) for k in ladder(b, b * 2000, 140)]
    prefill = [
        (n, p * b, b) for b in (1, 2, 4) for n in (8, 16, 32, 64, 128, 256, 512, 1024) for p in (0, 256, 512, 1024)
    ]
    return {
        "schema_version": 1,
        "decode": [{"total_kv_read_tokens": k, "batch_size": b} for k, b in decode],
        "prefill": [{"total_prefill_tokens": n, "total_kv_read_tokens": p, "batch_size": b} for n, p, b in prefill],
    }


class DrawClock:
    """The time the sweeps spend drawing (tokenizing) their chains' text, inside a rung's build
    (its schedule()) and elsewhere (the sweep's set-up): ChainText's calls, timed."""

    def __init__(self):
        from vllm.kvwarm.sweep import controller
        from vllm.kvwarm.sweep.dataset import ChainText

        self.building, self.seconds = False, {"in builds": 0.0, "elsewhere": 0.0}
        draw, add = ChainText.__call__, controller.add_chains

        def adding(*args, **kwargs):  # a rung's chains added, in the schedule() that starts its build
            self.building = True
            try:
                return add(*args, **kwargs)
            finally:
                self.building = False

        controller.add_chains = adding

        def timed(text, i, depth):
            started = time.perf_counter()
            tokens = draw(text, i, depth)
            self.seconds["in builds" if self.building else "elsewhere"] += time.perf_counter() - started
            return tokens

        ChainText.__call__ = timed


class Steps:
    """Every engine step timed and put in the bucket of the sweep's phase after its schedule()."""

    def __init__(self, core):
        from vllm.kvwarm.sweep.phase import Phase

        self.core, self.scheduler = core, core.scheduler
        self.kind = {Phase.BUILDING: "build", Phase.CATCHING_UP: "catch_up", Phase.MEASURING: "points"}
        self.tokens = 0  # tokens the last schedule() scheduled
        self._bucket = "between"
        schedule = self.scheduler.schedule

        def classified(*args, **kwargs):
            output = schedule(*args, **kwargs)
            sweep = self.scheduler.kvwarm_sweep
            self._bucket = self.kind.get(sweep.phase, "between") if sweep is not None else "plain"
            self.tokens = output.total_num_scheduled_tokens
            return output

        self.scheduler.schedule = classified  # the engine core calls it through the instance

    def step(self) -> tuple[str, float, int]:
        self._bucket, self.tokens = "between", 0
        started = time.perf_counter()
        self.core.step_fn()
        return self._bucket, time.perf_counter() - started, self.tokens


def sweep_side(steps: Steps, spec: dict, environ: dict) -> dict:
    """One sweep to its end: its wall time, seconds per bucket, its chains' tokens computed,
    its rows and stages."""
    from vllm.kvwarm.sweep.run import SweepRun

    scheduler = steps.scheduler
    started = time.perf_counter()
    run = SweepRun(scheduler, spec, environ)
    scheduler.kvwarm_run, scheduler.kvwarm_sweep = run, run.sweep
    seconds = dict.fromkeys(BUCKETS, 0.0)
    build, build_tokens, stages = 0.0, 0, 0
    while scheduler.has_requests():
        bucket, took, tokens = steps.step()
        if bucket == "build":
            build, build_tokens = build + took, build_tokens + tokens
        else:
            seconds[bucket] = seconds.get(bucket, 0.0) + took
        if len(run.sweep.stages) > stages:  # a build ended: a rung's first, or a restage of it
            stage = run.sweep.stages[-1]
            again = any((s["batch"], s["depth"]) == (stage["batch"], stage["depth"]) for s in run.sweep.stages[:-1])
            seconds["restage" if again else "build"] += build
            build, stages = 0.0, len(run.sweep.stages)
    wall = time.perf_counter() - started
    scheduler.kvwarm_run = scheduler.kvwarm_sweep = None
    artifact = json.loads(run.writer.artifact_path.read_text())
    if artifact["status"] != "complete":
        sys.exit(f"the sweep in {spec['out']} ended {artifact['status']}: {artifact['error']}")
    rows = len(artifact["results"]) + len(artifact["skipped_points"])
    figures = {"wall": wall, "seconds": seconds, "build_tokens": build_tokens, "rows": rows}
    return {**figures, "stages": run.sweep.stages, "out": spec["out"]}


def bound_side(steps: Steps, stages: list[dict], chain_text, label: str) -> tuple[float, int]:
    """The chains of `stages` prefilled as plain requests of one token, rung after rung, each
    chain salted by its index (as the sweep's are); returns the seconds and tokens computed."""
    from vllm.kvwarm.kv.chains import prefix_hasher
    from vllm.kvwarm.kv.request import greedy_request

    scheduler, seconds, tokens = steps.scheduler, 0.0, 0
    hasher = prefix_hasher(scheduler)
    for n, stage in enumerate(stages):
        texts = [chain_text(i, stage["depth"]) for i in range(stage["batch"])]  # the text is given: not timed
        started = time.perf_counter()  # the requests made and added are, as the sweep's chains are
        for i, text in enumerate(texts):
            salt = f"bound-{label}-{i}"
            scheduler.add_request(greedy_request(f"{salt}-{n}", text, 1, cache_salt=salt, block_hasher=hasher))
        seconds += time.perf_counter() - started
        while scheduler.has_requests():
            _, took, computed = steps.step()
            seconds, tokens = seconds + took, tokens + computed
    return seconds, tokens


def workload(name: str, steps: Steps, tmp: Path, what: dict, environ: dict, chain_text) -> dict:
    """Both sides of a workload, alternating, ROUNDS times; the median round's figures."""
    rounds = []
    for round_ in range(1, ROUNDS + 1):
        sides = {}
        order = ("real", "fake") if round_ % 2 else ("fake", "real")
        for side in order:
            warmup = {"real": "force", "fake": "off"}[side]
            spec = {**what, "out": str(tmp / f"{name}-{side}-{round_}")}
            sides[side] = sweep_side(steps, spec, {**environ, "DYN_BENCH_KV_WARMUP": warmup})
            if not steps.scheduler.reset_prefix_cache():
                sys.exit(f"{name}: blocks still in use after the {side} sweep")
        real = sides["real"]
        real["bound"], real["bound_tokens"] = bound_side(steps, real["stages"], chain_text, f"{name}{round_}")
        steps.scheduler.reset_prefix_cache()
        rounds.append(sides)
        print(
            f"  round {round_} ({' first, '.join(order)} second): real {real['wall']:.2f} s, fake "
            f"{sides['fake']['wall']:.2f} s; {real['rows']} row(s) a side",
            flush=True,
        )
    ratios = [r["real"]["wall"] / r["fake"]["wall"] for r in rounds]
    median = rounds[ratios.index(statistics.median_low(ratios))]
    report(name, median)
    agree(median)
    best = {  # each figure's least over the rounds: the host's noise only ever adds time
        "build": min(r["real"]["seconds"]["build"] for r in rounds),
        "bound": min(r["real"]["bound"] for r in rounds),
        "points": min(r["real"]["seconds"]["points"] for r in rounds),
        "fake_points": min(r["fake"]["seconds"]["points"] for r in rounds),
        "wall": min(r["real"]["wall"] for r in rounds),
        "fake_wall": min(r["fake"]["wall"] for r in rounds),
        "rows": median["real"]["rows"],
    }
    print(
        f"    the least of {ROUNDS} round(s): builds {best['build']:.2f} s against their bound {best['bound']:.2f} s "
        f"x{best['build'] / best['bound']:.2f}; points' steps {best['points']:.2f} s against fake "
        f"{best['fake_points']:.2f} s x{best['points'] / best['fake_points']:.2f}; whole {best['wall']:.2f} s "
        f"against {best['fake_wall']:.2f} s x{best['wall'] / best['fake_wall']:.2f}",
        flush=True,
    )
    return best


def report(name: str, sides: dict) -> None:
    real, fake = sides["real"], sides["fake"]
    rs, fs = real["seconds"], fake["seconds"]
    rate = real["bound_tokens"] / real["bound"] if real["bound"] else 0.0
    build_ratio = rs["build"] / real["bound"] if real["bound"] else float("nan")
    points_ratio = rs["points"] / fs["points"] if fs["points"] else float("nan")
    print(f"  {name}: real {real['wall']:.2f} s against fake {fake['wall']:.2f} s: x{real['wall'] / fake['wall']:.2f}")
    print(f"    the real side's extra {real['wall'] - fake['wall']:+.2f} s:", flush=True)
    print(
        f"      chain builds   {rs['build']:7.2f} s ({real['build_tokens']} tokens computed); bound "
        f"{real['bound']:.2f} s ({real['bound_tokens']} tokens at the engine's {rate:.0f} tokens/s): "
        f"x{build_ratio:.2f} (target <= {BUILD_TARGET})"
    )
    print(f"      restages       {rs['restage']:7.2f} s")
    print(f"      catch-ups      {rs['catch_up']:7.2f} s (settle steps: none set, DYN_BENCH_KV_WARMUP_SETTLE_STEPS)")
    print(
        f"      points' steps  {rs['points']:7.2f} s against fake {fs['points']:.2f} s: x{points_ratio:.2f} "
        f"(target <= {POINTS_TARGET}; {rs['points'] - fs['points']:+.2f} s)"
    )
    print(f"      between points {rs['between']:7.2f} s against fake {fs['between']:.2f} s", flush=True)


def agree(sides: dict) -> None:
    """The fake side's rows against the real side's, point by point (record.report's A/B)."""
    from vllm.kvwarm.record.report import compare
    from vllm.kvwarm.record.runs import load_run

    c = compare(load_run(sides["real"]["out"]), load_run(sides["fake"]["out"]))
    ratios = [b.median_ms / a.median_ms for a, b in c.joined]
    print(
        f"    fake against real, point by point: MAPE {c.mape:.2f}% over {len(c.joined)} point(s), fake/real "
        f"{min(ratios):.2f} to {max(ratios):.2f} (median {statistics.median(ratios):.2f})",
        flush=True,
    )


def main() -> None:
    run_in_temp_dir(run)


def run(tmp: Path) -> None:
    from vllm.kvwarm.sweep.dataset import ChainText, load_dataset

    release = release_label()
    model = tiny_models.make_tiny_qwen3_moe(tmp / "tiny-moe")
    dataset = tiny_models.write_sharegpt(tmp / "sharegpt.json", conversations=256)
    engine = kvwarm_engine(
        model,
        block_size=BLOCK,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=BATCHED_TOKENS,
        max_num_seqs=MAX_SEQS,
    )
    steps, draws = Steps(engine.engine_core.engine_core), DrawClock()
    tokenizer = engine.get_tokenizer()
    conversations, _ = load_dataset(dataset)
    chain_text = ChainText(conversations, lambda s: tokenizer.encode(s, add_special_tokens=False))
    environ = {
        "DYN_BENCH_KV_WARMUP_DATASET": str(dataset),
        "DYN_BENCH_GIANT_KV_REPEATS": "3",
        "DYN_BENCH_GIANT_KV_THRESHOLD": "0",  # the fake side times as many steps as the real one
    }
    print(
        f"vLLM {release} CPU engine, tiny MoE (2 layers, 4 experts, fp32); max_model_len {MAX_MODEL_LEN}, block "
        f"{BLOCK}, max_num_batched_tokens {BATCHED_TOKENS}, max_num_seqs {MAX_SEQS}; 3 timed steps a point on "
        f"both sides; {ROUNDS} round(s), the sides alternating",
        flush=True,
    )
    figures = {}
    for name, what in (
        ("decode grid", {"points": decode_grid()}),
        ("grid with prefill points", {"grid": GRID_CAPS}),
        *(() if QUICK else (("grid of 1,000+ points", {"points": big_grid()}),)),
    ):
        if "points" in what:
            path = tmp / f"{name.replace(' ', '-').replace(',', '')}.json"
            path.write_text(json.dumps(what["points"]))
            what = {"points": str(path)}
        print(f"{name}:", flush=True)
        draws.seconds = dict.fromkeys(draws.seconds, 0.0)
        figures[name] = workload(name, steps, tmp, what, environ, chain_text)
        print(
            f"    the chains' text drawn (tokenized), all real sweeps: {draws.seconds['in builds']:.3f} s inside "
            f"their builds' schedule(), {draws.seconds['elsewhere']:.3f} s before (and the bound's)",
            flush=True,
        )
    whole = figures["grid with prefill points" if QUICK else "grid of 1,000+ points"]
    builds = [f["build"] / f["bound"] for f in figures.values()]
    points = [f["points"] / f["fake_points"] for f in figures.values()]
    print(
        f"targets (the least of the rounds): chain builds <= {BUILD_TARGET}x their bound (worst x{max(builds):.2f}); "
        f"real points' steps <= {POINTS_TARGET}x the fake ones' (worst x{max(points):.2f}); the whole ratio of the "
        f"{whole['rows']}-row workload x{whole['wall'] / whole['fake_wall']:.2f}",
        flush=True,
    )
    print(
        json.dumps(
            {
                "metric": f"table_cost_real_over_fake_{whole['rows']}rows_{release}" + ("_quick" if QUICK else ""),
                "value": round(whole["wall"], 2),
                "unit": "s",
                "baseline": round(whole["fake_wall"], 2),
                "ratio": round(whole["wall"] / whole["fake_wall"], 2),
                "target": f"builds <= {BUILD_TARGET}x bound, points <= {POINTS_TARGET}x fake",
            }
        )
    )


if __name__ == "__main__":
    main()
