"""The tables: `python -m vllm.kvwarm sweep --grid-from TRACE` on the served engine's
arguments, with the warm-up on (real KV) and off (fake KV), each held against a trace by the
overlay's own validate (record.validate.validation.validate(), the code behind `python -m vllm.kvwarm
validate`; its validate.json, .csv and .png written beside the tables).

Where the sweep runs (`topology`; a candidate source of the gap between a served step and a
row, issue 40 item 5):
  in-process  the sweep command's default (VLLM_ENABLE_V1_MULTIPROCESSING=0): the engine core
              stepped inside the command's process, no input or output thread;
  served      VLLM_ENABLE_V1_MULTIPROCESSING=1: the engine core in its own process (vLLM's
              EngineCoreProc, with its input and output threads), as under a server.
Pinned as the served engine (pinning.py): the sweep command on the other cores from its
start, and its executor's worker process on the worker's core alone once it exists.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from kvwarm_testing.engine import CPU_ENGINE_ENV
from vllm.kvwarm.record.validate.output import text, write
from vllm.kvwarm.record.validate.predict import STEP
from vllm.kvwarm.record.validate.validation import ValidateError
from vllm.kvwarm.record.validate.validation import validate as hold_against

from .floor import floor_ms
from .pinning import cores, pin_session, pinning_env
from .pinning import placement as where
from .pooled import pool
from .runqueue import RunQueue
from .serving import Served, engine_args

TOPOLOGIES = ("in-process", "served")
# Untimed steps of each point's shape before its timed ones (DYN_BENCH_KV_WARMUP_SETTLE_STEPS):
# on the development host a point's first steps after the sweep's pause between points ran
# 1.36x the served steady steps of the same shape, its 5th-15th 1.15x, from the 20th on 1.03x
# (docs/measurements/served-vs-table.md, "Settle steps and the first steps after a pause"): a served step under
# load follows others without a pause. And 7 timed steps a point (DYN_BENCH_GIANT_KV_REPEATS)
# rather than 3: a row's median then stands less on one of this host's slow spells.
SETTLE_STEPS, TIMED_STEPS = 24, 7
SWEEP_TIMEOUT = 3600.0
QUICK_CAPS = {
    "decode_batches": 3,
    "kv_ladder": 3,
    "prefill_batches": 1,
    "prefill_tokens": 2,
    "prefix_depths": 1,
    "mixed": 1,
}


def sweep_table(
    served: Served, model: Path, budget: int, dataset: Path, out: Path, warmup: bool, topology: str, pinned: bool, caps
) -> tuple[Path, dict, dict]:
    """A table swept --grid-from the served run's trace, its warm-up left out (--skip-seconds);
    returns its folder, its artifact (status complete) and the engine's waits for a CPU while
    it swept (runqueue.py)."""
    env = {**os.environ, **CPU_ENGINE_ENV, **pinning_env(pinned)}
    env.update(
        DYN_BENCH_KV_WARMUP="on" if warmup else "off",
        DYN_BENCH_KV_WARMUP_DATASET=str(dataset),
        DYN_BENCH_KV_WARMUP_SETTLE_STEPS=str(SETTLE_STEPS),
        DYN_BENCH_GIANT_KV_REPEATS=str(TIMED_STEPS),
        VLLM_ENABLE_V1_MULTIPROCESSING="1" if topology == "served" else "0",
    )
    argv = [sys.executable, "-m", "vllm.kvwarm", "sweep", "--grid-from", str(served.trace), "--out", str(out)]
    argv += ["--skip-seconds", str(served.warm_up_seconds)] if served.warm_up_seconds else []
    argv += ["--grid-caps", json.dumps(caps)] if caps else []
    rest, worker = cores()
    on = pinned and worker is not None
    log = out.with_suffix(".log")
    out.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as stream:
        process = subprocess.Popen(
            [*argv, *engine_args(model, budget)],
            env=env,
            stdout=stream,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        if on:
            os.sched_setaffinity(process.pid, rest)
        with RunQueue(process.pid, engine_core=process.pid if topology != "served" else None) as waits:
            returncode = watch(process, on, topology != "served", SWEEP_TIMEOUT)
    artifact = json.loads((out / "sweep.json").read_text()) if (out / "sweep.json").exists() else {}
    if returncode != 0 or artifact.get("status") != "complete":
        raise SystemExit(f"the sweep for {out.name} did not complete ({returncode}); see {log}")
    return out, artifact, waits.figures()


def sweep_pooled(
    served: Served, model: Path, budget: int, dataset: Path, out: Path, warmup: bool, topology: str, caps, sweeps: int
) -> tuple[Path, dict, list[dict], dict, list[float]]:
    """`sweeps` tables of one grid swept one after another (sweep_table), pooled into one
    (pooled.py) in out/pooled; returns its folder, its artifact, each sweep's waits for a
    CPU, what the pooling saw, and the host's floor before each sweep and after the last."""
    artifacts, waits, floors = [], [], []
    for number in range(1, sweeps + 1):
        floors.append(floor_ms())
        _, artifact, waited = sweep_table(
            served, model, budget, dataset, out / f"sweep{number}", warmup, topology, True, caps
        )
        artifacts.append(artifact)
        waits.append(waited)
    floors.append(floor_ms())
    artifact, seen = pool(artifacts, out / "pooled")
    print(
        f"  pooled {seen['sweeps']} sweeps: {seen['rows']} rows ({seen['rows_in_every_sweep']} in every sweep); "
        f"a row's medians across the sweeps spread {seen['row_medians_spread_pct']} % (median over rows), "
        f"up to {seen['row_medians_spread_max_pct']} %",
        flush=True,
    )
    return out / "pooled", artifact, waits, seen, floors


def watch(process: subprocess.Popen, pin: bool, in_process: bool, timeout: float) -> int:
    """Wait for the sweep; while `pin`, pin its worker process as soon as it exists (and raise
    the command's own process, where the engine core runs `in_process`)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return process.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            if time.monotonic() > deadline:
                process.kill()
                raise
            if pin and pin_session(process.pid, engine_core=process.pid if in_process else None):
                pin = False
                print(f"  the sweep's processes: {where(process.pid)}", flush=True)


def validate(table: Path, trace: Path, out: Path, skip_seconds: float, basis: str = STEP) -> tuple[dict, dict]:
    """The table held against the trace on `basis` (validate's step or forward), the trace's
    first `skip_seconds` (the served engine's warm-up) left out: its text (per kind and band)
    printed, its files written in `out`; (one-line summary, validate.json record)."""
    try:
        result = hold_against(str(table), str(trace), basis, skip_seconds=skip_seconds)
    except ValidateError as err:
        raise SystemExit(f"validate {table.name} against {trace}: {err}") from None
    write(result, out)
    print(text(result), flush=True)
    return result.summary(), result.record()
