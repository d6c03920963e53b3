"""Numerics statistics and tensor dumps in a tiny training run: `debug:` on writes numerics.jsonl (every watched
module, GEMM and operand at the due steps, evaluation forwards left out), TensorBoard scalars, the heat map and
dumps that load back bit-exactly; `debug:` off writes none of it."""

from __future__ import annotations

import json
import math

import pytest
import torch

from fp8_recipes.numerics import DelayedScaler, fake_quant
from fp8_recipes.observe.recorder import load_dump
from fp8_recipes.rundir import read_numerics
from fp8_recipes.observe.stats import STAT_KEYS
from fp8_recipes.recipe.schema import Recipe

from test_train_cpu import compose_train, dataset, small_run  # noqa: F401 (dataset: the shared fixture)

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
OPERANDS = {("fprop", "activations"), ("fprop", "weights"), ("dgrad", "gradients"), ("dgrad", "weights"),
            ("wgrad", "gradients"), ("wgrad", "activations")}


@pytest.fixture
def fresh_world(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(var, raising=False)


def test_debug_on_records_stats_and_dumps(dataset, tmp_path, fresh_world):  # noqa: F811
    from fp8_recipes.training.run import run_training

    overrides = ["+recipe=delayed", *dataset, *small_run(tmp_path, num_layers=2, steps=5),
                 "trainer.eval_interval=1",  # evaluation right after a recorded step: must not be recorded
                 "++debug.interval=2", r"++debug.layers='layers\.[01]\.'", "++debug.dump.steps=[3]",  # '': [] in Hydra
                 r"++debug.dump.layers='layers\.1\.mlp\.linear_fc2'", "++debug.dump.tensors=[activations]"]
    run_training(compose_train(overrides))

    rows = read_numerics(tmp_path)
    modules = {f"decoder.layers.{i}.{m}" for i in range(2) for m in LINEARS}  # the LM head stays BF16
    assert {r["step"] for r in rows} == {1, 3, 5}
    for step in (1, 3, 5):
        keys = [(r["module"], r["gemm"], r["role"]) for r in rows if r["step"] == step]
        assert len(keys) == len(set(keys)) == len(modules) * len(OPERANDS)
        assert {k[0] for k in keys} == modules and {k[1:] for k in keys} == OPERANDS
    for r in rows:
        assert set(r) - {"step", "module", "gemm", "role", "policy"} <= set(STAT_KEYS)
        assert {"amax", "underflow_pct", "saturation_pct", "mse", "cosine", "scale", "scale_ratio"} <= set(r)
        assert 0.9 < r["cosine"] <= 1.0 + 1e-9 and 0 <= r["underflow_pct"] <= 100
    # one micro-batch of 4 x 128 tokens x hidden 128: the evaluation forward after step 1 added nothing
    qkv = next(r for r in rows if r["step"] == 1 and r["module"].endswith("0.self_attention.linear_qkv")
               and r["gemm"] == "fprop" and r["role"] == "activations")
    assert qkv["numel"] == 4 * 128 * 128
    assert qkv["scale"] == 1.0  # delayed scaling's first step: no history yet, scale 1

    assert (tmp_path / "numerics_underflow.png").stat().st_size > 1000
    assert any((tmp_path / "tb").glob("events.out.tfevents.*"))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = {t for t in EventAccumulator(str(tmp_path / "tb")).Reload().Tags()["scalars"] if t.startswith("numerics/")}
    assert {t.split("/")[-3] + "/" + t.split("/")[-2] for t in tags} == {"fprop/activations", "fprop/weights",
                                                                         "dgrad/gradients"}  # each role once
    assert "numerics/decoder.layers.0.mlp.linear_fc1/fprop/activations/underflow_pct" in tags

    dumps = sorted((tmp_path / "dumps").rglob("*.pt"))
    assert [p.relative_to(tmp_path).as_posix() for p in dumps] == [
        "dumps/step_3/decoder.layers.1.mlp.linear_fc2.fprop.activations.0.pt",
        "dumps/step_3/decoder.layers.1.mlp.linear_fc2.wgrad.activations.0.pt"]
    d = load_dump(dumps[0])
    assert d["step"] == 3 and d["role"] == "activations" and d["policy"]["scaling"] == "delayed"
    assert d["fp8_codes"].dtype == torch.uint8 and d["fp8"].dtype == torch.float8_e4m3fn
    assert d["hp"].dtype == torch.bfloat16 and d["dequantized"].shape == d["hp"].shape
    # the dump holds what the GEMM read: the same fake-quantization from the saved scale, bit for bit
    policy = Recipe.from_dict({"activations": d["policy"]}).activations
    scaler = DelayedScaler(policy)
    scaler.scale = d["scale"].reshape(())
    assert torch.equal(d["dequantized"], fake_quant(d["hp"], policy, scaler=scaler, record_amax=False))


def test_debug_off_writes_nothing(dataset, tmp_path, fresh_world):  # noqa: F811
    from fp8_recipes.training.run import run_training

    run_training(compose_train(["+recipe=tensorwise", *dataset, *small_run(tmp_path, num_layers=1, steps=2)]))
    assert (tmp_path / "metrics.jsonl").is_file()
    assert not any((tmp_path / p).exists() for p in ("numerics.jsonl", "numerics_underflow.png", "dumps"))


def test_bad_debug_key_fails_before_training(dataset, tmp_path, fresh_world):  # noqa: F811
    from fp8_recipes.training.run import run_training

    with pytest.raises(ValueError, match=r"debug\.tensors\[0\]: 'activation' is not one of"):
        run_training(compose_train(["+recipe=tensorwise", *dataset, *small_run(tmp_path, num_layers=1, steps=2),
                                    "++debug.tensors=[activation]"]))
    assert not tmp_path.joinpath("metrics.jsonl").exists()


@pytest.mark.parametrize("micro_batches", [1, 0])
def test_micro_batches_sampled_or_merged(dataset, tmp_path, fresh_world, micro_batches,  # noqa: F811
                                        monkeypatch):
    """Two micro-batches of 2 sequences per step: `micro_batches: 1` measures (and dumps) the first one of each
    module (every operand still there: the module is switched off only after its last), 0 sums both."""
    from fp8_recipes.observe.recorder import NumericsRecorder
    from fp8_recipes.training.run import run_training

    calls = []
    observe = NumericsRecorder.observe
    monkeypatch.setattr(NumericsRecorder, "observe", lambda self, state, *a, **k: (
        calls.append(self.step) if state.record_amax else None, observe(self, state, *a, **k))[-1])

    overrides = ["+recipe=tensorwise", *dataset, *small_run(tmp_path, num_layers=1, steps=2),
                 "trainer.micro_batch_size=2", "trainer.global_batch_size=4", "++debug.interval=1",
                 f"++debug.micro_batches={micro_batches}", "++debug.dump.steps=[2]",
                 r"++debug.dump.layers='layers\.0\.mlp\.linear_fc2'", "++debug.dump.tensors=[activations]"]
    run_training(compose_train(overrides))

    rows = read_numerics(tmp_path)
    modules = {f"decoder.layers.0.{m}" for m in LINEARS}
    for step in (1, 2):
        keys = [(r["module"], r["gemm"], r["role"]) for r in rows if r["step"] == step]
        assert len(keys) == len(set(keys)) == len(modules) * len(OPERANDS)
        assert {k[0] for k in keys} == modules and {k[1:] for k in keys} == OPERANDS
    per_micro_batch = 2 * 128 * 128  # 2 sequences x 128 tokens x hidden 128
    qkv = [r for r in rows if r["module"].endswith("linear_qkv") and r["gemm"] == "fprop"
           and r["role"] == "activations"]
    assert [r["numel"] for r in qkv] == [per_micro_batch * (1 if micro_batches == 1 else 2)] * 2
    # switched off after micro-batch 1: the backend no longer calls the observer (nothing reaches the recorder)
    assert calls.count(1) == calls.count(2) == len(modules) * len(OPERANDS) * (1 if micro_batches == 1 else 2)
    dumps = sorted(p.name for p in (tmp_path / "dumps" / "step_2").glob("*.pt"))
    indices = [0] if micro_batches == 1 else [0, 1]
    assert dumps == sorted(f"decoder.layers.0.mlp.linear_fc2.{g}.activations.{i}.pt"
                           for g in ("fprop", "wgrad") for i in indices)


def test_bench_stats_measures_three_overheads(dataset, tmp_path, fresh_world):  # noqa: F811
    """scripts/bench_stats.py's measurement on a tiny run: off/on step times, the in-run extra of the recorded
    steps, the recorder's own share; the table and the PNG."""
    from fp8_recipes.bench.observe import bench_stats, format_table, plot_overhead

    overrides = [*dataset, "model.num_layers=1", "model.vocab_size=null", "trainer.micro_batch_size=2",
                 "trainer.global_batch_size=2"]
    result = bench_stats(["tensorwise"], interval=3, steps=12, repeats=1, overrides=overrides)
    row = result["rows"][0]
    assert result["warmup"] and len(row["runs"]["off"]) == len(row["runs"]["on"]) == len(row["in_run"]) == 1
    assert row["step_s_off"] > 0 and row["step_s_on"] > 0 and row["recorder_pct"] > 0
    assert row["overhead_pct"] == pytest.approx(100 * (row["step_s_on"] / row["step_s_off"] - 1))
    assert math.isfinite(row["in_run_overhead_pct"])
    assert "| tensorwise |" in format_table(result)
    assert plot_overhead(result, tmp_path / "o.png").stat().st_size > 1000
    assert result["on"] == ["++debug.interval=3"]


def test_bench_stats_measures_the_autopilot(dataset, tmp_path, fresh_world):  # noqa: F811
    """`--on autopilot=on`: the runs measured against debug off are the autopilot's (it reads the statistics every
    interval steps, the same steps the in-run measure counts); a healthy run takes no action."""
    from fp8_recipes.bench.observe import bench_stats

    overrides = [*dataset, "model.num_layers=1", "model.vocab_size=null", "trainer.micro_batch_size=2",
                 "trainer.global_batch_size=2"]
    result = bench_stats(["delayed"], interval=3, steps=12, repeats=1, overrides=overrides, warmup=False,
                         on=["autopilot=on", "++autopilot.interval=3"])
    row = result["rows"][0]
    assert result["on"] == ["autopilot=on", "++autopilot.interval=3"]
    assert row["recorder_pct"] > 0 and math.isfinite(row["in_run_overhead_pct"])


def test_step_time_overhead_counts_recorded_steps_and_writes(tmp_path):
    from fp8_recipes.bench.observe import step_time_overhead

    times = {s: (0.3 if s % 10 == 1 else 0.2) for s in range(1, 41)}  # interval 10: steps 1, 11, 21, 31 record
    (tmp_path / "m.jsonl").write_text("".join(json.dumps({"kind": "train", "step": s, "step_time": t}) + "\n"
                                              for s, t in times.items()))
    # after step 5: 35 steps, 3 recorded at +0.1 s each, plus 3/4 of the 0.4 s of writes -> 0.6 s over 35 x 0.2 s
    assert step_time_overhead(tmp_path / "m.jsonl", 10, write_s=0.4) == pytest.approx(100 * 0.6 / 7.0)
    with pytest.raises(ValueError, match="no recorded"):
        step_time_overhead(tmp_path / "m.jsonl", 100, write_s=0.0)
