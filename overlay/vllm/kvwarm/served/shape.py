"""A served step's composition, read from the SchedulerOutput that scheduled it and the
queue left behind: its decode requests and their contexts, its prefill chunks' new and
prefix tokens, speculative tokens, what still waits. Runs in the trace's writer thread,
never in a step: the SchedulerOutput is made fresh by every schedule() and not changed
after the step's update, so it can be read there later.

A decode request is one scheduled token (past its speculative ones) on a request whose
prompt was fully computed before the step; every other scheduled request is a prefill
chunk (a new request, a later chunk of a long prompt, or a preempted request computing its
tokens again). A request's prompt length is known from the step that first scheduled it
(NewRequestData) until the step that reports it finished; a request seen before the trace
began falls back to the scheduler's own record, then to vLLM's own test (no output token
yet: a prefill chunk). The fields are those of Dynamo's forward-pass metrics (FPM):
contexts are tokens already in KV before this step's tokens; variances are population
variances.
"""

from __future__ import annotations


def _stats(values: list[int]) -> tuple[int, int, float]:
    """(count, sum, population variance)."""
    n = len(values)
    if not n:
        return 0, 0, 0.0
    total = sum(values)
    return n, total, (n * sum(v * v for v in values) - total * total) / (n * n)


def _prompt_len(new) -> int:
    if new.prompt_token_ids is not None:
        return len(new.prompt_token_ids)
    embeds = getattr(new, "prompt_embeds", None)
    return int(embeds.shape[0]) if embeds is not None else 0


class StepShapes:
    """Turns each SchedulerOutput, in the order the engine took the steps in, into the trace
    line's composition fields. `requests`: the scheduler's requests by id (a fallback for a
    prompt length never seen; read, never changed)."""

    def __init__(self, requests: dict | None = None):
        self._prompt: dict[str, int] = {}
        self._requests = requests if requests is not None else {}

    def _length(self, req_id: str) -> int | None:
        length = self._prompt.get(req_id)
        if length is None:
            request = self._requests.get(req_id)
            length = request.num_prompt_tokens if request is not None else None
        return length

    def observe(self, output) -> dict:
        """The composition of the step `output` scheduled (every output passes here, traced or
        not, so that prompt lengths are known)."""
        scheduled = output.num_scheduled_tokens
        spec = output.scheduled_spec_decode_tokens or {}
        decode: list[int] = []
        new_tokens: list[int] = []
        lengths: list[int] = []
        prefix = continuations = 0
        for new in output.scheduled_new_reqs:
            length = self._prompt[new.req_id] = _prompt_len(new)
            new_tokens.append(scheduled.get(new.req_id, 0))
            lengths.append(length)
            prefix += new.num_computed_tokens
        cached = output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", None) or ()
        outputs = getattr(cached, "num_output_tokens", None) or [None] * len(cached.req_ids)
        for req_id, before, produced in zip(cached.req_ids, cached.num_computed_tokens, outputs):
            n = scheduled.get(req_id, 0) - len(spec.get(req_id, ()))
            length = self._length(req_id)
            prompt_done = before >= length if length is not None else bool(produced)
            if prompt_done and n == 1:
                decode.append(before)
                continue
            new_tokens.append(n)
            lengths.append(length if length is not None else before + n)
            prefix += before
            continuations += 0 < before and (length is None or before < length) and req_id not in resumed
        for req_id in output.finished_req_ids:
            self._prompt.pop(req_id, None)
        n_decode, kv, kv_var = _stats(decode)
        n_prefill, new_sum, new_var = _stats(new_tokens)
        return {
            "decode": {"requests": n_decode, "kv_tokens": kv, "kv_var": kv_var},
            "prefill": {
                "requests": n_prefill,
                "new_tokens": new_sum,
                "prefix_tokens": prefix,
                "new_var": new_var,
                "prompt_var": _stats(lengths)[2],
                "continuations": continuations,
            },
            "spec_tokens": sum(len(t) for t in spec.values()),
            "preempted": len(getattr(output, "preempted_req_ids", None) or ()),
        }


def queued(waiting: tuple, preempted_status) -> dict:
    """What waits after the step's schedule(): requests to prefill (their prompt tokens) and
    preempted requests to resume (the KV they still hold), as Dynamo's FPM splits them.
    `waiting` is the queues' contents as the step's schedule() left them; a request read
    here may have moved on since, so prompt lengths (fixed for a request) are what is summed."""
    prompts, resuming = [], []
    for request in waiting:
        if request.status == preempted_status:
            resuming.append(request.num_computed_tokens)
        else:
            prompts.append(request.num_prompt_tokens)
    n, tokens, var = _stats(prompts)
    r, kv, kv_var = _stats(resuming)
    return {
        "requests": n,
        "tokens": tokens,
        "var": var,
        "resuming": r,
        "resuming_kv_tokens": kv,
        "resuming_kv_var": kv_var,
    }


def graph(cudagraph_stats) -> dict:
    """The graph the runner says the step ran (ModelRunnerOutput.cudagraph_stats where the
    runner fills it; nulls otherwise)."""
    if cudagraph_stats is None:
        return {"mode": None, "padded_tokens": None}
    mode = getattr(cudagraph_stats, "runtime_mode", None)
    padded = getattr(cudagraph_stats, "num_padded_tokens", None)
    return {
        "mode": None if mode is None else str(getattr(mode, "name", mode)),
        "padded_tokens": padded if isinstance(padded, int) else None,
    }
