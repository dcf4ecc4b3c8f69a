"""The trace's writer process: it reads the steps the engine's process sends it as marshal
frames on its standard input, turns each into the trace's JSON line (format version 2) and
writes the files (rotated at the size cap). It runs as a script of its own,
`python -I -S .../served/sink.py ENGINE_PID`, so that it imports the standard library alone (no vLLM,
no torch: about 12 MiB, and a start of a Python interpreter); served.writer starts it.

Why a process: in the engine's process every microsecond of Python a thread spends competes
for the GIL with the engine's thread; here the rendering, the JSON and the writes run on
another core (docs/validate-reference.md#what-the-trace-costs).

The stream: each frame is a 4-byte little-endian length and a marshal dump. The first is the
setup (the folder, the header's line, the size cap, the files' names by rotation); each next
one is a step (served.recorder's tuple: `number` None for a step that is not traced, whose
frame is read only for the prompt lengths it brings) or a record written as it is (a dict:
served.writer's record of the steps it dropped at its bound). The process ends at the end of its
input (the engine closed the trace, or the engine's process is gone), or when the engine's
process is gone while something else holds the pipe open (a process forked from it): it
then writes every whole frame it has, flushes, closes the file and prints one JSON line, its
report, on its standard output. A write that fails stops the trace (said on standard error
at once and in the report); a step that cannot be rendered is left out (the same).

Also imported by the engine's process (served.writer) for `prepare` alone (and for this
file's path, which it runs).
"""

from __future__ import annotations

import json
import marshal
import os
import select
import sys
import traceback
from pathlib import Path

_ENCODE = json.JSONEncoder(separators=(",", ":")).encode  # made once: json.dumps makes one per call
CHECK_PARENT_SECONDS = 1.0  # how often, with no input, the process looks for the engine's


def line(record: dict) -> str:
    return _ENCODE(record) + "\n"


def prepare(folder: Path, header: str, current: str) -> None:
    """In the engine's process, at the trace's start: the folder made, the current file begun
    with the header. Nothing else in the folder is touched: the names are this launch's own
    (record.vocabulary.trace_file_name), so another engine's files, or an earlier run's, stay
    as they are. Raises OSError naming the folder and the fix."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with (folder / current).open("x", encoding="ascii") as file:  # "x": never another launch's file
            file.write(header)
    except OSError as err:
        raise OSError(
            f"the trace folder {folder} cannot be written ({err}); give kvwarm_trace an 'out' folder this "
            "process may create and write"
        ) from err


class TraceFiles:
    """One launch's trace files of a rank: the current one open (begun by `prepare`), the
    rotated ones behind it. `names`: the file names by rotation, names[0] the current one."""

    def __init__(self, folder: Path, header: str, max_file_bytes: int, names: list[str]):
        self.folder, self._header, self._max, self._names = folder, header, max_file_bytes, names
        self.path = folder / names[0]
        self._file = self.path.open("a", encoding="ascii", buffering=1 << 16)
        self._size = self.path.stat().st_size

    def _open(self) -> None:
        self._file = self.path.open("w", encoding="ascii", buffering=1 << 16)
        self._file.write(self._header)
        self._size = len(self._header)

    def write(self, text: str) -> None:
        if self._size + len(text) > self._max and self._size > len(self._header):
            self._rotate()
        self._file.write(text)
        self._size += len(text)

    def _rotate(self) -> None:
        self._file.close()
        names, folder = self._names, self.folder
        (folder / names[-1]).unlink(missing_ok=True)
        for k in range(len(names) - 2, 0, -1):
            older = folder / names[k]
            if older.exists():
                older.replace(folder / names[k + 1])
        if len(names) > 1:
            self.path.replace(folder / names[1])
        self._open()

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class RawSteps:
    """Turns each step's parts, in the order the engine took the steps in, into the line's
    raw fields (docs/validate-reference.md, "a step line"). A request's prompt length is known from the
    step that first scheduled it (the engine sends it with the request's first chunk) until
    the step that reports it finished; one never seen (its first step was dropped) follows
    vLLM's own test: an output token already, its prompt is done; none, this chunk ends what
    is known of it."""

    def __init__(self):
        self._prompt: dict[str, int] = {}

    def _unseen(self, ids: list, computed: list, scheduled: dict, produced: list | None) -> list[int]:
        lengths = []
        for k, req_id in enumerate(ids):
            length = self._prompt.get(req_id)
            if length is None:
                before = computed[k]
                length = before if produced and produced[k] else before + scheduled.get(req_id, 0)
            lengths.append(length)
        return lengths

    def observe(self, step_parts: tuple) -> dict:
        """The line's raw fields for one step (every step passes here, traced or not, so that
        prompt lengths are known). `step_parts`: served.step_parts.parts' plain data."""
        scheduled, new_reqs, ids, computed, resumed, produced, spec, finished, preempted = step_parts
        prompt = self._prompt
        new = []
        for req_id, length, before in new_reqs:
            prompt[req_id] = length
            new.append([length, before, scheduled.get(req_id, 0)])
        try:
            lengths = [prompt[r] for r in ids]
        except KeyError:
            lengths = self._unseen(ids, computed, scheduled, produced)
        raw = {
            "new": new,
            "cached": {"computed": list(computed), "scheduled": [scheduled[r] for r in ids], "prompt": lengths},
        }
        if spec:
            raw["spec"] = [len(spec.get(r, ())) for r in ids]
            raw["spec_tokens"] = sum(map(len, spec.values()))
        if resumed:
            raw["resumed"] = [k for k, r in enumerate(ids) if r in resumed]
        if preempted:
            raw["preempted"] = len(preempted)
        for req_id in finished:
            prompt.pop(req_id, None)
        return raw


