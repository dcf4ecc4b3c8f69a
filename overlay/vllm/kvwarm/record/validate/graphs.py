"""`validate`'s figures by CUDA-graph mode: the served steps split by the graph the model
runner reported each ran in (the trace's `graph`, where the release and the engine report
it: vLLM fills `cudagraph_stats` with --cudagraph-metrics), and, where both are known, the
graph the step's shape expects on the table's engine (record.shape.expected_graph) against
the one it ran: a table timed in a captured graph predicts an eager step badly, and this
says so. The table's side: how many of its rows ran the graph their shape expects, by the
observed graph each row records (record.artifact, the row's `graph` block).

Plain data: nothing here imports vLLM.
"""

from __future__ import annotations

from ..shape import GraphConfig, expected_graph
from ..trace.reader import Step
from .metrics import Scored, figures

UNREPORTED = "unreported"  # a served step whose graph the runner did not report


def observed_mode(step: Step) -> str:
    return step.graph_mode or UNREPORTED


def expected_mode(step: Step, graphs: GraphConfig | None) -> str | None:
    """The graph the step's shape should run in on the table's engine (None: not recorded)."""
    if graphs is None:
        return None
    requests = step.decode_requests + step.prefill_requests
    return expected_graph(graphs, step.tokens, requests)["expected_cudagraph_mode"]


def by_mode(scored: list[Scored]) -> dict[str, dict]:
    """Per observed graph mode (UNREPORTED last), the figures of the steps that ran in it."""
    modes = sorted({observed_mode(s.step) for s in scored}, key=lambda m: (m == UNREPORTED, m))
    return {mode: figures([s for s in scored if observed_mode(s.step) == mode]) for mode in modes}


def expected_against_observed(scored: list[Scored], graphs: GraphConfig | None) -> list[dict]:
    """Per (expected, observed) pair of the steps where both are known: the steps and their
    MAPE and bias, the pairs that differ first."""
    pairs: dict[tuple[str, str], list[Scored]] = {}
    for s in scored:
        expected = expected_mode(s.step, graphs)
        if expected is not None and s.step.graph_mode is not None:
            pairs.setdefault((expected, s.step.graph_mode), []).append(s)
    out = []
    for (expected, observed), members in sorted(pairs.items(), key=lambda p: (p[0][0] == p[0][1], p[0])):
        f = figures(members)
        out.append({"expected": expected, "observed": observed, **{k: f[k] for k in ("steps", "mape", "bias")}})
    return out


def table_rows(artifacts: list[dict]) -> dict:
    """The table's measured rows by what their `graph` block says: the rows whose observed
    graph is known, those that ran the graph their shape expects, and why the others'
    observed graph is not known (the first reason a row gives)."""
    known = as_expected = 0
    unknown: dict[str, int] = {}
    for artifact in artifacts:
        for row in artifact.get("results") or []:
            graph = row.get("graph") if isinstance(row, dict) and isinstance(row.get("graph"), dict) else {}
            observed = graph.get("observed_cudagraph_mode")
            if observed is None:
                why = graph.get("why") or "the row records no observed graph (a sweep older than the record)"
                unknown[why] = unknown.get(why, 0) + 1
                continue
            known += 1
            as_expected += observed == graph.get("expected_cudagraph_mode")
    return {"observed": known, "as_expected": as_expected, "unknown": unknown}
