"""A served step's raw numbers, as the trace writes them (format version 2): per scheduled
request its tokens already computed, its tokens scheduled and its prompt's length; what
still waits as counts and sums. Runs in the trace's writer thread, never in a step, on the
parts of the SchedulerOutput the step kept (`parts`: vLLM makes them fresh in every
schedule() and does not change them after the step's update).

No composition here: which request is a decode and which a prefill chunk, the sums and the
variances are worked out when the trace is read (record.trace_reader), so that a step costs
the engine's process a few list copies and one JSON encoding (docs/validate.md#what-the-
trace-costs). A request's prompt length is known from the step that first scheduled it
(NewRequestData) until the step that reports it finished; a request seen before the trace
began falls back to the scheduler's own record, then to vLLM's own test (an output token
already: its prompt is done; none: this chunk ends what is known of it).
"""

from __future__ import annotations


def parts(output) -> tuple:
    """In the step: references to what the line needs, so the rest of the SchedulerOutput
    can be freed as soon as vLLM drops it."""
    cached = output.scheduled_cached_reqs
    return (
        output.num_scheduled_tokens,
        output.scheduled_new_reqs,
        cached.req_ids,
        cached.num_computed_tokens,
        getattr(cached, "resumed_req_ids", None),
        getattr(cached, "num_output_tokens", None),
        output.scheduled_spec_decode_tokens,
        output.finished_req_ids,
        getattr(output, "preempted_req_ids", None),
    )


def _prompt_len(new) -> int:
    if new.prompt_token_ids is not None:
        return len(new.prompt_token_ids)
    embeds = getattr(new, "prompt_embeds", None)
    return int(embeds.shape[0]) if embeds is not None else 0


class RawSteps:
    """Turns each step's parts, in the order the engine took the steps in, into the line's
    raw fields. `requests`: the scheduler's requests by id (a fallback for a prompt length
    never seen; read, never changed)."""

    def __init__(self, requests: dict | None = None):
        self._prompt: dict[str, int] = {}
        self._requests = requests if requests is not None else {}

    def _unseen(self, ids: list, computed: list, scheduled: dict, produced: list | None) -> list[int]:
        """Prompt lengths where a request was scheduled before the trace began (rare)."""
        lengths = []
        for k, req_id in enumerate(ids):
            length = self._prompt.get(req_id)
            if length is None:
                request = self._requests.get(req_id)
                length = request.num_prompt_tokens if request is not None else None
            if length is None:  # vLLM's own test: an output token means the prompt is done
                before = computed[k]
                length = before if produced and produced[k] else before + scheduled.get(req_id, 0)
            lengths.append(length)
        return lengths

    def observe(self, step_parts: tuple) -> dict:
        """The line's raw fields for one step (every step passes here, traced or not, so that
        prompt lengths are known)."""
        scheduled, new_reqs, ids, computed, resumed, produced, spec, finished, preempted = step_parts
        prompt = self._prompt
        new = []
        for req in new_reqs:
            length = prompt[req.req_id] = _prompt_len(req)
            new.append([length, req.num_computed_tokens, scheduled.get(req.req_id, 0)])
        try:
            lengths = [prompt[r] for r in ids]
        except KeyError:
            lengths = self._unseen(ids, computed, scheduled, produced)
        raw = {
            "new": new,
            "cached": {"computed": computed, "scheduled": [scheduled[r] for r in ids], "prompt": lengths},
        }
        if spec:
            raw["spec"] = [len(spec.get(r, ())) for r in ids]
            raw["spec_tokens"] = sum(map(len, spec.values()))
        if resumed:
            raw["resumed"] = [k for k, r in enumerate(ids) if r in resumed]
        if preempted:
            raw["preempted"] = len(preempted)
        for req_id in finished:
            prompt.pop(req_id, None)
        return raw


def queued(waiting: tuple, preempted_status) -> list[int]:
    """What waits after the step's schedule(), as [requests to prefill, their prompt tokens,
    the tokens' squares summed, preempted requests to resume, the KV they hold, its squares
    summed] (Dynamo's FPM split; the reader makes the variances). `waiting` is the queues'
    contents as the step's schedule() left them; a request read here may have moved on
    since, so prompt lengths (fixed for a request) are what is summed."""
    prompts = [r.num_prompt_tokens for r in waiting if r.status != preempted_status]
    resuming = (
        [r.num_computed_tokens for r in waiting if r.status == preempted_status] if len(prompts) < len(waiting) else []
    )
    return [
        len(prompts),
        sum(prompts),
        sum(p * p for p in prompts),
        len(resuming),
        sum(resuming),
        sum(k * k for k in resuming),
    ]


def graph(cudagraph_stats) -> list | None:
    """The graph the runner says the step ran, [mode, padded tokens] (ModelRunnerOutput.
    cudagraph_stats where the runner fills it; None otherwise)."""
    if cudagraph_stats is None:
        return None
    mode = getattr(cudagraph_stats, "runtime_mode", None)
    padded = getattr(cudagraph_stats, "num_padded_tokens", None)
    return [None if mode is None else str(getattr(mode, "name", mode)), padded if isinstance(padded, int) else None]
