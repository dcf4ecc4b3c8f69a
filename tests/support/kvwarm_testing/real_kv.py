"""Builders for the real vLLM v1 KV-cache classes of the installed (patched) wheel.

Plain functions (no pytest), shared by tests/vllm and the benchmarks.
"""

from __future__ import annotations

import torch
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager, MambaManager
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

BLOCK_SIZE = 16


def in_use(pool: BlockPool) -> dict[int, int]:
    """{block_id: ref_cnt} of every block held by someone (the null block's count is not
    maintained by vLLM, so it is left out)."""
    return {b.block_id: b.ref_cnt for b in pool.blocks if b.ref_cnt and not b.is_null}


def attention_manager(pool: BlockPool, group: int = 0) -> FullAttentionManager:
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=32, dtype=torch.float32)
    return FullAttentionManager(
        spec,
        block_pool=pool,
        enable_caching=True,
        kv_cache_group_id=group,
        scheduler_block_size=BLOCK_SIZE,
    )


def mamba_align_manager(pool: BlockPool, group: int = 1) -> MambaManager:
    spec = MambaSpec(
        block_size=BLOCK_SIZE,
        shapes=((2,), (3,)),
        dtypes=(torch.float32, torch.float32),
        mamba_cache_mode="align",
    )
    return MambaManager(
        spec,
        block_pool=pool,
        enable_caching=True,
        kv_cache_group_id=group,
        scheduler_block_size=BLOCK_SIZE,
    )


def tiny_llama_config(model_dir, max_position_embeddings: int = 1024):
    """A local model folder holding only a tiny Llama's config.json (enough for vLLM's
    ModelConfig without a tokenizer; nothing downloaded). Returns the folder."""
    import json

    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "num_hidden_layers": 2,
                "vocab_size": 256,
                "max_position_embeddings": max_position_embeddings,
                "torch_dtype": "float32",
            }
        )
    )
    return model_dir


def make_scheduler(
    tmp_path,
    num_blocks: int = 64,
    defer_block_free: bool = False,
    max_num_seqs: int = 8,
    *,
    block_size: int = BLOCK_SIZE,
    hash_block_size: int | None = None,
    state_block_size: int | None = None,
    scheduler_cls: type | None = None,
    additional_config: dict | None = None,
    async_scheduling: bool | None = None,
    max_model_len: int = 1024,
    max_num_batched_tokens: int = 256,
    enable_prefix_caching: bool = True,
):
    """A real v1 Scheduler on CPU over a tiny local model config (nothing downloaded).

    state_block_size adds an align-mode Mamba group (the hybrid layout); hash_block_size
    sets the prefix-match unit (default: the block size); scheduler_cls may be
    AsyncScheduler (or an async adapter), and async scheduling is then on (`async_scheduling`
    sets it otherwise)."""
    import dataclasses

    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    model_dir = tiny_llama_config(tmp_path / "tiny-llama", max_model_len)
    model_config = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="float32", seed=0)
    cache_extra = {}
    if state_block_size:
        cache_extra["mamba_cache_mode"] = "align"
    if hash_block_size:  # the field's name differs between releases
        fields = {f.name for f in dataclasses.fields(CacheConfig)}
        cache_extra["prefix_match_unit" if "prefix_match_unit" in fields else "hash_block_size"] = hash_block_size
    vllm_config = VllmConfig(
        model_config=model_config,
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            is_encoder_decoder=False,
            enable_chunked_prefill=True,
        ),
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching, **cache_extra),
        device_config=DeviceConfig(device="cpu"),
        additional_config=additional_config or {},
    )
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    # Async scheduling as the class needs it (the adapter refuses a class that does not match
    # the loop): on for AsyncScheduler and its subclasses, as on CUDA. Set after the config is
    # made, where the CPU platform has turned it off.
    if async_scheduling is None:
        async_scheduling = issubclass(scheduler_cls or Scheduler, AsyncScheduler)
    vllm_config.scheduler_config.async_scheduling = async_scheduling
    groups = [
        KVCacheGroupSpec(
            ["layer"], FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=32, dtype=torch.float32)
        )
    ]
    if state_block_size:
        groups.append(
            KVCacheGroupSpec(
                ["mamba"],
                MambaSpec(
                    block_size=state_block_size,
                    shapes=((2,), (3,)),
                    dtypes=(torch.float32, torch.float32),
                    mamba_cache_mode="align",
                ),
            )
        )
    kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    scheduler = (scheduler_cls or Scheduler)(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        block_size=block_size,
        hash_block_size=hash_block_size or block_size,
        log_stats=False,
        structured_output_manager=StructuredOutputManager(vllm_config),
    )
    scheduler.defer_block_free = defer_block_free
    return scheduler


