"""The step-time plot of one or more runs (matplotlib, which vLLM does not require: nothing
here imports it at module level, and plot_png() returns None where it cannot be imported, so
the sweep writes its PNG only where matplotlib is installed)."""

from __future__ import annotations

import io
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from . import vocabulary as v
from .files import write_atomically
from .runs import Row, Run, from_artifact

logger = logging.getLogger(__name__)

# label and marker per kv_seed_regime; any other regime is drawn with UNKNOWN_MARKER
REGIMES = {
    v.REAL_KV: ("real KV", "o"),
    v.FAKE_FALLBACK: ("fake KV (fallback)", "s"),
    v.LEGACY: ("fake KV (warm-up off)", "^"),
}
UNKNOWN_MARKER = "D"
LINESTYLES = ("-", "--", ":", "-.")


REGIMES.update(
    {
        v.REAL_PREFIX: ("real prefix", "o"),
        v.FAKE_PREFIX: ("fake prefix", "s"),
        v.NOT_APPLICABLE: ("no prefix", "v"),
    }
)
FILLED = (v.REAL_KV, v.REAL_PREFIX, v.NOT_APPLICABLE)


@dataclass(frozen=True)
class Panel:
    """One kind of point on one axes: its x value, its series and their labels."""

    kind: str
    x: Callable[[Row], int]
    series: Callable[[Row], tuple]
    label: Callable[[Row], str]
    xlabel: str
    ylabel: str


DECODE = Panel(
    v.DECODE,
    lambda r: r.k,
    lambda r: (r.b,),
    lambda r: _batch_label(r),
    "K: KV tokens read per decode step (tokens)",
    "decode step time (ms): median, bars min–max of the timed steps",
)
PREFILL = Panel(
    v.PREFILL,
    lambda r: r.n,
    lambda r: (r.b, r.k // r.b),
    lambda r: f"{_batch_label(r)}, prefix {r.k // r.b}",
    "N: new tokens per prefill step (tokens); dotted: prefill capture sizes",
    "prefill step time (ms): median, bars min–max of the shots",
)


def figure(runs: list[Run]):
    """Median step time: decode against K (one series per batch size), prefill against N (one
    series per batch size and prefix per request, capture sizes marked), min-max bars over
    the timed samples, a marker per KV regime; legend entries only for what is drawn. One
    panel per kind a run has (decode alone where there is none)."""
    from matplotlib.figure import Figure

    kinds = [p for p in (DECODE, PREFILL) if any(r.kind == p.kind for run in runs for r in run.rows)] or [DECODE]
    fig = Figure(figsize=(9.5, 5.8 * len(kinds)), dpi=110, layout="constrained")
    for i, panel in enumerate(kinds):
        ax = fig.add_subplot(len(kinds), 1, i + 1)
        _draw(ax, runs, panel)
        if i == 0:
            ax.set_title(_title(runs), fontsize=10, loc="left")
    return fig


def _recorded_capture_sizes(runs: list[Run], kind: str) -> list[int]:
    key = "decode_capture_sizes" if kind == v.DECODE else "prefill_capture_sizes"
    return sorted({s for run in runs for s in (run.meta.cudagraph or {}).get(key, [])})


def _draw(ax, runs: list[Run], panel: Panel) -> None:
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    colours = [f"C{i % 10}" for i in range(10)]
    rows_of = {id(run): [r for r in run.rows if r.kind == panel.kind] for run in runs}
    keys = sorted({panel.series(r) for run in runs for r in rows_of[id(run)]})
    colour_of = {k: colours[i % len(colours)] for i, k in enumerate(keys)}
    regimes, noisy, handles = [], False, []
    many = len(runs) > 1
    for n, run in enumerate(runs):
        style = LINESTYLES[n % len(LINESTYLES)]
        for key in keys:
            rows = sorted((r for r in rows_of[id(run)] if panel.series(r) == key), key=panel.x)
            if not rows:
                continue
            colour = colour_of[key]
            xs, ms = [panel.x(r) for r in rows], [r.median_ms for r in rows]
            ax.plot(xs, ms, linestyle=style, color=colour, linewidth=1.5)
            ax.errorbar(
                xs,
                ms,
                yerr=[[r.median_ms - r.min_ms for r in rows], [r.max_ms - r.median_ms for r in rows]],
                fmt="none",
                ecolor=colour,
                elinewidth=1,
                capsize=3,
            )
            for r in rows:
                marker = REGIMES.get(r.regime, (r.regime, UNKNOWN_MARKER))[1]
                ax.plot(
                    [panel.x(r)],
                    [r.median_ms],
                    marker=marker,
                    color=colour,
                    markersize=7,
                    linestyle="none",
                    markerfacecolor=colour if r.regime in FILLED else "white",
                    markeredgewidth=1.5,
                )
                if v.NOISY in r.reasons:
                    ax.plot(
                        [panel.x(r)],
                        [r.median_ms],
                        marker="o",
                        markersize=15,
                        linestyle="none",
                        markerfacecolor="none",
                        markeredgecolor="red",
                    )
                    noisy = True
                if r.regime not in regimes:
                    regimes.append(r.regime)
            if not many:
                handles.append(Line2D([], [], color=colour, linestyle=style, label=panel.label(rows[0])))
    if many:
        labels = {panel.series(r): panel.label(r) for run in runs for r in rows_of[id(run)]}
        handles += [Line2D([], [], color=colour_of[k], label=labels[k]) for k in keys]
        handles += [
            Line2D(
                [],
                [],
                color="black",
                linestyle=LINESTYLES[n % len(LINESTYLES)],
                label=f"{'AB'[n] if n < 2 else n + 1}: {run.label}",
            )
            for n, run in enumerate(runs)
        ]
    for regime in sorted(regimes, key=lambda r: list(REGIMES).index(r) if r in REGIMES else len(REGIMES)):
        label, marker = REGIMES.get(regime, (regime, UNKNOWN_MARKER))
        handles.append(
            Line2D(
                [],
                [],
                marker=marker,
                color="dimgray",
                linestyle="none",
                markersize=7,
                markerfacecolor="dimgray" if regime in FILLED else "white",
                label=label,
            )
        )
    if noisy:
        thresholds = {run.meta.noisy_spread for run in runs} - {None}
        over = f"{100 * thresholds.pop():g}%" if len(thresholds) == 1 else "the threshold"
        handles.append(
            Line2D(
                [],
                [],
                marker="o",
                markersize=12,
                linestyle="none",
                markerfacecolor="none",
                markeredgecolor="red",
                label=f"noisy (spread over {over})",
            )
        )
    if panel.kind == v.PREFILL:
        drawn = [panel.x(r) for run in runs for r in rows_of[id(run)]]
        for size in (s for s in _recorded_capture_sizes(runs, v.PREFILL) if drawn and s <= max(drawn)):
            ax.axvline(size, color="0.6", linestyle=":", linewidth=1)
    if handles:
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=9)  # never over data
    ax.set_xlabel(panel.xlabel)
    ax.set_ylabel(panel.ylabel)
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.margins(x=0.05, y=0.1)
    ax.xaxis.set_major_locator(
        MaxNLocator(nbins=7, steps=[1, 2, 2.5, 5, 10], integer=True)
    )  # tokens are counted; labels must not touch
    ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:,.10g}"))
    if not any(rows_of.values()):
        ax.text(0.5, 0.5, "no point measured", transform=ax.transAxes, ha="center", va="center", fontsize=14)
    ax.grid(True, color="0.9")


