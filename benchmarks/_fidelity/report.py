"""What the main process prints: each case's table, the summary and the JSON result line of
the paired benchmark, the variance study and the machine floor (each with its own result line)."""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from dataclasses import replace
from pathlib import Path

from .cases import CASES, TCMALLOC, VARIANCE, VARIANTS, Settings
from .runner import run_engine, uptime
from .stats import PHASES, TOLERANCE, a_a, holds_one, point_figures, spread, upper_median, within


def interval(f) -> str:
    return f"{f[0]:.3f} [{f[1]:.3f}, {f[2]:.3f}]"


def print_attention_case(result: dict) -> list[dict]:
    rows = []
    print(
        f"{'B':>3} {'K':>6}  {'shadow ms':>9} {'natural ms':>10}  {'shadow/natural [95%]':>22}  "
        f"{'A/A shadow':>22}  {'A/A natural':>22}  {'spread S|N':>11}  faults S|N  tokens  load"
    )
    for p in result["points"]:
        f = point_figures(p)
        rows.append({**f, "batch": p["batch"], "k": p["k"]})
        print(
            f"{p['batch']:>3} {p['k']:>6}  {f['shadow_ms']:>9.3f} {f['natural_ms']:>10.3f}  "
            f"{interval(f['ratio']):>22}  "
            f"{interval(f['aa_shadow']):>22}  {interval(f['aa_natural']):>22}  "
            f"{100 * f['spread']['shadow']:>4.1f}|{100 * f['spread']['natural']:<4.1f}%  "
            f"{f['faults']['shadow']:>4.0f}|{f['faults']['natural']:<4.0f}  {f['tokens_match']:>6}  "
            + "-".join(f"{x:.1f}" for x in p["load"])
        )
    print("  phases, ms (per measurement the median of its steps; the median over measurements): shadow | natural")
    print(f"  {'B':>3} {'K':>6}  " + "  ".join(f"{ph:>15}" for ph in PHASES) + "   schedule S/N [95%]")
    for p, f in zip(result["points"], rows):
        cells = "  ".join(f"{f['phases']['shadow'][ph]:>6.3f} | {f['phases']['natural'][ph]:<6.3f}" for ph in PHASES)
        print(f"  {p['batch']:>3} {p['k']:>6}  {cells}   {interval(f['schedule_ratio'])}")
    return rows


def print_hybrid_case(runs: list[dict]) -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
    """Every run's rows, then per mode how many rows agree with natural decoding and at how
    many the schedule() S/N interval holds 1; and the modes this build refuses, with why."""
    print(
        f"{'run':>3} {'mode':>7} {'B':>2} {'K':>5}  {'shadow ms':>9} {'natural ms':>10}  "
        f"{'shadow/natural [95%]':>22}  {'A/A natural':>22}  tokens  forward ms S|N   schedule S/N [95%]"
    )
    agree: dict[str, list[bool]] = {}
    schedule_at_1: dict[str, list[bool]] = {}
    by_run: dict[tuple[int, str], list[float]] = {}
    refused: dict[str, str] = {}
    for result in runs:
        for p in result["points"]:
            if "refused" in p:
                print(f"{result['run']:>3} {p['mode']:>7}  refused: {p['refused']}")
                refused[p["mode"]] = p["refused"]
                continue
            f = point_figures(p)
            ok = holds_one(f["ratio"]) or within(f["ratio"])
            agree.setdefault(p["mode"], []).append(ok)
            schedule_at_1.setdefault(p["mode"], []).append(holds_one(f["schedule_ratio"]))
            by_run.setdefault((result["run"], p["mode"]), []).append(f["shadow_ms"])
            print(
                f"{result['run']:>3} {p['mode']:>7} {p['batch']:>2} {p['k']:>5}  {f['shadow_ms']:>9.3f} "
                f"{f['natural_ms']:>10.3f}  {interval(f['ratio']):>22}  {interval(f['aa_natural']):>22}  "
                f"{f['tokens_match']:>6}  "
                f"{f['phases']['shadow']['forward']:.3f}|{f['phases']['natural']['forward']:.3f}  "
                f"{interval(f['schedule_ratio'])}"
            )
    for result in runs:
        copy = by_run.get((result["run"], "copy"))
        line = ", ".join(
            f"{mode}/copy {statistics.median(a / b for a, b in zip(by_run[(result['run'], mode)], copy)):.3f}"
            for mode in ("inplace", "exact")
            if copy and (result["run"], mode) in by_run
        )
        if line:
            print(f"  run {result['run']}: shadow step medians, point by point, {line}")
    summary = {mode: f"{sum(oks)}/{len(oks)}" for mode, oks in agree.items()}
    schedule = {mode: f"{sum(oks)}/{len(oks)}" for mode, oks in schedule_at_1.items()}
    print(
        "  rows agreeing with natural decoding (interval holds 1, or lies within 1 +- "
        f"{100 * TOLERANCE:g}%): " + ", ".join(f"{m} {v}" for m, v in summary.items())
    )
    print("  schedule() S/N interval holds 1: " + ", ".join(f"{m} {v}" for m, v in schedule.items()))
    return summary, schedule, refused


