"""One sweep inside an engine: inputs -> gate -> controller -> artifact.

The scheduler adapter builds a SweepRun when the engine's additional_config carries
{"kvwarm_sweep": {"points": FILE, "out": DIR}}, so the sweep runs wherever the scheduler
does: in the caller's process or in vLLM's engine-core process (`vllm serve`, or the
sweep command with VLLM_ENABLE_V1_MULTIPROCESSING=1). The artifact is rewritten after
every point, and on any failure with status "failed", the error and every row measured;
a point's line is logged at most once per sweep.progress.LOG_SECONDS.
Under data parallel each rank writes OUT/dp<R>/ and the ranks meet through an exchange
(sweep.exchange.make_exchange), which also carries each write to the combined view
OUT/sweep.json (record.combined) on rank 0's side. A generated grid (--grid) is laid once
the ranks agree on the pool (sweep.controller), the same on every rank; rank 0 writes it.
With "resume": true the run continues the sweep in its folder (sweep.resuming), with "ab":
true it measures every point on real and fake KV (sweep.ab).
A grid from a trace (--grid-from) is laid the same way: each rank reads the trace's shapes
itself, line by line, and keeps only their counts (sweep.trace_grid.read_shapes), since the
laying needs the pool the ranks agree on and sharing a laid grid would cross the exchange.
With DYN_FPM_BENCHMARK_OUTPUT_PATH set, whichever rank ends up holding every rank's final
artifact (rank 0 through the store, the last rank to finish through files, the only rank
alone) writes Dynamo's self-benchmark artifact there (record.export.write.write_final).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from vllm.logger import init_logger

from ..kv.layout import ATTENTION, group_layouts
from ..kv.prefix import prefix_unit
from ..kv.state_mode import STATE_ENV, decide_state_mode, refusal_hint
from ..record import vocabulary as v
from ..record.export import write as dynamo_files
from ..record.files import write_atomically
from ..record.trace.reader import TraceError
from .ab import AB_RECORD
from .controller import Sweep
from .dataset import ChainText, DatasetError
from .exchange import make_exchange
from .gate import content_reason, model_gate_reason
from .graphs import graph_config
from .grid import GridLimits, decode_grid, mixed_grid, mixed_note, points_file, prefill_grid
from .grid_settings import GridLaying, grid_settings, wants_grid
from .inputs import EMPTY_HELD_OUT, SweepInputs, chain_depth_needed, read_inputs, tail_tokens, tokenizer_encode
from .limits import EngineLimits, GridFit, SweepRefused, check_engine, check_points
from .plan import SweepConfig, SweepSetup, plan_rungs, points_digest
from .points import DecodePoint, PointsFileError, PrefillPoint, takes_tails
from .progress import PointLog
from .provenance import loop_record, rank_layout, run_record, trailing_steps
from .resume import POINTS_DIGEST, ResumeError
from .resuming import Resuming
from .settings import Settings, SettingsError, read_settings
from .trace_grid import check_engine as check_trace_engine
from .trace_grid import read_shapes, trace_grid
from .writer import ArtifactWriteError, ArtifactWriter

logger = init_logger(__name__)

CONFIG_KEY = "kvwarm_sweep"
GRID_FILE = "grid.json"  # a generated grid, beside the artifact (grid_path)
INPUT_ERRORS = (PointsFileError, SettingsError, DatasetError, SweepRefused, TraceError, ResumeError)


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
                f'"engine_args": [ARG, ...], "resume": true, "ab": true), got {spec!r}'
            )
        vllm_config = scheduler.vllm_config
        parallel = vllm_config.parallel_config
        self.layout = rank_layout(parallel)
        size, rank = self.layout.data_parallel_size, self.layout.data_parallel_rank
        rank_out = str(Path(spec["out"]) / f"dp{rank}") if size > 1 else None
        points = spec.get("points") or str(grid_path(spec["out"]))
        config = {"points": points, "model": vllm_config.model_config.model}
        self.writer = new_writer(spec["out"], config, environ, rank_out, self.layout)
        self.points_log = PointLog(lambda line: self.writer.progress(line, left_too=False))
        self.finished = False
        self.environ = environ
        self._stages_logged = 0  # the controller's stages in the record so far
        self._ab, self._resuming = bool(spec.get("ab")), None
        exchange = None
        if size == 1:
            self.writer.before_final = lambda artifact: self._export_final([artifact])
        try:
            dynamo_files.remove_stale(environ, rank)  # as Dynamo does: no earlier run's file stays there
            settings = read_settings(environ)
            self._plan = plan_inputs(spec, settings, environ)
            if spec.get("resume"):  # the record as the first boot wrote it, rows and all
                self._resuming = Resuming(self.writer, self._ab)
            else:
                self.writer.meta.plan = dict(self._plan)
            exchange = make_exchange(self.layout, spec["out"], parallel, settings, self._plan)
            exchange.on_final = self._export_final
            self.writer.exchange, self.writer.meta.exchange = exchange, exchange.record()
            self._say_where_dynamo_goes(exchange)
            self._run = run_record(scheduler, spec.get("engine_args"))
            if self._resuming is None:
                self.writer.run.update(self._run)
                self.writer.start_log()  # a resumed one's once it is held to the first boot's (_build)
            self.writer.write(v.RUNNING)  # replaces an earlier run's artifact in this folder (or resumes it)
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
        settings, meta = inputs.settings, self.writer.meta
        if self._ab and settings.warmup == "off":
            raise SettingsError("--ab measures every point on real and fake KV: unset DYN_BENCH_KV_WARMUP=off")
        if self._resuming is not None:  # before the first point
            model, loop = vllm_config.model_config.model, loop_record(scheduler)
            self._resuming.check(self._plan, model, self._run, self.layout.as_dict(), loop, inputs.dataset)
            self.writer.start_log(self._resuming.boot)
        kvm = scheduler.kv_cache_manager
        graphs = graph_config(vllm_config)
        meta.cudagraph = graphs.record()
        meta.engine_loop = loop_record(scheduler)
        meta.enabled, meta.dataset = settings.warmup != "off", inputs.dataset
        meta.giant_kv_repeats, meta.giant_kv_threshold = settings.steady_steps, settings.giant_kv_threshold
        meta.settle_steps = settings.settle_steps
        check_engine(vllm_config)
        decision = decide_state_mode(kvm, group_layouts(kvm), environ)
        if decision.reason == v.STATE_MODE_INVALID:
            raise SettingsError(f"{STATE_ENV}={decision.requested!r} is not one of {', '.join(v.STATE_MODES)}")
        meta.state_mode_requested = decision.requested
        reason = model_gate_reason(vllm_config, settings.warmup) or decision.reason
        state_mode = decision.mode if reason is None else None  # None: on fake KV (or no state)
        encode = tokenizer_encode(vllm_config.model_config) if reason is None else None
        common = {
            "progress": self.writer.progress,
            "on_row": self._on_row,
            "exchange": exchange,
            "vocab_size": vllm_config.model_config.get_vocab_size(),
            "graphs": graphs,
            "resumed": self._resuming.resumed() if self._resuming else None,
            "on_resume": self._resuming.kept if self._resuming else None,
        }
        if wants_grid(spec) or spec.get("grid_from"):
            caps, axes = grid_settings(spec.get("grid") or True, graphs)  # bad caps: refused before it serves
            trace, found, skip = None, None, spec.get("grid_skip_seconds", 0.0)
            if spec.get("grid_from"):  # read before it serves, held to this engine: its shapes kept, counted
                trace, found = read_shapes(spec["grid_from"], skip)
                check_trace_engine(trace, self.writer.run, self.layout.as_dict(), vllm_config.model_config.model)

            def lay_grid(pool: dict) -> SweepSetup:
                steps = settings.point_steps + trailing
                laying = GridLaying(steps, caps, axes, pool, trace, found, spec.get("grid_caps"), skip)
                points = self._grid(scheduler, laying, state_mode)
                self._points_known(points)
                return self._setup(scheduler, inputs, points, reason, decision, encode, trailing)

            provisional = SweepConfig(
                settings.steady_steps,
                max_model_len,
                real=False,
                gc_hold=settings.gc_hold,
                trailing_steps=trailing,
                settle_steps=settings.settle_steps,
            )
            return Sweep([], None, provisional, lay_grid=lay_grid, **common)
        source, steps = f"points file {spec['points']}", settings.point_steps + trailing
        check_points(inputs.points, vllm_config, kvm, source, state_mode=state_mode, decode_steps=steps)
        self._points_known(inputs.points)
        setup = self._setup(scheduler, inputs, inputs.points, reason, decision, encode, trailing)
        return Sweep(setup.points, setup.chain_tokens, setup.config, tail_tokens=setup.tail_tokens, **common)

    def _setup(self, scheduler, inputs: SweepInputs, points, reason, decision, encode, trailing: int) -> SweepSetup:
        """What the sweep measures once its points are known: the content gate (enough text
        for the deepest chain), the chains' and tails' text, the config. `trailing`: the
        engine loop's untimed decode steps (sweep.provenance)."""
        vllm_config, settings, meta = scheduler.vllm_config, inputs.settings, self.writer.meta
        max_model_len = vllm_config.model_config.max_model_len
        self.writer.total = len(points) * (2 if self._ab else 1)
        chain_text, tails = None, None
        if reason is None:
            need = max(
                (chain_depth_needed(p, settings.point_steps + trailing, scheduler.kv_cache_manager) for p in points),
                default=0,
            )
            reason = content_reason(inputs.conversations, encode, min(need, max_model_len))
            chain_text = ChainText(inputs.conversations, encode)
            tails = tail_tokens(inputs.held_out or [], encode)
            if tails is None and takes_tails(points):
                raise DatasetError(EMPTY_HELD_OUT.format(path=settings.dataset))
        meta.state_mode = decision.mode if reason is None else None
        meta.warm_eligible, meta.skip_reason = reason is None, reason
        meta.batch_semantics, meta.global_batch_factor = "per_rank", self.layout.data_parallel_size
        if reason is not None and self._ab:
            raise SettingsError(
                f"--ab measures every point on real and fake KV, and this model gets no real KV ({reason}); "
                "set DYN_BENCH_KV_WARMUP=force where the gate's heuristics skip the model, or sweep without --ab"
            )
        meta.ab = AB_RECORD if self._ab else None
        if reason is not None:
            hint = refusal_hint(reason)
            self.writer.progress(f"warm-up skipped ({reason}): every point on fake KV" + (f"; {hint}" if hint else ""))
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
            settle_steps=settings.settle_steps,
            ab=self._ab,
        )
        if chain_text is not None:  # drawn (tokenized) now, not in the schedule() that builds a rung
            for rung in plan_rungs(points, config.decode_steps, max_model_len):
                for i in range(rung.batch_size):
                    chain_text(i, rung.depth)  # a decode rung's, as planned before any trim
        return SweepSetup(points, chain_text, config, tails)

    def _grid(self, scheduler, laying: GridLaying, state_mode: str | None) -> list:
        """The generated grid (around the capture sizes, or over a trace's shapes) in the
        laying's pool (the ranks' smallest: sweep.meetings.pool_record), less any point such
        an engine cannot run as one step; rank 0 writes it to OUT/grid.json (a points file to
        edit and pass back), every rank records it. `state_mode`: the sweep's hand-off of
        recurrent state (None on fake KV)."""
        pool, trace = laying.pool, laying.trace
        kvm, vllm_config = scheduler.kv_cache_manager, scheduler.vllm_config
        layouts = group_layouts(kvm)
        attention = [g.block_size for g in layouts if g.kind == ATTENTION] or [kvm.block_pool.hash_block_size]
        limits = GridLimits(
            max_model_len=vllm_config.model_config.max_model_len,
            steady_steps=laying.decode_steps,
            kv_cache_tokens=pool["kv_cache_tokens"],
            num_blocks=pool["num_blocks"],
            block_size=max(attention),
            prefix_unit=prefix_unit(layouts, kvm.block_pool.hash_block_size),
            attention_only=all(g.kind == ATTENTION for g in layouts),
            state_mode=state_mode,
            continuations=vllm_config.scheduler_config.enable_chunked_prefill is not False
            and self.layout.data_parallel_size == 1,
        )
        note = mixed_note(limits)
        if trace is not None:
            laid = trace_grid(laying.shapes, laying.axes, limits, laying.trace_caps)
        else:
            axes, caps = laying.axes, laying.caps
            laid = prefill_grid(axes, limits, caps) + decode_grid(axes, limits, caps) + mixed_grid(axes, limits, caps)
        # each point kept where it fits beside those kept before it (a deeper prefix deepens
        # its rung-mates' chains); the others are beyond what this engine runs as one step
        usable = pool["usable_blocks"]
        fit = GridFit(EngineLimits.of(vllm_config, kvm, usable, state_mode, laying.decode_steps), GRID_FILE)
        points = [point for point in laid if fit.add(point)]
        if not points:
            raise PointsFileError(
                f"{GRID_FILE}: the generated grid holds no point this engine can run as one step (max_model_len "
                f"{limits.max_model_len}, {limits.num_blocks} KV blocks of {limits.block_size} tokens, max_num_seqs "
                f"{vllm_config.scheduler_config.max_num_seqs}); give the engine a larger --max-model-len or more KV "
                "cache memory, or pass --points"
            )
        path = grid_path(self.writer.root)
        if self.layout.data_parallel_rank == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(path, json.dumps(points_file(points), indent=2).encode())
        self.writer.meta.grid = {
            "points_file": str(path),
            "decode_batches": sorted({p.batch_size for p in points if isinstance(p, DecodePoint)}),
            "prefill_tokens": sorted({p.total_prefill_tokens for p in points if isinstance(p, PrefillPoint)}),
            "points": len(points),
            "mixed_note": note,  # why no mixed point was laid (null: laid where they fit)
            "pool": dict(pool),
            **({"trace": str(trace.root), "skip_seconds": laying.trace_skip_seconds} if trace else {}),
        }
        where = f"over the shapes of the trace {trace.root}" if trace else "around the capture sizes"
        self.writer.progress(
            f"generated a grid of {len(points)} point(s) {where} in a pool of {pool['num_blocks']} block(s)"
            + (
                f" (the smallest of the {self.layout.data_parallel_size} ranks')"
                if self.layout.data_parallel_size > 1
                else ""
            )
            + (f": {path}" if self.layout.data_parallel_rank == 0 else f" (rank 0 writes it to its OUT/{GRID_FILE})")
            + (f"; no mixed points: {note}" if note else "")
        )
        return points

    def _points_known(self, points: list) -> None:
        """The points the sweep measures, recorded (and held to the first boot's on a resume)."""
        if self._resuming is not None:
            self._resuming.points(points)
        else:
            self.writer.meta.plan[POINTS_DIGEST] = points_digest(points)

    def _log_stages(self) -> None:
        """The rungs built since the last row, into the record."""
        for stage in self.sweep.stages[self._stages_logged :]:
            self.writer.add_stage(stage)
        self._stages_logged = len(self.sweep.stages)

    def _on_row(self, row) -> None:
        self._log_stages()
        self.writer.add_row(row, self.sweep.point_index)
        self.points_log.row(row, len(self.writer.rows), self.writer.total)  # a line at most every LOG_SECONDS

    def finish(self) -> None:
        """After the controller is done: the final artifact."""
        self._log_stages()
        self.writer.meta.reset_prefix_cache = self.sweep.reset_prefix_cache_ok
        self.writer.meta.gc = self.sweep.gc_record()
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

    def _say_where_dynamo_goes(self, exchange) -> None:
        """With DYN_FPM_BENCHMARK_OUTPUT_PATH set: where Dynamo's artifact will be, and who writes it."""
        out = self.environ.get(dynamo_files.OUTPUT_ENV)
        if not out or self.layout.data_parallel_size == 1:
            return
        who = {"store": "rank 0, on its node, from what the ranks' store carried", "files": "the last rank to finish"}
        self.writer.progress(
            f"{dynamo_files.OUTPUT_ENV}={out}: once every rank is done, {who[exchange.kind]} writes Dynamo's artifact "
            "there for every rank (<stem>_dp<R> for rank R; with both kinds, both at the path and each "
            "kind at <stem>_prefill / <stem>_decode)"
        )

    def _export_final(self, ranks: list[dict | None]) -> None:
        """Dynamo's artifact at DYN_FPM_BENCHMARK_OUTPUT_PATH, from every rank's final artifact
        (the exchange calls this on the rank that holds them all, once they are final); what
        it writes, or why it writes nothing, is logged, never raised."""
        try:
            for path in dynamo_files.write_final(self.writer.root, ranks, self.environ):
                self.writer.progress(f"wrote {path} (Dynamo's self-benchmark artifact)")
        except Exception as err:  # noqa: BLE001  (any failure here must not reach the engine)
            logger.error(
                "[kvwarm sweep] nothing written at %s: %s: %s", dynamo_files.OUTPUT_ENV, type(err).__name__, err
            )


