"""One sweep inside an engine: inputs -> gate -> controller -> artifact.

The scheduler adapter builds a SweepRun when the engine's additional_config carries
{"kvwarm_sweep": {"points": FILE, "out": DIR}}, so the sweep runs wherever the scheduler
does: in the caller's process or in vLLM's engine-core process (`vllm serve`, or the
sweep command with VLLM_ENABLE_V1_MULTIPROCESSING=1). The artifact is rewritten after
every point, and on any failure with status "failed", the error and every row measured.
Under data parallel each rank writes OUT/dp<R>/ and the ranks meet through an exchange
(sweep.store_exchange.make_exchange), which also carries each write to the combined view
OUT/sweep.json (record.combined) on rank 0's side.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from vllm.logger import init_logger

from ..kv.layout import group_layouts
from ..kv.state_mode import STATE_ENV, decide_state_mode
from ..record import vocabulary as v
from .controller import Sweep
from .dataset import COLLECTION_POOL, ChainText, DatasetError, load_dataset
from .engine_record import run_record
from .gate import content_reason, model_gate_reason
from .plan import SweepConfig
from .points import DecodePoint, PointsFileError, load_points
from .ranks import rank_layout
from .settings import DATASET_ENV, Settings, SettingsError, read_settings
from .store_exchange import make_exchange
from .writer import ArtifactWriteError, ArtifactWriter

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
    points = load_points(points_path, max_model_len=max_model_len, steady_steps=settings.steady_steps)
    if settings.warmup == "off":
        return SweepInputs(settings, points, None, None)
    if not settings.dataset:
        raise DatasetError(
            f"{DATASET_ENV} is not set; point it at a ShareGPT-format JSON file "
            "(or set DYN_BENCH_KV_WARMUP=off to measure on fake KV)"
        )
    conversations, digest = load_dataset(settings.dataset)
    dataset = {
        "path": str(settings.dataset),
        "sha256": digest,
        "collection_pool": COLLECTION_POOL,
        "conversations": len(conversations),
    }
    return SweepInputs(settings, points, conversations, dataset)


def _tokenizer_encode(model_config):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        model_config.tokenizer,
        revision=model_config.tokenizer_revision,
        trust_remote_code=model_config.trust_remote_code,
    )
    return lambda text: tokenizer.encode(text, add_special_tokens=False)


def new_writer(out: str, config: dict, environ, rank_out: str | None = None, layout=None) -> ArtifactWriter:
    """The artifact writer of a run, with what the environment asked for recorded."""
    writer = ArtifactWriter(out, config, rank_out, layout)
    writer.meta.state_mode_requested = environ.get(STATE_ENV)
    return writer


class SweepRun:
    """Built by the scheduler adapter from its own config; `sweep` is what it drives."""

    def __init__(self, scheduler, spec: dict, environ=None):
        environ = os.environ if environ is None else environ
        if not isinstance(spec, dict) or not {"points", "out"} <= set(spec):
            raise SettingsError(
                f'additional_config["{CONFIG_KEY}"] must be {{"points": FILE, "out": DIR}} '
                f'(and optionally "engine_args": [ARG, ...]), got {spec!r}'
            )
        vllm_config = scheduler.vllm_config
        parallel = vllm_config.parallel_config
        self.layout = rank_layout(parallel)
        size, rank = self.layout.data_parallel_size, self.layout.data_parallel_rank
        rank_out = str(Path(spec["out"]) / f"dp{rank}") if size > 1 else None
        config = {"points": spec["points"], "model": vllm_config.model_config.model}
        self.writer = new_writer(spec["out"], config, environ, rank_out, self.layout)
        self.finished = False
        exchange = None
        try:
            exchange = make_exchange(self.layout, spec["out"], parallel, read_settings(environ))
            self.writer.exchange = exchange
            self.writer.run.update(run_record(scheduler, spec.get("engine_args")))
            self.writer.write(v.RUNNING)  # replaces an earlier run's artifact in this folder
            self.sweep = self._build(scheduler, vllm_config, spec, environ, exchange)
        except BaseException as err:
            if exchange is not None:  # the other ranks stop at their first boundary
                try:
                    exchange.post_failure(_message(err))
                except Exception:
                    logger.exception("[kvwarm sweep] telling the other ranks failed")
            self.fail(err)
            raise

    def _build(self, scheduler, vllm_config, spec: dict, environ, exchange) -> Sweep:
        max_model_len = vllm_config.model_config.max_model_len
        inputs = read_inputs(spec["points"], environ, max_model_len)
        settings, writer, meta = inputs.settings, self.writer, self.writer.meta
        meta.enabled, meta.dataset = settings.warmup != "off", inputs.dataset
        meta.giant_kv_repeats, meta.giant_kv_threshold = settings.steady_steps, settings.giant_kv_threshold
        writer.total = len(inputs.points)
        max_seqs = vllm_config.scheduler_config.max_num_seqs
        too_wide = sorted({p.batch_size for p in inputs.points if p.batch_size > max_seqs})
        if too_wide:
            raise PointsFileError(
                f"points file {spec['points']}: batch size(s) {too_wide} exceed max_num_seqs "
                f"{max_seqs}, so no step could run such a batch; start the engine with "
                f"--max-num-seqs {too_wide[-1]} or more"
            )
        kvm = scheduler.kv_cache_manager
        decision = decide_state_mode(kvm, group_layouts(kvm), environ)
        if decision.reason == v.STATE_MODE_INVALID:
            raise SettingsError(f"{STATE_ENV}={decision.requested!r} is not one of {', '.join(v.STATE_MODES)}")
        reason = model_gate_reason(vllm_config, settings.warmup) or decision.reason
        chain_text = None
        if reason is None:
            encode = _tokenizer_encode(vllm_config.model_config)
            need = max(p.tokens_spanned(settings.steady_steps) for p in inputs.points)
            reason = content_reason(inputs.conversations, encode, min(need, max_model_len))
            chain_text = ChainText(inputs.conversations, encode)
        meta.state_mode_requested = decision.requested
        meta.state_mode = decision.mode if reason is None else None
        meta.warm_eligible, meta.skip_reason = reason is None, reason
        meta.batch_semantics, meta.global_batch_factor = "per_rank", self.layout.data_parallel_size
        if reason is not None:
            writer.progress(f"warm-up skipped ({reason}): every point on fake KV")
        config = SweepConfig(
            steady_steps=settings.steady_steps,
            max_model_len=max_model_len,
            state_mode=decision.mode if reason is None else None,
            state_lending=decision.lending,
            real=reason is None,
            fake_regime=v.LEGACY if settings.warmup == "off" else v.FAKE_FALLBACK,
            giant_kv_threshold=settings.giant_kv_threshold,
        )
        return Sweep(
            inputs.points, chain_text, config, progress=writer.progress, on_row=self._on_row, exchange=exchange
        )

    def _on_row(self, row) -> None:
        self.writer.rows.append(row)
        self.writer.meta.stages = list(self.sweep.stages)
        self.writer.write(v.RUNNING)

    def finish(self) -> None:
        """After the controller is done: the final artifact."""
        self.writer.meta.stages = list(self.sweep.stages)
        self.writer.meta.reset_prefix_cache = self.sweep.reset_prefix_cache_ok
        self.writer.write(v.COMPLETE)
        self.finished = True
        self.writer.progress(f"wrote {self.writer.artifact_path}")

    def fail(self, err: BaseException) -> None:
        """Record why the sweep stopped, keeping every row measured before. Never raises:
        a failure to write the record is logged."""
        if self.finished:
            return
        self.finished = True
        message = _message(err)
        logger.error("[kvwarm sweep] failed: %s", message)
        try:
            self.writer.write(v.FAILED, message)
        except ArtifactWriteError as write_err:
            logger.error("[kvwarm sweep] %s", write_err)


def _message(err: BaseException) -> str:
    return str(err) if isinstance(err, INPUT_ERRORS) else f"{type(err).__name__}: {err}"
