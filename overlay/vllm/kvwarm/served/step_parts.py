"""A served step's parts as plain data (ints, strs, floats, lists, sets, dicts), taken in the
engine's thread so that the step can be marshalled at once and nothing of vLLM's is kept
alive after the step (docs/validate-reference.md#what-the-trace-costs). The trace's writer process
(served.sink) turns them into the line's raw numbers (format version 2).

Only reads: the fields of the SchedulerOutput vLLM made in this step's schedule(), the
requests the queues hold after it (summed here: the writer gets six numbers, not the
backlog), the runner's graph statistics. The lists and dicts of
the SchedulerOutput are passed as they are (marshal copies them); a request's prompt length
is read from its NewRequestData, once, in the step that first schedules it.
"""

from __future__ import annotations

from itertools import chain
from operator import attrgetter, mul

_PROMPT = attrgetter("num_prompt_tokens")
_STATUS = attrgetter("status")
NOTHING_WAITS = (0, 0, 0, 0, 0, 0)  # what `waiting` gives where nothing waits (or the queues are not read)


def _prompt_len(new) -> int:
    if new.prompt_token_ids is not None:
        return len(new.prompt_token_ids)
    embeds = getattr(new, "prompt_embeds", None)
    return int(embeds.shape[0]) if embeds is not None else 0


def parts(output) -> tuple:
    """What a line reads of a SchedulerOutput: the tokens scheduled per request, the new
    requests as (id, prompt length, tokens computed before), the cached requests' ids and
    computed tokens (and, where the release has them, the resumed ones and their output
    tokens), the speculative tokens, the finished and the preempted requests."""
    cached = output.scheduled_cached_reqs
    return (
        output.num_scheduled_tokens,
        [(r.req_id, _prompt_len(r), r.num_computed_tokens) for r in output.scheduled_new_reqs],
        cached.req_ids,
        cached.num_computed_tokens,
        getattr(cached, "resumed_req_ids", None),
        getattr(cached, "num_output_tokens", None),
        output.scheduled_spec_decode_tokens,
        output.finished_req_ids,
        getattr(output, "preempted_req_ids", None),
    )


def waiting(queues, preempted_status) -> tuple:
    """What a schedule() left waiting in `queues`, read right after it, as the line's `queued`
    sums (served.sink): requests to prefill, their prompt tokens, the tokens' squares summed,
    preempted requests to resume, the KV they hold, its squares summed (Dynamo's FPM split; the
    reader makes the variances). Each queue is read as
    it is held, never in its order (a priority queue's iteration sorts a copy of its heap: its
    heap's list is read instead), and the common case (no preempted request) in C loops."""
    requests = list(chain.from_iterable(map(_held, queues)))
    if not requests:
        return NOTHING_WAITS
    if preempted_status not in map(_STATUS, requests):
        return (*_sums(list(map(_PROMPT, requests))), 0, 0, 0)
    return (
        *_sums([r.num_prompt_tokens for r in requests if r.status != preempted_status]),
        *_sums([r.num_computed_tokens for r in requests if r.status == preempted_status]),
    )


def _held(queue):
    """A queue's requests in whatever order it holds them: vLLM's priority queue's heap list
    where it is one, else the queue itself (a deque)."""
    heap = getattr(queue, "_heap", None)
    return heap if isinstance(heap, list) else queue


def _sums(values: list[int]) -> tuple[int, int, int]:
    return len(values), sum(values), sum(map(mul, values, values))


def graph(cudagraph_stats) -> list | None:
    """The graph the runner says the step ran, [mode, padded tokens] (ModelRunnerOutput.
    cudagraph_stats where the runner fills it; None otherwise)."""
    if cudagraph_stats is None:
        return None
    mode = getattr(cudagraph_stats, "runtime_mode", None)
    padded = getattr(cudagraph_stats, "num_padded_tokens", None)
    return [None if mode is None else str(getattr(mode, "name", mode)), padded if isinstance(padded, int) else None]


def plain(value):
    """`value` made of the exact types marshal takes (it refuses subclasses: an int enum, a
    numpy integer, a defaultdict): the slow way, for a step whose parts marshal refused."""
    if value is None or type(value) in (bool, float, bytes):
        return value
    if isinstance(value, str):
        return str(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, dict):
        return {plain(k): plain(x) for k, x in value.items()}
    if isinstance(value, (set, frozenset)):
        return {plain(x) for x in value}
    if isinstance(value, (list, tuple)):
        return [plain(x) for x in value]
    if hasattr(value, "__index__"):
        return value.__index__()
    if isinstance(value, float) or hasattr(value, "__float__"):
        return float(value)
    return [plain(x) for x in value]  # another iterable; anything else raises TypeError
