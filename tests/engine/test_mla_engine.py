"""MLA shadows on the real CPU engine: a tiny DeepSeek-V2 (MLA + MoE, made here with random
weights), its latent KV borrowed by shadows through the scheduler adapter, whose greedy tokens
must equal natural requests' over the chain's first ctx + 1 tokens (kvwarm_testing.fidelity,
as test_shadow_engine does for attention).

Where the release's CPU platform has an MLA backend it picks the reference one (CPU_MLA; asked
for by name, so a CPU with AMX tiles runs it too) and turns prefix caching and chunked prefill
off for it, because that backend's prefill takes no cached context. Chains and shadows need
prefix caching (the sweep's gate refuses without it, and a chain's blocks cannot even be
hashed: vLLM's NONE_HASH is never set), so here the platform's override of prefix caching is
lifted and chunked prefill stays off; the test then checks that no step prefilled on a
cached context (each shadow's admission is one token on the chain's KV: a decode to MLA).

Runs in the command's pytest process (`-m command`): an engine of its own, as the tiny
Llama's session engine cannot share a process with another."""

from __future__ import annotations

import gc

import pytest
from kvwarm_testing.fidelity import CONTEXTS, shadow_and_natural_tokens

pytestmark = pytest.mark.command


@pytest.fixture(scope="module")
def mla_engine(tmp_path_factory):
    from kvwarm_testing.engine import Engine, cpu_mla_refusal, lift_cpu_overrides, skip_where_refused
    from kvwarm_testing.tiny_models import make_tiny_deepseek_v2
    from vllm import LLM

    skip_where_refused(cpu_mla_refusal())
    with pytest.MonkeyPatch.context() as patch:
        lift_cpu_overrides(("cache_config.enable_prefix_caching",), patch=patch.setattr)
        llm = LLM(
            model=str(make_tiny_deepseek_v2(tmp_path_factory.mktemp("tiny-deepseek-v2"))),
            dtype="float32",
            seed=0,
            enforce_eager=True,
            max_model_len=1024,
            max_num_seqs=8,
            enable_prefix_caching=True,
            enable_expert_parallel=True,
            attention_backend="CPU_MLA",
            scheduler_cls="vllm.kvwarm.scheduler.KvWarmScheduler",
        )
    engine = Engine(llm)
    yield engine
    del engine, llm
    gc.collect()


def _prefills_on_context(scheduler, monkeypatch) -> list[tuple[str, int, int]]:
    """(request, cached context, tokens) of every step that computed more than one token of a
    request past a context: what the reference MLA backend cannot do."""
    seen = []
    schedule = scheduler.schedule

    def recording(*args, **kwargs):
        output = schedule(*args, **kwargs)
        starts = {r.req_id: r.num_computed_tokens for r in output.scheduled_new_reqs}
        cached = output.scheduled_cached_reqs
        starts |= dict(zip(cached.req_ids, cached.num_computed_tokens))
        seen.extend(
            (rid, starts[rid], n) for rid, n in output.num_scheduled_tokens.items() if n > 1 and starts.get(rid)
        )
        return output

    monkeypatch.setattr(scheduler, "schedule", recording)
    return seen


@pytest.mark.parametrize("fork", [True, False])
def test_mla_shadows_decode_like_natural_requests_over_the_same_prefix(mla_engine, fork, monkeypatch):
    config = mla_engine.core.vllm_config
    assert config.model_config.use_mla and config.cache_config.enable_prefix_caching
    assert config.cache_config.block_size == 16  # the reference backend's: 128 is a whole block
    on_context = _prefills_on_context(mla_engine.scheduler, monkeypatch)
    shadow_tokens, natural = shadow_and_natural_tokens(mla_engine.llm, mla_engine.core, fork, f"mla-{fork}")
    assert on_context == []
    if fork:  # the forked tail holds the chain's latent KV for the partial block: exact
        assert shadow_tokens == natural
    else:  # a fresh tail is exact where ctx is block-aligned
        assert shadow_tokens[CONTEXTS.index(128)] == natural[CONTEXTS.index(128)]
