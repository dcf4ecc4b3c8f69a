"""The figures `validate` reports per step kind and KV-depth band (docs/validate.md): steps,
coverage, MAPE, P95 of the absolute error, signed bias, and the trace's own repeat noise.

  error     (predicted - served) / served, in percent: negative where the table is faster
  MAPE      the mean absolute error over the steps predicted
  P95       the 95th percentile of the absolute errors (linear between order statistics)
  bias      the mean signed error
  median_error  the median signed error: beside the bias where a few steps far off move the
            mean (under the batch queue a host stall longer than a forward leaves a window
            with no forward in it, which a table row over-predicts many times)
  coverage  the share of the steps whose prediction needed no extrapolation
  noise     the trace's repeat noise: steps of the same shape (SHAPE_BIN) grouped, each
            step's |served - its group's median| / that median, averaged over the steps of
            groups of two or more: the MAPE an oracle that knew every shape's median served
            time would score, the floor under any table's MAPE
  band      the step's depth (the KV already cached that it reads: decode contexts plus
            prefill prefixes) in BANDS
  after a pause  the steps within AFTER_PAUSE_STEPS of a pause of their rank's engine (a
            step without a window, as the first after the engine had nothing to run, or idle
            PAUSE_SECONDS or more between a step's update and the next step's schedule()): a
            table of steps run back to back does not predict them. The idle is read by one
            of PAUSE_RULES per rank (pause_rule): the trace's recorded gap where it has one;
            else, one step at a time, a window's wall less its step's span; under the batch
            queue without a gap nothing but the steps without a window (there the next
            schedule() runs before the update, so wall - span is never a pause)
  first size  the steps whose token count (Step.tokens) their rank's engine runs for the first
            time in the trace: on the CPU engine such a step pays about 2.5 ms more than the
            same count run again (its linears' kernels are made for it: docs/measurements/served-vs-table.md);
            a sweep's warm shot runs every point's count before its timed steps, and an engine
            served for hours has run most counts its budget allows
  relative  a prefill or mixed step's error with the table's level around it taken out: its
            prediction scaled by the median served / predicted of its rank's decode steps
            within LEVEL_STEPS step numbers of it (LEVEL_MIN of them at least, else none). The
            decode figures judge that level; what remains judges the rows of the step's own kind

Plain data: nothing here imports vLLM.
"""

from __future__ import annotations

import math
import statistics
from bisect import bisect_left, bisect_right
from dataclasses import dataclass

from .. import vocabulary as v
from ..trace.reader import Step
from .predict import Prediction

# lower edges of the KV-depth bands, in tokens: powers of four from 1Ki
BAND_EDGES = (0, 1 << 10, 1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20)
SHAPE_BIN = 0.01  # token counts within 1 % of each other are the same shape for the noise
# On the development host a served step ran 1.3x its shape's median in the first two steps
# after a pause of the engine, 1.09x to the 9th, 1.00x from the 10th (docs/measurements/served-vs-table.md)
PAUSE_SECONDS, AFTER_PAUSE_STEPS = 0.005, 10
# A served run and its table's sweep are minutes apart, and a host's speed can move a whole
# table against the served steps by more than a kind's own error over minutes (on the
# development host decode steps at 0.7x to 1.4x: docs/measurements/served-vs-table.md); the decode steps
# around a step (a served trace is mostly decode steps) say where that level stood then
LEVEL_STEPS, LEVEL_MIN = 50, 5
# How a rank's pauses are read (pause_rule), and what each says of them
GAP, WALL_LESS_SPAN, WINDOWS_ONLY = "gap", "wall_minus_span", "no_window_only"
PAUSE_RULES = {
    GAP: "the recorded gap from an update's end to the next schedule()",
    WALL_LESS_SPAN: "a step's window less its own span (one step at a time, no recorded gap)",
    WINDOWS_ONLY: (
        "only the steps without a window: a batch-queue trace without a recorded gap, whose windows overlap the "
        "next schedule(), so an idle shorter than a wait for work is not seen"
    ),
}


def _tokens(n: int) -> str:
    return "0" if n == 0 else f"{n >> 20}M" if n >= 1 << 20 else f"{n >> 10}k"


