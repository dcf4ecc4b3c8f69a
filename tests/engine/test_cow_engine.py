"""Copy-on-write forks on the real CPU engine: the scheduler queues the fork, the runner
zeroes, copies and then runs the forward, and the forked request decodes exactly like a
request that computed its whole prompt itself.

The fork is made the way vLLM's own copy-on-write makes one for a prefix hit that ends inside a block:
the new request is admitted with the chain's blocks as its computed prefix (the partial
tail block included, each with its hit-ref), and `_apply_cow` swaps the tail for a fresh
block right after the allocation (a release that forks such a hit by itself is left to
do so). That is also what a warm-up shadow does.
"""

from __future__ import annotations

import random

import pytest
import torch
from kvwarm_testing.engine import BLOCK_SIZE

CTX = 100  # tokens the forked request borrows; 100 % 32 = 4 tokens in the tail block
TAIL = CTX // BLOCK_SIZE
STEPS = 6
JUNK = 7.0


def _admit_with_forked_tail(monkeypatch, engine, chain_id: str, fork_id: str) -> dict:
    """Make `fork_id`'s admission borrow the chain's first CTX tokens and fork the tail.

    The fork's page is filled with junk, and the fork is queued for zeroing (upstream does
    that too) with zeroing switched on for the step: only zero-then-copy leaves it equal
    to the source.
    """
    kvm = engine.kv_cache_manager
    manager = engine.attention_manager()
    real_get, real_allocate = kvm.get_computed_blocks, kvm.allocate_slots
    fork = {}

    def get_computed_blocks(request):
        found = real_get(request)
        if request.request_id != fork_id:
            return found
        borrowed = list(manager.req_to_blocks[chain_id][: TAIL + 1])
        return (kvm.create_kv_cache_blocks((borrowed,)), CTX, *found[2:])

    def allocate_slots(request, *args, **kwargs):
        blocks = real_allocate(request, *args, **kwargs)
        if request.request_id == fork_id and blocks is not None and "cow" not in fork:
            table = manager.req_to_blocks[fork_id]
            source = manager.req_to_blocks[chain_id][TAIL]
            if table[TAIL] is source:  # the release left the partial hit shared: fork it
                cow = kvm.block_pool.get_new_blocks(1)[0]
                manager._apply_cow(fork_id, TAIL, source, cow)
                manager.new_block_ids.append(cow.block_id)
            cow = table[TAIL]
            engine.layer_kv()[cow.block_id] = JUNK
            fork["source_page"] = engine.layer_kv()[source.block_id].clone()
            fork.update(source=source.block_id, cow=cow.block_id)
        return blocks

    monkeypatch.setattr(kvm, "get_computed_blocks", get_computed_blocks)
    monkeypatch.setattr(kvm, "allocate_slots", allocate_slots)
    kvm.take_new_block_ids()  # drop what accumulated while zeroing was off
    monkeypatch.setattr(engine.scheduler, "needs_kv_cache_zeroing", True)
    return fork


def _spy_on_outputs(monkeypatch, scheduler) -> list:
    outputs = []
    real_schedule = scheduler.schedule

    def schedule(*args, **kwargs):
        outputs.append(real_schedule(*args, **kwargs))
        return outputs[-1]

    monkeypatch.setattr(scheduler, "schedule", schedule)
    return outputs


def _logprobs(output) -> list[float]:
    completion = output.outputs[0]
    return [step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids)]


def test_forked_tail_decodes_like_an_unforked_twin(monkeypatch, engine):
    pool = engine.kv_cache_manager.block_pool
    prompt = random.Random(0).choices(range(3, 400), k=CTX)

    chain_id = engine.add("chain", prompt, max_tokens=STEPS + 2, salt="chain")
    assert engine.step() == {}  # the chain's prefill: CTX tokens computed, one sampled
    chain = engine.scheduler.requests[chain_id]
    assert chain.num_computed_tokens == CTX
    next_prompt = prompt + chain.output_token_ids[:1]

    engine.add("twin", next_prompt, max_tokens=STEPS, salt="twin")
    fork_id = engine.add("fork", next_prompt, max_tokens=STEPS, salt="fork")
    fork = _admit_with_forked_tail(monkeypatch, engine, chain_id, fork_id)
    outputs = _spy_on_outputs(monkeypatch, engine.scheduler)
    engine.step()  # admits twin and fork, decodes the chain

    assert "cow" in fork and fork["source"] != fork["cow"]
    (output,) = outputs
    assert output.kv_cache_block_copies == [(fork["source"], fork["cow"])]
    assert fork["cow"] in output.new_block_ids_to_zero
    # Retentions released in the step: the source is the chain's alone, the fork the request's.
    assert pool.blocks[fork["source"]].ref_cnt == 1
    assert pool.blocks[fork["cow"]].ref_cnt == 1
    assert engine.attention_manager().req_to_blocks[fork_id][TAIL].block_id == fork["cow"]
    # After the step the fork's page holds exactly what the source held when it was forked
    # (zeroed, then copied, then the forward appended position CTX), and matches the
    # source's page, where the chain appended the same token at the same position.
    kv = engine.layer_kv()
    cow_page, held = kv[fork["cow"]], fork["source_page"] != 0
    assert held.any() and torch.equal(cow_page[held], fork["source_page"][held])
    assert torch.allclose(cow_page, kv[fork["source"]], rtol=0, atol=1e-6)
    assert not (cow_page == JUNK).any()

    monkeypatch.undo()
    finished = engine.run_to_completion()
    fork_out, twin_out, chain_out = finished["fork"], finished["twin"], finished["chain"]
    assert fork_out.outputs[0].token_ids == twin_out.outputs[0].token_ids
    assert chain_out.outputs[0].token_ids[1 : STEPS + 1] == twin_out.outputs[0].token_ids
    assert _logprobs(fork_out) == pytest.approx(_logprobs(twin_out), abs=1e-5)

    in_use = {b.block_id: b.ref_cnt for b in pool.blocks if b.ref_cnt and not b.is_null}
    assert in_use == {}
    assert pool.reset_prefix_cache()
