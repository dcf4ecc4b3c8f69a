"""What crosses the ranks' exchange, and the checks on what comes back.

Every record is a JSON object that names its rank and its kind, and, through the store, the
launch's nonce (rank 0 draws it when it hosts; every other rank learns it when it joins). A
record that is not what its key says (not an object, another rank's, another launch's, a
kind this boundary does not expect) is refused by name: RankFailed, naming the key and why.
These checks keep a stray or stale record out of a sweep; they are not authentication (the
store takes anyone who reaches its port: docs/ranks.md).

No value is larger than VALUE_LIMIT, far below what torch's store takes: a rank's rows cross
in chunks of about CHUNK_BYTES, and a value over the limit fails with both limits named.
"""

from __future__ import annotations

import json

from ...record import vocabulary as v
from ..ranks import RankFailed

VALUE_LIMIT = 1 << 20  # bytes: the most one value the sweep sets may hold
TORCH_LIMIT = 8 << 20  # bytes: torch's TCPStore refuses a larger payload (MAX_PAYLOAD_LEN) and drops the client
CHUNK_BYTES = 256 << 10  # a rank's new rows are published in chunks of about this
FAILURE = "failure"  # the kind of a failed rank's record; it answers whichever boundary comes next


def encode(value: dict, what: str) -> bytes:
    """`value` as the bytes the exchange sets; RankFailed where it is over the limit."""
    data = json.dumps(value, separators=(",", ":")).encode()
    if len(data) > VALUE_LIMIT:
        raise RankFailed(
            f"{what} is {len(data)} bytes, over the rank exchange's limit of {VALUE_LIMIT} bytes per value "
            f"(1 MiB; torch's TCPStore refuses a value over {TORCH_LIMIT} bytes)"
        )
    return data


def decode(raw: bytes, key: str, rank: int, nonce: str | None) -> dict:
    """The record at `key`, which rank `rank` set in this launch (`nonce`; None: not checked)."""
    try:
        record = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        raise RankFailed(f"refused the record at {key}: not JSON ({len(raw)} bytes)") from None
    if not isinstance(record, dict):
        raise RankFailed(f"refused the record at {key}: a JSON {type(record).__name__}, not an object")
    if record.get("rank") != rank:
        raise RankFailed(f"refused the record at {key}: it says rank {record.get('rank')!r}, the key rank {rank}")
    if nonce is not None and record.get("nonce") != nonce:
        raise RankFailed(
            f"refused the record at {key}: it is not this launch's (nonce {record.get('nonce')!r}, "
            f"this launch's {nonce!r}): another launch or process writes to this rank exchange"
        )
    return record


def meeting_record(raw: bytes, key: str, rank: int, kind: str, nonce: str | None) -> dict:
    """A rank's record for the open boundary of `kind` (or the failure that answers it)."""
    record = decode(raw, key, rank, nonce)
    if record.get("kind") not in (kind, FAILURE):
        raise RankFailed(
            f"refused the record at {key}: its kind {record.get('kind')!r} is not this boundary's ({kind!r}) "
            f"nor {FAILURE!r}"
        )
    return record


def summary_record(raw: bytes, key: str, rank: int, nonce: str | None) -> dict:
    """A rank's summary for rank 0's combined view: its artifact less its rows, and how many
    rows and chunks it has published."""
    record = decode(raw, key, rank, nonce)
    head = record.get("artifact")
    counts = [record.get(k) for k in ("chunks", "results", "skipped_points")]
    if not isinstance(head, dict) or head.get("status") not in v.STATUSES:
        raise RankFailed(f"refused the record at {key}: no artifact with a known status")
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts):
        raise RankFailed(f"refused the record at {key}: its counts {counts} are not whole numbers")
    return record


def rows_record(raw: bytes, key: str, rank: int, nonce: str | None) -> dict:
    """One chunk of a rank's new rows: its measured rows and its skipped points."""
    record = decode(raw, key, rank, nonce)
    for field in ("results", "skipped_points"):
        entries = record.get(field)
        if not isinstance(entries, list) or not all(isinstance(e, dict) and "point" in e for e in entries):
            raise RankFailed(f"refused the record at {key}: its {field} are not a list of rows")
    return record


def chunks(results: list[dict], skipped: list[dict], rank: int) -> list[dict]:
    """The new rows in chunks of about CHUNK_BYTES each (at least one row a chunk); one row
    over the limit fails with the limits named."""
    out: list[dict] = []
    current: dict = {"results": [], "skipped_points": []}
    size = 0
    for field, entries in (("results", results), ("skipped_points", skipped)):
        for entry in entries:
            n = len(encode(entry, f"rank {rank}'s row {entry.get('point')}"))
            if size and size + n > CHUNK_BYTES:
                out.append(current)
                current, size = {"results": [], "skipped_points": []}, 0
            current[field].append(entry)
            size += n
    if size:
        out.append(current)
    return out
