"""Which data-parallel rank this sweep runs on, and how the ranks agree without blocking.

Every DP rank's scheduler runs the same sweep. The ranks exchange small records at the
sweep's boundaries (a rung's free pool and plan digest, each point's start), and each
rank's latest artifact for the combined view, through an exchange:
- by default torch's TCPStore, hosted by rank 0 at vLLM's DP master address
  (sweep.store_exchange, which also chooses the exchange: `make_exchange`): nothing but the
  network is shared, so each rank's output folder may be on its own node;
- with DYN_BENCH_KV_WARMUP_RANK_SYNC=files, small files in the sweep's output folder
  (FileExchange, below), which must then be one folder every rank sees.
Not a collective on a process group: a dense model's DP ranks share none (vLLM
reconfigures each one as DP=1), and a blocking collective inside `schedule()` could
deadlock against the engine's own collectives (its periodic unfinished-requests
all-reduce, MoE dummy batches). A rank that waits here keeps stepping; only the sweep waits.

A record is posted once and polled on every `schedule()`; `poll` returns every rank's
record once all are there. A rank that failed posts its failure instead, so the others
stop at their next boundary rather than wait; a rank that never posts is given up on
after `timeout` seconds (DYN_BENCH_KV_WARMUP_RANK_TIMEOUT, default 300), or at the first
boundary, which waits for the ranks to start, after `start_timeout`. `share` hands
each artifact the rank writes on to the combined view (record.combined).
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from ..record import vocabulary as v
from ..record.combined import write_combined
from ..record.files import write_atomically
from .settings import DEFAULT_RANK_TIMEOUT

DEFAULT_TIMEOUT = float(DEFAULT_RANK_TIMEOUT)  # seconds a rank waits for the others at one boundary

# The data-parallel size this engine process was launched with: vLLM resets a dense
# model's ranks to DP=1 before the engine core (and the scheduler) is built, so the
# series' hook in the engine-core launcher records it here first (docs/hooks.md).
_launch_data_parallel_size: int | None = None


def note_launch(data_parallel_size: int) -> None:
    global _launch_data_parallel_size
    _launch_data_parallel_size = int(data_parallel_size)


@dataclass(frozen=True)
class RankLayout:
    """The engine's parallel layout as the sweep records it."""

    data_parallel_size: int
    data_parallel_rank: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    expert_parallel: bool

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def rank_layout(parallel_config) -> RankLayout:
    rank = getattr(parallel_config, "data_parallel_index", None)
    if rank is None:
        rank = parallel_config.data_parallel_rank
    size = max(parallel_config.data_parallel_size, _launch_data_parallel_size or 1)
    return RankLayout(
        size,
        int(rank),
        parallel_config.tensor_parallel_size,
        parallel_config.pipeline_parallel_size,
        bool(parallel_config.enable_expert_parallel),
    )


class RankFailed(RuntimeError):
    """Another rank failed, disagreed, or never reached a boundary: this rank stops too."""


class SoloExchange:
    """One rank: every exchange completes at once with this rank's own record."""

    size, rank = 1, 0

    def post(self, kind: str, record: dict) -> None:
        self._posted = [{**record, "kind": kind, "rank": 0}]

    def poll(self) -> list[dict] | None:
        return self._posted

    def post_failure(self, error: str) -> None:
        pass  # no one else to tell

    def share(self, artifact: dict) -> None:
        pass  # one rank: its artifact is the whole record


# --- the file fallback (DYN_BENCH_KV_WARMUP_RANK_SYNC=files) --------------------------------

SYNC_DIR = ".kvwarm-sync"


class FileExchange:
    """The file fallback: records at OUT/.kvwarm-sync/<run>/<seq>.<rank>.json, written
    atomically, and the combined view rebuilt from every rank's OUT/dp<R>/ under a file lock
    after each write of any rank. OUT must be one folder every rank sees. `run` must be the
    same on every rank of one launch and new for each launch (the DP master port)."""

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
            json.dumps({"kind": "failure", "rank": self.rank, "failed": error}).encode(),
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
        return [json.loads(p.read_text()) for p in paths]

    def share(self, artifact: dict) -> None:
        """This rank's artifact is in OUT/dp<R>/ already: rebuild the combined view from every
        rank's; once it is final nobody polls the records, and they go."""
        combined = write_combined(self.out, self.size)
        if combined["status"] != v.RUNNING:
            shutil.rmtree(self.out / SYNC_DIR, ignore_errors=True)
