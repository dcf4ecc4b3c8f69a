"""What exact recurrent state (DYN_BENCH_KV_WARMUP_STATE=exact) costs a decode sweep on a
hybrid model, against copy mode, on the real CPU engine.

Runs inside a release's engine venv (`nox -s bench-S -- state_exact_cost`; NEEDS_ENGINE
gives it the patched cpu-flavour engine). One in-process engine on a random-weight tiny
Qwen3-Next (gated-delta-net + attention, align-mode state) serves both modes; the prefix
cache is reset after each sweep. The same points are swept in each mode, by a Sweep
driven through the KvWarmScheduler adapter as `python -m vllm.kvwarm sweep` does, with the
mode vllm.kvwarm.state_mode.decide_state_mode gives for DYN_BENCH_KV_WARMUP_STATE=copy|exact.

Measured, per mode:
- admission cost per point, at B=4 and B=16: the wall time of the untimed steps from the
  step in which the sweep starts the point up to its first timed step. In copy mode that
  is the admission step alone; in exact mode the catch-up chains' prefill steps, the step
  in which they are parked, and the admission step. Steps are classed from what the
  scheduler ran in them, and the counts are asserted, so a changed flow fails loudly
  instead of timing nothing;
- the sweep's wall time, and its chain build times (the sweep's `stages`; exact mode caps
  prefill chunks at one state block while chains are built).

Contexts lie off state-block boundaries (the catch-ups have tokens to compute). Two rounds,
the modes' order swapped in the second so neither always runs first; medians. `--quick` (or
KVWARM_BENCH_QUICK=1): B=4 alone, 2 points on chains of 3.5 state blocks, one round. The last line is the JSON result
(value: exact's sweep, baseline: copy's).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from _engine import kvwarm_engine, release_label, run_in_temp_dir  # importing it sets the engine's environment
from kvwarm_testing import tiny_models

from kvwarm_build.sessions import quick_mode

NEEDS_ENGINE = True  # noxfile: run in the release's CPU engine venv

QUICK = quick_mode(sys.argv, os.environ)
REPEATS = 3  # the sweep's default steady steps per point
BATCHES, POINTS, ROUNDS = ((4,), 2, 1) if QUICK else ((4, 16), 4, 2)
MODES = ("copy", "exact")
MAX_MODEL_LEN, BATCHED_TOKENS = 2048, 2048


def contexts(state_block: int) -> list[int]:
    """POINTS per-request contexts c, spread over the depths a chain allows. A shadow is
    admitted at c - 1 tokens (its catch-up is that long), so c - 1 sits past a state
    boundary by a quarter, half or three quarters of a block: the catch-up computes that
    many tokens from the boundary state the chain left cached."""
    from vllm.kvwarm.sweep.plan import CHAIN_DEPTH_MARGIN

    # the largest c - 1 a chain covers (quick: chains of about 3 state blocks)
    deepest = MAX_MODEL_LEN - CHAIN_DEPTH_MARGIN - 1 - REPEATS if not QUICK else 3 * state_block + state_block // 2
    boundaries = deepest // state_block
    offsets = (state_block // 4, state_block // 2, 3 * state_block // 4)
    chosen = []
    for j in range(POINTS):
        ctx = (1 + (boundaries - 2) * j // (POINTS - 1)) * state_block + offsets[j % len(offsets)]
        assert ctx <= deepest and ctx % state_block, (ctx, state_block)
        chosen.append(ctx + 1)
    return chosen


@dataclass
class Step:
    seconds: float
    scheduled: dict = field(default_factory=dict)  # request id -> tokens scheduled
    new: frozenset = frozenset()  # ids scheduled as new requests


class StepLog:
    """Times every step_fn() and keeps what the scheduler ran in it, plus the index of
    each step in which the sweep started a point (its _start_point, the one place both
    modes start a point: copy queues the shadows there, exact its catch-up chains)."""

    def __init__(self, core):
        self.core, self.scheduler = core, core.scheduler
        self.steps: list[Step] = []
        self.starts: list[int] = []
        self._last = Step(0.0)
        update = self.scheduler.update_from_output

        def record(output, runner_output):
            self._last = Step(
                0.0, dict(output.num_scheduled_tokens), frozenset(r.req_id for r in output.scheduled_new_reqs)
            )
            return update(output, runner_output)

        self.scheduler.update_from_output = record  # the engine core calls it through the instance

    def watch(self, sweep) -> None:
        start_point = sweep._start_point

        def started(scheduler, plan, records):
            self.starts.append(len(self.steps))  # the step now running
            start_point(scheduler, plan, records)

        sweep._start_point = started

    def step(self) -> None:
        self._last = Step(0.0)  # a step with nothing scheduled may skip the update
        began = time.perf_counter()
        self.core.step_fn()
        self._last.seconds = time.perf_counter() - began
        self.steps.append(self._last)

    def take(self) -> tuple[list[Step], list[int]]:
        taken = self.steps, self.starts
        self.steps, self.starts = [], []
        return taken


def admissions(mode: str, steps: list[Step], starts: list[int]) -> list[dict]:
    """Per point: the untimed steps from its start to its first timed step, classed:
    admit    the step whose new requests are the point's shadows (exactly one);
    prefill  steps computing prompt tokens of requests new in this window (catch-ups);
    idle     nothing scheduled (the sweep parks the catch-ups and meets its ranks).
    Then the point's timed steps: REPEATS steps of its shadows alone, one token each."""
    from vllm.kvwarm.kv.injector import SHADOW_PREFIX

    found = []
    for n, start in enumerate(starts):
        end = starts[n + 1] if n + 1 < len(starts) else len(steps)
        window = steps[start:end]
        admit = next((i for i, s in enumerate(window) if any(r.startswith(SHADOW_PREFIX) for r in s.new)), None)
        if admit is None:
            sys.exit(f"{mode} point {n}: no step admitted its shadows")
        shadows = {r for r in window[admit].new if r.startswith(SHADOW_PREFIX)}
        before = window[:admit]
        fresh = set().union(*(s.new for s in before)) if before else set()
        prefill = [s for s in before if s.scheduled]
        idle = [s for s in before if not s.scheduled]
        if any(set(s.scheduled) - fresh for s in prefill):
            sys.exit(f"{mode} point {n}: an untimed step before admission ran a request not started for it")
        if (mode == "copy") != (not prefill):
            sys.exit(
                f"{mode} point {n}: {len(prefill)} prefill step(s) before admission; expected "
                + ("none" if mode == "copy" else "the catch-up chains' prefill")
            )
        timed = [s for s in window[admit + 1 :] if shadows & set(s.scheduled)]
        if (
            len(timed) != REPEATS
            or window[admit + 1] is not timed[0]
            or any(set(s.scheduled) != shadows or set(s.scheduled.values()) != {1} or s.new for s in timed)
        ):
            sys.exit(
                f"{mode} point {n}: expected {REPEATS} timed steps of its {len(shadows)} shadows alone, "
                f"right after the admission step"
            )
        kinds = {"catch-up": prefill, "idle": idle, "admission": [window[admit]]}
        found.append(
            {
                "batch": len(shadows),
                "ms": 1e3 * sum(s.seconds for s in window[: admit + 1]),
                "steps": {k: len(v) for k, v in kinds.items()},
                "kind_ms": {k: 1e3 * sum(s.seconds for s in v) for k, v in kinds.items()},
                "catchup_tokens": sum(sum(s.scheduled.values()) for s in prefill) / len(shadows),
            }
        )
    return found


