"""The artifact writer: every row appended to the rank's rows.jsonl as it ends (record.row_log),
the rank's sweep.json rewritten at a pace, and progress lines with the time left. Under data
parallel each rank writes OUT/dp<R>/ and hands each write to its exchange (sweep.exchange),
which keeps the combined view OUT/sweep.json (record.combined) on rank 0's side (or, with the
file exchange, in the one OUT every rank shares).

A row's line is flushed before anything else is written, so a process killed mid-sweep
loses at most the point it was measuring. Rewriting sweep.json costs more as it grows (every
row is written again; while running compact, unchecked, each row encoded once; the schema, the
CSV and the plot at the final write alone): once one write, with what the exchange did with
it, takes more than WRITE_FLOOR
seconds, the next points' writes are left out until it is paid for (it takes at most
WRITE_SHARE of the time since; sweep.pacing). The final write is never left out.

A write that fails raises ArtifactWriteError for the caller to end the sweep with; it never
reaches the engine (the scheduler adapter handles it).
"""

from __future__ import annotations

import time
from pathlib import Path

from vllm.logger import init_logger

from ..record import vocabulary as v
from ..record.artifact import KvwarmMeta, PointRow, artifact_head, build_artifact, utc_now, write_artifact
from ..record.encoded import EncodedRows
from ..record.files import write_atomically
from ..record.row_log import RowLog
from .pacing import Pacing
from .progress import time_left
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
        self.total = 0  # rows the sweep holds once complete (for the time left)
        self.started = time.monotonic()
        self.log: RowLog | None = None  # rows.jsonl, once the sweep starts (start_log)
        self.log_started = ""  # when this boot's log began
        self._earlier = 0  # rows an earlier boot measured (a resumed sweep), not timed here
        self._pacing = Pacing(WRITE_SHARE, WRITE_FLOOR)
        self._encoded = EncodedRows(layout.data_parallel_size if layout is not None else 1)
        self._started = False  # the first running write clears an earlier run's CSV and plot

    def start_log(self, boot: int = 0) -> None:
        """rows.jsonl: started anew (boot 0), or appended to by a resumed sweep's boot."""
        self.log_started = utc_now()
        self.log = RowLog(self.out, boot, self.log_started)

    def resume_from(self, artifact: dict, rows: list[PointRow], stages: list[dict]) -> None:
        """A resumed sweep's record as its first boot wrote it (config, run record, kvwarm
        block), with every row and rung of its rows.jsonl, until the ranks agree (keep)."""
        self.config = {k: val for k, val in (artifact.get("config") or {}).items() if k != "engine_args"}
        given = {k: artifact.get(k) for k in ("build", "torch", "hardware")}
        self.run = {"started_at": artifact.get("started_at") or utc_now(), "finished_at": None, **given}
        self.run["engine_args"] = (artifact.get("config") or {}).get("engine_args")
        self.meta = KvwarmMeta.read(artifact.get("kvwarm"))
        self.meta.stages = list(stages)
        self.rows = list(rows)

    def keep(self, rows: list[tuple[int, PointRow]], boots: list[dict], replaced: list[dict]) -> None:
        """A resumed sweep's rows (boot, row) from its earlier boots, which this one does not
        measure again; `boots`: each boot's line (this one's last); `replaced`: the rows it
        measures again, with why."""
        self.rows = [row for _, row in rows]
        self._encoded.keep(self.rows)
        self._earlier = len(rows)
        count = {b["boot"]: 0 for b in boots}
        for boot, _ in rows:
            count[boot] = count.get(boot, 0) + 1
        self.meta.boots = [{"boot": b["boot"], "started_at": b["started_at"], "rows": count[b["boot"]]} for b in boots]
        self.meta.resume = {"replaced": replaced}

    def add_row(self, row: PointRow, index: int) -> None:
        """A finished row: its line in rows.jsonl first, then the artifact (at the pace).
        `index`: its point's place in the sweep's point list."""
        self.rows.append(row)
        if self.meta.boots:
            self.meta.boots[-1]["rows"] += 1
        if self.log is not None:
            self.log.row(row, index, len(self.rows), self.total)
        self.write(v.RUNNING)

    def add_stage(self, stage: dict) -> None:
        """A rung built, recorded with the boot that built it."""
        stage = {**stage, "boot": self.log.boot if self.log is not None else 0}
        self.meta.stages = [*self.meta.stages, stage]
        if self.log is not None:
            self.log.stage(stage)

    @property
    def artifact_path(self) -> Path:
        return Path(self.out) / v.ARTIFACT

    def write(self, status: str, error: str | None = None) -> None:
        """The artifact, handed on to the exchange; a running one is left out while the last
        write is not yet paid for (WRITE_SHARE)."""
        if status == v.RUNNING and not self._pacing.due():
            return
        began, final = self._pacing.clock(), status != v.RUNNING
        if final:
            self.run["finished_at"] = utc_now()
        layout = self.layout.as_dict() if self.layout is not None else None
        made = (self.rows, self.meta, self.config, status, error)
        # what the exchange takes (every row's entry: O(rows)), only where there is one
        artifact = build_artifact(*made, run=self.run, layout=layout) if final or self.exchange else None
        if final and self.before_final is not None:
            self.before_final(artifact)
        try:
            if final:  # checked, with its CSV and its plot (drawn once: it stalls the engine about half a second)
                from ..record.plot import write_plot

                write_artifact(self.out, artifact)
                write_plot(self.out, artifact)
            else:
                self._write_running(artifact_head(*made, run=self.run, layout=layout))
        except Exception as err:
            raise ArtifactWriteError(f"writing the artifact to {self.out} failed: {type(err).__name__}: {err}") from err
        if self.exchange is not None:
            try:
                self.exchange.share(artifact)
            except Exception as err:
                raise ArtifactWriteError(
                    f"writing the combined view to {self.root} failed: {type(err).__name__}: {err}"
                ) from err
        self._pacing.wrote(began)  # the exchange's share of the write counts too
        if status != v.RUNNING and self.log is not None:
            self.log.close()
            self.log = None

    def _write_running(self, head: dict) -> None:
        """sweep.json while the sweep runs: compact, its rows each encoded once (record.encoded),
        unchecked. Its CSV and plot come with the final write: an earlier run's go now."""
        out = Path(self.out)
        out.mkdir(parents=True, exist_ok=True)
        if not self._started:
            for name in (v.ARTIFACT_CSV, v.ARTIFACT_PNG):
                (out / name).unlink(missing_ok=True)
            self._started = True
        write_atomically(out / v.ARTIFACT, self._encoded.dumps(head, self.rows))

    def progress(self, message: str, left_too: bool = True) -> None:
        """A progress line; `left_too`: with the time left (a point's line says its own)."""
        done, here = len(self.rows), len(self.rows) - self._earlier
        left = time_left(done, self.total, here, time.monotonic() - self.started) if left_too else ""
        rank = f" dp{self.layout.data_parallel_rank}" if self.layout and self.layout.data_parallel_size > 1 else ""
        logger.info("[kvwarm sweep%s] %s%s", rank, message, left)
