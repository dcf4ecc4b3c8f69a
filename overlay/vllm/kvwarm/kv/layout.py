"""What each KV-cache group is, read from its spec's fields and cache mode (never a class
name). A spec whose kind cannot be established is UNKNOWN, with the reason, and refused:
never borrowed as plain attention on a guess."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# Full attention and MLA: one block per block_size tokens, every block kept.
ATTENTION = "attention"
# Recurrent state (Mamba, gated-delta-net, ...) in align mode: one state block at a
# token-derived slot, nulls before it.
STATE_ALIGN = "state_align"
# Recurrent state in any other cache mode: no slot a shadow could be handed.
STATE_OTHER = "state_other"
# Sliding-window and chunked-local managers, cross-attention, ...: not borrowed by position.
UNSUPPORTED = "unsupported"
# A spec the layout does not know (a new class, or a known one with new fields).
UNKNOWN = "unknown"

# Fields that subclasses of FullAttentionSpec add without changing which blocks their
# manager keeps (MLA, attention sinks, quantized and hidden-state caches). Any other
# added field may be a window that drops old blocks, as `rswa_window` (the reference
# sliding window) does: such a spec is UNKNOWN until someone has checked it and listed
# the field here or in EVICTING_FIELDS.
KEEPS_EVERY_BLOCK_FIELDS = frozenset(
    {
        "cache_dtype_str",
        "alignment",
        "compress_ratio",
        "model_version",
        "non_causal_multi_token_decode",
        "head_size_v",
        "sink_len",
        "tq_slot_size",
        # sparse MLA (a top-k indexer reads tokens from the whole cache, so every block stays):
        # the top-k buffer's width, the cache's role in sparse attention, the index group's leader
        "topk_buffer_width",
        "cache_role",
        "is_index_group_leader",
        # MLA's storage view (some releases): the token width the worker views a block's
        # storage with; the scheduler never reads it, so its manager keeps every block
        "storage_block_size",
    }
)
EVICTING_FIELDS = frozenset({"rswa_window"})
STATE_MODE_FIELD, SPECULATIVE_FIELD = "mamba_cache_mode", "num_speculative_blocks"
# A group whose manager allocates from a pool of its own (e.g. a HiSparse host tier, whose
# spec is plain full attention): its block ids are not the shared pool's, so nothing there
# can be lent or forked; refused whatever its spec says.
OWN_POOL = "own_pool"


@dataclass(frozen=True)
class GroupLayout:
    group_id: int
    kind: str
    block_size: int
    num_speculative_blocks: int
    manager: object  # the group's SingleTypeKVCacheManager
    detail: str | None = None  # why an UNSUPPORTED or UNKNOWN group is one

    @property
    def can_fork(self) -> bool:
        return callable(getattr(self.manager, "_apply_cow", None))


def _fields(spec_or_class) -> set[str]:
    return {f.name for f in dataclasses.fields(spec_or_class)} if dataclasses.is_dataclass(spec_or_class) else set()


def classify_spec(spec) -> tuple[str, str | None]:
    """(kind, why): why names what made a group UNSUPPORTED or UNKNOWN (None otherwise)."""
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        CrossAttentionSpec,
        EncoderOnlyAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    name, fields = type(spec).__name__, _fields(spec)
    if STATE_MODE_FIELD in fields:
        if SPECULATIVE_FIELD not in fields:
            return UNKNOWN, f"{name} has {STATE_MODE_FIELD} but no {SPECULATIVE_FIELD}"
        mode = getattr(spec, STATE_MODE_FIELD)
        return (STATE_ALIGN, None) if mode == "align" else (STATE_OTHER, f"{name} in cache mode {mode!r}")
    if isinstance(spec, MambaSpec):
        return UNKNOWN, f"{name} is recurrent state without a {STATE_MODE_FIELD} field"
    if isinstance(spec, FullAttentionSpec):
        added = fields - _fields(FullAttentionSpec)
        if added & EVICTING_FIELDS:
            return UNSUPPORTED, f"{name} drops old blocks ({', '.join(sorted(added & EVICTING_FIELDS))})"
        if added - KEEPS_EVERY_BLOCK_FIELDS:
            return UNKNOWN, (
                f"{name} extends full attention with field(s) "
                f"{', '.join(sorted(added - KEEPS_EVERY_BLOCK_FIELDS))} that the layout does not "
                "know; it may drop old blocks (see docs/hooks.md, layout)"
            )
        return ATTENTION, None
    if isinstance(spec, (SlidingWindowSpec, ChunkedLocalAttentionSpec, CrossAttentionSpec, EncoderOnlyAttentionSpec)):
        return UNSUPPORTED, f"{name} is not borrowed by position"
    return UNKNOWN, f"{name} is a KV-cache spec the layout does not know"


def group_layouts(kv_cache_manager) -> list[GroupLayout]:
    """One entry per KV-cache group of a real KVCacheManager, in group order."""
    layouts = []
    for group_id, manager in enumerate(kv_cache_manager.coordinator.single_type_managers):
        spec = manager.kv_cache_spec
        kind, detail = classify_spec(spec)
        if manager.block_pool is not kv_cache_manager.block_pool:
            kind, detail = OWN_POOL, f"{type(manager).__name__} allocates from a block pool of its own"
        layouts.append(
            GroupLayout(
                group_id=group_id,
                kind=kind,
                block_size=manager.block_size,
                num_speculative_blocks=getattr(spec, SPECULATIVE_FIELD) if kind == STATE_ALIGN else 0,
                manager=manager,
                detail=detail,
            )
        )
    return layouts
