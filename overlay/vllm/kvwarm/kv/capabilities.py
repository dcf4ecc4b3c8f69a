"""Which hooks and capabilities this vLLM build has, found by probing, never by version.

Each row names an attribute the warm-up may rely on. A row is True when the attribute is
there, False when it is not, and None when its module could not be imported (the reason is
kept), so a report never claims more than it saw.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass

# A state manager that hashes partial state tails (an in-place hand-off needs a build
# that exempts borrowed requests from it).
PARTIAL_TAIL_HOOK = "_cache_partial_tail_block"


def hashes_partial_tails(manager) -> bool:
    """Whether a state manager (an instance or its class) hashes partial state tails."""
    return hasattr(manager, PARTIAL_TAIL_HOOK)


@dataclass(frozen=True)
class Capability:
    name: str
    module: str
    attribute: str  # dotted path inside the module; "Class.field" also finds dataclass fields
    why: str


CAPABILITIES = (
    Capability(
        "kv_cache_block_copy",
        "vllm.v1.core.kv_cache_utils",
        "KVCacheBlockCopy",
        "the (src, dst) record of a copy-on-write block copy",
    ),
    Capability(
        "manager_apply_cow",
        "vllm.v1.core.single_type_kv_cache_manager",
        "SingleTypeKVCacheManager._apply_cow",
        "a manager can fork a block of a request (copy mode)",
    ),
    Capability(
        "manager_take_pending_cow_copies",
        "vllm.v1.core.single_type_kv_cache_manager",
        "SingleTypeKVCacheManager.take_pending_cow_copies",
        "queued forks can be drained",
    ),
    Capability(
        "take_kv_cache_block_copies",
        "vllm.v1.core.kv_cache_manager",
        "KVCacheManager.take_kv_cache_block_copies",
        "the scheduler collects forks and retentions",
    ),
    Capability(
        "scheduler_output_block_copies",
        "vllm.v1.core.sched.output",
        "SchedulerOutput.kv_cache_block_copies",
        "forks travel to the worker with the step",
    ),
    Capability(
        "worker_block_copy",
        "vllm.v1.worker.utils",
        "copy_kv_cache_blocks_inplace",
        "the worker copies forked pages before the forward",
    ),
    Capability(
        "adopt_blocks",
        "vllm.v1.core.single_type_kv_cache_manager",
        "SingleTypeKVCacheManager.adopt_blocks",
        "hook: a shadow takes a prebuilt block table with its cached-block count pinned",
    ),
    Capability(
        "borrowed_kv",
        "vllm.v1.request",
        "Request.borrowed_kv",
        "hook: a borrowed request's blocks are never hashed",
    ),
    Capability(
        "hashes_partial_tails",
        "vllm.v1.core.single_type_kv_cache_manager",
        f"MambaManager.{PARTIAL_TAIL_HOOK}",
        "the release hashes partial state tails (in-place state hand-off needs an exemption)",
    ),
)


def _has(obj, dotted: str) -> bool:
    for part in dotted.split("."):
        if hasattr(obj, part):
            obj = getattr(obj, part)
        else:  # a dataclass field has no class attribute: found in the fields, it ends the path
            return dataclasses.is_dataclass(obj) and part in {f.name for f in dataclasses.fields(obj)}
    return True


def probe() -> dict[str, dict]:
    """{name: {"present": True|False|None, "where": ..., "why": ..., "error": ...}}."""
    report = {}
    for cap in CAPABILITIES:
        row = {"where": f"{cap.module}.{cap.attribute}", "why": cap.why, "present": None}
        try:
            row["present"] = _has(importlib.import_module(cap.module), cap.attribute)
        except Exception as err:  # noqa: BLE001  (a module that cannot import here says nothing either way)
            row["error"] = f"{type(err).__name__}: {err}"
        report[cap.name] = row
    return report
