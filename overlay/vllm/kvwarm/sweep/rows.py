"""A point's row: its regime, its stamps and its timed steps, from what the sweep measured.

The median is upstream's upper median (sorted[n // 2]); a row whose timed samples (decode
steps, prefill shots) spread more than NOISY_SPREAD of it is stamped noisy (its median may be
polluted, e.g. by the first steps after a rung build). Each sample's graph is the one the model
runner reported for its step (`observe`: sweep.timing.observed_graph), or why none is known.
"""

from __future__ import annotations

import statistics

from ..record import vocabulary as v
from ..record.artifact import PointRow
from .plan import PointPlan, SweepConfig
from .points import DecodePoint
from .timing import NOT_REPORTED, Window

NOISY_SPREAD = 0.5


def skipped_row(point: DecodePoint, reason: str, detail: str) -> PointRow:
    """The row of a point that was not measured, with why (`detail`, in words)."""
    return PointRow(point.total_kv_read_tokens, point.batch_size, v.skip_regime(reason), detail=detail)


def measured_row(
    plan: PointPlan, contexts: list[int], times: list[float], config: SweepConfig, chains: list, drifted: set[str]
) -> PointRow:
    """The row of a point whose requests decoded at `contexts` (as admitted) in the steps
    `times`. `chains`: the requests whose state the shadows read (their depth is stamped);
    `drifted`: the ids of chains an in-place shadow has advanced, updated here."""
    point = plan.point
    measured = sum(contexts) + point.batch_size
    reasons = [v.CONTEXT_CLAMPED] if measured != point.total_kv_read_tokens else []
    regime = v.REAL_KV if plan.real else fake_regime(plan, config)
    if plan.real:
        reasons += [v.STAMP_REAL_KV, *state_reasons(config, contexts, chains, drifted)]
    elif regime == v.FAKE_FALLBACK:
        reasons.append(v.STAMP_FAKE_FALLBACK)
    row = PointRow(
        measured, point.batch_size, regime, reasons, list(times), statistics.median_high(times), sample_kind=v.STEP
    )
    return stamp_noise(row)


def fake_regime(plan: PointPlan, config: SweepConfig) -> str:
    """The regime of a point on fake KV: an A/B sweep's fake side is the baseline fake KV
    (legacy, as with the warm-up off); any other is the sweep's (fake_fallback or legacy)."""
    return v.LEGACY if plan.ab == v.AB_FAKE else config.fake_regime


def state_reasons(config: SweepConfig, contexts: list[int], chains: list, drifted: set[str]) -> list[str]:
    """The state stamps of shadows on real KV at `contexts` (as admitted), as measured_row's
    arguments: the mode and the depth of the deepest state they read, and in place whether a
    chain had drifted already (`drifted` updated here)."""
    # exact: the state stands at each shadow's context once its admission token is in
    depth = max(contexts) + 1 if config.state_mode == v.EXACT else max(c.num_computed_tokens for c in chains)
    reasons = v.state_stamps(config.state_mode, depth)
    if config.state_mode == v.INPLACE:
        ids = {c.request_id for c in chains}
        reasons += [v.STATE_DRIFTED] if ids & drifted else []
        drifted |= ids
    return reasons


def observe(row: PointRow, windows: list[Window | None]) -> PointRow:
    """The graph each timed sample's step ran in as the runner reported it, [mode, padded
    tokens] (`windows`: the samples' own, in their order; None where a step had none), or,
    where it reported none for any, why (the first reason a step gives)."""
    if row.skipped:
        return row
    graphs = [w.graph if w is not None else None for w in windows]
    if any(g is not None for g in graphs):
        row.observed_graphs = graphs
    else:
        row.observed_why = next((w.graph_why for w in windows if w is not None and w.graph_why), NOT_REPORTED)
    return row


def stamp_noise(row: PointRow) -> PointRow:
    """A measured row (decode or prefill) whose samples spread more than NOISY_SPREAD of
    their median is stamped noisy; a row of one sample never is."""
    if len(row.samples) > 1 and row.spread > NOISY_SPREAD:
        row.sample_reasons.append(v.NOISY)
    return row
