"""The served-step trace on the real Scheduler and AsyncScheduler, stepped in vLLM's engine
orders (kvwarm_testing.real_kv.EngineLoop: one step at a time, and the batch queue) with the
model runner's part played by the test on a clock only it moves.

Each step's composition is checked against what the test reads off the scheduler's own
requests right after the schedule() that made it (not off the SchedulerOutput the recorder
reads); its times against the clock the test moved; the idle rule, the sweep's steps left
out, the setting's errors, rotation and a failed write, and no hook work with the trace off.
"""

from __future__ import annotations

import json
import logging
import statistics

import pytest
from kvwarm_testing.real_kv import EngineLoop, make_scheduler
from kvwarm_testing.recorded import (
    MIXED_ARRIVALS,
    add,
    current_files,
    forward_seconds,
    read,
    rotated_trace,
    run,
    serve,
    traced_scheduler,
)
from vllm.kvwarm.record.trace.reader import read_trace
from vllm.kvwarm.record.validate.match import Provenance
from vllm.kvwarm.record.vocabulary import trace_file_name
from vllm.kvwarm.scheduler import KvWarmAsyncScheduler, KvWarmScheduler
from vllm.kvwarm.served.settings import TraceSettingsError, trace_settings
from vllm.kvwarm.served.sink import prepare
from vllm.kvwarm.sweep.provenance import loop_record

LOOPS = [(KvWarmScheduler, False), (KvWarmAsyncScheduler, True)]
LOOP_IDS = ["sync", "batch-queue"]


def _pvar(values: list[int]) -> float:
    return statistics.pvariance(values) if values else 0.0


class Observed:
    """The composition of every step, read off the scheduler's requests right after the
    schedule() that made it (vLLM has then advanced each request's computed count by what
    it scheduled)."""

    def __init__(self, scheduler, own: set[str] = frozenset()):
        self.by_output: dict[int, dict] = {}
        self.order: list = []
        started: set[str] = set()  # requests scheduled before: a chunk of theirs is a later one
        schedule = scheduler.schedule

        def observed_schedule(*args, **kwargs):
            output = schedule(*args, **kwargs)
            decode, chunks, completing = [], [], 0
            for rid, n in output.num_scheduled_tokens.items():
                request = scheduler.requests[rid]
                before = request.num_computed_tokens - n
                if before >= request.num_prompt_tokens and n == 1:
                    decode.append(before)
                else:
                    chunks.append((n, before, request.num_prompt_tokens, rid in started))
                    completing += before + n >= request.num_prompt_tokens
            started.update(output.num_scheduled_tokens)
            self.by_output[id(output)] = {
                "decode": decode,
                "chunks": chunks,
                "outputs": len(decode) + completing,
                "own": bool(own & set(output.num_scheduled_tokens)),
            }
            self.order.append(output)
            return output

        scheduler.schedule = observed_schedule


