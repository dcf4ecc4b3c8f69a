"""The ranks' exchange over torch's TCPStore (the default).

Rank 0 hosts a `torch.distributed.TCPStore` at vLLM's DP master address
(`parallel_config.data_parallel_master_ip`) on a port derived from the DP master port
(`store_address`; docs/hooks.md says which ports vLLM itself takes from it), or on
DYN_BENCH_KV_WARMUP_RANK_SYNC_PORT, and sets the launch record first (given port 0, its
store takes a free one, which `port` then holds: the other ranks must be told it). Every
network operation runs in one thread per rank, the courier (joining, sending, looking for the
open boundary's records); `post`, `poll`, `post_failure` and `share`, which `schedule()`
calls, only hand work to it and read what it found: no `schedule()` waits on the network.
What crosses the store, under `kvwarm/` (sweep.exchange.records: what each holds, the checks,
the limits):

  launch         rank 0's: the launch's nonce, the DP size and the plan's inputs; a rank that
                 joins checks them (a store without it is not this launch's)
  rank/<R>       a counter rank R adds 1 to when it joins (2: another launch uses this port)
  m/<seq>/<R>    rank R's record for boundary <seq>, set once (a failure answers the next one)
  rows/<R>/<i>   chunk i of rank R's rows (R > 0), each row published once
  summary/<R>    rank R's artifact less its rows, and how many rows and chunks it published

Rank 0's combined view (sweep.exchange.view) reads the summaries and rows from a thread of
its own, between rank 0's points (each `post` tells it a boundary has come), and deletes the
chunks it has read.
"""

from __future__ import annotations

import secrets
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path

from torch.distributed import TCPStore
from vllm.logger import init_logger

from ...record.artifact import row_lists, without_rows
from ..ranks import DEFAULT_TIMEOUT, RankFailed
from ..settings import RANK_START_TIMEOUT_ENV, RANK_SYNC_ENV, RANK_SYNC_PORT_ENV, RANK_TIMEOUT_ENV
from .records import FAILURE, chunks, decode, encode, meeting_record
from .view import CombinedView

logger = init_logger(__name__)

PREFIX = "kvwarm"
LAUNCH_KEY = f"{PREFIX}/launch"
PORT_OFFSET = 10  # above the DP master port: vLLM may take the master port and the 9 after it
OP_SECONDS = 10.0  # what one store operation may take before the store counts as gone
RETRY_SECONDS = 0.25  # between a client's attempts to connect
LAUNCH_SECONDS = 10.0  # how long a joining rank waits for a store that answers to hold the launch record
# While a boundary is open the courier looks for the others' records this often, starting
# fast and backing off (the ranks' lag at a meeting, against the store's load).
LOOK_FIRST, LOOK_LAST = 0.001, 0.005
SEEN_SECONDS = 0.5  # how often, while waiting, it notes which ranks are there (for the timeout's error)
NETWORK_ERRORS = (RuntimeError, OSError)  # torch's DistError is a RuntimeError


def store_address(parallel_config, port: int | None = None) -> tuple[str, int, str]:
    """(host, port, where the port comes from) of this launch's store: the DP master address,
    and the port set by DYN_BENCH_KV_WARMUP_RANK_SYNC_PORT or the DP master port + 10."""
    host = parallel_config.data_parallel_master_ip
    if port is not None:
        return host, port, f"set by {RANK_SYNC_PORT_ENV}"
    master = parallel_config.data_parallel_master_port
    if master + PORT_OFFSET <= 65535:
        return host, master + PORT_OFFSET, f"vLLM's DP master port {master} + {PORT_OFFSET}"
    return host, master - PORT_OFFSET, f"vLLM's DP master port {master} - {PORT_OFFSET}"


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0] if lines else ''}"


