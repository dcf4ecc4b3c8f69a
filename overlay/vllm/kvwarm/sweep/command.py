"""`python -m vllm.kvwarm sweep (--points FILE | --grid | --grid-from TRACE) --out DIR [--resume]
[--ab] [vLLM engine args]`: a sweep of prefill and decode points on the real engine, writing
every row as it is measured.

--resume continues a sweep that was stopped (killed, or failed) from its --out: what it is
held to before the engine starts (the plan's inputs, the model, the build, the dataset) is
checked here, the rest once the engine is up (sweep.resume); a complete sweep is left as it
is. --ab measures every point on real and fake KV in this one engine (sweep.ab).

Every input is checked before the engine starts; any failure still writes an artifact
(status "failed", the error, and every row measured before it). The sweep itself runs
inside the scheduler (sweep.run.SweepRun, configured through additional_config): by
default the engine core runs in this process and this command steps it; with
VLLM_ENABLE_V1_MULTIPROCESSING=1 it runs in vLLM's engine-core process, the way it runs
under `vllm serve`, and this command waits for the artifact to be complete.

The adapter (the scheduler class) is the one that matches the engine's loop: the command
resolves the engine's config with vLLM's own code first, then names KvWarmAsyncScheduler
where vLLM turned async scheduling on (its default on CUDA) and KvWarmScheduler where it is
off (the CPU platform turns it off); a --scheduler-cls given is kept, and the adapter
refuses one that does not match (sweep.provenance, vllm.kvwarm.scheduler.check_matches_loop).

With --data-parallel-size N > 1 the engine cores always run in vLLM's own processes (one
per rank; an in-process engine core cannot be data parallel), each rank writes OUT/dp<R>/,
and the command waits for the combined OUT/sweep.json to be final: its exit code is 0
only when every rank completed. `--data-parallel-backend ray` is refused where vLLM's platform
names no Ray device (the CPU platform): vLLM's Ray launcher could not place the ranks there.

Where its standard error is a terminal the command shows the sweep's rows on a progress bar
(planned and done, the rate, the time left: sweep.progress); elsewhere the engine's own lines
say it, one per LOG_SECONDS at most.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

from ..record import vocabulary as v
from ..record.combined import rank_path
from ..record.validate.match import given_model
from .exchange.files import SYNC_DIR
from .grid_settings import check_grid
from .inputs import read_inputs
from .points import check_budget
from .progress import ArtifactRows, Bar
from .resume import check_plan, read_record, record_path
from .run import CONFIG_KEY, INPUT_ERRORS, grid_path, new_writer, plan_inputs
from .settings import SettingsError
from .trace_grid import caps_of, check_given

POLL_SECONDS = 1.0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m vllm.kvwarm sweep",
        description="Prefill and decode step times at (batch, tokens, KV) points, with real KV.",
        epilog="Every other argument is a vLLM engine argument, as for `vllm serve` (e.g. --model DIR "
        "--max-model-len N --enforce-eager).",
    )
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument(
        "--points",
        help='{"schema_version":1,"decode":[{"total_kv_read_tokens":K,"batch_size":B}],'
        '"prefill":[{"total_prefill_tokens":N,"total_kv_read_tokens":P,"batch_size":B}]}',
    )
    what.add_argument(
        "--grid",
        nargs="?",
        const=True,
        type=_grid_setting,
        metavar="CAPS_JSON",
        help="no points file: a grid laid around the engine's CUDA-graph capture sizes (written to OUT/grid.json); "
        'optionally caps and sizes, e.g. \'{"decode_batches": 8, "kv_ladder": 4, "prefill_tokens": 6, '
        '"capture_sizes": [1, 2, 4, 8]}\'',
    )
    what.add_argument(
        "--grid-from",
        metavar="TRACE",
        help="no points file: a grid over the shapes a served-step trace ran (written to OUT/grid.json), on the "
        "engine arguments the trace ran with",
    )
    p.add_argument(
        "--grid-caps",
        type=_grid_caps,
        metavar="CAPS_JSON",
        help='with --grid-from: the axes\' caps, e.g. \'{"decode_batches": 6, "kv_ladder": 4, "prefill_batches": 2, '
        '"prefill_tokens": 4, "prefix_depths": 2}\'',
    )
    p.add_argument(
        "--skip-seconds",
        type=float,
        default=0.0,
        metavar="S",
        help="with --grid-from: leave out the steps that ended within the trace's first S seconds (a fresh "
        "server's warm-up), as validate --skip-seconds does",
    )
    p.add_argument("--out", required=True, help="folder for sweep.json, rows.jsonl, sweep.csv and sweep.png")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the sweep that was stopped in --out: its rows are kept, only the points it had not "
        "measured are, with the same points, model, build and engine arguments (anything else is refused)",
    )
    p.add_argument(
        "--ab",
        action="store_true",
        help="measure every point twice, back to back in this engine: on real KV and on fake KV (rows tagged "
        "by side; `report` of the one artifact gives the A/B)",
    )
    return p


def _grid_caps(text: str) -> dict:
    try:
        return caps_of(json.loads(text))
    except (json.JSONDecodeError, SettingsError) as err:
        raise argparse.ArgumentTypeError(f"--grid-caps {text!r}: {err}") from None


def _grid_setting(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"--grid {text!r} is not JSON: {err}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"--grid {text!r}: give a JSON object of caps, or --grid alone")
    return value


def engine_args_from(argv: list[str], spec: dict):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    p = FlexibleArgumentParser(prog="python -m vllm.kvwarm sweep")
    EngineArgs.add_cli_args(p)
    engine_args = EngineArgs.from_cli_args(p.parse_args(argv))
    engine_args.additional_config = {**(engine_args.additional_config or {}), CONFIG_KEY: spec}
    return engine_args


def engine_config(engine_args):
    """The engine's config as vLLM resolves it (as LLMEngine.from_engine_args would), with the
    adapter that matches its loop where no --scheduler-cls was given."""
    from vllm.usage.usage_lib import UsageContext

    from .provenance import adapter_for

    vllm_config = engine_args.create_engine_config(UsageContext.ENGINE_CONTEXT)
    scheduler_config = vllm_config.scheduler_config
    scheduler_config.scheduler_cls = scheduler_config.scheduler_cls or adapter_for(vllm_config)
    return vllm_config


def run(argv: list[str]) -> int:
    p = parser()
    args, engine_argv = p.parse_known_args(argv)
    if args.grid_caps and not args.grid_from:
        p.error("--grid-caps goes with --grid-from (--grid takes its caps itself)")
    if args.skip_seconds and not args.grid_from:
        p.error("--skip-seconds goes with --grid-from (it leaves a trace's first seconds out of the grid)")
    spec = {"out": str(Path(args.out).resolve()), "engine_args": engine_argv}  # recorded as given
    spec.update({"resume": True} if args.resume else {}, **({"ab": True} if args.ab else {}))
    if args.grid_from:
        spec.update(grid_from=str(Path(args.grid_from).resolve()), grid_caps=args.grid_caps)
        if args.skip_seconds:
            spec["grid_skip_seconds"] = args.skip_seconds
    else:
        spec.update({"grid": args.grid} if args.grid is not None else {"points": str(Path(args.points).resolve())})
    writer = new_writer(
        spec["out"],
        {"points": spec.get("points") or str(grid_path(spec["out"])), "engine_args": {"given": engine_argv}},
        os.environ,
    )

    def refused(message: str) -> int:
        """Bad input: said, and recorded in a new sweep's artifact (a resumed one's is left as it is)."""
        print(f"kvwarm sweep: {message}", file=sys.stderr)
        if not args.resume:
            writer.write(v.FAILED, message)
        return 2

    try:
        inputs = read_inputs(spec.get("points"))  # max_model_len is checked again once the engine knows it
        if args.ab and inputs.settings.warmup == "off":
            raise SettingsError("--ab measures every point on real and fake KV: unset DYN_BENCH_KV_WARMUP=off")
        if spec.get("points"):  # a given budget refuses mixed points before the engine loads
            check_budget(inputs.points, engine_args_from(engine_argv, spec).max_num_batched_tokens, spec["points"])
        if args.grid_from:  # a trace of another model or layout: refused before the engine loads
            check_given(spec["grid_from"], engine_args_from(engine_argv, spec), args.skip_seconds)
        elif args.grid is not None:
            check_grid(args.grid)  # the caps, before the engine loads the model
        if args.resume and resumable(spec, inputs, engine_argv) is None:
            return 0
    except INPUT_ERRORS as err:
        return refused(str(err))
    if not args.resume:
        writer.write(v.RUNNING)  # replaces any earlier run's artifact in --out
    else:  # the file exchange's records of the stopped launch, which this launch's ranks must not read
        shutil.rmtree(Path(spec["out"]) / SYNC_DIR, ignore_errors=True)
    engine_args = engine_args_from(engine_argv, spec)
    ray = ray_refusal(engine_args)
    if ray is not None:
        return refused(ray)
    if engine_args.data_parallel_size > 1:
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
            return refused(
                "--data-parallel-size > 1 needs the engine cores in vLLM's own processes; "
                "unset VLLM_ENABLE_V1_MULTIPROCESSING (or set it to 1)"
            )
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        print(
            f"kvwarm sweep: {engine_args.data_parallel_size} data-parallel ranks, each writing "
            f"{spec['out']}/dp<R>/; waiting for the combined {spec['out']}/sweep.json",
            flush=True,
        )
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm.v1.engine.llm_engine import LLMEngine

    artifact = Path(spec["out"]) / v.ARTIFACT
    try:
        engine = LLMEngine.from_vllm_config(engine_config(engine_args), disable_log_stats=engine_args.disable_log_stats)
    except Exception:
        # Input found wrong once the engine knew max_model_len and the layout: the sweep
        # (in this process or the engine core's) recorded why in the artifact.
        recorded = _recorded(spec["out"], engine_args.data_parallel_size)
        if recorded is None or recorded["status"] != v.FAILED:
            raise
        print(f"kvwarm sweep: {recorded['error']}", file=sys.stderr)
        return 2
    core = getattr(engine.engine_core, "engine_core", None)
    bar = Bar() if Bar.wanted(sys.stderr) else None
    try:
        if core is not None:
            status = _step(core, bar)
        else:
            planned = len(inputs.points) * engine_args.data_parallel_size if spec.get("points") else None
            status = _wait(engine, ArtifactRows(artifact, planned, engine_args.data_parallel_size), bar)
    finally:
        if bar is not None:
            bar.close()
    if status != v.COMPLETE:
        recorded = _recorded(spec["out"], engine_args.data_parallel_size) or {}
        print(f"kvwarm sweep: {status}: {recorded.get('error') or 'see the log above'}", file=sys.stderr)
    engine.engine_core.shutdown()
    return 0 if status == v.COMPLETE else 1


def resumable(spec: dict, inputs, engine_argv: list[str]) -> dict | None:
    """--resume, before the engine starts: the record in --out, held to this command's plan,
    model, build and dataset (ResumeError where it differs or is missing); None, said, where
    the sweep is complete already."""
    from vllm.kvwarm import build_record

    artifact = read_record(record_path(spec["out"]), spec["out"])
    if artifact.get("status") == v.COMPLETE:
        rows = len(artifact.get("results") or []) + len(artifact.get("skipped_points") or [])
        print(f"kvwarm sweep: {spec['out']}: the sweep is complete ({rows} row(s)); nothing to resume")
        return None
    plan = plan_inputs(spec, inputs.settings, os.environ)
    check_plan(artifact, spec["out"], plan, given_model(engine_argv), build_record(), inputs.dataset)
    return artifact


def ray_refusal(engine_args) -> str | None:
    """Why data parallel over Ray cannot start on this platform (None: nothing against it).
    vLLM's Ray launcher places each rank on the Ray resource its platform names
    (`ray_device_key`); a platform that names none (the CPU one) stops it with an assertion
    ("No  found in Ray cluster") before any engine core exists."""
    if engine_args.data_parallel_size <= 1 or getattr(engine_args, "data_parallel_backend", "mp") != "ray":
        return None
    from vllm.platforms import current_platform

    if getattr(current_platform, "ray_device_key", ""):
        return None
    name = getattr(current_platform, "device_name", "this")
    return (
        f"--data-parallel-backend ray: vLLM's {name!r} platform names no Ray device (its ray_device_key is empty), "
        "so vLLM's Ray launcher cannot place the data-parallel ranks; use --data-parallel-backend mp (the default)"
    )


def _recorded(out: str, dp_size: int) -> dict | None:
    """The artifact that says how the run ended: a rank's, when one failed at start-up."""
    ranks = range(dp_size if dp_size > 1 else 0)
    paths = [Path(out) / v.ARTIFACT] + [Path(out) / rank_path(r) for r in ranks]
    for path in reversed(paths):
        try:
            recorded = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if recorded.get("status") == v.FAILED:
            return recorded
    try:
        return json.loads(paths[0].read_text())
    except (OSError, ValueError):
        return None