BANDS = tuple(
    f"{_tokens(lo)}-{_tokens(hi)}" if hi else f"{_tokens(lo)}+" for lo, hi in zip(BAND_EDGES, (*BAND_EDGES[1:], None))
)


def band(depth: int) -> str:
    return BANDS[max(i for i, edge in enumerate(BAND_EDGES) if depth >= edge)]


def _bin(tokens: int) -> int:
    return 0 if tokens <= 0 else 1 + math.floor(math.log(tokens) / math.log1p(SHAPE_BIN))


def shape(step: Step) -> tuple:
    """What makes two steps repeats of one another: the kind, the request counts, the token
    counts within SHAPE_BIN, and the graph where the runner said it."""
    return (
        step.kind,
        step.decode_requests,
        _bin(step.decode_kv_tokens),
        step.prefill_requests,
        _bin(step.prefill_new_tokens),
        _bin(step.prefill_prefix_tokens),
        step.graph_mode,
        step.padded_tokens,
    )


@dataclass
class Scored:
    """One traced step held against the table."""

    step: Step
    served_ms: float
    prediction: Prediction | None
    noise: float | None = None  # |served - its shape's median| / median, percent (groups of >= 2)
    group: int = 1  # steps of its shape
    since_pause: int = 0  # steps its rank's engine ran since it last paused (0: the first after it)
    size_runs: int = 1  # its rank's steps of its token count so far, itself included (1: the first)
    level: float | None = None  # the table's level around it (mark_levels; prefill and mixed steps)

    @property
    def after_pause(self) -> bool:
        return self.since_pause < AFTER_PAUSE_STEPS

    @property
    def first_size(self) -> bool:
        return self.size_runs == 1

    @property
    def error(self) -> float | None:
        if self.prediction is None or not self.served_ms:
            return None
        return 100 * (self.prediction.ms - self.served_ms) / self.served_ms

    @property
    def relative_error(self) -> float | None:
        """The error with the table's level around the step taken out."""
        if self.level is None or self.error is None:
            return None
        return 100 * (self.prediction.ms * self.level - self.served_ms) / self.served_ms

    @property
    def covered(self) -> bool:
        return self.prediction is not None and self.prediction.inside

    @property
    def band(self) -> str:
        return band(self.step.depth)


def pause_rule(steps: list[Step], batch_queue: bool) -> str:
    """How one rank's pauses are read (PAUSE_RULES): by the recorded gap where its steps carry
    one, else by wall - span one step at a time, else (the batch queue) by the windows alone."""
    if any(s.gap is not None for s in steps):
        return GAP
    return WINDOWS_ONLY if batch_queue else WALL_LESS_SPAN


def paused(step: Step, rule: str) -> bool:
    """Whether the rank's engine paused before the step: no window (an idle wait, the rank's
    first step, the sweep's work between points), or idle PAUSE_SECONDS or more by `rule`."""
    if step.wall is None:
        return True
    if rule == GAP:
        return step.gap is not None and step.gap >= PAUSE_SECONDS
    if rule == WALL_LESS_SPAN:
        return step.span is None or step.wall - step.span >= PAUSE_SECONDS
    return False


def step_key(step: Step) -> tuple[int, int, int]:
    """Where a step stands: its rank, its stream (a launch of the rank) and its number there."""
    return step.rank, step.stream, step.number


def steps_since_pause(steps: list[Step], rules: dict[int, str] | None = None) -> dict[tuple[int, int, int], int]:
    """Per step (`step_key`): the steps its engine ran since it last paused, in each stream's order
    (every traced step counts, scored or not); `rules`: each rank's pause_rule (default:
    wall - span)."""
    since, last = {}, {}
    for step in sorted(steps, key=step_key):
        rule, engine = (rules or {}).get(step.rank, WALL_LESS_SPAN), step_key(step)[:2]
        last[engine] = 0 if paused(step, rule) else last.get(engine, 0) + 1
        since[step_key(step)] = last[engine]
    return since


