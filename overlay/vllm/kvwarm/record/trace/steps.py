"""A trace's step line as a `Step`: composed here from the raw numbers the recorder writes
(format versions 2 and 3), or read as composed by the recorder of version 1.

Version 3 is version 2 with, per step, `gap` (the last update end before its schedule() to
that schedule()'s entry; null for a rank's first step) and, where its `wall` is null for a
named reason, `untimed` (record.vocabulary.TRACE_UNTIMED); its records of dropped steps are
the reader's (record.trace.reader). Version 2's raw fields (docs/validate-reference.md#the-trace):
`new` ([prompt length, tokens computed before, tokens scheduled] per new request), `cached`
(`computed`, `scheduled`, `prompt`: one entry per request scheduled again), `spec` and
`spec_tokens` (speculative tokens per cached request, where any), `resumed` (positions in
`cached` of preempted requests resuming), `preempted`, `queued` ([requests, prompt tokens, their squares, resuming
requests, their KV, its squares]), `gc` ([collections, seconds]), `graph` ([mode, padded
tokens], where the runner reports it).

The composition: a decode request is one scheduled token (past its speculative ones) on a
request whose prompt was computed before the step; every other request is a prefill
chunk (a new request, a later chunk of a long prompt, a preempted request computing its
tokens again), and a later chunk of a prompt not resuming is a continuation. Contexts are
tokens in KV before this step's tokens; variances are population variances, as Dynamo's
forward-pass metrics' are. Plain data: nothing here imports vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DECODE, PREFILL, MIXED = "decode", "prefill", "mixed"  # a step's kind (an idle step is never written)
KINDS = (DECODE, PREFILL, MIXED)
NO_QUEUE = {"requests": 0, "tokens": 0, "var": 0.0, "resuming": 0, "resuming_kv_tokens": 0, "resuming_kv_var": 0.0}


class TraceError(ValueError):
    """A trace that cannot be read: the message names the file (and line), what is wrong and the fix."""


@dataclass(frozen=True)
class Step:
    """One traced engine step, in the trace's own units (tokens, seconds)."""

    rank: int
    number: int  # its stream's step counter (record.trace.reader: a stream is one launch of a rank)
    wall: float | None  # the window since the last update end (None: a rank's first, after idle, `untimed`)
    phases: dict[str, float]
    decode_requests: int
    decode_kv_tokens: int  # the decode requests' contexts, summed
    prefill_requests: int
    prefill_new_tokens: int
    prefill_prefix_tokens: int  # computed or cache-hit before this chunk, summed
    spec_tokens: int = 0
    graph_mode: str | None = None
    padded_tokens: int | None = None
    at: float = 0.0  # seconds from the header's started_at to the step's update end
    span: float | None = None  # the step's own schedule() entry to its update end
    decode_kv_var: float = 0.0
    prefill_new_var: float = 0.0
    prefill_prompt_var: float = 0.0
    continuations: int = 0
    preempted: int = 0
    outputs: int = 0
    queued: dict = field(default_factory=lambda: dict(NO_QUEUE))
    gap: float | None = None  # the last update end before its schedule() to that schedule()'s entry
    untimed: str | None = None  # why `wall` is null, where named (record.vocabulary.TRACE_UNTIMED)
    stream: int = 0  # the launch of its rank it belongs to (record.trace.reader.Stream.index)

    @property
    def kind(self) -> str:
        if self.decode_requests and self.prefill_requests:
            return MIXED
        return PREFILL if self.prefill_requests else DECODE

    @property
    def continues(self) -> bool:
        """Whether every prefill chunk of the step continues its prompt (a continuation)."""
        return 0 < self.continuations == self.prefill_requests

    @property
    def tokens(self) -> int:
        """The tokens the step runs through the model: one per decode, its chunks' new tokens."""
        return self.decode_requests + self.prefill_new_tokens + self.spec_tokens

    @property
    def depth(self) -> int:
        """The KV already in the cache that the step reads: decode contexts and prefill prefixes."""
        return self.decode_kv_tokens + self.prefill_prefix_tokens


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _seconds(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0


def _counts(values) -> bool:
    return isinstance(values, list) and all(_count(x) for x in values)


def _var(n: int, total: int, squares: int) -> float:
    return (n * squares - total * total) / (n * n) if n else 0.0


def _stats(values: list[int]) -> tuple[int, int, float]:
    """(count, sum, population variance)."""
    return len(values), sum(values), _var(len(values), sum(values), sum(v * v for v in values))


def _refuse(where: str, problems: list[str]) -> None:
    if problems:
        raise TraceError(
            f"{where}: not a step record ({', '.join(problems)} missing or not a count/seconds); "
            "the file was not written by the trace recorder, or was edited"
        )


def _timing(record: dict) -> list[tuple[str, bool]]:
    phases = record.get("phases")
    return [
        ("step", _count(record.get("step"))),
        ("wall", record.get("wall") is None or _seconds(record.get("wall"))),
        ("span", record.get("span") is None or _seconds(record.get("span"))),
        ("gap", record.get("gap") is None or _seconds(record.get("gap"))),
        ("untimed", record.get("untimed") is None or isinstance(record.get("untimed"), str)),
        (
            "phases",
            phases is None or (isinstance(phases, dict) and all(_seconds(t) for t in phases.values() if t is not None)),
        ),
    ]


def _common(record: dict, rank: int, stream: int) -> dict:
    return {
        "rank": rank,
        "stream": stream,
        "gap": record.get("gap"),
        "untimed": record.get("untimed"),
        "number": record["step"],
        "wall": record["wall"],
        "span": record.get("span"),
        "at": float(record.get("at") or 0.0),
        "phases": {p: t for p, t in (record.get("phases") or {}).items() if t is not None},
        "outputs": record.get("outputs") if _count(record.get("outputs")) else 0,
    }


def step_v2(record: dict, rank: int, where: str, stream: int = 0) -> Step:
    """A version 2 or 3 line: raw numbers, composed here."""
    cached, new = record.get("cached"), record.get("new")
    cached = cached if isinstance(cached, dict) else {}
    columns = [cached.get(k) for k in ("computed", "scheduled", "prompt")]
    spec = record.get("spec")
    queue = record.get("queued")
    _refuse(
        where,
        [
            name
            for name, ok in _timing(record)
            + [
                ("new", isinstance(new, list) and all(_counts(r) and len(r) == 3 for r in new)),
                ("cached", all(_counts(c) for c in columns) and len({len(c) for c in columns}) == 1),
                ("spec", spec is None or (_counts(spec) and len(spec) == len(columns[0] or ()))),
                ("queued", queue is None or (_counts(queue) and len(queue) == 6)),
            ]
            if not ok
        ],
    )
    decode, new_tokens, lengths, prefix, continuations = [], [], [], 0, 0
    for length, before, n in new:
        new_tokens.append(n)
        lengths.append(length)
        prefix += before
    resumed = set(record.get("resumed") or ())
    for k, (before, n, length) in enumerate(zip(*columns)):
        n -= spec[k] if spec else 0
        if before >= length and n == 1:
            decode.append(before)
            continue
        new_tokens.append(n)
        lengths.append(length)
        prefix += before
        continuations += 0 < before < length and k not in resumed
    n_decode, kv, kv_var = _stats(decode)
    n_prefill, new_sum, new_var = _stats(new_tokens)
    q = queue or [0] * 6
    graph = record.get("graph") if isinstance(record.get("graph"), list) and len(record["graph"]) == 2 else [None, None]
    return Step(
        **_common(record, rank, stream),
        decode_requests=n_decode,
        decode_kv_tokens=kv,
        decode_kv_var=kv_var,
        prefill_requests=n_prefill,
        prefill_new_tokens=new_sum,
        prefill_prefix_tokens=prefix,
        prefill_new_var=new_var,
        prefill_prompt_var=_stats(lengths)[2],
        continuations=continuations,
        spec_tokens=record.get("spec_tokens") if _count(record.get("spec_tokens")) else 0,
        preempted=record.get("preempted") if _count(record.get("preempted")) else 0,
        queued={
            "requests": q[0],
            "tokens": q[1],
            "var": _var(*q[0:3]),
            "resuming": q[3],
            "resuming_kv_tokens": q[4],
            "resuming_kv_var": _var(*q[3:6]),
        },
        graph_mode=graph[0] if isinstance(graph[0], str) else None,
        padded_tokens=graph[1] if _count(graph[1]) else None,
    )


def step_v1(record: dict, rank: int, where: str, stream: int = 0) -> Step:
    """A version 1 line: composed by the recorder."""
    decode, prefill = record.get("decode"), record.get("prefill")
    _refuse(
        where,
        [
            name
            for name, ok in _timing(record)
            + [
                ("decode.requests", isinstance(decode, dict) and _count(decode.get("requests"))),
                ("decode.kv_tokens", isinstance(decode, dict) and _count(decode.get("kv_tokens"))),
                ("prefill.requests", isinstance(prefill, dict) and _count(prefill.get("requests"))),
                ("prefill.new_tokens", isinstance(prefill, dict) and _count(prefill.get("new_tokens"))),
                ("prefill.prefix_tokens", isinstance(prefill, dict) and _count(prefill.get("prefix_tokens"))),
                ("spec_tokens", record.get("spec_tokens") is None or _count(record.get("spec_tokens"))),
            ]
            if not ok
        ],
    )
    graph = record.get("graph") if isinstance(record.get("graph"), dict) else {}
    padded = graph.get("padded_tokens")
    queue = record.get("queued") if isinstance(record.get("queued"), dict) else {}
    return Step(
        **_common(record, rank, stream),
        decode_requests=decode["requests"],
        decode_kv_tokens=decode["kv_tokens"],
        decode_kv_var=float(decode.get("kv_var") or 0.0),
        prefill_requests=prefill["requests"],
        prefill_new_tokens=prefill["new_tokens"],
        prefill_prefix_tokens=prefill["prefix_tokens"],
        prefill_new_var=float(prefill.get("new_var") or 0.0),
        prefill_prompt_var=float(prefill.get("prompt_var") or 0.0),
        continuations=prefill.get("continuations") if _count(prefill.get("continuations")) else 0,
        spec_tokens=record.get("spec_tokens") or 0,
        preempted=record.get("preempted") if _count(record.get("preempted")) else 0,
        queued={k: queue.get(k, d) for k, d in NO_QUEUE.items()},
        graph_mode=graph.get("mode") if isinstance(graph.get("mode"), str) else None,
        padded_tokens=padded if _count(padded) else None,
    )


PARSERS = {1: step_v1, 2: step_v2, 3: step_v2}  # the trace schema versions this reader knows


def parse_step(record, rank: int, where: str, version: int = 3, stream: int = 0) -> Step:
    """One step line's record as a Step; TraceError naming `where` and the field when it is not one."""
    if not isinstance(record, dict):
        raise TraceError(f"{where}: not a step record (a JSON {type(record).__name__})")
    return PARSERS[version](record, rank, where, stream)
