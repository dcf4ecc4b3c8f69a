"""The ranks' exchange over torch's TCPStore (the default).

Rank 0 hosts a `torch.distributed.TCPStore` at vLLM's DP master address
(`parallel_config.data_parallel_master_ip`) on a port derived from the DP master port
(`store_address`; docs/hooks.md says which ports vLLM itself takes from it), or on
DYN_BENCH_KV_WARMUP_RANK_SYNC_PORT. The other ranks connect as clients from a thread,
retrying until the start timeout, so no `schedule()` waits on the network. What crosses it,
under `kvwarm/`:

  rank/<R>       a counter rank R adds 1 to when it joins (2: another launch uses this port)
  m/<seq>/<R>    rank R's record for boundary <seq>, set once (a failure answers the next one)
  artifact/<R>   rank R's latest artifact (JSON), after each of its writes (R > 0)

`poll` checks every rank's key of the open boundary (non-blocking) and fetches them in one
`multi_get` once all are there. Rank 0 keeps the combined view OUT/sweep.json from its own
artifact and every other rank's latest (sweep.exchange.view).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path

from torch.distributed import TCPStore
from vllm.logger import init_logger

from ..ranks import DEFAULT_TIMEOUT, RankFailed
from ..settings import RANK_SYNC_ENV, RANK_SYNC_PORT_ENV, RANK_TIMEOUT_ENV
from .view import CombinedView

logger = init_logger(__name__)

PREFIX = "kvwarm"
PORT_OFFSET = 10  # above the DP master port: vLLM may take the master port and the 9 after it
OP_SECONDS = 10.0  # what one store operation may take before the store counts as gone
RETRY_SECONDS = 0.25  # between a client's attempts to connect
NETWORK_ERRORS = (RuntimeError, OSError)  # torch's DistError is a RuntimeError
# The least a rank waits for the others to start (its connection, the first boundary):
# engines of one launch start seconds or minutes apart, whatever the rank timeout says.
START_TIMEOUT = DEFAULT_TIMEOUT


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
    sweep.exchange.files.FileExchange (`post`, `poll`, `post_failure`, `share`)."""

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
        clock=time.monotonic,
    ):
        self.host, self.port, self.size, self.rank, self.timeout = host, port, size, rank, timeout
        self.start_timeout = timeout if start_timeout is None else start_timeout  # connection, first boundary
        self.root = Path(root)  # where rank 0 writes the combined view
        self._origin, self.clock = origin or "given", clock
        self._lock = threading.RLock()  # the store, its error and the pending writes
        self._store: TCPStore | None = None
        self._error: str | None = None  # why the store cannot be used: the next post or poll raises it
        self._pending: dict[str, bytes] = {}  # written once connected
        self._seq = 0
        self._posted_at: float | None = None
        self._kind: str | None = None
        self._warned = False
        self.created = clock()
        self.lost: dict[int, str] = {}  # ranks that missed a boundary, with why
        self.view = CombinedView(self) if rank == 0 else None
        if rank == 0:
            self._host()
        else:
            threading.Thread(target=self._connect, name="kvwarm-ranks-connect", daemon=True).start()

    # --- joining the store ---------------------------------------------------------------------

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port} (port {self._origin})"

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
        except NETWORK_ERRORS as err:
            self._fail(
                f"rank 0 could not host the rank exchange (torch TCPStore) at {self.address}: "
                f"{_first_line(err)}; {self._fixes()}"
            )
            return
        self._joined(store)

    def _connect(self) -> None:
        """A client's connection, in its own thread: a plain TCP probe until rank 0's store
        listens (torch's own retries log a stack per attempt), then the store's handshake."""
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
            if time.monotonic() >= deadline:
                self._fail(
                    f"rank {self.rank} could not reach the rank exchange (torch TCPStore) that rank 0 hosts "
                    f"at {self.address} within {self.start_timeout:.0f} s (while the ranks start: the longer of "
                    f"{RANK_TIMEOUT_ENV} and {START_TIMEOUT:.0f} s): {last}; "
                    f"{self._fixes()}"
                )
                return
            time.sleep(RETRY_SECONDS)
        self._joined(store)

    def _joined(self, store: TCPStore) -> None:
        with self._lock:
            try:
                if store.add(f"{PREFIX}/rank/{self.rank}", 1) != 1:
                    self._fail(
                        f"rank {self.rank} of another launch already joined the rank exchange at "
                        f"{self.address}: two launches on one port; {self._fixes()}"
                    )
                    return
                for key, value in self._pending.items():
                    store.set(key, value)
            except NETWORK_ERRORS as err:
                self._fail(self._gone(err))
                return
            self._pending.clear()
            self._store = store

    def _fail(self, error: str) -> None:
        with self._lock:
            self._error = self._error or error
        logger.error("[kvwarm sweep dp%d] %s", self.rank, error)

    def _gone(self, err: BaseException) -> str:
        return (
            f"the rank exchange (torch TCPStore) at {self.address}, hosted by rank 0, stopped answering: "
            f"{_first_line(err)}"
        )

    def close(self) -> None:
        """Stop using the store (on rank 0: stop serving it); nothing is sent after this."""
        with self._lock:
            self._store = None
            self._error = self._error or "the rank exchange is closed"

    # --- boundaries ----------------------------------------------------------------------------

    def _key(self, seq: int, rank: int) -> str:
        return f"{PREFIX}/m/{seq}/{rank}"

    def _set(self, key: str, value: bytes) -> None:
        with self._lock:
            if self._error:
                raise RankFailed(self._error)
            if self._store is None:  # still connecting
                self._pending[key] = value
                return
            try:
                self._store.set(key, value)
            except NETWORK_ERRORS as err:
                self._error = self._gone(err)
        if self._error:
            raise RankFailed(self._error)

    def post(self, kind: str, record: dict) -> None:
        if self._posted_at is not None:
            raise RuntimeError(f"exchange {self._seq} ({self._kind}) is still open")
        self._seq += 1
        self._kind, self._posted_at = kind, self.clock()
        self._set(self._key(self._seq, self.rank), json.dumps({**record, "kind": kind, "rank": self.rank}).encode())

    def post_failure(self, error: str) -> None:
        """The others' next boundary is the one after this rank's last post, whether or
        not that one completed: answer it with the failure. Never raises."""
        self._posted_at = None
        try:
            self._set(
                self._key(self._seq + 1, self.rank),
                json.dumps({"kind": "failure", "rank": self.rank, "failed": error}).encode(),
            )
        except RankFailed:
            pass  # the store is gone: the others find that out themselves

    def poll(self) -> list[dict] | None:
        keys = [self._key(self._seq, r) for r in range(self.size)]
        with self._lock:
            if self._error:
                raise RankFailed(self._error)
            if self._store is None:
                return None  # still connecting: that has its own bound
            try:
                if self._store.check(keys):
                    records = [json.loads(value) for value in self._store.multi_get(keys)]
                    self._posted_at = None
                    return records
                missing = None
                limit = self.start_timeout if self._seq == 1 else self.timeout
                if self.clock() - self._posted_at > limit:
                    missing = [r for r, key in enumerate(keys) if not self._store.check([key])]
            except NETWORK_ERRORS as err:
                self._error = self._gone(err)
                raise RankFailed(self._error) from None
        if missing is None:
            return None
        error = f"rank(s) {missing} did not reach boundary {self._seq} ({self._kind}) within {limit:.0f} s"
        self.lost.update({r: error for r in missing})
        raise RankFailed(error)

    # --- the combined view ---------------------------------------------------------------------

    def share(self, artifact: dict) -> None:
        """After each write of this rank's artifact: rank 0 rewrites the combined view, the
        others publish theirs for it. A rank that cannot publish logs it; its next boundary
        fails on the store."""
        if self.view is not None:
            self.view.update(artifact)
            return
        try:
            self._set(f"{PREFIX}/artifact/{self.rank}", json.dumps(artifact).encode())
        except RankFailed as err:
            if not self._warned:
                self._warned = True
                logger.warning(
                    "[kvwarm sweep dp%d] the combined view on rank 0 misses this rank's records: %s", self.rank, err
                )

    def unheard(self) -> str | None:
        """Why rank 0 can hear from no rank (the store is gone or never came), else None."""
        with self._lock:
            return self._error if self._error and self._store is None else None

    def fetch_artifacts(self) -> dict[int, bytes]:
        """Rank 0: every other rank's latest published artifact (those that have one)."""
        with self._lock:
            if self._store is None:
                return {}
            keys = {r: f"{PREFIX}/artifact/{r}" for r in range(1, self.size)}
            try:
                present = [r for r, key in keys.items() if self._store.check([key])]
                values = self._store.multi_get([keys[r] for r in present]) if present else []
            except NETWORK_ERRORS as err:
                logger.warning("[kvwarm sweep dp0] gathering the other ranks' records failed: %s", _first_line(err))
                return {}
        return dict(zip(present, values))
