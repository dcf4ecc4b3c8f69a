"""Sweep artifacts (schema v1 and v2) read into runs and rows, for the report and the plot.
An A/B sweep's table is its real side (`results`); its fake side's rows are the run's
`fake_side`, which the report compares with them.

Plain data: nothing here imports vLLM or matplotlib.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from . import vocabulary as v
from .artifact import KvwarmMeta
from .shape import is_continuation

READS = (1, 2, 3)  # schema versions this reader knows; fields it does not know are ignored


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
    kind: str = v.DECODE  # v3: decode | prefill
    n: int = 0  # v3 prefill: the new tokens of the step
    phases_ms: dict[str, float] = field(default_factory=dict)  # v3: median per phase

    @property
    def key(self) -> tuple:
        return self.kind, self.k, self.b, self.n

    @property
    def spread(self) -> float:
        return (self.max_ms - self.min_ms) / self.median_ms if self.median_ms else 0.0


@dataclass
class Run:
    label: str
    source: str
    artifact: dict
    rows: list[Row] = field(default_factory=list)
    fake_side: list[Row] | None = None  # an A/B sweep's fake-KV rows (vocabulary AB_FAKE_SIDE)

    def side(self, name: str) -> Run:
        """An A/B sweep's side as a run of its own: the real one (its table) or the fake one."""
        if name == v.AB_REAL:
            return Run(f"{self.label} real KV", self.source, self.artifact, self.rows)
        fake = self.artifact.get(v.AB_FAKE_SIDE) or {}
        artifact = {**self.artifact, "skipped_points": fake.get("skipped_points", [])}
        return Run(f"{self.label} fake KV", self.source, artifact, self.fake_side or [])

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
        return (
            f"TP{layout.get('tensor_parallel_size', '?')} PP{layout.get('pipeline_parallel_size', '?')} "
            f"DP{layout.get('data_parallel_size', '?')} EP {ep}"
        )

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
        return {v.FAILED: "FAILED", v.RUNNING: "RUNNING, incomplete"}.get(self.status, "")

    @property
    def meta(self) -> KvwarmMeta:
        return KvwarmMeta.read(self.artifact.get("kvwarm"))

    def describe(self) -> str:
        return f"{self.model} · build {self.build} · layout {self.layout}"


def locate(arg: str) -> Path:
    """The sweep.json a command-line argument names: a sweep's --out folder or the file."""
    path = Path(arg)
    if path.is_dir():
        if (path / v.ARTIFACT).is_file():
            return path / v.ARTIFACT
        ranks = sorted(p.parent.name for p in path.glob(f"dp*/{v.ARTIFACT}"))
        if ranks:
            raise ReportError(
                f"{path}: holds per-rank artifacts ({', '.join(ranks)}) but no combined "
                f"sweep.json; pass one rank's folder (e.g. {path / ranks[0]}) or let the "
                "sweep finish writing the combined view"
            )
        raise ReportError(f"{path}: no sweep.json in this folder; pass a sweep's --out folder or its sweep.json")
    if not path.exists():
        raise ReportError(f"{path}: not found; pass a sweep's --out folder or its sweep.json")
    return path


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def read_rows(artifact: dict, source: str) -> list[Row]:
    """The measured rows of a v1, v2 or v3 artifact; min and max come from the timed steps
    where the artifact does not record them (v1)."""
    results = artifact.get("results")
    if not isinstance(results, list):
        raise ReportError(
            f"{source}: not a sweep artifact ('results' is not a list); pass the "
            "sweep.json that `python -m vllm.kvwarm sweep` wrote"
        )
    rows = []
    for i, r in enumerate(results):
        where = f"{source}: results[{i}]"
        point = r.get("point") if isinstance(r, dict) else None
        steps = r.get("steady_seconds") if isinstance(r, dict) else None
        if isinstance(point, dict) and (point.get("point_type") == v.MIXED or is_continuation(point)):
            continue  # a mixed or continuation row is no plain table's (record.validate.predict reads it apart)
        if (
            not isinstance(point, dict)
            or not _count(point.get("total_kv_read_tokens"))
            or not _count(point.get("batch_size"))
            or point["batch_size"] < 1
            or point.get("point_type", v.DECODE) not in v.POINT_TYPES
            or not isinstance(r.get("kv_seed_regime"), str)
            or not isinstance(steps, list)
            or not steps
            or not all(_number(t) for t in steps)
        ):
            raise ReportError(
                f"{where}: not a measured row (it needs point.total_kv_read_tokens, "
                "point.batch_size, kv_seed_regime and a non-empty steady_seconds); the "
                "file was not written by the sweep or was edited"
            )
        median = r.get("median_seconds")
        median = median if _number(median) else statistics.median(steps)
        lo = r.get("min_seconds") if _number(r.get("min_seconds")) else min(steps)
        hi = r.get("max_seconds") if _number(r.get("max_seconds")) else max(steps)
        phases = r.get("phases") if isinstance(r.get("phases"), dict) else {}
        rows.append(
            Row(
                point["total_kv_read_tokens"],
                point["batch_size"],
                r["kv_seed_regime"],
                [t * 1e3 for t in steps],
                median * 1e3,
                lo * 1e3,
                hi * 1e3,
                list(r.get("sample_reasons") or []),
                r.get("global_batch_size"),
                r.get("ranks"),
                point.get("point_type", v.DECODE),
                point.get("total_prefill_tokens", 0) if _count(point.get("total_prefill_tokens")) else 0,
                {p: t * 1e3 for p, t in phases.items() if _number(t)},
            )
        )
    return rows


