"""Joining the ranks' store on a real TCPStore (127.0.0.1): a rank that cannot reach it, a rank 0
that cannot host it (its sweep fails, the engine serves on), a rank that comes before the store
does, a second launch on one port; where the store listens, the rank settings' errors, and the
command's refusal of data parallel over Ray on this platform."""

from __future__ import annotations

import json
import socket
import time

import pytest
from kvwarm_testing.rank_sweeps import HangingUp, met, rank_runs, refusing_port, settled, until, view
from kvwarm_testing.real_kv import make_request, step_scheduler
from vllm.kvwarm.sweep import provenance
from vllm.kvwarm.sweep.exchange import make_exchange
from vllm.kvwarm.sweep.exchange.files import FileExchange
from vllm.kvwarm.sweep.exchange.solo import SoloExchange
from vllm.kvwarm.sweep.exchange.store import PORT_OFFSET, StoreExchange, store_address
from vllm.kvwarm.sweep.ranks import RankFailed
from vllm.kvwarm.sweep.settings import SettingsError, read_settings


@pytest.fixture(autouse=True)
def _hashing():
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    init_none_hash(sha256)


def test_a_rank_that_cannot_reach_the_store_fails_naming_the_address_the_port_and_the_settings(tmp_path):
    with refusing_port() as port:  # nothing listens there, and nothing can while it is held
        exchange = StoreExchange(
            "127.0.0.1", port, 2, 1, timeout=1.0, start_timeout=1.0, root=tmp_path, origin="set by test"
        )
        exchange.post("pool", {"usable_blocks": 1})  # while it still tries: kept for when it is in
        assert exchange.poll() is None
        with pytest.raises(RankFailed) as failed:
            while exchange.poll() is None:  # a connection refused: it tries again until the timeout
                time.sleep(0.05)
    message = str(failed.value)
    assert message.startswith(
        f"rank 1 could not reach the rank exchange (torch TCPStore) that rank 0 hosts at "
        f"127.0.0.1:{port} (port set by test) within 1 s (while the ranks start: "
        "DYN_BENCH_KV_WARMUP_RANK_START_TIMEOUT, default DYN_BENCH_KV_WARMUP_RANK_TIMEOUT)"
    )
    assert "DYN_BENCH_KV_WARMUP_RANK_SYNC_PORT" in message and "DYN_BENCH_KV_WARMUP_RANK_SYNC=files" in message
    exchange.post_failure("RankFailed: ...")  # never raises


def test_a_rank_0_that_cannot_host_fails_its_sweep_and_the_engine_serves_on(tmp_path, monkeypatch):
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        (scheduler,), out = rank_runs(tmp_path, monkeypatch, [(300, 2)], start=[0], port=port)
        step_scheduler(scheduler)  # the first boundary: the sweep fails, the engine does not
    own = json.loads((out / "dp0" / "sweep.json").read_text())
    assert own["status"] == "failed"
    assert own["error"].startswith(
        f"RankFailed: rank 0 could not host the rank exchange (torch TCPStore) at "
        f"127.0.0.1:{port} (port set by DYN_BENCH_KV_WARMUP_RANK_SYNC_PORT): "
    )
    assert "EADDRINUSE" in own["error"] or "in use" in own["error"]
    assert "DYN_BENCH_KV_WARMUP_RANK_SYNC=files" in own["error"]
    scheduler.add_request(make_request("user-after", 20))
    for _ in range(40):
        if not scheduler.has_requests():
            break
        step_scheduler(scheduler)
    assert "user-after" not in scheduler.requests  # served to its end
    rank_1 = view(scheduler)["ranks"][1]  # rank 0 cannot hear from it: final at once
    assert rank_1["status"] == "failed" and rank_1["error"].startswith("rank 0 cannot hear from it (it sent no record)")


def test_a_rank_that_connects_late_posts_as_soon_as_it_is_in(tmp_path):
    """Rank 1 starts before rank 0 hosts the store: its first attempts find nothing serving
    the port (a listener that hangs up), and its posts wait in it until it is in."""
    not_yet = HangingUp()
    rank_1 = StoreExchange("127.0.0.1", not_yet.port, 2, 1, timeout=30.0, root=tmp_path / "out1")
    rank_1.post("pool", {"usable_blocks": 7})
    assert rank_1.poll() is None
    until(lambda: not_yet.connections >= 2, "rank 1 made no attempt to join")  # the probe, then the store's
    assert not rank_1.settled() and rank_1.poll() is None
    not_yet.release()
    rank_0 = StoreExchange("127.0.0.1", not_yet.port, 2, 0, timeout=30.0, root=tmp_path / "out0")
    rank_0.post("pool", {"usable_blocks": 9})
    assert [(r["rank"], r["usable_blocks"]) for r in met(rank_0)] == [(0, 9), (1, 7)]
    assert [(r["rank"], r["usable_blocks"]) for r in met(rank_1)] == [(0, 9), (1, 7)]


