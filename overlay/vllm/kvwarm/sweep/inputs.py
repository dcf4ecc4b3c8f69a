"""Every input a sweep reads before it touches the engine (the points file, the settings, the
dataset's two halves), and what the chains' and prefill tails' text is made of once the
engine's tokenizer is known (sweep.run builds the sweep from them).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from ..kv.layout import group_layouts
from ..kv.prefix import prefix_unit
from .dataset import COLLECTION_POOL, DatasetError, load_halves
from .points import DecodePoint, MixedPoint, PrefillPoint, load_points, mixed_decode_steps, takes_tails
from .settings import DATASET_ENV, Settings, read_settings

# Prefill points' new tokens come from the dataset's held-out half, as much of it as this
# (tails cycle through it, each led by tokens of its own).
TAIL_TOKENS = 8192
EMPTY_HELD_OUT = (
    "dataset {path}: its held-out half (conversation_sha256_odd) holds no text, and prefill points take their "
    "new tokens from it; use a larger ShareGPT-format file (or DYN_BENCH_KV_WARMUP=off to measure on fake KV)"
)


@dataclass
class SweepInputs:
    settings: Settings
    points: list[DecodePoint | PrefillPoint]
    conversations: list[str] | None  # None when warm-up is off (no chains, no text)
    dataset: dict | None  # the artifact's record of the file
    held_out: list[str] | None = None  # the dataset's other half (prefill points' new tokens)


def read_inputs(
    points_path: str | None, environ=None, max_model_len: int = sys.maxsize, trailing_steps: int = 0
) -> SweepInputs:
    """Every input a sweep reads before it touches the engine; raises one of INPUT_ERRORS.
    A dataset problem is an error, not a reason to measure on fake KV: a mistyped path
    must not silently turn a real-KV table into a fake one. Without a points file (a
    generated grid) the points come once the engine is known. `trailing_steps`: the
    engine loop's untimed decode steps (sweep.provenance)."""
    environ = os.environ if environ is None else environ
    settings = read_settings(environ)
    steps = settings.point_steps + trailing_steps
    points = (
        load_points(points_path, max_model_len=max_model_len, steady_steps=steps) if points_path is not None else []
    )
    if settings.warmup == "off":
        return SweepInputs(settings, points, None, None)
    if not settings.dataset:
        raise DatasetError(
            f"{DATASET_ENV} is not set; point it at a ShareGPT-format JSON file "
            "(or set DYN_BENCH_KV_WARMUP=off to measure on fake KV)"
        )
    conversations, held_out, digest = load_halves(settings.dataset)
    if not held_out and (points_path is None or takes_tails(points)):
        raise DatasetError(EMPTY_HELD_OUT.format(path=settings.dataset))
    dataset = {
        "path": str(settings.dataset),
        "sha256": digest,
        "collection_pool": COLLECTION_POOL,
        "conversations": len(conversations),
    }
    return SweepInputs(settings, points, conversations, dataset, held_out)


def chain_depth_needed(point, decode_steps: int, kv_cache_manager) -> int:
    """Tokens of chain text a point needs: a decode point's longest request (over its
    `decode_steps`, SweepConfig.decode_steps), a prefill point's deepest prefix, a mixed
    point's deeper of its parts' (its decode part runs a step per shot and more)."""
    if isinstance(point, MixedPoint):
        steps = mixed_decode_steps(decode_steps)
        return max(point.decode.tokens_spanned(steps), chain_depth_needed(point.prefill, steps, kv_cache_manager))
    if isinstance(point, PrefillPoint):
        return max(
            point.prefixes(prefix_unit(group_layouts(kv_cache_manager), kv_cache_manager.block_pool.hash_block_size))
        )
    return point.tokens_spanned(decode_steps)


def tail_tokens(texts: list[str], encode) -> list[int] | None:
    """Up to TAIL_TOKENS tokens of the held-out half (None where it is empty)."""
    tokens: list[int] = []
    for text in texts:
        tokens += encode(text)
        if len(tokens) >= TAIL_TOKENS:
            break
    return tokens[:TAIL_TOKENS] or None


def tokenizer_encode(model_config):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        model_config.tokenizer,
        revision=model_config.tokenizer_revision,
        trust_remote_code=model_config.trust_remote_code,
    )
    return lambda text: tokenizer.encode(text, add_special_tokens=False)
