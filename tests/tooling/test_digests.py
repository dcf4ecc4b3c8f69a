"""The one digest of named files: what the series and the overlay digests are made of."""

from __future__ import annotations

import hashlib

from kvwarm_build.digests import digest_named


def test_each_name_and_its_bytes_are_separated_so_moving_a_byte_changes_the_digest():
    assert digest_named([("a", b"1")]) == hashlib.sha256(b"a\x001\x00").hexdigest()
    assert digest_named([("a", b"1b")]) != digest_named([("a1", b"b")])


def test_the_order_is_the_callers():
    items = [("b", b"2"), ("a", b"1")]
    assert digest_named(items) != digest_named(sorted(items))
