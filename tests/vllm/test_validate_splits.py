"""`validate`'s splits of a kind's steps: those after a pause of the engine, and those of a
token count their rank runs for the first time, each against the others (figures worked
out by hand on the tables and traces of test_validate)."""

from __future__ import annotations

import pytest
from kvwarm_testing.traces import step, write_table, write_trace
from test_validate import DECODE_ROWS, PREFILL_ROWS
from vllm.kvwarm.record.validate import validate
from vllm.kvwarm.record.validate_output import text


def test_steps_after_a_pause_of_the_engine_are_reported_apart_from_the_others(tmp_path):
    # the rank's first step (no window: the engine had not been stepping) and a step after
    # 18 ms idle (wall 30, span 12) are pauses; AFTER_PAUSE_STEPS (10) steps from each count
    steps = [step(0, None, (2, 200))]
    steps += [step(n, 15.0 if n < 10 else 12.0, (2, 200), span_ms=11.9) for n in range(1, 12)]
    steps += [step(12, 30.0, (2, 200), span_ms=12.0), step(13, 12.0, (2, 200), span_ms=11.9)]
    write_trace(tmp_path / "trace", steps)
    table = write_table(tmp_path / "table", DECODE_ROWS)
    result = validate(str(table), str(tmp_path / "trace"))
    pauses = result.kinds()["decode"]["pauses"]
    # predicted 12 ms each: steps 1-9 at 15 ms (-20 %), step 12 at 30 (-60 %), step 13 at 12;
    # steps 10 and 11, ten and eleven steps after the first pause, at 12
    assert pauses["share"] == pytest.approx(100 * 11 / 13)
    assert pauses["after_pause"]["mape"] == pytest.approx((9 * 20 + 60) / 11)
    assert pauses["after_pause"]["bias"] == pytest.approx(-(9 * 20 + 60) / 11)
    assert (pauses["others"]["steps"], pauses["others"]["mape"]) == (2, pytest.approx(0.0))
    summary = result.summary()
    assert summary["decode_after_pause_share"] == pauses["share"] and summary["decode_steady_mape"] == 0.0
    assert "11 step(s) (84.62%) within 10 steps of a pause of the engine" in text(result)


def test_steps_of_a_token_count_run_for_the_first_time_are_reported_apart(tmp_path):
    # 100 new tokens run first in the untimed step 0 (it counts, though not scored), so step 1
    # repeats it; 300 runs first in step 2, 20 % slower than its row (10 ms: 9 + 1 of
    # schedule), and again in step 3 as the row
    steps = [step(0, None, prefill=(1, 100, 0)), step(1, 6.0, prefill=(1, 100, 0))]
    steps += [step(2, 12.5, prefill=(1, 300, 0)), step(3, 10.0, prefill=(1, 300, 0))]
    write_trace(tmp_path / "trace", steps)
    result = validate(str(write_table(tmp_path / "table", PREFILL_ROWS)), str(tmp_path / "trace"))
    assert [s.size_runs for s in result.scored] == [2, 1, 2]
    sizes = result.kinds()["prefill"]["sizes"]
    assert sizes["share"] == pytest.approx(100 / 3)
    assert (sizes["first_size"]["mape"], sizes["first_size"]["bias"]) == (pytest.approx(20.0), pytest.approx(-20.0))
    assert (sizes["seen_size"]["steps"], sizes["seen_size"]["mape"]) == (2, pytest.approx(0.0))
    summary = result.summary()
    assert summary["prefill_first_size_share"] == sizes["share"] and summary["prefill_seen_size_mape"] == 0.0
    assert summary["mixed_first_size_share"] is None
    assert "1 step(s) (33.33%) ran their token count for the first time on their rank: MAPE 20.00%" in text(result)
