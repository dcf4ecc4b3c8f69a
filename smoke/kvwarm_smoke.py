"""The smoke test of a patched build on the real engine: the same script on CPU (the
`smoke-cpu-*` sessions, in CI) and on a CUDA host (`gpu-smoke-*`).

  sweeps    sweeps with `python -m vllm.kvwarm sweep`, one engine per process, on tiny
            random-weight models made here (or on --model DIR):
              moe        attention-only MoE, warm-up on: every decode point on real KV,
                         prefill points on real prefixes
              moe-off    the same with DYN_BENCH_KV_WARMUP=off: decode on fake KV, prefill
                         on fake prefixes (the A/B baseline)
              hybrid     Qwen3-Next layout (gated-delta-net + attention + MoE), align mode,
                         state handed over by copy, then exact (every row's state depth
                         is its own context); in place asked for is refused where the build
                         can fork (state_inplace_unfaithful: every point on fake KV)
              nemotronh  Mamba2 + attention (dense: DYN_BENCH_KV_WARMUP=force), copy; only
                         where this build's engine runs Mamba2 (--cases picks)
            Each artifact must validate, say complete, hold every point on the expected KV
            regime with nothing skipped, stamp the state mode on hybrid rows, record
            reset_prefix_cache() succeeding, and record the engine loop the device runs by
            default with its adapter (CUDA: vLLM's batch queue under async scheduling,
            KvWarmAsyncScheduler; CPU: one step at a time, KvWarmScheduler).
  generate  greedy tokens for fixed prompts on a tiny MoE model, written as JSON; run once
            on the official release and once on the patched build (warm-up off, through the
            scheduler adapter that matches the engine's loop: the async one on CUDA), then
  compare   checks the two are token-identical.

Runs inside a venv that has vLLM and the test-support package (tests/support: the tiny models
and the engine's environment).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from kvwarm_testing.engine import engine_env, fp32_conv_refusal, fp32_moe_refusal, hybrid_kernel_refusal

# Points per case: two rungs, deepest first; K/B stays within max_model_len less the steps.
POINTS = [(1600, 2), (900, 2), (2400, 4), (1200, 4)]
HYBRID_POINTS = [(1800, 2), (1500, 2), (3200, 4)]  # contexts past the 256/640-token state blocks
# Prefill points of the attention-only cases (N, P, B): on a prefix, and without one.
PREFILL_POINTS = [(256, 1024, 2), (128, 0, 2), (64, 512, 1)]
MAX_MODEL_LEN = 2048
CASES = ["moe", "moe-off", "hybrid", "nemotronh"]


def _log(message: str) -> None:
    print(f"[kvwarm smoke] {message}", flush=True)


def _dtype(device: str, dtype: str) -> str:
    # GPU kernels (FlashAttention, fused MoE) are built for half precision; the CPU runs
    # fp32 where it can, for exactness.
    return "bfloat16" if device == "cuda" and dtype == "float32" else dtype


def _engine_args(device: str, model: Path, dtype: str, extra: list[str]) -> list[str]:
    args = [
        "--model",
        str(model),
        "--dtype",
        _dtype(device, dtype),
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--seed",
        "0",
        "--enable-prefix-caching",
        "--max-num-seqs",
        "8",
        "--max-num-batched-tokens",
        "512",
        *extra,
    ]
    if device == "cpu":
        args.append("--enforce-eager")  # tiny models: compiling costs more than it saves
    return args


def _model(work: Path, maker: str, given: Path | None) -> Path:
    if given is not None:
        return given
    from kvwarm_testing import tiny_models

    directory = work / "models" / maker
    if not (directory / "config.json").exists():
        getattr(tiny_models, f"make_{maker}")(directory)
    return directory


def _cases(selected: list[str], model: Path | None) -> list[dict]:
    """What each case runs: model, engine args, environment, points and what to expect."""
    moe = ["--enable-expert-parallel"]
    state = ["--mamba-cache-mode", "align", "--mamba-ssm-cache-dtype", "float32"]
    hybrid = moe + state
    table = {
        "moe": [
            {
                "name": "moe",
                "maker": "tiny_qwen3_moe",
                "dtype": "float32",
                "args": moe,
                "env": {},
                "regime": "real_kv",
                "prefill": PREFILL_POINTS,
                "prefix_regime": "real_prefix",
            }
        ],
        "moe-off": [
            {
                "name": "moe-off",
                "maker": "tiny_qwen3_moe",
                "dtype": "float32",
                "args": moe,
                "env": {"DYN_BENCH_KV_WARMUP": "off"},
                "regime": "legacy",
                "prefill": PREFILL_POINTS,
                "prefix_regime": "fake_prefix",
            }
        ],
        "hybrid": [
            {
                "name": f"hybrid-{mode}",
                "maker": "tiny_qwen3_next",
                "dtype": "bfloat16",
                "args": hybrid,
                "points": HYBRID_POINTS,
                "env": {"DYN_BENCH_KV_WARMUP_STATE": mode},
                "regime": "real_kv",
                "state": mode,
            }
            for mode in ("copy", "exact")
        ]
        + [
            {
                "name": "hybrid-inplace",
                "maker": "tiny_qwen3_next",
                "dtype": "bfloat16",
                "args": hybrid,
                "points": HYBRID_POINTS,
                "env": {"DYN_BENCH_KV_WARMUP_STATE": "inplace"},
                "regime": "fake_fallback",
                "skip_reason": "state_inplace_unfaithful",
            }
        ],
        "nemotronh": [
            {
                "name": "nemotronh",
                "maker": "tiny_nemotron_h",
                "dtype": "float32",
                "args": state,
                "points": HYBRID_POINTS,
                "regime": "real_kv",
                "state": "copy",
                "env": {"DYN_BENCH_KV_WARMUP": "force", "DYN_BENCH_KV_WARMUP_STATE": "copy"},
            }
        ],
    }
    if model is not None:  # the user's model (forced past the gate's heuristics), state by copy, then exact
        return [
            {
                "name": f"model-{mode}",
                "maker": None,
                "dtype": "auto",
                "args": [],
                "points": POINTS,
                "regime": "real_kv",
                "env": {"DYN_BENCH_KV_WARMUP": "force", "DYN_BENCH_KV_WARMUP_STATE": mode},
            }
            for mode in ("copy", "exact")
        ]
    unknown = sorted(set(selected) - set(table))
    if unknown:
        raise SystemExit(f"kvwarm smoke: unknown case(s) {unknown}; choose from {', '.join(CASES)}")
    return [{"points": POINTS, **case} for name in selected for case in table[name]]


# The loop each device's engine runs by default, and the adapter the command picks for it.
LOOPS = {
    "cuda": ("batch_queue", "vllm.kvwarm.scheduler.KvWarmAsyncScheduler"),
    "cpu": ("sync", "vllm.kvwarm.scheduler.KvWarmScheduler"),
}


def _check(artifact: dict, case: dict, device: str) -> list[str]:
    """What is wrong with a case's artifact (empty when it is what the smoke expects)."""
    from vllm.kvwarm.record.schema import validate

    problems = []
    try:
        validate(artifact)
    except Exception as err:  # noqa: BLE001  (jsonschema.ValidationError, reported with the rest)
        problems.append(f"schema: {str(err).splitlines()[0]}")
    meta = artifact["kvwarm"]
    rows = [r for r in artifact["results"] if r["point"].get("point_type", "decode") == "decode"]
    prefill = [r for r in artifact["results"] if r["point"].get("point_type") == "prefill"]
    expected = [(n, p, b, case["prefix_regime"] if p else "not_applicable") for n, p, b in case.get("prefill", [])]
    got = [
        (
            r["point"]["total_prefill_tokens"],
            r["point"]["total_kv_read_tokens"],
            r["point"]["batch_size"],
            r["kv_seed_regime"],
        )
        for r in prefill
    ]
    if sorted(got) != sorted(expected):
        problems.append(f"prefill rows {got}, expected {expected}")
    if "skip_reason" in case and meta["skip_reason"] != case["skip_reason"]:
        problems.append(f"skip_reason {meta['skip_reason']!r}, expected {case['skip_reason']!r}")
    if artifact["status"] != "complete":
        problems.append(f"status {artifact['status']}: {artifact['error']}")
    if artifact["skipped_points"]:
        problems.append(f"skipped: {artifact['skipped_points']}")
    if len(rows) != len(case["points"]):
        problems.append(f"{len(rows)} row(s) for {len(case['points'])} point(s)")
    wrong = [(r["point"], r["kv_seed_regime"]) for r in rows if r["kv_seed_regime"] != case["regime"]]
    if wrong:
        problems.append(f"expected every point on {case['regime']}, got {wrong}")
    state = case.get("state") or meta["state_mode"]
    if state and case["regime"] == "real_kv":
        unstamped = [r["point"] for r in rows if f"kvwarm_state_{state}" not in r["sample_reasons"]]
        if meta["state_mode"] != state or unstamped:
            problems.append(f"state mode {meta['state_mode']!r} (wanted {state}); rows without the stamp: {unstamped}")
        if state == "exact":
            # uniform points: a row's context is K / B
            off = [
                r["point"]
                for r in rows
                if f"kvwarm_state_depth={r['point']['total_kv_read_tokens'] // r['point']['batch_size']}"
                not in r["sample_reasons"]
            ]
            if off:
                problems.append(f"exact rows whose kvwarm_state_depth is not their context: {off}")
    if meta["reset_prefix_cache"] is not True:
        problems.append(f"reset_prefix_cache() gave {meta['reset_prefix_cache']!r}")
    loop = meta.get("engine_loop") or {}
    if (loop.get("loop"), loop.get("scheduler_cls")) != LOOPS[device]:
        problems.append(f"engine loop {loop}, expected {LOOPS[device]} on {device}")
    return problems


