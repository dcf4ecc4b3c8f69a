"""`python -m vllm.kvwarm report DIR [DIR ...] [--out OUTDIR] [--allow-running]`: sweep
artifacts (schema v1 and v2) rendered into report.html with PNG plots, and report.csv.
With two or more runs, each is compared with the first: their points are joined by
(K, B), and per point the ratio of medians and overall the MAPE are printed and shown.

The plots use matplotlib, which vLLM does not require: nothing here imports it at module
level, and plot_png() returns None where it cannot be imported, so the sweep can write its
PNG only where matplotlib is installed.
"""

from __future__ import annotations

import argparse
import csv
import html
import io
import json
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

READS = (1, 2)  # schema versions this reader knows; fields it does not know are ignored
MATPLOTLIB_HINT = ("matplotlib is not installed in this Python environment: `pip install matplotlib` "
                   "there to get the plots (the sweep's JSON and CSV do not need it)")
# label and marker per kv_seed_regime; any other regime is drawn with UNKNOWN_MARKER
REGIMES = {"real_kv": ("real KV", "o"), "fake_fallback": ("fake KV (fallback)", "s"),
           "legacy": ("fake KV (warm-up off)", "^")}
UNKNOWN_MARKER = "D"
NOISY = "kvwarm_noisy"
LINESTYLES = ("-", "--", ":", "-.")


class ReportError(ValueError):
    """An input the report cannot use: the message names it, what is wrong and the fix."""


@dataclass
class Row:
    k: int
    b: int
    regime: str
    steps_ms: list[float]
    median_ms: float
    min_ms: float
    max_ms: float
    reasons: list[str]
    global_b: int | None = None  # v2: B over every data-parallel rank
    ranks: list[dict] | None = None  # v2 combined: each rank's median

    @property
    def key(self) -> tuple[int, int]:
        return self.k, self.b

    @property
    def spread(self) -> float:
        return (self.max_ms - self.min_ms) / self.median_ms if self.median_ms else 0.0


@dataclass
class Run:
    label: str
    source: str
    artifact: dict
    rows: list[Row] = field(default_factory=list)

    @property
    def status(self) -> str:
        return self.artifact.get("status", "unknown")

    @property
    def model(self) -> str:
        config = self.artifact.get("config") or {}
        model = config.get("model")
        args = config.get("engine_args")
        if model is None and isinstance(args, list):  # v1, written before the engine started
            for i, arg in enumerate(args):
                if arg == "--model" and i + 1 < len(args):
                    model = args[i + 1]
                elif str(arg).startswith("--model="):
                    model = arg.split("=", 1)[1]
        return Path(str(model).rstrip("/")).name if model else "unknown"

    @property
    def build(self) -> str:
        return (self.artifact.get("build") or {}).get("version") or "unknown"

    @property
    def layout(self) -> str:
        layout = self.artifact.get("layout")
        if not layout:
            return "unknown"
        ep = {True: "on", False: "off"}.get(layout.get("expert_parallel"), "?")
        return (f"TP{layout.get('tensor_parallel_size', '?')} PP{layout.get('pipeline_parallel_size', '?')} "
                f"DP{layout.get('data_parallel_size', '?')} EP {ep}")

    @property
    def hardware(self) -> str:
        hw = self.artifact.get("hardware")
        if not hw:
            return "unknown"
        gpus = ", ".join(f"{g.get('count', 1)} x {g.get('name', '?')}" for g in hw.get("gpus") or [])
        cpu = f"{hw.get('cpu', '?')} ({hw.get('cores', '?')} cores)"
        extra = [f"driver {hw['driver']}"] if hw.get("driver") else []
        extra += [f"CUDA {hw['cuda_runtime']}"] if hw.get("cuda_runtime") else []
        return "; ".join([gpus or "no GPU", cpu, *extra])

    @property
    def marking(self) -> str:
        """What the title says about a run that did not complete."""
        return {"failed": "FAILED", "running": "RUNNING, incomplete"}.get(self.status, "")

    def describe(self) -> str:
        return f"{self.model} · build {self.build} · layout {self.layout}"


# ---------------------------------------------------------------- reading

