"""The warm-up's environment variables."""

from __future__ import annotations

import pytest
from vllm.kvwarm.sweep.settings import Settings, SettingsError, read_settings


def test_defaults():
    assert read_settings({}) == Settings(warmup="on", steady_steps=3, giant_kv_threshold=1_000_000, dataset=None)


@pytest.mark.parametrize(
    "raw, warmup", [("OFF", "off"), ("0", "off"), (" false ", "off"), ("on", "on"), ("True", "on"), ("force", "force")]
)
def test_warmup_switch(raw, warmup):
    assert read_settings({"DYN_BENCH_KV_WARMUP": raw}).warmup == warmup


def test_integers_in_range_are_taken_as_given():
    settings = read_settings({"DYN_BENCH_GIANT_KV_REPEATS": "1", "DYN_BENCH_GIANT_KV_THRESHOLD": " 0 "})
    assert (settings.steady_steps, settings.giant_kv_threshold) == (1, 0)
    assert read_settings({"DYN_BENCH_GIANT_KV_REPEATS": "7"}).steady_steps == 7


@pytest.mark.parametrize(
    "name, raw, minimum",
    [
        ("DYN_BENCH_GIANT_KV_REPEATS", "0", 1),
        ("DYN_BENCH_GIANT_KV_REPEATS", "-3", 1),
        ("DYN_BENCH_GIANT_KV_THRESHOLD", "-1", 0),
    ],
)
def test_out_of_range_integers_are_refused_not_raised_to_the_minimum(name, raw, minimum):
    with pytest.raises(SettingsError, match=f"{name}='{raw}' is out of range: it must be an integer >= {minimum}"):
        read_settings({name: raw})


@pytest.mark.parametrize(
    "env, message",
    [
        ({"DYN_BENCH_KV_WARMUP": "maybe"}, "DYN_BENCH_KV_WARMUP='maybe' is not one of on, off, force"),
        ({"DYN_BENCH_GIANT_KV_REPEATS": "three"}, "DYN_BENCH_GIANT_KV_REPEATS='three' is not an integer"),
        ({"DYN_BENCH_GIANT_KV_THRESHOLD": "1e6"}, "DYN_BENCH_GIANT_KV_THRESHOLD='1e6' is not an integer"),
    ],
)
def test_unknown_values_name_the_variable(env, message):
    with pytest.raises(SettingsError, match=message):
        read_settings(env)
