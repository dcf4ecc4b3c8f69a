"""Wall time to measure a ladder of prefill points on real prefixes with the sweep, against
measuring the same steps by prefilling every point's whole prompt (prefix included) from
scratch, in one engine, one clock.

Runs inside a release's engine venv (`nox -s bench-S -- prefill_vs_full`). One in-process
engine serves both sides (start-up is shared and not timed); the prefix cache is reset after
each side. A random-weight Llama (hidden 512) and a small ShareGPT-format file are made on the
spot.

- sweep: a Sweep of the ladder's prefill points driven through the KvWarmScheduler adapter,
  as `python -m vllm.kvwarm sweep` does: B chains prefilled once per batch size as deep as the
  deepest prefix, then per point a warm shot and R measured shots, each one step of B new
  requests that find their prefix cached and compute only their new tokens;
- from scratch: per point the same 1 + R steps, each of B requests whose whole prompts
  (prefix and new tokens, salted apart, so nothing is found cached) are computed.

Alternating rounds, medians; the last line is the JSON result. `--quick` (or KVWARM_BENCH_QUICK=1:
one round, two points) only shows the benchmark still runs to its result.
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

NEEDS_ENGINE = True  # run in the release's CPU engine venv

QUICK = quick_mode(sys.argv, os.environ)
BATCH, REPEATS = 2, 3  # REPEATS: the sweep's default (DYN_BENCH_GIANT_KV_REPEATS)
ROUNDS = 1 if QUICK else 3
MAX_MODEL_LEN, BLOCK, BATCHED_TOKENS = 2048, 32, 2048
# (N, P): new and prefix tokens per step, summed over the batch
LADDER = [(128, 1024), (256, 2048)] if QUICK else [(n, p) for p in (1024, 2048, 3072) for n in (64, 256, 512)]
TARGET_RATIO = 2.0


def sweep_side(core, points, text, tails) -> float:
    from vllm.kvwarm.sweep.controller import Sweep
    from vllm.kvwarm.sweep.plan import SweepConfig

    scheduler = core.scheduler
    vocab = scheduler.vllm_config.model_config.get_vocab_size()
    sweep = Sweep(
        points,
        text,
        SweepConfig(steady_steps=REPEATS, max_model_len=MAX_MODEL_LEN),
        progress=lambda message: None,
        tail_tokens=tails,
        vocab_size=vocab,
    )
    started = time.perf_counter()
    scheduler.kvwarm_sweep = sweep
    while scheduler.has_requests():
        core.step_fn()
    elapsed = time.perf_counter() - started
    scheduler.kvwarm_sweep = None
    wrong = [
        f"N={r.total_prefill_tokens} P={r.total_kv_read_tokens}: {r.detail or r.kv_seed_regime}"
        for r in sweep.rows
        if r.kv_seed_regime != "real_prefix"
    ]
    if wrong or not sweep.reset_prefix_cache_ok:
        sys.exit(f"the sweep did not measure every point on a real prefix: {wrong}")
    return elapsed


def scratch_side(core, points, text, tails, round_: int) -> float:
    """1 + R steps per point, each of B requests computing their whole prompts."""
    from vllm.kvwarm.kv.chains import prefix_hasher
    from vllm.kvwarm.kv.request import greedy_request

    scheduler = core.scheduler
    started = time.perf_counter()
    for n, point in enumerate(points):
        for shot in range(1 + REPEATS):
            for i, (p, new) in enumerate(zip(point.prefixes(BLOCK), point.new_tokens())):
                salt = f"scratch_r{round_}_p{n}_s{shot}_{i}"  # nothing of it is cached
                tokens = text(i, p) + tails[:new]
                scheduler.add_request(
                    greedy_request(salt, tokens, 1, cache_salt=salt, block_hasher=prefix_hasher(scheduler))
                )
            while scheduler.has_requests():
                core.step_fn()
    return time.perf_counter() - started


def main() -> None:
    run_in_temp_dir(run)


def run(tmp: Path) -> None:
    from vllm.kvwarm.sweep.dataset import ChainText, load_halves
    from vllm.kvwarm.sweep.points import PrefillPoint

    points = [PrefillPoint(n, p, BATCH) for n, p in LADDER]
    model = tiny_models.make_small_llama(tmp / "small-llama")
    collection, held_out, _ = load_halves(tiny_models.write_sharegpt(tmp / "sharegpt.json"))
    engine = kvwarm_engine(
        model,
        block_size=BLOCK,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=BATCHED_TOKENS,
        max_num_seqs=2 * BATCH,
    )
    core = engine.engine_core.engine_core
    scheduler = core.scheduler
    tokenizer = engine.get_tokenizer()

    def encode(s):
        return tokenizer.encode(s, add_special_tokens=False)

    tails = [t for text in held_out for t in encode(text)][:4096]
    print(
        f"vLLM {release_label()} CPU engine, small Llama (hidden 512, 2 layers); B={BATCH}, R={REPEATS} "
        f"measured shots per point after a warm one; (N, P) = {LADDER}",
        flush=True,
    )
    times: dict[str, list[float]] = {"sweep": [], "from scratch": []}
    for round_ in range(1, ROUNDS + 1):
        times["sweep"].append(sweep_side(core, points, ChainText(collection, encode), tails))
        if not scheduler.reset_prefix_cache():
            sys.exit("reset_prefix_cache() failed after the sweep: blocks still in use")
        times["from scratch"].append(scratch_side(core, points, ChainText(collection, encode), tails, round_))
        if not scheduler.reset_prefix_cache():
            sys.exit("reset_prefix_cache() failed after the from-scratch side: blocks still in use")
        print(
            f"round {round_}: sweep {times['sweep'][-1]:.2f} s, from scratch {times['from scratch'][-1]:.2f} s",
            flush=True,
        )
    sweep, scratch = statistics.median(times["sweep"]), statistics.median(times["from scratch"])
    ratio = scratch / sweep
    print(
        f"median: sweep {sweep:.2f} s, from scratch {scratch:.2f} s: the sweep is {ratio:.2f}x faster "
        f"(target >= {TARGET_RATIO}x)",
        flush=True,
    )
    print(
        json.dumps(
            {
                "metric": f"prefill_ladder_seconds_{release_label()}",
                "value": round(sweep, 3),
                "unit": "s",
                "baseline": round(scratch, 3),
                "ratio": round(ratio, 3),
                "target": TARGET_RATIO,
                "quick": QUICK,
            }
        )
    )


if __name__ == "__main__":
    main()
