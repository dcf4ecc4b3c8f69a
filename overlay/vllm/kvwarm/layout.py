"""What each KV-cache group is, read from its spec and cache mode (never a class name)."""

from __future__ import annotations

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

    @property
    def can_fork(self) -> bool:
        return callable(getattr(self.manager, "_apply_cow", None))


def classify_spec(spec) -> str:
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    mode = getattr(spec, "mamba_cache_mode", None)
    if mode is not None:
        return STATE_ALIGN if mode == "align" else STATE_OTHER
    # The full-attention family (MLA, quantized, sinks; also sliding-window layers that the
    # manager treats as full) keeps a block for every token, so a prefix can be borrowed
    # by position. A spec that evicts old blocks (a reference sliding window) cannot.
    if isinstance(spec, FullAttentionSpec) and getattr(spec, "rswa_window", None) is None:
        return ATTENTION
    return UNSUPPORTED


def group_layouts(kv_cache_manager) -> list[GroupLayout]:
    """One entry per KV-cache group of a real KVCacheManager, in group order."""
    layouts = []
    for group_id, manager in enumerate(kv_cache_manager.coordinator.single_type_managers):
        spec = manager.kv_cache_spec
        layouts.append(GroupLayout(
            group_id=group_id,
            kind=OWN_POOL if manager.block_pool is not kv_cache_manager.block_pool else classify_spec(spec),
            block_size=manager.block_size,
            num_speculative_blocks=getattr(manager, "num_speculative_blocks", 0) or 0,
            manager=manager,
        ))
    return layouts
