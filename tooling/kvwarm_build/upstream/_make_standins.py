"""Offline stand-ins for Hugging Face hub models, written into a hub cache.

vLLM's CPU tests name real hub ids but only read their config, tokenizer and
processor (never weights). This file holds the one table of the ids we can fake
and, run as a script inside a venv that has transformers + tokenizers, writes
them in the standard cache layout:

    <hub>/models--org--name/refs/main                 -> "<rev>"
    <hub>/models--org--name/snapshots/<rev>/config.json, tokenizer.json, ...

The tooling imports STANDINS/VERSION from here without importing transformers.
Usage: python _make_standins.py <hub_dir> <model_id> [<model_id> ...]
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

# Bump when anything below changes what gets written; the cache marker records it.
VERSION = 1

# Specials each tokenizer family needs, at the ids the real tokenizers use
# (configs and processors refer to those ids). `base` is the size of the
# ordinary vocab; specials at or past it are added tokens.
_QWEN_SPECIALS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>",
    "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>",
    "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>",
    "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
    "<think>", "</think>",
]  # fmt: skip
TOKENIZER_FAMILIES = {
    # OPT reuses GPT-2's BPE with fairseq's four specials in front.
    "opt": {
        "base": 50265,
        "specials": {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3},
        "roles": {"bos": "</s>", "eos": "</s>", "pad": "<pad>", "unk": "<unk>"},
    },
    "llama": {
        "base": 32000,
        "specials": {"<unk>": 0, "<s>": 1, "</s>": 2, "<image>": 32000, "<pad>": 32001},
        "roles": {"bos": "<s>", "eos": "</s>", "pad": "<pad>", "unk": "<unk>"},
    },
    "qwen": {
        "base": 151643,
        "specials": {t: 151643 + i for i, t in enumerate(_QWEN_SPECIALS)},
        "roles": {"eos": "<|im_end|>", "pad": "<|endoftext|>"},
    },
}

_QWEN2_5_VL_VISION = {
    "depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
    "out_hidden_size": 2048, "patch_size": 14, "spatial_merge_size": 2,
    "temporal_patch_size": 2, "window_size": 112, "tokens_per_second": 2,
    "fullatt_block_indexes": [7, 15, 23, 31], "in_chans": 3,
}  # fmt: skip

# id -> what to fake. `config` overrides transformers' defaults for model_type
# with the real model's values the tests depend on (shapes feed KV-cache
# sizing, max_position_embeddings feeds max_model_len checks).
STANDINS: dict[str, dict] = {
    "facebook/opt-125m": {
        "arch": "OPTForCausalLM", "model_type": "opt", "tokenizer": "opt",
        "config": {"torch_dtype": "float16", "prefix": "</s>"},
    },
    "facebook/opt-350m": {
        "arch": "OPTForCausalLM", "model_type": "opt", "tokenizer": "opt",
        "config": {"torch_dtype": "float16", "prefix": "</s>", "hidden_size": 1024,
                   "ffn_dim": 4096, "num_hidden_layers": 24, "num_attention_heads": 16,
                   "word_embed_proj_dim": 512, "do_layer_norm_before": False},
    },
    "Qwen/Qwen1.5-7B": {
        "arch": "Qwen2ForCausalLM", "model_type": "qwen2", "tokenizer": "qwen",
        "config": {"torch_dtype": "bfloat16", "hidden_size": 4096, "intermediate_size": 11008,
                   "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
                   "max_position_embeddings": 32768, "vocab_size": 151936, "rope_theta": 1e6,
                   "bos_token_id": 151643, "eos_token_id": 151643, "tie_word_embeddings": False},
    },
    # vLLM's ModelConfig() default model: tests that build configs without a
    # model id need it even though they never name it.
    "Qwen/Qwen3-0.6B": {
        "arch": "Qwen3ForCausalLM", "model_type": "qwen3", "tokenizer": "qwen",
        "config": {"torch_dtype": "bfloat16", "hidden_size": 1024, "intermediate_size": 3072,
                   "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
                   "head_dim": 128, "max_position_embeddings": 40960, "vocab_size": 151936,
                   "rope_theta": 1e6, "bos_token_id": 151643, "eos_token_id": 151645,
                   "tie_word_embeddings": True},
    },
    "llava-hf/llava-1.5-7b-hf": {
        "arch": "LlavaForConditionalGeneration", "model_type": "llava", "tokenizer": "llava",
        "processor": "llava",
        "config": {"torch_dtype": "float16", "image_token_index": 32000, "pad_token_id": 32001,
                   "vocab_size": 32064,
                   "text_config": {"model_type": "llama", "vocab_size": 32064,
                                   "max_position_embeddings": 4096, "rms_norm_eps": 1e-5},
                   "vision_config": {"model_type": "clip_vision_model", "hidden_size": 1024,
                                     "image_size": 336, "intermediate_size": 4096,
                                     "num_attention_heads": 16, "num_hidden_layers": 24,
                                     "patch_size": 14, "projection_dim": 768}},
    },
    "Qwen/Qwen2.5-VL-3B-Instruct": {
        "arch": "Qwen2_5_VLForConditionalGeneration", "model_type": "qwen2_5_vl",
        "tokenizer": "qwen", "processor": "qwen2_5_vl",
        "config": {"torch_dtype": "bfloat16", "image_token_id": 151655, "video_token_id": 151656,
                   "vision_start_token_id": 151652, "vision_end_token_id": 151653,
                   "tie_word_embeddings": True,
                   "text_config": {"hidden_size": 2048, "intermediate_size": 11008,
                                   "num_hidden_layers": 36, "num_attention_heads": 16,
                                   "num_key_value_heads": 2, "max_position_embeddings": 128000,
                                   "vocab_size": 151936, "rope_theta": 1e6,
                                   "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
                                   "bos_token_id": 151643, "eos_token_id": 151645,
                                   "tie_word_embeddings": True},
                   "vision_config": _QWEN2_5_VL_VISION},
    },
}  # fmt: skip
TOKENIZER_FAMILIES["llava"] = TOKENIZER_FAMILIES["llama"]

# Enough text for a few hundred byte-level merges; the ids, not the merges, matter.
_CORPUS = """\
The scheduler decides which requests run in the next step and how many tokens
each one may process. Blocks of the key value cache are shared between requests
whose prompts begin with the same tokens, so a prefix that was computed once can
be reused. When memory runs short, the lowest priority request is preempted and
its blocks are freed; it will be recomputed later. Images and videos are turned
into embeddings by an encoder, and the encoder cache keeps them until every
request that needs them has been scheduled. Hello, my name is Robert and I like
numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. What is the capital of France? Paris.
A quick brown fox jumps over the lazy dog while the server answers questions.
"""

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def revision(model_id: str) -> str:
    """A stable fake commit hash, so reruns write the same snapshot path."""
    return hashlib.sha1(f"kvwarm-standin/{VERSION}/{model_id}".encode()).hexdigest()


def _tokenizer(family: str, max_len: int):
    """Byte-level BPE trained on the corpus, padded so the specials land on the real ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    spec = TOKENIZER_FAMILIES[family]
    base, specials = spec["base"], spec["specials"]
    trainer = trainers.BpeTrainer(
        vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    small = Tokenizer(models.BPE())
    small.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    small.train_from_iterator(_CORPUS.splitlines(), trainer)
    trained = json.loads(small.to_str())["model"]

    # Final vocab: in-range specials at their ids, trained tokens in the free
    # slots, then unreachable fillers up to `base`.
    vocab = {t: i for t, i in specials.items() if i < base}
    taken = set(vocab.values())
    free = (i for i in range(base) if i not in taken)
    for tok, _ in sorted(trained["vocab"].items(), key=lambda kv: kv[1]):
        vocab[tok] = next(free)
    for n, i in enumerate(free):
        vocab[f"<standin_fill_{n}>"] = i
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # Added in id order so the ones past `base` get exactly their real ids.
    added = sorted(specials.items(), key=lambda kv: kv[1])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, _ in added])
    got = {t: tok.token_to_id(t) for t in specials}
    assert got == specials, f"special ids drifted: {got}"

    roles = {f"{r}_token": t for r, t in spec["roles"].items()}
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=max_len, **roles)


