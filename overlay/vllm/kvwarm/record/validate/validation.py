"""`python -m vllm.kvwarm validate TABLE TRACE [--out DIR] [--json] [--basis step|forward]
[--allow-loop-mismatch] [--skip-seconds S]`: every step of a served-step trace predicted from
a sweep's table (record.validate.predict), and how far off the table is per step kind and KV-depth
band, beside the trace's own repeat noise (record.validate.metrics). Writes validate.json,
validate.csv and, where matplotlib imports, validate.png (docs/validate-reference.md).

A trace and a table whose model, build, step-time engine arguments, layout or hardware
differ are refused (record.validate.match), and so are step windows of different engine
loops unless --allow-loop-mismatch. Plain data: nothing here imports vLLM.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from .. import vocabulary as v
from ..export.dynamo_engine import recorded_graphs
from ..export.input import ExportError, SweepRecord, load_sweep
from ..runs import ReportError, locate, read_rows
from ..shape import GraphConfig
from ..trace.reader import KINDS, Step, Trace, TraceError, read_trace
from . import graphs as by_graph
from .match import ASYNC, Match, Provenance, loop_of, loop_refusal, match, refusal
from .metrics import (
    Scored,
    by_band,
    figures,
    mark_levels,
    mark_noise,
    pause_rule,
    pause_split,
    relative,
    size_runs,
    size_split,
    step_key,
    steps_since_pause,
)
from .predict import MEASURED, MIXED, STEP, Predictor, read_continuation_rows, read_mixed_rows

SPECULATIVE, UNTIMED, WARM_UP = "speculative", "untimed", "warm-up"  # why a step is left out
# a step's own named reason for its missing wall (the trace's `untimed`) is its reason here:
# the sweep's work between its points held in the step's window (sweep_between_points)
SWEEP_WORK = "sweep_between_points"


class ValidateError(ValueError):
    """A table and a trace that cannot be held against each other: the message says why and the fix."""


def load_table(arg: str) -> SweepRecord:
    """A finished sweep's every rank (record.export.input), refusing one rank of several."""
    try:
        file = locate(arg)
    except ReportError as err:
        raise ValidateError(str(err)) from None
    try:
        artifact = json.loads(file.read_text())
    except (OSError, ValueError) as err:
        raise ValidateError(f"{file}: not a readable sweep artifact ({err}); pass a sweep's --out folder") from None
    layout = artifact.get("layout") if isinstance(artifact, dict) else None
    one_of_several = isinstance(layout, dict) and (layout.get("data_parallel_size") or 1) > 1
    if one_of_several and artifact.get("artifact_type") not in (v.COMBINED, "combined"):
        raise ValidateError(
            f"{file}: one rank's artifact of a sweep on {layout['data_parallel_size']} data-parallel ranks; "
            f"a trace holds every rank's steps: pass the sweep's --out folder ({file.parent.parent})"
        )
    try:
        return load_sweep(file)
    except ExportError as err:
        raise ValidateError(str(err)) from None


def predictors(table: SweepRecord, basis: str) -> list[Predictor]:
    """One predictor per rank of the table (mixed rows read apart: their point has parts)."""
    out = []
    for artifact, path in zip(table.ranks, table.paths):
        plain = {**artifact, "results": [r for r in artifact["results"] if r["point"].get("point_type") != MIXED]}
        continued = read_continuation_rows(artifact, str(path))
        out.append(Predictor(read_rows(plain, str(path)), read_mixed_rows(artifact, str(path)), basis, continued))
    return out


def served_ms(step: Step, basis: str) -> float | None:
    seconds = step.wall if basis == STEP else step.phases.get("forward")
    return None if seconds is None else seconds * 1e3


def predict(predictor: Predictor, step: Step):
    if step.kind == v.DECODE:
        return predictor.decode_step(step.decode_requests, step.decode_kv_tokens)
    prefill = prefill_part(step)
    if step.kind == v.PREFILL:
        return predictor.prefill_step(*prefill)
    return predictor.mixed_step(step.decode_requests, step.decode_kv_tokens, *prefill)


def prefill_part(step: Step) -> tuple[int, int, int, bool]:
    """The step's prefill part as the predictor takes it: its requests, new and prefix tokens,
    and whether they all continue their prompts (then continuation rows predict it, where the
    table has them)."""
    return step.prefill_requests, step.prefill_new_tokens, step.prefill_prefix_tokens, step.continues


NOT_COVERED = {
    v.DECODE: "the table has no decode rows",
    v.PREFILL: "the table has no prefill rows",
    MIXED: "the table has neither mixed rows nor both decode and prefill rows to compose them",
}


