"""The steps of smoke/gpu_first_light.sh: the first run of a patched build on a GPU host,
from the kit (docs/gpu-smoke.md, "First light"), and the plans at the shapes users run
(docs/gpu-shapes.md). Each step writes WORK/results/STEP.json (status pass, fail or skip, its
seconds, what it found); the shell script runs them with their own timeouts and packs the
output. `--device cpu` is the dry run on the CPU engine: the same code, eager, one engine at a
time (the shape steps scaled down, async scheduling's CPU override lifted).

  models    the tiny random-weight models (kvwarm_testing.tiny_models), a ShareGPT file, and
            the shape steps' folders (smoke/gpu_models.py: config and tokenizer)
  generate  (a) greedy tokens of plain LLM.generate and through the adapter (warm-up off)
            on the tiny MoE, CUDA graphs on, async scheduling at vLLM's default: identical
  sweep     (b) a decode sweep (8 points, B in 1, 4, 16) and 3 prefill points on the MoE:
            every row real_kv, the artifact complete; which loop ran and what records it
  shadows   (c) shadows' greedy tokens against natural requests' on the engine's pages,
            the engine stepped by its own loop function (the batch queue)
  hybrid    (f) the tiny Qwen3-Next swept in exact state mode, if Triton's kernels load
  fidelity  (d) benchmarks/step_fidelity.py --quick --gpu-defaults (the batch queue, graphs)
  served    (e) the OpenAI server under vllm.benchmarks.serve; the served-step trace and
            `validate` where this build has them
  nemotron-exact, nemotron-copy, nemotron-inplace, mla   first_light_shapes.py (issue 60)
  served-moe   first_light_moe_served.py (issue 61)
  info      `python -m vllm.kvwarm info --json`: the build and its hooks
Runs with vLLM (the kit's folder on PYTHONPATH), tests/support and smoke/ importable.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import kvwarm_smoke
from first_light_engine import engine_cli, llm_kwargs, matching_adapter, models, run_sweep, shape_models
from first_light_moe_served import STEPS as SERVED_MOE_STEPS
from first_light_report import Result, engine_log_facts, loop_facts
from first_light_served import step_served
from first_light_shapes import STEPS as SHAPE_STEPS
from kvwarm_testing.engine import engine_env, lift_cpu_overrides

# (b): 8 decode points over B in {1, 4, 16}, context K/B up to 1900; 3 prefill points (N, P, B).
DECODE_POINTS = [(256, 1), (1024, 1), (1900, 1), (1024, 4), (4096, 4), (7200, 4), (4096, 16), (16384, 16)]
PREFILL_POINTS = kvwarm_smoke.PREFILL_POINTS


def step_info(args) -> Result:
    """`python -m vllm.kvwarm info --json`: the build and which hooks it found here."""
    command = [sys.executable, "-m", "vllm.kvwarm", "info", "--json"]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    print(done.stdout, done.stderr, flush=True)
    if done.returncode != 0:
        return Result("info", "fail", detail=f"exit {done.returncode}: {done.stderr.strip()[-300:]}")
    lines = done.stdout.splitlines()  # vLLM logs to stdout too: the JSON starts at a lone "{"
    text = "\n".join(lines[lines.index("{") :]) if "{" in lines else done.stdout
    (args.work / "info.json").write_text(text)
    info = json.loads(text)
    build, found = info["build"] or {}, info["capabilities"]
    missing = sorted(name for name, row in found.items() if row["present"] is not True)
    detail = f"vLLM {info['vllm_version']} ({build.get('flavour')} of {build.get('release')}), "
    detail += f"series {str(build.get('series_digest'))[:12]}; hooks present {len(found) - len(missing)}/{len(found)}"
    return Result("info", "pass" if build else "fail", detail=detail + (f", not: {missing}" if missing else ""))


def step_models(args) -> Result:
    """The tiny models, a ShareGPT file, and the shape steps' folders (config and tokenizer)."""
    from gpu_models import check_model

    made = models(args.work)
    shapes = {name: check_model(folder) for name, folder in shape_models(args).items()}
    for line in shapes.values():
        print(line, flush=True)
    detail = (
        ", ".join(p.name for p in made.values())
        + "; "
        + ", ".join(sorted({p.name for p in shape_models(args).values()}))
    )
    return Result("models", "pass", detail=detail, facts={"shapes": shapes})


