"""The model folders smoke/gpu_models.py writes for the GPU steps (config and tokenizer, dummy
weights): the full shapes add up to the parameters their publishers give (issue 60, 61), every
id below a config's vocab_size decodes with its tokenizer, and the scaled Qwen3 of the dry run
serves on the real CPU engine with dummy weights, its sampled ids detokenized by vLLM.

Runs in the command's pytest process (`-m command`): an engine of its own."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.command

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "smoke"))
import gpu_models  # a script of smoke/, importable from there

# The publishers' figures the issues quote: parameters in billions.
PUBLISHED = {"nemotron": 31.6, "mla": 15.7, "qwen3": 30.5}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_a_full_shape_adds_up_to_its_published_parameters(name):
    config = gpu_models.MODELS[name](False)
    assert gpu_models.parameters(config) / 1e9 == pytest.approx(PUBLISHED[name], abs=0.05)


def test_every_id_of_a_full_shape_tokenizer_decodes(tmp_path):
    from tokenizers import Tokenizer

    config = gpu_models.qwen3_moe(False)
    folder = gpu_models.write_model(tmp_path / "qwen3", config)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == config["vocab_size"] == 151936
    decoded = tokenizer.decode_batch([[i] for i in range(config["vocab_size"])], skip_special_tokens=False)
    assert decoded[0] == "<s>" and decoded[-1] == "<|id_151935|>"
    assert gpu_models.check_model(folder).startswith("qwen3:")


def test_the_scaled_model_serves_with_dummy_weights_on_the_cpu_engine(tmp_path):
    from vllm import LLM, SamplingParams

    folder = gpu_models.write_models(tmp_path, "cpu", only=["qwen3"])["qwen3"]
    llm = LLM(model=str(folder), load_format="dummy", dtype="bfloat16", seed=0, enforce_eager=True, max_model_len=512)
    try:
        params = SamplingParams(temperature=1.0, max_tokens=48, seed=0)
        outputs = llm.generate([{"prompt_token_ids": list(range(3, 40 + k))} for k in range(8)], params, use_tqdm=False)
        ids = [i for out in outputs for i in out.outputs[0].token_ids]
        assert len(ids) == 8 * 48 and all(out.outputs[0].text for out in outputs)
        assert max(ids) >= 1024  # past the trained merges: the filled part of the vocabulary decodes too
    finally:
        del llm
        gc.collect()