def _step(core, bar: Bar | None = None) -> str:
    """In-process engine core: step it until the sweep is done (its rows on `bar`, where the
    command shows one). The adapter records a sweep failure itself (once); an engine failure
    outside the sweep's hooks is recorded here."""
    scheduler = core.scheduler
    run = getattr(scheduler, "kvwarm_run", None)
    if run is None:
        raise SystemExit(
            "kvwarm sweep: --scheduler-cls must be one of vllm.kvwarm.scheduler's adapters (or a subclass of "
            "their mixin); leave it out and the command picks the one that matches the engine's loop"
        )
    if bar is not None:
        run.points_log.quiet = True  # the bar says it
    try:
        while scheduler.has_requests():
            core.step_fn()
            if bar is not None:
                bar.show(len(run.writer.rows), run.writer.total)
    except Exception as err:  # the rows already measured stay in the artifact
        run.fail(err)
        raise
    return json.loads(run.writer.artifact_path.read_text())["status"]


def _engine_dead(engine) -> bool:
    """vLLM's own liveness flag for engine cores in other processes (docs/hooks.md)."""
    resources = getattr(engine.engine_core, "resources", None)
    return bool(getattr(resources, "engine_dead", False))


def _wait(engine, rows: ArtifactRows, bar: Bar | None) -> str:
    """Engine cores in their own processes: they step themselves; wait for the final
    artifact (the combined view under data parallel) for as long as the engine lives,
    following its rows on `bar` where the command shows one."""
    while True:
        rows.read()
        if rows.final:
            return rows.status
        if bar is not None and rows.planned:
            bar.show(rows.done, rows.planned)
        if _engine_dead(engine):
            print(
                "kvwarm sweep: an engine core died before the sweep's artifact was final; see its log above",
                file=sys.stderr,
            )
            return "engine died"
        time.sleep(POLL_SECONDS)
