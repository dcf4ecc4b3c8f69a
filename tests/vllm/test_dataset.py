"""Chain text from a local ShareGPT-format file."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from vllm.kvwarm.sweep.dataset import ChainText, DatasetError, load_dataset


def _conversation(n: int) -> dict:
    return {
        "conversations": [
            {"from": "human", "value": f"question {n} " + "about decoding " * 6},
            {"from": "gpt", "value": "short"},
            {"from": "gpt", "value": f"answer {n} " + "with real text " * 6},
        ]
    }


def _half(conversation: dict) -> int:
    """Which half the file's loader puts a conversation in (0: the chains')."""
    text = "\n".join(t["value"] for t in conversation["conversations"] if len(t["value"]) >= 64)
    return hashlib.sha256(text.encode()).digest()[0] % 2


def _write(tmp_path, data) -> str:
    path = tmp_path / "sharegpt.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def test_the_collection_half_is_chosen_by_content_hash_not_order(tmp_path):
    data = [_conversation(n) for n in range(40)]
    path = _write(tmp_path, data)
    kept, digest = load_dataset(path)
    assert digest == hashlib.sha256(Path(path).read_bytes()).hexdigest()  # of the file's bytes
    assert 5 < len(kept) < 35  # about half
    assert all(hashlib.sha256(t.encode()).digest()[0] % 2 == 0 for t in kept)
    assert all("short" not in t.split("\n") for t in kept)  # turns under 64 chars dropped
    assert set(load_dataset(_write(tmp_path, data[::-1]))[0]) == set(kept)


def test_chain_draws_are_deterministic_and_deeper_draws_extend_shallower_ones(tmp_path):
    texts, _ = load_dataset(_write(tmp_path, [_conversation(n) for n in range(40)]))
    encode = lambda text: [ord(ch) for ch in text]
    text = ChainText(texts, encode)
    shallow, deep = text(0, 100), text(0, 5000)
    assert len(shallow) == 100 and len(deep) == 5000 and deep[:100] == shallow
    assert ChainText(texts, encode)(0, 5000) == deep
    assert text(1, 100) != shallow  # another chain, another draw


@pytest.mark.parametrize(
    "content, message",
    [
        ("[{", "is not valid JSON"),
        ({"conversations": []}, "expected a JSON list"),
        ([{"conversations": [{"from": "human", "value": "hi"}]}], "no conversation with turns of 64"),
    ],
)
def test_bad_datasets_say_what_is_wrong(tmp_path, content, message):
    with pytest.raises(DatasetError, match=message):
        load_dataset(_write(tmp_path, content))


def test_a_missing_dataset_names_the_variable(tmp_path):
    with pytest.raises(DatasetError, match="DYN_BENCH_KV_WARMUP_DATASET"):
        load_dataset(tmp_path / "missing.json")


def test_a_real_sweep_with_prefill_points_and_no_held_out_text_is_refused_before_the_engine(tmp_path):
    """Prefill points take their new tokens from the held-out half; a dataset whose
    conversations all fall in the chains' half is refused up front (it fell back to one
    repeated token), naming the file and the fix. Decode points never read that half."""
    from vllm.kvwarm.sweep.inputs import read_inputs

    even = [c for c in (_conversation(n) for n in range(60)) if _half(c) == 0]
    dataset = _write(tmp_path, even)
    points = tmp_path / "points.json"
    environ = {"DYN_BENCH_KV_WARMUP_DATASET": dataset}
    points.write_text(json.dumps({"schema_version": 1, "decode": [{"total_kv_read_tokens": 64, "batch_size": 1}]}))
    assert read_inputs(str(points), environ).held_out == []
    for spec in ({"prefill": [{"total_prefill_tokens": 64, "batch_size": 1}]}, None):
        if spec is not None:
            points.write_text(json.dumps({"schema_version": 1, **spec}))
        with pytest.raises(DatasetError, match=r"held-out half \(conversation_sha256_odd\) holds no text") as err:
            read_inputs(str(points) if spec else None, environ)  # None: a generated grid, which has prefill points
        assert dataset in str(err.value) and "DYN_BENCH_KV_WARMUP=off" in str(err.value)
