"""One sweep inside an engine: inputs -> gate -> controller -> artifact.

The scheduler adapter builds a SweepRun when the engine's additional_config carries
{"kvwarm_sweep": {"points": FILE, "out": DIR}}, so the sweep runs wherever the scheduler
does: in the caller's process or in vLLM's engine-core process (`vllm serve`, or the
sweep command with VLLM_ENABLE_V1_MULTIPROCESSING=1). The artifact is rewritten after
every point, and on any failure with status "failed", the error and every row measured.
Under data parallel each rank writes OUT/dp<R>/ and the ranks meet through an exchange
(sweep.exchange.make_exchange), which also carries each write to the combined view
OUT/sweep.json (record.combined) on rank 0's side. With DYN_FPM_BENCHMARK_OUTPUT_PATH set,
the last rank to finish also writes Dynamo's self-benchmark artifact there (record.export),
where OUT is one folder every rank sees.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from vllm.logger import init_logger

from ..kv.layout import ATTENTION, group_layouts
from ..kv.prefix import prefix_unit
from ..kv.state_mode import STATE_ENV, decide_state_mode, refusal_hint
from ..record import export
from ..record import vocabulary as v
from ..record.files import write_atomically
from ..record.shape import GraphConfig
from ..record.trace_reader import TraceError, read_trace
from .controller import Sweep
from .dataset import COLLECTION_POOL, ChainText, DatasetError, load_halves
from .engine_record import kv_cache_tokens, run_record
from .exchange import make_exchange
from .gate import content_reason, model_gate_reason
from .graphs import graph_config
from .grid import CAPS, GridLimits, decode_grid, points_file, prefill_grid
from .limits import SweepRefused, check_engine, check_points
from .loop import loop_record, trailing_steps
from .plan import SweepConfig
from .points import DecodePoint, PointsFileError, PrefillPoint, load_points
from .ranks import rank_layout
from .settings import DATASET_ENV, Settings, SettingsError, read_settings
from .trace_grid import check_engine as check_trace_engine
from .trace_grid import trace_grid
from .writer import ArtifactWriteError, ArtifactWriter

logger = init_logger(__name__)

CONFIG_KEY = "kvwarm_sweep"
GRID_FILE = "grid.json"  # a generated grid, beside the artifact (grid_path)
INPUT_ERRORS = (PointsFileError, SettingsError, DatasetError, SweepRefused, TraceError)
# Prefill points' new tokens come from the dataset's held-out half, as much of it as this
# (tails cycle through it, each led by tokens of its own).
TAIL_TOKENS = 8192


@dataclass
class SweepInputs:
    settings: Settings
    points: list[DecodePoint | PrefillPoint]
    conversations: list[str] | None  # None when warm-up is off (no chains, no text)
    dataset: dict | None  # the artifact's record of the file
    held_out: list[str] | None = None  # the dataset's other half (prefill points' new tokens)


def read_inputs(
    points_path: str | None, environ=None, max_model_len: int = sys.maxsize, trailing_steps: int = 0
) -> SweepInputs:
    """Every input a sweep reads before it touches the engine; raises one of INPUT_ERRORS.
    A dataset problem is an error, not a reason to measure on fake KV: a mistyped path
    must not silently turn a real-KV table into a fake one. Without a points file (a
    generated grid) the points come once the engine is known. `trailing_steps`: the
    engine loop's untimed decode steps (sweep.loop)."""
    environ = os.environ if environ is None else environ
    settings = read_settings(environ)
    steps = settings.steady_steps + trailing_steps
    points = (
        load_points(points_path, max_model_len=max_model_len, steady_steps=steps) if points_path is not None else []
    )
    if settings.warmup == "off":
        return SweepInputs(settings, points, None, None)
    if not settings.dataset:
        raise DatasetError(
            f"{DATASET_ENV} is not set; point it at a ShareGPT-format JSON file "
            "(or set DYN_BENCH_KV_WARMUP=off to measure on fake KV)"
        )
    conversations, held_out, digest = load_halves(settings.dataset)
    dataset = {
        "path": str(settings.dataset),
        "sha256": digest,
        "collection_pool": COLLECTION_POOL,
        "conversations": len(conversations),
    }
    return SweepInputs(settings, points, conversations, dataset, held_out)


def chain_depth_needed(point, decode_steps: int, kv_cache_manager) -> int:
    """Tokens of chain text a point needs: a decode point's longest request (over its
    `decode_steps`, SweepConfig.decode_steps), a prefill point's deepest prefix."""
    if isinstance(point, PrefillPoint):
        return max(
            point.prefixes(prefix_unit(group_layouts(kv_cache_manager), kv_cache_manager.block_pool.hash_block_size))
        )
    return point.tokens_spanned(decode_steps)


def tail_tokens(texts: list[str], encode) -> list[int] | None:
    """Up to TAIL_TOKENS tokens of the held-out half (None where it is empty)."""
    tokens: list[int] = []
    for text in texts:
        tokens += encode(text)
        if len(tokens) >= TAIL_TOKENS:
            break
    return tokens[:TAIL_TOKENS] or None


