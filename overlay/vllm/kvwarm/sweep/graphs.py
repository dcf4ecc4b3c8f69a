"""The engine's CUDA graphs, as its compilation config says: the modes of decode and of mixed
(prefill) batches, by vLLM's own `decode_mode()` and `mixed_mode()`, and the capture sizes.
What a step of a given shape runs in is record.shape's `expected_graph`, which the exports
share. The grid (sweep.grid) is laid around these sizes, and every row records what it expects
(the scheduler cannot see the graph the runner chose, so nothing observed is recorded).
"""

from __future__ import annotations

from ..record.shape import NONE, GraphConfig, split_of


def _name(mode) -> str:
    return getattr(mode, "name", None) or (str(mode) if mode is not None else NONE)


def split_sizes(compilation) -> tuple | None:
    """(prefill token sizes, decode request sizes) where the compilation config resolves them
    apart (record.shape.SPLIT_SIZES, probed), else None."""
    return split_of(compilation, lambda config, name: getattr(config, name, None))


def graph_config(vllm_config) -> GraphConfig:
    """What the engine's compilation config says (enforce_eager: no graphs)."""
    compilation = getattr(vllm_config, "compilation_config", None)
    mode = getattr(compilation, "cudagraph_mode", None)
    if vllm_config.model_config.enforce_eager:
        mode = None
    decode = mode.decode_mode() if callable(getattr(mode, "decode_mode", None)) else mode
    mixed = mode.mixed_mode() if callable(getattr(mode, "mixed_mode", None)) else mode
    scheduler = vllm_config.scheduler_config
    return GraphConfig.of(
        _name(mode),
        _name(decode),
        _name(mixed),
        getattr(compilation, "cudagraph_capture_sizes", None),
        scheduler.max_num_seqs,
        scheduler.max_num_batched_tokens,
        split_sizes(compilation),
    )
