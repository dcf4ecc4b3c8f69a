"""What `validate` prints and writes: the per-kind, per-band table, validate.json, one CSV
line per step held against the table, and the plot where matplotlib imports. Plain data."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from ..files import write_atomically
from .graphs import expected_mode
from .metrics import LEVEL_STEPS, PAUSE_RULES, band, figures, relative
from .validation import SWEEP_WORK, WARM_UP, Validation

# what a reason for leaving a step out means, where its name does not say it all
LEFT_OUT_WHY = {
    SWEEP_WORK: "their window holds the sweep's own work between its points (a collection, the artifact's write)",
    "untimed": "no window: the first step of a rank, or after the engine waited for work",
    "speculative": "draft tokens: no row is such a step",
    "unknown_output": "an output the adapter did not see scheduled: docs/hooks.md's served-trace contracts broke",
}

CSV_COLUMNS = [
    "rank",
    "step",
    "kind",
    "band",
    "depth",
    "decode_requests",
    "decode_kv_tokens",
    "prefill_requests",
    "prefill_new_tokens",
    "prefill_prefix_tokens",
    "graph_mode",
    "padded_tokens",
    "expected_graph_mode",
    "served_ms",
    "predicted_ms",
    "error_pct",
    "covered",
    "predictor",
    "shape_repeats",
    "size_runs",
    "noise_pct",
    "level",
    "left_out",
]


def _pct(value, signed: bool = False) -> str:
    return "n/a" if value is None else f"{value:+.2f}%" if signed else f"{value:.2f}%"


def _line(name: str, band: str, f: dict) -> str:
    return (
        f"{name:<8} {band:<10} {f['steps']:>7} {_pct(f['coverage']):>9} {_pct(f['mape']):>8} "
        f"{_pct(f['p95']):>8} {_pct(f['bias'], True):>9} {_pct(f['noise']):>8}"
    )


def _split(kind: str, split: dict, apart: str, what: str, rest: str, rest_name: str) -> str | None:
    """The kind's steps set apart (`what` they did) against the rest, where it has both."""
    f, others = split[apart], split[rest]
    if not f["predicted"] or not others["predicted"]:
        return None
    return (
        f"{kind}: {f['steps']} step(s) ({_pct(split['share'])}) {what}: MAPE {_pct(f['mape'])}, bias "
        f"{_pct(f['bias'], True)}; {rest_name}: MAPE {_pct(others['mape'])}, bias {_pct(others['bias'], True)}"
    )


def _pauses(kind: str, split: dict) -> str | None:
    """The kind's steps after a pause of the engine against the others."""
    idle_ms = split["pause_seconds"] * 1e3
    pause = f"within {split['within_steps']} steps of a pause of the engine ({idle_ms:g} ms idle or more)"
    return _split(kind, split, "after_pause", pause, "others", "the other steps")


def _sizes(kind: str, split: dict) -> str | None:
    """The kind's steps that ran their token count for the first time against the others."""
    first = "ran their token count for the first time on their rank"
    return _split(kind, split, "first_size", first, "seen_size", "the sizes run before")


def _relative(kind: str, apart: dict, composed: dict | None) -> str | None:
    """The kind's figures with the table's level around each step taken out."""
    if not apart["steps"]:
        return None
    line = (
        f"{kind}, against the decode steps around them (the table's level within {LEVEL_STEPS} steps taken "
        f"out): MAPE {_pct(apart['mape'])}, bias {_pct(apart['bias'], True)} over {apart['steps']} step(s)"
    )
    if composed and composed["steps"]:
        line += f"; composed: MAPE {_pct(composed['mape'])}, bias {_pct(composed['bias'], True)}"
    return line


def _graphs(kind: str, k: dict) -> list[str]:
    """The kind's figures per graph mode the runner reported, and expected against observed."""
    modes = k["graphs"]
    if list(modes) == ["unreported"]:
        return []
    lines = [
        f"{kind} in graph {mode}: {f['steps']} step(s), MAPE {_pct(f['mape'])}, bias {_pct(f['bias'], True)}"
        for mode, f in modes.items()
    ]
    for p in k["expected_against_observed"]:
        if p["expected"] != p["observed"]:
            lines.append(
                f"{kind}: {p['steps']} step(s) ran graph {p['observed']} where their shape expects {p['expected']}: "
                f"MAPE {_pct(p['mape'])}, bias {_pct(p['bias'], True)}"
            )
    return lines


def _context(result: Validation) -> list[str]:
    """How the pauses were read, and what the table's rows say of their graphs."""
    rules = sorted(result.pause_rules.items())
    lines = [f"pauses on rank {rank} read by {rule}: {PAUSE_RULES[rule]}" for rank, rule in rules]
    rows = result.table_graphs
    if rows.get("observed"):
        lines.append(
            f"table: {rows['as_expected']} of the {rows['observed']} row(s) whose graph the runner reported ran "
            "the graph their shape expects"
        )
    for why, count in (rows.get("unknown") or {}).items():
        lines.append(f"table: {count} row(s) without an observed graph: {why}")
    return lines


