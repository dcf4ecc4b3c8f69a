"""Issue 61's acceptance lines, each beside the figure it judges, from `validate`'s record
(validate.json: per kind its figures and bands, the one-line summary), in percent:

  decode   per KV band holding at least 20 steps: MAPE <= max(2 %, 1.5 x the band's repeat
           noise) and |bias| <= 1.5 %; the decode steps' coverage >= 95 %
  mixed    MAPE from the measured mixed rows <= max(5 %, 1.5 x the mixed noise), and below the
           composition's MAPE
  prefill  its figures, no line (nobody publishes one)
  graph    validate's split by graph mode where this build writes one (probed, never assumed)

A figure validate could not give (no steps, no noise) is said, not judged.
"""

from __future__ import annotations

BAND_STEPS = 20


def _pct(value) -> str:
    return "n/a" if value is None else f"{value:.2f} %"


def _decode(kinds: dict, summary: dict) -> list[tuple[str, bool | None]]:
    lines = []
    bands = (kinds.get("decode") or {}).get("bands") or {}
    for band, f in bands.items():
        if f["steps"] < BAND_STEPS:
            lines.append(
                (f"decode {band}: {f['steps']} steps (< {BAND_STEPS}: not judged), MAPE {_pct(f['mape'])}", None)
            )
            continue
        if f["mape"] is None:
            lines.append((f"decode {band}: {f['steps']} steps, none predicted (not covered)", False))
            continue
        limit = max(2.0, 1.5 * f["noise"]) if f["noise"] is not None else 2.0
        ok = f["mape"] <= limit and abs(f["bias"]) <= 1.5
        line = f"decode {band}: MAPE {_pct(f['mape'])} <= max(2 %, 1.5 x noise {_pct(f['noise'])}) = {limit:.2f} %"
        lines.append((f"{line}; |bias| {_pct(abs(f['bias']))} <= 1.50 %; {f['steps']} steps", ok))
    coverage = summary.get("decode_coverage")
    ok = None if coverage is None else coverage >= 95.0
    lines.append((f"decode coverage {_pct(coverage)} >= 95 %", ok))
    return lines


def _mixed(summary: dict) -> list[tuple[str, bool | None]]:
    mape, composed, noise = summary.get("mixed_mape"), summary.get("mixed_composed_mape"), summary.get("mixed_noise")
    if mape is None:
        return [(f"mixed: no step predicted from measured rows (predictor {summary.get('mixed_predictor')})", None)]
    limit = max(5.0, 1.5 * noise) if noise is not None else 5.0
    below = composed is None or mape < composed
    line = f"mixed: MAPE {_pct(mape)} <= max(5 %, 1.5 x noise {_pct(noise)}) = {limit:.2f} %"
    line += f" and below the composition's {_pct(composed)}; {summary.get('mixed_steps')} steps"
    return [(f"{line}, predictor {summary.get('mixed_predictor')}", mape <= limit and below)]


def _prefill(summary: dict) -> list[tuple[str, bool | None]]:
    figures = ", ".join(f"{k} {_pct(summary.get(f'prefill_{k}'))}" for k in ("mape", "p95", "bias", "coverage"))
    return [(f"prefill ({summary.get('prefill_steps')} steps): {figures} (reported, no line)", None)]


def _graphs(record: dict) -> list[tuple[str, bool | None]]:
    """Whatever validate writes per graph mode (a key naming `graph` in a kind or the summary)."""
    found = {k: v for k, v in record.get("summary", {}).items() if "graph" in k}
    for kind, figures in (record.get("kinds") or {}).items():
        found |= {f"{kind}.{k}": v for k, v in figures.items() if "graph" in k}
    if not found:
        return [("graph mode: this build's validate writes no split by graph mode", None)]
    return [(f"graph mode: {key} = {value}", None) for key, value in sorted(found.items())]


def acceptance(record: dict) -> list[tuple[str, bool | None]]:
    """(line, holds: True, False, or None where not judged), in the order of issue 61's list."""
    summary, kinds = record.get("summary") or {}, record.get("kinds") or {}
    return [*_decode(kinds, summary), *_mixed(summary), *_prefill(summary), *_graphs(record)]


def printed(name: str, record: dict) -> list[str]:
    marks = {True: "holds", False: "MISSED", None: "-"}
    return [f"  {name}: [{marks[ok]}] {line}" for line, ok in acceptance(record)]