@dataclass
class Validation:
    table: str
    trace: str
    basis: str
    match: Match
    loop_mismatch_allowed: bool
    skip_seconds: float = 0.0  # the steps that ended within the trace's first skip_seconds are left out
    scored: list[Scored] = field(default_factory=list)
    excluded: dict[str, int] = field(default_factory=dict)
    torn: list[str] = field(default_factory=list)
    trace_notes: list[str] = field(default_factory=list)  # the reader's: several launches of a rank, dropped steps
    how: dict[str, str | None] = field(default_factory=dict)  # per kind: measured, composed, None
    # mixed steps predicted by composition too, where mixed rows predicted them: the comparison
    composed: list[Scored] = field(default_factory=list)
    left_out: list[tuple[Step, str]] = field(default_factory=list)  # every step not scored, with why
    pause_rules: dict[int, str] = field(default_factory=dict)  # per rank: how its pauses were read
    graphs: GraphConfig | None = None  # the table's engine's graphs (None: not recorded)
    table_graphs: dict = field(default_factory=dict)  # its rows' observed graphs (graphs.table_rows)

    def of_kind(self, kind: str) -> list[Scored]:
        return [s for s in self.scored if s.step.kind == kind]

    def kinds(self) -> dict[str, dict]:
        """Per kind the trace holds: its figures, per band, how it is predicted."""
        out = {}
        for kind in KINDS:
            scored = self.of_kind(kind)
            if scored:
                out[kind] = {
                    **figures(scored),
                    "predictor": self.how.get(kind),
                    "not_covered": None if self.how.get(kind) else NOT_COVERED[kind],
                    "bands": by_band(scored),
                    "pauses": pause_split(scored),
                    "sizes": size_split(scored),
                    "graphs": by_graph.by_mode(scored),
                    "expected_against_observed": by_graph.expected_against_observed(scored, self.graphs),
                    **({} if kind == v.DECODE else {"relative": relative(scored)}),
                }
        return out

    def summary(self) -> dict:
        """The one-line JSON (`--json`): its keys are a contract (docs/validate-reference.md)."""
        line = {"steps": len(self.scored), "coverage": figures(self.scored)["coverage"]}
        for kind in KINDS:
            f = figures(self.of_kind(kind))
            line.update({f"{kind}_{name}": f[name] for name in ("mape", "p95", "bias", "coverage", "noise", "steps")})
        line["noise"] = line["decode_noise"]
        for kind in (v.DECODE, MIXED):  # served mixed steps follow pauses most (a new request ends one)
            pauses = pause_split(self.of_kind(kind))
            line[f"{kind}_after_pause_share"] = pauses["share"]
            line.update({f"{kind}_steady_{name}": pauses["others"][name] for name in ("mape", "bias")})
        for kind in (v.PREFILL, MIXED):  # their sizes spread over the token budget: many run once
            sizes = size_split(self.of_kind(kind))
            line[f"{kind}_first_size_share"] = sizes["share"]
            line.update({f"{kind}_seen_size_{name}": sizes["seen_size"][name] for name in ("mape", "bias")})
            apart = relative(self.of_kind(kind))  # the table's level around each step taken out
            line.update({f"{kind}_relative_{name}": apart[name] for name in ("mape", "bias")})
        line["mixed_predictor"] = self.how.get(MIXED) if self.of_kind(MIXED) else None
        composed = figures(self.composed) if self.composed else {}
        line.update({f"mixed_composed_{name}": composed.get(name) for name in ("mape", "bias", "coverage")})
        apart = relative(self.composed) if self.composed else {}
        line.update({f"mixed_composed_relative_{name}": apart.get(name) for name in ("mape", "bias")})
        line.update(basis=self.basis, excluded=sum(self.excluded.values()), torn_lines=len(self.torn))
        line["excluded_by_reason"] = dict(self.excluded)
        line["skip_seconds"] = self.skip_seconds
        rules = set(self.pause_rules.values())
        line["pause_rule"] = rules.pop() if len(rules) == 1 else "per_rank" if rules else None
        known = [s for s in self.scored if s.step.graph_mode is not None]
        line["graph_reported_steps"] = len(known)
        line["graph_unexpected_steps"] = sum(
            p["steps"] for p in by_graph.expected_against_observed(known, self.graphs) if p["expected"] != p["observed"]
        )
        return line

    def record(self) -> dict:
        """validate.json: everything the command printed, and what it compared."""
        return {
            "table": self.table,
            "trace": self.trace,
            "basis": self.basis,
            "skip_seconds": self.skip_seconds,
            "summary": self.summary(),
            "kinds": self.kinds(),
            "loop": {
                "trace": self.match.loop[0],
                "table": self.match.loop[1],
                "mismatch_allowed": self.loop_mismatch_allowed,
            },
            "noted_differences": [{"field": d.field, "trace": d.trace, "table": d.table} for d in self.match.noted],
            "excluded": self.excluded,
            "pauses": {"rules": {str(rank): rule for rank, rule in self.pause_rules.items()}},
            "table_graphs": self.table_graphs,
            "torn_lines": self.torn,
            "trace_notes": self.trace_notes,
        }