@pytest.mark.parametrize("cls, batch_queue", LOOPS, ids=LOOP_IDS)
def test_every_served_step_is_one_line_with_its_composition_and_its_window(tmp_path, cls, batch_queue):
    """MIXED_ARRIVALS: prompts longer than the step's token budget (256) chunk, so decode,
    prefill and mixed steps all occur; two prompts share their first blocks (a prefix hit)."""
    scheduler, clock, out = traced_scheduler(tmp_path, cls)
    seen = Observed(scheduler)
    order = engine_order(scheduler)
    serve(scheduler, EngineLoop(scheduler, batch_queue, clock, forward_seconds), MIXED_ARRIVALS)
    header, steps = read(out)
    assert header["type"] == "kvwarm_trace" and header["schema_version"] == 3
    assert header["engine_loop"] == loop_record(scheduler)  # the sweep artifact's record, same code
    assert header["engine_loop"]["loop"] == ("batch_queue" if batch_queue else "sync")
    assert header["model"] == scheduler.vllm_config.model_config.model
    # validate's reader takes the recorder's files as they are: every step, the loop named
    read_back = read_trace(out)
    assert len(read_back.steps) == len(steps)
    assert Provenance.of_trace(read_back.header).loop == header["engine_loop"]["loop"]
    traced = [o for o in seen.order if o.total_num_scheduled_tokens]
    assert [s.number for s in steps] == list(range(len(traced))) and len(traced) > 10
    kinds = set()
    for line, output in zip(steps, traced):  # the recorder's raw numbers, composed by the reader
        want = seen.by_output[id(output)]
        news = [n for n, *_ in want["chunks"]]
        assert (line.decode_requests, line.decode_kv_tokens) == (len(want["decode"]), sum(want["decode"]))
        assert line.decode_kv_var == pytest.approx(_pvar(want["decode"]))
        assert (line.prefill_requests, line.prefill_new_tokens, line.prefill_prefix_tokens) == (
            len(news),
            sum(news),
            sum(before for _, before, *_ in want["chunks"]),
        )
        assert line.prefill_new_var == pytest.approx(_pvar(news))
        assert line.prefill_prompt_var == pytest.approx(_pvar([p for _, _, p, _ in want["chunks"]]))
        assert line.continuations == sum(later and 0 < before < p for _, before, p, later in want["chunks"])
        assert line.outputs == want["outputs"] and line.spec_tokens == 0 and line.preempted == 0
        kinds.add((bool(want["decode"]), bool(want["chunks"])))
    assert kinds == {(True, False), (False, True), (True, True)}  # decode, prefill and mixed steps
    assert any(line.continuations for line in steps)
    # a prefix hit (prefix tokens on a first chunk) is held to the scheduler's own line by line
    # above; whether the arrivals make one depends on when a release caches a prompt's blocks
    # the windows: the ones the adapter's timer closed (the sweep's basis), in order
    windows = [s for s in steps if s.wall is not None]
    assert len(windows) == len(steps) - 1 and steps[0].wall is None  # no window before the first
    for line in windows:
        assert sum(line.phases.values()) == pytest.approx(line.wall)
        assert line.at - steps[line.number - 1].at == pytest.approx(line.wall, abs=2e-6)
    if not batch_queue:  # one step at a time: the window is the step's own forward
        for line, output in zip(steps, traced):
            if line.wall is not None:
                assert line.wall == pytest.approx(forward_seconds(output))
                assert line.phases["forward"] == pytest.approx(forward_seconds(output))
    else:  # the batch queue: each step's window and span from the loop's order (engine_order)
        expected = expected_times(order)
        for line, output in zip(steps, traced):
            wall, span = expected[id(output)]
            assert line.span == pytest.approx(span) and (line.wall is None or line.wall == pytest.approx(wall))
        assert sum(line.span > line.wall for line in windows) > len(windows) / 2  # the next schedule() overlaps


def engine_order(scheduler) -> list[tuple[str, object]]:
    """The engine loop's calls as they happen: ("schedule", output) and ("update", output)."""
    order, schedule, update = [], scheduler.schedule, scheduler.update_from_output

    def scheduled(*args, **kwargs):
        output = schedule(*args, **kwargs)
        order.append(("schedule", output))
        return output

    def updated(output, runner_output):
        result = update(output, runner_output)
        order.append(("update", output))
        return result

    scheduler.schedule, scheduler.update_from_output = scheduled, updated
    return order


def expected_times(order) -> dict:
    """Per output (by id), (its window, its span) in the played runner's seconds: EngineLoop advances
    the clock by forward_seconds(output) when it submits an output, right after its
    schedule(); a window runs from one update's end to the next, a span from the output's own
    schedule() to its update's end."""
    times, since_update, since_scheduled = {}, 0.0, {}
    for call, output in order:
        if call == "schedule":
            since_update += forward_seconds(output)
            for key in since_scheduled:
                since_scheduled[key] += forward_seconds(output)
            since_scheduled[id(output)] = forward_seconds(output)
        else:
            times[id(output)] = (since_update, since_scheduled.pop(id(output)))
            since_update = 0.0
    return times


class Moments:
    """The played clock's reading at each schedule()'s entry and each update_from_output()'s
    end, read by the test around the adapter's own calls."""

    def __init__(self, scheduler, clock):
        self.entered: dict[int, float] = {}
        self.ended: dict[int, float] = {}
        self.last_end_before: dict[int, float | None] = {}
        schedule, update = scheduler.schedule, scheduler.update_from_output
        last_end = [None]

        def observed_schedule(*args, **kwargs):
            entered, before = clock(), last_end[0]
            output = schedule(*args, **kwargs)
            self.entered[id(output)], self.last_end_before[id(output)] = entered, before
            return output

        def observed_update(output, runner_output):
            outputs = update(output, runner_output)
            self.ended[id(output)] = last_end[0] = clock()
            return outputs

        scheduler.schedule, scheduler.update_from_output = observed_schedule, observed_update


