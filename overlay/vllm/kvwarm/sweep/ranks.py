"""Which data-parallel rank this sweep runs on, and how the ranks agree without blocking.

Every DP rank's scheduler runs the same sweep. The ranks exchange small records at the
sweep's boundaries (a rung's free pool and plan digest, each point's start) through files
in the sweep's output folder, which every rank writes its artifact into anyway:
- a dense model's DP ranks share no process group at all (vLLM reconfigures each one as
  DP=1), so there is nothing else to exchange over;
- a blocking collective inside `schedule()` could deadlock against the engine's own
  collectives (its periodic unfinished-requests all-reduce, MoE dummy batches): a rank that
  waits here keeps stepping, and only the sweep waits.
So the output folder must be one every rank sees (a shared filesystem for multi-node DP).

A record is posted once and polled on every `schedule()`; `poll` returns every rank's
record once all are there. A rank that failed posts its failure instead, so the others
stop at their next boundary rather than wait; a rank that never posts is given up on
after `timeout` seconds.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from ..record.files import write_atomically

SYNC_DIR = ".kvwarm-sync"
DEFAULT_TIMEOUT = 300.0  # seconds a rank waits for the others at one boundary

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


class FileExchange:
    """Records at OUT/.kvwarm-sync/<run>/<seq>.<rank>.json, written atomically. `run` must be
    the same on every rank of one launch and new for each launch (the DP master port)."""

    def __init__(
        self, out: str | Path, run: str, size: int, rank: int, timeout: float = DEFAULT_TIMEOUT, clock=time.monotonic
    ):
        self.folder = Path(out) / SYNC_DIR / run
        self.folder.mkdir(parents=True, exist_ok=True)
        self.size, self.rank, self.timeout, self._clock = size, rank, timeout, clock
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
            if waited > self.timeout:
                missing = [r for r, p in enumerate(paths) if not p.exists()]
                raise RankFailed(
                    f"rank(s) {missing} did not reach boundary {self._seq} ({self._kind}) within {self.timeout:.0f} s"
                )
            return None
        self._posted_at = None
        return [json.loads(p.read_text()) for p in paths]


def remove_sync_folder(out: str | Path) -> None:
    """The file exchange's records, once the combined view is final (nobody polls them)."""
    shutil.rmtree(Path(out) / SYNC_DIR, ignore_errors=True)


def make_exchange(layout: RankLayout, out: str | Path, parallel_config):
    if layout.data_parallel_size == 1:
        return SoloExchange()
    run = f"{parallel_config.data_parallel_master_ip}-{parallel_config.data_parallel_master_port}"
    return FileExchange(out, run, layout.data_parallel_size, layout.data_parallel_rank)
