"""The ranks' store exchange on a real TCPStore (127.0.0.1): what it refuses (a forged or stray
record, a foreign store on its port, a rank with other sweep inputs, a value over its limit),
that nothing `schedule()` calls waits on the network (one that does not answer at all), that a
waiting rank sleeps only when its scheduler has nothing else to run, and the port it takes."""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta

import pytest
from kvwarm_testing.rank_sweeps import met, rank_runs, settled, store_client, until, view
from kvwarm_testing.real_kv import make_request, step_scheduler
from torch.distributed import TCPStore
from vllm.kvwarm.sweep import meetings as meetings_module
from vllm.kvwarm.sweep.exchange import store as store_module
from vllm.kvwarm.sweep.exchange.records import TORCH_LIMIT, VALUE_LIMIT
from vllm.kvwarm.sweep.exchange.store import StoreExchange, store_address
from vllm.kvwarm.sweep.meetings import Meetings
from vllm.kvwarm.sweep.ranks import RankFailed


def _pair(tmp_path, **rank_1):
    """Rank 0 (on a free port its store takes) and rank 1 of one launch, joined."""
    rank_0 = StoreExchange("127.0.0.1", 0, 2, 0, timeout=30.0, root=tmp_path / "out0")
    port = rank_0.port
    rank_1 = settled(StoreExchange("127.0.0.1", port, 2, 1, timeout=30.0, root=tmp_path / "out1", **rank_1))
    return port, rank_0, rank_1


def _stranger(port: int) -> TCPStore:
    """Another process's client of the launch's store: it can read and write any key."""
    return store_client(port)


def _until_raises(exchange, seconds: float = 30.0) -> RankFailed:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if exchange.poll() is not None:
                raise AssertionError("the boundary met")
        except RankFailed as err:
            return err
        time.sleep(0.01)
    raise AssertionError("no refusal")


def _json(record: dict):
    return lambda nonce: json.dumps({**record, "nonce": record.get("nonce", nonce)}).encode()


@pytest.mark.parametrize(
    "forge, says",
    [
        (lambda nonce: b"just text", "not JSON"),
        (lambda nonce: b"[1, 2]", "a JSON list, not an object"),
        (_json({"kind": "pool", "rank": 0, "usable_blocks": 9, "failed": None}), "it says rank 0, the key rank 1"),
        (
            _json({"kind": "pool", "rank": 1, "nonce": "0123", "usable_blocks": 9, "failed": None}),
            "it is not this launch's (nonce '0123'",
        ),
        (
            _json({"kind": "plan", "rank": 1, "digest": "d", "failed": None}),
            "its kind 'plan' is not this boundary's ('pool')",
        ),
    ],
)
def test_a_forged_meeting_record_is_refused_naming_its_key(tmp_path, forge, says):
    """A stranger on the port sets rank 1's record of the open boundary (with this launch's
    nonce, read from the launch record as anyone can, where it does not forge that too)."""
    port, rank_0, _ = _pair(tmp_path)
    rank_0.post("pool", {"usable_blocks": 10, "failed": None})
    _stranger(port).set("kvwarm/m/1/1", forge(rank_0.nonce))
    err = _until_raises(rank_0)
    assert str(err).startswith("refused the record at kvwarm/m/1/1: ") and says in str(err)


def test_a_record_of_this_launch_without_its_fields_is_refused_by_the_meeting(tmp_path):
    port, rank_0, _ = _pair(tmp_path)
    meeting = Meetings(rank_0)
    meeting.post("pool", {"usable_blocks": 10}, lambda records: pytest.fail("the meeting took a forged record"))
    forged = {"kind": "pool", "rank": 1, "nonce": rank_0.nonce, "usable_blocks": "lots", "failed": None}
    _stranger(port).set("kvwarm/m/1/1", json.dumps(forged).encode())
    deadline = time.monotonic() + 30
    with pytest.raises(RankFailed, match="refused rank 1's pool record: its 'usable_blocks' is 'lots', not a whole"):
        while time.monotonic() < deadline:
            meeting.poll()


