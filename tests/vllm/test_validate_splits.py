"""`validate`'s splits of a kind's steps: those after a pause of the engine, and those of a
token count their rank runs for the first time, each against the others; the prefill and
mixed figures with the table's level around each step taken out; and the warm-up it leaves
out (figures worked out by hand on the tables and traces of test_validate)."""

from __future__ import annotations

import csv
import json

import pytest
from kvwarm_testing.traces import step, write_table, write_trace
from test_validate import DECODE_ROWS, PREFILL_ROWS, mixed
from vllm.kvwarm.record.validate.command import run
from vllm.kvwarm.record.validate.output import steps_csv, text
from vllm.kvwarm.record.validate.validation import ValidateError, validate


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


def test_prefill_and_mixed_steps_are_also_judged_against_the_decode_steps_around_them(tmp_path):
    # the decode steps (2 x 200, predicted 12 ms) ran 1.2x their prediction but for two (1.0x,
    # 1.5x): their median ratio, 1.2, is the table's level around steps 6 and 7 (the mean would
    # be 1.214); the mixed step 6 (mixed rows: 11 ms) ran 13.2, the prefill step 7 (9.5) 11.4:
    # each -16.67 % raw and 0 with the level taken out; the composition (11.5) +4.545 % so.
    # Step 100 has no decode step within 50 of it: no level, out of the relative figures
    decodes = [14.4, 14.4, 14.4, 12.0, 18.0]
    steps = [step(0, None, (2, 200))] + [step(n + 1, ms, (2, 200)) for n, ms in enumerate(decodes)]
    steps += [step(6, 13.2, (2, 200), (1, 200, 500)), step(7, 11.4, prefill=(1, 200, 500))]
    steps += [step(8, 14.4, (2, 200)), step(9, 14.4, (2, 200)), step(100, 11.0, (2, 200), (1, 200, 500))]
    write_trace(tmp_path / "trace", steps)
    rows = DECODE_ROWS + PREFILL_ROWS + [mixed(100, 9.0), mixed(300, 11.0)]
    result = validate(str(write_table(tmp_path / "table", rows)), str(tmp_path / "trace"))
    assert [s.level for s in result.scored if s.step.kind != "decode"] == [pytest.approx(1.2), pytest.approx(1.2), None]
    summary = result.summary()
    assert summary["mixed_mape"] == pytest.approx(100 * 2.2 / 13.2 / 2)
    assert result.kinds()["mixed"]["relative"] == {"steps": 1, "mape": pytest.approx(0.0), "bias": pytest.approx(0.0)}
    assert (summary["prefill_mape"], summary["prefill_relative_mape"]) == (pytest.approx(100 * 1.9 / 11.4), 0.0)
    assert summary["mixed_composed_relative_mape"] == pytest.approx(100 * 0.6 / 13.2)
    assert summary["mixed_composed_relative_bias"] == pytest.approx(100 * 0.6 / 13.2)
    assert "decode" not in [k for k, f in result.kinds().items() if "relative" in f]
    assert (
        "mixed, against the decode steps around them (the table's level within 50 steps taken out): MAPE 0.00%, "
        "bias +0.00% over 1 step(s); composed: MAPE 4.55%, bias +4.55%"
    ) in text(result)
    levels = {row["step"]: row["level"] for row in csv.DictReader(steps_csv(result).splitlines())}
    assert (levels["1"], levels["6"], levels["7"], levels["100"]) == ("", "1.2000", "1.2000", "")


def test_a_servers_warm_up_is_left_out_but_its_sizes_count_as_run(tmp_path, capsys):
    # step n ends 0.01 (n + 1) s into the trace: --skip-seconds 0.025 leaves out steps 0 and 1
    # (100 new tokens each), so step 2 (100 again) is a size run before, at its row (6 ms)
    steps = [step(0, None, prefill=(1, 100, 0)), step(1, 9.0, prefill=(1, 100, 0)), step(2, 6.0, prefill=(1, 100, 0))]
    write_trace(tmp_path / "trace", steps)
    table = str(write_table(tmp_path / "table", PREFILL_ROWS))
    result = validate(table, str(tmp_path / "trace"), skip_seconds=0.025)
    assert [(s.step.number, s.size_runs) for s in result.scored] == [(2, 3)]
    assert result.excluded == {"warm-up": 2} and result.summary()["prefill_mape"] == pytest.approx(0.0)
    assert result.summary()["skip_seconds"] == 0.025
    assert "left out: 2 warm-up step(s) (ended within the trace's first 0.025 s: --skip-seconds)" in text(result)
    assert validate(table, str(tmp_path / "trace")).summary()["prefill_steps"] == 2
    with pytest.raises(ValidateError, match="--skip-seconds -1.0: give the seconds of the trace to leave out"):
        validate(table, str(tmp_path / "trace"), skip_seconds=-1.0)
    argv = [table, str(tmp_path / "trace"), "--out", str(tmp_path / "v"), "--json", "--skip-seconds", "0.025"]
    assert run(argv) == 0
    assert json.loads(capsys.readouterr().out)["excluded"] == 2