class StoreExchange:
    """The exchange of one rank through the launch's TCPStore; the same interface as
    sweep.exchange.files.FileExchange (`post`, `poll`, `post_failure`, `share`, `on_final`)."""

    kind = "store"

    def __init__(
        self,
        host: str,
        port: int,
        size: int,
        rank: int,
        timeout: float = DEFAULT_TIMEOUT,
        *,
        start_timeout: float | None = None,
        root: str | Path,
        origin: str = "",
        plan: dict | None = None,
        clock=time.monotonic,
    ):
        """`plan`: the inputs every rank's plan is made from (the points, the settings), which
        rank 0 publishes and every other rank compares with its own when it joins."""
        self.host, self.port, self.size, self.rank, self.timeout = host, port, size, rank, timeout
        self.start_timeout = timeout if start_timeout is None else start_timeout  # joining, the first boundary
        self.root = Path(root)  # where rank 0 writes the combined view
        self.plan = plan or {}
        self._origin, self.clock = origin or "given", clock
        self._cond = threading.Condition()  # the state below, shared with the courier
        self._net = threading.Lock()  # one store operation at a time
        self._store: TCPStore | None = None
        self._nonce: str | None = None
        self._error: str | None = None  # why this rank's sweep must stop: the next post or poll raises it
        self._gone = False  # the store cannot be used any more (or is closed): the courier stops
        self._outbox: list[tuple] = []  # what the courier sends, in order
        self._seq = 0
        self._posted_at: float | None = None
        self._kind: str | None = None
        self._met: list[dict] | RankFailed | None = None  # the open boundary's records, once all are there
        self._seen: set[int] = set()  # the ranks whose record of the open boundary was there when last noted
        self._seen_at = 0.0
        self._shared = (0, 0, 0, 0)  # rows published: results, skipped points, and an A/B sweep's fake side's
        self._chunks = 0
        self.created = clock()
        self.lost: dict[int, str] = {}  # ranks that missed a boundary, with why
        self.on_final = None  # rank 0: called with every rank's artifact once the combined view is final
        self.view = CombinedView(self) if rank == 0 else None
        if rank == 0:
            self._host()
        threading.Thread(target=self._run, name=f"kvwarm-ranks-dp{rank}", daemon=True).start()

    # --- joining the store ---------------------------------------------------------------------

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port} (port {self._origin})"

    def record(self) -> dict:
        """How the ranks met, for the artifact."""
        return {"exchange": self.kind, "address": self.host, "port": self.port, "port_origin": self._origin}

    def _fixes(self) -> str:
        return (
            f"set {RANK_SYNC_PORT_ENV} to a free port, the same on every rank, or {RANK_SYNC_ENV}=files "
            "to meet through files in one OUT folder every rank sees"
        )

    def _host(self) -> None:
        try:
            store = TCPStore(
                self.host, self.port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=OP_SECONDS)
            )
            nonce = secrets.token_hex(8)
            store.set(
                LAUNCH_KEY,
                encode({"rank": 0, "nonce": nonce, "size": self.size, "plan": self.plan}, "the launch record"),
            )
            store.add(f"{PREFIX}/rank/0", 1)
        except NETWORK_ERRORS as err:
            self._fail(
                f"rank 0 could not host the rank exchange (torch TCPStore) at {self.address}: "
                f"{_first_line(err)}; {self._fixes()}",
                gone=True,
            )
            return
        self._store, self._nonce = store, nonce
        self.port = store.port  # the one it took, where it was given 0

    def _join(self) -> bool:
        """A client's joining, in the courier: a plain TCP probe until rank 0's store listens
        (torch's own retries log a stack per attempt), the store's handshake, then the launch
        record checked against this rank's own."""
        deadline = time.monotonic() + self.start_timeout
        last = "nothing answered"
        while True:
            left = deadline - time.monotonic()
            try:
                with socket.create_connection((self.host, self.port), timeout=max(0.1, min(2.0, left))):
                    pass
                store = TCPStore(self.host, self.port, is_master=False, timeout=timedelta(seconds=OP_SECONDS))
                break
            except NETWORK_ERRORS as err:
                last = _first_line(err)
            if time.monotonic() >= deadline or self._gone:
                self._fail(
                    f"rank {self.rank} could not reach the rank exchange (torch TCPStore) that rank 0 hosts "
                    f"at {self.address} within {self.start_timeout:.0f} s (while the ranks start: "
                    f"{RANK_START_TIMEOUT_ENV}, default {RANK_TIMEOUT_ENV}): {last}; {self._fixes()}",
                    gone=True,
                )
                return False
            time.sleep(RETRY_SECONDS)
        try:
            problem = self._launch_problem(store)
            if problem is None and store.add(f"{PREFIX}/rank/{self.rank}", 1) != 1:
                problem = f"rank {self.rank} of another launch already joined the rank exchange at {self.address}"
        except NETWORK_ERRORS as err:
            problem = self._lost_store(err)
        if problem is not None:
            self._fail(f"{problem}; {self._fixes()}", gone=True)
            return False
        with self._cond:
            self._store = store
            self._cond.notify_all()
        return True

    def _launch_problem(self, store: TCPStore) -> str | None:
        """Why the store this rank reached is not its launch's exchange (None: it is)."""
        waited = time.monotonic() + LAUNCH_SECONDS
        while not store.check([LAUNCH_KEY]):
            if time.monotonic() > waited:
                return (
                    f"rank {self.rank} reached a TCPStore at {self.address} that holds no kvwarm launch record "
                    f"after {LAUNCH_SECONDS:.0f} s: it is not this launch's rank exchange (another job's store "
                    "on that port?)"
                )
            time.sleep(RETRY_SECONDS)
        try:
            launch = decode(store.get(LAUNCH_KEY), LAUNCH_KEY, 0, None)
        except RankFailed as err:
            return f"rank {self.rank} reached a TCPStore at {self.address} whose launch record is not ours: {err}"
        if launch.get("size") != self.size:
            return (
                f"rank {self.rank} reached the rank exchange of a launch of {launch.get('size')} data-parallel "
                f"rank(s) at {self.address}; this rank's launch has {self.size}"
            )
        theirs = launch.get("plan") or {}
        differ = sorted(k for k in set(theirs) | set(self.plan) if theirs.get(k) != self.plan.get(k))
        if differ:
            shown = "; ".join(f"{k}: rank 0 {theirs.get(k)!r}, rank {self.rank} {self.plan.get(k)!r}" for k in differ)
            return (
                f"rank {self.rank}'s sweep inputs differ from rank 0's, who hosts the rank exchange at "
                f"{self.address} ({shown}); give every rank the same points file and settings"
            )
        self._nonce = launch.get("nonce")
        return None

    def _fail(self, error: str, gone: bool = False) -> None:
        with self._cond:
            self._error = self._error or error
            self._gone = self._gone or gone
            self._cond.notify_all()
        logger.error("[kvwarm sweep dp%d] %s", self.rank, error)

    def _lost_store(self, err: BaseException) -> str:
        return (
            f"the rank exchange (torch TCPStore) at {self.address}, hosted by rank 0, stopped answering: "
            f"{_first_line(err)}"
        )

    def close(self) -> None:
        """Stop using the store (on rank 0: stop serving it); nothing is sent after this."""
        with self._cond:
            self._gone = True
            self._error = self._error or "the rank exchange is closed"
            self._cond.notify_all()
        with self._net:
            self._store = None

    def settled(self) -> bool:
        """Whether this rank is in the store (rank 0: hosts it) or has failed to be (then the
        next post or poll raises why); False while it still joins."""
        with self._cond:
            return self._store is not None or self._error is not None

    def unheard(self) -> str | None:
        """Why rank 0 can hear from no rank (the store is gone or never came), else None."""
        with self._cond:
            return self._error if self._gone else None

    # --- what schedule() calls: no network ----------------------------------------------------

    def _key(self, seq: int, rank: int) -> str:
        return f"{PREFIX}/m/{seq}/{rank}"

    def post(self, kind: str, record: dict) -> None:
        with self._cond:
            if self._error:
                raise RankFailed(self._error)
            if self._posted_at is not None:
                raise RuntimeError(f"exchange {self._seq} ({self._kind}) is still open")
            self._seq += 1
            self._kind, self._posted_at, self._met = kind, self.clock(), None
            self._seen, self._seen_at = {self.rank}, self._posted_at
            self._outbox.append(("set", self._key(self._seq, self.rank), {**record, "kind": kind, "rank": self.rank}))
            self._cond.notify_all()
        if self.view is not None:  # every boundary lies between points: the view's turn
            self.view.between_points()

    def post_failure(self, error: str) -> None:
        """The others' next boundary is the one after this rank's last post, whether or
        not that one completed: answer it with the failure. Never raises."""
        with self._cond:
            self._posted_at = None
            record = {"kind": FAILURE, "rank": self.rank, "failed": error}
            self._outbox.append(("set", self._key(self._seq + 1, self.rank), record))
            self._cond.notify_all()

    def poll(self) -> list[dict] | None:
        """Every rank's record of the open boundary once the courier found them all (None
        until then); RankFailed once the boundary's limit has passed without them."""
        with self._cond:
            if self._error:
                raise RankFailed(self._error)
            met = self._met
            if met is not None:
                self._met, self._posted_at = None, None
                if isinstance(met, RankFailed):
                    raise met
                return met
            if self._store is None:
                return None  # still joining: that has its own bound
            limit = self.start_timeout if self._seq == 1 else self.timeout
            if self.clock() - self._posted_at <= limit:
                return None
            missing = [r for r in range(self.size) if r not in self._seen]
            error = f"rank(s) {missing} did not reach boundary {self._seq} ({self._kind}) within {limit:.0f} s"
            self.lost.update({r: error for r in missing})  # under the lock: the view thread reads it
        raise RankFailed(error)

    def given_up(self) -> dict[int, str]:
        """The ranks that missed a boundary, with why (a copy: the view's thread reads it while
        the engine's updates it)."""
        with self._cond:
            return dict(self.lost)

    def share(self, artifact: dict) -> None:
        """After each write of this rank's artifact: rank 0's combined view takes it; any
        other rank publishes its new rows and its summary (through the courier)."""
        if self.view is not None:
            self.view.update(artifact)
            return
        lists = row_lists(artifact)  # an A/B sweep's fake side's rows say their side (`ab`)
        new = [rows[n:] for rows, n in zip(lists, self._shared)]
        self._shared = tuple(len(rows) for rows in lists)
        head = without_rows(artifact)
        with self._cond:
            self._outbox += [("rows", *new[:2]), ("rows", *new[2:]), ("summary", head, len(lists[0]), len(lists[1]))]
            self._cond.notify_all()

    # --- the courier ---------------------------------------------------------------------------

    def _open(self) -> bool:
        return self._posted_at is not None and self._met is None

    def _run(self) -> None:
        if self.rank and not self._join():
            return
        delay = LOOK_FIRST
        while True:
            with self._cond:
                while not (self._gone or self._outbox or self._open()):
                    self._cond.wait()
                    delay = LOOK_FIRST
                if self._gone:
                    return
                items, self._outbox = self._outbox, []
                seq, kind, looking = self._seq, self._kind, self._open()
            try:
                self._send(items)
                found = self._look(seq, kind) if looking else True
            except NETWORK_ERRORS as err:
                if not self._gone:
                    self._fail(self._lost_store(err), gone=True)
                return
            if not found:
                with self._cond:
                    if not self._outbox:
                        self._cond.wait(delay)
                delay = min(2 * delay, LOOK_LAST)

    def _set(self, key: str, record: dict, what: str) -> None:
        data = encode({**record, "nonce": self._nonce}, what)
        with self._net:
            if self._store is not None:
                self._store.set(key, data)

    def _send(self, items: list[tuple]) -> None:
        """Everything handed over, in order; of several summaries only the last. A value over
        the limit fails this rank's sweep (its next boundary) and is not sent."""
        last_summary = max((i for i, item in enumerate(items) if item[0] == "summary"), default=None)
        for i, item in enumerate(items):
            try:
                if item[0] == "set":
                    self._set(item[1], item[2], f"rank {self.rank}'s record at {item[1]}")
                elif item[0] == "rows":
                    for chunk in chunks(item[1], item[2], self.rank):
                        key = f"{PREFIX}/rows/{self.rank}/{self._chunks}"
                        self._set(key, {**chunk, "rank": self.rank}, f"rank {self.rank}'s rows at {key}")
                        self._chunks += 1
                elif i == last_summary:
                    summary = {"rank": self.rank, "artifact": item[1], "chunks": self._chunks}
                    summary |= {"results": item[2], "skipped_points": item[3]}
                    self._set(f"{PREFIX}/summary/{self.rank}", summary, f"rank {self.rank}'s summary")
            except RankFailed as err:
                self._fail(str(err))

    def _look(self, seq: int, kind: str) -> bool:
        """Whether every rank's record of boundary `seq` is there; if so, they are checked
        and handed to `poll`."""
        keys = [self._key(seq, r) for r in range(self.size)]
        with self._net:
            if self._store is None:
                return False
            if not self._store.check(keys):
                if self.clock() - self._seen_at >= SEEN_SECONDS:
                    seen = {r for r, key in enumerate(keys) if self._store.check([key])}
                    with self._cond:
                        if self._seq == seq:
                            self._seen, self._seen_at = seen | {self.rank}, self.clock()
                return False
            values = self._store.multi_get(keys)
        try:
            met = [meeting_record(raw, key, r, kind, self._nonce) for r, (key, raw) in enumerate(zip(keys, values))]
        except RankFailed as err:
            met = err
        with self._cond:
            if self._seq == seq:
                self._met, self._seen = met, set(range(self.size))
        return True

    # --- rank 0: what the combined view reads --------------------------------------------------

    def store_call(self, name: str, *args):
        """One operation on the store, for rank 0's view (None once the store is gone)."""
        with self._net:
            if self._store is None:
                return None
            return getattr(self._store, name)(*args)

    @property
    def nonce(self) -> str | None:
        return self._nonce