def test_a_forged_summary_never_reaches_the_combined_view_and_is_named(tmp_path):
    from vllm.kvwarm.record.artifact import KvwarmMeta, build_artifact

    port, rank_0, rank_1 = _pair(tmp_path)
    own = build_artifact([], KvwarmMeta(), {}, "running")
    head = {k: x for k, x in own.items() if k not in ("results", "skipped_points")} | {"status": "complete"}
    forged = {"rank": 1, "nonce": "not-ours", "artifact": head, "chunks": 0, "results": 0, "skipped_points": 0}
    _stranger(port).set("kvwarm/summary/1", json.dumps(forged).encode())
    rank_0.view.update(own)
    deadline = time.monotonic() + 30
    while "kvwarm/summary/1" not in rank_0.view.refused:
        assert time.monotonic() < deadline, "the forged summary was not refused"
        rank_0.view.between_points()  # as rank 0's boundaries tell it: the view's turn
        time.sleep(0.05)
    assert "it is not this launch's (nonce 'not-ours'" in rank_0.view.refused["kvwarm/summary/1"]
    assert 1 not in rank_0.view.heads  # not in the view: rank 1 has sent nothing of its own
    rank_1.share(own)
    while 1 not in rank_0.view.heads:  # rank 1's own summary replaces it and is taken
        assert time.monotonic() < deadline, "rank 1's own summary never reached the view"
        rank_0.view.between_points()
        time.sleep(0.05)
    assert rank_0.view.heads[1]["status"] == "running"


def test_a_foreign_store_on_the_port_is_refused_by_name_by_every_rank(tmp_path, monkeypatch):
    monkeypatch.setattr(store_module, "LAUNCH_SECONDS", 1.0)
    foreign = TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    port = foreign.port  # the port it took
    foreign.set("their/key", b"theirs")
    rank_0 = StoreExchange("127.0.0.1", port, 2, 0, timeout=5.0, root=tmp_path / "out0", origin="set by test")
    with pytest.raises(
        RankFailed, match=rf"rank 0 could not host the rank exchange \(torch TCPStore\) at 127.0.0.1:{port}"
    ):
        rank_0.post("pool", {"usable_blocks": 1})
    rank_1 = StoreExchange("127.0.0.1", port, 2, 1, timeout=5.0, root=tmp_path / "out1", origin="set by test")
    rank_1.post("pool", {"usable_blocks": 1})
    err = _until_raises(rank_1)
    assert str(err).startswith(
        f"rank 1 reached a TCPStore at 127.0.0.1:{port} (port set by test) that holds no kvwarm launch record after "
        "1 s: it is not this launch's rank exchange (another job's store on that port?)"
    )
    assert "DYN_BENCH_KV_WARMUP_RANK_SYNC_PORT" in str(err)
    assert foreign.get("their/key") == b"theirs" and not foreign.check(["kvwarm/rank/1"])  # nothing of ours there


def test_a_rank_with_other_sweep_inputs_is_refused_when_it_joins_naming_them(tmp_path):
    rank_0 = StoreExchange("127.0.0.1", 0, 2, 0, root=tmp_path / "out0", plan={"steady_steps": 3, "grid": True})
    plan = {"steady_steps": 5, "grid": True}
    rank_1 = StoreExchange("127.0.0.1", rank_0.port, 2, 1, root=tmp_path / "out1", plan=plan)
    rank_1.post("pool", {"usable_blocks": 1})
    err = _until_raises(rank_1)
    assert "rank 1's sweep inputs differ from rank 0's" in str(err)
    assert "(steady_steps: rank 0 3, rank 1 5)" in str(err) and "give every rank the same points file" in str(err)


