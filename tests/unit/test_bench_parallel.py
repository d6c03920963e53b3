"""scripts/bench_parallel.py's bookkeeping (the runs themselves need GPUs): ratios per GPU against the one-GPU run of
the same recipe and FP8 against BF16 in the same layout, the files it writes, and a bad layout name in one line."""

import json
import math

import pytest

from fp8_recipes.bench.parallel import _ratios, bench_parallel, save

RESULT = {"date": "2026-12-01", "runs": [
    {"layout": "1gpu", "recipe": "bf16", "gpus": 1, "tokens_per_s": 100.0, "peak_gib": 60.0},
    {"layout": "1gpu", "recipe": "delayed", "gpus": 1, "tokens_per_s": 130.0, "peak_gib": 62.0},
    {"layout": "dp2", "recipe": "bf16", "gpus": 2, "tokens_per_s": 190.0, "peak_gib": 40.0},
    {"layout": "dp2", "recipe": "delayed", "gpus": 2, "tokens_per_s": 247.0, "peak_gib": 42.0},
    {"layout": "pp2", "recipe": "delayed", "gpus": 2, "rc": 1, "error": ["boom"]},
]}


def test_ratios_per_gpu_and_fp8_over_bf16():
    rows = {(r["layout"], r["recipe"]): r for r in _ratios(RESULT)}
    dp2 = rows[("dp2", "delayed")]
    assert dp2["per_gpu"] == pytest.approx(123.5) and dp2["vs_1gpu"] == pytest.approx(1.9)  # 247 / 130
    assert dp2["fp8_vs_bf16"] == pytest.approx(1.3) and math.isnan(rows[("dp2", "bf16")]["fp8_vs_bf16"])
    assert math.isnan(rows[("pp2", "delayed")]["vs_1gpu"])  # a failed run has no ratio


def test_save_writes_json_table_and_plot(tmp_path):
    table = save(RESULT, tmp_path)
    assert "| dp2 | delayed | 2 | 247 | 124 | 1.90 | 1.30 | 42.00 |" in table
    assert json.loads((tmp_path / "bench_parallel.json").read_text()) == RESULT
    assert (tmp_path / "bench_parallel.md").read_text().strip() == table
    assert (tmp_path / "bench_parallel.png").stat().st_size > 1000


def test_unknown_layout_is_one_line(tmp_path):
    with pytest.raises(ValueError, match=r"^--layouts: 'dp3' is not one of 1gpu, 1gpu-plainopt"):
        bench_parallel(["1gpu", "dp3"], ["bf16"], [], out=tmp_path, steps=1, gbs=8)
