"""Writing a file so that no reader or concurrent writer ever sees it half written, and
the lock file that serialises the ranks' read-then-write steps."""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def write_atomically(path: Path, data: bytes) -> None:
    """A unique temporary file in the target folder, then an atomic replace: concurrent
    writers (other ranks, a reader) never see a partial file or collide on a name."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextmanager
def locked(lock_path: Path, wait: bool = True) -> Iterator[bool]:
    """An exclusive flock on lock_path (made if missing) for the block's duration; yields
    whether it is held. `wait`: False: where another process holds it, the block runs
    without it at once (yields False) instead of waiting."""
    with open(lock_path, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
