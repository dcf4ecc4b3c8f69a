"""A prefill point inside a sweep: its shots, each one engine step of exactly B brand-new
requests (max_tokens=1), request i computing new_i tokens on top of a prefix-cache hit of
kv_i tokens, then its row.

  real prefix  the prefix is real KV of real text: request i is chain i's first kv_i tokens
               under chain i's cache salt (a hit on the chain's blocks) plus a fresh tail;
  fake prefix  (warm-up off, or the gate refused the model) the prefix blocks are registered
               and hashed but never computed (kv.prefix.fake_prefix);
  P = 0        no prefix: the regime is not_applicable.

One untimed warm shot of the same shape (other tails) runs first, and the settle shots
(SweepConfig.settle_steps, untimed), then `steady_steps` measured shots, each with fresh
tails; every shot's time is kept and the upper median is the row's. A shot's time is the
forward phase of its step's own span (sweep.timing): from the end of the schedule() that
scheduled that shot to the model output's arrival (the start of its update_from_output),
under either engine loop; under vLLM's batch queue the loop's next
schedule() (empty: the shot's requests are done, others are held) runs inside it, while the
executor works. The row's phases are those spans' (schedule + sweep + forward + update = the
span; its forward median is the row's median with an odd count). The hit is probed before a
shot is queued; after its step the shot is checked: exactly its B requests, N new tokens, a
hit of P tokens, else the point is skipped with the measured_* reason.

A continuation point's shot is two steps: a lead step, untimed, in which each request (a
hit of kv_i - u tokens, u the prefix unit) computes u tokens, its chunk capped at u
(kv.catchup.PrefillChunkCap), then the shot's step, in which the same requests, running now,
compute their new_i tokens on the kv_i tokens their lead step and their hit gave them: the
later chunk of a chunked prompt. The lead step runs the shot alone; under vLLM's batch queue
the step scheduled while it is in flight runs nothing, so the shot's step starts on an idle
executor. Its check: exactly its B requests, running, N new tokens, P computed before.
"""

from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass, field

from ..kv.arithmetic import pool_shortfall
from ..kv.borrowing import ShadowRegistrationError
from ..kv.catchup import cached_tokens
from ..kv.chains import prefix_hasher
from ..kv.fake_kv import salted_sequence
from ..kv.layout import group_layouts
from ..kv.prefix import fake_prefix, new_request_blocks, prefix_unit
from ..kv.request import greedy_request
from ..record import vocabulary as v
from ..record.artifact import PointRow
from .points import PrefillPoint
from .rows import stamp_noise
from .timing import Window, phase_medians

PREFILL_PREFIX = "__kvwarm_prefill_"  # frontend ids never start like this
# Every tail taken (one per request of a shot) starts with tokens of its own, so no two
# tails share a block hash (a block's hash chains its predecessors'), whatever the text after.
_TAKE_NUMBERS = itertools.count(1)


