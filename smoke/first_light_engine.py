"""What every first-light step's engine shares (smoke/first_light.py, first_light_served.py):
the engine arguments (the kit's settings on CUDA, graphs on with a short capture list, a GPU
slice where engines run side by side), the adapter that matches vLLM's resolved loop, the
tiny models and a ShareGPT file, and a sweep run as the command a user runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import kvwarm_smoke
from kvwarm_testing.engine import engine_env

MAX_MODEL_LEN = 2048
CAPTURE_SIZES = ["1", "2", "4", "8", "16", "32"]  # a short list: capture costs seconds per size
# Several engines share the GPU at once: each asks for a slice and a fixed KV pool, so one's
# start-up profile never sizes its cache from memory another is using.
CONCURRENT_GPU = ["--gpu-memory-utilization", "0.12", "--kv-cache-memory-bytes", str(2 << 30)]


def kit_settings(site: Path | None) -> dict:
    path = site / "kit-settings.json" if site else None
    if path is None or not path.is_file():
        return {"env": {}, "engine_args": [], "additional_config": {}}
    return json.loads(path.read_text())


def engine_cli(args, model: Path, dtype: str, concurrent: bool = True, extra: tuple[str, ...] = ()) -> list[str]:
    """vLLM engine arguments every step's engine shares; on CUDA the kit's settings, graphs
    on with a short capture list, and a GPU slice where engines run side by side."""
    settings = kit_settings(args.site)
    cli = ["--model", str(model), "--dtype", kvwarm_smoke._dtype(args.device, dtype)]
    cli += ["--max-model-len", str(MAX_MODEL_LEN), "--seed", "0", "--enable-prefix-caching"]
    cli += ["--max-num-seqs", "32", "--max-num-batched-tokens", "2048", *extra]
    if args.device == "cpu":
        cli.append("--enforce-eager")  # tiny models: compiling costs more than it saves
    else:
        cli += [*settings["engine_args"], "--cudagraph-capture-sizes", *CAPTURE_SIZES]
        cli += CONCURRENT_GPU if concurrent else []
    if settings["additional_config"]:
        cli += ["--additional-config", json.dumps(settings["additional_config"])]
    return cli


def engine_args(cli: list[str]):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    EngineArgs.add_cli_args(parser)
    return EngineArgs.from_cli_args(parser.parse_args(cli))


def llm_kwargs(cli: list[str]) -> dict:
    """The same arguments as LLM(...) keywords: the fields the command line changed."""
    parsed = engine_args(cli)
    changed = {f.name: getattr(parsed, f.name) for f in fields(parsed) if getattr(parsed, f.name) != f.default}
    return {k: v for k, v in changed.items() if not callable(v)}


def matching_adapter(cli: list[str]) -> str:
    """The adapter the sweep command picks for these arguments: vLLM resolves the engine's
    config (async scheduling: its default on CUDA, off on CPU), and the overlay's
    sweep.provenance.adapter_for names the class that serves the resolved loop."""
    from vllm.kvwarm.sweep.provenance import adapter_for

    return adapter_for(engine_args(cli).create_engine_config())


def models(work: Path) -> dict[str, Path]:
    from kvwarm_testing import tiny_models

    made = {}
    for key, maker in (("moe", "tiny_qwen3_moe"), ("llama", "tiny_llama"), ("next", "tiny_qwen3_next")):
        folder = work.parent / "models" / maker  # beside WORK, which a rerun empties
        if not (folder / "config.json").exists():
            getattr(tiny_models, f"make_{maker}")(folder)
        made[key] = folder
    dataset = work / "sharegpt.json"
    if not dataset.exists():
        tiny_models.write_sharegpt(dataset, conversations=400)
    made["dataset"] = dataset
    return made


def shape_models(args) -> dict[str, Path]:
    """The shape steps' model folders (smoke/gpu_models.py): on CUDA the full shapes and a
    small NemotronH, on the CPU engine the scaled ones; beside WORK, which a rerun empties."""
    from gpu_models import write_models

    return write_models(
        args.work.parent / "models", args.device, nemotron_layers=getattr(args, "nemotron_layers", None)
    )


def run_sweep(args, name: str, arguments: list[str], env: dict, launch: bool = False, where=None) -> tuple:
    """`python -m vllm.kvwarm sweep --out WORK/sweeps/NAME ARGUMENTS` (with `launch`, through
    launch() here: the CPU dry run's overrides lifted; with `where`, its processes pinned as
    placement.Pinner does), its log in WORK/logs/NAME.log; returns its exit status, its
    artifact (None if it wrote none), the log."""
    out, log = args.work / "sweeps" / name, args.work / "logs" / f"{name}.log"
    entry = [str(Path(__file__).resolve())] if launch else ["-m", "vllm.kvwarm"]
    cmd = [sys.executable, *entry, "sweep", "--out", str(out), *arguments]
    env = {
        **os.environ,
        **engine_env(args.device),
        "DYN_BENCH_KV_WARMUP_DATASET": str(models(args.work)["dataset"]),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1",  # the engine core in its own process, as under serve
        **env,
    }
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as handle:
        sweep = subprocess.Popen(cmd, env=env, stdout=handle, stderr=subprocess.STDOUT)
        if where is not None:
            from placement import Pinner

            pinner = Pinner(sweep.pid, where)
        rc = sweep.wait()
        if where is not None:
            pinner.stop()
    artifact = out / "sweep.json"
    return rc, (json.loads(artifact.read_text()) if artifact.exists() else None), log


def launch(argv: list[str]) -> int:
    """`python first_light_engine.py sweep ARGS` (the sweep command) or `serve ARGS` (the OpenAI
    server) with the CPU platform's overrides lifted (kvwarm_testing.engine.lift_cpu_overrides):
    async scheduling as CUDA has it (the batch queue and the async adapter), and prefix caching
    for MLA models. On CUDA nothing is lifted: the same code path as the GPU's."""
    from kvwarm_testing.engine import lift_cpu_overrides

    lift_cpu_overrides()
    if argv[:1] == ["sweep"]:
        from vllm.kvwarm.sweep.command import run

        return run(argv[1:])
    if argv[:1] == ["serve"]:
        import runpy

        sys.argv = ["vllm.entrypoints.openai.api_server", *argv[1:]]
        runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__")
        return 0
    sys.exit("usage: first_light_engine.py sweep|serve ARGS")


if __name__ == "__main__":
    sys.exit(launch(sys.argv[1:]))
