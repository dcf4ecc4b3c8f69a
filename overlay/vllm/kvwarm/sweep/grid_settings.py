"""A generated grid's settings: the config's "grid" (true, or caps and capture sizes) checked
before the engine loads (each cap within its bound: sweep.grid.CAP_BOUNDS), the axes it is
laid around, and what it is laid from once the ranks agree on the pool (sweep.run)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..record.shape import GraphConfig
from .grid import CAP_BOUNDS, CAPS
from .settings import SettingsError


@dataclass(frozen=True)
class GridLaying:
    """What a generated grid is laid from once the ranks agree on the pool."""

    decode_steps: int  # what a decode point's requests run (SweepConfig.decode_steps)
    caps: dict
    axes: GraphConfig
    pool: dict  # sweep.meetings.pool_record: the ranks' smallest
    trace: object = None  # a served-step trace's headers (record.trace.reader.Trace) for --grid-from
    shapes: object = None  # the shapes its steps ran, counted (sweep.trace_grid.Shapes)
    trace_caps: dict | None = None
    trace_skip_seconds: float = 0.0  # the trace's first seconds left out of it (--skip-seconds)


def _positive(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def wants_grid(spec: dict) -> bool:
    """Whether a sweep's config asks for a generated grid: "grid": true, or caps ({} too)."""
    return spec.get("grid") not in (None, False)


def check_grid(spec_grid) -> tuple[dict, list[int] | None]:
    """A generated grid's caps (every cap, the defaults filled in) and the capture sizes
    given, or SettingsError naming what is wrong: checked before the engine loads."""
    asked = dict(spec_grid) if isinstance(spec_grid, dict) else {}
    sizes = asked.pop("capture_sizes", None)
    problem = spec_grid is not True and not isinstance(spec_grid, dict)
    problem = problem or set(asked) - set(CAPS) or not all(_positive(n) for n in asked.values())
    if problem or (sizes is not None and not (isinstance(sizes, list) and all(_positive(n) for n in sizes))):
        raise SettingsError(
            f'"grid": {spec_grid!r}: the grid takes true, or caps among {", ".join(CAPS)} (positive integers) '
            'and "capture_sizes" (a list of positive integers)'
        )
    check_bounds(asked, CAP_BOUNDS, f'"grid" ({spec_grid!r})')
    return {**CAPS, **asked}, sizes


def check_bounds(asked: dict, bounds: dict, setting: str, why: dict | None = None) -> None:
    """Each cap asked for within its bound, else SettingsError naming the cap, its bound and
    the fix; `why`: per cap, what its bound holds (where it is more than the values of one axis)."""
    over = [name for name in bounds if asked.get(name, 0) > bounds[name]]
    if over:
        name = over[0]
        reason = f" ({why[name](asked[name])})" if why and name in why else ""
        raise SettingsError(
            f"{setting}: {name} {asked[name]} is beyond its bound {bounds[name]}{reason}; give {name} "
            f"{bounds[name]} or less (a larger grid: write its points to a file and pass --points)"
        )


def grid_settings(spec_grid, graphs: GraphConfig) -> tuple[dict, GraphConfig]:
    """The caps of a generated grid and the capture sizes its axes are laid around: the
    engine's, or "capture_sizes" given (a target deployment's, e.g. planned on a CPU host,
    whose platform clears them); the rows' graph record stays this engine's."""
    caps, sizes = check_grid(spec_grid)
    if sizes is not None:
        sizes = tuple(sorted(set(sizes)))
        graphs = replace(
            graphs,
            decode_capture_sizes=tuple(s for s in sizes if s <= graphs.max_num_seqs),
            prefill_capture_sizes=sizes,
        )
    return caps, graphs
