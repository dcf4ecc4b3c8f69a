"""Step-time fidelity of shadows: the median steady decode step of B shadow requests
(borrowed real KV, as the sweep measures) against that of B natural requests decoded at
the same contexts after a real prefill, on the real CPU engine. The CPU stand-in for the
seed's GPU metric (decode MAPE of the sweep's table against natural decoding).

Runs inside a release's engine venv (`nox -s bench-S -- step_fidelity`). It reuses
sweep_vs_prefill's engine, ladder and sides: the shadow side is a Sweep driven
through the KvWarmScheduler adapter; the natural side prefills each point's B prompts,
then sends them again to decode the same R steady steps together. Every engine step is
timed by the same clock (StepClock) on both sides; a point's figure is the median of its
R steady steps of B requests.

Rounds alternate the sides (shadow first in odd rounds, natural first in even ones), in
one engine. Per round, the MAPE of shadow against natural over the ladder is the
fidelity; the MAPE of one round against the next, on the same side, is the run-to-run
noise those figures carry. A faithful shadow gives a fidelity MAPE close to the noise
(ratio near 1). The last line is the JSON result.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
from pathlib import Path

from _engine import release_label, run_in_temp_dir  # importing it sets the engine's environment
from kvwarm_testing import tiny_models

NEEDS_ENGINE = True  # noxfile: run in the release's CPU engine venv

ROOT = Path(__file__).resolve().parents[1]
ROUNDS = 4
TARGET_RATIO = 1.5  # fidelity MAPE at most 1.5x the run-to-run noise


def load_sweep_vs_prefill():
    """The sibling benchmark, for its engine settings, ladder, StepClock and both sides."""
    spec = importlib.util.spec_from_file_location("sweep_vs_prefill", ROOT / "benchmarks" / "sweep_vs_prefill.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def mape(measured: list[float], reference: list[float]) -> float:
    return 100 * statistics.fmean(abs(m - r) / r for m, r in zip(measured, reference))


def point_medians(clock, points, batch: int, steady_steps: int, side: str) -> list[float]:
    """Per point (in measuring order), the median of its steady steps, in ms. Steps are
    grouped by the set of requests they ran; each group must be R steps of B requests."""
    groups: dict[frozenset, list[float]] = {}
    for seconds, kind, ids in clock.steps:
        if kind == "steady":
            groups.setdefault(ids, []).append(seconds)
    clock.take()  # and start the next side afresh
    shapes = [(len(ids), len(times)) for ids, times in groups.items()]
    if shapes != [(batch, steady_steps)] * len(points):
        sys.exit(
            f"{side}: steady steps per point (batch, steps) {shapes}; expected {len(points)} x "
            f"({batch}, {steady_steps})"
        )
    return [1e3 * statistics.median(times) for times in groups.values()]


def main() -> None:
    run_in_temp_dir(run)


def run(tmp: Path) -> None:
    base = load_sweep_vs_prefill()
    from vllm.engine.arg_utils import EngineArgs
    from vllm.kvwarm.sweep.dataset import ChainText, load_conversations
    from vllm.kvwarm.sweep.plan import plan_rungs
    from vllm.v1.engine.llm_engine import LLMEngine

    release = release_label()
    batch, steady_steps = base.BATCH, base.REPEATS
    # the sweep measures a rung deepest first: the natural side goes in the same order
    points = [p for rung in plan_rungs(base.ladder(), steady_steps, base.MAX_MODEL_LEN) for p in rung.points]
    models = tiny_models
    model = models.make_small_llama(tmp / "small-llama")
    conversations = load_conversations(models.write_sharegpt(tmp / "sharegpt.json"))
    engine = LLMEngine.from_engine_args(
        EngineArgs(
            model=str(model),
            dtype="float32",
            seed=0,
            enforce_eager=True,
            block_size=base.BLOCK,
            max_model_len=base.MAX_MODEL_LEN,
            max_num_batched_tokens=base.BATCHED_TOKENS,
            max_num_seqs=2 * batch,
            enable_prefix_caching=True,
            scheduler_cls="vllm.kvwarm.scheduler.KvWarmScheduler",
        )
    )
    clock = base.StepClock(engine.engine_core.engine_core)
    tokenizer = engine.get_tokenizer()

    def chain_text():
        return ChainText(conversations, lambda s: tokenizer.encode(s, add_special_tokens=False))

    ks = [p.total_kv_read_tokens for p in points]
    print(
        f"vLLM {release} CPU engine, small Llama (hidden 512, 2 layers); B={batch}, R={steady_steps} steady steps "
        f"per point, {ROUNDS} alternating rounds; ladder K = {ks}",
        flush=True,
    )

    sides = {
        "shadow": lambda: base.warm_up_side(clock, points, chain_text(), lambda message: None),
        "natural": lambda: base.prefill_side(clock, points, chain_text()),
    }
    medians: dict[str, list[list[float]]] = {name: [] for name in sides}
    for round_ in range(1, ROUNDS + 1):
        order = ("shadow", "natural") if round_ % 2 else ("natural", "shadow")
        for name in order:
            sides[name]()
            medians[name].append(point_medians(clock, points, batch, steady_steps, name))
            if not clock.scheduler.reset_prefix_cache():
                sys.exit(f"reset_prefix_cache() failed after the {name} side: blocks still in use")
        fidelity = mape(medians["shadow"][-1], medians["natural"][-1])
        print(f"round {round_} ({order[0]} first): shadow vs natural MAPE {fidelity:.2f}%", flush=True)

    print(f"{'K':>7}  {'shadow ms':>9}  {'natural ms':>10}  {'shadow/natural':>14}   (medians over rounds)")
    over_rounds = {
        name: [statistics.median(r[i] for r in rounds) for i in range(len(points))] for name, rounds in medians.items()
    }
    for k, s, n in zip(ks, over_rounds["shadow"], over_rounds["natural"]):
        print(f"{k:>7}  {s:>9.3f}  {n:>10.3f}  {s / n:>14.3f}")
    fidelity = statistics.fmean(mape(s, n) for s, n in zip(medians["shadow"], medians["natural"]))
    noise_by_side = {
        name: statistics.fmean(mape(rounds[r + 1], rounds[r]) for r in range(ROUNDS - 1))
        for name, rounds in medians.items()
    }
    noise = statistics.fmean(noise_by_side.values())
    print(
        f"fidelity: shadow vs natural MAPE {fidelity:.2f}% (mean over {ROUNDS} rounds); on the medians over "
        f"rounds {mape(over_rounds['shadow'], over_rounds['natural']):.2f}%",
        flush=True,
    )
    print(
        f"run-to-run noise: MAPE of one round against the next {noise:.2f}% (shadow "
        f"{noise_by_side['shadow']:.2f}%, natural {noise_by_side['natural']:.2f}%)",
        flush=True,
    )
    ratio = fidelity / noise if noise else float("inf")
    print(
        json.dumps(
            {
                "metric": f"step_fidelity_mape_b{batch}_{len(points)}pts_{release}",
                "value": round(fidelity, 2),
                "unit": "%",
                "baseline": round(noise, 2),
                "ratio": round(ratio, 2),
                "target": f"ratio <= {TARGET_RATIO:g} (fidelity MAPE within {TARGET_RATIO:g}x the run-to-run noise)",
            }
        )
    )


if __name__ == "__main__":
    main()
