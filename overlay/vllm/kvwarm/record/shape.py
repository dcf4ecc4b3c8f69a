"""A point's shape as plain arithmetic, the one copy the sweep and the exports share: its
identity across ranks and runs (`point_key`), the balanced split of a total over its requests
(`balanced`), and the CUDA graph a step of its shape should run in (`expected_graph`).

A decode step of B requests runs the graph captured for the smallest decode capture size
>= B, padded to it; a prefill step of N new tokens the smallest prefill capture size >= N
(vLLM's mixed mode: piecewise graphs, by token count), except a prefill of one token per
request (N == B), which vLLM's runner classifies as a uniform decode batch by its shape and
runs as a decode step. Past the largest size, or with graphs off, the step runs eager. Where
vLLM resolves the two kinds apart (prefill graphs by token count, decode graphs by request
count: SPLIT_SIZES), those are the sizes; elsewhere decode capture sizes are the capture
sizes up to max_num_seqs and prefill ones all capture sizes. Each kind only where its mode
captures.
The sweep reads the modes from the engine (sweep.graphs); the exports from the record.

Plain data: nothing here imports vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import vocabulary as v

NONE = "NONE"  # vLLM's CUDAGraphMode.NONE, by name
# Where vLLM resolves the capture sizes apart (its compilation config's fields, and the engine
# record's keys): the token counts of the prefill (mixed-batch) graphs, the request counts of
# the uniform decode ones.
SPLIT_SIZES = ("prefill_cudagraph_capture_token_sizes", "decode_cudagraph_capture_request_sizes")


CONTINUATION = "continuation"


def is_continuation(point: dict) -> bool:
    """Whether a row's prefill requests (a mixed row's prefill part's) were running ones,
    their prefix computed by a lead step of their own (sweep.prefill)."""
    prefill = point.get("prefill")
    return point.get(CONTINUATION) is True or (isinstance(prefill, dict) and prefill.get(CONTINUATION) is True)


def point_key(point: dict) -> tuple:
    """A point's identity across ranks and runs (rows of schema 1 and 2 are decode points):
    (kind, K, B, N), for a mixed point its decode part's (B, K) after them, and a
    continuation's mark last."""
    key = (
        point.get("point_type", v.DECODE),
        point["total_kv_read_tokens"],
        point["batch_size"],
        point.get("total_prefill_tokens", 0),
    )
    decode = point.get("decode")
    key += (decode["batch_size"], decode["total_kv_read_tokens"]) if decode else ()
    return key + (CONTINUATION,) if is_continuation(point) else key


def balanced(total: int, parts: int) -> list[int]:
    """`parts` integers summing to `total`, the first total % parts of them one larger."""
    base, longer = divmod(total, parts)
    return [base + 1] * longer + [base] * (parts - longer)


def positive_sizes(values) -> tuple[int, ...]:
    """Capture sizes as a sorted tuple of the positive ones."""
    return tuple(sorted({int(s) for s in values or [] if int(s) > 0}))


def split_of(holder, get) -> tuple | None:
    """The (prefill, decode) sizes `get(holder, name)` gives for SPLIT_SIZES, or None where
    it gives neither (one list for both kinds)."""
    split = tuple(get(holder, name) for name in SPLIT_SIZES)
    return None if all(s is None for s in split) else tuple(s or () for s in split)


@dataclass(frozen=True)
class GraphConfig:
    mode: str = NONE  # the engine's cudagraph_mode
    decode_mode: str = NONE
    prefill_mode: str = NONE
    capture_sizes: tuple[int, ...] = ()  # as configured (read even where graphs are off, e.g. on CPU)
    decode_capture_sizes: tuple[int, ...] = ()
    prefill_capture_sizes: tuple[int, ...] = ()
    max_num_seqs: int | None = 0  # None: not recorded (every capture size is a decode one)
    max_num_batched_tokens: int | None = 0

    @classmethod
    def of(
        cls,
        mode: str,
        decode_mode: str,
        prefill_mode: str,
        sizes,
        max_num_seqs: int | None,
        max_num_batched_tokens: int | None,
        split=None,
    ) -> GraphConfig:
        """The engine's graphs from its modes' names and its configured capture sizes: which
        of those sizes decode and prefill steps can run in; `split`, where vLLM resolved
        them apart, the (prefill token, decode request) sizes (SPLIT_SIZES)."""
        sizes = positive_sizes(sizes)
        prefill, decode = (positive_sizes(split[0]), positive_sizes(split[1])) if split is not None else (sizes, sizes)
        decode = tuple(s for s in decode if max_num_seqs is None or s <= max_num_seqs)
        return cls(
            mode=mode,
            decode_mode=decode_mode,
            prefill_mode=prefill_mode,
            capture_sizes=sizes,
            decode_capture_sizes=decode if decode_mode != NONE else (),
            prefill_capture_sizes=prefill if prefill_mode != NONE else (),
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
        )

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


def expected_graph(config: GraphConfig, tokens: int, requests: int) -> dict:
    """The graph a step of `requests` requests computing `tokens` tokens in all should run in.
    vLLM's runner tells a uniform decode batch by its shape alone (one token per request), so
    a prefill of B one-token prompts (N == B) runs as a decode step does."""
    uniform = tokens == requests
    mode = config.decode_mode if uniform else config.prefill_mode
    sizes = config.decode_capture_sizes if uniform else config.prefill_capture_sizes
    limit = config.max_num_seqs if uniform else config.max_num_batched_tokens
    n = tokens
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


def step_tokens(point: dict) -> tuple[int, int]:
    """(tokens, requests) of one step of a point: decode, one token per request; prefill, N
    new tokens over B requests; mixed, one token per decode request and the prefill part's N."""
    batch = point["batch_size"]
    if point.get("point_type") == v.MIXED:
        return point["decode"]["batch_size"] + point["total_prefill_tokens"], batch
    return (
        (point.get("total_prefill_tokens") or batch, batch) if point.get("point_type") == v.PREFILL else (batch, batch)
    )
