"""The warm-up gate: whether a sweep measures on real KV, or why not (upstream's reasons,
checked in upstream's order). An ineligible sweep still runs, every point on fake KV, and
the artifact names the reason.

1. flag_off                          DYN_BENCH_KV_WARMUP=off
2. dense_model_content_insensitive   no expert count in the model config   } cost-saving
3. moe_tp_balanced_by_construction   MoE without --enable-expert-parallel  } heuristics:
                                     (routing cannot skew one rank's load)   `force` skips them
4. prefix_caching_disabled           chains are found and kept by the prefix cache
5. the state reasons (kv.state_mode) correctness: never overridden
6. content_too_shallow: H < N        the dataset's collection half is shorter than the
                                     deepest chain (N tokens)
"""

from __future__ import annotations

from collections.abc import Callable

from ..record.vocabulary import CONTENT_TOO_SHALLOW, DENSE_MODEL, FLAG_OFF, MOE_TP_BALANCED, PREFIX_CACHING_DISABLED

EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def expert_count(hf_config) -> int:
    """The routed experts a model config declares (0 for a dense model)."""
    configs = [hf_config, getattr(hf_config, "text_config", None)]
    counts = [getattr(c, key, None) for c in configs if c is not None for key in EXPERT_COUNT_KEYS]
    return max((n for n in counts if isinstance(n, int) and not isinstance(n, bool)), default=0)


def model_gate_reason(vllm_config, warmup: str) -> str | None:
    """Reasons 1-4 for an engine's config; `warmup` is settings.warmup (on | off | force)."""
    if warmup == "off":
        return FLAG_OFF
    if warmup != "force":
        if expert_count(vllm_config.model_config.hf_config) == 0:
            return DENSE_MODEL
        if not vllm_config.parallel_config.enable_expert_parallel:
            return MOE_TP_BALANCED
    if not vllm_config.cache_config.enable_prefix_caching:
        return PREFIX_CACHING_DISABLED
    return None


def content_reason(conversations: list[str], encode: Callable[[str], list[int]], need: int) -> str | None:
    """Reason 6: tokenizes the collection half until `need` tokens are found."""
    have = 0
    for text in conversations:
        have += len(encode(text))
        if have >= need:
            return None
    return f"{CONTENT_TOO_SHALLOW}: {have} tokens < {need}"
