"""Step-time fidelity of shadows, paired: per point, B shadow requests (borrowed real KV, timed
by the real Sweep through the KvWarmScheduler adapter) and B natural requests decoding at the
same contexts (each prefilled chain[:c] itself, c its context) take turns many times in ONE
engine, timed by one clock and split into the same phases (vllm.kvwarm.sweep.timing).

Runs inside a release's engine venv (`nox -s bench-S -- step_fidelity`). Each model runs in
an engine process of its own (this script, `--case NAME`), started by the main process,
which prints the tables and the JSON result:

- dense (a small Llama) and MoE (a small Qwen3-MoE, expert parallel): B in {1, 4, 16} over a
  context ladder; the headline figures;
- hybrids in copy and exact state hand-off against natural requests (in place asked for
  is refused where the build can fork, and the refusal printed with its reason): the
  Qwen3-Next variant of issue 22 (full attention in layers 0 and 3, linear in 1 and 2,
  hidden 64, 8 experts top-2) and the project's own tiny Qwen3-Next, each in several
  separate engine processes (a run-level mode shows only across processes).

Per point, one untimed warm-up of each side, then PAIRS pairs in ABBA order (shadow, natural,
natural, shadow, ...: a linear drift cancels within two pairs). A measurement is one point's
admission plus STEPS steady steps of its B requests; its figure is the upper median of those
steps (the sweep's row median), per phase the median. Per point:

  ratio  the median over pairs of shadow/natural, with a 95% percentile-bootstrap interval
         (resampling pairs);
  A/A    the same statistic within one side, each measurement against the one two later
         (2 over 0, 3 over 1, 6 over 4, ...: both ran after the same side), for each side:
         the noise a ratio of 1 carries;
  after other/own  a side's measurements run right after the other side's over those run
         right after its own: what the state one side leaves costs the next (ABBA cancels it
         from the ratio; an A/A of even against odd measurements would measure it instead);
  faults, preempted  per steady step, the process's minor page faults and involuntary
         context switches (getrusage), the median over measurements.

What is controlled, and why (docs/measurements.md, "Paired step fidelity"): the natural side
holds the collector as the sweep does; both sides reuse their own cached blocks from one
measurement to the next (a natural request hits its own earlier prefill, a shadow its parked
chain), so no measurement gets other physical blocks than the one before; the first
measurement after a build or a new point is the warm-up, not counted; the load average is
recorded with each point. `--variance` changes one thing at a time (fresh blocks, the
collector free, an unpinned process, the engine's other threads isolated from its CPU, glibc
without its trim, tcmalloc, the KV cache on huge pages).

`--quick` (or KVWARM_BENCH_QUICK=1): the dense model alone, two points, four pairs (the fewest
that give an A/A). `--pairs N` for more pairs: on a host whose speed drifts, a point's interval
narrows only as 1/sqrt(N) (docs/measurements.md, "What the variance is").
The last line is the JSON result.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import math
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

from _engine import release_label  # importing it sets the engine's environment
from kvwarm_testing import tiny_models

from kvwarm_build.sessions import quick_mode

NEEDS_ENGINE = True  # noxfile: run in the release's CPU engine venv

HERE = Path(__file__).resolve()
MAX_MODEL_LEN, BLOCK, BATCHED_TOKENS = 2048, 32, 2048
PHASES = ("schedule", "forward", "update", "sweep", "other")
TOLERANCE = 0.02  # every interval within 1 +- 2 %, A/A within 2 %
BOOTSTRAP = 2000
# Unique in the process: vLLM's runner keeps a finished request's align-mode state slot by id
# until a step that runs a forward, so an id used again would start from a stale slot.
NATURAL_IDS = itertools.count()


@dataclass(frozen=True)
class Settings:
    pairs: int  # counted shadow/natural pairs per point
    steps: int  # steady steps per measurement
    batches: tuple[int, ...]
    contexts: tuple[int, ...]  # per-request contexts of the attention-only ladders
    hybrid_points: tuple[tuple[int, int], ...]  # (K, B) of the hybrid ladders
    runs: dict[str, int]  # engine processes per case
    # What the variance study turns off or on (the defaults are the controlled benchmark):
    natural_blocks: str = "own"  # own: a natural measurement hits its earlier blocks; fresh: new ones
    gc_hold: bool = True  # the collector held out of both sides' measurements
    pin: bool = True  # the engine process pinned to one CPU
    isolate: bool = False  # with pin: the engine's other threads (gloo's loops, ...) on the other CPUs
    modes: tuple[str, ...] | None = None  # the hybrids' state modes (default: every one)
    flush_denormal: bool = False  # torch.set_flush_denormal: subnormal floats read as zero
    allocator: str = "glibc"  # the engine process's malloc: a key of ALLOCATORS

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Settings:
        data = json.loads(text)
        data["hybrid_points"] = tuple(tuple(p) for p in data["hybrid_points"])
        for key in ("batches", "contexts", "modes"):
            data[key] = tuple(data[key]) if data[key] is not None else None
        return cls(**data)


FULL = Settings(
    pairs=12,
    steps=8,
    batches=(1, 4, 16),
    contexts=(256, 1024, 2000),
    hybrid_points=((2800, 2), (1400, 2), (2800, 4), (1400, 4)),
    runs={"dense": 1, "moe": 1, "hybrid-variant": 6, "hybrid-tiny": 3},
)
QUICK = Settings(
    pairs=4,
    steps=4,
    batches=(1, 4),
    contexts=(512,),
    hybrid_points=((1400, 2),),  # with --only (the quick mode runs the dense model alone)
    runs={"dense": 1},
)
# The variance study (--variance): the dense model at two points, each source of
# measurement-to-measurement variance let loose in turn.
VARIANCE = replace(FULL, batches=(1, 16), contexts=(1024,), runs={"dense": 1})
VARIANTS = {
    "controlled": {},
    "fresh blocks": {"natural_blocks": "fresh"},
    "collector free": {"gc_hold": False},
    "unpinned": {"pin": False},
    "isolated": {"isolate": True},
    "glibc, no trim": {"allocator": "glibc-no-trim"},
    "tcmalloc": {"allocator": "tcmalloc"},
    "huge pages": {"allocator": "thp"},
}
# The engine process's malloc, set in its environment before it starts. glibc's default
# gives memory above its trim threshold back to the kernel and serves large blocks by mmap:
# the next step that needs them faults their pages in again (and the kernel zeroes them).
# vLLM's own CPU launcher preloads tcmalloc where it finds it; an in-process engine, as here
# and in every test, runs on whatever the interpreter started with.
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")  # Debian's libtcmalloc-minimal4
ALLOCATORS = {
    "glibc": {},
    "glibc-no-trim": {"MALLOC_TRIM_THRESHOLD_": str(1 << 40), "MALLOC_MMAP_THRESHOLD_": str(32 << 20)},
    "tcmalloc": {"LD_PRELOAD": str(TCMALLOC)},
    # torch's CPU allocator asks for transparent huge pages (madvise) for large blocks: the KV
    # cache; with the kernel's THP in `madvise` mode, nothing else gets them.
    "thp": {"THP_MEM_ALLOC_ENABLE": "1"},
}


@dataclass(frozen=True)
class Case:
    title: str
    maker: str  # a kvwarm_testing.tiny_models maker
    engine: dict
    modes: tuple[str | None, ...] = (None,)  # state hand-off modes (hybrids)

    def hybrid(self) -> bool:
        return self.modes != (None,)


_COMMON = {"seed": 0, "enforce_eager": True, "max_model_len": MAX_MODEL_LEN, "enable_prefix_caching": True}
_HYBRID = {
    **_COMMON,
    "dtype": "bfloat16",
    "mamba_ssm_cache_dtype": "float32",
    "mamba_cache_mode": "align",
    "enable_expert_parallel": True,
    "max_num_batched_tokens": BATCHED_TOKENS,
    "max_num_seqs": 16,
}
CASES = {
    "dense": Case(
        "small Llama (dense: hidden 512, 2 layers, fp32)",
        "make_small_llama",
        {**_COMMON, "dtype": "float32", "block_size": BLOCK, "max_num_batched_tokens": BATCHED_TOKENS},
    ),
    "moe": Case(
        "small Qwen3-MoE (hidden 512, 2 layers, 8 experts top-2, fp32, expert parallel)",
        "make_small_qwen3_moe",
        {
            **_COMMON,
            "dtype": "float32",
            "block_size": BLOCK,
            "max_num_batched_tokens": BATCHED_TOKENS,
            "enable_expert_parallel": True,
        },
    ),
    "hybrid-variant": Case(
        "Qwen3-Next variant (attention 0 and 3, linear 1 and 2, hidden 64, 8 experts top-2, bf16, EP)",
        "make_qwen3_next_variant",
        _HYBRID,
        ("copy", "inplace", "exact"),
    ),
    "hybrid-tiny": Case(
        "tiny Qwen3-Next (3 linear + 1 attention layer, 4 experts top-2, bf16, EP)",
        "make_tiny_qwen3_next",
        _HYBRID,
        ("copy", "inplace", "exact"),
    ),
}


# --- statistics (the main process) ---------------------------------------------------------


NOT_MEASURED = (math.nan, math.nan, math.nan)


def upper_median(values: list[float]) -> float:
    return statistics.median_high(values)


def paired_ratio(a: list[float], b: list[float], seed: int = 0) -> tuple[float, float, float]:
    """The median of a[j] / b[j] over pairs j, and its 95% percentile-bootstrap interval."""
    ratios = [x / y for x, y in zip(a, b)]
    rng = random.Random(seed)
    boots = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(BOOTSTRAP))
    return statistics.median(ratios), boots[int(0.025 * BOOTSTRAP)], boots[int(0.975 * BOOTSTRAP) - 1]


def a_a(values: list[float]) -> tuple[float, float, float]:
    """One side against itself, each measurement against the one two later (2 over 0, 3 over
    1, 6 over 4, 7 over 5, ...): ABBA runs a side's measurements alternately after one of its
    own and after one of the other side's, and two apart they ran after the same."""
    first = [j for j in range(len(values) - 2) if j % 4 < 2]
    if not first:  # fewer than three measurements (the quick mode)
        return NOT_MEASURED
    return paired_ratio([values[j + 2] for j in first], [values[j] for j in first])