def plan_inputs(spec: dict, settings: Settings, environ) -> dict:
    """What every rank's plan is made from, which the ranks' store checks when a rank joins:
    the points file's content (each node may hold its own copy), the grid asked for, and the
    settings that shape the plan and the rows."""
    digest = None
    if spec.get("points"):
        try:
            digest = hashlib.sha256(Path(spec["points"]).read_bytes()).hexdigest()
        except OSError:
            digest = None  # the file's own error comes when it is read
    return {
        "points_sha256": digest,
        "grid": spec.get("grid"),
        "grid_from": bool(spec.get("grid_from")),  # each node may hold its own copy of the trace
        "grid_caps": spec.get("grid_caps"),
        "grid_skip_seconds": spec.get("grid_skip_seconds"),
        "warmup": settings.warmup,
        "steady_steps": settings.steady_steps,
        "settle_steps": settings.settle_steps,
        "giant_kv_threshold": settings.giant_kv_threshold,
        "gc_hold": settings.gc_hold,
        "state_mode": environ.get(STATE_ENV),
        "ab": bool(spec.get("ab")),
    }


def _sources(spec: dict) -> tuple[bool, bool, bool]:
    """Which of the points' sources the config names: a points file, a grid, a trace."""
    return "points" in spec, wants_grid(spec), bool(spec.get("grid_from"))


def _message(err: BaseException) -> str:
    return str(err) if isinstance(err, INPUT_ERRORS) else f"{type(err).__name__}: {err}"
