"""The points a sweep measures, from the points file (per DP rank):

    {"schema_version": 3,
     "decode":  [{"total_kv_read_tokens": K, "batch_size": B}, ...],
     "prefill": [{"total_prefill_tokens": N, "total_kv_read_tokens": P, "batch_size": B,
                  "continuation": false}, ...],
     "mixed":   [{"decode": {decode point}, "prefill": {prefill point}}, ...]}

Schema v1 (Dynamo's shape) is the same without `mixed` and `continuation`, v2 without
`continuation`; both are still read.

A decode point is B requests whose contexts partition K (as equal as possible), decoding one
token each per step. A prefill point is one step of B brand-new requests: request i computes
new_i tokens (a balanced split of N, each at least 1) on top of a prefix-cache hit of kv_i
tokens (a balanced split of P in whole prefix blocks, at least one each when P > 0; the block
is the engine's, so that split is made once the engine is known: PrefillPoint.prefixes).
A continuation prefill point (`"continuation": true`, P > 0) is the same step with its B
requests running ones whose first P tokens an earlier step of their own computed: the later
chunk of a chunked prompt (sweep.prefill).
A mixed point is one step holding both: a decode part's B_d requests (one token each, at their
contexts) and a prefill part's B_p new requests, B_d + N_p tokens in all.
The lists may be empty or missing, not all. Every problem is a PointsFileError that names
the file, the entry and the fix.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..record.shape import balanced

SCHEMA_VERSION = 3  # v2 adds `mixed`, v3 `continuation`
READS = (1, 2, 3)  # v1: Dynamo's shape (decode and prefill)
CONTINUATION_SCHEMA = 3
TOP_LEVEL_KEYS = ("decode", "mixed", "prefill", "schema_version")
MIXED_KEYS = ("decode", "prefill")
DECODE_KEYS = ("batch_size", "total_kv_read_tokens")
PREFILL_KEYS = ("batch_size", "total_kv_read_tokens", "total_prefill_tokens")
CONTINUATION_KEY = "continuation"


class PointsFileError(ValueError):
    pass


@dataclass(frozen=True)
class DecodePoint:
    total_kv_read_tokens: int  # K: KV tokens the step reads, summed over the batch
    batch_size: int  # B

    def contexts(self) -> list[int]:
        """B contexts summing to K, the first K % B of them one token longer."""
        return balanced(self.total_kv_read_tokens, self.batch_size)

    def tokens_spanned(self, steady_steps: int) -> int:
        """Tokens the point's longest request spans: its context, the admission token and
        the steady steps (what max_model_len and the chains' text must hold)."""
        return largest_part(self.total_kv_read_tokens, self.batch_size) + 1 + steady_steps


@dataclass(frozen=True)
class PrefillPoint:
    total_prefill_tokens: int  # N: new tokens the step computes, summed over the batch
    total_kv_read_tokens: int  # P: prefix tokens the step reads from the cache, summed
    batch_size: int  # B
    continuation: bool = False  # running requests, their first P tokens computed by an earlier step

    def new_tokens(self) -> list[int]:
        """B new-token counts summing to N, each at least 1."""
        return balanced(self.total_prefill_tokens, self.batch_size)

    def prefixes(self, unit: int) -> list[int]:
        """B prefix lengths summing to P in whole blocks of `unit` tokens (the prefix-match
        unit, and on a hybrid layout the state block too): raises PointsFileError where P is
        not a whole number of blocks, or gives a request none."""
        if self.total_kv_read_tokens == 0:
            return [0] * self.batch_size
        return [n * unit for n in balanced(self._prefix_blocks(unit), self.batch_size)]

    def lead(self, unit: int) -> int:
        """The tokens each request computes in its shot's lead step (a continuation: one
        prefix unit; else none, the shot is one step)."""
        return unit if self.continuation else 0

    def hits(self, unit: int) -> list[int]:
        """The prefix each request's lookup finds: its prefix, less what its lead step computes."""
        return [p - self.lead(unit) for p in self.prefixes(unit)]

    def _prefix_blocks(self, unit: int) -> int:
        blocks, rest = divmod(self.total_kv_read_tokens, unit)
        if rest or blocks < self.batch_size:
            low = max(self.batch_size, blocks) * unit
            fix = f"use {low}" + (f" or {low + unit}" if rest and blocks >= self.batch_size else "")
            raise PointsFileError(
                f"prefill point N={self.total_prefill_tokens} P={self.total_kv_read_tokens} B={self.batch_size}: "
                f"P must be a whole number of {unit}-token blocks, at least one per request ({fix})"
            )
        return blocks

    def tokens_spanned(self, unit: int = 1) -> int:
        """Tokens the point's longest request spans: its prefix and new tokens and the one
        token it samples (the first request: both splits put their larger parts first)."""
        prefix = largest_part(self._prefix_blocks(unit), self.batch_size) * unit if self.total_kv_read_tokens else 0
        return prefix + largest_part(self.total_prefill_tokens, self.batch_size) + 1


@dataclass(frozen=True)
class MixedPoint:
    """One step of a decode part's requests (one token each) and a prefill part's new ones."""

    decode: DecodePoint
    prefill: PrefillPoint

    @property
    def batch_size(self) -> int:
        """The step's requests (what max_num_seqs must hold)."""
        return self.decode.batch_size + self.prefill.batch_size

    @property
    def step_tokens(self) -> int:
        """The tokens the step computes: one per decode request and the prefill part's N."""
        return self.decode.batch_size + self.prefill.total_prefill_tokens

    def name(self) -> str:
        d, p = self.decode, self.prefill
        return (
            f"decode B={d.batch_size} K={d.total_kv_read_tokens} + prefill B={p.batch_size} "
            f"N={p.total_prefill_tokens} P={p.total_kv_read_tokens}" + (" (continuation)" if p.continuation else "")
        )


def mixed_decode_steps(decode_steps: int) -> int:
    """The steps a mixed point's decode requests run after their admission: one per shot
    (the warm one and at most `decode_steps` more, SweepConfig.decode_steps: what a decode
    point's requests run), each followed by at most one more (the decode-only step before a
    new request's shot: mixed_gap_steps), and one more. Under data parallel the shots are
    one more (a trailing untimed shot: sweep.mixed_runner) and run without gap steps, so
    decode_steps + 2 steps, which this bound holds too."""
    return 2 * (decode_steps + 1) + 1


# A served chunk of a new prompt joins decodes that ran alone the step before; on the CPU
# engine such a step ran 2-4.5 % longer than the same step right after another chunk's
# (docs/measurements/mixed-steps.md, "What runs before a mixed step"), so a shot follows one such step.
MIXED_GAP_STEPS = 1


def mixed_gap_steps(point: MixedPoint, ranks: int = 1) -> int:
    """The decode part's steps alone before each shot after the first: none for a
    continuation, whose lead step runs there (as a served chunk follows its prompt's last),
    and none over several data-parallel `ranks`, which may start a point a step apart: a
    gap would put one rank's timed shot beside another's decode-only step."""
    return 0 if point.prefill.continuation or ranks > 1 else MIXED_GAP_STEPS


def mixed_advance(point: MixedPoint, settle: int, ranks: int = 1) -> int:
    """The tokens each decode request computes from the warm shot's step to the step before
    the first timed shot (whose K the row reports): the settle shots' and the gaps'."""
    return settle + (settle + 1) * mixed_gap_steps(point, ranks)


def takes_tails(points: list) -> bool:
    """Whether any point computes new prompt tokens (a prefill point, a mixed one's part)."""
    return any(isinstance(p, (PrefillPoint, MixedPoint)) for p in points)


def largest_part(total: int, parts: int) -> int:
    """The largest of `balanced(total, parts)`, without building it (a mistyped batch size
    must not allocate a list of that length before any check)."""
    return -(-total // parts)


def _int(value, what: str, where: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = "a positive integer" if minimum else "an integer >= 0"
        raise PointsFileError(f"{where}: {what} must be {kind}, got {value!r}")
    return value


def _known_keys(entry: dict, allowed: tuple[str, ...], where: str) -> None:
    """A mistyped key would otherwise surface as a missing one, far from its cause."""
    for key in entry:
        if key not in allowed:
            raise PointsFileError(f"{where}: unknown key {key!r} (allowed: {', '.join(allowed)})")


def _decode_point(entry, where: str, max_model_len: int, steady_steps: int) -> DecodePoint:
    if not isinstance(entry, dict):
        raise PointsFileError(f"{where}: expected an object with total_kv_read_tokens and batch_size")
    _known_keys(entry, DECODE_KEYS, where)
    k = _int(entry.get("total_kv_read_tokens"), "total_kv_read_tokens", where, 1)
    b = _int(entry.get("batch_size"), "batch_size", where, 1)
    if k < b:
        raise PointsFileError(
            f"{where}: total_kv_read_tokens {k} is less than batch_size {b} (every request reads at least one token)"
        )
    point = DecodePoint(k, b)
    longest = point.tokens_spanned(steady_steps)
    if longest > max_model_len:
        raise PointsFileError(
            f"{where}: a request at context {largest_part(k, b)} plus {1 + steady_steps} decode "
            f"steps needs {longest} tokens, beyond max_model_len {max_model_len}; lower K, "
            "raise batch_size or start the engine with a larger --max-model-len"
        )
    return point


def _prefill_point(entry, where: str, max_model_len: int, version: int = SCHEMA_VERSION) -> PrefillPoint:
    if not isinstance(entry, dict):
        raise PointsFileError(
            f"{where}: expected an object with total_prefill_tokens, total_kv_read_tokens and batch_size"
        )
    if CONTINUATION_KEY in entry and version < CONTINUATION_SCHEMA:
        raise PointsFileError(
            f"{where}: continuation needs schema_version {CONTINUATION_SCHEMA}; set it to {CONTINUATION_SCHEMA}"
        )
    _known_keys(entry, (*PREFILL_KEYS, CONTINUATION_KEY), where)
    continuation = entry.get(CONTINUATION_KEY, False)
    if not isinstance(continuation, bool):
        raise PointsFileError(f"{where}: continuation must be true or false, got {continuation!r}")
    n = _int(entry.get("total_prefill_tokens"), "total_prefill_tokens", where, 1)
    p = _int(entry.get("total_kv_read_tokens", 0), "total_kv_read_tokens", where, 0)
    b = _int(entry.get("batch_size"), "batch_size", where, 1)
    if n < b:
        raise PointsFileError(
            f"{where}: total_prefill_tokens {n} is less than batch_size {b} (every request computes at least "
            "one new token)"
        )
    if 0 < p < b:
        raise PointsFileError(f"{where}: total_kv_read_tokens {p} gives a request no prefix; use 0 or at least {b}")
    if continuation and not p:
        raise PointsFileError(
            f"{where}: a continuation continues the P tokens its requests computed before, and P is 0; give "
            "total_kv_read_tokens > 0 or drop continuation"
        )
    point = PrefillPoint(n, p, b, continuation)
    longest = largest_part(p, b) + largest_part(n, b) + 1  # whole blocks may move a few tokens: rechecked
    if longest > max_model_len:
        raise PointsFileError(
            f"{where}: a request of about {longest - 1} prompt tokens plus the one it samples is beyond "
            f"max_model_len {max_model_len}; lower N or P, raise batch_size or start the engine with a larger "
            "--max-model-len"
        )
    return point


def _mixed_point(entry, where: str, max_model_len: int, steady_steps: int, version: int) -> MixedPoint:
    if not isinstance(entry, dict) or set(entry) != set(MIXED_KEYS):
        _known_keys(entry if isinstance(entry, dict) else {}, MIXED_KEYS, where)
        raise PointsFileError(
            f"{where}: expected an object with a 'decode' part (total_kv_read_tokens, batch_size) and a "
            "'prefill' part (total_prefill_tokens, total_kv_read_tokens, batch_size)"
        )
    steps = mixed_decode_steps(steady_steps)
    return MixedPoint(
        _decode_point(entry["decode"], f"{where}.decode", max_model_len, steps),
        _prefill_point(entry["prefill"], f"{where}.prefill", max_model_len, version),
    )


def parse_points(data, source: str, max_model_len: int, steady_steps: int) -> list:
    """The points of a parsed points file, prefill points first, then decode, then mixed;
    `steady_steps` is the steady steps each decode request decodes after its context, which
    must still fit in max_model_len."""
    if not isinstance(data, dict):
        raise PointsFileError(f"{source}: expected a JSON object with schema_version and decode, prefill or mixed")
    version = data.get("schema_version")
    if type(version) is not int or version not in READS:  # true and 1.0 equal 1, and are not it
        raise PointsFileError(
            f"{source}: schema_version is {version!r}; this sweep reads schema_version "
            f"{' or '.join(map(str, READS))} (the integer; 2 or more for mixed points, {CONTINUATION_SCHEMA} for "
            "continuations)"
        )
    if version == 1 and "mixed" in data:
        raise PointsFileError(f"{source}: 'mixed' points need schema_version 2 or more; set it to {SCHEMA_VERSION}")
    _known_keys(data, TOP_LEVEL_KEYS if version > 1 else tuple(k for k in TOP_LEVEL_KEYS if k != "mixed"), source)
    lists = {kind: data.get(kind, []) for kind in ("prefill", "decode", "mixed")}
    for kind, entries in lists.items():
        if not isinstance(entries, list):
            raise PointsFileError(f"{source}: '{kind}' must be a list of points")
    if not any(lists.values()):
        raise PointsFileError(f"{source}: 'decode', 'prefill' and 'mixed' are all empty: give at least one point")
    prefill = [
        _prefill_point(e, f"{source}: prefill[{i}]", max_model_len, version) for i, e in enumerate(lists["prefill"])
    ]
    decode = [
        _decode_point(e, f"{source}: decode[{i}]", max_model_len, steady_steps) for i, e in enumerate(lists["decode"])
    ]
    mixed = [
        _mixed_point(e, f"{source}: mixed[{i}]", max_model_len, steady_steps, version)
        for i, e in enumerate(lists["mixed"])
    ]
    for kind, points in (("prefill", prefill), ("decode", decode), ("mixed", mixed)):
        first: dict = {}
        for i, point in enumerate(points):
            if point in first:
                raise PointsFileError(
                    f"{source}: {kind}[{i}] repeats {kind}[{first[point]}]; give each point once (rows are "
                    "keyed by their point, so a repeat would be lost)"
                )
            first[point] = i
    return [*prefill, *decode, *mixed]


def check_budget(points: list, budget: int | None, source: str) -> None:
    """Each mixed point's step fits the engine's token budget (max_num_batched_tokens), or
    the engine would chunk its prefill part: refused, naming the point and the fix."""
    for point in points:
        if budget is not None and isinstance(point, MixedPoint) and point.step_tokens > budget:
            raise PointsFileError(
                f"{source}: mixed point {point.name()}: its step computes {point.decode.batch_size} decode + "
                f"{point.prefill.total_prefill_tokens} prefill = {point.step_tokens} tokens, beyond "
                f"max_num_batched_tokens {budget}, so the engine would chunk the prefill part; lower N or the "
                f"decode batch, or start the engine with --max-num-batched-tokens {point.step_tokens} or more"
            )


def load_points(path: str | Path, max_model_len: int, steady_steps: int) -> list:
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