class TailText:
    """take(n): the next n tokens of text the chains never use (the held-out half of the
    dataset; without it, a salted sequence of the take's own, as fake KV's prompts are),
    led by tokens unique to this take."""

    def __init__(self, tokens: list[int], vocab_size: int):
        self._tokens = tokens
        self._vocab = max(vocab_size, 3)
        self._at = 0

    def take(self, n: int) -> list[int]:
        taken = next(_TAKE_NUMBERS)
        lead = [2 + taken % (self._vocab - 2), 2 + (taken // (self._vocab - 2)) % (self._vocab - 2)]
        count = max(0, n - len(lead))
        if self._tokens:
            body = [self._tokens[(self._at + i) % len(self._tokens)] for i in range(count)]
            self._at += count
        else:
            body = salted_sequence(taken, count, self._vocab)
        return (lead + body)[:n]


@dataclass
class Shot:
    requests: list
    timed: bool
    done: bool = False
    led: bool = False  # continuation: its lead step's output is in

    def lead_scheduled(self) -> bool:
        """Whether the shot's first step has been scheduled (vLLM counts the tokens computed then)."""
        return all(r.num_computed_tokens for r in self.requests)


@dataclass
class PrefillShots:
    point: PrefillPoint
    regime: str  # real_prefix | fake_prefix | not_applicable
    prefixes: list[int]  # kv_i
    new: list[int]  # new_i
    prompts: list[list[int]]  # request i's prefix tokens
    salts: list[str | None]  # request i's cache salt (None: a salt of its own)
    steady_steps: int
    trailing: int = 0  # untimed shots after the timed ones (data parallel: sweep.prefill_runner)
    settle: int = 0  # untimed shots after the warm one, before the timed ones (SweepConfig.settle_steps)
    lead: int = 0  # continuation: the tokens each request computes in its shot's lead step
    seeds: list = field(default_factory=list)  # fake prefixes, freed with the point
    shots: list[Shot] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    windows: list[Window] = field(default_factory=list)
    failure: tuple[str, str] | None = None  # (reason, detail): the point is skipped

    @property
    def hits(self) -> list[int]:
        """The prefix each request's lookup finds: kv_i, less its lead step's tokens."""
        return [p - self.lead for p in self.prefixes]

    @property
    def current(self) -> Shot | None:
        return self.shots[-1] if self.shots else None

    @property
    def finished(self) -> bool:
        """Failed, or every shot run: the warm one, the settling, timed and trailing ones."""
        return self.failure is not None or len(self.shots) >= 1 + self.settle + self.steady_steps + self.trailing

    def next_is_timed(self) -> bool:
        """Whether the next shot is a timed one (not the warm, a settling or a trailing one)."""
        return 1 + self.settle <= len(self.shots) < 1 + self.settle + self.steady_steps


def shot_requests(scheduler, shots: PrefillShots, tails: TailText, name: str) -> list:
    """The B requests of the next shot (not added to the scheduler yet)."""
    hasher = prefix_hasher(scheduler)
    requests = []
    for i, (prompt, n, salt) in enumerate(zip(shots.prompts, shots.new, shots.salts)):
        request_id = f"{PREFILL_PREFIX}{name}_{i}"
        requests.append(
            greedy_request(
                request_id, prompt + tails.take(shots.lead + n), 1, cache_salt=salt or request_id, block_hasher=hasher
            )
        )
    return requests


def check_shot(scheduler, shots: PrefillShots, requests: list) -> tuple[str, str] | None:
    """Before a shot is queued: the pool holds its requests' blocks, and each request's
    lookup finds its prefix cached (reason, detail when not)."""
    kvm = scheduler.kv_cache_manager
    layouts = group_layouts(kvm)
    need = sum(new_request_blocks(layouts, h, shots.lead + n) for h, n in zip(shots.hits, shots.new))
    short = pool_shortfall(need, kvm.block_pool.get_num_free_blocks())
    if short:
        return v.PREFILL_INJECTION_FAILED, f"{v.POOL_EXHAUSTED}: {short} more free block(s) needed for the shot"
    hits = [cached_tokens(kvm, r) if h else 0 for r, h in zip(requests, shots.hits)]
    if hits != shots.hits:
        reason = v.REAL_SEED_VALIDATION_FAILED if shots.regime == v.REAL_PREFIX else v.FAKE_PREFIX_VALIDATION_FAILED
        return reason, f"the prefix cache holds {hits} of the prefixes {shots.hits}"
    return None


def prefixes_missing(scheduler, point: PrefillPoint, chains: list) -> bool:
    """Whether a real-prefix point finds any of its hits (chain i's first kv_i tokens, less a
    continuation's lead) no longer cached: then its rung's chains are built again before it
    starts."""
    kvm = scheduler.kv_cache_manager
    hasher = prefix_hasher(scheduler)
    unit = prefix_unit(group_layouts(kvm), kvm.block_pool.hash_block_size)
    for i, (chain, p) in enumerate(zip(chains, point.hits(unit))):
        if not p:
            continue
        # a token past the prefix, as a shot's tail: the lookup may find the whole prefix, no more
        tokens = [*chain.prompt_token_ids[:p], chain.prompt_token_ids[0]]
        probe = greedy_request(
            f"{PREFILL_PREFIX}probe_{i}", tokens, 1, cache_salt=chain.cache_salt, block_hasher=hasher
        )
        if cached_tokens(kvm, probe) != p:
            return True
    return False


def seed_fake_prefixes(scheduler, shots: PrefillShots, name: str) -> None:
    """Fake prefix: register and hash each request's prefix blocks (never computed)."""
    try:
        for i, prompt in enumerate(shots.prompts):
            if prompt:
                seed = fake_prefix(scheduler, f"fakeprefix_{name}_{i}", prompt)
                shots.seeds.append(seed)
                shots.salts[i] = seed.cache_salt
    except ShadowRegistrationError as err:
        shots.failure = (v.FAKE_PREFIX_ALLOCATION_FAILED, str(err))


def free_seeds(scheduler, shots: PrefillShots) -> None:
    for seed in shots.seeds:
        scheduler.kv_cache_manager.free(seed)
    shots.seeds = []


def _computed_before(new_reqs, cached_reqs, ids: set[str]) -> dict[str, int]:
    """Each of `ids` the step scheduled: the tokens computed before it (a new request's hit)."""
    before = {r.req_id: r.num_computed_tokens for r in new_reqs if r.req_id in ids}
    before.update((i, n) for i, n in zip(cached_reqs.req_ids, cached_reqs.num_computed_tokens) if i in ids)
    return before


def verify_step(
    shots: PrefillShots, shot: Shot, scheduled: dict[str, int], new_reqs, cached_reqs, lead_step: bool = False
) -> tuple[str, str] | None:
    """After a shot's step, which scheduled `scheduled` ({request id: tokens}, less what ran
    beside the shot by design) and whose new and running requests' data are `new_reqs` and
    `cached_reqs` (the SchedulerOutput's scheduled_new_reqs, scheduled_cached_reqs): exactly
    the shot's B requests (new ones; a continuation's running ones), N new tokens, P tokens
    computed before (a new request's hit). A continuation's lead step (`lead_step`): its B new
    requests, `lead` tokens each, on their hits."""
    ids = {r.request_id for r in shot.requests}
    new = {r.req_id for r in new_reqs if r.req_id in ids}
    point = shots.point
    running = bool(shots.lead) and not lead_step
    if set(scheduled) != ids or len(new) != (0 if running else point.batch_size):
        foreign = len(set(scheduled) - ids)
        what = f"{len(ids & set(scheduled)) - len(new)} running" if running else f"{len(new)}"
        return v.BATCH_SIZE_MISMATCH, (
            f"{v.BATCH_SIZE_MISMATCH}: the step scheduled {len(scheduled)} request(s), {what} of the point's "
            f"{point.batch_size} {'running' if running else 'new'} ones"
            + (f", {foreign} not the sweep's" if foreign else "")
        )
    if lead_step and any(scheduled[i] != shots.lead for i in ids):
        return v.PREFILL_TOKENS_MISMATCH, (
            f"{v.PREFILL_TOKENS_MISMATCH}: the lead step computed {sorted(scheduled[i] for i in ids)} token(s), "
            f"{shots.lead} each wanted (the engine did not cap the chunk)"
        )
    computed = sum(scheduled[i] for i in ids)
    if not lead_step and computed != point.total_prefill_tokens:
        return v.PREFILL_TOKENS_MISMATCH, (
            f"{v.PREFILL_TOKENS_MISMATCH}: the step computed {computed} new token(s), the point "
            f"{point.total_prefill_tokens} (the engine chunked a request)"
        )
    hit = sum(_computed_before(new_reqs, cached_reqs, ids).values())
    want = sum(shots.hits) if lead_step else point.total_kv_read_tokens
    if hit != want:
        return v.KV_READ_MISMATCH, (
            f"{v.KV_READ_MISMATCH}: the step's requests had {hit} token(s) computed or cached before it, the "
            f"{'lead step' if lead_step else 'point'} {want}"
        )
    return None


def skipped_row(point: PrefillPoint, reason: str, detail: str) -> PointRow:
    """A prefill point's row, skipped with `reason` (also a mixed point's prefill part's)."""
    return PointRow(
        point.total_kv_read_tokens,
        point.batch_size,
        v.skip_regime(reason),
        detail=detail,
        point_type=v.PREFILL,
        total_prefill_tokens=point.total_prefill_tokens,
        continuation=point.continuation,
    )


def prefill_row(shots: PrefillShots) -> PointRow:
    point = shots.point
    if shots.failure is not None:
        return skipped_row(point, *shots.failure)
    stamps = {v.REAL_PREFIX: [v.STAMP_PREFILL_REAL_SEED], v.FAKE_PREFIX: [v.STAMP_PREFILL_FAKE_PREFIX]}
    row = PointRow(
        point.total_kv_read_tokens,
        point.batch_size,
        shots.regime,
        list(stamps.get(shots.regime, [])),
        list(shots.times),
        statistics.median_high(shots.times),
        point_type=v.PREFILL,
        total_prefill_tokens=point.total_prefill_tokens,
        phases=phase_medians(shots.windows),
        sample_kind=v.SHOT_FORWARD,
        split={"prefix_tokens": list(shots.prefixes), "new_tokens": list(shots.new)},
        continuation=point.continuation,
    )
    return stamp_noise(row)