def size_runs(steps: list[Step]) -> dict[tuple[int, int, int], int]:
    """Per step (`step_key`): its engine's steps of its token count up to it, itself included, in
    each stream's order (every traced step counts, scored or not)."""
    runs, seen = {}, {}
    for step in sorted(steps, key=step_key):
        key = (*step_key(step)[:2], step.tokens)
        seen[key] = seen.get(key, 0) + 1
        runs[step_key(step)] = seen[key]
    return runs


def split(scored: list[Scored], apart, name: str, rest: str) -> dict:
    """The share of the steps `apart` picks, their figures under `name`, the others' under `rest`."""
    chosen = [s for s in scored if apart(s)]
    return {
        "share": 100 * len(chosen) / len(scored) if scored else None,
        name: figures(chosen),
        rest: figures([s for s in scored if not apart(s)]),
    }


def size_split(scored: list[Scored]) -> dict:
    """The figures of the steps that ran their token count for the first time, and of the others."""
    return split(scored, lambda s: s.first_size, "first_size", "seen_size")


def pause_split(scored: list[Scored]) -> dict:
    """The figures of the steps after a pause and of the others, and the share of the first."""
    return {
        "within_steps": AFTER_PAUSE_STEPS,
        "pause_seconds": PAUSE_SECONDS,
        **split(scored, lambda s: s.after_pause, "after_pause", "others"),
    }


def mark_levels(scored: list[Scored], *also: list[Scored]) -> None:
    """Each prefill and mixed step's level, in `scored` and in `also` (the same steps predicted
    another way): the median served / predicted of its rank's decode steps within LEVEL_STEPS."""
    ratios: dict[tuple[int, int], list[tuple[int, float]]] = {}  # per engine (rank, stream)
    for s in scored:
        if s.step.kind == v.DECODE and s.error is not None and s.prediction.ms > 0:
            ratios.setdefault(step_key(s.step)[:2], []).append((s.step.number, s.served_ms / s.prediction.ms))
    for points in ratios.values():
        points.sort()
    numbers = {engine: [n for n, _ in points] for engine, points in ratios.items()}
    for s in [*scored, *(x for group in also for x in group)]:
        engine = step_key(s.step)[:2]
        if s.step.kind == v.DECODE or engine not in ratios:
            continue
        near = numbers[engine]
        lo, hi = bisect_left(near, s.step.number - LEVEL_STEPS), bisect_right(near, s.step.number + LEVEL_STEPS)
        if hi - lo >= LEVEL_MIN:
            s.level = statistics.median(q for _, q in ratios[engine][lo:hi])


def relative(scored: list[Scored]) -> dict:
    """MAPE and bias of the steps' relative errors (those with a level and a prediction)."""
    errors = [s.relative_error for s in scored if s.relative_error is not None]
    return {"steps": len(errors), "mape": _mean([abs(e) for e in errors]), "bias": _mean(errors)}


def mark_noise(scored: list[Scored]) -> None:
    """Every step's deviation from the median of the steps of its shape."""
    groups: dict[tuple, list[Scored]] = {}
    for s in scored:
        groups.setdefault(shape(s.step), []).append(s)
    for members in groups.values():
        median = statistics.median(s.served_ms for s in members)
        for s in members:
            s.group = len(members)
            s.noise = 100 * abs(s.served_ms - median) / median if len(members) > 1 and median else None


def p95(values: list[float]) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=20, method="inclusive")[18]


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def figures(scored: list[Scored]) -> dict:
    """The figures of a set of steps (percent; None where no step gives one)."""
    errors = [s.error for s in scored if s.error is not None]
    return {
        "steps": len(scored),
        "covered": sum(s.covered for s in scored),
        "coverage": 100 * sum(s.covered for s in scored) / len(scored) if scored else None,
        "predicted": len(errors),
        "mape": _mean([abs(e) for e in errors]),
        "p95": p95([abs(e) for e in errors]) if errors else None,
        "bias": _mean(errors),
        "median_error": statistics.median(errors) if errors else None,
        "noise": _mean([s.noise for s in scored if s.noise is not None]),
        "noise_steps": sum(s.noise is not None for s in scored),
    }


def by_band(scored: list[Scored]) -> dict[str, dict]:
    """Each band's figures, for the bands that hold a step, shallow first."""
    return {b: figures([s for s in scored if s.band == b]) for b in BANDS if any(s.band == b for s in scored)}