def sweep_side(log: StepLog, mode: str, decision, points, text, progress) -> dict:
    """One sweep of every point in `mode`, from its first step to its end."""
    from vllm.kvwarm.sweep.controller import Sweep
    from vllm.kvwarm.sweep.plan import SweepConfig

    scheduler = log.scheduler
    sweep = Sweep(
        points,
        text,
        SweepConfig(
            steady_steps=REPEATS, max_model_len=MAX_MODEL_LEN, state_mode=decision.mode, state_lending=decision.lending
        ),
        progress=lambda message: progress(f"  [{mode}] {message}"),
    )
    log.watch(sweep)
    started = time.perf_counter()
    scheduler.kvwarm_sweep = sweep
    while scheduler.has_requests():
        log.step()
    elapsed = time.perf_counter() - started
    scheduler.kvwarm_sweep = None
    bad = [
        f"K={r.total_kv_read_tokens} B={r.batch_size}: {r.kv_seed_regime} {r.detail or r.sample_reasons}"
        for r in sweep.rows
        if r.kv_seed_regime != "real_kv" or f"kvwarm_state_{mode}" not in r.sample_reasons
    ]
    if bad or len(sweep.rows) != len(points) or not sweep.reset_prefix_cache_ok:
        sys.exit(
            f"{mode}: {len(sweep.rows)}/{len(points)} rows, not all real KV in {mode} mode: {bad}, "
            f"reset_prefix_cache {sweep.reset_prefix_cache_ok}"
        )
    steps, starts = log.take()
    if len(starts) != len(points):
        sys.exit(f"{mode}: {len(starts)} point start(s) seen for {len(points)} point(s)")
    return {
        "seconds": elapsed,
        "admissions": admissions(mode, steps, starts),
        "build": {s["batch"]: s["build_seconds"] for s in sweep.stages},
        "steady": {b: [r.median_seconds for r in sweep.rows if r.batch_size == b] for b in BATCHES},
    }


