"""What a step pays on the CPU engine the first time it runs a token count, against the same
count run again: the cost behind validate's first-size split (docs/validate.md).

Runs inside a release's engine venv (`nox -s bench-S -- first_size_cost`; NEEDS_ENGINE gives
it the patched cpu-flavour engine). Two parts:

- the engine: one in-process `LLM` on a random-weight tiny Qwen3-MoE (fp32, the served
  benchmark's model), prefix caching off. For each of SIZES, never run before in the process,
  three one-step prefills of that many fresh random tokens (`max_tokens=1`): the first, then
  two repeats (after one prefill of another size: the process's first pays more). Per size
  the first's wall time over the repeats' mean; the noise is the two repeats' spread,
  measured in the same run;
- the kernel: vLLM's CPU linear for fp32 weights (`ops.create_onednn_mm`, as the engine's
  unquantized GEMM dispatch makes it, at the model's qkv shape): one call at a new row count,
  a repeat, and a call after every other count of KERNEL_COUNTS (39 in the full run, more
  than the handler's 32-entry cache holds; 9 in the quick one, fewer). Run with
  `ONEDNN_PRIMITIVE_CACHE_CAPACITY=0` to see the evicted count pay again: oneDNN's own
  primitive cache is what spares it.

`--quick` (or KVWARM_BENCH_QUICK=1): 4 sizes and 10 kernel counts. The last line is the JSON
result (value: the first prefills' median ms, baseline: their repeats').
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

from _engine import release_label, run_in_temp_dir  # importing it sets the engine's environment
from kvwarm_testing import tiny_models

from kvwarm_build.sessions import quick_mode

NEEDS_ENGINE = True  # noxfile: run in the release's CPU engine venv

QUICK = quick_mode(sys.argv, os.environ)
# odd counts between the engine's warm-up sizes, none a power of two
SIZES = list(range(101, 141, 10)) if QUICK else list(range(101, 501, 17))
KERNEL_COUNTS = list(range(100, 150, 5)) if QUICK else list(range(100, 300, 5))
QKV = (128, 1536)  # (K, N) of the tiny MoE's qkv projection at 8 KV heads of 64


def prefill_ms(llm, tokens: int, vocab: int, rng) -> float:
    from vllm import SamplingParams

    prompt = {"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(tokens)]}
    started = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    return (time.perf_counter() - started) * 1e3


def engine_part(tmp: Path) -> dict:
    import random

    from vllm import LLM

    model = tiny_models.make_tiny_qwen3_moe(tmp / "tiny-moe", kv_heads=8)
    llm = LLM(
        model=str(model),
        dtype="float32",
        seed=0,
        enforce_eager=True,
        enable_prefix_caching=False,
        max_model_len=1024,
        max_num_batched_tokens=1024,
        max_num_seqs=4,
        enable_expert_parallel=True,
    )
    vocab = llm.llm_engine.model_config.get_vocab_size()
    rng = random.Random(0)
    prefill_ms(llm, 64, vocab, rng)  # the process's first prefill pays more than a new size
    firsts, repeats, noise = [], [], []
    for tokens in SIZES:
        first = prefill_ms(llm, tokens, vocab, rng)
        again = [prefill_ms(llm, tokens, vocab, rng) for _ in range(2)]
        firsts.append(first)
        repeats.append(statistics.fmean(again))
        noise.append(100 * abs(again[0] - again[1]) / statistics.fmean(again))
        print(f"{tokens:4d} tokens: first {first:7.2f} ms, repeats {again[0]:7.2f} {again[1]:7.2f} ms", flush=True)
    return {"first_ms": firsts, "repeat_ms": repeats, "noise_pct": noise}


def kernel_part() -> dict | None:
    """A new, a repeated and an evicted row count through the CPU engine's fp32 linear."""
    import torch
    from vllm import _custom_ops as ops

    if not hasattr(ops, "create_onednn_mm"):
        print("kernel part skipped: this build's ops have no create_onednn_mm", flush=True)
        return None
    torch.manual_seed(0)
    k, n = QKV
    handler = ops.create_onednn_mm(torch.randn(n, k).t(), 32)

    def call_us(rows: int) -> float:
        x = torch.randn(rows, k)
        started = time.perf_counter()
        ops.onednn_mm(handler, x, None)
        return (time.perf_counter() - started) * 1e6

    call_us(1)
    new, again = [], []
    for rows in KERNEL_COUNTS:
        new.append(call_us(rows))
        again.append(call_us(rows))
    evicted = [call_us(rows) for rows in KERNEL_COUNTS]  # each after len - 1 other counts
    med = statistics.median
    out = {"new_us": med(new), "repeat_us": med(again), "evicted_us": med(evicted), "counts": len(KERNEL_COUNTS)}
    print(
        f"kernel {k}x{n}: a new row count {out['new_us']:.0f} us, repeated {out['repeat_us']:.0f} us, after "
        f"{len(KERNEL_COUNTS) - 1} other counts {out['evicted_us']:.0f} us (medians; oneDNN primitive cache "
        f"capacity {os.environ.get('ONEDNN_PRIMITIVE_CACHE_CAPACITY', 'default')})",
        flush=True,
    )
    return out


def run(tmp: Path) -> None:
    engine = engine_part(tmp)
    kernel = kernel_part()
    first, repeat = statistics.median(engine["first_ms"]), statistics.median(engine["repeat_ms"])
    ratios = [f / r for f, r in zip(engine["first_ms"], engine["repeat_ms"])]
    result = {
        "metric": f"first_size_prefill_ms_{release_label()}" + ("_quick" if QUICK else ""),
        "value": round(first, 3),
        "unit": "ms",
        "baseline": round(repeat, 3),
        "ratio": round(statistics.median(ratios), 3),
        "target": "none: the first run of a token count against its repeats, beside their own noise",
        "sizes": len(SIZES),
        "extra_ms_median": round(statistics.median(f - r for f, r in zip(engine["first_ms"], engine["repeat_ms"])), 3),
        "repeat_noise_pct": round(statistics.median(engine["noise_pct"]), 2),
        "kernel": kernel,
        "load_average": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    run_in_temp_dir(run)