def locate(arg: str) -> Path:
    """The sweep.json a command-line argument names: a sweep's --out folder or the file."""
    path = Path(arg)
    if path.is_dir():
        if (path / "sweep.json").is_file():
            return path / "sweep.json"
        ranks = sorted(p.parent.name for p in path.glob("dp*/sweep.json"))
        if ranks:
            raise ReportError(f"{path}: holds per-rank artifacts ({', '.join(ranks)}) but no combined "
                              f"sweep.json; pass one rank's folder (e.g. {path / ranks[0]}) or let the "
                              "sweep finish writing the combined view")
        raise ReportError(f"{path}: no sweep.json in this folder; pass a sweep's --out folder or its sweep.json")
    if not path.exists():
        raise ReportError(f"{path}: not found; pass a sweep's --out folder or its sweep.json")
    return path


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0


def read_rows(artifact: dict, source: str) -> list[Row]:
    """The measured rows of a v1 or v2 artifact; min and max come from the timed steps
    where the artifact does not record them (v1)."""
    results = artifact.get("results")
    if not isinstance(results, list):
        raise ReportError(f"{source}: not a sweep artifact ('results' is not a list); pass the "
                          "sweep.json that `python -m vllm.kvwarm sweep` wrote")
    rows = []
    for i, r in enumerate(results):
        where = f"{source}: results[{i}]"
        point = r.get("point") if isinstance(r, dict) else None
        steps = r.get("steady_seconds") if isinstance(r, dict) else None
        if (not isinstance(point, dict) or not all(isinstance(point.get(n), int) and point[n] > 0
                                                   for n in ("total_kv_read_tokens", "batch_size"))
                or not isinstance(r.get("kv_seed_regime"), str)
                or not isinstance(steps, list) or not steps or not all(_number(t) for t in steps)):
            raise ReportError(f"{where}: not a measured row (it needs point.total_kv_read_tokens, "
                              "point.batch_size, kv_seed_regime and a non-empty steady_seconds); the "
                              "file was not written by the sweep or was edited")
        median = r.get("median_seconds")
        median = median if _number(median) else statistics.median(steps)
        lo = r.get("min_seconds") if _number(r.get("min_seconds")) else min(steps)
        hi = r.get("max_seconds") if _number(r.get("max_seconds")) else max(steps)
        rows.append(Row(point["total_kv_read_tokens"], point["batch_size"], r["kv_seed_regime"],
                        [t * 1e3 for t in steps], median * 1e3, lo * 1e3, hi * 1e3,
                        list(r.get("sample_reasons") or []), r.get("global_batch_size"), r.get("ranks")))
    return rows


def from_artifact(artifact: dict, label: str, source: str) -> Run:
    version = artifact.get("schema_version")
    if isinstance(version, bool) or not isinstance(version, int):
        raise ReportError(f"{source}: not a sweep artifact (no integer schema_version); pass the "
                          "sweep.json that `python -m vllm.kvwarm sweep` wrote")
    if version not in READS:
        raise ReportError(f"{source}: schema_version {version}; this report reads versions up to "
                          f"{max(READS)}: render it with the vLLM kvwarm build that wrote it, or a newer one")
    return Run(label, source, artifact, read_rows(artifact, source))


def load_run(arg: str, allow_running: bool = False, label: str | None = None) -> Run:
    path = locate(arg)
    try:
        artifact = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ReportError(f"{path}: not valid JSON ({err}); it is not a sweep artifact, or was cut "
                          "short: run the sweep again") from None
    if not isinstance(artifact, dict):
        raise ReportError(f"{path}: not a sweep artifact (a JSON {type(artifact).__name__}, not an object)")
    run = from_artifact(artifact, label or labels_for([arg])[0], str(path))
    if run.status == "running" and not allow_running:
        raise ReportError(f"{path}: status 'running': the sweep has not finished (or was killed before "
                          "it could record why); wait for it, or pass --allow-running to render the "
                          f"{len(run.rows)} row(s) measured so far")
    if run.status not in ("complete", "failed", "running"):
        raise ReportError(f"{path}: status {run.status!r} is none of complete, failed, running; "
                          "not an artifact the sweep wrote")
    return run


