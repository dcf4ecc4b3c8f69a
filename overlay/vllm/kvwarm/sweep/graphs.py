"""The CUDA graph a step of a given shape runs in, as the engine's compilation config says.

A decode step of B requests runs the graph captured for the smallest decode capture size
>= B, padded to it; a prefill step of N new tokens the smallest prefill capture size >= N
(vLLM's mixed mode: piecewise graphs, by token count). Past the largest size, or with graphs
off, the step runs eager. Decode capture sizes are the capture sizes up to max_num_seqs, and
only when the decode mode captures; prefill ones all capture sizes, when the mixed mode does.
The grid (sweep.grid) is laid around these sizes, and every row records what it expects
(the scheduler cannot see the graph the runner chose, so nothing observed is recorded).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..record import vocabulary as v

NONE = "NONE"


@dataclass(frozen=True)
class GraphConfig:
    mode: str = NONE  # the engine's cudagraph_mode
    decode_mode: str = NONE
    prefill_mode: str = NONE
    capture_sizes: tuple[int, ...] = ()  # as configured (read even where graphs are off, e.g. on CPU)
    decode_capture_sizes: tuple[int, ...] = ()
    prefill_capture_sizes: tuple[int, ...] = ()
    max_num_seqs: int = 0
    max_num_batched_tokens: int = 0

    def record(self) -> dict:
        """The artifact's `cudagraph` block."""
        return {
            "mode": self.mode,
            "decode_mode": self.decode_mode,
            "prefill_mode": self.prefill_mode,
            "capture_sizes": list(self.capture_sizes),
            "decode_capture_sizes": list(self.decode_capture_sizes),
            "prefill_capture_sizes": list(self.prefill_capture_sizes),
        }


def _name(mode) -> str:
    return getattr(mode, "name", None) or (str(mode) if mode is not None else NONE)


def graph_config(vllm_config) -> GraphConfig:
    """What the engine's compilation config says (enforce_eager: no graphs)."""
    compilation = getattr(vllm_config, "compilation_config", None)
    mode = getattr(compilation, "cudagraph_mode", None)
    if vllm_config.model_config.enforce_eager:
        mode = None
    decode = mode.decode_mode() if callable(getattr(mode, "decode_mode", None)) else mode
    mixed = mode.mixed_mode() if callable(getattr(mode, "mixed_mode", None)) else mode
    sizes = tuple(sorted({int(s) for s in (getattr(compilation, "cudagraph_capture_sizes", None) or []) if int(s) > 0}))
    max_seqs = vllm_config.scheduler_config.max_num_seqs
    return GraphConfig(
        mode=_name(mode),
        decode_mode=_name(decode),
        prefill_mode=_name(mixed),
        capture_sizes=sizes,
        decode_capture_sizes=tuple(s for s in sizes if s <= max_seqs) if _name(decode) != NONE else (),
        prefill_capture_sizes=sizes if _name(mixed) != NONE else (),
        max_num_seqs=max_seqs,
        max_num_batched_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
    )


def expected_graph(config: GraphConfig, kind: str, n: int) -> dict:
    """The graph a step of `n` (decode: B requests; prefill: N new tokens) should run in."""
    decode = kind == v.DECODE
    mode = config.decode_mode if decode else config.prefill_mode
    sizes = config.decode_capture_sizes if decode else config.prefill_capture_sizes
    limit = config.max_num_seqs if decode else config.max_num_batched_tokens
    reasons = []
    capture = next((s for s in sizes if s >= n), None) if mode != NONE else None
    if mode == NONE or not sizes:
        reasons.append(v.CUDAGRAPH_DISABLED)
    elif n in sizes:
        reasons.append(v.CAPTURE)
    elif n - 1 in sizes:
        reasons.append(v.POST_CAPTURE)
    elif capture is None:
        reasons.append(v.EAGER_TAIL)
    if n == limit:
        reasons.append(v.ENGINE_LIMIT)
    return {
        "expected_cudagraph_mode": mode if capture is not None else NONE,
        "expected_capture_size": capture,
        "padding_tokens": capture - n if capture is not None else 0,
        "reasons": reasons,
        "observed_cudagraph_mode": None,
        "observed_size": None,
    }