def carry_over(point: dict, side: str) -> tuple[float, float, float]:
    """A side's measurements that ran right after the other side's over those right after
    its own (the k-th against the k-th): what the state the other side leaves costs."""
    letter = side[0].upper()  # `order` holds S and N
    after: dict[bool, list[float]] = {True: [], False: []}
    positions = [i for i, x in enumerate(point["order"]) if x == letter]
    for wall, i in zip(point[side]["walls"], positions):
        if i:
            after[point["order"][i - 1] == letter].append(wall)
    n = min(len(after[True]), len(after[False]))
    return paired_ratio(after[False][:n], after[True][:n]) if n else NOT_MEASURED


# --- one engine process: the case ----------------------------------------------------------


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
            requests, scheduled = scheduler.requests, output.num_scheduled_tokens
            steady = (
                bool(scheduled)
                and not output.scheduled_new_reqs
                and set(scheduled.values()) == {1}
                and all(requests[r].num_computed_tokens > requests[r].num_prompt_tokens for r in scheduled)
            )
            for new in output.scheduled_new_reqs:
                self.new_prompts[new.req_id] = list(new.prompt_token_ids or [])
            before = len(self.windows)
            result = update(output, runner_output)
            for rid, index in (getattr(runner_output, "req_id_to_index", None) or {}).items():
                self.sampled.setdefault(rid, []).extend(runner_output.sampled_token_ids[index])
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
        from vllm.kvwarm.sweep.timing import StepTimer

        self.core, self.scheduler, self.text = core, core.scheduler, text
        self.settings, self.mode, self.lending = settings, mode, lending
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
                for point, warm_up in naturals:
                    self._natural(point, warm_up)
                scheduler.kvwarm_sweep = sweep
            if not scheduler.has_requests():
                break
            self.core.step_fn()
        scheduler.kvwarm_sweep = None
        if not sweep.reset_prefix_cache_ok:
            sys.exit(f"mode {self.mode}: the sweep's leak check (reset_prefix_cache) failed")
        return [self.results[(p.batch_size, p.total_kv_read_tokens)] for p in points]

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
        if [s.window.wall for s in steady] != row.steady_seconds or len({s.ids for s in steady}) != 1:
            sys.exit(f"{where}: the shadows' steady steps seen here are not the row's {row.steady_seconds}")
        ids = sorted(steady[0].ids, key=lambda r: int(r[len(SHADOW_PREFIX) :]))
        prompts = [self.steps.new_prompts.get(r) for r in ids]
        if prompts != [self.text(i, c) for i, c in enumerate(point.contexts())]:
            sys.exit(f"{where}: the shadows' prompts are not chain i's first c_i tokens")
        tokens = [self.steps.sampled.get(r, []) for r in ids]
        self.steps.forget()
        result = self._result(point)
        done = result["order"].count("S")
        if "shadow" not in result["warm_up"]:  # the first after the build: not counted
            result["warm_up"]["shadow"] = row.steady_seconds
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
        for max_tokens in (1, 1 + self.settings.steps) if warm_up else (1 + self.settings.steps,):
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
            while scheduler.has_requests():
                self.core.step_fn()
            if hold:
                gc.collect()
                if enabled:
                    gc.enable()
        scheduler.kvwarm_timer = None
        steady = self.steps.take()
        tokens = [self.steps.sampled.get(r, []) for r in ids]
        self.steps.forget()
        where = f"{self.mode or 'attention'} K={point.total_kv_read_tokens} B={point.batch_size}"
        if len(steady) != self.settings.steps or any(s.ids != frozenset(ids) for s in steady):
            sys.exit(
                f"{where}: the natural side ran {len(steady)} steady step(s) of its requests, not {self.settings.steps}"
            )
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


