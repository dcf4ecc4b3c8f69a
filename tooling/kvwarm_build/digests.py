"""The one digest of named files the build records (the series, the overlay), and the one
key of what a cached venv, image or result was made from."""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Iterable


def digest_named(items: Iterable[tuple[str, bytes]]) -> str:
    """sha256 over (name, bytes) pairs in the given order: name, NUL, bytes, NUL each.
    The order is the caller's: a series' order matters, a folder is given sorted."""
    digest = hashlib.sha256()
    for name, data in items:
        digest.update(name.encode() + b"\0" + data + b"\0")
    return digest.hexdigest()


def cache_key(*inputs, length: int = 12) -> str:
    """A short hex name for what a cached thing is made from: sha256 over the repr of
    `inputs` (str, tuples, lists, numbers: values whose repr is stable) and this Python's
    major.minor, as what one Python made (a venv, its results) is not another's."""
    return hashlib.sha256(repr((*inputs, sys.version_info[:2])).encode()).hexdigest()[:length]
