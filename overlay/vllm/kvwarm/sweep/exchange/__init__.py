"""How the data-parallel ranks of one sweep agree without blocking (docs/ranks.md).

Every DP rank's scheduler runs the same sweep. The ranks exchange small records at the
sweep's boundaries (the grid's pool, a rung's free pool and plan digest, each point's start;
sweep.meetings), and each rank's rows for the combined view, through an exchange:
- by default torch's TCPStore, hosted by rank 0 at vLLM's DP master address (`store`, with
  rank 0's combined view in `view`): nothing but the network is shared, so each rank's
  output folder may be on its own node; its network work runs in threads of its own;
- with DYN_BENCH_KV_WARMUP_RANK_SYNC=files, small files in the sweep's output folder
  (`files`), which must then be one folder every rank sees;
- on one rank, none (`solo`).
What crosses an exchange, and the checks on what comes back: `records`.
Not a collective on a process group: a dense model's DP ranks share none (vLLM
reconfigures each one as DP=1), and a blocking collective inside `schedule()` could
deadlock against the engine's own collectives (its periodic unfinished-requests
all-reduce, MoE dummy batches). A rank that waits here keeps stepping; only the sweep waits.

A record is posted once and polled on every `schedule()`; `poll` returns every rank's
record once all are there. A rank that failed posts its failure instead, so the others
stop at their next boundary rather than wait; a rank that never posts is given up on
after `timeout` seconds (DYN_BENCH_KV_WARMUP_RANK_TIMEOUT, default 300), or at the first
boundary, which waits for the ranks to start, after `start_timeout`
(DYN_BENCH_KV_WARMUP_RANK_START_TIMEOUT, default the rank timeout). `share` hands each
artifact the rank writes on to the combined view (record.combined); the rank that ends up
holding every rank's final artifact hands them to `on_final` (the Dynamo export).
"""

from __future__ import annotations

from pathlib import Path

from ..provenance import RankLayout
from ..settings import Settings
from . import store
from .files import FileExchange
from .solo import SoloExchange


def make_exchange(layout: RankLayout, out: str | Path, parallel_config, settings: Settings, plan: dict | None = None):
    """The exchange of this rank: none under one rank, else the one the settings ask for.
    `plan`: the sweep's inputs, which every rank must share (the store checks them at join).
    Never raises for the store: one this rank cannot host or reach fails the first boundary,
    inside `schedule()`, where the adapter's failure handling keeps the engine serving."""
    if layout.data_parallel_size == 1:
        return SoloExchange()
    size, rank, timeout = layout.data_parallel_size, layout.data_parallel_rank, float(settings.rank_timeout)
    start = float(settings.start_timeout)
    if settings.rank_sync == "files":
        run = f"{parallel_config.data_parallel_master_ip}-{parallel_config.data_parallel_master_port}"
        return FileExchange(out, run, size, rank, timeout=timeout, start_timeout=start)
    host, port, origin = store.store_address(parallel_config, settings.rank_sync_port)
    return store.StoreExchange(
        host, port, size, rank, timeout=timeout, start_timeout=start, root=out, origin=origin, plan=plan
    )