def ladder(case: Case, settings: Settings):
    from vllm.kvwarm.sweep.points import DecodePoint

    if case.hybrid():
        return [DecodePoint(k, b) for k, b in settings.hybrid_points]
    # deepest first within a batch, the largest batch first: the order the sweep measures in
    return [
        DecodePoint(b * c, b)
        for b in sorted(settings.batches, reverse=True)
        for c in sorted(settings.contexts, reverse=True)
    ]


def isolate_this_thread() -> None:
    """Leave this thread's CPU to it: every other thread of the process (vLLM's gloo groups
    start several loop threads, each waking about 100 times a second) goes to the other CPUs."""
    here, main = os.sched_getaffinity(0), threading.get_native_id()
    others = set(range(os.cpu_count() or 1)) - here
    if not others:
        sys.exit("--isolate needs a CPU besides the measuring one")
    for tid in (int(t) for t in os.listdir("/proc/self/task")):
        if tid != main:
            with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
                os.sched_setaffinity(tid, others)


def run_case(name: str, out: Path, settings: Settings) -> None:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.kvwarm.kv.layout import group_layouts
    from vllm.kvwarm.kv.state_mode import STATE_ENV, decide_state_mode
    from vllm.kvwarm.sweep.dataset import ChainText, load_dataset
    from vllm.v1.engine.llm_engine import LLMEngine

    case = CASES[name]
    if settings.flush_denormal:
        import torch

        torch.set_flush_denormal(True)
    if settings.pin:  # every thread of the engine (one OpenMP thread: the caller's) on one CPU
        os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
    with tempfile.TemporaryDirectory() as tmp:
        model = getattr(tiny_models, case.maker)(Path(tmp) / name)
        conversations, _ = load_dataset(tiny_models.write_sharegpt(Path(tmp) / "sharegpt.json"))
        started = time.perf_counter()
        engine = LLMEngine.from_engine_args(
            EngineArgs(model=str(model), scheduler_cls="vllm.kvwarm.scheduler.KvWarmScheduler", **case.engine)
        )
        start_seconds = time.perf_counter() - started
        if settings.pin and settings.isolate:
            isolate_this_thread()
        core = engine.engine_core.engine_core
        tokenizer = engine.get_tokenizer()
        text = ChainText(conversations, lambda s: tokenizer.encode(s, add_special_tokens=False))
        kvm = core.scheduler.kv_cache_manager
        points = ladder(case, settings)
        results = []
        for mode in settings.modes or case.modes if case.hybrid() else case.modes:
            lending = None
            if mode is not None:
                decision = decide_state_mode(kvm, group_layouts(kvm), {STATE_ENV: mode})
                if decision.mode != mode:
                    results.append({"mode": mode, "refused": decision.reason})
                    continue
                lending = decision.lending
            results += PairedRun(core, text, settings, mode, lending).run(points)
            if not core.scheduler.reset_prefix_cache():
                sys.exit(f"reset_prefix_cache() failed after mode {mode}: blocks still in use")
        huge_pages = _huge_pages_kib()
    for r in results:
        for side in ("shadow", "natural"):
            if side in r:
                r[side] = r[side].__dict__
    out.write_text(
        json.dumps(
            {"case": name, "engine_start_seconds": start_seconds, "huge_pages_kib": huge_pages, "points": results}
        )
    )


