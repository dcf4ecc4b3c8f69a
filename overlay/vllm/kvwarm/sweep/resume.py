"""Resuming a killed sweep (`sweep ... --resume`, `"resume": true`) from its folder: every row
measured before is kept, no point is measured twice, and the plan must be the first boot's.

What a resume is held to, each refused by name:
  - before the model loads (the command; the adapter at its start): what the plan is made
    from (`plan_inputs`: the points file's content, the grid asked for, the warm-up settings,
    --ab), the dataset's content, the model and the build;
  - once the engine is up, before the first point: the engine as vLLM resolved it, on the
    fields that change a step's time (record.validate.match.STEP_TIME_FIELDS, what `validate`
    refuses a table and a trace on) and the engine loop; and the points the sweep measures
    (a grid laid again must be the first boot's).
A rank's rows come from its rows.jsonl (record.row_log); its sweep.json gives the rest of the
record, kept as the first boot wrote it. Under data parallel the ranks agree at their first
meeting on the points every rank finished (`agree`): a row one rank has and another lacks
(killed in between) is dropped and its point measured again on every rank, said in the
artifact (kvwarm.resume.replaced); so is a point of an A/B sweep with one side measured.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ..record import vocabulary as v
from ..record.artifact import PointRow
from ..record.row_log import Logged, read_log
from ..record.validate.match import Provenance, match, model_name
from .plan import points_digest

# What each of plan_inputs' fields is set by, for the refusal.
SET_BY = {
    "points_sha256": "the points file's content (--points)",
    "grid": "--grid",
    "grid_from": "--grid-from",
    "grid_caps": "--grid-caps",
    "grid_skip_seconds": "--skip-seconds",
    "warmup": "DYN_BENCH_KV_WARMUP",
    "steady_steps": "DYN_BENCH_GIANT_KV_REPEATS",
    "settle_steps": "DYN_BENCH_KV_WARMUP_SETTLE_STEPS",
    "giant_kv_threshold": "DYN_BENCH_GIANT_KV_THRESHOLD",
    "gc_hold": "DYN_BENCH_KV_WARMUP_GC",
    "state_mode": "DYN_BENCH_KV_WARMUP_STATE",
    "ab": "--ab",
}
BUILD_FIELDS = ("version", "flavour", "series_digest", "overlay_digest")
POINTS_DIGEST = "points_digest"  # the plan record's digest of the points measured, once known
FIX = "Resume with what the first boot ran with, or start the sweep again without --resume (or in another --out)"


class ResumeError(ValueError):
    """A resume refused: the message names the folder, what differs and the fix."""


@dataclass
class Earlier:
    """What a rank's folder holds of the sweep to resume."""

    folder: Path
    artifact: dict  # its sweep.json, as last written
    logged: Logged  # its rows.jsonl, folded

    @property
    def complete(self) -> bool:
        return self.artifact.get("status") == v.COMPLETE

    def rows(self) -> list[PointRow]:
        return [row for _, row in self.logged.rows.values()]


def record_path(out: str | Path) -> Path | None:
    """The sweep.json that says how a sweep in `out` stands: its own (one rank, or the
    combined view), else rank 0's; None where there is neither."""
    for path in (Path(out) / v.ARTIFACT, Path(out) / "dp0" / v.ARTIFACT):
        if path.exists():
            return path
    return None


def read_record(path: Path | None, out: str | Path) -> dict:
    if path is None:
        raise ResumeError(
            f"--resume: {out} holds no sweep to resume (no sweep.json there or in its dp0/); "
            "run the sweep without --resume, or pass the --out of the sweep that was stopped"
        )
    try:
        artifact = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ResumeError(f"--resume: {path} cannot be read ({err}); start the sweep again without --resume") from None
    if not isinstance(artifact, dict) or not isinstance((artifact.get("kvwarm") or {}).get("plan"), dict):
        raise ResumeError(
            f"--resume: {path} records no plan (a build without resume wrote it, or it is not a sweep's); "
            "start the sweep again without --resume"
        )
    return artifact


def load_earlier(folder: str | Path) -> Earlier:
    """A rank's folder: its sweep.json and its rows.jsonl (none: no row was measured)."""
    folder = Path(folder)
    path = folder / v.ARTIFACT
    artifact = read_record(path if path.exists() else None, folder)
    try:
        logged = read_log(folder / v.ROWS)
    except FileNotFoundError:
        logged = Logged(boots=[{"boot": 0, "started_at": artifact.get("started_at", "")}])
    except ValueError as err:
        raise ResumeError(f"--resume: {err}; start the sweep again without --resume") from None
    return Earlier(folder, artifact, logged)


