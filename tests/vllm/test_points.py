"""The points file (schema v1: decode and prefill points) and its errors."""

from __future__ import annotations

import json

import pytest
from vllm.kvwarm.sweep.points import DecodePoint, PointsFileError, PrefillPoint, load_points


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


def test_prefill_points_split_n_evenly_and_p_in_whole_blocks(tmp_path):
    path = _write(
        tmp_path,
        {
            "schema_version": 1,
            "decode": [{"total_kv_read_tokens": 64, "batch_size": 2}],
            "prefill": [
                {"total_prefill_tokens": 100, "total_kv_read_tokens": 80, "batch_size": 3},
                {"total_prefill_tokens": 16, "batch_size": 1},
            ],
        },
    )
    points = load_points(path, max_model_len=1024, steady_steps=3)
    assert points == [PrefillPoint(100, 80, 3), PrefillPoint(16, 0, 1), DecodePoint(64, 2)]  # prefill first
    prefill = points[0]
    assert prefill.new_tokens() == [34, 33, 33] and prefill.prefixes(16) == [32, 32, 16]
    assert points[1].prefixes(16) == [0] and points[1].tokens_spanned(16) == 17
    with pytest.raises(PointsFileError, match=r"whole number of 32-token blocks, at least one per request \(use 96\)"):
        prefill.prefixes(32)
    with pytest.raises(PointsFileError, match=r"\(use 80 or 96\)"):
        PrefillPoint(100, 88, 2).prefixes(16)


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "is not valid JSON"),
        ([], "expected a JSON object"),
        ({"schema_version": 4, "decode": []}, "schema_version is 4"),
        (
            {"schema_version": 1, "decode": [], "prefill": [{"total_prefill_tokens": 8}]},
            r"prefill\[0\]: batch_size must be a positive integer",
        ),
        ({"schema_version": 1, "decode": []}, "all empty"),
        ({"schema_version": True, "decode": [{"total_kv_read_tokens": 8, "batch_size": 1}]}, "is True; this sweep"),
        ({"schema_version": 1.0, "decode": [{"total_kv_read_tokens": 8, "batch_size": 1}]}, "is 1.0; this sweep"),
        (
            {"schema_version": 1, "decode": [{"total_kv_read_tokens": 8, "batch_size": 1}] * 2},
            r"decode\[1\] repeats decode\[0\]; give each point once",
        ),
        (
            {
                "schema_version": 1,
                "prefill": [
                    {"total_prefill_tokens": 8, "batch_size": 1},
                    {"total_prefill_tokens": 16, "batch_size": 1},
                    {"total_prefill_tokens": 8, "total_kv_read_tokens": 0, "batch_size": 1},
                ],
            },
            r"prefill\[2\] repeats prefill\[0\]",
        ),
        ({"schema_version": 1, "decode": {"total_kv_read_tokens": 8}}, "'decode' must be a list"),
        (
            {"schema_version": 1, "prefill": [{"total_prefill_tokens": 2, "total_kv_read_tokens": 0, "batch_size": 4}]},
            "total_prefill_tokens 2 is less than batch_size 4",
        ),
        (
            {"schema_version": 1, "prefill": [{"total_prefill_tokens": 8, "total_kv_read_tokens": 3, "batch_size": 4}]},
            "total_kv_read_tokens 3 gives a request no prefix",
        ),
        (
            {
                "schema_version": 1,
                "prefill": [{"total_prefill_tokens": 8, "total_kv_read_tokens": -16, "batch_size": 1}],
            },
            "total_kv_read_tokens must be an integer >= 0",
        ),
        (
            {
                "schema_version": 1,
                "prefill": [{"total_prefill_tokens": 500, "total_kv_read_tokens": 600, "batch_size": 1}],
            },
            "beyond max_model_len 1024",
        ),
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


def test_a_mistyped_batch_size_is_refused_by_the_engines_limit_before_anything_is_allocated(tmp_path):
    """A batch of 10^20 requests: the file is read by arithmetic (it built a list of B
    contexts, an OverflowError or a stall), then refused against max_num_seqs."""
    from kvwarm_testing.real_kv import make_scheduler
    from vllm.kvwarm.sweep.limits import check_points

    huge = 10**20
    path = _write(
        tmp_path,
        {
            "schema_version": 1,
            "decode": [{"total_kv_read_tokens": 10 * huge, "batch_size": huge}],
            "prefill": [{"total_prefill_tokens": 10 * huge, "total_kv_read_tokens": 0, "batch_size": huge}],
        },
    )
    points = load_points(path, max_model_len=1024, steady_steps=3)
    scheduler = make_scheduler(tmp_path)
    with pytest.raises(PointsFileError, match=rf"batch size\(s\) \[{huge}\] exceed max_num_seqs 8"):
        check_points(points, scheduler.vllm_config, scheduler.kv_cache_manager, path)