def _huge_pages_kib() -> int:
    """How much of this process's memory transparent huge pages back (the KV cache, if any)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    return 0


# --- the main process ----------------------------------------------------------------------


def uptime() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f}, {five:.2f}, {fifteen:.2f}"


def run_engine(name: str, run: int, tmp: Path, settings: Settings, in_process: bool = False) -> dict:
    """One engine's measurements: in a process of its own (two engines cannot share one), or
    in this one where it is the only engine (the quick mode: one vLLM import less)."""
    out = tmp / f"{name}-{run}.json"
    started = time.perf_counter()
    if in_process:
        if settings.allocator != "glibc":
            sys.exit(f"the {settings.allocator} allocator needs an engine process of its own")
        run_case(name, out, settings)
    else:
        args = [sys.executable, str(HERE), "--case", name, "--out", str(out), "--settings", settings.to_json()]
        env = {**os.environ, **ALLOCATORS[settings.allocator]}
        done = subprocess.run(args, capture_output=True, text=True, check=False, env=env)
        if done.returncode != 0:
            sys.exit(f"the {name} engine (run {run}) failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    result = json.loads(out.read_text())
    result["run"], result["wall_seconds"] = run, time.perf_counter() - started
    print(
        f"  {name} run {run}: {result['wall_seconds']:.0f} s (engine start {result['engine_start_seconds']:.0f} s; "
        f"{result['huge_pages_kib'] >> 10} MiB on huge pages); {uptime()}",
        flush=True,
    )
    return result


def spread(values: list[float]) -> float:
    """The median absolute deviation over the median: one side's measurement-to-measurement noise."""
    m = statistics.median(values)
    return statistics.median(abs(v - m) for v in values) / m