def test_a_second_launch_on_the_same_port_is_refused_not_mixed_in(tmp_path):
    rank_0 = StoreExchange("127.0.0.1", 0, 2, 0, root=tmp_path / "a0")  # on a free port it takes
    first = [rank_0, settled(StoreExchange("127.0.0.1", rank_0.port, 2, 1, root=tmp_path / "a1"))]
    intruder = settled(StoreExchange("127.0.0.1", rank_0.port, 2, 1, root=tmp_path / "b1"))
    with pytest.raises(RankFailed, match="rank 1 of another launch already joined the rank exchange at 127.0.0.1"):
        intruder.post("pool", {"usable_blocks": 1})
    for exchange in first:
        exchange.post("pool", {"usable_blocks": 2})
    assert [[r["usable_blocks"] for r in met(e)] for e in first] == [[2, 2], [2, 2]]


def test_the_store_listens_beside_vllms_dp_master_port_or_where_the_setting_says(tmp_path):
    from vllm.config import ParallelConfig

    parallel = ParallelConfig()
    master = parallel.data_parallel_master_port
    assert store_address(parallel) == (
        parallel.data_parallel_master_ip,
        master + PORT_OFFSET,
        f"vLLM's DP master port {master} + 10",
    )
    assert store_address(parallel, 4242) == (
        parallel.data_parallel_master_ip,
        4242,
        "set by DYN_BENCH_KV_WARMUP_RANK_SYNC_PORT",
    )
    parallel.data_parallel_master_port = 65530
    assert store_address(parallel)[1] == 65520
    layout = provenance.RankLayout(2, 1, 1, 1, False)
    files = make_exchange(layout, tmp_path, parallel, read_settings({"DYN_BENCH_KV_WARMUP_RANK_SYNC": "files"}))
    assert isinstance(files, FileExchange) and files.folder.parent.name == ".kvwarm-sync"
    assert isinstance(
        make_exchange(provenance.RankLayout(1, 0, 1, 1, False), tmp_path, parallel, read_settings({})), SoloExchange
    )


@pytest.mark.parametrize(
    "env, message",
    [
        (
            {"DYN_BENCH_KV_WARMUP_RANK_SYNC": "nfs"},
            "DYN_BENCH_KV_WARMUP_RANK_SYNC='nfs' is not one of store, files (default store)",
        ),
        (
            {"DYN_BENCH_KV_WARMUP_RANK_SYNC_PORT": "http"},
            "DYN_BENCH_KV_WARMUP_RANK_SYNC_PORT='http' is not a TCP port number (1 to 65535)",
        ),
        (
            {"DYN_BENCH_KV_WARMUP_RANK_SYNC_PORT": "70000"},
            "DYN_BENCH_KV_WARMUP_RANK_SYNC_PORT='70000' is out of range: a TCP port is 1 to 65535",
        ),
        (
            {"DYN_BENCH_KV_WARMUP_RANK_TIMEOUT": "0"},
            "DYN_BENCH_KV_WARMUP_RANK_TIMEOUT='0' is out of range: it must be an integer >= 1 (default 300)",
        ),
        (
            {"DYN_BENCH_KV_WARMUP_RANK_START_TIMEOUT": "soon"},
            (
                "DYN_BENCH_KV_WARMUP_RANK_START_TIMEOUT='soon' is not an integer "
                "(default DYN_BENCH_KV_WARMUP_RANK_TIMEOUT's value)"
            ),
        ),
    ],
)
def test_the_rank_settings_refuse_what_they_do_not_know_naming_the_variable(env, message):
    with pytest.raises(SettingsError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read_settings(env)
    settings = read_settings(
        {
            "DYN_BENCH_KV_WARMUP_RANK_SYNC": " FILES ",
            "DYN_BENCH_KV_WARMUP_RANK_SYNC_PORT": "4242",
            "DYN_BENCH_KV_WARMUP_RANK_TIMEOUT": "20",
        }
    )
    assert (settings.rank_sync, settings.rank_sync_port, settings.rank_timeout) == ("files", 4242, 20)
    assert (read_settings({}).rank_sync, read_settings({}).rank_timeout) == ("store", 300)
    assert read_settings({"DYN_BENCH_KV_WARMUP_RANK_TIMEOUT": "20"}).start_timeout == 20  # the rank timeout's
    assert read_settings({"DYN_BENCH_KV_WARMUP_RANK_START_TIMEOUT": "900"}).start_timeout == 900


def test_the_command_refuses_data_parallel_over_ray_where_the_platform_names_no_ray_device(
    tmp_path, capsys, monkeypatch, engine_cli
):
    """vLLM's Ray launcher places each rank on the Ray resource its platform names; the CPU
    platform names none (vLLM stops with an assertion before any engine core exists)."""
    from vllm.kvwarm.sweep.command import run
    from vllm.platforms import current_platform

    monkeypatch.setenv("DYN_BENCH_KV_WARMUP", "off")
    assert not current_platform.ray_device_key  # what this host's vLLM says: no GPU here
    points = tmp_path / "points.json"
    points.write_text(json.dumps({"schema_version": 1, "decode": [{"total_kv_read_tokens": 64, "batch_size": 1}]}))
    out = tmp_path / "out"
    argv = ["--points", str(points), "--out", str(out), "--model", str(tmp_path / "model")]
    assert run([*argv, "--data-parallel-size", "2", "--data-parallel-backend", "ray"]) == 2
    said = capsys.readouterr().err
    assert "--data-parallel-backend ray: vLLM's" in said and "platform names no Ray device" in said
    artifact = json.loads((out / "sweep.json").read_text())
    assert artifact["status"] == "failed" and "use --data-parallel-backend mp" in artifact["error"]
