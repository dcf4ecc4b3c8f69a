"""`python -m vllm.kvwarm report DIR [DIR ...] [--out OUTDIR] [--allow-running]`: sweep
artifacts (schema v1 and v2) rendered into report.html with PNG plots, and report.csv.
With two or more runs, each is compared with the first: their points are joined by
(K, B), and per point the ratio of medians and overall the MAPE are printed and shown.
An A/B sweep (`sweep --ab`) is compared with itself: its fake side against its real side,
measured in one boot. Its table, everywhere else, is its real side.
"""

from __future__ import annotations

import argparse
import csv
import html
import io
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from . import vocabulary as v
from .plot import figure, png_bytes
from .runs import ReportError, Row, Run, labels_for, load_run
from .shape import point_key

MATPLOTLIB_HINT = (
    "matplotlib is not installed in this Python environment: `pip install matplotlib` "
    "there to get the plots (the sweep's JSON and CSV do not need it)"
)


@dataclass
class Comparison:
    base: Run
    other: Run
    joined: list[tuple[Row, Row]]
    only_base: list[Row]
    only_other: list[Row]

    @property
    def mape(self) -> float | None:
        """Mean of |other - base| / base over the joined points, in percent."""
        if not self.joined:
            return None
        return 100 * statistics.fmean(abs(b.median_ms - a.median_ms) / a.median_ms for a, b in self.joined)


def compare(base: Run, other: Run) -> Comparison:
    """Points joined by (K, B); a point measured twice in a run pairs with the other run's
    occurrences in order."""
    pending: dict[tuple, list[Row]] = {}
    for row in other.rows:
        pending.setdefault(row.key, []).append(row)
    joined, only_base = [], []
    for row in base.rows:
        match = pending.get(row.key)
        if match:
            joined.append((row, match.pop(0)))
        else:
            only_base.append(row)
    left = {id(r) for rows in pending.values() for r in rows}
    only_other = [row for row in other.rows if id(row) in left]
    return Comparison(base, other, joined, only_base, only_other)


def skip_reason(run: Run, key: tuple) -> str:
    for s in run.artifact.get("skipped_points") or []:
        p = s.get("point") or {}
        if "total_kv_read_tokens" in p and point_key(p) == key:
            return f"skipped there: {s.get('kv_seed_regime')}"
    return "not in its points"


def ab_comparison(run: Run) -> Comparison:
    """An A/B sweep's fake side (B) against its real side (A), point by point."""
    return compare(run.side(v.AB_REAL), run.side(v.AB_FAKE))


def comparison_text(c: Comparison) -> str:
    lines = [
        f"B = {c.other.label} against A = {c.base.label}",
        f"{'K':>9} {'B':>4}  {'A median ms':>11}  {'B median ms':>11}  {'B/A':>6}  A regime / B regime",
    ]
    for a, b in c.joined:
        lines.append(
            f"{a.k:>9} {a.b:>4}  {a.median_ms:>11.3f}  {b.median_ms:>11.3f}  "
            f"{b.median_ms / a.median_ms:>6.3f}  {a.regime} / {b.regime}{_prefill(a)}"
        )
    mape = "n/a (no point in common)" if c.mape is None else f"{c.mape:.2f}%"
    lines.append(f"MAPE of B against A over {len(c.joined)} joined point(s): {mape}")
    for name, rows, run in (("A", c.only_base, c.other), ("B", c.only_other, c.base)):
        for row in rows:
            lines.append(f"unmatched: K={row.k} B={row.b}{_prefill(row)} only in {name} ({skip_reason(run, row.key)})")
    return "\n".join(lines)


def _prefill(row: Row) -> str:
    """What a prefill row adds to a line written for decode rows (K is then its prefix P)."""
    return f" (prefill N={row.n})" if row.kind == v.PREFILL else ""


CSV_COLUMNS = [
    "run",
    "source",
    "status",
    "total_kv_read_tokens",
    "batch_size",
    "global_batch_size",
    "kv_seed_regime",
    "median_ms",
    "min_ms",
    "max_ms",
    "spread",
    "steps",
    "steady_ms",
    "sample_reasons",
    "baseline_run",
    "baseline_median_ms",
    "ratio_to_baseline",
    "point_type",
    "total_prefill_tokens",
    *(f"{phase}_ms" for phase in v.PHASES),
]