def labels_for(args: list[str]) -> list[str]:
    """Each run's name in plots and tables: its folder's name (short enough for a legend),
    the argument as given where two folders share a name, numbered where given twice."""
    folders = [Path(a).parent if Path(a).name == "sweep.json" else Path(a) for a in args]
    names = [f.resolve().name or str(f) for f in folders]
    if len(set(names)) < len(names):
        names = [str(f) for f in folders]
    return [f"{n} #{names[:i].count(n) + 1}" if names.count(n) > 1 else n for i, n in enumerate(names)]


# ---------------------------------------------------------------- comparing

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
    pending: dict[tuple[int, int], list[Row]] = {}
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


def skip_reason(run: Run, key: tuple[int, int]) -> str:
    for s in run.artifact.get("skipped_points") or []:
        p = s.get("point") or {}
        if (p.get("total_kv_read_tokens"), p.get("batch_size")) == key:
            return f"skipped there: {s.get('kv_seed_regime')}"
    return "not in its points"


def comparison_text(c: Comparison) -> str:
    lines = [f"B = {c.other.label} against A = {c.base.label}",
             f"{'K':>9} {'B':>4}  {'A median ms':>11}  {'B median ms':>11}  {'B/A':>6}  A regime / B regime"]
    for a, b in c.joined:
        lines.append(f"{a.k:>9} {a.b:>4}  {a.median_ms:>11.3f}  {b.median_ms:>11.3f}  "
                     f"{b.median_ms / a.median_ms:>6.3f}  {a.regime} / {b.regime}")
    mape = "n/a (no point in common)" if c.mape is None else f"{c.mape:.2f}%"
    lines.append(f"MAPE of B against A over {len(c.joined)} joined point(s): {mape}")
    for name, rows, run in (("A", c.only_base, c.other), ("B", c.only_other, c.base)):
        for row in rows:
            lines.append(f"unmatched: K={row.k} B={row.b} only in {name} ({skip_reason(run, row.key)})")
    return "\n".join(lines)


# ---------------------------------------------------------------- plotting

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
            ax.errorbar(ks, ms, yerr=[[r.median_ms - r.min_ms for r in rows], [r.max_ms - r.median_ms for r in rows]],
                        fmt="none", ecolor=colour, elinewidth=1, capsize=3)
            for r in rows:
                marker = REGIMES.get(r.regime, (r.regime, UNKNOWN_MARKER))[1]
                ax.plot([r.k], [r.median_ms], marker=marker, color=colour, markersize=7, linestyle="none",
                        markerfacecolor=colour if r.regime == "real_kv" else "white", markeredgewidth=1.5)
                if NOISY in r.reasons:
                    ax.plot([r.k], [r.median_ms], marker="o", markersize=15, linestyle="none",
                            markerfacecolor="none", markeredgecolor="red")
                    noisy = True
                if r.regime not in regimes:
                    regimes.append(r.regime)
            if not many:
                handles.append(Line2D([], [], color=colour, linestyle=style, label=_batch_label(rows[0])))
    if many:
        handles += [Line2D([], [], color=colour_of[b], label=f"B={b}") for b in batches]
        handles += [Line2D([], [], color="black", linestyle=LINESTYLES[n % len(LINESTYLES)],
                           label=f"{'AB'[n] if n < 2 else n + 1}: {run.label}") for n, run in enumerate(runs)]
    for regime in sorted(regimes, key=lambda r: list(REGIMES).index(r) if r in REGIMES else len(REGIMES)):
        label, marker = REGIMES.get(regime, (regime, UNKNOWN_MARKER))
        handles.append(Line2D([], [], marker=marker, color="dimgray", linestyle="none", markersize=7,
                              markerfacecolor="dimgray" if regime == "real_kv" else "white", label=label))
    if noisy:
        thresholds = {(run.artifact.get("kvwarm") or {}).get("noisy_threshold") for run in runs} - {None}
        over = f"{100 * thresholds.pop():g}%" if len(thresholds) == 1 else "the threshold"
        handles.append(Line2D([], [], marker="o", markersize=12, linestyle="none", markerfacecolor="none",
                              markeredgecolor="red", label=f"noisy (spread over {over})"))
    if handles:
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=9)  # never over data
    ax.set_xlabel("K: KV tokens read per decode step (tokens)")
    ax.set_ylabel("decode step time (ms): median, bars min–max of the timed steps")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.margins(x=0.05, y=0.1)
    ax.xaxis.set_major_locator(MaxNLocator(nbins=7, steps=[1, 2, 2.5, 5, 10], integer=True))  # K counts tokens; labels must not touch
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
    lines += [f"{'AB'[n] if n < 2 else n + 1}: {r.describe()}" + (f"  [{r.marking}]" if r.marking else "")
              for n, r in enumerate(runs)]
    return "\n".join(lines)


