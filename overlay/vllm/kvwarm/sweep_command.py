"""`python -m vllm.kvwarm sweep --points FILE --out DIR [vLLM engine args]`: a decode sweep on
the real engine, in this process (the engine core runs in-process so the sweep controller
inside its scheduler is reachable), writing the artifact after every point.

Every input is checked before the engine starts where it can be; any failure still writes
an artifact (status "failed", the error, and every row measured before it).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from .artifact import build_artifact, write_artifact
from .dataset import ChainText, DatasetError, load_conversations
from .points import PointsFileError, load_points
from .settings import SettingsError, read_settings

ADAPTER = "vllm.kvwarm.scheduler.KvWarmScheduler"
INPUT_ERRORS = (PointsFileError, SettingsError, DatasetError)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m vllm.kvwarm sweep", description="Decode step times at (batch, KV) points with real KV.",
        epilog="Every other argument is a vLLM engine argument, as for `vllm serve` (e.g. --model DIR "
               "--max-model-len N --enforce-eager).")
    p.add_argument("--points", required=True, help='{"schema_version":1,"decode":[{"total_kv_read_tokens":K,'
                                                   '"batch_size":B}]}')
    p.add_argument("--out", required=True, help="folder for sweep.json, sweep.csv and sweep.png")
    return p


def engine_args_from(argv: list[str]):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    p = FlexibleArgumentParser(prog="python -m vllm.kvwarm sweep")
    EngineArgs.add_cli_args(p)
    engine_args = EngineArgs.from_cli_args(p.parse_args(argv))
    engine_args.scheduler_cls = engine_args.scheduler_cls or ADAPTER
    return engine_args


class Reporter:
    """Writes the artifact after every point and prints progress with the time left."""

    def __init__(self, out: str, meta: dict, config: dict, total: int):
        self.out, self.meta, self.config, self.total = out, meta, config, total
        self.started = time.monotonic()
        self.rows: list = []

    def write(self, status: str, error: str | None = None) -> None:
        write_artifact(self.out, build_artifact(self.rows, self.meta, self.config, status, error))

    def progress(self, message: str) -> None:
        done = len(self.rows)
        left = ""
        if 0 < done < self.total:
            per_point = (time.monotonic() - self.started) / done
            left = f", about {per_point * (self.total - done):.0f} s left"
        print(f"[kvwarm sweep] {message}{left}", flush=True)


def _meta(settings, decision=None, skip_reason=None) -> dict:
    return {"enabled": settings is not None and settings.warmup != "off",
            "warm_eligible": skip_reason is None and decision is not None,
            "skip_reason": skip_reason, "giant_kv_repeats": settings.repeats if settings else 1,
            "state_mode_requested": decision.requested if decision else os.environ.get("DYN_BENCH_KV_WARMUP_STATE"),
            "state_mode": decision.mode if decision else None, "reset_prefix_cache": None}


def run(argv: list[str]) -> int:
    args, engine_argv = parser().parse_known_args(argv)
    config = {"points": args.points, "engine_args": engine_argv}
    reporter = Reporter(args.out, _meta(None), config, total=0)
    try:
        settings = read_settings()
        reporter.meta = _meta(settings)
        points = load_points(args.points, max_model_len=sys.maxsize, headroom=settings.repeats)
        if settings.warmup == "off":
            raise SettingsError("DYN_BENCH_KV_WARMUP=off: the fake-KV sweep is not built yet; "
                                "unset it to measure on real KV")
        if not settings.dataset:
            raise DatasetError("DYN_BENCH_KV_WARMUP_DATASET is not set; point it at a ShareGPT-format JSON file")
        conversations = load_conversations(settings.dataset)
        reporter.total = len(points)
        return _sweep(args, engine_argv, settings, conversations, reporter)
    except INPUT_ERRORS as err:
        print(f"kvwarm sweep: {err}", file=sys.stderr)
        reporter.write("failed", str(err))
        return 2


def _sweep(args, engine_argv, settings, conversations, reporter: Reporter) -> int:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm.v1.engine.llm_engine import LLMEngine

    from .layout import group_layouts
    from .state_mode import decide_state_mode
    from .sweep import DecodeSweep

    engine = LLMEngine.from_engine_args(engine_args_from(engine_argv))
    core = engine.engine_core.engine_core
    scheduler = core.scheduler
    max_model_len = engine.vllm_config.model_config.max_model_len
    points = load_points(args.points, max_model_len=max_model_len, headroom=settings.repeats)
    kvm = scheduler.kv_cache_manager
    decision = decide_state_mode(kvm, group_layouts(kvm), os.environ)
    reporter.meta = _meta(settings, decision, decision.reason)
    if decision.reason:
        raise SettingsError(f"the warm-up gate refuses this layout: {decision.reason}")
    tokenizer = engine.get_tokenizer()
    text = ChainText(conversations, lambda s: tokenizer.encode(s, add_special_tokens=False))

    def progress(message: str) -> None:
        reporter.rows = list(sweep.rows)
        if message.startswith("point "):
            reporter.write("running")
        reporter.progress(message)

    sweep = DecodeSweep(points, text, repeats=settings.repeats, max_model_len=max_model_len,
                        state_mode=decision.mode, progress=progress)
    scheduler.kvwarm_sweep = sweep
    try:
        while scheduler.has_requests():
            core.step_fn()
    except Exception as err:  # keep every measured row, say what stopped the sweep
        reporter.rows = list(sweep.rows)
        reporter.write("failed", f"{type(err).__name__}: {err}")
        raise
    reporter.rows = list(sweep.rows)
    reporter.meta["reset_prefix_cache"] = sweep.reset_prefix_cache_ok
    reporter.write("complete")
    print(f"[kvwarm sweep] wrote {Path(args.out) / 'sweep.json'}", flush=True)
    return 0