def make_kv_cache_manager(
    block_sizes: list[int],
    num_blocks: int = 64,
    enable_caching: bool = True,
    max_model_len: int = 8192,
    state_groups: list[tuple[int, int, str]] = (),
    hash_block_size: int | None = None,
    attention_spec: str = "FullAttentionSpec",
    state_extra: dict | None = None,
):
    """A real KVCacheManager: one attention group per block size (full attention, or another
    spec class of vllm.v1.kv_cache_interface such as MLAAttentionSpec), then one Mamba group
    per (block size, speculative blocks, cache mode) in state_groups (state_extra: more
    MambaSpec fields, for a build that has them)."""
    import math

    from vllm.v1 import kv_cache_interface
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    spec_cls = getattr(kv_cache_interface, attention_spec)
    specs = [spec_cls(block_size=bs, num_kv_heads=1, head_size=32, dtype=torch.float32) for bs in block_sizes]
    specs += [
        MambaSpec(
            block_size=bs,
            shapes=((2,), (3,)),
            dtypes=(torch.float32, torch.float32),
            mamba_cache_mode=mode,
            num_speculative_blocks=spec,
            **(state_extra or {}),
        )
        for bs, spec, mode in state_groups
    ]
    groups = [KVCacheGroupSpec([f"layer{i}"], spec) for i, spec in enumerate(specs)]
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    sizes = [spec.block_size for spec in specs]
    return KVCacheManager(
        kv_cache_config=config,
        max_model_len=max_model_len,
        scheduler_block_size=math.lcm(*sizes),
        hash_block_size=hash_block_size or math.gcd(*sizes),
        enable_caching=enable_caching,
    )


def make_chain(kv_cache_manager, request_id: str, num_tokens: int):
    """A request whose first num_tokens are computed and hashed, as after its prefill."""
    request = make_request(request_id, num_tokens, hash_block_size=kv_cache_manager.block_pool.hash_block_size)
    assert kv_cache_manager.allocate_slots(request, num_tokens) is not None
    request.num_computed_tokens = num_tokens
    return request


