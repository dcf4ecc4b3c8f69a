"""Tiny random-weight models made on the spot (the model hub is out of reach).

Each model directory holds a transformers config, random weights and a byte-level BPE
tokenizer trained on a few built-in sentences, which is all vLLM needs to load it.
"""

from __future__ import annotations

from pathlib import Path

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Decode step time depends on batch size and the KV context each request reads.",
    "Prefix caching lets requests that share a prompt share its KV blocks.",
    "A copy-on-write fork copies one block so a request can write without disturbing others.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 and punctuation , . ; : ! ? ( ) [ ] { } - _ / \\ ' \"",
]


def save_tokenizer(directory: Path, vocab_size: int = 512) -> int:
    """Train and save a byte-level BPE tokenizer; returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_CORPUS * 8, trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")
    wrapped.save_pretrained(directory)
    return tokenizer.get_vocab_size()


def make_tiny_llama(directory: Path, seed: int = 0) -> Path:
    """2 layers, head size 32 (a size CPU attention supports), fp32."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    vocab = save_tokenizer(directory)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        max_position_embeddings=2048, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(directory)
    return directory


def make_tiny_qwen3_next(directory: Path, seed: int = 0) -> Path:
    """The Qwen3-Next layout: 3 gated-delta-net linear-attention layers + 1 full attention
    layer, a 4-expert top-2 MoE; head sizes 64 (CPU kernels support them). Run it in
    bfloat16 with mamba_ssm_cache_dtype="float32"."""
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    vocab = save_tokenizer(directory)
    config = Qwen3NextConfig(
        vocab_size=vocab, hidden_size=128, intermediate_size=128, num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        num_attention_heads=2, num_key_value_heads=1, head_dim=64,
        linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=64, linear_value_head_dim=64,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
        max_position_embeddings=4096, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Qwen3NextForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory)
    return directory
