"""The first light's steps at the shapes users run (issue 60; docs/gpu-shapes.md): models with
dummy weights from the folders smoke/gpu_models.py writes on the host, swept by
`python -m vllm.kvwarm sweep` with CUDA graphs on and async scheduling at vLLM's default (the
batch queue; on the CPU dry run the platform's override of it lifted, first_light_engine.launch),
the points of smoke/shape_plans.py:

  nemotron-exact, nemotron-copy  NemotronH hybrid MoE at Nemotron-3-Nano-30B-A3B's shape, the
        state handed over exactly (catch-ups) and by copy, --mamba-cache-mode align, prefix
        caching on: decode at B 8 to 128 to 32k tokens per request and prefill points on a
        real prefix; every row on its regime with its state stamps, nothing skipped,
        reset_prefix_cache() succeeding at the end
  nemotron-inplace  the same architecture, small: in place where the build admits it (rows
        stamped kvwarm_state_inplace), else its refusal by name (the mode is decided by the
        layout and the build, not the size)
  mla   DeepSeek-V2-Lite's shape (MLA + MoE): decode to 64k tokens per request and prefill
        points on a real prefix

Every step reports each row's graph mode as observed where the build reports it (else the
expected one, said as such), the rungs' build times, and its own time against the estimate
it was sized by.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import kvwarm_smoke
from first_light_engine import CONCURRENT_GPU, kit_settings, run_sweep, shape_models
from first_light_report import Result, engine_log_facts
from gpu_models import NEMOTRON_PATTERN
from shape_plans import PLANS, SweepPlan

NEMOTRON_STATE = ("--mamba-cache-mode", "align", "--mamba-ssm-cache-dtype", "float32")
# A full-shape model's fixed KV pool (so no engine sizes its cache from memory another is
# using): NemotronH's ladder holds ~9 GB of attention KV and state blocks at its largest rung,
# the MLA model's 640k tokens of latent KV 20 GB; the rest keeps earlier rungs' chains cached.
POOL = 24 << 30


def gpu_share(args, model: str, alone: bool) -> tuple[str, ...]:
    """A full-shape engine's share of the GPU: 0.9 alone, 0.7 beside the small engines
    (CONCURRENT_GPU each); NemotronH's pool shrinks with its layers (--nemotron-layers)."""
    pool = POOL
    if model == "nemotron" and getattr(args, "nemotron_layers", None):
        pool = POOL * args.nemotron_layers // len(NEMOTRON_PATTERN)
    return ("--gpu-memory-utilization", "0.9" if alone else "0.7", "--kv-cache-memory-bytes", str(pool))


# The in-place check: the small NemotronH at contexts past its state blocks.
SMALL = SweepPlan(
    "nemotron-small",
    ((900, 2), (750, 2), (800, 4)),
    (),
    2048,
    8,
    512,
    (1, 2, 4, 8),
    boot_seconds=40,
    prefill_rate=20_000,
)


def shape_cli(args, plan: SweepPlan, folder: Path, extra: tuple[str, ...], share: tuple[str, ...]) -> list[str]:
    """The engine arguments of a shape's sweep: dummy weights, bf16, prefix caching and expert
    parallel on; on CUDA the kit's settings (FlashAttention's MLA kernels for the MLA model),
    graphs of the plan's sizes and a `share` of the GPU; on the CPU engine eager."""
    cli = ["--model", str(folder), "--load-format", "dummy", "--dtype", "bfloat16", "--seed", "0"]
    cli += ["--max-model-len", str(plan.max_model_len), "--max-num-seqs", str(plan.max_num_seqs)]
    cli += ["--max-num-batched-tokens", str(plan.batched_tokens), "--enable-prefix-caching", "--enable-expert-parallel"]
    cli += list(extra)
    if args.device == "cpu":
        return [*cli, "--enforce-eager"]
    settings = kit_settings(args.site)
    kit = list(settings["engine_args"])
    if plan.model == "mla" and "--attention-backend" in kit:  # Hopper's first MLA choice, FA3 (in the wheel)
        kit[kit.index("--attention-backend") + 1] = "FLASH_ATTN_MLA"
    cli += [*kit, "--cudagraph-capture-sizes", *(str(s) for s in plan.capture), *share]
    if settings["additional_config"]:
        cli += ["--additional-config", json.dumps(settings["additional_config"])]
    return cli


def graph_modes(artifact: dict) -> dict:
    """Each row's graph mode: as observed where the build reports it, else as expected."""
    graphs = [r.get("graph") or {} for r in artifact["results"]]
    observed = Counter(g["observed_cudagraph_mode"] for g in graphs if g.get("observed_cudagraph_mode"))
    expected = Counter(str(g.get("expected_cudagraph_mode")) for g in graphs)
    return {
        "observed": dict(observed) if observed else "not reported by this build (rows' observed_cudagraph_mode null)",
        "expected": dict(expected),
        "rows_observed": sum(observed.values()),
    }