def _batch_label(row: Row) -> str:
    if row.global_b and row.global_b != row.b:
        return f"B={row.b} per rank ({row.global_b} over all ranks)"
    return f"B={row.b}"


def _title(runs: list[Run]) -> str:
    if len(runs) == 1:
        run = runs[0]
        mark = f"  [{run.marking}]" if run.marking else ""
        return f"{_what(runs)} step time: {run.model}{mark}\nbuild {run.build} · layout {run.layout}"
    lines = [f"{_what(runs)} step time: {' vs '.join(r.label for r in runs)}"]
    lines += [
        f"{'AB'[n] if n < 2 else n + 1}: {r.describe()}" + (f"  [{r.marking}]" if r.marking else "")
        for n, r in enumerate(runs)
    ]
    return "\n".join(lines)


def _what(runs: list[Run]) -> str:
    kinds = {r.kind for run in runs for r in run.rows}
    return "Prefill and decode" if kinds == {v.DECODE, v.PREFILL} else "Prefill" if kinds == {v.PREFILL} else "Decode"


def png_bytes(fig) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def plot_png(artifact: dict) -> bytes | None:
    """The PNG of one artifact (as the sweep holds it in memory), or None where matplotlib
    is not installed."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return None
    return png_bytes(figure([from_artifact(artifact, "sweep", "sweep")]))


_said_no_plot = False


def write_plot(out_dir: str | Path, artifact: dict) -> Path | None:
    """sweep.png beside a finished sweep's sweep.json, where matplotlib imports (said once
    per process where it does not)."""
    global _said_no_plot
    path = Path(out_dir) / v.ARTIFACT_PNG
    png = plot_png(artifact)
    if png is None:
        path.unlink(missing_ok=True)
        if not _said_no_plot:
            _said_no_plot = True
            logger.info(
                "[kvwarm sweep] no %s: matplotlib is not installed here (pip install matplotlib, "
                "or render later with python -m vllm.kvwarm report OUT)",
                v.ARTIFACT_PNG,
            )
        return None
    write_atomically(path, png)
    return path
