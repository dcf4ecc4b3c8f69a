"""The decode points a sweep measures, from the established points file (schema v1):

    {"schema_version": 1, "decode": [{"total_kv_read_tokens": K, "batch_size": B}, ...]}

A point is B requests whose contexts partition K (as equal as possible). Every problem
is a PointsFileError that names the file, the entry and the fix.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SCHEMA_VERSION = 1
TOP_LEVEL_KEYS = ("decode", "prefill", "schema_version")
POINT_KEYS = ("batch_size", "total_kv_read_tokens")


class PointsFileError(ValueError):
    pass


@dataclass(frozen=True)
class DecodePoint:
    total_kv_read_tokens: int  # K: KV tokens the step reads, summed over the batch
    batch_size: int  # B

    def contexts(self) -> list[int]:
        """B contexts summing to K, the first K % B of them one token longer."""
        base, longer = divmod(self.total_kv_read_tokens, self.batch_size)
        return [base + 1] * longer + [base] * (self.batch_size - longer)

    def tokens_spanned(self, steady_steps: int) -> int:
        """Tokens the point's longest request spans: its context, the admission token and
        the steady steps (what max_model_len and the chains' text must hold)."""
        return self.contexts()[0] + 1 + steady_steps


def _positive_int(value, what: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PointsFileError(f"{where}: {what} must be a positive integer, got {value!r}")
    return value


def _known_keys(entry: dict, allowed: tuple[str, ...], where: str) -> None:
    """A mistyped key would otherwise surface as a missing one, far from its cause."""
    for key in entry:
        if key not in allowed:
            raise PointsFileError(f"{where}: unknown key {key!r} (allowed: {', '.join(allowed)})")


def parse_points(data, source: str, max_model_len: int, steady_steps: int) -> list[DecodePoint]:
    """The points of a parsed points file; `steady_steps` is the steady steps each request
    decodes after its context, which must still fit in max_model_len."""
    if not isinstance(data, dict):
        raise PointsFileError(f"{source}: expected a JSON object with schema_version and decode")
    if data.get("schema_version") != SCHEMA_VERSION:
        raise PointsFileError(
            f"{source}: schema_version is {data.get('schema_version')!r}; this sweep reads "
            f"schema_version {SCHEMA_VERSION}"
        )
    _known_keys(data, TOP_LEVEL_KEYS, source)
    if data.get("prefill"):
        raise PointsFileError(
            f"{source}: has prefill points; the decode sweep measures decode points only "
            "(remove the 'prefill' list or run a prefill benchmark for them)"
        )
    entries = data.get("decode")
    if not isinstance(entries, list) or not entries:
        raise PointsFileError(f"{source}: 'decode' must be a non-empty list of points")
    points = []
    for i, entry in enumerate(entries):
        where = f"{source}: decode[{i}]"
        if not isinstance(entry, dict):
            raise PointsFileError(f"{where}: expected an object with total_kv_read_tokens and batch_size")
        _known_keys(entry, POINT_KEYS, where)
        k = _positive_int(entry.get("total_kv_read_tokens"), "total_kv_read_tokens", where)
        b = _positive_int(entry.get("batch_size"), "batch_size", where)
        if k < b:
            raise PointsFileError(
                f"{where}: total_kv_read_tokens {k} is less than batch_size {b} "
                "(every request reads at least one token)"
            )
        point = DecodePoint(k, b)
        longest = point.tokens_spanned(steady_steps)
        if longest > max_model_len:
            raise PointsFileError(
                f"{where}: a request at context {point.contexts()[0]} plus {1 + steady_steps} decode "
                f"steps needs {longest} tokens, beyond max_model_len {max_model_len}; lower K, "
                "raise batch_size or start the engine with a larger --max-model-len"
            )
        points.append(point)
    return points


def load_points(path: str | Path, max_model_len: int, steady_steps: int) -> list[DecodePoint]:
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise PointsFileError(f"points file {path} not found; pass an existing file with --points") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise PointsFileError(f"points file {path} is not valid JSON: {err}") from None
    return parse_points(data, f"points file {path}", max_model_len, steady_steps)