def write_csv(runs: list[Run], comparisons: list[Comparison]) -> str:
    """One line per measured row of every run; rows of the second and later runs carry the
    first run's median at the same (K, B) and the ratio, where it has one."""
    baseline = {id(b): (c.base.label, a) for c in comparisons for a, b in c.joined}
    text = io.StringIO()
    writer = csv.writer(text)
    writer.writerow(CSV_COLUMNS)
    for run in runs:
        for row in run.rows:
            base_label, base = baseline.get(id(row), (None, None))
            writer.writerow(
                [
                    run.label,
                    run.source,
                    run.status,
                    row.k,
                    row.b,
                    row.global_b or "",
                    row.regime,
                    f"{row.median_ms:.4f}",
                    f"{row.min_ms:.4f}",
                    f"{row.max_ms:.4f}",
                    f"{row.spread:.4f}",
                    len(row.steps_ms),
                    " ".join(f"{t:.4f}" for t in row.steps_ms),
                    " ".join(row.reasons),
                    base_label or "",
                    f"{base.median_ms:.4f}" if base else "",
                    f"{row.median_ms / base.median_ms:.4f}" if base else "",
                    row.kind,
                    row.n,
                    *(f"{row.phases_ms[p]:.4f}" if p in row.phases_ms else "" for p in v.PHASES),
                ]
            )
    return text.getvalue()


STYLE = """body{font-family:sans-serif;margin:2em;max-width:70em}table{border-collapse:collapse;margin:.5em 0}
td,th{border:1px solid #ccc;padding:.2em .6em;text-align:right}th{background:#f4f4f4}td.l,th.l{text-align:left}
.failed{background:#fdd;border:1px solid #c00;padding:.5em}.running{background:#ffd;border:1px solid #aa0;padding:.5em}
img{max-width:100%;border:1px solid #ddd}"""


def _table(header: list[str], lines: list[list], left: int = 0) -> str:
    def cell(tag, i, value):
        return f"<{tag}{' class=l' if i < left else ''}>{html.escape(str(value))}</{tag}>"

    head = "".join(cell("th", i, h) for i, h in enumerate(header))
    body = "".join("<tr>" + "".join(cell("td", i, v) for i, v in enumerate(line)) + "</tr>" for line in lines)
    return f"<table><tr>{head}</tr>{body}</table>"


def _run_section(n: int, run: Run, png: str) -> str:
    a = run.artifact
    parts = [f"<h2>Run {n}: {html.escape(run.label)}</h2>"]
    if run.status in (v.FAILED, v.RUNNING):
        what = (
            "FAILED: " + str(a.get("error") or "no error recorded")
            if run.status == v.FAILED
            else "RUNNING: the sweep had not finished; these are the rows measured so far"
        )
        parts.append(f"<p class={run.status}>{html.escape(what)}</p>")
    config = a.get("config") or {}
    resolved = (
        (config.get("engine_args") or {}).get("resolved") if isinstance(config.get("engine_args"), dict) else None
    )
    info = [
        ["file", run.source],
        ["status", run.status],
        ["schema version", a.get("schema_version")],
        ["model", config.get("model", run.model)],
        ["build", run.build],
        ["layout", run.layout],
        ["hardware", run.hardware],
        ["torch", a.get("torch") or "unknown"],
        ["started / finished", f"{a.get('started_at') or 'unknown'} / {a.get('finished_at') or 'unknown'}"],
        ["points file", config.get("points", "unknown")],
    ]
    if resolved:
        info.append(["engine (resolved)", ", ".join(f"{k}={v}" for k, v in sorted(resolved.items()))])
    parts.append(_table(["", ""], info, left=2))
    parts.append(f'<p><img src="{png}" alt="step time against K for {html.escape(run.label)}"></p>')
    header = ["type", "N", "K", "B", "regime", "median ms", "min ms", "max ms", "spread", "steps", "sample reasons"]
    lines = [
        [
            r.kind,
            r.n if r.kind == v.PREFILL else "",
            r.k,
            r.b,
            r.regime,
            f"{r.median_ms:.3f}",
            f"{r.min_ms:.3f}",
            f"{r.max_ms:.3f}",
            f"{100 * r.spread:.1f}%",
            len(r.steps_ms),
            " ".join(r.reasons),
        ]
        for r in run.rows
    ]
    if any(r.ranks for r in run.rows):  # combined view: the row's median is the slowest rank's
        header.append("median ms per rank")
        for line, r in zip(lines, run.rows):
            line.append(" ".join(f"{x.get('rank')}: {1e3 * x.get('median_seconds', 0):.3f}" for x in r.ranks or []))
    parts.append(_table(header, lines))
    skipped = [
        [
            (s.get("point") or {}).get("total_kv_read_tokens"),
            (s.get("point") or {}).get("batch_size"),
            s.get("kv_seed_regime"),
            s.get("reason"),
        ]
        for s in a.get("skipped_points") or []
    ]
    if skipped:
        parts.append("<h3>Skipped points</h3>" + _table(["K", "B", "regime", "reason"], skipped))
    if a.get("ranks"):
        ranks = [
            [r.get("rank"), r.get("status"), r.get("rows"), r.get("path"), r.get("error") or ""] for r in a["ranks"]
        ]
        parts.append("<h3>Data-parallel ranks</h3>" + _table(["rank", "status", "rows", "path", "error"], ranks))
    return "\n".join(parts)


