"""What the GPU steps of issues 60 and 61 sweep and serve, per model: at full shape on the GPU
host and scaled down on the CPU dry run (the same rungs, depths divided by 16), and the
arithmetic that sized each step to its budget (docs/gpu-shapes.md, "Budget").

A sweep builds one rung of chains per batch size, largest first, and chain i of every rung
extends the same text, so what its chains prefill is, per chain index, the deepest rung that
has one (prefill_tokens). The decode ladders keep B x context (the KV one step reads) at most
256k tokens: every rung's chains cost the same, and the depth asked for (32k, 64k per request)
is reached at the smallest batch.
"""

from __future__ import annotations

from dataclasses import dataclass

K = 1024


@dataclass(frozen=True)
class SweepPlan:
    model: str  # a gpu_models name
    decode: tuple[tuple[int, int], ...]  # (context per request, B)
    prefill: tuple[tuple[int, int, int], ...]  # (N new tokens, P prefix tokens, B): totals over the B
    max_model_len: int
    max_num_seqs: int
    batched_tokens: int
    capture: tuple[int, ...]  # CUDA-graph capture sizes (the CPU engine runs eager)
    # the estimate the budget is made of (GPU host; nothing measured yet)
    boot_seconds: int = 0  # dummy weights, compile (a cold cache), graph capture
    prefill_rate: int = 1  # chain prefill, tokens per second
    state_block: int = 0  # tokens per state block (align mode: exact mode's catch-ups recompute up to one)

    def points(self) -> dict:
        """The points file (`sweep --points`)."""
        return {
            "schema_version": 1,
            "decode": [{"total_kv_read_tokens": c * b, "batch_size": b} for c, b in self.decode],
            "prefill": [
                {"total_prefill_tokens": n, "total_kv_read_tokens": p, "batch_size": b} for n, p, b in self.prefill
            ],
        }

    def prefill_tokens(self) -> int:
        """Tokens the chains prefill: per chain index, the deepest rung holding one."""
        rungs: dict[int, int] = {}
        for context, batch in self.decode:
            rungs[batch] = max(rungs.get(batch, 0), context)
        for _, prefix, batch in self.prefill:
            rungs[batch] = max(rungs.get(batch, 0), prefix // batch)
        deepest = [max(d for b, d in rungs.items() if b > i) for i in range(max(rungs))]
        return sum(deepest)

    def catchup_tokens(self) -> int:
        """Exact state: what the catch-ups recompute, about half a state block per shadow."""
        return sum(b * min(c, self.state_block // 2) for c, b in self.decode) if self.state_block else 0

    def estimate(self, exact: bool = False, warm: bool = False) -> dict:
        """The step's seconds as sized: its boot (a warm compile cache: a third), the chains'
        prefill, the catch-ups (exact state), and 2 s per point."""
        boot = self.boot_seconds // 3 if warm else self.boot_seconds
        tokens = self.prefill_tokens() + (self.catchup_tokens() if exact else 0)
        seconds = {
            "boot": boot,
            "prefill": round(tokens / self.prefill_rate),
            "points": 2 * (len(self.decode) + len(self.prefill)),
        }
        return {**seconds, "total": sum(seconds.values()), "prefill_tokens": tokens}


# NemotronH at Nemotron-3-Nano's shape: the PR's pilot (B 8/32/128, to 32k per request) with
# both hand-off modes and prefill points on a real prefix. A state block holds ~2k tokens there
# (a Mamba2 layer's fp32 state, 2.1 MB, over an attention page of 1 KiB per token).
NEMOTRON = SweepPlan(
    model="nemotron",
    decode=((32 * K, 8), (8 * K, 8), (8 * K, 32), (2 * K, 32), (2 * K, 128), (K // 2, 128)),
    prefill=((2 * K, 32 * K, 1), (8 * K, 8 * K, 1), (4 * K, 32 * K, 4)),
    max_model_len=40 * K,
    max_num_seqs=128,
    batched_tokens=8 * K,
    capture=(1, 2, 4, 8, 16, 32, 64, 128),
    boot_seconds=150,
    prefill_rate=25_000,
    state_block=2 * K,
)
# DeepSeek-V2-Lite: decode to 64k per request, prefill on real prefix KV.
MLA = SweepPlan(
    model="mla",
    decode=((64 * K, 4), (16 * K, 4), (16 * K, 16), (4 * K, 16), (4 * K, 64), (K, 64)),
    prefill=((2 * K, 64 * K, 1), (8 * K, 16 * K, 1), (4 * K, 16 * K, 4)),
    max_model_len=72 * K,
    max_num_seqs=64,
    batched_tokens=8 * K,
    capture=(1, 2, 4, 8, 16, 32, 64),
    boot_seconds=100,
    prefill_rate=20_000,  # MLA's prefill attention at 64k doubles a token's work
)


def scaled(plan: SweepPlan, block: int) -> SweepPlan:
    """The dry run's plan: the same rungs, contexts and prefixes / 16, prefill chunks of at most
    `block` tokens (NemotronH: one state block, see gpu-shapes.md), a short max_model_len."""
    decode = tuple((c // 16, b) for c, b in plan.decode)
    prefill = tuple((min(n // 16, block), p // 16, b) for n, p, b in plan.prefill)
    deepest = max([c for c, _ in decode] + [p // b + n // b for n, p, b in prefill])
    return SweepPlan(
        plan.model, decode, prefill, deepest + 512, plan.max_num_seqs, block, (), prefill_rate=2_000, boot_seconds=30
    )


PLANS = {"cuda": {"nemotron": NEMOTRON, "mla": MLA}}
PLANS["cpu"] = {"nemotron": scaled(NEMOTRON, 128), "mla": scaled(MLA, 2048)}


@dataclass(frozen=True)
class ServedPlan:
    """Issue 61's load: prompts longer than the token budget (chunked prefill mixes steps), two
    rates: the first near saturation (`near`, requests per second), the second below it (a
    fraction of the first's measured throughput)."""

    model: str
    input_len: int
    output_len: int
    requests: int  # per rate
    near: float
    below_share: float
    max_model_len: int
    max_num_seqs: int
    batched_tokens: int
    capture: tuple[int, ...]
    boot_seconds: int = 0

    def estimate(self, ab: bool) -> dict:
        """Seconds as sized: the server's boot, the two loads (requests / rate, plus 10 s of
        drain each), the table's boots (a warm cache: a third of the first) and grid rows
        (about 90 s real, 40 s fake), validate."""
        loads = self.requests / self.near + self.requests / (self.near * self.below_share) + 20
        tables = (1 if ab else 2) * self.boot_seconds // 3 + 130
        seconds = {"boot": self.boot_seconds, "loads": round(loads), "tables": tables, "validate": 10}
        return {**seconds, "total": sum(seconds.values())}


QWEN3 = ServedPlan(
    model="qwen3",
    input_len=3 * K,
    output_len=128,
    requests=300,
    near=8.0,  # Qwen3-30B-A3B on one H100/H200: about 25k prefill tokens/s, 3k-token prompts
    below_share=0.5,
    max_model_len=8 * K,
    max_num_seqs=128,
    batched_tokens=2 * K,
    capture=(1, 2, 4, 8, 16, 32, 64, 128),
    boot_seconds=120,
)
SERVED = {
    "cuda": QWEN3,
    "cpu": ServedPlan("qwen3", 384, 16, 48, 4.0, 0.5, 2 * K, 32, 256, (), boot_seconds=20),
}
