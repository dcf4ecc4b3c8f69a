"""The figures of one point (the main process): the upper median of a measurement, the paired
ratio with its 95% percentile-bootstrap interval, each side's A/A, the carry-over from the
other side, the spread, and whether an interval holds 1 or lies within the tolerance."""

from __future__ import annotations

import math
import random
import statistics

PHASES = ("schedule", "forward", "update", "sweep", "other")
TOLERANCE = 0.02  # every interval within 1 +- 2 %, A/A within 2 %
BOOTSTRAP = 2000
NOT_MEASURED = (math.nan, math.nan, math.nan)


def upper_median(values: list[float]) -> float:
    return statistics.median_high(values)


def paired_ratio(a: list[float], b: list[float], seed: int = 0) -> tuple[float, float, float]:
    """The median of a[j] / b[j] over pairs j, and its 95% percentile-bootstrap interval."""
    ratios = [x / y for x, y in zip(a, b)]
    rng = random.Random(seed)
    boots = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(BOOTSTRAP))
    return statistics.median(ratios), boots[int(0.025 * BOOTSTRAP)], boots[int(0.975 * BOOTSTRAP) - 1]


def a_a(values: list[float]) -> tuple[float, float, float]:
    """One side against itself, each measurement against the one two later (2 over 0, 3 over
    1, 6 over 4, 7 over 5, ...): ABBA runs a side's measurements alternately after one of its
    own and after one of the other side's, and two apart they ran after the same."""
    first = [j for j in range(len(values) - 2) if j % 4 < 2]
    if not first:  # fewer than three measurements (the quick mode)
        return NOT_MEASURED
    return paired_ratio([values[j + 2] for j in first], [values[j] for j in first])


def carry_over(point: dict, side: str) -> tuple[float, float, float]:
    """A side's measurements that ran right after the other side's over those right after
    its own (the k-th against the k-th): what the state the other side leaves costs."""
    letter = side[0].upper()  # `order` holds S and N
    after: dict[bool, list[float]] = {True: [], False: []}
    positions = [i for i, x in enumerate(point["order"]) if x == letter]
    for wall, i in zip(point[side]["walls"], positions):
        if i:
            after[point["order"][i - 1] == letter].append(wall)
    n = min(len(after[True]), len(after[False]))
    return paired_ratio(after[False][:n], after[True][:n]) if n else NOT_MEASURED


def spread(values: list[float]) -> float:
    """The median absolute deviation over the median: one side's measurement-to-measurement noise."""
    m = statistics.median(values)
    return statistics.median(abs(v - m) for v in values) / m


def point_figures(p: dict) -> dict:
    s, n = p["shadow"]["walls"], p["natural"]["walls"]
    return {
        "ratio": paired_ratio(s, n),
        "aa_shadow": a_a(s),
        "aa_natural": a_a(n),
        "carry_over": {side: carry_over(p, side) for side in ("shadow", "natural")},
        "spread": {"shadow": spread(s), "natural": spread(n)},
        # per step, the median over measurements
        "faults": {side: statistics.median(p[side]["faults"]) for side in ("shadow", "natural")},
        "preempted": {side: statistics.median(p[side]["preempted"]) for side in ("shadow", "natural")},
        "shadow_ms": 1e3 * statistics.median(s),
        "natural_ms": 1e3 * statistics.median(n),
        "phases": {
            side: {ph: 1e3 * statistics.median(m[ph] for m in p[side]["phases"]) for ph in PHASES}
            for side in ("shadow", "natural")
        },
        "schedule_ratio": paired_ratio(
            [m["schedule"] for m in p["shadow"]["phases"]], [m["schedule"] for m in p["natural"]["phases"]]
        ),
        "tokens_match": _tokens_match(p),
        # the first measurement after the build (or the point's first): against the counted median
        "warm_up": {
            side: upper_median(p["warm_up"][side]) / statistics.median(p[side]["walls"]) for side in p["warm_up"]
        },
    }


def _tokens_match(p: dict) -> str:
    """How many of the shadows' sampled tokens equal the natural requests' (first measurements)."""
    shadow, natural = p["shadow"]["tokens"][0], p["natural"]["tokens"][0]
    same = sum(a == b for s, t in zip(shadow, natural) for a, b in zip(s, t))
    return f"{same}/{sum(len(t) for t in natural)}"


def holds_one(f) -> bool:
    """A (median, low, high) interval that contains 1."""
    return f[1] <= 1 <= f[2]


def within(f) -> bool:
    return 1 - TOLERANCE <= f[1] and f[2] <= 1 + TOLERANCE
