"""A sweep run's resume (sweep.run.SweepRun with `"resume": true`; what is checked and kept:
sweep.resume): the rank's folder read back into its artifact writer, held to this boot's plan
and engine before the first point, and the rows the ranks agree to keep handed to the writer.
"""

from __future__ import annotations

from ..record import vocabulary as v
from ..record.artifact import PointRow
from .plan import points_digest
from .resume import POINTS_DIGEST, Resumed, check_engine, check_plan, check_points, load_earlier
from .writer import ArtifactWriter


class Resuming:
    def __init__(self, writer: ArtifactWriter, ab: bool):
        """The earlier record in the writer's folder, read into it (ResumeError where the
        folder holds no sweep)."""
        self.earlier = load_earlier(writer.out)
        self.where = str(writer.out)
        self.boot = self.earlier.logged.next_boot
        self._writer, self._sides = writer, v.AB_SIDES if ab else (None,)
        writer.resume_from(self.earlier.artifact, self.earlier.rows(), self.earlier.logged.stages)
        said = "complete" if self.earlier.complete else self.earlier.artifact.get("status")
        writer.progress(
            f"resuming the sweep in {self.where} (boot {self.boot}; it was {said}): "
            f"{len(self.earlier.logged.rows)} row(s) measured before"
        )

    def check(self, plan: dict, model: str, run: dict, layout: dict, loop: dict, dataset: dict | None) -> None:
        """This boot's plan inputs, model, build and dataset, then its engine (the fields of
        an artifact it would write: `run`, sweep.provenance.run_record; `layout`; `loop`,
        loop_record), against the first boot's."""
        artifact = self.earlier.artifact
        check_plan(artifact, self.where, plan, model, run.get("build"), dataset)
        now = {
            "config": {"model": model, "engine_args": run.get("engine_args")},
            "build": run.get("build"),
            "layout": layout,
            "hardware": run.get("hardware"),
            "torch": run.get("torch"),
            "kvwarm": {"engine_loop": loop},
        }
        check_engine(artifact, now, self.where)

    def points(self, points: list) -> None:
        """The points this boot measures are the first boot's."""
        check_points(self.earlier.artifact, points, self.where)
        self._writer.meta.plan = {**(self._writer.meta.plan or {}), POINTS_DIGEST: points_digest(points)}

    def resumed(self) -> Resumed:
        return Resumed(self.earlier.logged.rows, self._sides)

    def kept(self, kept: list[tuple[int, str | None, int, PointRow]], replaced: list[dict]) -> None:
        """The rows the ranks agreed to keep (index, side, boot, row), and those measured again."""
        boots = [*self.earlier.logged.boots, {"boot": self.boot, "started_at": self._writer.log_started}]
        self._writer.keep([(boot, row) for _, _, boot, row in kept], boots, replaced)
        if replaced:
            self._writer.progress(f"{len(replaced)} row(s) measured again: {replaced[0]['reason']}")
        self._writer.progress(f"{len(kept)} row(s) kept from earlier boots; {self._writer.total - len(kept)} to go")
