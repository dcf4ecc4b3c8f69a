"""Wall time to measure a ladder of decode points at one batch size on the real CPU engine
with KV warm-up, against measuring the same points on real KV by full prefill per point.

Runs inside a release's engine venv (`nox -s bench-S -- sweep_vs_prefill`; the session
gives files with NEEDS_ENGINE = True the patched cpu-flavour engine). One in-process engine
serves both sides (start-up is shared and not timed); the prefix cache is reset after
each side. A random-weight Llama and a small ShareGPT-format file are made on the spot.

- warm-up: a Sweep driven through the KvWarmScheduler adapter, as
  `python -m vllm.kvwarm sweep` does: B chains prefilled once, then per point an admission
  step and R steady steps on borrowed KV;
- full prefill: per point, B requests whose prompts are the point's contexts of real text
  (salted per point, so no point reuses another's KV) are prefilled, then sent again with
  max_tokens 1 + R to decode the same R steady steps together (see prefill_side).

Ladder: 8 points at B=4, K evenly spaced up to the deepest max_model_len allows (planners
fit step time against K, so tables sample K evenly). Model: hidden 512, not the tests'
tiny Llama, whose prefill is mostly attention (hidden 64 at 2k contexts) and so would
weigh long prompts unlike a real model does.

Every engine step is timed and classed (see StepClock); both sides must show R steady
steps of B requests per point. Three alternating rounds, medians; the warm-up side runs
first. `--quick` (or KVWARM_BENCH_QUICK=1): 3 points up to a quarter of the depth, one
round. The last line is the JSON result.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

from _engine import (  # importing it sets the engine's environment
    is_steady_step,
    kvwarm_engine,
    release_label,
    run_in_temp_dir,
)
from kvwarm_testing import tiny_models

from kvwarm_build.sessions import quick_mode

NEEDS_ENGINE = True  # noxfile: run in the release's CPU engine venv

QUICK = quick_mode(sys.argv, os.environ)
BATCH, REPEATS = 4, 3  # REPEATS: the sweep's default (DYN_BENCH_GIANT_KV_REPEATS)
POINTS = 3 if QUICK else 8
ROUNDS = 1 if QUICK else 3  # alternating rounds of both sides; each side's median counts
MAX_MODEL_LEN, BLOCK, BATCHED_TOKENS = 2048, 32, 2048
TARGET_RATIO = 3.0


def ladder():
    """POINTS evenly spaced K up to the deepest the engine allows at batch B. A chain is
    c + 1 + REPEATS tokens deep and samples one token when its prefill ends; that token
    must not reach max_model_len, or vLLM finishes (and frees) the chain by length."""
    from vllm.kvwarm.sweep.points import DecodePoint

    k_max = BATCH * (MAX_MODEL_LEN - 3 - REPEATS) // (4 if QUICK else 1)  # quick: a quarter as deep
    return [DecodePoint(k_max * j // POINTS, BATCH) for j in range(1, POINTS + 1)]


class StepClock:
    """Times every step_fn() and classes it by what the scheduler ran in it:
    steady   every scheduled request decodes one token past its prompt;
    admit    requests start on KV they did not compute (borrowed, or a prefix-cache hit);
    prefill  any other step that computes prompt tokens (chain build, full prefill);
    idle     nothing scheduled (the sweep's bookkeeping steps)."""

    KINDS = ("steady", "admit", "prefill", "idle")

    def __init__(self, core):
        self.core, self.scheduler = core, core.scheduler
        self.steps: list[tuple[float, str, frozenset]] = []  # (seconds, kind, scheduled ids)
        self._last = ("idle", frozenset())
        update = self.scheduler.update_from_output

        def classify(output, runner_output):
            scheduled = output.num_scheduled_tokens
            if not scheduled:
                kind = "idle"
            elif any(new.num_computed_tokens for new in output.scheduled_new_reqs):
                kind = "admit"
            elif is_steady_step(self.scheduler, output):
                kind = "steady"
            else:
                kind = "prefill"
            self._last = (kind, frozenset(scheduled))
            return update(output, runner_output)

        self.scheduler.update_from_output = classify  # the engine core calls it through the instance

    def step(self) -> None:
        self._last = ("idle", frozenset())  # a step with nothing scheduled may skip the update
        started = time.perf_counter()
        self.core.step_fn()
        self.steps.append((time.perf_counter() - started, *self._last))

    def take(self) -> dict:
        """This side's figures: seconds and steps per kind, steady steps per request batch."""
        steps, self.steps = self.steps, []
        side = {
            kind: [sum(s for s, k, _ in steps if k == kind), sum(k == kind for _, k, _ in steps)] for kind in self.KINDS
        }
        per_batch: dict[frozenset, int] = {}
        for _, kind, ids in steps:
            if kind == "steady":
                per_batch[ids] = per_batch.get(ids, 0) + 1
        side["steady_counts"] = list(per_batch.values())
        side["steady_batches"] = {len(ids) for ids in per_batch}
        return side


def request(scheduler, request_id: str, salt: str, tokens: list[int], max_tokens: int):
    """An ordinary greedy request, hashed for the prefix cache like a frontend's."""
    from vllm.kvwarm.kv.chains import prefix_hasher
    from vllm.kvwarm.kv.request import greedy_request

    return greedy_request(request_id, tokens, max_tokens, cache_salt=salt, block_hasher=prefix_hasher(scheduler))


def warm_up_side(clock: StepClock, points, text, progress) -> float:
    """The sweep as `python -m vllm.kvwarm sweep` drives it, from its first step to its end."""
    from vllm.kvwarm.sweep.controller import Sweep
    from vllm.kvwarm.sweep.plan import SweepConfig

    scheduler = clock.scheduler
    sweep = Sweep(
        points,
        text,
        SweepConfig(steady_steps=REPEATS, max_model_len=MAX_MODEL_LEN),
        progress=lambda message: progress(f"  [sweep] {message}"),
    )
    started = time.perf_counter()
    scheduler.kvwarm_sweep = sweep
    while scheduler.has_requests():
        clock.step()
    elapsed = time.perf_counter() - started
    scheduler.kvwarm_sweep = None
    skipped = [f"K={r.total_kv_read_tokens}: {r.detail}" for r in sweep.rows if r.kv_seed_regime != "real_kv"]
    if skipped or not sweep.reset_prefix_cache_ok:
        sys.exit(f"the sweep skipped points {skipped} or did not end with reset_prefix_cache() succeeding")
    return elapsed


def prefill_side(clock: StepClock, points, text) -> float:
    """Per point: prefill the B prompts (max_tokens 1), then send them again: they hit the
    prefix cache for all but their partial tail block and decode R steps together. Sent
    once with max_tokens 1 + R, chunked prefill would start decoding the first request
    while the others still prefill, and no step would run the point's batch."""
    scheduler = clock.scheduler
    started = time.perf_counter()
    for n, point in enumerate(points):
        for phase, max_tokens in (("prefill", 1), ("decode", 1 + REPEATS)):
            for i, ctx in enumerate(point.contexts()):
                salt = f"prefill_p{n}_r{i}"  # unique per point, shared by its two phases
                scheduler.add_request(request(scheduler, f"{salt}_{phase}", salt, text(i, ctx), max_tokens))
            while scheduler.has_requests():
                clock.step()
    return time.perf_counter() - started


def main() -> None:
    run_in_temp_dir(run)


def run(tmp: Path) -> None:
    from vllm.kvwarm.sweep.dataset import ChainText, load_dataset
    from vllm.kvwarm.sweep.plan import plan_rungs

    release = release_label()
    points = ladder()
    model = tiny_models.make_small_llama(tmp / "small-llama")
    conversations, _ = load_dataset(tiny_models.write_sharegpt(tmp / "sharegpt.json"))
    engine = kvwarm_engine(
        model,
        block_size=BLOCK,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=BATCHED_TOKENS,
        max_num_seqs=2 * BATCH,
    )
    clock = StepClock(engine.engine_core.engine_core)
    tokenizer = engine.get_tokenizer()

    def chain_text():  # a fresh one per side, so both pay for tokenizing
        return ChainText(conversations, lambda s: tokenizer.encode(s, add_special_tokens=False))

    ks = [p.total_kv_read_tokens for p in points]
    print(
        f"vLLM {release} CPU engine, small Llama (hidden 512, 2 layers); B={BATCH}, "
        f"R={REPEATS} steady steps per point, "
        f"max_model_len {MAX_MODEL_LEN}, block {BLOCK}, max_num_batched_tokens {BATCHED_TOKENS}",
        flush=True,
    )
    print(f"ladder K = {ks} (evenly spaced up to B x (max_model_len - 3 - R))", flush=True)

    # Alternating rounds, medians: the host's noise and any first-use cost (round 1's
    # warm-up side runs first) do not decide the ratio.
    times: dict[str, list[float]] = {"warm-up": [], "full prefill": []}
    totals = {name: {kind: [0.0, 0] for kind in StepClock.KINDS} for name in times}
    for round_ in range(1, ROUNDS + 1):
        progress = print if round_ == 1 else (lambda message: None)
        sides = (
            ("warm-up", lambda progress=progress: warm_up_side(clock, points, chain_text(), progress)),
            ("full prefill", lambda: prefill_side(clock, points, chain_text())),
        )
        for name, side in sides:
            times[name].append(side())
            figures = clock.take()
            # Both sides must time the same thing: R steady steps of the point's B requests.
            if figures["steady_counts"] != [REPEATS] * POINTS or figures["steady_batches"] != {BATCH}:
                sys.exit(
                    f"{name}: steady steps per point {figures['steady_counts']} (batch sizes "
                    f"{figures['steady_batches']}); expected {POINTS} x {REPEATS} at B={BATCH}"
                )
            for kind in StepClock.KINDS:
                totals[name][kind] = [t + f for t, f in zip(totals[name][kind], figures[kind])]
            if not clock.scheduler.reset_prefix_cache():
                sys.exit(f"reset_prefix_cache() failed after the {name} side: blocks still in use")
        print(
            f"round {round_}: warm-up {times['warm-up'][-1]:.2f} s, full prefill {times['full prefill'][-1]:.2f} s",
            flush=True,
        )
    print(f"every round, both sides: {POINTS} points x {REPEATS} steady steps at B={BATCH}, all on real KV", flush=True)

    prefilled = sum(ks)
    chain_tokens = sum(rung.batch_size * rung.depth for rung in plan_rungs(points, REPEATS, MAX_MODEL_LEN))
    print(
        f"prefilled tokens per round: warm-up {chain_tokens} (B chains, once), full prefill {prefilled} "
        f"(every point), {prefilled / chain_tokens:.1f}x",
        flush=True,
    )
    print("per round (mean): seconds / steps by kind of step", flush=True)
    for name, kinds in totals.items():
        print(
            f"  {name:12}: "
            + ", ".join(f"{kind} {secs / ROUNDS:.2f} s / {steps // ROUNDS}" for kind, (secs, steps) in kinds.items()),
            flush=True,
        )
    ours, baseline = statistics.median(times["warm-up"]), statistics.median(times["full prefill"])
    ratio = baseline / ours
    print(f"median of {ROUNDS}: warm-up {ours:.2f} s, full prefill {baseline:.2f} s, ratio {ratio:.2f}x", flush=True)
    if ratio < TARGET_RATIO:
        warm = totals["warm-up"]
        dominant = max(StepClock.KINDS, key=lambda kind: warm[kind][0])
        print(
            f"below {TARGET_RATIO:g}x: the warm-up side's time is mostly {dominant} steps; at best the "
            f"ratio approaches the prefilled-token ratio, less the steady steps both sides pay",
            flush=True,
        )
    print(
        json.dumps(
            {
                "metric": f"sweep_vs_prefill_b{BATCH}_{POINTS}pts_{release}" + ("_quick" if QUICK else ""),
                "value": round(ours, 2),
                "unit": "s",
                "baseline": round(baseline, 2),
                "ratio": round(ratio, 2),
                "target": f"ratio >= {TARGET_RATIO:g}",
            }
        )
    )


if __name__ == "__main__":
    main()