def _child(args, *extra: str, env: dict | None = None, log: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(Path(__file__).resolve()), *extra, "--work", str(args.work), "--device", args.device]
    cmd += ["--site", str(args.site)] if args.site else []
    with log.open("a") as out:
        return subprocess.run(cmd, env={**os.environ, **(env or {})}, stdout=out, stderr=subprocess.STDOUT, check=False)


def step_generate_one(args) -> Result:
    """One engine: greedy tokens (warm-up off) through the matching adapter (--adapter) or
    vLLM's own scheduler. The CPU engine's environment gives it a fixed KV pool: without one
    the CPU worker refuses to start when others' memory leaves less than 92 % free."""
    os.environ.update({**engine_env(args.device), "DYN_BENCH_KV_WARMUP": "off"})
    from vllm import LLM, SamplingParams

    cli = engine_cli(args, models(args.work)["moe"], "float32")
    kwargs = llm_kwargs(cli) | ({"scheduler_cls": matching_adapter(cli)} if args.adapter else {})
    llm = LLM(**kwargs)
    config = llm.llm_engine.vllm_config.scheduler_config
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outputs = llm.generate(kvwarm_smoke.PROMPTS * 2, params, use_tqdm=False)
    found = {
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "async_scheduling": bool(config.async_scheduling),
        "scheduler_cls": str(config.scheduler_cls or "vLLM's default"),  # unset: vLLM picks at start
    }
    Path(args.out).write_text(json.dumps(found))
    return Result(
        "generate-one", "pass", detail=f"{len(found['tokens'])} completions, scheduler {found['scheduler_cls']}"
    )


def step_generate(args) -> Result:
    folder = args.work / "generate"
    folder.mkdir(parents=True, exist_ok=True)
    runs = {}
    for name, extra in (("plain", []), ("adapter", ["--adapter"])):
        out = folder / f"{name}.json"
        done = _child(args, "generate-one", *extra, "--out", str(out), log=args.work / "logs" / "generate.log")
        if done.returncode != 0 or not out.exists():
            return Result("generate", "fail", detail=f"the {name} engine failed (exit {done.returncode}); see its log")
        runs[name] = json.loads(out.read_text())
    plain, ours = runs["plain"], runs["adapter"]
    differing = [i for i, (a, b) in enumerate(zip(plain["tokens"], ours["tokens"])) if a != b]
    facts = {
        "async_scheduling": plain["async_scheduling"],
        "adapter": ours["scheduler_cls"],
        "plain_scheduler": plain["scheduler_cls"],
        "prompts": len(plain["tokens"]),
        "differing_prompts": differing,
    }
    same = not differing and len(plain["tokens"]) == len(ours["tokens"])
    detail = f"{len(plain['tokens'])} greedy completions {'identical' if same else 'DIFFER at ' + str(differing)}"
    # The adapter must leave vLLM's loop as it resolved it (it refuses a mismatch at start).
    loop_kept = ours["async_scheduling"] == plain["async_scheduling"]
    on_off = {True: "on", False: "off"}
    detail += f" ({ours['scheduler_cls'].rsplit('.', 1)[1]}, async scheduling {on_off[plain['async_scheduling']]}"
    detail += ")" if loop_kept else f"; the adapter's engine: {on_off[ours['async_scheduling']]})"
    return Result("generate", "pass" if same and loop_kept else "fail", detail=detail, facts=facts)


def _sweep(args, name: str, model: Path, dtype: str, points: dict, env: dict, extra=(), concurrent=True) -> tuple:
    spec = args.work / f"points-{name}.json"
    spec.write_text(json.dumps({"schema_version": 1, **points}))
    cli = engine_cli(args, model, dtype, concurrent=concurrent, extra=tuple(extra))
    return run_sweep(args, name, ["--points", str(spec), *cli], env)