@pytest.mark.parametrize("cls, batch_queue", LOOPS, ids=LOOP_IDS)
def test_at_and_gap_read_the_adapters_one_clock(tmp_path, cls, batch_queue):
    """`at`: the step's update end, from the clock's reading when the trace started (0 here);
    `gap`: the last update end before its schedule() to that schedule()'s entry, the idle wait
    included (null where no update ended before it)."""
    scheduler, clock, out = traced_scheduler(tmp_path, cls)
    moments = Moments(scheduler, clock)
    loop = EngineLoop(scheduler, batch_queue, clock, forward_seconds)
    add(scheduler, "first", 50, max_tokens=4, token=3)
    run(loop)
    clock.advance(5.0)  # the engine waits for work
    add(scheduler, "later", 300, max_tokens=4, token=5)
    run(loop)
    scheduler.kvwarm_trace.close()
    _, steps = read(out)
    traced = [o for o in loop.outputs if o.total_num_scheduled_tokens]
    assert len(steps) == len(traced) > 6
    gaps = []
    for line, output in zip(steps, traced):
        assert line.at == moments.ended[id(output)]
        before = moments.last_end_before[id(output)]
        assert line.gap == (None if before is None else pytest.approx(moments.entered[id(output)] - before, abs=1e-9))
        gaps.append(line.gap)
    waited = next(i for i, s in enumerate(steps) if s.prefill_requests and i > 0)
    assert gaps[waited] == pytest.approx(5.0) and steps[waited].wall is None
    # under the batch queue the next step was scheduled before any update ended after the wait
    paused = [i for i, g in enumerate(gaps) if g is not None and g >= 5.0]
    assert paused == ([waited, waited + 1] if batch_queue else [waited])
    assert gaps[: 2 if batch_queue else 1] == [None] * (2 if batch_queue else 1)


@pytest.mark.parametrize("cls, batch_queue", LOOPS, ids=LOOP_IDS)
def test_a_step_after_an_idle_wait_has_no_wall(tmp_path, cls, batch_queue):
    scheduler, clock, out = traced_scheduler(tmp_path, cls)
    loop = EngineLoop(scheduler, batch_queue, clock, forward_seconds)
    add(scheduler, "first", 50, max_tokens=4, token=3)
    run(loop)
    clock.advance(5.0)  # the engine waits for work
    add(scheduler, "later", 50, max_tokens=4, token=5)
    run(loop)
    scheduler.kvwarm_trace.close()
    _, steps = read(out)
    first_of_later = next(i for i, s in enumerate(steps) if s.prefill_requests and i > 0)
    assert steps[first_of_later].wall is None and steps[first_of_later].at - steps[first_of_later - 1].at > 5
    walls = [s.wall for i, s in enumerate(steps) if i not in (0, first_of_later)]
    assert walls and all(w is not None and w < 1 for w in walls)


class PointEnds:
    """Which update_from_output calls finished a sweep's point (its rows grew), in the order
    the updates ran."""

    def __init__(self, scheduler):
        self.order: list[tuple[object, bool]] = []
        update = scheduler.update_from_output

        def observed_update(output, runner_output):
            rows = len(scheduler.kvwarm_sweep.rows)
            outputs = update(output, runner_output)
            self.order.append((output, len(scheduler.kvwarm_sweep.rows) > rows))
            return outputs

        scheduler.update_from_output = observed_update

    def after_a_point(self) -> set[int]:
        """The outputs whose update closed a window holding a point's end (the update after one
        that finished a point)."""
        return {id(output) for (output, _), (_, ended) in zip(self.order[1:], self.order) if ended}


