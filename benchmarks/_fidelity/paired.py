"""One engine's paired run (in its engine process): the steps seen around the adapter's own
update_from_output (Steps), and the shadows the Sweep measures taking ABBA turns with natural
requests at the same contexts (PairedRun), each measurement recorded per side (Measured)."""

from __future__ import annotations

import gc
import itertools
import os
import resource
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from _engine import is_steady_step

from .cases import MAX_MODEL_LEN, Settings
from .stats import upper_median

# Unique in the process: vLLM's runner keeps a finished request's align-mode state slot by id
# until a step that runs a forward, so an id used again would start from a stale slot.
NATURAL_IDS = itertools.count()


@dataclass
class Measured:
    """One side's measurements of one point, in the order they ran."""

    walls: list[float] = field(default_factory=list)  # seconds: the upper median of each
    phases: list[dict] = field(default_factory=list)  # seconds: each phase's median
    tokens: list[list[list[int]]] = field(default_factory=list)  # per measurement, per request
    faults: list[float] = field(default_factory=list)  # the median minor page faults of its steps
    preempted: list[float] = field(default_factory=list)  # the median involuntary context switches


class SteadyStep(NamedTuple):
    ids: frozenset  # the requests it ran
    window: object  # the StepTimer's window
    faults: int  # minor page faults of the process since the step before
    preempted: int  # involuntary context switches since the step before


class Steps:
    """Every update_from_output of the engine, seen from around the adapter's own: which
    requests the step ran, the tokens it sampled and the window the adapter's StepTimer closed
    for it, and what the process's resource usage says of it (page faults, preemptions). A
    steady step is one where every scheduled request decodes one token past its prompt. One
    per scheduler (`steps_of`)."""

    def __init__(self, scheduler):
        self.windows: list = []  # the timers' `closed` list: what they append to
        self.steady: list[SteadyStep] = []
        self.usage = _usage()
        self.new_prompts: dict[str, list[int]] = {}
        self.sampled: dict[str, list[int]] = {}
        update = scheduler.update_from_output

        def seen(output, runner_output):
            scheduled, steady = output.num_scheduled_tokens, is_steady_step(scheduler, output)
            for new in output.scheduled_new_reqs:
                self.new_prompts[new.req_id] = list(new.prompt_token_ids or [])
            before = len(self.windows)
            result = update(output, runner_output)
            # in batch order on every release (the newest have no req_id_to_index to look them up by)
            for rid, sampled in zip(runner_output.req_ids, runner_output.sampled_token_ids, strict=True):
                self.sampled.setdefault(rid, []).extend(sampled)
            usage, self.usage = self.usage, _usage()
            if steady and len(self.windows) > before:
                faults, preempted = (now - then for now, then in zip(self.usage, usage))
                self.steady.append(SteadyStep(frozenset(scheduled), self.windows[-1], faults, preempted))
            self.windows.clear()
            return result

        scheduler.update_from_output = seen  # the engine core calls it through the instance

    def take(self) -> list[SteadyStep]:
        steady, self.steady = self.steady, []
        return steady

    def tokens(self, ids: list[str], where: str) -> list[list[int]]:
        """The tokens each of `ids` sampled; a request that sampled none stops the benchmark
        (its fidelity would read 0/0 and look like agreement)."""
        tokens = [self.sampled.get(r, []) for r in ids]
        if not all(tokens):
            silent = [r for r, t in zip(ids, tokens) if not t]
            sys.exit(f"{where}: no sampled token seen for {', '.join(silent)} (the model runner's output was not read)")
        return tokens

    def forget(self) -> None:
        """Drop what was seen of other requests (chains, catch-ups)."""
        self.new_prompts.clear()
        self.sampled.clear()


def _usage() -> tuple[int, int]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_minflt, usage.ru_nivcsw


def steps_of(scheduler) -> Steps:
    if not hasattr(scheduler, "_fidelity_steps"):
        scheduler._fidelity_steps = Steps(scheduler)
    return scheduler._fidelity_steps


