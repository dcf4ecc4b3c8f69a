"""Model folders for the GPU steps of issues 60 and 61, written where they run: config.json and
a tokenizer, no weights (vLLM's `--load-format dummy` fills the weights with random values from
the config), so nothing large travels to the GPU host.

  full    the published architecture facts (docs/gpu-shapes.md): NemotronH hybrid MoE at the
          shape of Nemotron-3-Nano-30B-A3B, DeepSeek-V2-Lite (MLA + MoE), Qwen3-30B-A3B
  scaled  the same architectures (classes, layer kinds, MLA's latent width, the state cache's
          dtype) at a width and depth the CPU engine runs: the dry run's (NemotronH's MoE
          layers dense there: the CPU engine has no MoE of its relu2 activation)

The tokenizer is a byte-level BPE trained on a few sentences, its vocabulary filled up to the
config's vocab_size with plain-text tokens: dummy weights sample any id below vocab_size, and
the server detokenizes every one of them. Special tokens <s> and </s> are ids 0 and 1, and the
config's bos/eos say so.

  python smoke/gpu_models.py DIR [--device cpu] [--only nemotron,mla,qwen3] [--nemotron-layers N]
Needs `tokenizers` and `transformers` (both on the GPU host) and nothing of vLLM.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# Nemotron-3-Nano-30B-A3B's 52 layers: M Mamba2, E MoE, * attention (23, 23, 6).
NEMOTRON_PATTERN = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"
SPECIALS = ["<s>", "</s>"]  # ids 0 and 1
_CORPUS = [
    "Decode step time depends on batch size and the KV context each request reads.",
    "Prefix caching lets requests that share a prompt share their KV blocks.",
    "decode prefill cache block shadow chain rung batch token step kernel expert route state",
    "attention memory layer model sample greedy context prefix pool fork copy graph queue",
    "The quick brown fox jumps over the lazy dog. 0 1 2 3 4 5 6 7 8 9 , . ; : ! ? ( ) [ ] -",
]


def nemotron_h(scaled: bool, layers: int | None = None, dense: bool = False) -> dict:
    """NemotronHForCausalLM: hidden 2688, 32 heads / 2 KV heads of 128; Mamba2 64 heads of 64,
    state 128, 8 groups, conv 4, chunk 128, SSM cache fp32; MoE 128 experts top-6 + 1 shared,
    expert width 1856 (the shared expert's 3712, as the published config has it: with it the
    parameters add up to the published 31.6 B); vocab 131072. `layers`: the pattern's first N
    (an H100 that cannot hold all 52). `dense`: the MoE layers dense ("-", NemotronH's relu2
    MLP), for the CPU engine: its fused MoE has no non-gated activation ("is_act_and_mul=False
    is supported only for CUDA, XPU and ROCm")."""
    pattern = "MEM*EME" if scaled else NEMOTRON_PATTERN[: layers or len(NEMOTRON_PATTERN)]
    pattern = pattern.replace("E", "-") if dense else pattern
    dims = {
        "hidden_size": 2688,
        "num_attention_heads": 32,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "mamba_num_heads": 64,
        "mamba_head_dim": 64,
        "ssm_state_size": 128,
        "n_groups": 8,
        "chunk_size": 128,
        "n_routed_experts": 128,
        "num_experts_per_tok": 6,
        "moe_intermediate_size": 1856,
        "moe_shared_expert_intermediate_size": 3712,
        "intermediate_size": 1856,
        "vocab_size": 131072,
        "max_position_embeddings": 262144,
    }
    if scaled:  # heads of 64: sizes vLLM's CPU kernels take
        dims.update(
            hidden_size=128,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=64,
            mamba_num_heads=4,
            mamba_head_dim=32,
            ssm_state_size=16,
            n_groups=1,
            chunk_size=64,
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            moe_shared_expert_intermediate_size=128,
            intermediate_size=64,
            vocab_size=4096,
            max_position_embeddings=16384,
        )
    return {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "num_hidden_layers": len(pattern),
        "hybrid_override_pattern": pattern,
        **dims,
        # the same under the names vLLM's own NemotronHConfig takes (releases that register it)
        "mamba_n_groups": dims["n_groups"],
        "mamba_chunk_size": dims["chunk_size"],
        "mamba_d_conv": 4,
        "conv_kernel": 4,
        "expand": 2,
        "mamba_ssm_cache_dtype": "float32",
        "n_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "mlp_hidden_act": "relu2",
        "mamba_hidden_act": "silu",
        "use_conv_bias": True,
        "mamba_proj_bias": False,
        "attention_bias": False,
        "mlp_bias": False,
        "use_bias": False,
        "layer_norm_epsilon": 1e-5,
        "residual_in_fp32": False,
        "rescale_prenorm_residual": True,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


def deepseek_v2_lite(scaled: bool) -> dict:
    """DeepseekV2ForCausalLM: 27 layers (layer 0 dense, width 10944), hidden 2048, 16 heads,
    kv_lora_rank 512, no query compression, qk_nope 128 + qk_rope 64, v 128; 64 routed experts
    top-6 + 2 shared, width 1408; vocab 102400; YaRN to 163840 positions as published. The
    scaled one keeps the latent width (512 + 64: the only one vLLM's CPU MLA kernel takes)."""
    dims = {
        "num_hidden_layers": 27,
        "hidden_size": 2048,
        "intermediate_size": 10944,
        "num_attention_heads": 16,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "n_routed_experts": 64,
        "moe_intermediate_size": 1408,
        "num_experts_per_tok": 6,
        "n_shared_experts": 2,
        "vocab_size": 102400,
    }
    if scaled:
        dims.update(
            num_hidden_layers=3,
            hidden_size=128,
            intermediate_size=256,
            num_attention_heads=2,
            qk_nope_head_dim=32,
            v_head_dim=32,
            n_routed_experts=8,
            moe_intermediate_size=64,
            num_experts_per_tok=2,
            n_shared_experts=2,
            vocab_size=4096,
        )
    return {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        **dims,
        "num_key_value_heads": dims["num_attention_heads"],
        "kv_lora_rank": 512,
        "q_lora_rank": None,
        "qk_rope_head_dim": 64,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "greedy",
        "scoring_func": "softmax",
        "norm_topk_prob": False,
        "routed_scaling_factor": 1.0,
        "hidden_act": "silu",
        "max_position_embeddings": 163840,
        "rope_theta": 10000,
        "rope_scaling": {
            "type": "yarn",
            "factor": 40,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        },
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


def qwen3_moe(scaled: bool) -> dict:
    """Qwen3MoeForCausalLM: 48 layers, hidden 2048, 32 heads / 4 KV heads of 128 (q/k norm),
    128 experts top-8 of width 768, norm_topk_prob; vocab 151936."""
    dims = {
        "num_hidden_layers": 48,
        "hidden_size": 2048,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "intermediate_size": 6144,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
    }
    if scaled:
        dims.update(
            num_hidden_layers=2,
            hidden_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            num_experts=16,
            num_experts_per_tok=4,
            moe_intermediate_size=64,
            intermediate_size=256,
            vocab_size=4096,
            max_position_embeddings=16384,
        )
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        **dims,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "hidden_act": "silu",
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


MODELS = {"nemotron": nemotron_h, "mla": deepseek_v2_lite, "qwen3": qwen3_moe}
FOLDERS = {"nemotron": "nemotron-h-30b-a3b", "mla": "deepseek-v2-lite", "qwen3": "qwen3-30b-a3b"}


def parameters(config: dict) -> int:
    """The parameter count of a config made here (what dummy weights fill): the check that a
    full-shape config adds up to the published size."""
    h, vocab = config["hidden_size"], config["vocab_size"]
    total = 2 * vocab * h  # embeddings and an untied head
    kind = config["model_type"]
    if kind == "nemotron_h":
        inner = config["mamba_num_heads"] * config["mamba_head_dim"]
        groups = 2 * config["n_groups"] * config["ssm_state_size"]
        mamba = h * (2 * inner + groups + config["mamba_num_heads"]) + (inner + groups) * 4 + inner * h
        heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
        attention = 2 * h * heads * config["head_dim"] + 2 * h * kv * config["head_dim"]
        moe = config["n_routed_experts"] * 2 * h * config["moe_intermediate_size"] + h * config["n_routed_experts"]
        moe += 2 * h * config["moe_shared_expert_intermediate_size"] * config["n_shared_experts"]
        per = {"M": mamba, "*": attention, "E": moe, "-": 2 * h * config["intermediate_size"]}
        return total + sum(per[c] for c in config["hybrid_override_pattern"])
    if kind == "deepseek_v2":
        heads, rope = config["num_attention_heads"], config["qk_rope_head_dim"]
        qk = config["qk_nope_head_dim"] + rope
        attention = h * heads * qk + h * (config["kv_lora_rank"] + rope)
        attention += config["kv_lora_rank"] * heads * (config["qk_nope_head_dim"] + config["v_head_dim"])
        attention += heads * config["v_head_dim"] * h
        expert = 3 * h * config["moe_intermediate_size"]
        moe = (config["n_routed_experts"] + config["n_shared_experts"]) * expert + h * config["n_routed_experts"]
        dense, layers = config["first_k_dense_replace"], config["num_hidden_layers"]
        return total + layers * attention + dense * 3 * h * config["intermediate_size"] + (layers - dense) * moe
    heads, kv, dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    attention = 2 * h * heads * dim + 2 * h * kv * dim
    moe = config["num_experts"] * 3 * h * config["moe_intermediate_size"] + h * config["num_experts"]
    return total + config["num_hidden_layers"] * (attention + moe)


def write_tokenizer(directory: Path, vocab_size: int) -> None:
    """A byte-level BPE of exactly `vocab_size` ids: trained merges for encoding text, then
    plain-text tokens (`<|id_N|>`, decoded as written) up to vocab_size, so that every id a
    model with dummy weights samples decodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=min(vocab_size, 1024),
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS * 8, trainer)
    spec = json.loads(tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    fill = (f"<|id_{i}|>" for i in range(len(vocab), vocab_size))
    vocab.update((token, i) for i, token in zip(range(len(vocab), vocab_size), fill))
    if len(vocab) != vocab_size or sorted(vocab.values()) != list(range(vocab_size)):
        raise RuntimeError(f"the tokenizer holds {len(vocab)} ids, not 0..{vocab_size - 1}")
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(spec)), bos_token="<s>", eos_token="</s>"
    )
    wrapped.model_max_length = 1 << 20
    wrapped.save_pretrained(directory)


def write_model(folder: Path, config: dict) -> Path:
    """config.json (bos 0, eos 1: the tokenizer's) and the tokenizer; returns the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {**config, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 1}
    (folder / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    write_tokenizer(folder, config["vocab_size"])
    return folder


def check_model(folder: Path) -> str:
    """Read back as vLLM will (transformers' AutoConfig and AutoTokenizer): the layer count and
    the vocabulary; a summary line."""
    from transformers import AutoConfig, AutoTokenizer

    config = json.loads((folder / "config.json").read_text())
    loaded = AutoConfig.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if loaded.num_hidden_layers != config["num_hidden_layers"] or len(tokenizer) != config["vocab_size"]:
        raise RuntimeError(
            f"{folder}: read back {loaded.num_hidden_layers} layers and {len(tokenizer)} tokens, "
            f"not {config['num_hidden_layers']} and {config['vocab_size']}"
        )
    tokenizer.decode([config["vocab_size"] - 1, 2, 3])  # the last id decodes too
    size = sum(p.stat().st_size for p in folder.iterdir()) / (1 << 20)
    return (
        f"{folder.name}: {config['architectures'][0]}, {config['num_hidden_layers']} layers, "
        f"{parameters(config) / 1e9:.2f} B parameters ({parameters(config) * 2 / (1 << 30):.1f} GiB in bf16), "
        f"vocab {config['vocab_size']}; {size:.1f} MiB on disk"
    )


def configs(device: str, nemotron_layers: int | None = None) -> dict[str, tuple[str, dict]]:
    """{name: (folder name, config)} of what a device's steps run: on CUDA the full shapes and
    a small NemotronH (MoE; the in-place refusal needs no full boot), on the CPU engine every
    one scaled (NemotronH dense)."""
    if device == "cpu":
        made = {name: (f"{FOLDERS[name]}-scaled", MODELS[name](True)) for name in MODELS}
        made["nemotron"] = (f"{FOLDERS['nemotron']}-scaled-dense", nemotron_h(True, dense=True))
        return {**made, "nemotron-small": made["nemotron"]}
    made = {name: (FOLDERS[name], MODELS[name](False)) for name in MODELS}
    if nemotron_layers:
        made["nemotron"] = (f"{FOLDERS['nemotron']}-{nemotron_layers}l", nemotron_h(False, nemotron_layers))
    return {**made, "nemotron-small": (f"{FOLDERS['nemotron']}-scaled", nemotron_h(True))}


def write_models(root: Path, device: str, only: list[str] | None = None, nemotron_layers: int | None = None) -> dict:
    """The folders asked for under `root` (kept where already written); {name: folder}."""
    known = configs(device, nemotron_layers)
    unknown = sorted(set(only or ()) - set(known))
    if unknown:
        raise SystemExit(f"gpu_models: unknown model(s) {unknown}; the models are {', '.join(known)}")
    made = {}
    for name in only or list(known):
        folder_name, config = known[name]
        folder = root / folder_name
        if not (folder / "tokenizer.json").exists():
            write_model(folder, config)
        made[name] = folder
    return made


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu_models.py", description=__doc__.split("\n\n")[0])
    p.add_argument("root", type=Path, help="the folder to write the model folders in")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: the dry run's scaled configs")
    p.add_argument("--only", help=f"comma-separated, of {', '.join(MODELS)}, nemotron-small")
    p.add_argument("--nemotron-layers", type=int, help="NemotronH: the first N layers of its pattern only")
    args = p.parse_args(argv)
    made = write_models(args.root, args.device, args.only.split(",") if args.only else None, args.nemotron_layers)
    for folder in made.values():
        print(check_model(folder), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