def variance_study(release: str, tmp: Path, variants: list[str], runs: int) -> None:
    """The dense model under each of `variants` (VARIANTS' names), `runs` engines each."""
    print(f"variance study, vLLM {release}: dense model, {VARIANCE.pairs} pairs per point; {uptime()}", flush=True)
    results = {}
    for name in variants:
        changes = VARIANTS[name]
        if changes.get("allocator") == "tcmalloc" and not TCMALLOC.exists():
            print(f"  {name}: left out, no {TCMALLOC} (Debian's libtcmalloc-minimal4)", flush=True)
            continue
        for run in range(1, runs + 1):
            label = name if runs == 1 else f"{name} #{run}"
            results[label] = run_engine("dense", run, tmp, replace(VARIANCE, **changes))
    print(
        f"\n{'variant':>15} {'B':>2} {'K':>6} {'ms S|N':>13}  {'spread S|N':>11}  {'A/A shadow':>22}  "
        f"{'A/A natural':>22}  {'after other/own, N':>22}  {'shadow/natural [95%]':>22}  faults S|N  preempted S|N"
    )
    for name, result in results.items():
        for p in result["points"]:
            f = point_figures(p)
            print(
                f"{name:>15} {p['batch']:>2} {p['k']:>6} {f['shadow_ms']:>6.2f}|{f['natural_ms']:<6.2f}  "
                f"{100 * f['spread']['shadow']:>4.1f}|{100 * f['spread']['natural']:<4.1f}%  "
                f"{interval(f['aa_shadow']):>22}  {interval(f['aa_natural']):>22}  "
                f"{interval(f['carry_over']['natural']):>22}  {interval(f['ratio']):>22}  "
                f"{f['faults']['shadow']:>4.0f}|{f['faults']['natural']:<4.0f}  "
                f"{f['preempted']['shadow']:>4.1f}|{f['preempted']['natural']:<4.1f}"
            )
    print(f"\n{uptime()}", flush=True)
    print(
        json.dumps(
            {
                "metric": f"step_fidelity_variance_{release}",
                "value": _largest_spread(r for n, r in results.items() if n.startswith("controlled")),
                "unit": "%",
                "baseline": _largest_spread(r for n, r in results.items() if not n.startswith("controlled")),
                "ratio": None,
                "target": "report only: the largest spread (MAD/median) controlled, and with a source let loose",
            }
        )
    )


def machine_floor(settings: Settings) -> None:
    """The host's own noise, without vLLM: fixed work about as long as a small model's step,
    timed in the same shape (measurements of STEPS repetitions, each the upper median) in a
    process pinned the same way. Three probes take turns, so they see the same moments: a
    matrix product that stays in the caches (compute), a sum over 128 MiB (memory bandwidth,
    what a decode step's KV and weight reads need) and a loop of the interpreter's own work
    (what schedule() and update_from_output() are). Their A/A is the floor under the engine's."""
    import torch

    if settings.pin:
        os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
    torch.set_num_threads(1)
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    big = torch.empty(32 << 20).uniform_()  # 128 MiB of float32

    def interpreter() -> None:
        table = {}
        for i in range(20_000):
            table[i % 97] = table.get(i % 97, 0) + i

    probes = {
        "compute": lambda: torch.mm(a, b),
        "memory": lambda: big.sum(),
        "interpreter": interpreter,
    }

    def measurement(probe) -> float:
        times = []
        for _ in range(settings.steps):
            started = time.perf_counter()
            probe()
            times.append(time.perf_counter() - started)
        return upper_median(times)

    walls: dict[str, list[float]] = {name: [] for name in probes}
    for name, probe in probes.items():
        measurement(probe)  # the warm-up
    for _ in range(4 * settings.pairs):
        for name, probe in probes.items():
            walls[name].append(measurement(probe))
    figures = {}
    for name, values in walls.items():
        aa = a_a(values)
        f = figures[name] = {"ms": 1e3 * statistics.median(values), "spread": spread(values), "aa": aa}
        print(f"machine floor, {name:>11}: {f['ms']:7.3f} ms, spread {100 * f['spread']:4.1f} %, A/A {interval(aa)}")
    print(uptime())
    worst = max(abs(f["aa"][0] - 1) for f in figures.values())
    print(
        json.dumps(
            {
                "metric": "step_fidelity_machine_floor",
                "value": round(100 * worst, 2),
                "unit": "%",
                "baseline": round(100 * max(f["spread"] for f in figures.values()), 2),
                "ratio": None,
                "target": "report only: the largest A/A (value) and spread (baseline) of fixed work on this host",
                "probes": figures,
            }
        )
    )


