"""The input of the exports: every rank's artifact of one finished sweep, read from its --out
folder (record.export); plain data."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from .. import vocabulary as v
from ..combined import given_up, rank_path
from ..runs import READS
from ..shape import point_key

RANK_TYPES = {v.RANK, "rank"}  # ours, and the tag of schema 1 and 2
COMBINED_TYPES = {v.COMBINED, "combined"}


class ExportError(ValueError):
    """An input the export cannot use: the message names it, what is wrong and the fix."""


@dataclass
class SweepRecord:
    """Every rank's artifact of one sweep, in rank order."""

    root: Path  # the sweep's --out folder
    ranks: list[dict]
    paths: list[Path]  # where each rank's artifact was read
    left_out: str | None = None  # rows the export was asked to leave out, in words

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def ab(self) -> bool:
        """An A/B sweep (`sweep --ab`): its rows here are its real side's (its table); its fake
        side's stay in the artifact (vocabulary AB_FAKE_SIDE), which no export or validate reads."""
        return any(v.AB_FAKE_SIDE in artifact for artifact in self.ranks)

    def kinds(self) -> list[str]:
        """The kinds of point the sweep has rows of (measured or skipped); with none, the
        kinds its points file lists where it can still be read, else decode."""
        found = {
            (entry.get("point") or {}).get("point_type", v.DECODE)
            for artifact in self.ranks
            for entry in [*artifact.get("results", []), *artifact.get("skipped_points", [])]
        }
        if not found:
            found = _points_file_kinds((self.ranks[0].get("config") or {}).get("points"), self.root)
        return [kind for kind in v.POINT_TYPES if kind in found] or [v.DECODE]


def _points_file_kinds(path, root: Path) -> set[str]:
    """The kinds a points file lists: as the sweep recorded its path, else in the sweep's
    folder (a generated grid is recorded as OUT/grid.json's bare name)."""
    if not isinstance(path, str) or not path:
        return set()
    for candidate in (Path(path), root / Path(path).name):
        try:
            data = json.loads(candidate.read_text())
        except (OSError, ValueError):
            continue
        return {kind for kind in v.POINT_TYPES if isinstance(data, dict) and data.get(kind)}
    return set()


def _read(path: Path) -> dict:
    try:
        artifact = json.loads(path.read_text())
    except OSError as err:
        raise ExportError(f"{path}: cannot be read ({err.strerror}); pass a sweep's --out folder") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ExportError(f"{path}: not valid JSON ({err}); it was cut short or is not a sweep artifact") from None
    if not isinstance(artifact, dict) or not isinstance(artifact.get("results"), list):
        raise ExportError(f"{path}: not a sweep artifact (no 'results' list); pass the sweep.json a sweep wrote")
    version = artifact.get("schema_version")
    if version not in READS:
        raise ExportError(
            f"{path}: schema_version {version!r}; this export reads versions {', '.join(map(str, READS))}: "
            "export it with the kvwarm build that wrote it, or a newer one"
        )
    kind = artifact.get("artifact_type", v.RANK)
    if kind not in RANK_TYPES | COMBINED_TYPES:
        raise ExportError(
            f"{path}: artifact_type {kind!r} is not a kvwarm sweep's (a Dynamo artifact cannot be exported again)"
        )
    return artifact


def _final(artifact: dict, path: Path) -> None:
    if artifact.get("status") == v.RUNNING:
        raise ExportError(
            f"{path}: status 'running': the sweep has not finished (or was killed before it could "
            "record why); export it once it has completed or failed"
        )