def point_figures(p: dict) -> dict:
    s, n = p["shadow"]["walls"], p["natural"]["walls"]
    return {
        "ratio": paired_ratio(s, n),
        "aa_shadow": a_a(s),
        "aa_natural": a_a(n),
        "carry_over": {side: carry_over(p, side) for side in ("shadow", "natural")},
        "spread": {"shadow": spread(s), "natural": spread(n)},
        # per step, the median over measurements
        "faults": {side: statistics.median(p[side]["faults"]) for side in ("shadow", "natural")},
        "preempted": {side: statistics.median(p[side]["preempted"]) for side in ("shadow", "natural")},
        "shadow_ms": 1e3 * statistics.median(s),
        "natural_ms": 1e3 * statistics.median(n),
        "phases": {
            side: {ph: 1e3 * statistics.median(m[ph] for m in p[side]["phases"]) for ph in PHASES}
            for side in ("shadow", "natural")
        },
        "schedule_ratio": paired_ratio(
            [m["schedule"] for m in p["shadow"]["phases"]], [m["schedule"] for m in p["natural"]["phases"]]
        ),
        "tokens_match": _tokens_match(p),
        # the first measurement after the build (or the point's first): against the counted median
        "warm_up": {
            side: upper_median(p["warm_up"][side]) / statistics.median(p[side]["walls"]) for side in p["warm_up"]
        },
    }


def _tokens_match(p: dict) -> str:
    """How many of the shadows' sampled tokens equal the natural requests' (first measurements)."""
    shadow, natural = p["shadow"]["tokens"][0], p["natural"]["tokens"][0]
    same = sum(a == b for s, t in zip(shadow, natural) for a, b in zip(s, t))
    return f"{same}/{sum(len(t) for t in natural)}"


def interval(f) -> str:
    return f"{f[0]:.3f} [{f[1]:.3f}, {f[2]:.3f}]"


def holds_one(f) -> bool:
    """A (median, low, high) interval that contains 1."""
    return f[1] <= 1 <= f[2]


def within(f) -> bool:
    return 1 - TOLERANCE <= f[1] and f[2] <= 1 + TOLERANCE


def print_attention_case(result: dict) -> list[dict]:
    rows = []
    print(
        f"{'B':>3} {'K':>6}  {'shadow ms':>9} {'natural ms':>10}  {'shadow/natural [95%]':>22}  "
        f"{'A/A shadow':>22}  {'A/A natural':>22}  {'spread S|N':>11}  faults S|N  load"
    )
    for p in result["points"]:
        f = point_figures(p)
        rows.append({**f, "batch": p["batch"], "k": p["k"]})
        print(
            f"{p['batch']:>3} {p['k']:>6}  {f['shadow_ms']:>9.3f} {f['natural_ms']:>10.3f}  "
            f"{interval(f['ratio']):>22}  "
            f"{interval(f['aa_shadow']):>22}  {interval(f['aa_natural']):>22}  "
            f"{100 * f['spread']['shadow']:>4.1f}|{100 * f['spread']['natural']:<4.1f}%  "
            f"{f['faults']['shadow']:>4.0f}|{f['faults']['natural']:<4.0f}  " + "-".join(f"{x:.1f}" for x in p["load"])
        )
    print("  phases, ms (per measurement the median of its steps; the median over measurements): shadow | natural")
    print(f"  {'B':>3} {'K':>6}  " + "  ".join(f"{ph:>15}" for ph in PHASES) + "   schedule S/N [95%]")
    for p, f in zip(result["points"], rows):
        cells = "  ".join(f"{f['phases']['shadow'][ph]:>6.3f} | {f['phases']['natural'][ph]:<6.3f}" for ph in PHASES)
        print(f"  {p['batch']:>3} {p['k']:>6}  {cells}   {interval(f['schedule_ratio'])}")
    return rows


