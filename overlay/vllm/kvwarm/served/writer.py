"""The engine's side of the trace's writer process (served.sink): it starts the process,
hands it the steps and, at close, waits for it. A step costs the engine's process one
marshal dump (C) and, now and then, one write to a pipe; no thread of the trace's runs in
the engine's process, so nothing competes with the engine's thread for the GIL.

Each step's frame (a 4-byte length, the marshal dump) is appended to a buffer; the buffer
goes to the pipe, which never blocks (non-blocking; what the pipe does not take waits for
the next try), once it holds SEND_BYTES, once SEND_SECONDS passed since the last send, and
whenever the engine is about to wait for work (so a trace is whole while the server idles).

Bounded (docs/validate-reference.md#the-trace-under-faults): at most the setting's
`max_pending_mb` waits in the engine's process beyond the pipe's own buffer. A step that
finds the bound full is sent first (the writer process may have caught up); only if the
bound is still full is it dropped, and from then on the steps are dropped until the writer
process has taken half the bound (so a writer that keeps just behind makes a few long gaps,
not one per step). A gap is logged when it starts (the bound, the writer process) and when
it ends (how many steps over how long, traced and held ones apart), and the trace records
it where it was: a line {"dropped": N, "untraced": M, "from": AT, "to": AT}; the traced steps'
numbers skip by N.

Lifecycle: the process reads the pipe to its end. `close` (the engine core's shutdown, and
atexit) sends what waits, closes the pipe, waits for the process and logs what it reports (a
failed write, a step it could not render); a process that does not end within the timeout
is killed. A writer process that dies (killed, out of memory) is logged when the next send
finds the pipe closed, with its exit status, and again at close; the trace stops there and
the engine serves on. If the engine's process dies, the pipe closes and the writer process
ends by itself after writing what it had; it runs in a session of its own, so a Ctrl-C to the
server's terminal does not cut it short.
"""

from __future__ import annotations

import fcntl
import json
import marshal
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from vllm.logger import init_logger

from ..record import vocabulary as v
from . import sink
from .settings import MAX_PENDING_MB_ENV, TraceSettings
from .step_parts import plain

logger = init_logger(__name__)

SEND_BYTES = 64 << 10
SEND_SECONDS = 0.1
PIPE_BYTES = 1 << 20  # asked of the kernel for the pipe (Linux; the default stays where refused), at most the bound
SINK = Path(sink.__file__).resolve()


@dataclass
class Gap:
    """Steps dropped at the bound, from the first to the last (their `at`)."""

    start: float
    end: float
    steps: int = 0  # traced steps
    untraced: int = 0  # steps the trace leaves out (the sweep's, none scheduled), sent for their prompt lengths

    def record(self) -> dict:
        return {v.TRACE_DROPPED: self.steps, "untraced": self.untraced, "from": self.start, "to": self.end}


def exit_status(process: subprocess.Popen) -> str:
    """How `process` ended, in words (waiting a moment: a process whose pipe just closed may
    not be reaped yet)."""
    try:
        code = process.wait(timeout=0.2)
    except subprocess.TimeoutExpired:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


