"""`python -m vllm.kvwarm export --to profiler`: the pre-deployment profiler's interpolation
tables (npz and their JSON fallbacks) in the profiler's units, the slowest rank's time per
point, and what the export refuses to table, each named with its fix."""

from __future__ import annotations

import json

import numpy as np
import pytest
from export_helpers import RESOLVED, decode_row, dp_sweep, prefill_row, write_rank
from vllm.kvwarm.__main__ import main
from vllm.kvwarm.record import vocabulary as v
from vllm.kvwarm.record.export import write as export
from vllm.kvwarm.record.export.input import load_sweep


def test_the_profiler_tables_hold_the_rows_in_the_profilers_units(tmp_path):
    root = dp_sweep(
        tmp_path / "s",
        [
            [
                decode_row(1000, 4, (0.010,) * 3),
                prefill_row(256, 0, 1, (0.020,) * 3),
                prefill_row(256, 512, 1),
                prefill_row(256, 0, 2),
            ],
            [
                decode_row(1000, 4, (0.012,) * 3),
                prefill_row(256, 0, 1, (0.025,) * 3),
                prefill_row(256, 512, 1),
                prefill_row(256, 0, 2),
            ],
        ],
    )
    export.write_profiler(load_sweep(root), tmp_path / "p")
    with np.load(tmp_path / "p" / "selected_decode_interpolation" / "raw_data.npz") as d:
        assert d["x_kv_usage"].tolist() == [1000 / 8000] and d["y_context_length"].tolist() == [250.0]
        assert d["z_itl"].tolist() == pytest.approx([12.0]) and d["max_kv_tokens"].tolist() == [8000]
        assert d["z_thpt_per_gpu"].tolist() == pytest.approx([4 / 0.012])
    with np.load(tmp_path / "p" / "selected_prefill_interpolation" / "raw_data.npz") as d:  # B = 1, P = 0 only
        assert d["prefill_isl"].tolist() == [256.0] and d["prefill_ttft"].tolist() == pytest.approx([25.0])
        assert d["prefill_thpt_per_gpu"].tolist() == pytest.approx([256 / 0.025])
    fallback = json.loads((tmp_path / "p" / "decode_raw_data.json").read_text())
    assert fallback["max_kv_tokens"] == 8000 and fallback["z_itl"] == pytest.approx([12.0])


def test_the_profiler_export_refuses_what_it_cannot_table(tmp_path, capsys):
    root = tmp_path / "old"
    write_rank(root, [decode_row(100, 1)], resolved={k: val for k, val in RESOLVED.items() if k != "kv_cache_tokens"})
    assert main(["export", str(root), "--to", "profiler"]) == 2
    assert "--max-kv-tokens" in capsys.readouterr().err
    assert main(["export", str(root), "--to", "profiler", "--max-kv-tokens", "4000"]) == 0
    write_rank(root, [decode_row(100, 1)], status=v.FAILED, error="boom")
    assert main(["export", str(root), "--to", "profiler"]) == 2
    assert "did not complete" in capsys.readouterr().err
    write_rank(root, [prefill_row(64, 128, 1)])
    assert main(["export", str(root), "--to", "profiler"]) == 2
    assert "B = 1, P = 0" in capsys.readouterr().err