class PairedRun:
    """One engine's ladder for one state mode: the Sweep measures the shadows (every point
    queued 1 + PAIRS times in a row); between its points the sweep is set aside (no hook runs,
    its chains stay parked) and the natural requests of the same point run."""

    def __init__(self, core, text, settings: Settings, mode: str | None, lending: str | None):
        from vllm.kvwarm.sweep.provenance import trailing_steps
        from vllm.kvwarm.sweep.timing import StepTimer

        self.core, self.scheduler, self.text = core, core.scheduler, text
        self.settings, self.mode, self.lending = settings, mode, lending
        # Under the batch queue each side runs one untimed step after its timed ones (the
        # window of the last timed step holds the next step's schedule(): the sweep's rule)
        self.trailing = trailing_steps(core.vllm_config)
        self.steps = steps_of(self.scheduler)
        self.natural_timer = StepTimer(time.perf_counter, closed=self.steps.windows)
        self.results: dict[tuple[int, int], dict] = {}
        self.rows: list = []  # rows the sweep finished, not yet taken

    def run(self, points) -> list[dict]:
        from vllm.kvwarm.sweep.controller import Sweep
        from vllm.kvwarm.sweep.plan import SweepConfig

        config = SweepConfig(
            steady_steps=self.settings.steps,
            max_model_len=MAX_MODEL_LEN,
            state_mode=self.mode,
            state_lending=self.lending,
            gc_hold=self.settings.gc_hold,
            trailing_steps=self.trailing,
        )
        sequence = [p for p in points for _ in range(1 + self.settings.pairs)]
        sweep = Sweep(sequence, self.text, config, progress=lambda m: None, on_row=self.rows.append)
        sweep.timer.closed = self.steps.windows
        scheduler = self.scheduler
        scheduler.kvwarm_sweep = sweep
        while True:
            naturals = [job for row in self.rows for job in self._shadows_measured(row)]
            self.rows.clear()
            if naturals:
                scheduler.kvwarm_sweep = None
                self._drain()
                for point, warm_up in naturals:
                    self._natural(point, warm_up)
                scheduler.kvwarm_sweep = sweep
            if not scheduler.has_requests() and not self.core.batch_queue:
                break
            self.core.step_fn()
        scheduler.kvwarm_sweep = None
        if not sweep.reset_prefix_cache_ok:
            sys.exit(f"mode {self.mode}: the sweep's leak check (reset_prefix_cache) failed")
        return [self.results[(p.batch_size, p.total_kv_read_tokens)] for p in points]

    def _drain(self) -> None:
        """Take in every step still in flight (vLLM's batch queue: the step the engine scheduled
        before the last update, empty once a point's requests are done), so that no update of
        one side's step reaches the other side's timer. Nothing to do one step at a time."""
        while self.scheduler.has_requests() or self.core.batch_queue:
            self.core.step_fn()

    def _result(self, point) -> dict:
        key = (point.batch_size, point.total_kv_read_tokens)
        if key not in self.results:
            self.results[key] = {
                "mode": self.mode,
                "batch": point.batch_size,
                "k": point.total_kv_read_tokens,
                "contexts": point.contexts(),
                "shadow": Measured(),
                "natural": Measured(),
                "order": [],
                "load": [os.getloadavg()[0]],
                "warm_up": {},
            }
        return self.results[key]

    def _shadows_measured(self, row) -> list[tuple[object, bool]]:
        """The sweep measured a point once more: keep its timed steps (checked against its
        row); return the natural measurements to run now."""
        from vllm.kvwarm.kv.injector import SHADOW_PREFIX
        from vllm.kvwarm.sweep.points import DecodePoint

        point = DecodePoint(row.total_kv_read_tokens, row.batch_size)
        where = f"{self.mode or 'attention'} K={point.total_kv_read_tokens} B={point.batch_size}"
        if row.kv_seed_regime != "real_kv":
            sys.exit(f"{where}: {row.kv_seed_regime} {row.detail}")
        steady = [s for s in self.steps.take() if all(r.startswith(SHADOW_PREFIX) for r in s.ids)]
        steady, trailing = steady[: len(steady) - self.trailing], steady[len(steady) - self.trailing :]
        if [s.window.wall for s in steady] != row.samples or len({s.ids for s in steady + trailing}) != 1:
            sys.exit(f"{where}: the shadows' steady steps seen here are not the row's {row.samples}")
        ids = sorted(steady[0].ids, key=lambda r: int(r[len(SHADOW_PREFIX) :]))
        prompts = [self.steps.new_prompts.get(r) for r in ids]
        if prompts != [self.text(i, c) for i, c in enumerate(point.contexts())]:
            sys.exit(f"{where}: the shadows' prompts are not chain i's first c_i tokens")
        tokens = self.steps.tokens(ids, where)
        self.steps.forget()
        result = self._result(point)
        done = result["order"].count("S")
        if "shadow" not in result["warm_up"]:  # the first after the build: not counted
            result["warm_up"]["shadow"] = row.samples
            return [(point, True)]  # the naturals' warm-up prefills them
        _record(result["shadow"], steady, tokens)
        result["order"].append("S")
        last = done + 1 == self.settings.pairs
        if last:
            result["load"].append(os.getloadavg()[0])
        if done % 2:  # ABBA: an odd pair's natural ran before its shadow
            return []
        return [(point, False)] if last else [(point, False), (point, False)]  # this pair's, the next's

    def _natural(self, point, warm_up: bool) -> None:
        """B requests over chain i's first c_i tokens, under a salt of their own (so they compute
        their KV themselves), decode 1 + STEPS tokens. The warm-up prefills them first (one
        token each), so every counted measurement hits its own cached blocks and starts with one
        step over the prompt's uncached tail, as a shadow starts with its admission step."""
        from vllm.kvwarm.kv.chains import prefix_hasher
        from vllm.kvwarm.kv.request import greedy_request

        scheduler, result = self.scheduler, self._result(point)
        prompts = [self.text(i, c) for i, c in enumerate(point.contexts())]
        salt = f"natural-{self.mode}-{point.batch_size}-{point.total_kv_read_tokens}"
        if self.settings.natural_blocks == "fresh":  # computed anew, in whatever blocks are free
            salt += f"-{next(NATURAL_IDS)}"
            warm_up = True
        scheduler.kvwarm_timer = self.natural_timer
        decoded = 1 + self.settings.steps + self.trailing  # as many as a shadow
        for max_tokens in (1, decoded) if warm_up else (decoded,):
            ids = []
            for i, prompt in enumerate(prompts):
                ids.append(f"natural_{next(NATURAL_IDS)}")
                hasher = prefix_hasher(scheduler)
                scheduler.add_request(
                    greedy_request(ids[-1], prompt, max_tokens, cache_salt=f"{salt}-{i}", block_hasher=hasher)
                )
            enabled, hold = gc.isenabled(), self.settings.gc_hold
            if hold:
                gc.disable()  # as the sweep holds it for its points (sweep.gc_hold)
            self.steps.take()
            self._drain()
            if hold:
                gc.collect()
                if enabled:
                    gc.enable()
        scheduler.kvwarm_timer = None
        steady = self.steps.take()
        where = f"{self.mode or 'attention'} K={point.total_kv_read_tokens} B={point.batch_size}"
        tokens = self.steps.tokens(ids, where)
        self.steps.forget()
        expected = self.settings.steps + self.trailing
        if len(steady) != expected or any(s.ids != frozenset(ids) for s in steady):
            sys.exit(f"{where}: the natural side ran {len(steady)} steady step(s) of its requests, not {expected}")
        steady = steady[: self.settings.steps]  # the timed ones: as the shadows', the trailing step left out
        if warm_up and "natural" not in result["warm_up"]:
            result["warm_up"]["natural"] = [s.window.wall for s in steady]
            return
        _record(result["natural"], steady, tokens)
        result["order"].append("N")


def _record(side: Measured, steady: list[SteadyStep], tokens) -> None:
    from vllm.kvwarm.sweep.timing import phase_medians

    windows = [s.window for s in steady]
    side.walls.append(upper_median([w.wall for w in windows]))
    side.phases.append(phase_medians(windows))
    side.tokens.append(tokens)
    side.faults.append(statistics.median(s.faults for s in steady))
    side.preempted.append(statistics.median(s.preempted for s in steady))