@pytest.mark.parametrize("cls, batch_queue", LOOPS, ids=LOOP_IDS)
def test_the_sweeps_own_steps_are_left_out_and_the_served_ones_between_points_are_traced(
    tmp_path, monkeypatch, cls, batch_queue
):
    """A sweep (fake KV: no dataset needed) and the trace in one engine; requests from outside
    arrive all through it and are served between points. The first served step after a point
    carries the point's end (its collection, its artifact write) in its window: traced with
    no wall, the reason named."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    init_none_hash(sha256)
    monkeypatch.setenv("DYN_BENCH_KV_WARMUP", "off")
    points = tmp_path / "points.json"
    decode = [{"total_kv_read_tokens": k, "batch_size": 2} for k in (64, 128, 192)]
    points.write_text(json.dumps({"schema_version": 1, "decode": decode}))
    out = tmp_path / "trace"
    spec = {"kvwarm_sweep": {"points": str(points), "out": str(tmp_path / "sweep")}, "kvwarm_trace": {"out": str(out)}}
    scheduler = make_scheduler(tmp_path, num_blocks=1024, scheduler_cls=cls, additional_config=spec)
    users = {f"u{i}" for i in range(40)}
    seen, ends = Observed(scheduler), PointEnds(scheduler)
    loop = EngineLoop(scheduler, batch_queue)
    for i in range(600):
        if i % 3 == 0 and i < 120:
            add(scheduler, f"u{i // 3}", 30 + i % 40, max_tokens=3, token=20 + i % 50)
        if not loop.busy():
            break
        loop.step()
    scheduler.kvwarm_trace.close()
    assert json.loads((tmp_path / "sweep" / "sweep.json").read_text())["status"] == "complete"
    _, steps = read(out)
    served = [o for o in seen.order if o.total_num_scheduled_tokens and set(o.num_scheduled_tokens) <= users]
    swept = [o for o in seen.order if set(o.num_scheduled_tokens) - users]
    assert swept and len(steps) == len(served) > 0  # every step of users' requests alone, none of the sweep's
    after_a_point = ends.after_a_point()
    for line, output in zip(steps, served):
        assert line.decode_requests + line.prefill_requests == len(output.num_scheduled_tokens)
        if id(output) in after_a_point:
            assert line.untimed == "sweep_between_points" and line.wall is None
        if line.untimed is not None:
            assert line.untimed == "sweep_between_points" and line.wall is None
    # one step at a time, the step after a point's last is the users' (under the batch queue it
    # was scheduled with the point, so the sweep's own: not traced)
    assert batch_queue or sum(id(output) in after_a_point for output in served) == len(decode)
    assert sum(line.untimed is not None for line in steps) < len(steps) / 4  # the others keep their walls


def test_the_trace_off_keeps_no_timer_and_records_nothing(tmp_path):
    scheduler = make_scheduler(tmp_path, scheduler_cls=KvWarmScheduler)
    assert scheduler.kvwarm_trace is None and scheduler.kvwarm_timer is None
    loop = EngineLoop(scheduler, False)
    add(scheduler, "a", 40, max_tokens=3, token=3)
    run(loop)
    assert not list(tmp_path.glob("**/trace-dp*.jsonl"))


def test_the_header_records_the_run_as_the_sweeps_artifact_does(tmp_path):
    from vllm.kvwarm.sweep.provenance import run_record

    scheduler, _, out = traced_scheduler(tmp_path, KvWarmScheduler)
    scheduler.kvwarm_trace.close()
    header, steps = read(out)
    record = run_record(scheduler)
    assert steps == []
    assert header["engine"] == record["engine_args"] and header["hardware"] == record["hardware"]
    assert header["build"] == record["build"] and header["torch"] == record["torch"]
    assert header["layout"]["data_parallel_size"] == 1 and header["rank"] == 0 and header["dp_size"] == 1
    assert header["model"] == scheduler.vllm_config.model_config.model
    assert header["timing"] == {"basis": "update_to_update", "clock": "perf_counter"}
    assert header["started_at"].endswith("Z")


def test_files_rotate_at_the_cap_each_with_the_header_and_the_oldest_removed(tmp_path):
    out = rotated_trace(tmp_path, files=3, requests=12, max_tokens=12)
    [current] = current_files(out)
    launch = current.name.removeprefix("trace-dp0-").removesuffix(".jsonl")
    names = [f"trace-dp0-{launch}.2.jsonl", f"trace-dp0-{launch}.1.jsonl", current.name]  # oldest first
    assert sorted(p.name for p in out.iterdir()) == sorted(names)
    numbers = []
    for name in names:
        lines = (out / name).read_text().splitlines()
        assert json.loads(lines[0])["type"] == "kvwarm_trace"
        assert (out / name).stat().st_size <= 4096 or len(lines) == 2
        numbers += [json.loads(x)["step"] for x in lines[1:]]
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers))) and numbers[0] > 0  # the oldest went


def test_a_failed_write_stops_the_trace_and_the_engine_serves_on(tmp_path, caplog):
    scheduler, clock, out = traced_scheduler(tmp_path, KvWarmScheduler, max_file_mb=4096 / (1 << 20), files=2)
    (out / trace_file_name(0, scheduler.kvwarm_trace.launch, 1)).mkdir()  # rotation cannot replace a folder
    loop = EngineLoop(scheduler, False, clock, forward_seconds)
    for i in range(12):
        add(scheduler, f"r{i}", 20, max_tokens=12, token=30 + i)
    with caplog.at_level(logging.ERROR):
        run(loop)
        scheduler.kvwarm_trace.close()
    assert not scheduler.requests  # every request served
    assert "the trace stops here, the engine serves on" in caplog.text


def test_a_launch_touches_no_other_file_in_its_folder(tmp_path):
    """An earlier run's files, another engine's, anything else: left as they are; a launch's
    own name that exists already is refused rather than overwritten."""
    out = tmp_path / "trace"
    out.mkdir()
    others = ("trace-dp0.jsonl", "trace-dp0.3.jsonl", "trace-dp1.jsonl", "notes.txt")
    others += (trace_file_name(0, "20260101T000000000000-p1"), trace_file_name(0, "20260101T000000000000-p1", 1))
    for name in others:
        (out / name).write_text("old\n")
    scheduler, _, _ = traced_scheduler(tmp_path, KvWarmScheduler)
    scheduler.kvwarm_trace.close()
    mine = scheduler.kvwarm_trace.path
    assert sorted(p.name for p in out.iterdir()) == sorted([*others, mine.name])
    assert all((out / name).read_text() == "old\n" for name in others)
    with pytest.raises(OSError, match="cannot be written"):
        prepare(out, '{"type":"kvwarm_trace"}\n', mine.name)
    assert json.loads(mine.read_text().splitlines()[0])["type"] == "kvwarm_trace"


@pytest.mark.parametrize(
    "config, environ, named",
    [
        ({"kvwarm_trace": "/tmp/x"}, {}, 'additional_config["kvwarm_trace"] must be {"out": DIR}'),
        ({"kvwarm_trace": {"out": "/tmp/x", "size": 3}}, {}, "unknown key(s) size"),
        ({"kvwarm_trace": {"out": "/tmp/x", "files": 0}}, {}, 'additional_config["kvwarm_trace"].files=0'),
        ({"kvwarm_trace": {"out": "/tmp/x", "max_file_mb": "big"}}, {}, "max_file_mb='big' is not a number"),
        ({}, {"DYN_BENCH_TRACE_DIR": "/tmp/x", "DYN_BENCH_TRACE_FILES": "-1"}, "DYN_BENCH_TRACE_FILES=-1"),
    ],
)
def test_a_bad_setting_is_refused_naming_it_and_the_fix(config, environ, named):
    with pytest.raises(TraceSettingsError) as refused:
        trace_settings(config, environ)
    assert named in str(refused.value)


def test_the_setting_from_the_environment_and_additional_config_first(tmp_path):
    environ = {"DYN_BENCH_TRACE_DIR": str(tmp_path / "env"), "DYN_BENCH_TRACE_MAX_FILE_MB": "2"}
    from_env = trace_settings({}, environ)
    assert from_env.out == tmp_path / "env" and from_env.max_file_bytes == 2 << 20 and from_env.files == 8
    given = trace_settings({"kvwarm_trace": {"out": str(tmp_path / "cfg")}}, environ)
    assert given.out == tmp_path / "cfg" and given.max_file_bytes == 64 << 20
    assert trace_settings({}, {}) is None


def test_a_trace_folder_that_cannot_be_made_stops_the_engine_start_naming_it(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(OSError) as refused:
        make_scheduler(
            tmp_path, scheduler_cls=KvWarmScheduler, additional_config={"kvwarm_trace": {"out": str(blocker)}}
        )
    assert str(blocker) in str(refused.value) and "kvwarm_trace" in str(refused.value)