def check_plan(artifact: dict, where: str, plan: dict, model: str | None, build: dict | None, dataset) -> None:
    """The plan's inputs, the model, the build and the dataset now, against the first
    boot's; ResumeError naming each that differs."""
    said = []
    earlier = artifact["kvwarm"]["plan"]
    for key in sorted(set(plan) | set(earlier)):
        if key != POINTS_DIGEST and plan.get(key) != earlier.get(key):
            said.append(f"{SET_BY.get(key, key)} ({key}: first boot {earlier.get(key)!r}, now {plan.get(key)!r})")
    then = model_name((artifact.get("config") or {}).get("model"))
    if model is not None and then is not None and model_name(model) != then:
        said.append(f"the model (--model: first boot {then!r}, now {model_name(model)!r})")
    recorded = artifact.get("build")
    if isinstance(recorded, dict) and isinstance(build, dict):
        for key in BUILD_FIELDS:
            if recorded.get(key) != build.get(key):
                said.append(f"the build ({key}: first boot {recorded.get(key)!r}, now {build.get(key)!r})")
    then_data = ((artifact.get("kvwarm") or {}).get("dataset") or {}).get("sha256")
    now_data = (dataset or {}).get("sha256")
    if then_data and now_data and then_data != now_data:
        said.append(
            f"the dataset's content (DYN_BENCH_KV_WARMUP_DATASET: sha256 {then_data[:12]}…, now {now_data[:12]}…)"
        )
    if said:
        raise ResumeError(f"--resume of {where}: the plan is not the first boot's: {'; '.join(said)}. {FIX}")


def check_engine(artifact: dict, now: dict, where: str) -> None:
    """The engine now (`now`: an artifact's fields as this boot would record them) against
    the first boot's, on what changes a step's time and the engine loop."""
    then_p, now_p = Provenance.of_artifact(artifact), Provenance.of_artifact(now)
    found = match(then_p, now_p)
    said = [f"{d.field} (first boot {d.trace!r}, now {d.table!r})" for d in found.refused]
    if found.loop_differs:
        said.append(f"the engine loop (first boot {found.loop[0]}, now {found.loop[1]})")
    if said:
        raise ResumeError(
            f"--resume of {where}: the engine differs from the first boot's in what changes a step's time: "
            f"{'; '.join(said)}. Resume with the engine arguments it ran with (config.engine_args.given in its "
            "sweep.json), or start the sweep again without --resume (or in another --out)"
        )


def check_points(artifact: dict, points: list, where: str) -> None:
    """The points this boot measures are the first boot's (a grid is laid again, and the
    pool it is laid in may differ); a record made before they were known holds none."""
    then = artifact["kvwarm"]["plan"].get(POINTS_DIGEST)
    if then is not None and then != points_digest(points):
        grid = (artifact.get("kvwarm") or {}).get("grid") or {}
        pool = (
            f" (the first boot's grid: {grid.get('points')} point(s) in a pool of {grid.get('pool')})" if grid else ""
        )
        raise ResumeError(
            f"--resume of {where}: the points this boot would measure are not the first boot's{pool}; a grid is laid "
            "in the engine's KV pool: give the engine the same KV cache (--gpu-memory-utilization, "
            "--num-gpu-blocks-override), or pass the first boot's grid.json with --points in a new sweep"
        )


# --- the ranks' agreement on what is done ------------------------------------------------------


@dataclass
class Resumed:
    """A rank's earlier rows, for the controller: by (point index, A/B side), in the order
    they were measured, each with the boot that measured it."""

    rows: dict[tuple[int, str | None], tuple[int, PointRow]]
    sides: tuple[str | None, ...]  # (None,), or an A/B sweep's two

    def done(self) -> set[int]:
        """The points this rank finished: every side measured."""
        indices = {index for index, _ in self.rows}
        return {i for i in indices if all((i, side) in self.rows for side in self.sides)}


def ranges(indices: Iterable[int]) -> list[list[int]]:
    """Indices as [start, end) runs: what a rank posts of its finished points."""
    runs: list[list[int]] = []
    for i in sorted(indices):
        if runs and runs[-1][1] == i:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1])
    return runs


def from_ranges(runs: list) -> set[int]:
    return {i for start, end in runs for i in range(start, end)}


def agree(resumed: Resumed, records: list[dict]) -> tuple[set[int], list[tuple[int, str | None, int, PointRow]], list]:
    """Every rank's `done` runs (the resume meeting's records): the points every rank
    finished, this rank's rows of them (index, side, boot, row) in their order, and what is
    dropped and measured again, each {point, reason}."""
    done_by_rank = {r["rank"]: from_ranges(r["done"]) for r in records}
    common = set.intersection(*done_by_rank.values()) if done_by_rank else set()
    mine = resumed.done()
    kept, replaced = [], []
    for (index, side), (boot, row) in resumed.rows.items():
        if index in common:
            kept.append((index, side, boot, row))
            continue
        if index in mine:
            lacking = sorted(rank for rank, done in done_by_rank.items() if index not in done)
            reason = f"rank(s) {lacking} had not finished it when the sweep stopped: measured again on every rank"
        else:
            reason = "an A/B point with one side measured when the sweep stopped: both sides measured again"
        replaced.append({"point": row.point, "reason": reason, **({"ab": side} if side else {})})
    return common, kept, replaced
