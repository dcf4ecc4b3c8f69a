"""KV warm-up for real-KV step-time benchmarking (the overlay of the patched vLLM build).

Copied into the vLLM tree by the kvwarm build tooling. It never branches on vLLM's version:
what a build can do is probed (kv.capabilities). The rooms, and which way imports go:

  scheduler.py  the adapter (`--scheduler-cls vllm.kvwarm.scheduler.KvWarmScheduler` or
                `KvWarmAsyncScheduler`): stock scheduling plus the sweep's hooks
  __main__.py   `python -m vllm.kvwarm info | sweep | report | export | validate | selfcheck`
  ranks.py      `note_launch`, which the series' rank hook calls
  sweep/        the measurement controller (rungs, decode points, catch-ups) and its
                helpers: the prefill runner, the decode steps, the ranks' meetings; its
                inputs: points, settings, dataset, gate, plan, graphs, grid and the grid
                laid over a served-step trace (trace_grid); rows; the run's provenance
                (provenance: the engine record, the loop, the rank layout, which the trace
                writes too); the ranks' exchange (exchange/: solo, files, store, the
                combined view); the run that ties them to an engine and writes the record
  served/       the served-step trace: the recorder in the adapter's step, the writer
                process; imports only sweep.provenance of the sweep
  kv/           everything that touches vLLM's KV-cache internals (docs/hooks.md): layout,
                capabilities, shadow registration, state hand-off, chains, fake KV,
                catch-ups, the injector
  record/       the measurement record as plain data (vocabulary, artifact, schema,
                combined view), the arithmetic of a point's shape the sweep shares (shape:
                point keys, balanced splits, the graph a step runs in), its readers (runs,
                plot, report), and three rooms: trace/ (a served-step trace read back),
                validate/ (a table held against a trace: predict, match, validation,
                metrics, output, plot, command) and export/ (the planners' formats: Dynamo's
                self-benchmark artifact, the profiler's tables, the FPM capture); imports
                nothing of vLLM

  scheduler -> sweep -> kv -> record.vocabulary; sweep -> record; served -> sweep.provenance, record;
  record -> nothing above.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources

__all__ = ["build_record"]


@cache
def build_record() -> dict | None:
    """What this vLLM was built from (release, flavour, series digest, revision), or None
    when vllm.kvwarm was put in place by something other than the build tooling."""
    try:
        text = resources.files(__name__).joinpath("_build_record.json").read_text()
    except FileNotFoundError:
        return None
    return json.loads(text)