def load_sweep(arg: str | Path) -> SweepRecord:
    """A finished sweep from its --out folder (or its sweep.json): one rank's artifact, or
    under data parallel the combined view's folder with every rank's dp<R>/sweep.json."""
    path = Path(arg)
    file = path / v.ARTIFACT if path.is_dir() else path
    if not file.is_file():
        raise ExportError(f"{path}: no sweep.json here; pass a sweep's --out folder or its sweep.json")
    artifact = _read(file)
    root = file.parent
    size = int((artifact.get("layout") or {}).get("data_parallel_size") or 1)
    if artifact.get("artifact_type") in COMBINED_TYPES:
        size = len(artifact.get("ranks") or []) or size
        paths = [root / rank_path(r) for r in range(size)]
        missing = [str(p.relative_to(root)) for p in paths if not p.is_file()]
        if missing:
            raise ExportError(
                f"{root}: the combined view names {size} data-parallel ranks and {', '.join(missing)} "
                f"{'is' if len(missing) == 1 else 'are'} not here; where each node wrote its own --out, "
                f"copy every node's dp<R>/ folder into {root}"
            )
        ranks = _given_up(artifact, [_read(p) for p in paths])
        _one_sweep(ranks, paths)
    elif size > 1:
        raise ExportError(
            f"{file}: one rank's artifact of a sweep on {size} data-parallel ranks; Dynamo's files "
            f"hold every rank's steps: pass the sweep's --out folder ({root.parent}), which holds them all"
        )
    else:
        paths, ranks = [file], [artifact]
    for p, a in zip(paths, ranks):
        _final(a, p)
    return SweepRecord(root, ranks, paths)


def _given_up(view: dict, ranks: list[dict]) -> list[dict]:
    """A rank whose own record still says running (it was killed) but which the final
    combined view counts as failed (the others gave up on it) exports as failed, with the
    view's reason."""
    if view.get("status") == v.RUNNING:
        return ranks
    failed = [s for s in view.get("ranks") or [] if isinstance(s, dict) and s.get("status") == v.FAILED]
    return given_up(ranks, {s.get("rank"): s.get("error") or "the other ranks gave up on it" for s in failed})


def _one_sweep(ranks: list[dict], paths: list[Path]) -> None:
    """Every rank's artifact is of the same sweep: dp<r>/ holds rank r of as many ranks, of the
    same build, and (where two ranks completed) with the same points, which every rank of one
    sweep measures or skips together."""
    size, first = len(ranks), ranks[0]
    first_points = _points(first)
    fix = "gather the dp<R>/ folders of one sweep into its --out folder"
    for r, (artifact, path) in enumerate(zip(ranks, paths)):
        layout = artifact.get("layout") or {}
        said = (layout.get("data_parallel_rank", 0), layout.get("data_parallel_size", 1))
        if said != (r, size):
            raise ExportError(f"{path}: rank {said[0]} of {said[1]}, where rank {r} of {size} belongs; {fix}")
        if artifact.get("build") != first.get("build"):
            raise ExportError(f"{path}: another build than {paths[0]}'s, so another sweep; {fix}")
        complete = artifact.get("status") == first.get("status") == v.COMPLETE
        if complete and _points(artifact) != first_points:
            raise ExportError(f"{path}: other points than {paths[0]}'s, so another sweep; {fix}")


def _points(artifact: dict) -> set[tuple]:
    entries = [*artifact.get("results", []), *artifact.get("skipped_points", [])]
    return {point_key(e.get("point") or {}) for e in entries}


PREFIXED = "prefill points with a prefix (P > 0)"


def without_prefix(sweep: SweepRecord) -> SweepRecord:
    """The sweep less its prefill points with a prefix (measured or skipped), for a planner
    that fits prefill time on new tokens alone (P is not one of its features)."""

    def keep(entry: dict) -> bool:
        point = entry.get("point") or {}
        return point.get("point_type") != v.PREFILL or not point.get("total_kv_read_tokens")

    ranks = [
        {
            **artifact,
            "results": [r for r in artifact.get("results", []) if keep(r)],
            "skipped_points": [s for s in artifact.get("skipped_points", []) if keep(s)],
        }
        for artifact in sweep.ranks
    ]
    return replace(sweep, ranks=ranks, left_out=PREFIXED)