def sweep_facts(artifact: dict, log: Path, seconds: float, estimate: dict) -> dict:
    meta = artifact["kvwarm"]
    regimes = Counter(r["kv_seed_regime"] for r in artifact["results"])
    return {
        "seconds": round(seconds, 1),
        "estimate": estimate,
        "rows": len(artifact["results"]),
        "regimes": dict(regimes),
        "stages": meta.get("stages"),
        "state_mode": meta.get("state_mode"),
        "skip_reason": meta.get("skip_reason"),
        "reset_prefix_cache": meta.get("reset_prefix_cache"),
        "engine_loop": meta.get("engine_loop"),
        "cudagraph": meta.get("cudagraph"),
        "graph_modes": graph_modes(artifact),
        **engine_log_facts(log),
    }


def _sweep(args, name: str, plan: SweepPlan, folder: Path, env: dict, extra=(), sized=None, share=()):
    spec = args.work / f"points-{name}.json"
    spec.write_text(json.dumps(plan.points()))
    if args.device == "cpu" and plan.model.startswith("nemotron"):  # the CPU's NemotronH is dense
        env = {**env, "DYN_BENCH_KV_WARMUP": "force"}
    started = time.monotonic()
    arguments = ["--points", str(spec), *shape_cli(args, plan, folder, extra, share)]
    rc, artifact, log = run_sweep(args, name, arguments, env, launch=True)
    took = time.monotonic() - started
    print(f"[first light] {name}: sized {sized or plan.estimate()}, took {took:.0f} s", flush=True)
    return rc, artifact, log, took


def _case(plan: SweepPlan, **expected) -> dict:
    """What kvwarm_smoke._check expects of the plan's rows."""
    return {"points": [(c * b, b) for c, b in plan.decode], "prefill": list(plan.prefill), **expected}


def _checked(name: str, rc: int, artifact: dict | None, log: Path, case: dict, facts: dict) -> Result:
    if artifact is None:
        return Result(name, "fail", detail=f"no artifact (exit {rc}); see {log.name}", facts=facts)
    # the loop CUDA runs: batch queue and the async adapter (the CPU dry run lifts its override)
    problems = kvwarm_smoke._check(artifact, case, "cuda") or ([f"exit {rc}"] if rc else [])
    found = facts["graph_modes"]
    graphs = found["observed"] if found["rows_observed"] else f"graphs expected {found['expected']} (none observed)"
    detail = f"{facts['rows']} rows {facts['regimes']}, state {facts['state_mode']}, {graphs}, {facts['seconds']} s"
    return Result(
        name, "fail" if problems else "pass", detail=detail + "".join(f"; {p}" for p in problems), facts=facts
    )


def step_nemotron(args, mode: str) -> Result:
    """NemotronH at full shape (scaled on the CPU), the state handed over in `mode`."""
    plan, name = PLANS[args.device]["nemotron"], f"nemotron-{mode}"
    folder = shape_models(args)["nemotron"]
    env = {"DYN_BENCH_KV_WARMUP_STATE": mode}
    share = gpu_share(args, "nemotron", alone=mode != "exact")  # exact's boot overlaps the small engines
    sized = plan.estimate(exact=mode == "exact", warm=mode != "exact")  # copy follows exact: a warm compile cache
    rc, artifact, log, took = _sweep(args, name, plan, folder, env, NEMOTRON_STATE, sized, share)
    facts = sweep_facts(artifact, log, took, sized) if artifact else {}
    case = _case(plan, regime="real_kv", prefix_regime="real_prefix", state=mode)
    return _checked(name, rc, artifact, log, case, facts)


def step_nemotron_inplace(args) -> Result:
    """In place on the small NemotronH: admitted (rows real_kv, stamped) or refused by name."""
    folder = shape_models(args)["nemotron-small"]
    env = {"DYN_BENCH_KV_WARMUP_STATE": "inplace"}
    rc, artifact, log, took = _sweep(args, "nemotron-inplace", SMALL, folder, env, NEMOTRON_STATE, share=CONCURRENT_GPU)
    if artifact is None:
        return Result("nemotron-inplace", "fail", detail=f"no artifact (exit {rc}); see {log.name}")
    facts = sweep_facts(artifact, log, took, SMALL.estimate())
    admitted = facts["state_mode"] == "inplace"
    case = _case(SMALL, regime="real_kv", state="inplace") if admitted else _case(SMALL, regime="fake_fallback")
    result = _checked("nemotron-inplace", rc, artifact, log, case, facts)
    said = "admitted by this build" if admitted else f"refused by this build: {facts['skip_reason']}"
    if not admitted and not facts["skip_reason"]:
        result.status, said = "fail", "not in place and no refusal named"
    result.detail = f"in place {said}; {result.detail}"
    return result


def step_mla(args) -> Result:
    """DeepSeek-V2-Lite's shape (scaled on the CPU): decode and prefill on real latent KV."""
    plan = PLANS[args.device]["mla"]
    rc, artifact, log, took = _sweep(
        args, "mla", plan, shape_models(args)["mla"], {}, share=gpu_share(args, "mla", True)
    )
    facts = sweep_facts(artifact, log, took, plan.estimate()) if artifact else {}
    return _checked("mla", rc, artifact, log, _case(plan, regime="real_kv", prefix_regime="real_prefix"), facts)


STEPS = {
    "nemotron-exact": lambda args: step_nemotron(args, "exact"),
    "nemotron-copy": lambda args: step_nemotron(args, "copy"),
    "nemotron-inplace": step_nemotron_inplace,
    "mla": step_mla,
}
