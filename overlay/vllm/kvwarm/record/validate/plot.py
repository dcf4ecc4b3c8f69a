"""validate.png: served against predicted time per step, and the signed error against KV
depth with the bands marked (matplotlib, imported only when drawing: plot_png returns None
where it cannot be imported)."""

from __future__ import annotations

from ..plot import png_bytes
from ..trace.reader import KINDS
from .metrics import BAND_EDGES
from .validation import Validation

COLOURS = {"decode": "C0", "prefill": "C1", "mixed": "C2"}


def figure(result: Validation):
    """Top: served against predicted (filled inside the table's range, open outside it), the
    line of a perfect table. Bottom: signed error against depth, the bands' edges dotted."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9.5, 10), dpi=110, layout="constrained")
    top, bottom = fig.add_subplot(2, 1, 1), fig.add_subplot(2, 1, 2)
    predicted = [s for s in result.scored if s.prediction is not None]
    for kind in KINDS:
        for inside in (True, False):
            mine = [s for s in predicted if s.step.kind == kind and s.covered == inside]
            if not mine:
                continue
            composed = " (composed)" if result.how.get(kind) == "composed" else ""
            style = {
                "color": COLOURS[kind],
                "s": 12,
                "facecolors": COLOURS[kind] if inside else "none",
                "label": f"{kind}{composed}{'' if inside else ', outside the table'}",
            }
            top.scatter([s.served_ms for s in mine], [s.prediction.ms for s in mine], **style)
            bottom.scatter([max(1, s.step.depth) for s in mine], [s.error for s in mine], **style)
    if predicted:
        hi = max(max(s.served_ms, s.prediction.ms) for s in predicted)
        top.plot([0, hi], [0, hi], color="0.5", linewidth=1, label="predicted = served")
    s = result.summary()
    top.set_title(
        f"{result.table} against {result.trace} ({result.basis} basis)\n"
        f"decode MAPE {_pct(s['decode_mape'])}, bias {_pct(s['decode_bias'])}, noise {_pct(s['noise'])}; "
        f"coverage {_pct(s['coverage'])}",
        fontsize=9,
        loc="left",
    )
    top.set_xlabel("served step time (ms)")
    top.set_ylabel("predicted from the table (ms)")
    bottom.set_xscale("log")
    depths = [max(1, s.step.depth) for s in predicted]
    for edge in (e for e in BAND_EDGES[1:] if depths and min(depths) < e < max(depths)):
        bottom.axvline(edge, color="0.7", linestyle=":", linewidth=1)
    bottom.axhline(0, color="0.5", linewidth=1)
    bottom.set_xlabel("KV depth of the step (tokens, log; dotted: band edges)")
    bottom.set_ylabel("error: (predicted - served) / served (%)")
    for ax in (top, bottom):
        ax.grid(True, color="0.9")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
        if not predicted:
            ax.text(0.5, 0.5, "no step predicted", transform=ax.transAxes, ha="center", va="center", fontsize=14)
    return fig


def _pct(value) -> str:
    return "n/a" if value is None else f"{value:.2f}%"


def plot_png(result: Validation) -> bytes | None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return None
    return png_bytes(figure(result))
