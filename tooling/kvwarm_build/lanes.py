"""Commands run side by side, their output interleaved line by line, each line led by its
name; and `nox -s matrix` in lanes.

Most of the matrix is one core's work or the disk's (a stand-in image is mostly layers
copied by the vfs driver, a gate mostly one pytest process), so on two cores two lanes of
sessions take far less than one: `nox -s matrix -- --lanes N`. A lane takes whole kinds of
session (every release's images, every release's gates, ...), so a lane never runs two
images at once (each wants 12 GiB free while it builds) and the kinds that run a CPU engine
stay apart from each other only as far as the balance allows (each is its own process).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .errors import BuildError

_PRINTING = threading.Lock()

# Minutes a session of each kind took per release in two lanes on two cores
# (docs/measurements/matrix.md#the-matrix-in-two-lanes-on-an-amx-host; smoke and consumers from
# the matrix before): the weights lanes are balanced by.
KIND_MINUTES = {
    "image-standin": 6.0,
    "upstream-tests": 5.0,
    "engine": 5.5,
    "smoke-cpu": 5.0,
    "unit": 4.0,
    "consumers": 4.0,
    "bench": 5.0,
}
UNKNOWN_KIND_MINUTES = 3.0
# Every later session installs the wheels `builds` makes: these run first, alone.
FIRST = ("lint-patches", "builds")

Plan = list[tuple[str, "list[str] | None"]]


def run_prefixed(cmd: list[str], prefix: str) -> int:
    """cmd's exit status; its stdout and stderr printed as they come, each line led by
    `[prefix]`, never torn by another command's line."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            with _PRINTING:
                sys.stdout.write(f"[{prefix}] {line.rstrip()}\n")
                sys.stdout.flush()
    return proc.returncode


def say(line: str) -> None:
    with _PRINTING:
        print(line, flush=True)


def kind_of(session: str) -> str:
    """`image-standin-9.9` -> `image-standin`: the name without its release."""
    head, _, tail = session.rpartition("-")
    return head if head and tail[:1].isdigit() else session


def lanes_arguments(posargs: list[str]) -> int:
    """`matrix`'s arguments: `--lanes N` (default 2)."""
    if not posargs:
        return 2
    if len(posargs) == 2 and posargs[0] == "--lanes" and posargs[1].isdigit() and int(posargs[1]) >= 1:
        return int(posargs[1])
    raise BuildError(
        f"matrix arguments {posargs} are not understood",
        "pass nothing (two lanes) or `--lanes N` with N 1 or more (1 runs every session in turn)",
    )


def split(plan: Plan, lanes: int) -> tuple[Plan, list[Plan]]:
    """(the sessions that run first, alone; the lanes): whole kinds dealt out longest first,
    each to the lane with the least estimated work so far; a lane keeps the plan's order."""
    first = [item for item in plan if item[0] in FIRST]
    by_kind: dict[str, Plan] = {}
    for item in plan:
        if item[0] not in FIRST:
            by_kind.setdefault(kind_of(item[0]), []).append(item)

    def minutes(kind: str) -> float:
        return KIND_MINUTES.get(kind, UNKNOWN_KIND_MINUTES) * len(by_kind[kind])

    loads, dealt = [0.0] * lanes, [set() for _ in range(lanes)]
    for kind in sorted(by_kind, key=minutes, reverse=True):
        lane = loads.index(min(loads))
        loads[lane] += minutes(kind)
        dealt[lane].add(kind)
    order = [item for item in plan if item[0] not in FIRST]
    return first, [[item for item in order if kind_of(item[0]) in kinds] for kinds in dealt if kinds]


def nox_command(noxfile: Path, envdir: Path, name: str, posargs: list[str] | None) -> list[str]:
    """The command that runs session `name` of `noxfile` in a nox of its own (this
    interpreter's), its venvs under `envdir`, with posargs when there are any."""
    nox = [sys.executable, "-m", "nox", "-f", str(noxfile), "--envdir", str(envdir), "-s", name]
    return [*nox, *(["--", *posargs] if posargs else [])]


def run_plan(plan: Plan, lanes: int, command, finished=lambda name, code: None) -> list[str]:
    """Run `plan` (FIRST alone, then the lanes side by side), each session its own process
    command(name, posargs), then finished(name, exit status); a failed session does not stop
    its lane, a failed FIRST stops everything. Returns the failed sessions' names; prints each
    session's end and a summary."""
    first, dealt = split(plan, lanes)
    for number, lane in enumerate(dealt, 1):
        say(f"matrix lane {number}: {', '.join(name for name, _ in lane)}")
    done: list[tuple[str, int, float]] = []

    def run_lane(lane: Plan) -> None:
        for name, posargs in lane:
            started = time.monotonic()
            code = run_prefixed(command(name, posargs), name)
            done.append((name, code, time.monotonic() - started))
            say(f"matrix: {name} {'green' if code == 0 else f'FAILED (exit {code})'} in {done[-1][2]:.0f} s")
            finished(name, code)

    run_lane(first)
    if all(code == 0 for _, code, _ in done):
        with ThreadPoolExecutor(max(1, len(dealt))) as pool:
            list(pool.map(run_lane, dealt))
    else:
        say("matrix: a first session failed; the lanes did not start")
    for name, code, seconds in done:
        say(f"  {name:<24} {'green' if code == 0 else 'FAILED':<7} {seconds:6.0f} s")
    return [name for name, code, _ in done if code != 0]
