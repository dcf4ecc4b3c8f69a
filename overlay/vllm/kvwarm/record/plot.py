"""The step-time plot of one or more runs (matplotlib, which vLLM does not require: nothing
here imports it at module level, and plot_png() returns None where it cannot be imported, so
the sweep writes its PNG only where matplotlib is installed)."""

from __future__ import annotations

import io
import logging
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


def figure(runs: list[Run]):
    """Median step time against K: one series per batch size (per run), min-max bars
    over the timed steps, a marker per KV regime; legend entries only for what is drawn."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    fig = Figure(figsize=(9.5, 5.8), dpi=110, layout="constrained")
    ax = fig.add_subplot()
    colours = [f"C{i % 10}" for i in range(10)]
    batches = sorted({row.b for run in runs for row in run.rows})
    colour_of = {b: colours[i % len(colours)] for i, b in enumerate(batches)}
    regimes, noisy, handles = [], False, []
    many = len(runs) > 1
    for n, run in enumerate(runs):
        style = LINESTYLES[n % len(LINESTYLES)]
        for b in batches:
            rows = sorted((r for r in run.rows if r.b == b), key=lambda r: r.k)
            if not rows:
                continue
            colour = colour_of[b]
            ks, ms = [r.k for r in rows], [r.median_ms for r in rows]
            ax.plot(ks, ms, linestyle=style, color=colour, linewidth=1.5)
            ax.errorbar(
                ks,
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
                    [r.k],
                    [r.median_ms],
                    marker=marker,
                    color=colour,
                    markersize=7,
                    linestyle="none",
                    markerfacecolor=colour if r.regime == v.REAL_KV else "white",
                    markeredgewidth=1.5,
                )
                if v.NOISY in r.reasons:
                    ax.plot(
                        [r.k],
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
                handles.append(Line2D([], [], color=colour, linestyle=style, label=_batch_label(rows[0])))
    if many:
        handles += [Line2D([], [], color=colour_of[b], label=f"B={b}") for b in batches]
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
                markerfacecolor="dimgray" if regime == v.REAL_KV else "white",
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
    if handles:
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=9)  # never over data
    ax.set_xlabel("K: KV tokens read per decode step (tokens)")
    ax.set_ylabel("decode step time (ms): median, bars min–max of the timed steps")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.margins(x=0.05, y=0.1)
    ax.xaxis.set_major_locator(
        MaxNLocator(nbins=7, steps=[1, 2, 2.5, 5, 10], integer=True)
    )  # K counts tokens; labels must not touch
    ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:,.10g}"))
    if not any(run.rows for run in runs):
        ax.text(0.5, 0.5, "no point measured", transform=ax.transAxes, ha="center", va="center", fontsize=14)
    ax.grid(True, color="0.9")
    ax.set_title(_title(runs), fontsize=10, loc="left")
    return fig


def _batch_label(row: Row) -> str:
    if row.global_b and row.global_b != row.b:
        return f"B={row.b} per rank ({row.global_b} over all ranks)"
    return f"B={row.b}"


def _title(runs: list[Run]) -> str:
    if len(runs) == 1:
        run = runs[0]
        mark = f"  [{run.marking}]" if run.marking else ""
        return f"Decode step time: {run.model}{mark}\nbuild {run.build} · layout {run.layout}"
    lines = [f"Decode step time: {' vs '.join(r.label for r in runs)}"]
    lines += [
        f"{'AB'[n] if n < 2 else n + 1}: {r.describe()}" + (f"  [{r.marking}]" if r.marking else "")
        for n, r in enumerate(runs)
    ]
    return "\n".join(lines)


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
