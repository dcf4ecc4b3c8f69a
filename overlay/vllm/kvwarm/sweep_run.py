"""One decode sweep inside an engine: inputs -> gate -> controller -> artifact.

The scheduler adapter builds a SweepRun when the engine's additional_config carries
{"kvwarm_sweep": {"points": FILE, "out": DIR}}, so the sweep runs wherever the scheduler
does: in the caller's process or in vLLM's engine-core process (`vllm serve`, or the
sweep command with VLLM_ENABLE_V1_MULTIPROCESSING=1). The artifact is rewritten after
every point, and on any failure with status "failed", the error and every row measured.
Under data parallel each rank writes OUT/dp<R>/ and, after each of its writes, the
combined view OUT/sweep.json (artifact.write_combined).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from vllm.logger import init_logger

from .artifact import build_artifact, write_artifact, write_combined
from .dataset import COLLECTION_POOL, ChainText, DatasetError, load_dataset
from .gate import content_reason, model_gate_reason
from .layout import group_layouts
from .points import DecodePoint, PointsFileError, load_points
from .settings import DATASET_ENV, Settings, SettingsError, read_settings
from .ranks import make_exchange, rank_layout
from .record import run_record, utc_now
from .state_mode import MODES, STATE_ENV, STATE_MODE_INVALID, decide_state_mode
from .sweep import FAKE_FALLBACK, LEGACY, NOISY_SPREAD, DecodeSweep, SweepConfig

logger = init_logger(__name__)

CONFIG_KEY = "kvwarm_sweep"
INPUT_ERRORS = (PointsFileError, SettingsError, DatasetError)


@dataclass
class SweepInputs:
    settings: Settings
    points: list[DecodePoint]
    conversations: list[str] | None  # None when warm-up is off (no chains, no text)
    dataset: dict | None  # the artifact's record of the file


def read_inputs(points_path: str, environ=None, max_model_len: int = sys.maxsize) -> SweepInputs:
    """Every input a sweep reads before it touches the engine; raises one of INPUT_ERRORS.
    A dataset problem is an error, not a reason to measure on fake KV: a mistyped path
    must not silently turn a real-KV table into a fake one."""
    environ = os.environ if environ is None else environ
    settings = read_settings(environ)
    points = load_points(points_path, max_model_len=max_model_len, headroom=settings.repeats)
    if settings.warmup == "off":
        return SweepInputs(settings, points, None, None)
    if not settings.dataset:
        raise DatasetError(f"{DATASET_ENV} is not set; point it at a ShareGPT-format JSON file "
                           "(or set DYN_BENCH_KV_WARMUP=off to measure on fake KV)")
    conversations, digest = load_dataset(settings.dataset)
    dataset = {"path": str(settings.dataset), "sha256": digest, "collection_pool": COLLECTION_POOL,
               "conversations": len(conversations)}
    return SweepInputs(settings, points, conversations, dataset)


class ArtifactWriteError(RuntimeError):
    pass


class Reporter:
    """The artifact (after every point) and progress lines with the time left. A write that
    fails raises ArtifactWriteError for the caller to end the sweep with; it never reaches
    the engine (the scheduler adapter handles it)."""

    def __init__(self, out: str, config: dict, environ, rank_out: str | None = None, layout=None):
        self.root = out  # where the combined view goes under data parallel
        self.out = rank_out or out  # where this rank's artifact goes
        self.config = config
        self.layout = layout
        self.meta = {"enabled": False, "warm_eligible": False, "skip_reason": None, "dataset": None,
                     "stages": [], "giant_kv_repeats": 1, "giant_kv_threshold": None,
                     "state_mode_requested": environ.get(STATE_ENV), "state_mode": None,
                     "reset_prefix_cache": None, "noisy_spread": NOISY_SPREAD}
        self.run: dict = {"started_at": utc_now(), "finished_at": None}
        self.rows: list = []
        self.total = 0
        self.started = time.monotonic()

    def record_inputs(self, inputs: SweepInputs) -> None:
        settings = inputs.settings
        self.meta.update(enabled=settings.warmup != "off", dataset=inputs.dataset,
                         giant_kv_repeats=settings.repeats, giant_kv_threshold=settings.giant_kv_threshold)
        self.total = len(inputs.points)

    def write(self, status: str, error: str | None = None) -> None:
        if status != "running":
            self.run["finished_at"] = utc_now()
        artifact = build_artifact(self.rows, self.meta, self.config, status, error,
                                  run=self.run, layout=self.layout)
        try:
            write_artifact(self.out, artifact)
        except Exception as err:
            raise ArtifactWriteError(f"writing the artifact to {self.out} failed: {type(err).__name__}: {err}") from err
        if self.layout is not None and self.layout.data_parallel_size > 1:
            try:
                write_combined(self.root, self.layout.data_parallel_size)
            except Exception as err:
                raise ArtifactWriteError(f"writing the combined view to {self.root} failed: "
                                         f"{type(err).__name__}: {err}") from err

    def progress(self, message: str) -> None:
        done = len(self.rows)
        left = ""
        if 0 < done < self.total:
            per_point = (time.monotonic() - self.started) / done
            left = f", about {per_point * (self.total - done):.0f} s left"
        rank = f" dp{self.layout.data_parallel_rank}" if self.layout and self.layout.data_parallel_size > 1 else ""
        logger.info("[kvwarm sweep%s] %s%s", rank, message, left)


def _tokenizer_encode(model_config):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        model_config.tokenizer, revision=model_config.tokenizer_revision,
        trust_remote_code=model_config.trust_remote_code)
    return lambda text: tokenizer.encode(text, add_special_tokens=False)


class SweepRun:
    """Built by the scheduler adapter from its own config; `sweep` is what it drives."""

    def __init__(self, scheduler, spec: dict, environ=None):
        environ = os.environ if environ is None else environ
        if not isinstance(spec, dict) or not {"points", "out"} <= set(spec):
            raise SettingsError(f'additional_config["{CONFIG_KEY}"] must be {{"points": FILE, "out": DIR}} '
                                f'(and optionally "engine_args": [ARG, ...]), got {spec!r}')
        vllm_config = scheduler.vllm_config
        parallel = vllm_config.parallel_config
        self.layout = rank_layout(parallel)
        size, rank = self.layout.data_parallel_size, self.layout.data_parallel_rank
        rank_out = str(Path(spec["out"]) / f"dp{rank}") if size > 1 else None
        config = {"points": spec["points"], "model": vllm_config.model_config.model}
        self.reporter = Reporter(spec["out"], config, environ, rank_out, self.layout)
        self.finished = False
        try:
            self.reporter.run.update(run_record(scheduler, spec.get("engine_args")))
            self.reporter.write("running")  # replaces an earlier run's artifact in this folder
            self.sweep = self._build(scheduler, vllm_config, spec, environ,
                                     make_exchange(self.layout, spec["out"], parallel))
        except BaseException as err:
            self.fail(err)
            raise

    def _build(self, scheduler, vllm_config, spec: dict, environ, exchange) -> DecodeSweep:
        max_model_len = vllm_config.model_config.max_model_len
        inputs = read_inputs(spec["points"], environ, max_model_len)
        settings, reporter = inputs.settings, self.reporter
        reporter.record_inputs(inputs)
        max_seqs = vllm_config.scheduler_config.max_num_seqs
        too_wide = sorted({p.batch_size for p in inputs.points if p.batch_size > max_seqs})
        if too_wide:
            raise PointsFileError(f"points file {spec['points']}: batch size(s) {too_wide} exceed max_num_seqs "
                                  f"{max_seqs}, so no step could run such a batch; start the engine with "
                                  f"--max-num-seqs {too_wide[-1]} or more")
        kvm = scheduler.kv_cache_manager
        decision = decide_state_mode(kvm, group_layouts(kvm), environ)
        if decision.reason == STATE_MODE_INVALID:
            raise SettingsError(f"{STATE_ENV}={decision.requested!r} is not one of {', '.join(MODES)}")
        reason = model_gate_reason(vllm_config, settings.warmup) or decision.reason
        chain_text = None
        if reason is None:
            encode = _tokenizer_encode(vllm_config.model_config)
            need = max(p.tokens_spanned(settings.repeats) for p in inputs.points)
            reason = content_reason(inputs.conversations, encode, min(need, max_model_len))
            chain_text = ChainText(inputs.conversations, encode)
        dp = self.layout.data_parallel_size
        reporter.meta.update(decision.metadata(), warm_eligible=reason is None, skip_reason=reason,
                             batch_semantics="per_rank", global_batch_factor=dp)
        if reason is not None:
            reporter.meta["state_mode"] = None
            reporter.progress(f"warm-up skipped ({reason}): every point on fake KV")
        config = SweepConfig(
            repeats=settings.repeats, max_model_len=max_model_len,
            state_mode=decision.mode if reason is None else None, state_lending=decision.lending,
            real=reason is None,
            fake_regime=LEGACY if settings.warmup == "off" else FAKE_FALLBACK,
            giant_kv_threshold=settings.giant_kv_threshold)
        return DecodeSweep(inputs.points, chain_text, config, progress=reporter.progress, on_row=self._on_row,
                           exchange=exchange)

    def _on_row(self, row) -> None:
        self.reporter.rows.append(row)
        self.reporter.meta["stages"] = list(self.sweep.stages)
        self.reporter.write("running")

    def finish(self) -> None:
        """After the controller is done: the final artifact."""
        self.reporter.meta["stages"] = list(self.sweep.stages)
        self.reporter.meta["reset_prefix_cache"] = self.sweep.reset_prefix_cache_ok
        self.reporter.write("complete")
        self.finished = True
        self.reporter.progress(f"wrote {Path(self.reporter.out) / 'sweep.json'}")

    def fail(self, err: BaseException) -> None:
        """Record why the sweep stopped, keeping every row measured before. Never raises:
        a failure to write the record is logged."""
        if self.finished:
            return
        self.finished = True
        message = str(err) if isinstance(err, INPUT_ERRORS) else f"{type(err).__name__}: {err}"
        logger.error("[kvwarm sweep] failed: %s", message)
        try:
            self.reporter.write("failed", message)
        except ArtifactWriteError as write_err:
            logger.error("[kvwarm sweep] %s", write_err)