def test_a_value_over_the_limit_fails_the_rank_naming_both_limits(tmp_path):
    _, _, rank_1 = _pair(tmp_path)
    huge = {"point": {"batch_size": 1}, "steady_seconds": [0.001] * (VALUE_LIMIT // 5)}
    rank_1.share({"status": "running", "results": [huge], "skipped_points": []})
    rank_1.post("pool", {"usable_blocks": 1})
    err = _until_raises(rank_1)
    assert f"over the rank exchange's limit of {VALUE_LIMIT} bytes per value" in str(err)
    assert f"torch's TCPStore refuses a value over {TORCH_LIMIT} bytes" in str(err)
    assert VALUE_LIMIT <= 1 << 20 < TORCH_LIMIT  # the limit stays far from torch's


class UnansweringStore(TCPStore):
    """torch's TCPStore whose every operation (every rank's) waits while the network is held
    (`answering` clear): a network that does not answer at all. `waiting`: operations waiting now."""

    answering = threading.Event()
    waiting = 0
    lock = threading.Lock()

    @classmethod
    def wait_for_network(cls) -> None:
        with cls.lock:
            cls.waiting += 1
        cls.answering.wait()
        with cls.lock:
            cls.waiting -= 1

    def set(self, *args):
        self.wait_for_network()
        return super().set(*args)

    def get(self, *args):
        self.wait_for_network()
        return super().get(*args)

    def add(self, *args):
        self.wait_for_network()
        return super().add(*args)

    def check(self, *args):
        self.wait_for_network()
        return super().check(*args)

    def multi_get(self, *args):
        self.wait_for_network()
        return super().multi_get(*args)

    def delete_key(self, *args):
        self.wait_for_network()
        return super().delete_key(*args)


@pytest.fixture
def unanswering(monkeypatch):
    """The exchanges made in the test use UnansweringStore; the network answers again when it
    ends (the stores can then close)."""
    UnansweringStore.answering.set()
    monkeypatch.setattr(store_module, "TCPStore", UnansweringStore)
    yield UnansweringStore
    UnansweringStore.answering.set()


def test_nothing_schedule_calls_waits_on_the_network(tmp_path, unanswering):
    """While the store answers nothing at all (every operation held, a courier waiting on one),
    what a rank's schedule() calls (post, poll, share, post_failure) returns; once it answers
    again, the meeting completes."""
    _, rank_0, rank_1 = _pair(tmp_path)
    unanswering.answering.clear()
    artifact = {"status": "running", "results": [{"point": {"batch_size": 1}}], "skipped_points": []}
    polls = []

    def what_schedule_calls():
        rank_1.share(artifact)
        for exchange in (rank_0, rank_1):
            exchange.post("pool", {"usable_blocks": 3, "failed": None})
        polls.extend(exchange.poll() for _ in range(20) for exchange in (rank_0, rank_1))

    calls = threading.Thread(target=what_schedule_calls)
    calls.start()
    # a call that waited on the network would wait as long as it is held: for ever
    calls.join(timeout=60)
    assert not calls.is_alive(), "a call schedule() makes waited on the network"
    until(lambda: unanswering.waiting, "no courier waited on the network")  # it was held against real work
    assert polls == [None] * 40  # nothing met while the network is held
    unanswering.answering.set()
    met_0, met_1 = met(rank_0, 60), met(rank_1, 60)
    rank_1.post_failure("RuntimeError: done")
    assert [[r["usable_blocks"] for r in m] for m in (met_0, met_1)] == [[3, 3], [3, 3]]


def test_a_waiting_rank_sleeps_only_when_its_scheduler_has_nothing_else_to_run(tmp_path, monkeypatch):
    schedulers, _ = rank_runs(tmp_path, monkeypatch, [(300, 2)], start=[0])  # rank 1 never comes
    (scheduler,) = schedulers
    slept = []
    monkeypatch.setattr(meetings_module.time, "sleep", lambda s: slept.append(s))
    scheduler.add_request(make_request("user-1", 20))
    served = 0
    while "user-1" in scheduler.requests:
        step_scheduler(scheduler)  # the sweep waits at its first meeting; the user's request runs
        served += 1
    assert served > 1 and slept == []
    step_scheduler(scheduler)  # nothing else to run: now it lets the other ranks have the CPU
    assert slept == [meetings_module.IDLE_SLEEP]


def test_the_store_port_lies_outside_the_ports_vllm_takes_from_the_dp_master_port():
    """vLLM takes the DP master port and the nine after it (docs/hooks.md): an oracle of its
    own, not the offset the code uses."""
    from vllm.config import ParallelConfig

    parallel = ParallelConfig()
    for master in (parallel.data_parallel_master_port, 29500, 1024, 65526, 65530, 65535):
        parallel.data_parallel_master_port = master
        host, port, origin = store_address(parallel)
        assert host == parallel.data_parallel_master_ip and 1 <= port <= 65535
        assert port not in range(master, master + 10), (master, port)
        assert str(master) in origin
    assert store_address(parallel, 4242)[1:] == (4242, "set by DYN_BENCH_KV_WARMUP_RANK_SYNC_PORT")


def test_the_first_meeting_waits_as_long_as_the_rank_timeout_unless_a_start_timeout_is_set(tmp_path, monkeypatch):
    schedulers, out = rank_runs(tmp_path, monkeypatch, [(300, 2)], timeout=2, start=[0])
    started = time.monotonic()
    while schedulers[0].has_requests() and time.monotonic() - started < 60:
        step_scheduler(schedulers[0])
    waited = time.monotonic() - started
    own = json.loads((out / "dp0" / "sweep.json").read_text())
    assert own["error"] == "RankFailed: rank(s) [1] did not reach boundary 1 (pool) within 2 s" and waited < 30
    assert own["kvwarm"]["exchange"]["exchange"] == "store" and own["kvwarm"]["exchange"]["port"] > 0
    view(schedulers[0])
    monkeypatch.setenv("DYN_BENCH_KV_WARMUP_RANK_START_TIMEOUT", "600")
    (tmp_path / "again").mkdir()
    schedulers, _ = rank_runs(tmp_path / "again", monkeypatch, [(300, 2)], timeout=2, start=[0])
    exchange = schedulers[0].kvwarm_run.writer.exchange
    assert (exchange.timeout, exchange.start_timeout) == (2.0, 600.0)
    exchange.close()
