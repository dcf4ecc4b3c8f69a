"""Registration of B=128 attention shadows at ctx=32,768 (block size 16) against a bare
BlockPool.touch of the same prefix blocks, on the real KV-cache classes of this venv's
vLLM, in the same run.

Runs inside a release venv (`nox -s bench-S -- shadow_registration`). Each round
registers every shadow (and releases the fork retentions, as the admission step does),
then frees them untimed; the baseline touches each shadow's shared prefix and frees it
untimed. Medians over the rounds; `--quick` (or KVWARM_BENCH_QUICK=1): one round. The last
line is the JSON result.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from kvwarm_testing.real_kv import make_chain, make_kv_cache_manager, make_request

from kvwarm_build.sessions import quick_mode

QUICK = quick_mode(sys.argv, os.environ)
BATCH, CTX, BLOCK, HEADROOM = 128, 32_768, 16, 3
ROUNDS = 1 if QUICK else 5
TARGET_RATIO = 2.0


def main() -> None:
    from vllm.kvwarm.kv.shadows import register_shadow, release_fork_retentions

    chain_tokens = CTX + 1 + HEADROOM
    chain_blocks = -(-chain_tokens // BLOCK)
    kvm = make_kv_cache_manager([BLOCK], num_blocks=1 + chain_blocks + 2 * BATCH, max_model_len=2 * chain_tokens)
    pool, manager = kvm.block_pool, kvm.coordinator.single_type_managers[0]
    chain = make_chain(kvm, "chain", chain_tokens)
    prefix = manager.req_to_blocks["chain"][: CTX // BLOCK]
    # Borrowed shadows are never hashed, so they need no block hasher.
    shadows = [make_request(f"shadow{i}", CTX + 1, hash_block_size=None) for i in range(BATCH)]
    print(
        f"{BATCH} shadows at ctx {CTX}, block size {BLOCK}: {len(prefix)} shared blocks each, {ROUNDS} rounds",
        flush=True,
    )

    def register_all() -> float:
        started = time.perf_counter()
        for shadow in shadows:
            register_shadow(kvm, shadow, chain, CTX, HEADROOM)
        release_fork_retentions(kvm)
        elapsed = time.perf_counter() - started
        for shadow in shadows:
            kvm.free(shadow)
            shadow.borrowed_kv = False
        return elapsed

    def touch_all() -> float:
        started = time.perf_counter()
        for _ in shadows:
            pool.touch(prefix)
        elapsed = time.perf_counter() - started
        for _ in shadows:
            pool.free_blocks(prefix)
        return elapsed

    register_all(), touch_all()  # warm-up
    ours = statistics.median(register_all() for _ in range(ROUNDS))
    print(f"register {BATCH} shadows (+ release fork retentions): {ours * 1e3:.1f} ms", flush=True)
    baseline = statistics.median(touch_all() for _ in range(ROUNDS))
    print(f"bare BlockPool.touch of the same prefixes: {baseline * 1e3:.1f} ms", flush=True)
    print(
        json.dumps(
            {
                "metric": "shadow_registration_b128_ctx32768" + ("_quick" if QUICK else ""),
                "value": round(ours * 1e3, 2),
                "unit": "ms",
                "baseline": round(baseline * 1e3, 2),
                "ratio": round(ours / baseline, 2),
                "target": f"ratio <= {TARGET_RATIO:g}",
            }
        )
    )


if __name__ == "__main__":
    main()
