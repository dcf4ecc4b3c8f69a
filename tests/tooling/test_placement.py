"""smoke/placement.py on a real process tree titled as vLLM titles its processes: a frontend,
its engine core, the engine core's model worker (the CPU engine's executor) and the trace's
writer. On a host of fewer than 4 cores the worker must get a core no other process of the
tree may run on: an engine core sharing it takes each output late under vLLM's batch queue
(docs/measurements/served-vs-table.md, "The batch queue on two cores")."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "smoke"))
import placement  # a script of smoke/, importable from there

# root (the frontend) -> the engine core -> its model worker; the root's trace writer beside
# them. No command line but the worker's holds vLLM's worker title ($w spells it at run time).
TREE = """
(exec -a 'python served/sink.py' sleep 60) &
(exec -a VLLM::EngineCore bash -c 'w=Worker_TP0; (exec -a "VLLM::$w" sleep 60) & wait') &
wait
"""
TITLES = {b"VLLM::EngineCore": "engine core", b"VLLM::Worker_TP0": "worker", b"python served/sink.py": "writer"}


def _titled(session: int) -> dict[str, int]:
    """{engine core | worker | writer: pid} of the session's processes that exec'd their title."""
    found = {}
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and os.getsid(int(entry.name)) == session:
                title = (entry / "cmdline").read_bytes().split(b"\0")[0]
                if title in TITLES:
                    found[TITLES[title]] = int(entry.name)
        except OSError:  # gone meanwhile
            continue
    return found


@pytest.fixture
def tree():
    """(the root's pid, {engine core | worker | writer: pid}) of the live tree."""
    root = subprocess.Popen(["bash", "-c", TREE], start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while len(titled := _titled(root.pid)) < len(TITLES) and time.monotonic() < deadline:
            time.sleep(0.05)  # the forks exec their titles
        yield root.pid, titled
    finally:
        os.killpg(root.pid, 9)
        root.wait()


@pytest.fixture
def two_cores():
    """This process on two of its cores while a test runs (cores() reads its own mask)."""
    mine = sorted(os.sched_getaffinity(0))
    if len(mine) < 2:
        pytest.skip("needs 2 cores to give the worker one of its own")
    os.sched_setaffinity(0, set(mine[:2]))
    try:
        yield mine[:2]
    finally:
        os.sched_setaffinity(0, set(mine))


def test_on_two_cores_the_model_worker_has_its_core_alone(tree, two_cores):
    root, titled = tree
    assert len(titled) == len(TITLES), titled
    where = placement.cores()
    placement.pin_tree(root, where)
    worker = os.sched_getaffinity(titled["worker"])
    others = {"root": os.sched_getaffinity(root)} | {
        name: os.sched_getaffinity(pid) for name, pid in titled.items() if name != "worker"
    }
    assert worker == {two_cores[1]}, worker
    assert all(not worker & cpus for cpus in others.values()), (worker, others)
    assert placement.roles(root)[titled["worker"]] == "worker"
    assert f"model worker {two_cores[1]} alone" in placement.words(where)


def test_on_four_cores_or_more_the_worker_stays_with_its_engine_core(monkeypatch):
    monkeypatch.setattr(placement.os, "sched_getaffinity", lambda _pid: set(range(8)))
    where = placement.cores()
    assert where["worker"] == where["engine"] == {0, 1, 2, 3}
    assert not where["engine"] & (where["frontend"] | where["client"])
    assert "model worker" not in placement.words(where)
