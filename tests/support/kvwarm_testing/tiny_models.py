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


def write_sharegpt(path: Path, conversations: int = 64) -> Path:
    """A ShareGPT-format JSON file of two-turn conversations of plain words (the chains'
    text), each conversation different."""
    import json

    words = [
        "decode",
        "prefill",
        "cache",
        "block",
        "shadow",
        "chain",
        "rung",
        "batch",
        "token",
        "step",
        "kernel",
        "expert",
        "route",
        "state",
        "attention",
        "memory",
        "layer",
        "model",
        "sample",
        "greedy",
        "context",
        "prefix",
        "pool",
        "fork",
        "copy",
    ]
    path.write_text(
        json.dumps(
            [
                {
                    "conversations": [
                        {"from": "human", "value": " ".join(words[(n * 7 + k * 3) % len(words)] for k in range(80))},
                        {"from": "gpt", "value": " ".join(words[(n * 5 + k * 11) % len(words)] for k in range(120))},
                    ]
                }
                for n in range(conversations)
            ]
        )
    )
    return path


def save_tokenizer(directory: Path, vocab_size: int = 512) -> int:
    """Train and save a byte-level BPE tokenizer; returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_CORPUS * 8, trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")
    wrapped.save_pretrained(directory)
    return tokenizer.get_vocab_size()


def _save_model(directory: Path, config_name: str, model_name: str, dtype: str, seed: int, **config) -> Path:
    """A tokenizer and a random-weight transformers model of that config, saved for vLLM."""
    import torch
    import transformers

    directory.mkdir(parents=True, exist_ok=True)
    vocab = save_tokenizer(directory)
    model_config = getattr(transformers, config_name)(
        vocab_size=vocab, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False, **config
    )
    torch.manual_seed(seed)
    getattr(transformers, model_name)(model_config).to(getattr(torch, dtype)).save_pretrained(directory)
    return directory


def make_tiny_llama(directory: Path, seed: int = 0) -> Path:
    """2 layers, head size 32 (a size CPU attention supports), fp32."""
    return _save_model(
        directory,
        "LlamaConfig",
        "LlamaForCausalLM",
        "float32",
        seed,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=2048,
    )


def make_small_llama(directory: Path, seed: int = 0) -> Path:
    """2 layers, hidden 512, MLP 2048, 8 heads of 64 (2 KV heads), fp32: wide enough that
    the projections and the MLP, not attention, carry most of a prefill's work up to a
    2k context, as in real LLMs (the tiny Llama's work is mostly attention)."""
    return _save_model(
        directory,
        "LlamaConfig",
        "LlamaForCausalLM",
        "float32",
        seed,
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
    )


def _qwen3_moe(directory: Path, seed: int, **dims) -> Path:
    """A 2-layer Qwen3-MoE in fp32, top-2 over its experts, MoE in every layer, heads of 64."""
    return _save_model(
        directory,
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        "float32",
        seed,
        num_hidden_layers=2,
        head_dim=64,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=4096,
        **dims,
    )


def make_tiny_qwen3_moe(directory: Path, seed: int = 0, kv_heads: int = 1) -> Path:
    """Attention-only MoE: 2 layers, a 4-expert top-2 MoE in each, head size 64, fp32.
    Run it with --enable-expert-parallel (the gate's condition for MoE models). `kv_heads`
    widens the KV a token reads (8: about 1.3 us per token of KV on this host, where 1 is
    lost in a busy host's noise)."""
    return _qwen3_moe(
        directory,
        seed,
        hidden_size=128,
        intermediate_size=128,
        num_attention_heads=max(2, kv_heads),
        num_key_value_heads=kv_heads,
        num_experts=4,
        moe_intermediate_size=64,
    )


def _qwen3_next(directory: Path, seed: int, **dims) -> Path:
    """A 4-layer Qwen3-Next in bfloat16: heads of 64 (CPU kernels support them), 2 attention
    heads over 1 KV head, gated-delta-net layers of 1 key and 2 value heads, a top-2 MoE with
    experts and shared expert of 64. Run it with mamba_ssm_cache_dtype="float32"."""
    return _save_model(
        directory,
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        "bfloat16",
        seed,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        max_position_embeddings=4096,
        **dims,
    )


def make_tiny_qwen3_next(directory: Path, seed: int = 0) -> Path:
    """The Qwen3-Next layout: 3 gated-delta-net linear-attention layers + 1 full attention
    layer, a 4-expert top-2 MoE; head sizes 64 (CPU kernels support them). Run it in
    bfloat16 with mamba_ssm_cache_dtype="float32"."""
    return _qwen3_next(
        directory,
        seed,
        hidden_size=128,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        num_experts=4,
    )


def make_small_qwen3_moe(directory: Path, seed: int = 0) -> Path:
    """The MoE counterpart of the small Llama: 2 layers, hidden 512, an 8-expert top-2 MoE
    (experts of 256) in each, 8 heads of 64 (2 KV heads), fp32. The experts' weights are a
    step's main cost at small batches, so which experts the batch routes to moves it.
    Run it with --enable-expert-parallel (the gate's condition for MoE models)."""
    return _qwen3_moe(
        directory,
        seed,
        hidden_size=512,
        intermediate_size=1024,
        num_attention_heads=8,
        num_key_value_heads=2,
        num_experts=8,
        moe_intermediate_size=256,
    )


def make_qwen3_next_variant(directory: Path, seed: int = 0) -> Path:
    """Another Qwen3-Next layout: full attention in layers 0 and 3, gated-delta-net linear
    attention in 1 and 2, hidden 64, an 8-expert top-2 MoE; head sizes 64. Run it in bfloat16
    with mamba_ssm_cache_dtype="float32", mamba_cache_mode="align" and expert parallel on."""
    return _qwen3_next(
        directory,
        seed,
        hidden_size=64,
        layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"],
        num_experts=8,
    )


def make_tiny_nemotron_h(directory: Path, seed: int = 0) -> Path:
    """NemotronH: Mamba2, attention, Mamba2, MLP layers (dense), heads of 64, fp32.
    Mamba2 runs on the CPU engine only where the release's mixer does not need Triton
    (releases.toml's cpu_smoke_cases leaves it out elsewhere)."""
    from safetensors.torch import load_file, save_file

    _save_model(
        directory,
        "NemotronHConfig",
        "NemotronHForCausalLM",
        "float32",
        seed,
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=4,
        hybrid_override_pattern="M*M-",
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        mamba_num_heads=4,
        mamba_head_dim=64,
        ssm_state_size=16,
        n_groups=1,
        chunk_size=64,
        max_position_embeddings=4096,
    )
    # Some transformers 5 releases save the embedding as `backbone.embedding` (later ones as
    # `backbone.embeddings`); vLLM's loader maps the name published models use, `backbone.embeddings`.
    weights = directory / "model.safetensors"
    tensors = load_file(weights)
    if "backbone.embedding.weight" in tensors:
        tensors["backbone.embeddings.weight"] = tensors.pop("backbone.embedding.weight")
        save_file(tensors, weights, metadata={"format": "pt"})
    return directory


def make_tiny_deepseek_v2(directory: Path, seed: int = 0) -> Path:
    """DeepSeek-V2's MLA + MoE: 2 layers (layer 0 dense, layer 1 a 4-expert top-2 MoE with a
    shared expert), 2 heads, no query compression, a latent KV of kv_lora_rank 512 plus a
    rope part of 64 per token (576: the only width vLLM's CPU MLA decode kernel is built
    for), fp32. Run it with --enable-expert-parallel (the gate's condition for MoE models)."""
    return _save_model(
        directory,
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        "float32",
        seed,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_nope_head_dim=32,
        qk_rope_head_dim=64,
        v_head_dim=32,
        first_k_dense_replace=1,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_group=1,
        topk_group=1,
        max_position_embeddings=4096,
    )