def check(trace: Trace, table: SweepRecord, allow_loop_mismatch: bool) -> Match:
    """The pair's records compared; ValidateError where a step-time field or the loop differs."""
    m = match(Provenance.of_trace(trace.header), Provenance.of_artifact(table.ranks[0]))
    what = f"trace {trace.root} and table {table.root}"
    problem = refusal(
        what,
        m,
        "Sweep a table with the trace's engine arguments on the same build and hardware: "
        f"python -m vllm.kvwarm sweep --grid-from {trace.root} --out DIR <those arguments>",
    )
    problem = problem or (
        None
        if allow_loop_mismatch
        else loop_refusal(
            what,
            m,
            "Sweep under the trace's loop (--async-scheduling or --no-async-scheduling), or pass "
            "--allow-loop-mismatch to compare the windows anyway",
        )
    )
    if problem:
        raise ValidateError(problem)
    return m


def pause_rules(trace: Trace) -> dict[int, str]:
    """Per rank, how its pauses are read (record.validate.metrics.pause_rule): by the recorded
    gap where its steps carry one; else by its loop, which its header says."""
    rules = {}
    for rank, header in trace.headers.items():
        engine = header.get("engine") if isinstance(header.get("engine"), dict) else {}
        resolved = engine.get("resolved") if isinstance(engine.get("resolved"), dict) else {}
        batch_queue = loop_of(header.get("engine_loop"), resolved) == ASYNC
        rules[rank] = pause_rule([s for s in trace.steps if s.rank == rank], batch_queue)
    return rules


def validate(
    table_arg: str, trace_arg: str, basis: str = STEP, allow_loop_mismatch: bool = False, skip_seconds: float = 0.0
) -> Validation:
    """The trace read, checked against the table, and every step predicted but those that ended
    within the trace's first `skip_seconds` (a fresh server's warm-up: they still count for
    the pauses and the sizes run before)."""
    if not skip_seconds >= 0:
        raise ValidateError(f"--skip-seconds {skip_seconds}: give the seconds of the trace to leave out, 0 or more")
    try:
        trace = read_trace(trace_arg)
    except TraceError as err:
        raise ValidateError(str(err)) from None
    table = load_table(table_arg)
    m = check(trace, table, allow_loop_mismatch)
    try:
        by_rank = predictors(table, basis)
    except ReportError as err:
        raise ValidateError(str(err)) from None
    result = Validation(
        str(table.root),
        str(trace.root),
        basis,
        m,
        allow_loop_mismatch,
        skip_seconds,
        torn=list(trace.torn),
        trace_notes=trace.notes,
    )
    kinds = [p.kinds() for p in by_rank]
    for kind in KINDS:
        result.how[kind] = next((k[kind] for k in kinds if k[kind]), None)
    result.pause_rules = pause_rules(trace)
    result.graphs, result.table_graphs = recorded_graphs(table.ranks[0]), by_graph.table_rows(table.ranks)
    since, runs = steps_since_pause(trace.steps, result.pause_rules), size_runs(trace.steps)
    for step in trace.steps:
        served = served_ms(step, basis)
        reason = WARM_UP if step.at < skip_seconds else step.untimed
        reason = reason or (SPECULATIVE if step.spec_tokens else UNTIMED if served is None else None)
        if reason:
            result.excluded[reason] = result.excluded.get(reason, 0) + 1
            result.left_out.append((step, reason))
            continue
        rank = min(step.rank, len(by_rank) - 1)
        predictor = by_rank[rank]
        at = step_key(step)
        prediction = predict(predictor, step)
        result.scored.append(Scored(step, served, prediction, since_pause=since[at], size_runs=runs[at]))
        if step.kind == MIXED and kinds[rank][MIXED] == MEASURED:
            composed = predictor.composed_step(step.decode_requests, step.decode_kv_tokens, *prefill_part(step))
            result.composed.append(Scored(step, served, composed))
    mark_noise(result.scored)
    mark_levels(result.scored, result.composed)
    return result
