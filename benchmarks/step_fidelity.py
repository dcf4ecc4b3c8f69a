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

What is controlled, and why (docs/measurements/fidelity.md, "Paired step fidelity"): the natural side
holds the collector as the sweep does; both sides reuse their own cached blocks from one
measurement to the next (a natural request hits its own earlier prefill, a shadow its parked
chain), so no measurement gets other physical blocks than the one before; the first
measurement after a build or a new point is the warm-up, not counted; the load average is
recorded with each point. `--variance` changes one thing at a time (fresh blocks, the
collector free, an unpinned process, the engine's other threads isolated from its CPU, glibc
without its trim, tcmalloc, the KV cache on huge pages).

`--quick` (or KVWARM_BENCH_QUICK=1): the dense model alone, two points, four pairs (the fewest
that give an A/A). By default the engine runs one step at a time (EngineCore.step, the sync
adapter, eager). `--gpu-defaults`: as vLLM sets an engine up on a GPU, async scheduling at its
default (the batch queue through KvWarmAsyncScheduler; on the CPU engine the platform's
override of it is lifted, as the engine tests lift it) and on CUDA graphs of a few sizes; each
side then runs one untimed step after its timed ones, as the sweep does under the batch queue.
Each case's result records the loop it ran. `--pairs N` for more pairs: on a host whose speed drifts, a point's interval
narrows only as 1/sqrt(N) (docs/measurements/fidelity.md, "What the variance is").
The last line is the JSON result.
The pieces live in benchmarks/_fidelity/ (its docstring is the map); this script parses the
arguments and runs them.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from _engine import release_label  # importing it sets the engine's environment
from _fidelity.cases import CASES, FULL, QUICK, VARIANTS, Settings
from _fidelity.report import machine_floor, print_paired, variance_study
from _fidelity.runner import run_case, run_engine, uptime

from kvwarm_build.sessions import quick_mode

NEEDS_ENGINE = True  # noxfile: run in the release's CPU engine venv


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
    parser.add_argument(
        "--gpu-defaults",
        action="store_true",
        help="async scheduling at vLLM's default (the batch queue; on CPU the platform's override lifted), "
        "graphs on CUDA",
    )
    parser.add_argument("--gpu-memory-utilization", type=float, help="CUDA: the engine's share of the GPU")
    parser.add_argument("--kv-cache-memory-bytes", type=int, help="CUDA: a fixed KV pool (beside other engines)")
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
    if args.gpu_defaults:
        settings = replace(settings, gpu_defaults=True)
    if args.gpu_memory_utilization or args.kv_cache_memory_bytes:
        memory = {
            "gpu_memory_utilization": args.gpu_memory_utilization,
            "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
        }
        settings = replace(settings, **memory)
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
    print_paired(by_case, release, quick)


if __name__ == "__main__":
    main()
