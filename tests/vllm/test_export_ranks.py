"""The export of a data-parallel sweep reads every rank's artifact of that one sweep: a rank
folder left on another node, or one from another sweep or layout, is refused by name with the
fix (review 80dd0ee, section 3)."""

from __future__ import annotations

import json

import pytest
from export_helpers import decode_row, dp_sweep, dynamo_files, write_rank
from vllm.kvwarm.__main__ import main
from vllm.kvwarm.record import vocabulary as v
from vllm.kvwarm.record.combined import write_combined, write_view
from vllm.kvwarm.record.export import input as export


def test_a_rank_folder_left_on_another_node_is_named_with_how_to_gather_it(tmp_path, capsys):
    root = dp_sweep(tmp_path / "s", [[decode_row(100, 1)]] * 3)
    for rank in (1, 2):
        (root / f"dp{rank}" / "sweep.json").unlink()
    assert main(["export", str(root), "--to", "dynamo", "--out", str(tmp_path / "b.json")]) == 2
    err = capsys.readouterr().err
    assert "names 3 data-parallel ranks and dp1/sweep.json, dp2/sweep.json are not here" in err
    assert f"copy every node's dp<R>/ folder into {root}" in err
    assert not (tmp_path / "b.json").exists()


def _replace_rank(root, folder: int, **kwargs):
    """dp<folder>/ rewritten with an artifact as `kwargs` say (its rank, size, rows)."""
    write_rank(root / f"dp{folder}", kwargs.pop("rows", [decode_row(100, 1)]), **kwargs)


@pytest.mark.parametrize(
    "changed, says",
    [
        ({"rank": 0, "size": 2}, "dp1/sweep.json: rank 0 of 2, where rank 1 of 2 belongs"),
        ({"rank": 1, "size": 4}, "dp1/sweep.json: rank 1 of 4, where rank 1 of 2 belongs"),
        ({"rank": 1, "size": 2, "rows": [decode_row(200, 1)]}, "dp1/sweep.json: other points than"),
    ],
)
def test_a_rank_artifact_of_another_sweep_or_layout_is_refused_by_name(tmp_path, changed, says):
    root = dp_sweep(tmp_path / "s", [[decode_row(100, 1)]] * 2)
    assert len(dynamo_files(root, tmp_path / "b.json")) == 2  # one sweep: exported
    _replace_rank(root, 1, **changed)
    with pytest.raises(export.ExportError, match="gather the dp<R>/ folders of one sweep") as err:
        export.load_sweep(root)
    assert says in str(err.value)


def test_a_rank_artifact_of_another_build_is_refused_by_name(tmp_path):
    root = dp_sweep(tmp_path / "s", [[decode_row(100, 1)]] * 2)
    path = root / "dp1" / "sweep.json"
    artifact = json.loads(path.read_text())
    artifact["build"] = {"vllm": "another"}
    path.write_text(json.dumps(artifact))
    with pytest.raises(export.ExportError, match=r"dp1/sweep.json: another build than .*dp0/sweep.json's"):
        export.load_sweep(root)


def test_a_failed_sweeps_ranks_may_hold_different_points_and_still_export(tmp_path):
    root = tmp_path / "s"
    write_rank(root / "dp0", [decode_row(100, 1), decode_row(200, 1)], rank=0, size=2)
    write_rank(root / "dp1", [decode_row(100, 1)], rank=1, size=2, status=v.FAILED, error="rank 1 stopped")
    write_combined(root, 2)  # the combined view of the two, as the sweep writes it
    record = export.load_sweep(root)
    assert [len(a["results"]) for a in record.ranks] == [2, 1]


def test_a_grid_sweep_without_rows_reads_its_kinds_from_the_grid_in_its_folder(tmp_path, monkeypatch):
    root = tmp_path / "s"
    write_rank(root, [])
    artifact = json.loads((root / "sweep.json").read_text())
    artifact["config"]["points"] = "grid.json"  # as a generated grid is recorded
    (root / "sweep.json").write_text(json.dumps(artifact))
    (root / "grid.json").write_text(json.dumps({"schema_version": 2, "prefill": [{"N": 64, "P": 0, "B": 1}]}))
    monkeypatch.chdir(tmp_path)  # not the sweep's folder: the bare name alone would not be found
    assert export.load_sweep(root).kinds() == ["prefill"]


def test_a_rank_the_others_gave_up_on_exports_as_failed_with_the_views_reason(tmp_path):
    root = tmp_path / "s"
    survivor = write_rank(root / "dp0", [decode_row(100, 1), decode_row(200, 1)], rank=0, size=2)
    killed = write_rank(root / "dp1", [decode_row(100, 1)], rank=1, size=2, status=v.RUNNING)
    write_combined(root, 2)  # rank 1 still running: no final view yet
    with pytest.raises(export.ExportError, match="status 'running'"):
        export.load_sweep(root)
    write_view(root, [survivor, killed], lost={1: "rank 0 gave up on it: no meeting record within 1 s"})
    record = export.load_sweep(root)
    assert [a["status"] for a in record.ranks] == [v.COMPLETE, v.FAILED]
    assert record.ranks[1]["error"] == "rank 0 gave up on it: no meeting record within 1 s"
    files = dynamo_files(root, tmp_path / "b.json")  # each rank's file with its own status, as Dynamo's
    assert [f["status"] for f in files] == [v.COMPLETE, v.FAILED] and not files[1]["valid"]
    assert files[1]["error"] == "rank 0 gave up on it: no meeting record within 1 s"
