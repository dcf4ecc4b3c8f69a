"""Bad input refused with a clear error naming the input and the fix, not a traceback (review
finding 17): a trace header without its started_at (which `export --to fpm` reads for every
line's clock), a table's mixed row a hand edit or an older sweep left without its parts, and
a trace setting of a fractional file count."""

from __future__ import annotations

import json

import pytest
from kvwarm_testing.traces import header, step, write_table, write_trace
from test_validate import DECODE_ROWS
from vllm.kvwarm.record.export.command import run as export
from vllm.kvwarm.record.runs import ReportError
from vllm.kvwarm.record.trace.reader import TraceError, read_trace
from vllm.kvwarm.record.validate.predict import read_mixed_rows
from vllm.kvwarm.record.validate.validation import ValidateError, validate
from vllm.kvwarm.served.settings import TraceSettingsError, trace_settings


@pytest.mark.parametrize("started_at", [None, "yesterday"], ids=["missing", "not-a-time"])
def test_a_header_without_a_readable_started_at_is_refused_naming_it(tmp_path, capsys, started_at):
    head = header()
    if started_at is None:
        del head["started_at"]
    else:
        head["started_at"] = started_at
    write_trace(tmp_path / "trace", [step(0, None, (2, 200)), step(1, 12.0, (2, 200))], head=head)
    with pytest.raises(
        TraceError, match=r"line 1: started_at .* is not a UTC time like .*restore the header the recorder wrote"
    ):
        read_trace(tmp_path / "trace")
    assert export([str(tmp_path / "trace"), "--to", "fpm"]) == 2
    assert "started_at" in capsys.readouterr().err and not (tmp_path / "trace" / "fpm.jsonl").exists()


def mixed_result(**point_changes) -> dict:
    point = {
        "point_type": "mixed",
        "total_kv_read_tokens": 700,
        "batch_size": 3,
        "total_prefill_tokens": 200,
        "decode": {"batch_size": 2, "total_kv_read_tokens": 200},
        "prefill": {"batch_size": 1, "total_prefill_tokens": 200, "total_kv_read_tokens": 500},
        **point_changes,
    }
    return {"point": point, "kv_seed_regime": "real_kv", "steady_seconds": [0.01], "median_seconds": 0.01}


@pytest.mark.parametrize(
    "changes",
    [{"decode": {"total_kv_read_tokens": 200}}, {"prefill": None}, {"decode": {"batch_size": "2"}}],
    ids=["no-decode-batch", "no-prefill-part", "batch-as-text"],
)
def test_a_mixed_row_without_its_parts_is_refused_naming_the_row(tmp_path, changes):
    artifact = {"results": [mixed_result(), mixed_result(**changes)]}
    with pytest.raises(ReportError, match=r"^sweep.json: results\[1\]: not a measured mixed row"):
        read_mixed_rows(artifact, "sweep.json")
    assert len(read_mixed_rows({"results": [mixed_result()]})) == 1
    # through validate: the table as written, the row then edited
    table = write_table(tmp_path / "table", DECODE_ROWS)
    record = json.loads((table / "sweep.json").read_text())
    record["results"].append(mixed_result(**changes))
    (table / "sweep.json").write_text(json.dumps(record))
    write_trace(tmp_path / "trace", [step(0, None, (2, 200)), step(1, 12.0, (2, 200))])
    with pytest.raises(ValidateError, match=r"results\[4\]: not a measured mixed row .* sweep the mixed points again"):
        validate(str(table), str(tmp_path / "trace"))


def test_a_fractional_file_count_is_refused_as_not_a_whole_number():
    environ = {"DYN_BENCH_TRACE_DIR": "/tmp/x", "DYN_BENCH_TRACE_FILES": "8.5"}
    with pytest.raises(TraceSettingsError, match=r"DYN_BENCH_TRACE_FILES='8.5' is not a whole number; give how many"):
        trace_settings({}, environ)
    with pytest.raises(TraceSettingsError, match=r"DYN_BENCH_TRACE_FILES='eight' is not a number"):
        trace_settings({}, {**environ, "DYN_BENCH_TRACE_FILES": "eight"})
    assert trace_settings({}, {**environ, "DYN_BENCH_TRACE_FILES": "8"}).files == 8
