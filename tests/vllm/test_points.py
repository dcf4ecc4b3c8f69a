"""The decode points file (schema v1) and its errors."""

from __future__ import annotations

import json

import pytest
from vllm.kvwarm.sweep.points import DecodePoint, PointsFileError, load_points


def _write(tmp_path, data) -> str:
    path = tmp_path / "points.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def test_points_partition_their_kv_over_the_batch(tmp_path):
    path = _write(
        tmp_path,
        {
            "schema_version": 1,
            "decode": [{"total_kv_read_tokens": 1000, "batch_size": 3}, {"total_kv_read_tokens": 64, "batch_size": 64}],
        },
    )
    points = load_points(path, max_model_len=1024, steady_steps=3)
    assert points == [DecodePoint(1000, 3), DecodePoint(64, 64)]
    assert points[0].contexts() == [334, 333, 333] and sum(points[0].contexts()) == 1000
    assert points[1].contexts() == [1] * 64


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "is not valid JSON"),
        ([], "expected a JSON object"),
        ({"schema_version": 2, "decode": []}, "schema_version is 2"),
        ({"schema_version": 1, "decode": [], "prefill": [{"total_prefill_tokens": 8}]}, "decode points only"),
        ({"schema_version": 1, "decode": []}, "non-empty list"),
        ({"schema_version": 1, "decode": [{"total_kv_read_tokens": 10}]}, r"decode\[0\]: batch_size must be"),
        ({"schema_version": 1, "decode": [{"total_kv_read_tokens": "10", "batch_size": 1}]}, "positive integer"),
        ({"schema_version": 1, "decode": [{"total_kv_read_tokens": True, "batch_size": 1}]}, "positive integer"),
        ({"schema_version": 1, "decode": [{"total_kv_read_tokens": 2, "batch_size": 4}]}, "less than batch_size"),
        (
            {"schema_version": 1, "decode": [{"total_kv_read_tokens": 1021, "batch_size": 1}]},
            "needs 1025 tokens, beyond max_model_len 1024",
        ),
    ],
)
def test_bad_points_files_name_the_file_and_the_problem(tmp_path, content, message):
    path = _write(tmp_path, content)
    with pytest.raises(PointsFileError, match=message) as err:
        load_points(path, max_model_len=1024, steady_steps=3)
    assert path in str(err.value)


@pytest.mark.parametrize(
    "content, key, allowed",
    [
        (
            {"schema_version": 1, "decode": [{"total_kv_read_token": 10, "batch_size": 1}]},
            "total_kv_read_token",
            "batch_size, total_kv_read_tokens",
        ),
        (
            {"schema_version": 1, "decode": [{"total_kv_read_tokens": 10, "batch_size": 1, "batch": 2}]},
            "batch",
            "batch_size, total_kv_read_tokens",
        ),
        (
            {"schema_version": 1, "decodes": [{"total_kv_read_tokens": 10, "batch_size": 1}]},
            "decodes",
            "decode, prefill, schema_version",
        ),
    ],
)
def test_an_unknown_key_is_named_with_the_allowed_ones(tmp_path, content, key, allowed):
    path = _write(tmp_path, content)
    with pytest.raises(PointsFileError) as err:
        load_points(path, max_model_len=1024, steady_steps=3)
    message = str(err.value)
    assert f"unknown key {key!r}" in message and f"allowed: {allowed}" in message and path in message


def test_a_missing_points_file_says_which(tmp_path):
    with pytest.raises(PointsFileError, match=r"points file .*nope\.json not found"):
        load_points(tmp_path / "nope.json", max_model_len=1024, steady_steps=3)