def _comparison_section(title: str, c: Comparison, png: str) -> str:
    mape = "n/a (no point in common)" if c.mape is None else f"{c.mape:.2f}%"
    lines = [
        [a.k, a.b, f"{a.median_ms:.3f}", f"{b.median_ms:.3f}", f"{b.median_ms / a.median_ms:.3f}", a.regime, b.regime]
        for a, b in c.joined
    ]
    parts = [
        f"<h2>{html.escape(title)}</h2>",
        (
            f"<p><b>MAPE of B against A: {mape}</b> over {len(c.joined)} joined point(s) "
            "(mean of |B − A| / A of the medians)</p>"
        ),
        _table(["K", "B", "A median ms", "B median ms", "B/A", "A regime", "B regime"], lines),
    ]
    unmatched = [
        [r.k, r.b, f"only in {name}", skip_reason(run, r.key)]
        for name, rows, run in (("A", c.only_base, c.other), ("B", c.only_other, c.base))
        for r in rows
    ]
    if unmatched:
        parts.append("<h3>Unmatched points</h3>" + _table(["K", "B", "", "why"], unmatched))
    parts.append(f'<p><img src="{png}" alt="A and B overlaid"></p>')
    return "\n".join(parts)


def render(runs: list[Run], comparisons: list[Comparison], out: Path, ab: list[Comparison] = ()) -> list[Path]:
    """report.html, report.csv and one PNG per run and per comparison, in `out`; `ab`: each
    A/B sweep's comparison of its sides (ab_comparison), in the order of the runs."""
    out.mkdir(parents=True, exist_ok=True)
    written, sections = [], []
    titled = [
        *(
            (f"compare-{n}-vs-1.png", f"Run {n} (B: {c.other.label}) against run 1 (A: {c.base.label})", c)
            for n, c in enumerate(comparisons, start=2)
        ),
        *(
            (
                f"ab-{c.base.label}.png".replace("/", "_").replace(" ", "-"),
                f"A/B in one boot: {c.other.label} (B) against {c.base.label} (A)",
                c,
            )
            for c in ab
        ),
    ]
    for name, title, c in titled:
        (out / name).write_bytes(png_bytes(figure([c.base, c.other])))
        written.append(out / name)
        sections.append(_comparison_section(title, c, name))
    for n, run in enumerate(runs, start=1):
        name = f"run-{n}.png"
        (out / name).write_bytes(png_bytes(figure([run])))
        written.append(out / name)
        sections.append(_run_section(n, run, name))
    page = (
        f"<!doctype html><html><head><meta charset=utf-8><title>kvwarm sweep report</title>"
        f"<style>{STYLE}</style></head><body><h1>kvwarm sweep report</h1>"
        f"<p>{len(runs)} run(s); made by <code>python -m vllm.kvwarm report</code>.</p>\n"
        + "\n".join(sections)
        + "</body></html>\n"
    )
    (out / "report.html").write_text(page)
    (out / "report.csv").write_text(write_csv([*runs, *(c.other for c in ab)], [*comparisons, *ab]))
    return [out / "report.html", out / "report.csv", *written]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m vllm.kvwarm report",
        description="Render sweep artifacts into report.html (PNG plots) and report.csv; with two or "
        "more, compare each with the first (per-point ratio of medians, MAPE).",
    )
    p.add_argument("dirs", nargs="+", metavar="DIR", help="a sweep's --out folder, or its sweep.json")
    p.add_argument("--out", default="kvwarm-report", help="folder for the report (default: ./kvwarm-report)")
    p.add_argument(
        "--allow-running", action="store_true", help="render an artifact whose sweep has not finished (marked running)"
    )
    return p


def run(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(f"kvwarm report: {MATPLOTLIB_HINT}", file=sys.stderr)
        return 2
    runs, problems = [], []
    for arg, label in zip(args.dirs, labels_for(args.dirs)):
        try:
            runs.append(load_run(arg, args.allow_running, label))
        except (ReportError, OSError) as err:
            problems.append(str(err))
    if problems:  # nothing is written unless every input can be read
        for problem in problems:
            print(f"kvwarm report: {problem}", file=sys.stderr)
        return 2
    for n, r in enumerate(runs, start=1):
        print(f"run {n}: {r.label} ({r.source}): {r.status}, {len(r.rows)} measured point(s), {r.describe()}")
        if r.fake_side is not None:
            print(f"  an A/B sweep: its table is its real side's rows; its {len(r.fake_side)} fake-KV row(s) below")
        if r.status == v.FAILED:
            print(
                f"kvwarm report: warning: {r.source}: the sweep failed ({r.artifact.get('error')}); "
                f"rendering the {len(r.rows)} row(s) it measured, marked failed",
                file=sys.stderr,
            )
    comparisons = [compare(runs[0], r) for r in runs[1:]]
    ab = [ab_comparison(r) for r in runs if r.fake_side is not None]
    for c in comparisons:
        print()
        print(comparison_text(c))
    for c in ab:
        print("\nA/B in one boot (fake KV against real KV, the same engine):")
        print(comparison_text(c))
    written = render(runs, comparisons, Path(args.out), ab)
    print(f"\nwrote {', '.join(p.name for p in written)} in {Path(args.out).resolve()}")
    return 0
