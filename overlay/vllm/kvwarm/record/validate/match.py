"""Whether a table may be held against a trace: the fields of their records that change a
step's time must be equal (docs/validate-reference.md lists them and why), and the step windows must
come from the same engine loop.

A record here is what a sweep's artifact and a trace's header share (`Provenance`): the
model, the build, the engine arguments as vLLM resolved them, the layout, the hardware,
torch and the loop. Fields that differ but do not change a step's time are noted, never
refused; a field one side lacks is not compared. Plain data: nothing here imports vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .. import vocabulary as v

SYNC, ASYNC = v.LOOP_SYNC, v.LOOP_BATCH_QUEUE  # the engine loop (each record's engine_loop.loop)

# Fields that change a step's time; a difference refuses the pair.
STEP_TIME_FIELDS = (
    "model",
    "resolved.model_type",
    "resolved.architectures",
    "resolved.dtype",
    "resolved.kv_cache_dtype",
    "resolved.block_sizes",
    "resolved.max_num_batched_tokens",
    "resolved.enforce_eager",
    "resolved.cudagraph_mode",
    "resolved.cudagraph_capture_sizes",
    "resolved.mamba_cache_mode",
    "resolved.distributed_executor_backend",
    "layout.tensor_parallel_size",
    "layout.data_parallel_size",
    "layout.pipeline_parallel_size",
    "layout.expert_parallel",
    "build.version",
    "build.flavour",
    "build.series_digest",
    "build.overlay_digest",
    "hardware.cpu",
    "hardware.gpus",
)
# Fields that differ harmlessly for a step of a given shape; a difference is said, not refused.
NOTED_FIELDS = (
    "resolved.max_num_seqs",
    "resolved.max_model_len",
    "resolved.enable_prefix_caching",
    "resolved.enable_chunked_prefill",
    "resolved.long_prefill_token_threshold",
    "resolved.num_gpu_blocks",
    "hardware.cores",
    "hardware.driver",
    "hardware.cuda_runtime",
    "hardware.transparent_hugepages",
    "torch",
)
MISSING = object()
# The engine argument that sets a step-time field where its name does not say it.
ARGUMENT_HINTS = {"resolved.distributed_executor_backend": "--distributed-executor-backend"}


def model_name(model) -> str | None:
    """A model as both records name it: the last part of its path or hub id."""
    return Path(str(model).rstrip("/")).name if model else None


def given_model(given) -> str | None:
    """The model in engine arguments as given (a list: `--model X`, `--model=X`, or `serve X`)."""
    if not isinstance(given, list):
        return None
    for i, arg in enumerate(given):
        if arg == "--model" and i + 1 < len(given):
            return given[i + 1]
        if str(arg).startswith("--model="):
            return str(arg).split("=", 1)[1]
        if arg == "serve" and i + 1 < len(given) and not str(given[i + 1]).startswith("-"):
            return given[i + 1]
    return None


def loop_of(record, resolved: dict) -> str | None:
    """The loop a record says ran: its engine_loop record (sweep.provenance.loop_record) where it
    has one, else the resolved async_scheduling (the adapter runs the loop vLLM resolved)."""
    explicit = record.get("loop") if isinstance(record, dict) else None
    if explicit in v.LOOPS:
        return explicit
    flag = resolved.get("async_scheduling")
    return None if flag is None else ASYNC if flag else SYNC


@dataclass(frozen=True)
class Provenance:
    model: str | None
    build: dict | None  # None: not a kvwarm build; MISSING: not recorded
    resolved: dict
    layout: dict
    hardware: dict
    torch: str | None
    loop: str | None

    @classmethod
    def of_trace(cls, header: dict) -> Provenance:
        engine = header.get("engine") or {}
        resolved = engine.get("resolved") or {}
        model = header.get("model") or given_model(engine.get("given"))
        return cls(
            model_name(model),
            header.get("build", MISSING),
            resolved,
            header.get("layout") or {},
            header.get("hardware") or {},
            header.get("torch"),
            loop_of(header.get("engine_loop"), resolved),
        )

    @classmethod
    def of_artifact(cls, artifact: dict) -> Provenance:
        config = artifact.get("config") or {}
        engine = config.get("engine_args") if isinstance(config.get("engine_args"), dict) else {}
        resolved = engine.get("resolved") or {}
        return cls(
            model_name(config.get("model") or given_model(engine.get("given"))),
            artifact.get("build", MISSING),
            resolved,
            artifact.get("layout") or {},
            artifact.get("hardware") or {},
            artifact.get("torch"),
            loop_of((artifact.get("kvwarm") or {}).get("engine_loop"), resolved),
        )

    def get(self, name: str):
        """A field by its dotted name; MISSING where the record does not have it."""
        if "." not in name:
            value = getattr(self, name)
            return MISSING if value is None else value
        part, key = name.split(".", 1)
        block = getattr(self, part)
        if block is None or block is MISSING:  # a null build: a vLLM that is not a kvwarm build
            return None if block is None and part == "build" else MISSING
        return block.get(key, MISSING)


@dataclass(frozen=True)
class Difference:
    field: str
    trace: object
    table: object

    def said(self, other: str = "table") -> str:
        hint = ARGUMENT_HINTS.get(self.field)
        given = f"; the trace's: {hint} {self.trace}" if hint and self.trace is not None else ""
        return f"{self.field} (trace {self.trace!r}, {other} {self.table!r}{given})"

    def __str__(self) -> str:
        return self.said()


@dataclass(frozen=True)
class Match:
    refused: list[Difference]  # fields that change a step's time
    noted: list[Difference]  # fields that do not
    loop: tuple[str | None, str | None]  # (trace, table)

    @property
    def loop_differs(self) -> bool:
        return None not in self.loop and self.loop[0] != self.loop[1]


def _differences(trace: Provenance, table: Provenance, names) -> list[Difference]:
    out = []
    for name in names:
        a, b = trace.get(name), table.get(name)
        if a is MISSING or b is MISSING:
            continue
        if name.endswith("gpus"):  # NVML's order is not a difference
            a, b = sorted(map(repr, a or [])), sorted(map(repr, b or []))
        if a != b:
            out.append(Difference(name, trace.get(name), table.get(name)))
    return out


def match(trace: Provenance, table: Provenance) -> Match:
    return Match(
        _differences(trace, table, STEP_TIME_FIELDS),
        _differences(trace, table, NOTED_FIELDS),
        (trace.loop, table.loop),
    )


def refusal(what: str, m: Match, fix: str, other: str = "table") -> str | None:
    """The error for a pair that differs in a step-time field (None when none does); `other`
    names the second record (a table, or the engine a sweep runs on)."""
    if not m.refused:
        return None
    return f"{what} differ in what changes a step's time: {'; '.join(d.said(other) for d in m.refused)}. {fix}"


def loop_refusal(what: str, m: Match, fix: str, other: str = "table") -> str | None:
    if not m.loop_differs:
        return None
    trace, table = m.loop
    return (
        f"{what}: the trace ran the {trace} engine loop, the {other} the {table} one; a step window is timed "
        f"differently under each (batch_queue: the next schedule() overlaps the forward). {fix}"
    )
