"""The one digest of named files the build records (the series, the overlay)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable


def digest_named(items: Iterable[tuple[str, bytes]]) -> str:
    """sha256 over (name, bytes) pairs in the given order: name, NUL, bytes, NUL each.
    The order is the caller's: a series' order matters, a folder is given sorted."""
    digest = hashlib.sha256()
    for name, data in items:
        digest.update(name.encode() + b"\0" + data + b"\0")
    return digest.hexdigest()