def render(raw_steps: RawSteps, step: tuple | dict) -> str | None:
    """A step's frame as its line (None: a step that is not traced); a record as it is."""
    if isinstance(step, dict):
        return line(step)
    number, at, wall, untimed, gap, span, phases, parts, waiting, sent, collected, graph = step
    raw = raw_steps.observe(parts)
    if number is None:
        return None
    record = {"step": number, "at": at, "wall": wall}
    if untimed is not None:
        record["untimed"] = untimed
    record.update(gap=gap, span=span, phases=phases, **raw)
    record["queued"] = list(waiting)  # served.step_parts.waiting's sums
    record["outputs"] = sent
    record["gc"] = list(collected)
    if graph is not None:
        record["graph"] = list(graph)
    return line(record)


class Frames:
    """Whole frames out of the bytes read so far."""

    def __init__(self):
        self._buffer = bytearray()

    def feed(self, chunk: bytes) -> list:
        buffer = self._buffer
        buffer += chunk
        frames, at = [], 0
        while len(buffer) - at >= 4:
            size = int.from_bytes(buffer[at : at + 4], "little")
            if len(buffer) - at - 4 < size:
                break
            frames.append(marshal.loads(buffer[at + 4 : at + 4 + size]))
            at += 4 + size
        del buffer[:at]
        return frames

    @property
    def partial(self) -> bool:
        return bool(self._buffer)


class Sink:
    def __init__(self, setup: dict):
        self.raw = RawSteps()
        self.report = {"written": 0, "failed": None, "render_failed": None, "partial_frame": False}
        self.path = Path(setup["folder"]) / setup["names"][0]
        try:
            self.files = TraceFiles(Path(setup["folder"]), setup["header"], setup["max_file_bytes"], setup["names"])
        except OSError as err:
            self.files = None
            self._fail(err)

    def take(self, step: tuple) -> None:
        try:
            text = render(self.raw, step)
        except Exception:  # noqa: BLE001  (a step left out, said once)
            if self.report["render_failed"] is None:
                self.report["render_failed"] = traceback.format_exc(limit=3)
                _say(f"a step could not be rendered; it is left out:\n{self.report['render_failed']}")
            return
        if text is not None and self.report["failed"] is None:
            try:
                self.files.write(text)
                self.report["written"] += 1
            except OSError as err:
                self._fail(err)

    def flush(self) -> None:
        if self.report["failed"] is None:
            try:
                self.files.flush()
            except OSError as err:
                self._fail(err)

    def _fail(self, err: OSError) -> None:
        self.report["failed"] = f"writing {self.path} failed ({err})"
        _say(f"{self.report['failed']}; the trace stops here, the engine serves on")

    def close(self) -> None:
        if self.files is None:
            return
        self.flush()
        try:
            self.files.close()
        except OSError as err:
            if self.report["failed"] is None:
                self._fail(err)


def _say(message: str) -> None:
    print(f"[kvwarm trace] {message}", file=sys.stderr, flush=True)


def main() -> int:
    # the engine's process, as it named itself (it may be gone before this line runs)
    fd, parent = sys.stdin.fileno(), int(sys.argv[1]) if len(sys.argv) > 1 else os.getppid()
    frames, sink = Frames(), None
    while True:
        ready, _, _ = select.select([fd], [], [], CHECK_PARENT_SECONDS)
        if not ready:
            if os.getppid() != parent:  # the engine's process is gone; a process it forked holds the pipe
                break
            continue
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            break
        for frame in frames.feed(chunk):
            if sink is None:
                sink = Sink(frame)
            else:
                sink.take(frame)
        if sink is not None:
            sink.flush()
    if sink is None:
        return 1
    sink.report["partial_frame"] = frames.partial
    sink.close()
    try:
        print(json.dumps(sink.report), flush=True)
    except OSError:  # nobody reads the report: the engine's process is gone
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