def make_request(
    request_id: str,
    num_tokens: int,
    token: int = 7,
    hash_block_size: int | None = BLOCK_SIZE,
    cache_salt: str | None = None,
):
    """A greedy request of num_tokens prompt tokens; hash_block_size None: no block hasher;
    cache_salt: keys of its own (a shadow as the injector builds it)."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    params.update_from_generation_config({}, 0)
    return Request(
        request_id=request_id,
        prompt_token_ids=[token] * num_tokens,
        sampling_params=params,
        pooling_params=None,
        cache_salt=cache_salt,
        block_hasher=get_request_block_hasher(hash_block_size, sha256) if hash_block_size else None,
    )


def runner_output(req_ids: list[str], sampled: list[list[int]]):
    """A real ModelRunnerOutput of a step that ran `req_ids` (in batch order) and sampled
    `sampled[i]` for the i-th. A request's index is its place in req_ids; releases whose
    output also carries that as a `req_id_to_index` field (dropped with the V1 runner) get
    it filled in."""
    from dataclasses import fields

    from vllm.v1.outputs import ModelRunnerOutput

    extra = {}
    if "req_id_to_index" in {f.name for f in fields(ModelRunnerOutput)}:
        extra["req_id_to_index"] = {r: i for i, r in enumerate(req_ids)}
    return ModelRunnerOutput(req_ids=list(req_ids), sampled_token_ids=sampled, **extra)


def v2_runner_request_state(scheduler):
    """The request state vLLM's V2 model runner keeps for the requests a `scheduler` sends it,
    sized from its config: the CPU runner's (`CPURequestState`, the real class), or None on a
    release whose V2 runner keeps it only in GPU buffers (written by Triton kernels)."""
    try:
        from vllm.v1.worker.cpu.states import CPURequestState
    except ImportError:
        return None
    config = scheduler.vllm_config
    return CPURequestState(
        max_num_reqs=config.scheduler_config.max_num_seqs,
        max_model_len=config.model_config.max_model_len,
        max_num_batched_tokens=config.scheduler_config.max_num_batched_tokens,
        vocab_size=config.model_config.get_vocab_size(),
        device=torch.device("cpu"),
    )


def model_output(scheduler, output, token: int = 7):
    """The model runner's part of a step, played here: every scheduled request that has
    finished its prompt (as of the schedule() that made `output`) samples `token`."""
    ids = list(output.num_scheduled_tokens)
    sampled = [
        [token] if scheduler.requests[r].num_computed_tokens >= scheduler.requests[r].num_prompt_tokens else []
        for r in ids
    ]
    return runner_output(ids, sampled)


def step_scheduler(scheduler, token: int = 7, sent=None):
    """One scheduler step with the model runner's part played here (model_output). Returns
    the SchedulerOutput; `sent(output)` sees it first, as the workers get it (before the
    step's tokens are in)."""
    output = scheduler.schedule()
    if sent is not None:
        sent(output)
    scheduler.update_from_output(output, model_output(scheduler, output, token))
    return output


class ManualClock:
    """A clock that moves only when told: a test that advances it by known amounts knows how
    long every window is."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class EngineLoop:
    """Steps a scheduler in the order of vLLM's engine core, with the model runner's part
    played here (model_output). The runner does its work when a step is submitted, right
    after its schedule() (as the CPU runner does), and `forward(output)` seconds pass on
    `clock` there (none without a clock).

      batch_queue False  EngineCore.step: schedule, submit, update_from_output, per step;
      batch_queue True   EngineCore.step_with_batch_queue with a queue of two (vLLM's loop
                         under async scheduling): each step() schedules and submits the
                         next step, and takes the oldest in-flight step's output in once
                         two are in flight or nothing more can be scheduled; so step n+1's
                         schedule() runs before step n's update_from_output.

    `outputs`: every SchedulerOutput, in the order the steps were scheduled."""

    def __init__(self, scheduler, batch_queue: bool, clock: ManualClock | None = None, forward=None, token: int = 7):
        from collections import deque

        self.scheduler, self.batch_queue, self.token = scheduler, batch_queue, token
        self.clock, self.forward = clock, forward or (lambda output: 0.0)
        self.in_flight = deque()
        self.outputs = []

    def busy(self) -> bool:
        return self.scheduler.has_requests() or bool(self.in_flight)

    def step(self) -> None:
        scheduler = self.scheduler
        if scheduler.has_requests():
            output = scheduler.schedule()
            self.outputs.append(output)
            self.in_flight.appendleft((output, self._submit(output)))
            more = output.total_num_scheduled_tokens > 0 or scheduler.has_requests()
            if self.batch_queue and len(self.in_flight) < 2 and more:
                return
        elif not self.in_flight:
            return
        output, runner_output = self.in_flight.pop()
        scheduler.update_from_output(output, runner_output)

    def _submit(self, output):
        runner_output = model_output(self.scheduler, output, self.token)
        if self.clock is not None:
            self.clock.advance(self.forward(output))
        return runner_output


def park(scheduler, chains, token: int = 7) -> None:
    """Prefill `chains` (requests with room to decode) through `scheduler`, then park them:
    resident, never scheduled again. Steps as step_scheduler does, sampling `token`."""
    for chain in chains:
        scheduler.add_request(chain)
    while any(c.num_computed_tokens < c.num_prompt_tokens or c.num_output_placeholders for c in chains):
        step_scheduler(scheduler, token)
    for chain in chains:
        scheduler.running.remove(chain)
