"""Data-parallel ranks of one sweep stepped in one process on real Schedulers (the model runner's
part played by real_kv.step_scheduler), meeting through the real exchanges: torch's TCPStore on
127.0.0.1, whose rank 0 takes a free port of its own that the other ranks are then told, and the
file fallback in one shared folder. What the tests wait for is polled under a deadline, never
slept for; what they read is what the product shows (its public calls, its files, the store's
keys as sweep.exchange.store documents them)."""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

from .plugin import rank_out
from .real_kv import make_scheduler, step_scheduler

EXCHANGES = ("store", "files")
PORT_ENV = "DYN_BENCH_KV_WARMUP_RANK_SYNC_PORT"


def step_all(schedulers, limit: int = 2000) -> int:
    """Step every rank in turn until none has work; returns the rounds taken."""
    for rounds in range(limit):
        busy = [s for s in schedulers if s.has_requests()]
        if not busy:
            return rounds
        for scheduler in busy:
            step_scheduler(scheduler)
    raise AssertionError("the ranks did not finish (a hang)")


def stop_on_rank_failure(sweep, errors: list) -> None:
    """What the adapter does under a configured run, for a bare sweep: a RankFailed ends the
    sweep (its requests given back, the others told) and is collected instead of raised."""
    from vllm.kvwarm.sweep.ranks import RankFailed

    original = sweep.before_schedule

    def before_schedule(scheduler):
        try:
            original(scheduler)
        except RankFailed as err:
            errors.append(str(err))
            sweep.abandon(scheduler, str(err))

    sweep.before_schedule = before_schedule


def until(condition, what: str, seconds: float = 30.0, every: float = 0.01):
    """`condition()`'s first true value, polled until the deadline (else an AssertionError
    naming `what`)."""
    deadline = time.monotonic() + seconds
    while not (value := condition()):
        assert time.monotonic() < deadline, f"{what} within {seconds:.0f} s"
        time.sleep(every)
    return value


def settled(exchange, seconds: float = 30.0):
    """A store exchange once this rank is in the store (its connection is made in a thread of
    its own) or has failed to be."""
    until(exchange.settled, f"rank {exchange.rank} neither joined nor failed", seconds)
    return exchange


def met(exchange, seconds: float = 30.0) -> list[dict]:
    """Every rank's records of the open boundary, polled as the sweep polls (a store's writes
    from another connection arrive a moment later)."""
    return until(exchange.poll, "the ranks did not meet", seconds)


def store_client(port: int):
    """Another client of the store at 127.0.0.1:`port` (as another process's would be): it can
    read and write any key."""
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))


def exchanges(tmp_path, kind="store", size=2, timeout=60.0, clock=time.monotonic, start_timeout=None):
    """Every rank's exchange of one launch: the store, rank 0's on a free port it takes itself
    and the others told it (each rank's combined-view folder its own), or the files in one
    shared folder."""
    from vllm.kvwarm.sweep.exchange.files import FileExchange
    from vllm.kvwarm.sweep.exchange.store import StoreExchange

    bounds = {"timeout": timeout, "start_timeout": start_timeout}
    if kind == "files":
        return [FileExchange(tmp_path / "out", "run", size, r, clock=clock, **bounds) for r in range(size)]
    rank_0 = StoreExchange("127.0.0.1", 0, size, 0, root=tmp_path / "out0", clock=clock, **bounds)
    others = [
        StoreExchange("127.0.0.1", rank_0.port, size, r, root=tmp_path / f"out{r}", clock=clock, **bounds)
        for r in range(1, size)
    ]
    return [settled(e) for e in (rank_0, *others)]


@contextmanager
def launched(data_parallel_size: int):
    """As if the engine processes were launched with this DP size (the series' rank hook calls
    vllm.kvwarm.ranks.note_launch), then one rank again: what no note means."""
    from vllm.kvwarm.ranks import note_launch

    note_launch(data_parallel_size)
    try:
        yield
    finally:
        note_launch(1)


