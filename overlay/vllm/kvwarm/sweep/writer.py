"""The artifact writer: a rank's sweep.json after every point, and progress lines with the time
left. Under data parallel each rank writes OUT/dp<R>/ and hands each write to its exchange
(sweep.exchange), which keeps the combined view OUT/sweep.json (record.combined) on rank 0's
side (or, with the file exchange, in the one OUT every rank shares).

Rewriting a record costs more as it grows (every row is checked and written again): once one
write takes more than WRITE_FLOOR seconds, the next points' writes are left out until it is
paid for (it takes at most WRITE_SHARE of the time since; sweep.pacing), so a sweep of tens of
thousands of points does not spend its time rewriting its record. Below that floor every
point is written as it ends; the final write is never left out.

A write that fails raises ArtifactWriteError for the caller to end the sweep with; it never
reaches the engine (the scheduler adapter handles it).
"""

from __future__ import annotations

import time
from pathlib import Path

from vllm.logger import init_logger

from ..record import vocabulary as v
from ..record.artifact import KvwarmMeta, PointRow, build_artifact, utc_now, write_artifact
from .pacing import Pacing
from .provenance import RankLayout
from .rows import NOISY_SPREAD

logger = init_logger(__name__)

WRITE_SHARE = 0.1  # the most of a sweep's time its running record's rewrites may take
WRITE_FLOOR = 0.05  # seconds: a write cheaper than this is never left out


class ArtifactWriteError(RuntimeError):
    pass


class ArtifactWriter:
    def __init__(self, out: str, config: dict, rank_out: str | None = None, layout: RankLayout | None = None):
        self.root = out  # where the combined view goes under data parallel
        self.out = rank_out or out  # where this rank's artifact goes
        self.config = config
        self.layout = layout
        self.exchange = None  # under data parallel: what each write is shared through (sweep.exchange)
        # one rank: called with the final artifact before it is written, so whoever waits for
        # it finds what this made (the Dynamo export)
        self.before_final = None
        self.meta = KvwarmMeta(noisy_spread=NOISY_SPREAD)
        self.run: dict = {"started_at": utc_now(), "finished_at": None}
        self.rows: list[PointRow] = []
        self.total = 0  # points the sweep will measure (for the time left)
        self.started = time.monotonic()
        self._pacing = Pacing(WRITE_SHARE, WRITE_FLOOR)

    @property
    def artifact_path(self) -> Path:
        return Path(self.out) / v.ARTIFACT

    def write(self, status: str, error: str | None = None) -> None:
        """The artifact, handed on to the exchange; a running one is left out while the last
        write is not yet paid for (WRITE_SHARE)."""
        if status == v.RUNNING and not self._pacing.due():
            return
        began = self._pacing.clock()
        if status != v.RUNNING:
            self.run["finished_at"] = utc_now()
        layout = self.layout.as_dict() if self.layout is not None else None
        artifact = build_artifact(self.rows, self.meta, self.config, status, error, run=self.run, layout=layout)
        if status != v.RUNNING and self.before_final is not None:
            self.before_final(artifact)
        try:
            write_artifact(self.out, artifact)
            if status == v.RUNNING:  # no plot of an earlier run stays beside this record
                (Path(self.out) / v.ARTIFACT_PNG).unlink(missing_ok=True)
            else:  # drawn once, at the end: a plot stalls the engine about half a second
                from ..record.plot import write_plot

                write_plot(self.out, artifact)
        except Exception as err:
            raise ArtifactWriteError(f"writing the artifact to {self.out} failed: {type(err).__name__}: {err}") from err
        self._pacing.wrote(began)
        if self.exchange is not None:
            try:
                self.exchange.share(artifact)
            except Exception as err:
                raise ArtifactWriteError(
                    f"writing the combined view to {self.root} failed: {type(err).__name__}: {err}"
                ) from err

    def progress(self, message: str) -> None:
        done = len(self.rows)
        left = ""
        if 0 < done < self.total:
            per_point = (time.monotonic() - self.started) / done
            left = f", about {per_point * (self.total - done):.0f} s left"
        rank = f" dp{self.layout.data_parallel_rank}" if self.layout and self.layout.data_parallel_size > 1 else ""
        logger.info("[kvwarm sweep%s] %s%s", rank, message, left)