def print_hybrid_case(runs: list[dict]) -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
    """Every run's rows, then per mode how many rows agree with natural decoding and at how
    many the schedule() S/N interval holds 1; and the modes this build refuses, with why."""
    print(
        f"{'run':>3} {'mode':>7} {'B':>2} {'K':>5}  {'shadow ms':>9} {'natural ms':>10}  "
        f"{'shadow/natural [95%]':>22}  {'A/A natural':>22}  tokens  forward ms S|N   schedule S/N [95%]"
    )
    agree: dict[str, list[bool]] = {}
    schedule_at_1: dict[str, list[bool]] = {}
    by_run: dict[tuple[int, str], list[float]] = {}
    refused: dict[str, str] = {}
    for result in runs:
        for p in result["points"]:
            if "refused" in p:
                print(f"{result['run']:>3} {p['mode']:>7}  refused: {p['refused']}")
                refused[p["mode"]] = p["refused"]
                continue
            f = point_figures(p)
            ok = holds_one(f["ratio"]) or within(f["ratio"])
            agree.setdefault(p["mode"], []).append(ok)
            schedule_at_1.setdefault(p["mode"], []).append(holds_one(f["schedule_ratio"]))
            by_run.setdefault((result["run"], p["mode"]), []).append(f["shadow_ms"])
            print(
                f"{result['run']:>3} {p['mode']:>7} {p['batch']:>2} {p['k']:>5}  {f['shadow_ms']:>9.3f} "
                f"{f['natural_ms']:>10.3f}  {interval(f['ratio']):>22}  {interval(f['aa_natural']):>22}  "
                f"{f['tokens_match']:>6}  "
                f"{f['phases']['shadow']['forward']:.3f}|{f['phases']['natural']['forward']:.3f}  "
                f"{interval(f['schedule_ratio'])}"
            )
    for result in runs:
        copy = by_run.get((result["run"], "copy"))
        line = ", ".join(
            f"{mode}/copy {statistics.median(a / b for a, b in zip(by_run[(result['run'], mode)], copy)):.3f}"
            for mode in ("inplace", "exact")
            if copy and (result["run"], mode) in by_run
        )
        if line:
            print(f"  run {result['run']}: shadow step medians, point by point, {line}")
    summary = {mode: f"{sum(oks)}/{len(oks)}" for mode, oks in agree.items()}
    schedule = {mode: f"{sum(oks)}/{len(oks)}" for mode, oks in schedule_at_1.items()}
    print(
        "  rows agreeing with natural decoding (interval holds 1, or lies within 1 +- "
        f"{100 * TOLERANCE:g}%): " + ", ".join(f"{m} {v}" for m, v in summary.items())
    )
    print("  schedule() S/N interval holds 1: " + ", ".join(f"{m} {v}" for m, v in schedule.items()))
    return summary, schedule, refused