def png_bytes(fig) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def plot_png(artifact: dict) -> bytes | None:
    """The PNG of one artifact (as the sweep holds it in memory), or None where matplotlib
    is not installed (say MATPLOTLIB_HINT once, then)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return None
    return png_bytes(figure([from_artifact(artifact, "sweep", "sweep")]))


# ---------------------------------------------------------------- writing

CSV_COLUMNS = ["run", "source", "status", "total_kv_read_tokens", "batch_size", "global_batch_size",
               "kv_seed_regime", "median_ms", "min_ms", "max_ms", "spread", "steps", "steady_ms",
               "sample_reasons", "baseline_run", "baseline_median_ms", "ratio_to_baseline"]


def write_csv(runs: list[Run], comparisons: list[Comparison]) -> str:
    """One line per measured row of every run; rows of the second and later runs carry the
    first run's median at the same (K, B) and the ratio, where it has one."""
    baseline = {id(b): a for c in comparisons for a, b in c.joined}
    text = io.StringIO()
    writer = csv.writer(text)
    writer.writerow(CSV_COLUMNS)
    for run in runs:
        for row in run.rows:
            base = baseline.get(id(row))
            writer.writerow([
                run.label, run.source, run.status, row.k, row.b, row.global_b or "", row.regime,
                f"{row.median_ms:.4f}", f"{row.min_ms:.4f}", f"{row.max_ms:.4f}", f"{row.spread:.4f}",
                len(row.steps_ms), " ".join(f"{t:.4f}" for t in row.steps_ms), " ".join(row.reasons),
                runs[0].label if base else "", f"{base.median_ms:.4f}" if base else "",
                f"{row.median_ms / base.median_ms:.4f}" if base else ""])
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
    if run.status in ("failed", "running"):
        what = ("FAILED: " + str(a.get("error") or "no error recorded") if run.status == "failed"
                else "RUNNING: the sweep had not finished; these are the rows measured so far")
        parts.append(f"<p class={run.status}>{html.escape(what)}</p>")
    config = a.get("config") or {}
    resolved = (config.get("engine_args") or {}).get("resolved") if isinstance(config.get("engine_args"), dict) else None
    info = [["file", run.source], ["status", run.status], ["schema version", a.get("schema_version")],
            ["model", config.get("model", run.model)], ["build", run.build], ["layout", run.layout],
            ["hardware", run.hardware], ["torch", a.get("torch") or "unknown"],
            ["started / finished", f"{a.get('started_at') or 'unknown'} / {a.get('finished_at') or 'unknown'}"],
            ["points file", config.get("points", "unknown")]]
    if resolved:
        info.append(["engine (resolved)", ", ".join(f"{k}={v}" for k, v in sorted(resolved.items()))])
    parts.append(_table(["", ""], info, left=2))
    parts.append(f'<p><img src="{png}" alt="step time against K for {html.escape(run.label)}"></p>')
    header = ["K", "B", "regime", "median ms", "min ms", "max ms", "spread", "steps", "sample reasons"]
    lines = [[r.k, r.b, r.regime, f"{r.median_ms:.3f}", f"{r.min_ms:.3f}", f"{r.max_ms:.3f}",
              f"{100 * r.spread:.1f}%", len(r.steps_ms), " ".join(r.reasons)] for r in run.rows]
    if any(r.ranks for r in run.rows):  # combined view: the row's median is the slowest rank's
        header.append("median ms per rank")
        for line, r in zip(lines, run.rows):
            line.append(" ".join(f"{x.get('rank')}: {1e3 * x.get('median_seconds', 0):.3f}" for x in r.ranks or []))
    parts.append(_table(header, lines))
    skipped = [[(s.get("point") or {}).get("total_kv_read_tokens"), (s.get("point") or {}).get("batch_size"),
                s.get("kv_seed_regime"), s.get("reason")] for s in a.get("skipped_points") or []]
    if skipped:
        parts.append("<h3>Skipped points</h3>" + _table(["K", "B", "regime", "reason"], skipped))
    if a.get("ranks"):
        ranks = [[r.get("rank"), r.get("status"), r.get("rows"), r.get("path"), r.get("error") or ""]
                 for r in a["ranks"]]
        parts.append("<h3>Data-parallel ranks</h3>" + _table(["rank", "status", "rows", "path", "error"], ranks))
    return "\n".join(parts)