def _config(spec: dict):
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(spec["model_type"], **spec["config"])
    cfg.architectures = [spec["arch"]]
    return cfg


def _processor(kind: str, tokenizer):
    """What to save beside the tokenizer for a multimodal model.

    Qwen2.5-VL gets only its image processor: building the full processor needs
    a video processor, which needs torchvision; AutoProcessor assembles it at
    load time from preprocessor_config.json + the tokenizer.
    """
    if kind == "llava":
        from transformers import CLIPImageProcessor, LlavaProcessor

        images = CLIPImageProcessor(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336})
        return LlavaProcessor(
            image_processor=images, tokenizer=tokenizer, patch_size=14,
            vision_feature_select_strategy="default", num_additional_image_tokens=1,
            image_token="<image>", chat_template=CHAT_TEMPLATE,
        )  # fmt: skip
    if kind == "qwen2_5_vl":
        from transformers import Qwen2VLImageProcessor

        return Qwen2VLImageProcessor(size={"shortest_edge": 3136, "longest_edge": 12845056})
    raise ValueError(f"unknown processor kind {kind!r}")


def make(hub: Path, model_id: str) -> None:
    spec = STANDINS[model_id]
    repo = hub / ("models--" + model_id.replace("/", "--"))
    rev = revision(model_id)
    snap = repo / "snapshots" / rev
    snap.mkdir(parents=True, exist_ok=True)

    cfg = _config(spec)
    cfg.save_pretrained(snap)
    text = cfg.get_text_config()
    tokenizer = _tokenizer(spec["tokenizer"], text.max_position_embeddings)
    if len(tokenizer) > text.vocab_size:
        raise SystemExit(f"{model_id}: tokenizer ({len(tokenizer)}) > vocab ({text.vocab_size})")
    if spec.get("tokenizer") == "qwen":
        tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(snap)
    if "processor" in spec:
        _processor(spec["processor"], tokenizer).save_pretrained(snap)

    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(rev)


def main(argv: list[str]) -> int:
    # transformers' image processors import torchvision; see the shim's docstring.
    import _torchvision_shim  # noqa: F401  (this file's folder is sys.path[0])

    hub, ids = Path(argv[0]), argv[1:]
    unknown = [i for i in ids if i not in STANDINS]
    if unknown:
        print(f"no stand-in recipe for: {', '.join(unknown)}", file=sys.stderr)
        return 2
    for model_id in ids:
        make(hub, model_id)
        print(f"stand-in ready: {model_id}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