def variance_study(release: str, tmp: Path, variants: list[str], runs: int) -> None:
    """The dense model under each of `variants` (VARIANTS' names), `runs` engines each."""
    print(f"variance study, vLLM {release}: dense model, {VARIANCE.pairs} pairs per point; {uptime()}", flush=True)
    results = {}
    for name in variants:
        changes = VARIANTS[name]
        if changes.get("allocator") == "tcmalloc" and not TCMALLOC.exists():
            print(f"  {name}: left out, no {TCMALLOC} (Debian's libtcmalloc-minimal4)", flush=True)
            continue
        for run in range(1, runs + 1):
            label = name if runs == 1 else f"{name} #{run}"
            results[label] = run_engine("dense", run, tmp, replace(VARIANCE, **changes))
    print(
        f"\n{'variant':>15} {'B':>2} {'K':>6} {'ms S|N':>13}  {'spread S|N':>11}  {'A/A shadow':>22}  "
        f"{'A/A natural':>22}  {'after other/own, N':>22}  {'shadow/natural [95%]':>22}  faults S|N  preempted S|N"
    )
    for name, result in results.items():
        for p in result["points"]:
            f = point_figures(p)
            print(
                f"{name:>15} {p['batch']:>2} {p['k']:>6} {f['shadow_ms']:>6.2f}|{f['natural_ms']:<6.2f}  "
                f"{100 * f['spread']['shadow']:>4.1f}|{100 * f['spread']['natural']:<4.1f}%  "
                f"{interval(f['aa_shadow']):>22}  {interval(f['aa_natural']):>22}  "
                f"{interval(f['carry_over']['natural']):>22}  {interval(f['ratio']):>22}  "
                f"{f['faults']['shadow']:>4.0f}|{f['faults']['natural']:<4.0f}  "
                f"{f['preempted']['shadow']:>4.1f}|{f['preempted']['natural']:<4.1f}"
            )
    print(f"\n{uptime()}", flush=True)
    print(
        json.dumps(
            {
                "metric": f"step_fidelity_variance_{release}",
                "value": _largest_spread(r for n, r in results.items() if n.startswith("controlled")),
                "unit": "%",
                "baseline": _largest_spread(r for n, r in results.items() if not n.startswith("controlled")),
                "ratio": None,
                "target": "report only: the largest spread (MAD/median) controlled, and with a source let loose",
            }
        )
    )


def machine_floor(settings: Settings) -> None:
    """The host's own noise, without vLLM: fixed work about as long as a small model's step,
    timed in the same shape (measurements of STEPS repetitions, each the upper median) in a
    process pinned the same way. Three probes take turns, so they see the same moments: a
    matrix product that stays in the caches (compute), a sum over 128 MiB (memory bandwidth,
    what a decode step's KV and weight reads need) and a loop of the interpreter's own work
    (what schedule() and update_from_output() are). Their A/A is the floor under the engine's."""
    import torch

    if settings.pin:
        os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
    torch.set_num_threads(1)
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    big = torch.empty(32 << 20).uniform_()  # 128 MiB of float32

    def interpreter() -> None:
        table = {}
        for i in range(20_000):
            table[i % 97] = table.get(i % 97, 0) + i

    probes = {
        "compute": lambda: torch.mm(a, b),
        "memory": lambda: big.sum(),
        "interpreter": interpreter,
    }

    def measurement(probe) -> float:
        times = []
        for _ in range(settings.steps):
            started = time.perf_counter()
            probe()
            times.append(time.perf_counter() - started)
        return upper_median(times)

    walls: dict[str, list[float]] = {name: [] for name in probes}
    for name, probe in probes.items():
        measurement(probe)  # the warm-up
    for _ in range(4 * settings.pairs):
        for name, probe in probes.items():
            walls[name].append(measurement(probe))
    figures = {}
    for name, values in walls.items():
        aa = a_a(values)
        f = figures[name] = {"ms": 1e3 * statistics.median(values), "spread": spread(values), "aa": aa}
        print(f"machine floor, {name:>11}: {f['ms']:7.3f} ms, spread {100 * f['spread']:4.1f} %, A/A {interval(aa)}")
    print(uptime())
    worst = max(abs(f["aa"][0] - 1) for f in figures.values())
    print(
        json.dumps(
            {
                "metric": "step_fidelity_machine_floor",
                "value": round(100 * worst, 2),
                "unit": "%",
                "baseline": round(100 * max(f["spread"] for f in figures.values()), 2),
                "ratio": None,
                "target": "report only: the largest A/A (value) and spread (baseline) of fixed work on this host",
                "probes": figures,
            }
        )
    )