def step_sweep(args) -> Result:
    case = {
        "points": DECODE_POINTS,
        "prefill": PREFILL_POINTS,
        "regime": "real_kv",
        "prefix_regime": "real_prefix",
    }
    points = {
        "decode": [{"total_kv_read_tokens": k, "batch_size": b} for k, b in DECODE_POINTS],
        "prefill": [
            {"total_prefill_tokens": n, "total_kv_read_tokens": p, "batch_size": b} for n, p, b in PREFILL_POINTS
        ],
    }
    moe = models(args.work)["moe"]
    rc, artifact, log = _sweep(args, "moe", moe, "float32", points, {}, extra=["--enable-expert-parallel"])
    if artifact is None:
        return Result("sweep", "fail", detail=f"no artifact (exit {rc}); see {log.name}")
    problems = kvwarm_smoke._check(artifact, case, args.device)
    if rc != 0 and not problems:
        problems = [f"exit {rc}"]
    facts = {**loop_facts(artifact), **engine_log_facts(log)}
    rows = len(artifact["results"])
    detail = f"{rows} rows" + (": " + "; ".join(problems) if problems else ", every one on its expected regime")
    return Result("sweep", "fail" if problems else "pass", detail=detail, facts=facts)


def step_shadows(args) -> Result:
    """Shadows admitted through the adapter decode the tokens natural requests decode,
    on this engine's pages (the engine in this process, stepped by its own loop function:
    the batch queue, as on CUDA; the CPU dry run lifts the platform's override of it)."""
    os.environ.update({**engine_env(args.device), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    if args.device == "cpu":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from kvwarm_testing.fidelity import CONTEXTS, shadow_and_natural_tokens
    from vllm import LLM

    lift_cpu_overrides(("scheduler_config.async_scheduling",))

    cli = engine_cli(args, models(args.work)["llama"], "float32", extra=("--block-size", "32"))
    adapter = matching_adapter(cli)
    llm = LLM(**llm_kwargs(cli), scheduler_cls=adapter)
    core = llm.llm_engine.engine_core.engine_core  # stepped by its own loop function, step_fn
    shadow, natural = shadow_and_natural_tokens(llm, core, True, "first-light")
    differing = [ctx for ctx, a, b in zip(CONTEXTS, shadow, natural) if a != b]
    loop = "batch queue" if core.batch_queue is not None else "one step at a time"
    facts = {"adapter": adapter, "loop": loop, "contexts": CONTEXTS, "shadow": shadow, "natural": natural}
    detail = (
        f"{len(CONTEXTS)} shadows (forked tails) {'decode as' if not differing else 'DIFFER from'} natural requests"
    )
    detail += f" at contexts {differing or CONTEXTS} ({adapter.rsplit('.', 1)[1]}, {loop})"
    return Result("shadows", "fail" if differing else "pass", detail=detail, facts=facts)


def triton_refusal() -> str | None:
    """Why Triton's kernels (the gated-delta-net ops vLLM runs) do not run here, or None."""
    try:
        import torch
        from vllm.model_executor.layers.fla.ops.chunk import l2norm_fwd

        x = torch.randn(1, 8, 2, 64, device="cuda", dtype=torch.bfloat16)
        l2norm_fwd(x)
        torch.cuda.synchronize()
    except Exception as err:  # noqa: BLE001  (any failure means the kernels cannot run)
        return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    return None


def step_hybrid(args) -> Result:
    if args.device == "cuda":
        refusal = triton_refusal()
        if refusal:
            return Result("hybrid", "skip", detail=f"Triton's kernels did not load: {refusal}")
    case = {"points": kvwarm_smoke.HYBRID_POINTS, "regime": "real_kv", "state": "exact"}
    points = {"decode": [{"total_kv_read_tokens": k, "batch_size": b} for k, b in case["points"]]}
    extra = ["--enable-expert-parallel", "--mamba-cache-mode", "align", "--mamba-ssm-cache-dtype", "float32"]
    env = {"DYN_BENCH_KV_WARMUP_STATE": "exact"}
    rc, artifact, log = _sweep(args, "hybrid-exact", models(args.work)["next"], "bfloat16", points, env, extra)
    if artifact is None:
        return Result("hybrid", "fail", detail=f"no artifact (exit {rc}); see {log.name}")
    problems = kvwarm_smoke._check(artifact, case, args.device) or ([f"exit {rc}"] if rc else [])
    detail = f"{len(artifact['results'])} rows" + (": " + "; ".join(problems) if problems else ", real_kv, exact state")
    return Result("hybrid", "fail" if problems else "pass", detail=detail, facts=loop_facts(artifact))


def step_fidelity(args) -> Result:
    """(d) benchmarks/step_fidelity.py --quick --gpu-defaults: the paired benchmark on the loop
    and graphs a GPU runs by default (on the CPU dry run its override lifted): its tables and
    JSON line, which must say the batch queue ran and every shadow token equals the natural's."""
    root = Path(__file__).resolve().parents[1]
    log = args.work / "logs" / "fidelity.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "tooling"), os.environ.get("PYTHONPATH", "")])}
    # on CUDA it may run beside other engines (the shapes plan): a share of the GPU, a fixed pool
    share = (
        [] if args.device == "cpu" else ["--gpu-memory-utilization", "0.12", "--kv-cache-memory-bytes", str(2 << 30)]
    )
    with log.open("w") as handle:
        rc = subprocess.run(
            [sys.executable, str(root / "benchmarks" / "step_fidelity.py"), "--quick", "--gpu-defaults", *share],
            env=env,
            stdout=handle,
            stderr=subprocess.STDOUT,
            check=False,
        ).returncode
    lines = log.read_text().splitlines()
    result = next((json.loads(x) for x in reversed(lines) if x.startswith('{"metric"')), None)
    tables = [x for x in lines if "ratio" in x or "shadow/natural" in x or "A/A" in x][-12:]
    if rc != 0 or result is None:
        return Result(
            "fidelity", "fail", detail=f"exit {rc}, no result line; see {log.name}", facts={"tail": lines[-15:]}
        )
    loops, tokens = result.get("engine_loop") or [], result.get("tokens_agreeing", "")
    same, total = (int(n) for n in tokens.split("/")) if tokens else (0, -1)
    ok = any(loop.startswith("batch_queue") for loop in loops) and same == total
    return Result(
        "fidelity",
        "pass" if ok else "fail",
        detail=f"{result['metric']}: {result['value']} % ({result.get('points_within')}); {loops}; tokens {tokens}",
        facts={"result": result, "table": tables},
    )


STEPS = {
    "info": step_info,
    "models": step_models,
    "generate": step_generate,
    "generate-one": step_generate_one,
    "sweep": step_sweep,
    "shadows": step_shadows,
    "hybrid": step_hybrid,
    "fidelity": step_fidelity,
    **SHAPE_STEPS,
}


def main(argv: list[str] | None = None) -> int:
    steps = {**STEPS, "served": step_served, **SERVED_MOE_STEPS}
    p = argparse.ArgumentParser(prog="first_light.py", description=__doc__.split("\n\n")[0])
    p.add_argument("step", choices=sorted(steps))
    p.add_argument("--work", type=Path, required=True, help="the run's scratch folder")
    p.add_argument("--device", choices=["cuda", "cpu"], required=True)
    p.add_argument("--site", type=Path, help="the kit's install folder (its kit-settings.json)")
    p.add_argument("--adapter", action="store_true", help="generate-one: through the adapter matching the loop")
    p.add_argument("--out", help="generate-one: the tokens' file")
    p.add_argument("--nemotron-layers", type=int, help="NemotronH: its pattern's first N layers (an H100)")
    args = p.parse_args(argv)
    args.work = args.work.resolve()
    (args.work / "logs").mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    try:
        result = steps[args.step](args)
    except Exception as err:  # noqa: BLE001  (the step failed; the summary says how)
        import traceback

        traceback.print_exc()
        result = Result(
            args.step, "fail", detail=f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        )
    result.seconds = round(time.monotonic() - started, 1)
    if args.step != "generate-one":
        result.write(args.work)
    print(f"[first light] {result.step}: {result.status}: {result.detail} ({result.seconds} s)", flush=True)
    return 0 if result.status != "fail" else 1


if __name__ == "__main__":
    sys.exit(main())