def rank_runs(
    tmp_path,
    monkeypatch,
    points,
    kind="store",
    size=2,
    timeout=None,
    start=None,
    port=None,
    grid=None,
    blocks=None,
    resume=False,
):
    """SweepRuns configured as the adapter builds them, one per rank of a launch of `size`
    (`start`: those ranks only, rank 0 first). Through the store each rank has an OUT of its own
    (as on nodes with their own disks: kvwarm_testing.plugin.rank_out), and rank 0's store
    takes a free port (where `port` gives none) that the other ranks read from the
    environment; through files they share one OUT. `grid`: a --grid sweep with these caps
    instead of `points`; `blocks`: each rank's pool; `resume`: the launch resumes the sweep in
    OUT. Returns (schedulers, OUT)."""
    from vllm.kvwarm.scheduler import KvWarmScheduler
    from vllm.kvwarm.sweep.exchange import store
    from vllm.kvwarm.sweep.run import SweepRun

    monkeypatch.setenv("DYN_BENCH_KV_WARMUP", "off")  # fake KV: no dataset or tokenizer needed
    monkeypatch.setenv("DYN_BENCH_KV_WARMUP_RANK_SYNC", kind)
    if port is not None:
        monkeypatch.setenv(PORT_ENV, str(port))
    if timeout is not None:
        monkeypatch.setenv("DYN_BENCH_KV_WARMUP_RANK_TIMEOUT", str(timeout))
    path = tmp_path / "points.json"
    path.write_text(
        json.dumps({"schema_version": 1, "decode": [{"total_kv_read_tokens": k, "batch_size": b} for k, b in points]})
    )
    out = tmp_path / "out"
    ranks = list(range(size) if start is None else start)
    assert kind != "store" or port is not None or ranks[0] == 0, "through the store, rank 0 comes first or a port"
    schedulers = []
    for rank in ranks:
        pool = blocks[rank] if blocks else 128
        scheduler = make_scheduler(tmp_path / f"r{rank}", num_blocks=pool, scheduler_cls=KvWarmScheduler)
        scheduler.vllm_config.parallel_config.data_parallel_index = rank
        spec = {"grid": grid} if grid else {"points": str(path)}
        spec["out"] = str(out if kind == "files" else rank_out(out, rank))
        spec.update({"resume": True} if resume else {})
        with launched(size), monkeypatch.context() as local:
            if kind == "store" and port is None and rank == 0:
                local.setattr(store, "store_address", any_free_port)
            scheduler.kvwarm_run = SweepRun(scheduler, spec)
        scheduler.kvwarm_sweep = scheduler.kvwarm_run.sweep
        exchange = scheduler.kvwarm_run.writer.exchange
        if kind == "store" and port is None and rank == 0:
            monkeypatch.setenv(PORT_ENV, str(exchange.port))  # where the other ranks find it
        schedulers.append(scheduler)
    for scheduler in schedulers:
        if kind == "store":
            settled(scheduler.kvwarm_run.writer.exchange)
    return schedulers, out


def any_free_port(parallel_config, port=None) -> tuple[str, int, str]:
    """store_address's stand-in for rank 0 of a test's launch: its store takes a free port on
    127.0.0.1 itself (port 0), instead of one chosen before it binds."""
    return "127.0.0.1", 0, "taken by rank 0's store (test)"


def artifacts(out, kind, size=2):
    """Every rank's own artifact, each from its own OUT, and the combined view (rank 0's OUT)."""
    folders = [out if kind == "files" else rank_out(out, r) for r in range(size)]
    per_rank = [json.loads((folder / f"dp{r}" / "sweep.json").read_text()) for r, folder in enumerate(folders)]
    return per_rank, json.loads((out / "sweep.json").read_text())


def view(scheduler) -> dict:
    """Rank 0's combined view once its collector (if one runs) is done."""
    from vllm.kvwarm.sweep.exchange.store import StoreExchange

    exchange = scheduler.kvwarm_run.writer.exchange
    if isinstance(exchange, StoreExchange) and exchange.view.collector is not None:
        exchange.view.collector.join(timeout=60)
        assert not exchange.view.collector.is_alive(), "rank 0's combined view never became final"
    return json.loads((Path(scheduler.kvwarm_run.writer.root) / "sweep.json").read_text())


def handed_over(scheduler, seconds: float = 30.0) -> None:
    """Wait until the store holds a rank's summary of every row it has (its courier publishes
    off the step): a test that then stops stepping the rank must not race its last publication.
    Read as any client of the store reads it (kvwarm/summary/<R>)."""
    exchange = scheduler.kvwarm_run.writer.exchange
    rows = len(scheduler.kvwarm_sweep.rows)
    client = store_client(exchange.port)
    key = f"kvwarm/summary/{exchange.rank}"

    def published() -> bool:
        if not client.check([key]):
            return False
        summary = json.loads(client.get(key))
        return summary["results"] + summary["skipped_points"] >= rows

    until(published, f"rank {exchange.rank}'s summary of {rows} row(s) did not reach the store", seconds)


@contextmanager
def refusing_port():
    """A port of 127.0.0.1 bound and never listened on: a connection to it is refused, and no
    one else can take it while this holds it."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        yield held.getsockname()[1]


class HangingUp:
    """A port of 127.0.0.1 where nothing serves the store yet: a listener that hangs up on every
    connection (`connections` counts them) until `release()` frees the port for rank 0's store."""

    def __init__(self):
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen()
        self.port = self.listener.getsockname()[1]
        self.connections = 0
        self.thread = threading.Thread(target=self.hang_up, name="hanging-up", daemon=True)
        self.thread.start()

    def hang_up(self) -> None:
        while True:
            try:
                connection, _ = self.listener.accept()
            except OSError:  # released
                return
            self.connections += 1
            # a reset, not a close: nothing of it lingers on the port rank 0 takes next
            connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            connection.close()

    def release(self) -> None:
        self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept
        self.listener.close()
        self.thread.join(timeout=30)