def main() -> None:
    run_in_temp_dir(run)


def run(tmp: Path) -> None:
    from vllm.kvwarm.kv.catchup import state_block_size
    from vllm.kvwarm.kv.layout import group_layouts
    from vllm.kvwarm.kv.state_mode import STATE_ENV, decide_state_mode
    from vllm.kvwarm.sweep.dataset import ChainText, load_dataset
    from vllm.kvwarm.sweep.points import DecodePoint

    release = release_label()
    tiny = tiny_models
    model = tiny.make_tiny_qwen3_next(tmp / "tiny-qwen3-next")
    conversations, _ = load_dataset(tiny.write_sharegpt(tmp / "sharegpt.json"))
    engine = kvwarm_engine(
        model,
        dtype="bfloat16",
        mamba_ssm_cache_dtype="float32",
        mamba_cache_mode="align",
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=BATCHED_TOKENS,
        max_num_seqs=2 * max(BATCHES),
    )
    log = StepLog(engine.engine_core.engine_core)
    tokenizer = engine.get_tokenizer()
    kvm = log.scheduler.kv_cache_manager
    layouts = group_layouts(kvm)
    decisions = {mode: decide_state_mode(kvm, layouts, {STATE_ENV: mode}) for mode in MODES}
    for mode, decision in decisions.items():
        if decision.mode != mode:
            sys.exit(f"{STATE_ENV}={mode}: this build decides {decision}")
    state_block = state_block_size(layouts)
    ctxs = contexts(state_block)
    points = [DecodePoint(b * c, b) for b in BATCHES for c in ctxs]  # equal contexts: K = B x c

    print(
        f"vLLM {release} CPU engine, tiny Qwen3-Next (3 gated-delta-net + 1 attention layer), align mode, "
        f"state block {state_block}; max_model_len {MAX_MODEL_LEN}, max_num_batched_tokens {BATCHED_TOKENS}; "
        f"R={REPEATS}",
        flush=True,
    )
    print(
        f"contexts per request {ctxs} at B={BATCHES} (shadows admitted at c - 1 = "
        f"{[(c - 1) // state_block for c in ctxs]} blocks + {[(c - 1) % state_block for c in ctxs]} tokens); "
        f"exact lends by {decisions['exact'].lending}",
        flush=True,
    )

    results: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for round_ in range(1, ROUNDS + 1):
        progress = print if round_ == 1 else (lambda message: None)
        for mode in MODES if round_ % 2 else reversed(MODES):
            text = ChainText(conversations, lambda s: tokenizer.encode(s, add_special_tokens=False))
            results[mode].append(sweep_side(log, mode, decisions[mode], points, text, progress))
            if not log.scheduler.reset_prefix_cache():
                sys.exit(f"reset_prefix_cache() failed after the {mode} sweep: blocks still in use")
        print(
            f"round {round_}: " + ", ".join(f"{m} sweep {results[m][-1]['seconds']:.2f} s" for m in MODES), flush=True
        )

    def admitted(mode, b):
        return [a for r in results[mode] for a in r["admissions"] if a["batch"] == b]

    admission_ms = {m: {b: statistics.median(a["ms"] for a in admitted(m, b)) for b in BATCHES} for m in MODES}
    print(
        f"admission per point (median of {POINTS} points x {ROUNDS} rounds), from the point's start to its "
        "first timed step; by kind of step: mean steps, median ms",
        flush=True,
    )
    for b in BATCHES:
        for m in MODES:
            entries = admitted(m, b)
            kinds = ", ".join(
                f"{kind} {statistics.mean(a['steps'][kind] for a in entries):.2f} x "
                f"{statistics.median(a['kind_ms'][kind] for a in entries):.2f} ms"
                for kind in entries[0]["steps"]
                if any(a["steps"][kind] for a in entries)
            )
            steady = 1e3 * statistics.median(v for r in results[m] for v in r["steady"][b])
            print(f"  B={b:2} {m:5}: {admission_ms[m][b]:6.2f} ms ({kinds}); timed step {steady:.2f} ms", flush=True)
        tokens = statistics.mean(a["catchup_tokens"] for a in admitted("exact", b))
        print(
            f"  B={b:2} exact/copy {admission_ms['exact'][b] / admission_ms['copy'][b]:.2f}x; "
            f"{tokens:.0f} tokens computed per catch-up",
            flush=True,
        )
    expected = statistics.mean((c - 1) % state_block for c in ctxs)
    print(
        f"  (a catch-up that starts from the last cached state boundary computes {expected:.0f} on average)", flush=True
    )

    def median_of(mode, pick):
        return statistics.median(pick(r) for r in results[mode])

    build_s = {m: {b: median_of(m, lambda r, b=b: r["build"][b]) for b in BATCHES} for m in MODES}
    sweep_s = {m: median_of(m, lambda r: r["seconds"]) for m in MODES}
    print(
        "chain build, s (median): "
        + "; ".join(f"B={b} copy {build_s['copy'][b]:.2f}, exact {build_s['exact'][b]:.2f}" for b in BATCHES),
        flush=True,
    )
    print(
        f"sweep total, s (median of {ROUNDS}): copy {sweep_s['copy']:.2f}, exact {sweep_s['exact']:.2f}, "
        f"exact/copy {sweep_s['exact'] / sweep_s['copy']:.2f}x",
        flush=True,
    )
    print(
        json.dumps(
            {
                "metric": f"state_exact_cost_{release}" + ("_quick" if QUICK else ""),
                "value": round(sweep_s["exact"], 2),
                "unit": "s",
                "baseline": round(sweep_s["copy"], 2),
                "ratio": round(sweep_s["exact"] / sweep_s["copy"], 2),
                "target": "none: the cost of exact state, reported (its extra steps are untimed)",
                "admission_ms": {m: {str(b): round(v, 2) for b, v in by_b.items()} for m, by_b in admission_ms.items()},
                "admission_ratio": {
                    str(b): round(admission_ms["exact"][b] / admission_ms["copy"][b], 2) for b in BATCHES
                },
                "build_s": {m: {str(b): round(v, 3) for b, v in by_b.items()} for m, by_b in build_s.items()},
                "sweep_s": {m: round(v, 2) for m, v in sweep_s.items()},
                "sweep_ratio": round(sweep_s["exact"] / sweep_s["copy"], 2),
            }
        )
    )


if __name__ == "__main__":
    main()