def text(result: Validation) -> str:
    """The table users read: per kind each band, then the kind over every band."""
    s = result.summary()
    lines = [
        f"table {result.table} against trace {result.trace}: {s['steps']} step(s) on the {result.basis} basis",
        f"{'kind':<8} {'band':<10} {'steps':>7} {'coverage':>9} {'MAPE':>8} {'P95':>8} {'bias':>9} {'noise':>8}",
    ]
    pauses = []
    for kind, k in result.kinds().items():
        if k["not_covered"]:
            lines.append(f"{kind:<8} {'all':<10} {k['steps']:>7}  not covered: {k['not_covered']}")
            continue
        for depth, f in k["bands"].items():
            lines.append(_line(kind, depth, f))
        label = f"{kind}*" if k["predictor"] == "composed" else kind
        lines.append(_line(label, "all", k))
        pauses += [_pauses(kind, k["pauses"]), _sizes(kind, k["sizes"]), *_graphs(kind, k)]
        if "relative" in k:
            composed = relative(result.composed) if kind == "mixed" and result.composed else None
            pauses.append(_relative(kind, k["relative"], composed))
    if result.how.get("mixed") == "composed" and result.of_kind("mixed"):
        lines.append("mixed*: composed (the prefill row plus the decode curve's marginal): the table has no mixed rows")
    if result.composed:
        c = figures(result.composed)
        lines.append(
            f"mixed, composed as planners do (the prefill row plus the decode curve's marginal), beside the "
            f"measured rows: MAPE {_pct(c['mape'])}, bias {_pct(c['bias'], True)}, coverage {_pct(c['coverage'])}"
        )
    lines.append(
        f"coverage {_pct(s['coverage'])}; noise: the trace's repeat noise (served steps of one shape), "
        "the floor under MAPE"
    )
    lines += [p for p in pauses if p]
    lines += _context(result)
    for reason, count in result.excluded.items():
        within = f" (ended within the trace's first {result.skip_seconds:g} s: --skip-seconds)"
        within = within if reason == WARM_UP else f" ({LEFT_OUT_WHY[reason]})" if reason in LEFT_OUT_WHY else ""
        lines.append(f"left out: {count} {reason} step(s){within}")
    for torn in result.torn:
        lines.append(f"torn last line, skipped: {torn}")
    for note in result.trace_notes:
        lines.append(f"trace: {note}")
    for d in result.match.noted:
        lines.append(f"differs, said and not refused: {d}")
    if result.loop_mismatch_allowed and result.match.loop_differs:
        trace, table = result.match.loop
        lines.append(f"loop mismatch allowed: the trace ran the {trace} loop, the table the {table} one")
    return "\n".join(lines)


def _shape(st) -> list:
    return [
        st.rank,
        st.number,
        st.kind,
        band(st.depth),
        st.depth,
        st.decode_requests,
        st.decode_kv_tokens,
        st.prefill_requests,
        st.prefill_new_tokens,
        st.prefill_prefix_tokens,
    ]


def steps_csv(result: Validation) -> str:
    """One line per traced step: those held against the table, then those left out (their
    `left_out` says why; nothing predicted)."""
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(CSV_COLUMNS)
    for s in result.scored:
        st, p = s.step, s.prediction
        expected = expected_mode(st, result.graphs)
        writer.writerow(
            [
                *_shape(st),
                st.graph_mode or "",
                "" if st.padded_tokens is None else st.padded_tokens,
                expected or "",
                f"{s.served_ms:.4f}",
                "" if p is None else f"{p.ms:.4f}",
                "" if s.error is None else f"{s.error:.3f}",
                int(s.covered),
                "" if p is None else p.how,
                s.group,
                s.size_runs,
                "" if s.noise is None else f"{s.noise:.3f}",
                "" if s.level is None else f"{s.level:.4f}",
                "",
            ]
        )
    for st, reason in result.left_out:
        writer.writerow([*_shape(st), st.graph_mode or "", *[""] * (len(CSV_COLUMNS) - 12), reason])
    return out.getvalue()


def write(result: Validation, out: Path) -> tuple[list[Path], str | None]:
    """validate.json, validate.csv and validate.png in `out`; the note says why no plot."""
    from .plot import plot_png

    out.mkdir(parents=True, exist_ok=True)
    written = [out / "validate.json", out / "validate.csv"]
    write_atomically(written[0], json.dumps(result.record(), indent=2, default=str).encode())
    write_atomically(written[1], steps_csv(result).encode())
    png = plot_png(result)
    if png is None:
        (out / "validate.png").unlink(missing_ok=True)
        return written, "no validate.png: matplotlib is not installed here (pip install matplotlib)"
    write_atomically(out / "validate.png", png)
    return [*written, out / "validate.png"], None
