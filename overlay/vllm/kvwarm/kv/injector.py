"""Admitting a point's shadows into a live scheduler, and taking them out again.

A point is B shadows, shadow i borrowing chain i at context ctx_i. They are admitted
inside a `schedule()` call, after the stock scheduling of the step (the scheduler
adapter calls `admit_pending`), so that:
- their fork retentions are released at once (a deferred release would land in the
  measured steps) and the copies ride this very step's output;
- zero-filled tail blocks are zeroed in this step, before the admission forward writes;
- each shadow first appears as a new request (the worker must see it whole), one token
  short of its context's end: ctx tokens are borrowed, the admission step computes one.
From the next step on the stock running loop schedules them as ordinary decode requests.

A fake-KV point (fake_kv) goes the same way with requests whose blocks are allocated,
not borrowed.

An Admission (one point's requests) is admitted whole or not at all: if any shadow cannot
be registered, the ones already registered are released, their copies dropped, and the
admission records the reason (the artifact skips the point as decode_injection_failed).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .borrowing import ShadowRegistrationError
from .chains import prefix_hasher
from .fake_kv import allocate_fake, fake_request
from .layout import group_layouts
from .request import greedy_request
from .shadows import check_pool, register_shadow, release_fork_retentions

SHADOW_PREFIX = "__kvwarm_shadow_"  # frontend ids never start like this


@dataclass
class Admission:
    """One point's requests as the injector admits them."""

    chains: list | None  # the lending Requests, one per shadow; None for a fake-KV point
    contexts: list[int]
    steady_steps: int  # steady steps after the admission step
    fork: bool | None = None
    state_mode: str | None = None
    vocab_size: int = 0  # fake-KV points: the range of their synthetic tokens
    # exact state (kv/catchup): the rung's chains, whose tokens the shadows' prompts take;
    # `chains` are then catch-ups exactly ctx deep (their own next token is a sampled one)
    prompt_chains: list | None = None
    shadows: list = field(default_factory=list)  # filled on admission
    failure: str | None = None  # the registration error, when the point was refused


def shadow_request(request_id: str, chain, ctx: int, max_tokens: int, block_hasher):
    """A greedy request over the chain's first ctx + 1 tokens that decodes `max_tokens`.
    It carries a block hasher as a frontend request does (so its steps do a natural
    request's hashing work), salted with its own id: its keys never match the chain's,
    and nothing can hit what it caches (kv.shadows.register_shadow says where it does)."""
    return greedy_request(
        request_id, chain.all_token_ids[: ctx + 1], max_tokens, cache_salt=request_id, block_hasher=block_hasher
    )


def prefill_token_ids(scheduler, request) -> list[int] | None:
    """What a new request's NewRequestData carries for the model runner to build its state
    from, as the scheduler itself passes it: the request's `prefill_token_ids` where it has
    that property (the V2 runner is then the only one, and refuses None); else the whole
    token list when the engine runs the V2 runner (`use_v2_model_runner`); else None (the
    V1 runner reads the prompt)."""
    if hasattr(type(request), "prefill_token_ids"):
        return request.prefill_token_ids
    return request._all_token_ids if getattr(scheduler, "use_v2_model_runner", False) else None


class ShadowInjector:
    """Queues admissions and admits them from inside the scheduler's `schedule()`."""

    def __init__(self):
        self._pending: list[Admission] = []
        self._next = 0

    def has_pending(self) -> bool:
        return bool(self._pending)

    def drop_pending(self) -> None:
        """Forget admissions not admitted yet (nothing of theirs is registered before admission)."""
        self._pending = []

    def queue(self, admission: Admission) -> Admission:
        if not admission.contexts or (admission.chains is None and admission.vocab_size < 1):
            raise ValueError("an admission needs contexts, and a vocabulary size when it is fake")
        if admission.chains is not None and len(admission.chains) != len(admission.contexts):
            raise ValueError(
                f"an admission needs one chain per context, got {len(admission.chains)} chain(s) "
                f"for {len(admission.contexts)} context(s)"
            )
        self._pending.append(admission)
        return admission

    def admit_pending(self, scheduler, output) -> None:
        """Register, emit and account every queued admission on this step's output."""
        admissions, self._pending = self._pending, []
        for admission in admissions:
            try:
                self._register_point(scheduler, admission)
            except ShadowRegistrationError as err:
                admission.failure = str(err)
                continue
            self._emit(scheduler, output, admission.shadows)

    def _register_point(self, scheduler, admission: Admission) -> None:
        kvm = scheduler.kv_cache_manager
        if admission.chains is not None:
            check_pool(
                kvm,
                group_layouts(kvm),
                admission.contexts,
                admission.steady_steps,
                admission.state_mode,
                " for the point",
            )
        hasher = prefix_hasher(scheduler) if admission.chains is not None else None
        try:
            for i, ctx in enumerate(admission.contexts):
                request_id = f"{SHADOW_PREFIX}{self._next}"
                self._next += 1
                if admission.chains is None:
                    request = fake_request(
                        request_id, ctx, admission.steady_steps + 1, admission.vocab_size, salt=self._next
                    )
                    admission.shadows.append(request)
                    allocate_fake(kvm, request, ctx)
                    continue
                text = (admission.prompt_chains or admission.chains)[i]
                request = shadow_request(request_id, text, ctx, admission.steady_steps + 1, hasher)
                register_shadow(
                    kvm,
                    request,
                    admission.chains[i],
                    ctx,
                    admission.steady_steps,
                    fork=admission.fork,
                    state_mode=admission.state_mode,
                    room_past_chain=admission.prompt_chains is not None,
                    own_keys=True,
                )
                admission.shadows.append(request)
        except BaseException:
            release_fork_retentions(kvm)  # drop the copies of the shadows registered so far
            for shadow in admission.shadows:
                kvm.free(shadow)
            admission.shadows = []
            raise

    def _emit(self, scheduler, output, shadows) -> None:
        from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput
        from vllm.v1.request import RequestStatus

        kvm = scheduler.kv_cache_manager
        copies = release_fork_retentions(kvm)
        if copies:
            output.kv_cache_block_copies = list(output.kv_cache_block_copies or []) + copies
        zero = kvm.take_new_block_ids()
        if zero and scheduler.needs_kv_cache_zeroing:
            output.new_block_ids_to_zero = list(output.new_block_ids_to_zero or []) + zero
        admitted = SchedulerOutput.make_empty()
        for shadow in shadows:
            shadow.num_computed_tokens = len(shadow.prompt_token_ids) - 1
            shadow.status = RequestStatus.RUNNING
            scheduler.requests[shadow.request_id] = shadow
            # Built before the bookkeeping below advances num_computed_tokens.
            output.scheduled_new_reqs.append(
                NewRequestData.from_request(
                    shadow, kvm.get_block_ids(shadow.request_id), prefill_token_ids(scheduler, shadow)
                )
            )
            admitted.num_scheduled_tokens[shadow.request_id] = 1
            scheduler.running.append(shadow)
        # vLLM's own per-step bookkeeping (num_computed_tokens, in-flight and placeholder
        # counts of the async scheduler), run on the shadows' rows only.
        scheduler._update_after_schedule(admitted)
        output.num_scheduled_tokens.update(admitted.num_scheduled_tokens)
        output.total_num_scheduled_tokens += len(shadows)
        if hasattr(scheduler, "prev_step_scheduled_req_ids"):
            scheduler.prev_step_scheduled_req_ids.update(admitted.num_scheduled_tokens)
