"""Does what runs before a mixed step change its cost? A served prompt's first chunk joins
decodes that ran alone the step before; a sweep's mixed shots, before the gap step
(sweep-reference.md#mixed-points), ran one right after another. This measures the two orders on one
engine, in turns, so that the host's drift falls on both.

Runs inside a release's engine venv (`nox -s bench-S -- mixed_step_order`; NEEDS_ENGINE gives
it the patched cpu-flavour engine): one in-process `LLM` on the served benchmark's tiny MoE
(fp32) and engine arguments (budget 128, eager, prefix caching off), first one prompt of
every length up to the budget (as the served benchmark's warm-up: no step below pays for a
count run for the first time). Then DECODES requests decode and, cycle after cycle: GAP steps
of the decodes alone, then three mixed steps in a row, each a fresh prompt of 128 - DECODES
tokens (one step, the whole budget) beside the decodes:

  after decodes  the first: a step of decodes alone before it (as served)
  after a chunk  the second: right after a mixed step of its own shape (as the shots ran)
  repeat         the third, after a mixed step of the same shape: the noise floor

Each step's time is the executor's `execute_model` (the forward, as validate's `forward`
basis). Per cycle the first over the second and the third over the second; their medians
and interquartile ranges are printed. `--quick` (or KVWARM_BENCH_QUICK=1): 12 cycles at one
decode batch; full: 80 cycles at each of DECODE_BATCHES. The last line is the JSON result
(value: the median of after-decodes / after-a-chunk over the batches; baseline: the repeat's).
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

from _engine import release_label, run_in_temp_dir  # importing it sets the engine's environment
from kvwarm_testing import tiny_models

from kvwarm_build.sessions import quick_mode

NEEDS_ENGINE = True  # noxfile: run in the release's CPU engine venv

QUICK = quick_mode(sys.argv, os.environ)
BUDGET = 128  # the served benchmark's --max-num-batched-tokens
GAP = 7  # decode-only steps before each cycle's first mixed step
CYCLES = 12 if QUICK else 80
DECODE_BATCHES = (4,) if QUICK else (1, 4)


def quartiles(values: list[float]) -> tuple[float, float, float]:
    q1, median, q3 = statistics.quantiles(values, n=4)
    return q1, median, q3


class Engine:
    def __init__(self, tmp: Path):
        from vllm import LLM, SamplingParams

        model = tiny_models.make_tiny_qwen3_moe(tmp / "tiny-moe", kv_heads=8)
        self.llm = LLM(
            model=str(model),
            dtype="float32",
            seed=0,
            enforce_eager=True,
            enable_prefix_caching=False,
            max_model_len=1024,
            block_size=32,
            max_num_seqs=8,
            max_num_batched_tokens=BUDGET,
            enable_expert_parallel=True,
        )
        self.engine = self.llm.llm_engine
        self.vocab = self.engine.model_config.get_vocab_size()
        self.rng = random.Random(0)
        self.one = SamplingParams(max_tokens=1, temperature=0.0)
        self.forwards: list[float] = []
        executor = self.engine.engine_core.engine_core.model_executor
        execute = executor.execute_model

        def timed(*args, **kwargs):
            started = time.perf_counter()
            result = execute(*args, **kwargs)
            self.forwards.append(time.perf_counter() - started)
            return result

        executor.execute_model = timed
        self.added = 0

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(3, self.vocab) for _ in range(n)]

    def every_count(self) -> None:
        for n in range(1, BUDGET + 1):
            self.llm.generate([{"prompt_token_ids": self.tokens(n)}], self.one, use_tqdm=False)

    def add(self, tokens: int, params) -> str:
        self.added += 1
        request_id = f"r{self.added}"
        self.engine.add_request(request_id, {"prompt_token_ids": self.tokens(tokens)}, params)
        return request_id

    def mixed_ms(self, new_tokens: int) -> float:
        """One step of the running decodes and a fresh prompt of `new_tokens`: its forward."""
        self.add(new_tokens, self.one)
        self.forwards.clear()
        self.engine.step()
        return sum(self.forwards) * 1e3


def measure(engine: Engine, decodes: int) -> dict:
    from vllm import SamplingParams

    steps_each = GAP + 3
    running = SamplingParams(max_tokens=CYCLES * steps_each + 8, temperature=0.0, ignore_eos=True)
    ids = [engine.add(8, running) for _ in range(decodes)]
    for _ in range(4):
        engine.engine.step()  # admitted, decoding
    new = BUDGET - decodes
    after_decodes, after_chunk, repeat = [], [], []
    for _ in range(CYCLES):
        for _ in range(GAP):
            engine.engine.step()
        after_decodes.append(engine.mixed_ms(new))
        after_chunk.append(engine.mixed_ms(new))
        repeat.append(engine.mixed_ms(new))
    engine.engine.abort_request(ids)
    while engine.engine.has_unfinished_requests():
        engine.engine.step()
    order = [a / b for a, b in zip(after_decodes, after_chunk)]
    noise = [c / b for c, b in zip(repeat, after_chunk)]
    result = {
        "decodes": decodes,
        "new_tokens": new,
        "after_decodes_ms": statistics.median(after_decodes),
        "after_chunk_ms": statistics.median(after_chunk),
        "ratio_quartiles": [round(x, 4) for x in quartiles(order)],
        "repeat_quartiles": [round(x, 4) for x in quartiles(noise)],
    }
    q1, median, q3 = result["ratio_quartiles"]
    r1, rmed, r3 = result["repeat_quartiles"]
    print(
        f"{decodes} decode(s) + {new} new tokens, {CYCLES} cycles: after {GAP} decode steps "
        f"{result['after_decodes_ms']:.2f} ms, after a chunk {result['after_chunk_ms']:.2f} ms; paired "
        f"{median:.3f} (IQR {q1:.3f}-{q3:.3f}) against the repeat's {rmed:.3f} (IQR {r1:.3f}-{r3:.3f})",
        flush=True,
    )
    return result


def run(tmp: Path) -> None:
    engine = Engine(tmp)
    engine.every_count()
    results = [measure(engine, decodes) for decodes in DECODE_BATCHES]
    value = statistics.median(r["ratio_quartiles"][1] for r in results)
    baseline = statistics.median(r["repeat_quartiles"][1] for r in results)
    result = {
        "metric": f"mixed_after_decodes_ratio_{release_label()}" + ("_quick" if QUICK else ""),
        "value": round(value, 4),
        "unit": "ratio",
        "baseline": round(baseline, 4),
        "ratio": round(value / baseline, 4),
        "target": "none: a mixed step after decode steps against one after a mixed step, beside the repeat's noise",
        "batches": results,
        "load_average": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    run_in_temp_dir(run)