def _comparison_section(n: int, c: Comparison, png: str) -> str:
    mape = "n/a (no point in common)" if c.mape is None else f"{c.mape:.2f}%"
    lines = [[a.k, a.b, f"{a.median_ms:.3f}", f"{b.median_ms:.3f}", f"{b.median_ms / a.median_ms:.3f}",
              a.regime, b.regime] for a, b in c.joined]
    parts = [f"<h2>Run {n} (B: {html.escape(c.other.label)}) against run 1 (A: {html.escape(c.base.label)})</h2>",
             f"<p><b>MAPE of B against A: {mape}</b> over {len(c.joined)} joined point(s) "
             "(mean of |B − A| / A of the medians)</p>",
             _table(["K", "B", "A median ms", "B median ms", "B/A", "A regime", "B regime"], lines)]
    unmatched = [[r.k, r.b, f"only in {name}", skip_reason(run, r.key)]
                 for name, rows, run in (("A", c.only_base, c.other), ("B", c.only_other, c.base)) for r in rows]
    if unmatched:
        parts.append("<h3>Unmatched points</h3>" + _table(["K", "B", "", "why"], unmatched))
    parts.append(f'<p><img src="{png}" alt="A and B overlaid"></p>')
    return "\n".join(parts)


def render(runs: list[Run], comparisons: list[Comparison], out: Path) -> list[Path]:
    """report.html, report.csv and one PNG per run and per comparison, in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    written, sections = [], []
    for n, c in enumerate(comparisons, start=2):
        name = f"compare-{n}-vs-1.png"
        (out / name).write_bytes(png_bytes(figure([c.base, c.other])))
        written.append(out / name)
        sections.append(_comparison_section(n, c, name))
    for n, run in enumerate(runs, start=1):
        name = f"run-{n}.png"
        (out / name).write_bytes(png_bytes(figure([run])))
        written.append(out / name)
        sections.append(_run_section(n, run, name))
    page = (f"<!doctype html><html><head><meta charset=utf-8><title>kvwarm sweep report</title>"
            f"<style>{STYLE}</style></head><body><h1>kvwarm sweep report</h1>"
            f"<p>{len(runs)} run(s); made by <code>python -m vllm.kvwarm report</code>.</p>\n"
            + "\n".join(sections) + "</body></html>\n")
    (out / "report.html").write_text(page)
    (out / "report.csv").write_text(write_csv(runs, comparisons))
    return [out / "report.html", out / "report.csv", *written]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m vllm.kvwarm report",
        description="Render sweep artifacts into report.html (PNG plots) and report.csv; with two or "
                    "more, compare each with the first (per-point ratio of medians, MAPE).")
    p.add_argument("dirs", nargs="+", metavar="DIR", help="a sweep's --out folder, or its sweep.json")
    p.add_argument("--out", default="kvwarm-report", help="folder for the report (default: ./kvwarm-report)")
    p.add_argument("--allow-running", action="store_true",
                   help="render an artifact whose sweep has not finished (marked running)")
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
        if r.status == "failed":
            print(f"kvwarm report: warning: {r.source}: the sweep failed ({r.artifact.get('error')}); "
                  f"rendering the {len(r.rows)} row(s) it measured, marked failed", file=sys.stderr)
    comparisons = [compare(runs[0], r) for r in runs[1:]]
    for c in comparisons:
        print()
        print(comparison_text(c))
    written = render(runs, comparisons, Path(args.out))
    print(f"\nwrote {', '.join(p.name for p in written)} in {Path(args.out).resolve()}")
    return 0