class TraceWriter:
    def __init__(self, settings: TraceSettings, rank: int, launch: str, header: str):
        folder = settings.out
        names = [v.trace_file_name(rank, launch, k) for k in range(settings.files)]
        sink.prepare(folder, header, names[0])  # raises OSError naming the folder
        self.path = folder / names[0]
        self.rank = rank
        self.bound = settings.max_pending_bytes
        self.dropped = 0  # traced steps dropped at the bound, over the trace's life
        self.dropped_untraced = 0  # steps not traced dropped at the bound
        self.gaps = 0
        self._gap: Gap | None = None  # the steps being dropped now
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
            fcntl.fcntl(self._fd, fcntl.F_SETPIPE_SZ, min(PIPE_BYTES, self.bound))
        except (AttributeError, OSError):
            pass
        setup = {"folder": str(folder), "header": header, "max_file_bytes": settings.max_file_bytes, "names": names}
        self._pending = bytearray()
        self._append(marshal.dumps(setup))
        os.set_blocking(self._fd, False)
        self._send(0.0)

    @property
    def dropping(self) -> bool:
        """Whether steps are being dropped at the bound now."""
        return self._gap is not None

    def submit(self, step: tuple, at: float, idle: bool) -> None:
        """From the engine's thread: never blocks, never raises. `step`: served.recorder's
        frame, its step's number first (None: a step that is not traced); `at`: the step's
        end, seconds since the trace started; `idle`: the engine is about to wait for work."""
        if self._stopped is not None:
            return
        data = self._dump(step)
        if data is None:
            return
        if (self._gap is not None or len(self._pending) >= self.bound) and not self._room(at):
            if self._stopped is None:
                self._drop(step[0] is None, at)
            return
        self._append(data)
        if idle or len(self._pending) >= SEND_BYTES or at - self._sent_at >= SEND_SECONDS:
            self._send(at)

    def _dump(self, step: tuple) -> bytes | None:
        try:
            return marshal.dumps(step)
        except ValueError:
            pass
        try:
            return marshal.dumps(plain(step))
        except (TypeError, ValueError):
            if not self._unmarshallable:
                self._unmarshallable = True
                logger.exception("[kvwarm trace] a step's parts are not plain data; it is left out")
            return None

    def _append(self, data: bytes) -> None:
        self._pending += len(data).to_bytes(4, "little")
        self._pending += data

    def _room(self, at: float) -> bool:
        """Whether a step may wait, once what waits was offered to the writer process: below
        the bound, or, while steps are dropped, below half of it (the gap then ends)."""
        self._send(at)
        if self._stopped is not None:
            return False
        if self._gap is None:
            return len(self._pending) < self.bound
        if len(self._pending) > self.bound // 2:
            return False
        self._end_gap("the writer process takes steps again")
        return True

    def _drop(self, untraced: bool, at: float) -> None:
        gap = self._gap
        if gap is None:
            gap = self._gap = Gap(at, at)
            self.gaps += 1
            logger.warning(
                "[kvwarm trace] the trace's writer process (pid %d) has not taken the last %d KiB of steps (the "
                "bound: kvwarm_trace.max_pending_mb, %s); steps are dropped from here until it has taken half of "
                "them, and %s records the gap",
                self.process.pid,
                self.bound >> 10,
                MAX_PENDING_MB_ENV,
                self.path.name,
            )
        gap.end = at
        gap.untraced += untraced
        gap.steps += not untraced
        self.dropped_untraced += untraced
        self.dropped += not untraced

    def _end_gap(self, why: str) -> None:
        gap, self._gap = self._gap, None
        self._append(marshal.dumps(gap.record()))
        logger.warning(
            "[kvwarm trace] %s: %d step(s) dropped (and %d the trace leaves out), over %.3f s (from %.3f s to "
            "%.3f s of the trace); %s records the gap",
            why,
            gap.steps,
            gap.untraced,
            gap.end - gap.start,
            gap.start,
            gap.end,
            self.path.name,
        )

    def _send(self, at: float) -> None:
        try:
            sent = os.write(self._fd, self._pending)
        except BlockingIOError:
            return
        except OSError as err:
            self._stop(
                f"the trace's writer process (pid {self.process.pid}) is gone ({exit_status(self.process)}; "
                f"sending to it: {err}): {self.path} ends at the steps it had written"
            )
            return
        del self._pending[:sent]  # a bytearray drops its head without moving the rest
        self._sent_at = at

    def _stop(self, why: str) -> None:
        self._stopped = why
        self._pending.clear()
        self._gap = None
        logger.error("[kvwarm trace] %s; the trace stops here, the engine serves on", why)

    def close(self, timeout: float = 10.0) -> None:
        """Send what waits, end the writer process's input, wait for it and log its report
        (idempotent)."""
        if self._closed:
            return
        self._closed = True
        gone = self._stopped  # the writer process was already gone (said when it happened)
        if gone is None and self._gap is not None:
            self._end_gap("the trace closes while steps are dropped")
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
        self._log(out, unsent, gone)

    def _log(self, out: bytes, unsent: int, gone: str | None) -> None:
        try:
            report = json.loads(out.decode().strip().splitlines()[-1])
        except (ValueError, IndexError):
            report = None
        if report is None:
            logger.error(
                "[kvwarm trace] the trace's writer process ended without its report (%s)%s; %s holds only what it "
                "wrote before it ended",
                exit_status(self.process),
                ", as said when a step could not be sent to it" if gone else "",
                self.path,
            )
        if report is not None and report.get("failed"):
            logger.error("[kvwarm trace] %s; the trace stops here, the engine serves on", report["failed"])
        if report is not None and report.get("render_failed"):
            logger.error("[kvwarm trace] a step could not be rendered, left out:\n%s", report["render_failed"])
        if unsent:
            logger.error("[kvwarm trace] %d byte(s) of steps could not be handed to the writer process", unsent)
