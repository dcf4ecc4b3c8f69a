"""The engine's side of the trace's writer process (served.sink): it starts the process,
hands it the steps and, at close, waits for it. A step costs the engine's process one
marshal dump (C) and, now and then, one write to a pipe; no thread of the trace's runs in
the engine's process, so nothing competes with the engine's thread for the GIL.

Each step's frame (a 4-byte length, the marshal dump) is appended to a buffer; the buffer
goes to the pipe, which never blocks (non-blocking; what the pipe does not take waits for
the next try), once it holds SEND_BYTES, once SEND_SECONDS passed since the last send, and
whenever the engine is about to wait for work (so a trace is whole while the server idles).
Bounded: at most MAX_PENDING_BYTES wait in the engine's process (beyond the pipe's own
buffer); beyond that a step is dropped and counted (the steps' numbers then skip; the count
is logged at close).

Lifecycle: the process reads the pipe to its end. `close` (the engine core's shutdown, and
atexit) sends what waits, closes the pipe, waits for the process and logs what it reports (a
failed write, a step it could not render, the steps dropped); a process that does not end
within the timeout is killed. If the engine's process dies, the pipe closes and the writer
process ends by itself after writing what it had; it runs in a session of its own, so a
Ctrl-C to the server's terminal does not cut it short. Nothing here reaches the engine: a
writer process that is gone is logged once and the trace stops.
"""

from __future__ import annotations

import fcntl
import json
import marshal
import os
import select
import subprocess
import sys
import time
from pathlib import Path

from vllm.logger import init_logger

from ..record import vocabulary as v
from . import sink
from .step_parts import plain

logger = init_logger(__name__)

SEND_BYTES = 64 << 10
SEND_SECONDS = 0.1
MAX_PENDING_BYTES = 32 << 20  # about 30,000 steps of 32 requests waiting for the writer process
PIPE_BYTES = 1 << 20  # asked of the kernel for the pipe (Linux; the default stays where refused)
SINK = Path(sink.__file__).resolve()


class TraceWriter:
    def __init__(self, folder: Path, rank: int, header: str, max_file_bytes: int, files: int):
        names = [v.trace_file_name(rank, k) for k in range(files)]
        sink.prepare(folder, rank, header, names[0])  # raises OSError naming the folder
        self.path = folder / names[0]
        self.rank = rank
        self.dropped = 0  # traced steps left out at the bound
        self._stopped: str | None = None  # why the trace stopped in the engine's process
        self._unmarshallable = False
        self._closed = False
        self._sent_at = 0.0
        read, self._fd = os.pipe()
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-I", "-S", str(SINK), str(os.getpid())],
                stdin=read,
                stdout=subprocess.PIPE,
                start_new_session=True,
            )
        finally:
            os.close(read)
        try:
            fcntl.fcntl(self._fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        except (AttributeError, OSError):
            pass
        setup = {"folder": str(folder), "header": header, "max_file_bytes": max_file_bytes, "names": names}
        data = marshal.dumps(setup)
        self._pending = bytearray(len(data).to_bytes(4, "little") + data)
        os.set_blocking(self._fd, False)
        self._send(0.0)

    def submit(self, step: tuple, now: float, idle: bool) -> None:
        """From the engine's thread: never blocks, never raises. `step`: served.recorder's
        frame, its step's number first (None: a step that is not traced); `now`: the step's
        end on the adapter's clock; `idle`: the engine is about to wait for work."""
        if self._stopped is not None:
            return
        try:
            data = marshal.dumps(step)
        except ValueError:
            data = self._slow(step)
            if data is None:
                return
        pending = self._pending
        if len(pending) >= MAX_PENDING_BYTES:
            self.dropped += step[0] is not None
            return
        pending += len(data).to_bytes(4, "little")
        pending += data
        if idle or len(pending) >= SEND_BYTES or now - self._sent_at >= SEND_SECONDS:
            self._send(now)

    def _slow(self, step: tuple) -> bytes | None:
        try:
            return marshal.dumps(plain(step))
        except (TypeError, ValueError):
            if not self._unmarshallable:
                self._unmarshallable = True
                logger.exception("[kvwarm trace] a step's parts are not plain data; it is left out")
            return None

    def _send(self, now: float) -> None:
        try:
            sent = os.write(self._fd, self._pending)
        except BlockingIOError:
            return
        except OSError as err:
            self._stop(f"the trace's writer process is gone ({err}, exit code {self.process.poll()})")
            return
        del self._pending[:sent]  # a bytearray drops its head without moving the rest
        self._sent_at = now

    def _stop(self, why: str) -> None:
        self._stopped = why
        self._pending.clear()
        logger.error("[kvwarm trace] %s; the trace stops here, the engine serves on", why)

    def close(self, timeout: float = 10.0) -> None:
        """Send what waits, end the writer process's input, wait for it and log its report
        (idempotent)."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + timeout
        while self._pending and self._stopped is None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([], [self._fd], [], left)[1]:
                break
            self._send(0.0)
        unsent = len(self._pending)
        self._stopped = self._stopped or "closed"  # a step after this is not sent (the pipe is gone)
        os.close(self._fd)
        try:
            out, _ = self.process.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.communicate()
            logger.error("[kvwarm trace] the writer process did not finish within %.0f s; it was stopped", timeout)
            return
        self._log(out, unsent)

    def _log(self, out: bytes, unsent: int) -> None:
        try:
            report = json.loads(out.decode().strip().splitlines()[-1])
        except (ValueError, IndexError):
            report = None
        if report is None and self._stopped is None:
            logger.error(
                "[kvwarm trace] the writer process ended without its report (exit code %s); %s may be short",
                self.process.returncode,
                self.path,
            )
        if report is not None and report.get("failed"):
            logger.error("[kvwarm trace] %s; the trace stops here, the engine serves on", report["failed"])
        if report is not None and report.get("render_failed"):
            logger.error("[kvwarm trace] a step could not be rendered, left out:\n%s", report["render_failed"])
        if unsent:
            logger.error("[kvwarm trace] %d byte(s) of steps could not be handed to the writer process", unsent)
        if self.dropped:
            logger.warning(
                "[kvwarm trace] %d step(s) dropped: more than %d KiB waited for the writer process",
                self.dropped,
                MAX_PENDING_BYTES >> 10,
            )
