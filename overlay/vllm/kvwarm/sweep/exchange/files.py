"""The file fallback of the ranks' exchange (DYN_BENCH_KV_WARMUP_RANK_SYNC=files): small
files in the sweep's output folder, which must then be one folder every rank sees."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from ...record import vocabulary as v
from ...record.combined import write_combined
from ...record.files import write_atomically
from ..ranks import DEFAULT_TIMEOUT, RankFailed
from .records import FAILURE, meeting_record

SYNC_DIR = ".kvwarm-sync"


class FileExchange:
    """The file fallback: records at OUT/.kvwarm-sync/<run>/<seq>.<rank>.json, written
    atomically, and the combined view rebuilt from every rank's OUT/dp<R>/ under a file lock
    after each write of any rank. OUT must be one folder every rank sees. `run` must be the
    same on every rank of one launch and new for each launch (the DP master port). The last
    rank to write sees the view final and hands every rank's artifact to `on_final`."""

    kind = "files"

    def __init__(
        self,
        out: str | Path,
        run: str,
        size: int,
        rank: int,
        timeout: float = DEFAULT_TIMEOUT,
        clock=time.monotonic,
        start_timeout: float | None = None,
    ):
        self.out = Path(out)
        self.folder = self.out / SYNC_DIR / run
        self.folder.mkdir(parents=True, exist_ok=True)
        self.size, self.rank, self.timeout, self._clock = size, rank, timeout, clock
        self.start_timeout = timeout if start_timeout is None else start_timeout
        self._seq = 0
        self._posted_at: float | None = None
        self._kind: str | None = None
        self.on_final = None

    def record(self) -> dict:
        """How the ranks met, for the artifact."""
        return {"exchange": self.kind, "address": str(self.folder), "port": None, "port_origin": None}

    def _path(self, seq: int, rank: int) -> Path:
        return self.folder / f"{seq:06d}.{rank}.json"

    def post(self, kind: str, record: dict) -> None:
        if self._posted_at is not None:
            raise RuntimeError(f"exchange {self._seq} ({self._kind}) is still open")
        self._seq += 1
        self._kind, self._posted_at = kind, self._clock()
        write_atomically(
            self._path(self._seq, self.rank), json.dumps({**record, "kind": kind, "rank": self.rank}).encode()
        )

    def post_failure(self, error: str) -> None:
        """The others' next boundary is the one after this rank's last post, whether or
        not that one completed: answer it with the failure."""
        self._posted_at = None
        self.folder.mkdir(parents=True, exist_ok=True)
        write_atomically(
            self._path(self._seq + 1, self.rank),
            json.dumps({"kind": FAILURE, "rank": self.rank, "failed": error}).encode(),
        )

    def poll(self) -> list[dict] | None:
        paths = [self._path(self._seq, r) for r in range(self.size)]
        if not all(p.exists() for p in paths):
            waited = self._clock() - self._posted_at
            limit = self.start_timeout if self._seq == 1 else self.timeout
            if waited > limit:
                missing = [r for r, p in enumerate(paths) if not p.exists()]
                raise RankFailed(
                    f"rank(s) {missing} did not reach boundary {self._seq} ({self._kind}) within {limit:.0f} s"
                )
            return None
        self._posted_at = None
        return [meeting_record(p.read_bytes(), str(p), r, self._kind, None) for r, p in enumerate(paths)]

    def share(self, artifact: dict) -> None:
        """This rank's artifact is in OUT/dp<R>/ already: rebuild the combined view from every
        rank's; once it is final nobody polls the records, and they go. A running one never
        waits for the lock (another rank's rebuild, which reads this rank's latest artifact
        too): where it is held, this rank's next write rebuilds it. A final one waits, so the
        last rank to finish always writes the final view."""
        combined = write_combined(self.out, self.size, self.on_final, wait=artifact["status"] != v.RUNNING)
        if combined is not None and combined["status"] != v.RUNNING:
            shutil.rmtree(self.out / SYNC_DIR, ignore_errors=True)