def _tokenizer_encode(model_config):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        model_config.tokenizer,
        revision=model_config.tokenizer_revision,
        trust_remote_code=model_config.trust_remote_code,
    )
    return lambda text: tokenizer.encode(text, add_special_tokens=False)


def _positive(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def grid_settings(spec_grid, graphs: GraphConfig) -> tuple[dict, GraphConfig]:
    """The caps of a generated grid and the capture sizes its axes are laid around: the
    engine's, or "capture_sizes" given (a target deployment's, e.g. planned on a CPU host,
    whose platform clears them); the rows' graph record stays this engine's."""
    asked = dict(spec_grid) if isinstance(spec_grid, dict) else {}
    sizes = asked.pop("capture_sizes", None)
    problem = set(asked) - set(CAPS) or not all(_positive(n) for n in asked.values())
    if problem or (sizes is not None and not (isinstance(sizes, list) and all(_positive(n) for n in sizes))):
        raise SettingsError(
            f'"grid": {spec_grid!r}: the grid takes true, or caps among {", ".join(CAPS)} (positive integers) '
            'and "capture_sizes" (a list of positive integers)'
        )
    if sizes is not None:
        sizes = tuple(sorted(set(sizes)))
        graphs = replace(
            graphs,
            decode_capture_sizes=tuple(s for s in sizes if s <= graphs.max_num_seqs),
            prefill_capture_sizes=sizes,
        )
    return {**CAPS, **asked}, graphs


def grid_path(out: str) -> Path:
    """Where a --grid sweep writes its generated grid: in its output folder."""
    return Path(out) / GRID_FILE


def new_writer(out: str, config: dict, environ, rank_out: str | None = None, layout=None) -> ArtifactWriter:
    """The artifact writer of a run, with what the environment asked for recorded."""
    writer = ArtifactWriter(out, config, rank_out, layout)
    writer.meta.state_mode_requested = environ.get(STATE_ENV)
    return writer


class SweepRun:
    """Built by the scheduler adapter from its own config; `sweep` is what it drives."""

    def __init__(self, scheduler, spec: dict, environ=None):
        environ = os.environ if environ is None else environ
        if not isinstance(spec, dict) or "out" not in spec or sum(_sources(spec)) != 1:
            raise SettingsError(
                f'additional_config["{CONFIG_KEY}"] must be {{"points": FILE, "out": DIR}}, '
                f'{{"grid": true, "out": DIR}} or {{"grid_from": TRACE, "out": DIR}} (and optionally '
                f'"engine_args": [ARG, ...]), got {spec!r}'
            )
        vllm_config = scheduler.vllm_config
        parallel = vllm_config.parallel_config
        self.layout = rank_layout(parallel)
        size, rank = self.layout.data_parallel_size, self.layout.data_parallel_rank
        rank_out = str(Path(spec["out"]) / f"dp{rank}") if size > 1 else None
        points = spec.get("points") or str(grid_path(spec["out"]))
        config = {"points": points, "model": vllm_config.model_config.model}
        self.writer = new_writer(spec["out"], config, environ, rank_out, self.layout)
        self.finished = False
        self.environ = environ
        exchange = None
        try:
            export.remove_stale(environ, rank)  # as Dynamo does: no earlier run's file stays there
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
        trailing = trailing_steps(vllm_config)
        inputs = read_inputs(spec.get("points"), environ, max_model_len, trailing)
        settings, writer, meta = inputs.settings, self.writer, self.writer.meta
        decode_steps = settings.steady_steps + trailing  # what a decode point's requests run
        kvm = scheduler.kv_cache_manager
        graphs = graph_config(vllm_config)
        meta.cudagraph = graphs.record()
        meta.engine_loop = loop_record(scheduler)
        if spec.get("grid") or spec.get("grid_from"):
            inputs.points = self._grid(scheduler, graphs, decode_steps, spec)
        meta.enabled, meta.dataset = settings.warmup != "off", inputs.dataset
        meta.giant_kv_repeats, meta.giant_kv_threshold = settings.steady_steps, settings.giant_kv_threshold
        writer.total = len(inputs.points)
        check_engine(vllm_config)
        check_points(inputs.points, vllm_config, kvm, f"points file {spec.get('points') or GRID_FILE}")
        decision = decide_state_mode(kvm, group_layouts(kvm), environ)
        if decision.reason == v.STATE_MODE_INVALID:
            raise SettingsError(f"{STATE_ENV}={decision.requested!r} is not one of {', '.join(v.STATE_MODES)}")
        reason = model_gate_reason(vllm_config, settings.warmup) or decision.reason
        chain_text, tails = None, None
        if reason is None:
            encode = _tokenizer_encode(vllm_config.model_config)
            need = max(chain_depth_needed(p, decode_steps, kvm) for p in inputs.points)
            reason = content_reason(inputs.conversations, encode, min(need, max_model_len))
            chain_text = ChainText(inputs.conversations, encode)
            tails = tail_tokens(inputs.held_out or [], encode)
        meta.state_mode_requested = decision.requested
        meta.state_mode = decision.mode if reason is None else None
        meta.warm_eligible, meta.skip_reason = reason is None, reason
        meta.batch_semantics, meta.global_batch_factor = "per_rank", self.layout.data_parallel_size
        if reason is not None:
            hint = refusal_hint(reason)
            writer.progress(f"warm-up skipped ({reason}): every point on fake KV" + (f"; {hint}" if hint else ""))
        config = SweepConfig(
            steady_steps=settings.steady_steps,
            max_model_len=max_model_len,
            state_mode=decision.mode if reason is None else None,
            state_lending=decision.lending,
            real=reason is None,
            fake_regime=v.LEGACY if settings.warmup == "off" else v.FAKE_FALLBACK,
            giant_kv_threshold=settings.giant_kv_threshold,
            gc_hold=settings.gc_hold,
            trailing_steps=trailing,
        )
        return Sweep(
            inputs.points,
            chain_text,
            config,
            progress=writer.progress,
            on_row=self._on_row,
            exchange=exchange,
            tail_tokens=tails,
            vocab_size=vllm_config.model_config.get_vocab_size(),
            graphs=graphs,
        )

    def _grid(self, scheduler, graphs, decode_steps: int, spec: dict) -> list:
        """The generated grid (around the capture sizes, or over a trace's shapes), less any
        point this engine cannot run as one step; written to OUT/grid.json (a points file to
        edit and pass back) and recorded."""
        kvm, vllm_config = scheduler.kv_cache_manager, scheduler.vllm_config
        layouts = group_layouts(kvm)
        attention = [g.block_size for g in layouts if g.kind == ATTENTION] or [kvm.block_pool.hash_block_size]
        limits = GridLimits(
            max_model_len=vllm_config.model_config.max_model_len,
            steady_steps=decode_steps,
            kv_cache_tokens=kv_cache_tokens(scheduler) or 0,
            num_blocks=scheduler.kv_cache_config.num_blocks,
            block_size=max(attention),
            prefix_unit=prefix_unit(layouts, kvm.block_pool.hash_block_size),
        )
        points = []
        caps, axes = grid_settings(spec.get("grid"), graphs)
        trace = None
        if spec.get("grid_from"):
            trace = read_trace(spec["grid_from"])
            check_trace_engine(trace, self.writer.run, self.layout.as_dict(), vllm_config.model_config.model)
            laid = trace_grid(trace, axes, limits, spec.get("grid_caps"))
        else:
            laid = prefill_grid(axes, limits, caps) + decode_grid(axes, limits, caps)
        for point in laid:
            try:
                check_points([point], vllm_config, kvm, GRID_FILE)
            except PointsFileError:
                continue  # beyond what this engine runs as one step
            points.append(point)
        path = grid_path(self.writer.root)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, json.dumps(points_file(points), indent=2).encode())
        self.writer.meta.grid = {
            "points_file": str(path),
            "decode_batches": sorted({p.batch_size for p in points if isinstance(p, DecodePoint)}),
            "prefill_tokens": sorted({p.total_prefill_tokens for p in points if isinstance(p, PrefillPoint)}),
            "points": len(points),
            **({"trace": str(trace.root)} if trace else {}),
        }
        where = f"over the shapes of the trace {trace.root}" if trace else "around the capture sizes"
        self.writer.progress(f"generated a grid of {len(points)} point(s) {where}: {path}")
        return points

    def _on_row(self, row) -> None:
        self.writer.rows.append(row)
        self.writer.meta.stages = list(self.sweep.stages)
        self.writer.write(v.RUNNING)

    def finish(self) -> None:
        """After the controller is done: the final artifact."""
        self.writer.meta.stages = list(self.sweep.stages)
        self.writer.meta.reset_prefix_cache = self.sweep.reset_prefix_cache_ok
        self.writer.meta.gc = self.sweep.gc_record()
        self.writer.write(v.COMPLETE)
        self.finished = True
        self.writer.progress(f"wrote {self.writer.artifact_path}")
        self._export_for_dynamo()

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
        self._export_for_dynamo()

    def _export_for_dynamo(self) -> None:
        """Dynamo's artifact at DYN_FPM_BENCHMARK_OUTPUT_PATH, once every rank is done; a
        failure to write it is logged, never raised (the sweep's own record is written)."""
        try:
            for path in export.write_if_asked(self.writer.root, self.layout.data_parallel_size, self.environ):
                self.writer.progress(f"wrote {path} (Dynamo's self-benchmark artifact)")
        except Exception as err:  # noqa: BLE001  (any failure here must not reach the engine)
            logger.error("[kvwarm sweep] writing %s failed: %s: %s", export.OUTPUT_ENV, type(err).__name__, err)


def _sources(spec: dict) -> tuple[bool, bool, bool]:
    """Which of the points' sources the config names: a points file, a grid, a trace."""
    return "points" in spec, bool(spec.get("grid")), bool(spec.get("grid_from"))


def _message(err: BaseException) -> str:
    return str(err) if isinstance(err, INPUT_ERRORS) else f"{type(err).__name__}: {err}"
