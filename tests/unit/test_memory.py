"""The memory estimator (fp8_recipes/memory.py) against what was measured: peaks of scripts/train.py on one H200
(docs/bench/bench_engine_h200.json, written by scripts/bench_parallel.py) within 10%, and the published Llama 3
parameter counts."""

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from fp8_recipes import cli
from fp8_recipes.memory import GIB, LLAMA3, estimate_memory, parameter_counts
from fp8_recipes.plan import ParallelLayout

ROOT = Path(__file__).resolve().parents[2]


def total_params(model: dict) -> int:
    c = parameter_counts(model)
    return c["embedding"] + c["output_layer"] + c["layers"] * c["layer"] + c["final_norm"]


@pytest.mark.parametrize("name, billions", [("llama3-8b", 8.03), ("llama3-70b", 70.55), ("llama3-405b", 405.85)])
def test_llama3_parameter_counts(name, billions):
    assert total_params(LLAMA3[name]) / 1e9 == pytest.approx(billions, abs=0.01)


def test_estimate_within_ten_percent_of_the_h200_peaks():
    measured = json.loads((ROOT / "docs" / "bench" / "bench_engine_h200.json").read_text())
    runs = [r for r in measured["runs"] if r["layout"] == "1gpu" and "peak_gib" in r]
    assert {r["recipe"] for r in runs} == {"bf16", "delayed"}
    model = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "model" / "llama3_8b_8l.yaml"))
    for run in runs:
        estimate = estimate_memory(model, ParallelLayout(), micro_batch_size=measured["micro_batch_size"],
                                   seq_length=model["seq_length"], fp8=run["recipe"] != "bf16")
        assert estimate.total_gib == pytest.approx(run["peak_gib"], rel=0.10), (run, estimate.rows())


def test_layout_divides_what_it_shards():
    model = LLAMA3["llama3-70b"]
    one = estimate_memory(model, ParallelLayout(tp=8), micro_batch_size=1, seq_length=8192, fp8=False)
    dp = estimate_memory(model, ParallelLayout(tp=8, pp=4, dp=2), micro_batch_size=1, seq_length=8192, fp8=False)
    replicated = estimate_memory(model, ParallelLayout(tp=8, pp=4, dp=2), micro_batch_size=1, seq_length=8192,
                                 fp8=False, distributed_optimizer=False)
    assert replicated.optimizer == pytest.approx(2 * dp.optimizer)  # the distributed optimizer: 1 / DP
    assert dp.stage == 0 and dp.logits == 0  # the first stage: 4 micro-batches in flight outweigh the logits
    assert one.weights / 4 < dp.weights < one.weights / 3.5  # 80 layers over 4 stages, + the embedding on stage 0
    cp = estimate_memory(model, ParallelLayout(tp=8, pp=4, cp=2, dp=2), micro_batch_size=1, seq_length=8192, fp8=False)
    assert cp.activations == pytest.approx(dp.activations / 2) and cp.optimizer == pytest.approx(dp.optimizer / 2)
    fp8 = estimate_memory(model, ParallelLayout(tp=8, pp=4, dp=2), micro_batch_size=1, seq_length=8192, fp8=True)
    assert fp8.fp8_weights > 0 and fp8.activations < dp.activations


def test_memory_command(capsys):
    assert cli.main(["memory", "llama3-70b", "--layout", "tp=4,pp=4,vpp=5,cp=2,dp=4", "--fp8"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("llama3-70b: tp=4, pp=4, vpp=5, cp=2, dp=4: 128 GPUs, micro-batch 1, seq 8192, FP8")
    assert "  total" in out and "GiB" in out
    assert cli.main(["memory", "llama3-1b"]) == 1
    assert "is not a model" in capsys.readouterr().err
    assert GIB == 2**30