def _largest_spread(results) -> float | None:
    spreads = [spread(p[side]["walls"]) for r in results for p in r["points"] for side in ("shadow", "natural")]
    return round(100 * max(spreads), 2) if spreads else None


def _tokens_agreeing(rows: list[dict]) -> str:
    """Over the attention-only points: the shadows' greedy tokens equal to the natural requests'."""
    pairs = [tuple(int(n) for n in r["tokens_match"].split("/")) for r in rows]
    return f"{sum(a for a, _ in pairs)}/{sum(b for _, b in pairs)}"


def _loop_label(loop: dict | None) -> str:
    """`batch_queue, KvWarmAsyncScheduler, graphs FULL_AND_PIECEWISE`: how a case's engine ran."""
    if not loop:
        return "loop not recorded"
    graphs = "eager" if loop["enforce_eager"] else f"graphs {loop['cudagraph_mode'].rsplit('.', 1)[-1]}"
    return f"{loop['loop']}, {loop['scheduler_cls'].rsplit('.', 1)[-1]}, {graphs}"


def print_paired(by_case: dict[str, list[dict]], release: str, quick: bool) -> None:
    """Each case's table (by_case: its engines' results), the attention-only summary and the
    JSON result line."""
    headline, hybrids, hybrid_schedules, hybrid_refused = [], {}, {}, {}
    loops = {_loop_label(r.get("loop")) for runs in by_case.values() for r in runs}
    for name, runs in by_case.items():
        ran = ", ".join(sorted({_loop_label(r.get("loop")) for r in runs}))
        print(f"\n{name}: {CASES[name].title}; {ran}", flush=True)
        if CASES[name].hybrid():
            hybrids[name], hybrid_schedules[name], hybrid_refused[name] = print_hybrid_case(runs)
        else:
            for result in runs:
                headline += print_attention_case(result)
    print(f"\n{uptime()}", flush=True)
    worst = max((abs(r["ratio"][0] - 1) for r in headline), default=0.0)
    noises = (abs(r[k][0] - 1) for r in headline for k in ("aa_shadow", "aa_natural"))
    noise = max((n for n in noises if math.isfinite(n)), default=0.0)
    inside = sum(within(r["ratio"]) for r in headline)
    # the shadows' schedule() against the natural requests' (the sweep's own work is not in it)
    schedule_at_1 = sum(holds_one(r["schedule_ratio"]) for r in headline)
    if headline:
        print(
            f"attention-only points: largest |shadow/natural - 1| {100 * worst:.2f}%, largest A/A {100 * noise:.2f}%; "
            f"{inside}/{len(headline)} intervals within 1 +- {100 * TOLERANCE:g}%; "
            f"schedule() S/N interval holds 1 at {schedule_at_1}/{len(headline)}",
            flush=True,
        )
    attention = "_".join(n for n in by_case if not CASES[n].hybrid()) or "hybrids"
    print(
        json.dumps(
            {
                "metric": f"step_fidelity_paired_{attention}_{release}"
                + ("_batch_queue" if any(x.startswith("batch_queue") for x in loops) else "")
                + ("_quick" if quick else ""),
                "value": round(100 * worst, 2),
                "unit": "%",
                "baseline": round(100 * noise, 2),
                "ratio": round(worst / noise, 2) if noise else None,
                "target": f"every point's 95% interval within 1 +- {100 * TOLERANCE:g}% "
                f"and A/A <= {100 * TOLERANCE:g}%",
                "points_within": f"{inside}/{len(headline)}",
                "tokens_agreeing": _tokens_agreeing(headline),
                "schedule_holding_1": f"{schedule_at_1}/{len(headline)}",
                "hybrid_rows_agreeing": hybrids,
                "hybrid_schedule_holding_1": hybrid_schedules,
                "hybrid_modes_refused": hybrid_refused,
                "engine_loop": sorted(loops),
            }
        )
    )