def from_artifact(artifact: dict, label: str, source: str) -> Run:
    version = artifact.get("schema_version")
    if isinstance(version, bool) or not isinstance(version, int):
        raise ReportError(
            f"{source}: not a sweep artifact (no integer schema_version); pass the "
            "sweep.json that `python -m vllm.kvwarm sweep` wrote"
        )
    if version not in READS:
        raise ReportError(
            f"{source}: schema_version {version}; this report reads versions up to "
            f"{max(READS)}: render it with the vLLM kvwarm build that wrote it, or a newer one"
        )
    fake = artifact.get(v.AB_FAKE_SIDE)
    fake_side = read_rows(fake, f"{source}: {v.AB_FAKE_SIDE}") if isinstance(fake, dict) else None
    return Run(label, source, artifact, read_rows(artifact, source), fake_side)


def load_run(arg: str, allow_running: bool = False, label: str | None = None) -> Run:
    path = locate(arg)
    try:
        artifact = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ReportError(
            f"{path}: not valid JSON ({err}); it is not a sweep artifact, or was cut short: run the sweep again"
        ) from None
    if not isinstance(artifact, dict):
        raise ReportError(f"{path}: not a sweep artifact (a JSON {type(artifact).__name__}, not an object)")
    run = from_artifact(artifact, label or labels_for([arg])[0], str(path))
    if run.status == v.RUNNING and not allow_running:
        raise ReportError(
            f"{path}: status 'running': the sweep has not finished (or was killed before "
            "it could record why); wait for it, or pass --allow-running to render the "
            f"{len(run.rows)} row(s) measured so far"
        )
    if run.status not in v.STATUSES:
        raise ReportError(
            f"{path}: status {run.status!r} is none of complete, failed, running; not an artifact the sweep wrote"
        )
    return run


def labels_for(args: list[str]) -> list[str]:
    """Each run's name in plots and tables: its folder's name (short enough for a legend),
    the argument as given where two folders share a name, numbered where given twice."""
    folders = [Path(a).parent if Path(a).name == "sweep.json" else Path(a) for a in args]
    names = [f.resolve().name or str(f) for f in folders]
    if len(set(names)) < len(names):
        names = [str(f) for f in folders]
    return [f"{n} #{names[:i].count(n) + 1}" if names.count(n) > 1 else n for i, n in enumerate(names)]