def sweeps(args) -> int:
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    from kvwarm_testing.tiny_models import write_sharegpt

    dataset = write_sharegpt(work / "sharegpt.json", conversations=400)
    failures = 0
    cases = _cases(args.cases.split(","), Path(args.model) if args.model else None)
    refusals, skipped, ran = {}, 0, set()  # refusals per maker: why this host's CPU engine cannot run it
    for n, case in enumerate(cases):
        model = _model(work, case["maker"], Path(args.model) if args.model else None)
        if args.device == "cpu" and case["maker"] not in refusals:
            refusals[case["maker"]] = _cpu_refusal(case, model)
        if refusals.get(case["maker"]):
            _log(f"case {case['name']}: skipped: {refusals[case['maker']]}")
            skipped += 1
            continue
        ran.add(case["name"])
        out = work / "sweeps" / case["name"]
        points = work / f"points-{case['name']}.json"
        points.write_text(
            json.dumps(
                {
                    "schema_version": 1,
                    "decode": [{"total_kv_read_tokens": k, "batch_size": b} for k, b in case["points"]],
                    "prefill": [
                        {"total_prefill_tokens": n, "total_kv_read_tokens": p, "batch_size": b}
                        for n, p, b in case.get("prefill", [])
                    ],
                }
            )
        )
        # The engine core in its own process (as under `vllm serve`) for every GPU case and
        # for the first CPU case; the others in-process, which starts faster.
        multiprocess = args.device == "cuda" or n == 0
        env = {
            **os.environ,
            **engine_env(args.device),
            "DYN_BENCH_KV_WARMUP_DATASET": str(dataset),
            "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocess else "0",
            **case["env"],
        }
        cmd = [
            sys.executable,
            "-m",
            "vllm.kvwarm",
            "sweep",
            "--points",
            str(points),
            "--out",
            str(out),
            *_engine_args(args.device, model, case["dtype"], case["args"]),
        ]
        _log(f"case {case['name']} ({'engine-core process' if multiprocess else 'in-process'}): {' '.join(cmd[3:])}")
        started = time.monotonic()
        log_path = work / f"{case['name']}.log"
        with log_path.open("w") as log:
            rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
        artifact_path = out / "sweep.json"
        if not artifact_path.exists():
            problems = [f"no artifact (exit {rc})"]
        else:
            problems = _check(json.loads(artifact_path.read_text()), case, args.device)
        if rc != 0 and not problems:
            problems = [f"exit {rc}"]
        verdict = "ok" if not problems else "FAILED: " + "; ".join(problems)
        _log(f"case {case['name']}: {verdict} ({time.monotonic() - started:.0f} s; log {log_path})")
        if problems:
            failures += 1
            print("".join(log_path.read_text().splitlines(keepends=True)[-40:]), flush=True)
    _log(f"{len(cases) - failures - skipped}/{len(cases)} case(s) passed" + (f", {skipped} skipped" if skipped else ""))
    if not failures and {"moe", "moe-off"} <= ran:
        failures += _report_real_against_fake(work)
    return 1 if failures else 0