def _largest_spread(results) -> float | None:
    spreads = [spread(p[side]["walls"]) for r in results for p in r["points"] for side in ("shadow", "natural")]
    return round(100 * max(spreads), 2) if spreads else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the quick mode (also KVWARM_BENCH_QUICK=1)")
    parser.add_argument("--only", help="comma-separated cases (default: every case of the mode)")
    parser.add_argument("--runs", type=int, help="engine processes per hybrid case (default: FULL's)")
    parser.add_argument("--pairs", type=int, help="ABBA pairs per point (default: 12; the interval narrows as 1/sqrt)")
    parser.add_argument("--variance", action="store_true", help="the variance study instead")
    parser.add_argument("--variants", help=f"the variance study's variants (default: all of {', '.join(VARIANTS)})")
    parser.add_argument(
        "--floor", action="store_true", help="the host's own noise: fixed compute, memory and interpreter work"
    )
    parser.add_argument("--modes", help="comma-separated state modes of the hybrids (default: every one)")
    parser.add_argument("--flush-denormal", action="store_true", help="subnormal floats read as zero")
    parser.add_argument("--case", choices=sorted(CASES), help=argparse.SUPPRESS)  # one engine process
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--settings", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        run_case(args.case, args.out, Settings.from_json(args.settings))
        return
    quick = quick_mode(sys.argv, os.environ)
    settings = QUICK if quick else FULL
    release = release_label()
    if args.floor:
        machine_floor(settings)
        return
    if args.variance:
        with tempfile.TemporaryDirectory() as tmp:
            variants = args.variants.split(",") if args.variants else list(VARIANTS)
            unknown = [v for v in variants if v not in VARIANTS]
            if unknown:
                sys.exit(f"--variants {args.variants}: unknown {unknown}; the variants are {', '.join(VARIANTS)}")
            variance_study(release, Path(tmp), variants, args.runs or 1)
        return
    names = args.only.split(",") if args.only else list(settings.runs)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        sys.exit(f"--only {args.only}: unknown case(s) {unknown}; the cases are {', '.join(CASES)}")
    if args.modes:
        settings = replace(settings, modes=tuple(args.modes.split(",")))
    if args.flush_denormal:
        settings = replace(settings, flush_denormal=True)
    if args.pairs:
        settings = replace(settings, pairs=args.pairs)
    if args.runs:
        settings = replace(settings, runs={**settings.runs, **{n: args.runs for n in names if CASES[n].hybrid()}})
    print(
        f"vLLM {release} CPU engine: paired shadow/natural steps, {settings.pairs} ABBA pairs of {settings.steps} "
        f"steady steps per point (after one warm-up each); {uptime()}; {os.cpu_count()} CPUs",
        flush=True,
    )
    by_case: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            runs = range(1, settings.runs.get(name, 1) + 1)
            alone = len(names) == 1 and len(runs) == 1
            by_case[name] = [run_engine(name, run, Path(tmp), settings, in_process=alone) for run in runs]
    headline, hybrids, hybrid_schedules, hybrid_refused = [], {}, {}, {}
    for name, runs in by_case.items():
        print(f"\n{name}: {CASES[name].title}", flush=True)
        if CASES[name].hybrid():
            hybrids[name], hybrid_schedules[name], hybrid_refused[name] = print_hybrid_case(runs)
        else:
            for result in runs:
                headline += print_attention_case(result)
    print(f"\n{uptime()}", flush=True)
    worst = max((abs(r["ratio"][0] - 1) for r in headline), default=0.0)
    noises = (abs(r[k][0] - 1) for r in headline for k in ("aa_shadow", "aa_natural"))
    noise = max((n for n in noises if math.isfinite(n)), default=0.0)
    inside = sum(within(r["ratio"]) for r in headline)
    # the shadows' schedule() against the natural requests' (the sweep's own work is not in it)
    schedule_at_1 = sum(holds_one(r["schedule_ratio"]) for r in headline)
    if headline:
        print(
            f"attention-only points: largest |shadow/natural - 1| {100 * worst:.2f}%, largest A/A {100 * noise:.2f}%; "
            f"{inside}/{len(headline)} intervals within 1 +- {100 * TOLERANCE:g}%; "
            f"schedule() S/N interval holds 1 at {schedule_at_1}/{len(headline)}",
            flush=True,
        )
    attention = "_".join(n for n in by_case if not CASES[n].hybrid()) or "hybrids"
    print(
        json.dumps(
            {
                "metric": f"step_fidelity_paired_{attention}_{release}" + ("_quick" if quick else ""),
                "value": round(100 * worst, 2),
                "unit": "%",
                "baseline": round(100 * noise, 2),
                "ratio": round(worst / noise, 2) if noise else None,
                "target": f"every point's 95% interval within 1 +- {100 * TOLERANCE:g}% "
                f"and A/A <= {100 * TOLERANCE:g}%",
                "points_within": f"{inside}/{len(headline)}",
                "schedule_holding_1": f"{schedule_at_1}/{len(headline)}",
                "hybrid_rows_agreeing": hybrids,
                "hybrid_schedule_holding_1": hybrid_schedules,
                "hybrid_modes_refused": hybrid_refused,
            }
        )
    )


if __name__ == "__main__":
    main()
