"""`python -m vllm.kvwarm sweep --points FILE --out DIR [vLLM engine args]`: a decode sweep on
the real engine, writing the artifact after every point.

Every input is checked before the engine starts; any failure still writes an artifact
(status "failed", the error, and every row measured before it). The sweep itself runs
inside the scheduler (sweep_run.SweepRun, configured through additional_config): by
default the engine core runs in this process and this command steps it; with
VLLM_ENABLE_V1_MULTIPROCESSING=1 it runs in vLLM's engine-core process, the way it runs
under `vllm serve`, and this command waits for the artifact to be complete.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from .sweep_run import CONFIG_KEY, INPUT_ERRORS, Reporter, read_inputs

ADAPTER = "vllm.kvwarm.scheduler.KvWarmScheduler"
POLL_SECONDS = 1.0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m vllm.kvwarm sweep", description="Decode step times at (batch, KV) points with real KV.",
        epilog="Every other argument is a vLLM engine argument, as for `vllm serve` (e.g. --model DIR "
               "--max-model-len N --enforce-eager).")
    p.add_argument("--points", required=True, help='{"schema_version":1,"decode":[{"total_kv_read_tokens":K,'
                                                   '"batch_size":B}]}')
    p.add_argument("--out", required=True, help="folder for sweep.json, sweep.csv and sweep.png")
    return p


def engine_args_from(argv: list[str], spec: dict):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    p = FlexibleArgumentParser(prog="python -m vllm.kvwarm sweep")
    EngineArgs.add_cli_args(p)
    engine_args = EngineArgs.from_cli_args(p.parse_args(argv))
    engine_args.scheduler_cls = engine_args.scheduler_cls or ADAPTER
    engine_args.additional_config = {**(engine_args.additional_config or {}), CONFIG_KEY: spec}
    return engine_args


def run(argv: list[str]) -> int:
    args, engine_argv = parser().parse_known_args(argv)
    spec = {"points": str(Path(args.points).resolve()), "out": str(Path(args.out).resolve())}
    reporter = Reporter(spec["out"], {"points": spec["points"], "engine_args": engine_argv}, os.environ)
    try:
        read_inputs(spec["points"])  # max_model_len is checked again once the engine knows it
    except INPUT_ERRORS as err:
        print(f"kvwarm sweep: {err}", file=sys.stderr)
        reporter.write("failed", str(err))
        return 2
    reporter.write("running")  # replaces any earlier run's artifact in --out
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm.v1.engine.llm_engine import LLMEngine

    artifact = Path(spec["out"]) / "sweep.json"
    try:
        engine = LLMEngine.from_engine_args(engine_args_from(engine_argv, spec))
    except Exception:
        # Input found wrong once the engine knew max_model_len and the layout: the sweep
        # (in this process or the engine core's) recorded why in the artifact.
        recorded = json.loads(artifact.read_text())
        if recorded["status"] != "failed":
            raise
        print(f"kvwarm sweep: {recorded['error']}", file=sys.stderr)
        return 2
    core = getattr(engine.engine_core, "engine_core", None)
    status = _step(core) if core is not None else _wait(engine, artifact)
    return 0 if status == "complete" else 1


def _step(core) -> str:
    """In-process engine core: step it until the sweep is done."""
    scheduler = core.scheduler
    if getattr(scheduler, "kvwarm_run", None) is None:
        raise SystemExit(f"kvwarm sweep: --scheduler-cls must be {ADAPTER} (or a subclass of its mixin)")
    try:
        while scheduler.has_requests():
            core.step_fn()
    except Exception as err:  # the rows already measured stay in the artifact
        scheduler.kvwarm_run.fail(err)
        raise
    return "complete"


def _wait(engine, artifact: Path) -> str:
    """Engine core in its own process: it steps itself; wait for the final artifact."""
    while True:
        status = json.loads(artifact.read_text())["status"] if artifact.exists() else None
        if status in ("complete", "failed"):
            return status
        if getattr(getattr(engine.engine_core, "resources", None), "engine_dead", False):
            print("kvwarm sweep: the engine core died; see its log above", file=sys.stderr)
            return "failed"
        time.sleep(POLL_SECONDS)
