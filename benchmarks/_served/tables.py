"""The tables: `python -m vllm.kvwarm sweep --grid-from TRACE` on the served engine's
arguments, with the warm-up on (real KV) and off (fake KV), each held against a trace by
`python -m vllm.kvwarm validate` (both from the overlay's record and sweep rooms; a build
without them says so, and the benchmark reports the trace alone).

Where the sweep runs (`topology`):
  served      the engine core in its own process, as under a server (vLLM's EngineCoreProc:
              its input and output threads, every step's outputs serialized and sent to the
              client, statistics on): the host work a served step does (docs/validate.md#closing-the-gap);
  in-process  the engine core stepped inside the command's process (the sweep command's
              default before the gap was closed): no output path, no input thread.
Pinned as the served side: the worker on the last core, the command on the others.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

from kvwarm_testing.engine import CPU_ENGINE_ENV
from kvwarm_testing.served import run_on

from .serving import cores, engine_args, pinning_env

TOPOLOGIES = ("served", "in-process")
QUICK_CAPS = {"decode_batches": 3, "kv_ladder": 3, "prefill_batches": 1, "prefill_tokens": 2, "prefix_depths": 1}


def missing_commands() -> str | None:
    """Why this build cannot make or judge a table from a trace (None: it can)."""
    wanted = {"vllm.kvwarm.record.validate": "validate", "vllm.kvwarm.sweep.trace_grid": "sweep --grid-from"}
    absent = [name for module, name in wanted.items() if importlib.util.find_spec(module) is None]
    return f"this build has no {' and no '.join(absent)}" if absent else None


def sweep_table(
    trace: Path, model: Path, budget: int, dataset: Path, out: Path, warmup: bool, topology: str, pinned: bool, caps
) -> tuple[Path, dict]:
    """A --grid-from table; returns its folder and its artifact (status complete)."""
    env = {**os.environ, **CPU_ENGINE_ENV, **pinning_env(pinned)}
    env.update(
        DYN_BENCH_KV_WARMUP="on" if warmup else "off",
        DYN_BENCH_KV_WARMUP_DATASET=str(dataset),
        VLLM_ENABLE_V1_MULTIPROCESSING="1" if topology == "served" else "0",
    )
    argv = [sys.executable, "-m", "vllm.kvwarm", "sweep", "--grid-from", str(trace), "--out", str(out)]
    argv += ["--grid-caps", json.dumps(caps)] if caps else []
    rest, worker = cores()
    on = rest if pinned and worker is not None and topology == "served" else None
    log = out.with_suffix(".log")
    out.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as stream:
        done = run_on([*argv, *engine_args(model, budget)], on, 3600, env=env, stdout=stream)
    artifact = json.loads((out / "sweep.json").read_text()) if (out / "sweep.json").exists() else {}
    if done.returncode != 0 or artifact.get("status") != "complete":
        raise SystemExit(f"the sweep for {out.name} did not complete ({done.returncode}); see {log}")
    return out, artifact


def validate(table: Path, trace: Path, out: Path, basis: str = "step") -> dict:
    """validate's one-line summary, and its text (per kind and band) printed."""
    argv = [sys.executable, "-m", "vllm.kvwarm", "validate", str(table), str(trace), "--out", str(out)]
    text = subprocess.run([*argv, "--basis", basis], capture_output=True, text=True, check=False)
    if text.returncode != 0:
        raise SystemExit(f"validate {table.name} against {trace} failed:\n{text.stderr[-2000:]}")
    print(text.stdout.rstrip(), flush=True)
    line = subprocess.run([*argv, "--basis", basis, "--json"], capture_output=True, text=True, check=True)
    return json.loads(line.stdout.strip().splitlines()[-1])
