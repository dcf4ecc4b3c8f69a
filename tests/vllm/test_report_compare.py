"""`python -m vllm.kvwarm report` comparing runs: the A/B ratios and MAPE against figures
computed by hand, runs named by their folders, several runs each compared with the first,
and the points only one side has named."""

from __future__ import annotations

import csv

import pytest
from report_helpers import legend, rank_artifact, save
from vllm.kvwarm.record.artifact import PointRow
from vllm.kvwarm.record.plot import REGIMES, figure
from vllm.kvwarm.record.report import compare, run
from vllm.kvwarm.record.runs import from_artifact, labels_for, load_run


def test_ab_ratios_and_mape_match_a_hand_computation(tmp_path, capsys):
    a = save(tmp_path / "off", rank_artifact(medians_ms=(10.0, 20.0), regime="legacy"))
    only_in_b = PointRow(8000, 4, "real_kv", ["kvwarm_real_kv"], [0.08, 0.08, 0.08], 0.08)
    b = save(tmp_path / "on", rank_artifact(medians_ms=(11.0, 18.0), extra=[only_in_b]))
    assert run([a, b, "--out", str(tmp_path / "ab")]) == 0
    # by hand: |11 - 10| / 10 = 10%, |18 - 20| / 20 = 10%: MAPE 10%; ratios 1.1 and 0.9
    out = capsys.readouterr().out
    assert "MAPE of B against A over 2 joined point(s): 10.00%" in out
    assert "     1000    4       10.000       11.000   1.100  legacy / real_kv" in out
    assert "     2000    4       20.000       18.000   0.900  legacy / real_kv" in out
    assert "unmatched: K=8000 B=4 only in B (not in its points)" in out
    page = (tmp_path / "ab" / "report.html").read_text()
    assert "MAPE of B against A: 10.00%" in page and "compare-2-vs-1.png" in page
    rows = list(csv.DictReader((tmp_path / "ab" / "report.csv").open()))
    assert [(r["run"], r["total_kv_read_tokens"], r["ratio_to_baseline"]) for r in rows] == [
        ("off", "1000", ""),
        ("off", "2000", ""),
        ("on", "1000", "1.1000"),
        ("on", "2000", "0.9000"),
        ("on", "8000", ""),
    ]
    overlay = figure([load_run(a), load_run(b)])
    assert legend(overlay) == ["B=4", "A: off", "B: on", REGIMES["real_kv"][0], REGIMES["legacy"][0]]


def test_runs_are_named_by_their_folder_unless_two_share_a_name():
    assert labels_for(["runs/real-kv", "runs/fake-kv/sweep.json"]) == ["real-kv", "fake-kv"]
    assert labels_for(["host1/moe", "host2/moe/"]) == ["host1/moe", "host2/moe"]
    assert labels_for(["runs/moe", "runs/moe"]) == ["runs/moe #1", "runs/moe #2"]


def test_three_runs_are_each_compared_with_the_first_and_unmatched_points_named(tmp_path):
    first = from_artifact(rank_artifact(medians_ms=(10.0, 20.0)), "a", "a")
    skipped = PointRow(2000, 4, "skip:pool_too_small", detail="no room")
    third = from_artifact(rank_artifact(medians_ms=(12.0,), extra=[skipped]), "c", "c")
    c = compare(first, third)
    assert [(x.k, y.k) for x, y in c.joined] == [(1000, 1000)] and c.mape == pytest.approx(20.0)
    assert [r.k for r in c.only_base] == [2000] and c.only_other == []
    out = tmp_path / "three"
    runs = [
        save(tmp_path / n, rank_artifact(medians_ms=m)) for n, m in (("a", (10, 20)), ("b", (10, 22)), ("c", (12, 20)))
    ]
    assert run([*runs, "--out", str(out)]) == 0
    assert sorted(p.name for p in out.glob("*.png")) == [
        "compare-2-vs-1.png",
        "compare-3-vs-1.png",
        "run-1.png",
        "run-2.png",
        "run-3.png",
    ]