def _cpu_refusal(case: dict, model: Path) -> str | None:
    """Why this host's CPU engine cannot run the case's model (kvwarm_testing.engine's probes:
    vLLM's own kernels on some CPUs); None when it can."""
    fp32 = case["dtype"] == "float32"
    if case["maker"] == "tiny_nemotron_h" and fp32:
        return fp32_conv_refusal()
    if case["maker"] == "tiny_qwen3_moe" and fp32:
        return fp32_moe_refusal()
    if case["maker"] == "tiny_qwen3_next" and case["dtype"] == "bfloat16":
        return hybrid_kernel_refusal(model)
    return None


def _report_real_against_fake(work: Path) -> int:
    """The seed's A/B on the two MoE runs: `report` renders both and prints the MAPE of fake
    KV (warm-up off) against real KV."""
    sweeps_dir, report = work / "sweeps", work / "report"
    cmd = [
        sys.executable,
        "-m",
        "vllm.kvwarm",
        "report",
        str(sweeps_dir / "moe"),
        str(sweeps_dir / "moe-off"),
        "--out",
        str(report),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    problems = [] if done.returncode == 0 else [f"exit {done.returncode}: {done.stderr.strip()[-400:]}"]
    problems += [
        f"no {name}" for name in ("report.html", "report.csv", "compare-2-vs-1.png") if not (report / name).exists()
    ]
    problems += [] if "MAPE" in done.stdout else ["no MAPE in its table"]
    _log(f"report moe vs moe-off: {'ok' if not problems else 'FAILED: ' + '; '.join(problems)} ({report})")
    print(done.stdout, flush=True)
    return 1 if problems else 0


PROMPTS = [
    "The quick brown fox",
    "Decode step time depends on",
    "Prefix caching lets requests",
    "A copy-on-write fork copies one block",
    "Numbers 0 1 2 3",
]


def generate(args) -> int:
    """Greedy tokens on the tiny MoE model (made once in --work, shared by both runs)."""
    for key, value in engine_env(args.device).items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ["DYN_BENCH_KV_WARMUP"] = "off"
    from vllm import LLM, SamplingParams

    work = Path(args.work).resolve()
    model = _model(work, "tiny_qwen3_moe", Path(args.model) if args.model else None)
    # Where this host's CPU engine refuses an fp32 MoE both builds run it in bf16, said here
    refusal = fp32_moe_refusal() if args.device == "cpu" else None
    if refusal:
        _log(f"in bfloat16: {refusal}")
    engine = {
        "model": str(model),
        "dtype": "bfloat16" if refusal else _dtype(args.device, "float32"),
        "max_model_len": MAX_MODEL_LEN,
        "seed": 0,
        "enable_prefix_caching": True,
        "enforce_eager": args.device == "cpu",
        "max_num_seqs": 8,
    }
    extra = {"scheduler_cls": _adapter(engine)} if args.adapter else {}
    if extra:
        _log(f"through {extra['scheduler_cls']}")
    llm = LLM(**engine, **extra)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outputs = llm.generate(PROMPTS * 2, params)  # twice: the second round hits the prefix cache
    import vllm

    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    Path(args.out).write_text(json.dumps({"vllm": vllm.__version__, "adapter": args.adapter, "tokens": tokens}))
    _log(f"vLLM {vllm.__version__}: {len(tokens)} greedy completions -> {args.out}")
    return 0


def _adapter(engine: dict) -> str:
    """The adapter that matches the loop vLLM resolves for these engine arguments (the
    adapter refuses the other one)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.kvwarm.sweep.provenance import adapter_for
    from vllm.usage.usage_lib import UsageContext

    return adapter_for(EngineArgs(**engine).create_engine_config(UsageContext.LLM_CLASS))


def compare(args) -> int:
    a, b = (json.loads(Path(p).read_text()) for p in (args.first, args.second))
    differing = [i for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y]
    if differing or len(a["tokens"]) != len(b["tokens"]):
        _log(f"FAILED: vLLM {a['vllm']} and {b['vllm']} differ on prompt(s) {differing}")
        return 1
    _log(f"vLLM {a['vllm']} and {b['vllm']}: {len(a['tokens'])} greedy completions token-identical")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvwarm_smoke.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("sweeps", help="decode sweeps on tiny models (or --model)")
    s.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    g = sub.add_parser("generate", help="greedy tokens for fixed prompts")
    g.add_argument("--out", required=True)
    g.add_argument("--adapter", action="store_true", help="through the scheduler adapter that matches the loop")
    for q in (s, g):
        q.add_argument("--device", choices=["cpu", "cuda"], required=True)
        q.add_argument("--work", required=True, help="folder for models, artifacts and logs")
        q.add_argument("--model", help="a local model directory instead of the tiny models")
    c = sub.add_parser("compare", help="two `generate` outputs must be token-identical")
    c.add_argument("first")
    c.add_argument("second")
    args = p.parse_args(argv)
    return {"sweeps": sweeps, "generate": generate, "compare": compare}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
