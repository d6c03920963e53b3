"""Non-finite steps in the training loop on Megatron-Core's engine (a one-layer GPT, tests/unit/tiny_engine.py): the
optimizer step is skipped without touching weights, optimizer state (fp32 main params, Adam moments) or the LR
schedule; skips are counted and logged; after ``max_consecutive_skips`` in a row the run falls back to high
precision, or stops with one line."""

import copy
import json
import math

import pytest
import torch

from fp8_recipes.numerics import DelayedScaler
from fp8_recipes.rundir import read_metrics
from fp8_recipes.recipe.schema import Role, Scaling, TensorPolicy
from fp8_recipes.training.checkpoint import read_checkpoint
from fp8_recipes.training.config import TrainerConfig
from fp8_recipes.training.errors import NonFiniteStop
from fp8_recipes.training.loop import train
from fp8_recipes.training.precision import NoPrecision, Precision
from tiny_engine import BATCH, batches, tensors, tiny_engine


class SpyPrecision(NoPrecision):
    """Snapshots weights and optimizer state at every step's start; records skips and high-precision steps."""

    def __init__(self, engine):
        super().__init__("fp8")
        self.engine = engine
        self.snapshots, self.skipped, self.high_precision_steps, self.step = {}, [], [], None

    def begin_step(self, step):
        self.step = step
        opt = self.engine.optimizer
        self.snapshots[step] = (copy.deepcopy(self.engine.models[0].state_dict()), copy.deepcopy(opt.state_dict()),
                                opt.param_groups[0]["lr"])
        return self.label

    def high_precision(self):
        self.high_precision_steps.append(self.step)
        return super().high_precision()

    def skip_step(self, step):
        self.skipped.append(step)


def run(tmp_path, monkeypatch, poison, steps=8, resume_from=None, **trainer):
    cfg = {"max_steps": steps, "micro_batch_size": BATCH, "global_batch_size": BATCH, "warmup_steps": 2,
           "eval_interval": 0, "save_checkpoints": False, "lr": 1e-2, "min_lr": 1e-3, **trainer}
    with tiny_engine(cfg, poison) as engine:
        precision = SpyPrecision(engine)
        try:
            summary = train(engine, batches(), None, cfg, precision, tmp_path, resume_from=resume_from)
        except NonFiniteStop as e:
            summary = e
    return summary, precision, read_metrics(tmp_path, "train")


def same_state(a, b) -> bool:
    (ma, oa, lra), (mb, ob, lrb) = a, b
    tensors_a, tensors_b = tensors(ma) + tensors(oa), tensors(mb) + tensors(ob)
    return lra == lrb and len(tensors_a) == len(tensors_b) and all(torch.equal(x, y)
                                                                   for x, y in zip(tensors_a, tensors_b))


@pytest.mark.parametrize("kind", ["loss", "grad"])
def test_nonfinite_step_is_skipped_without_touching_state(kind, tmp_path, monkeypatch):
    summary, spy, rows = run(tmp_path, monkeypatch, {3: kind})
    snaps = spy.snapshots
    assert same_state(snaps[3], snaps[4])          # step 3 changed nothing: weights, Adam moments and step, LR
    assert not same_state(snaps[4], snaps[5]) and not same_state(snaps[2], snaps[3])  # normal steps do
    assert spy.skipped == [3] and spy.high_precision_steps == []
    assert [r["skipped"] for r in rows] == [False] * 3 + [True] + [False] * 4
    assert [r["skipped_steps"] for r in rows] == [0] * 3 + [1] * 5
    assert rows[4]["lr"] == rows[3]["lr"]          # the schedule did not advance on the skipped step
    assert (rows[3]["loss"] == "nan") == (kind == "loss") and rows[3]["grad_norm"] in ("nan", "inf")
    assert summary["skipped_steps"] == 1 and summary["bf16_fallbacks"] == 0 and summary["stopped"] is None
    assert all(math.isfinite(r["loss"]) for r in rows if not r["skipped"])


def test_consecutive_skips_fall_back_to_high_precision(tmp_path, monkeypatch):
    summary, spy, rows = run(tmp_path, monkeypatch, {2: "loss", 3: "loss"}, steps=9, max_consecutive_skips=2,
                             fallback_bf16_steps=3)
    assert spy.skipped == [2, 3]
    assert spy.high_precision_steps == [4, 5, 6]   # the three steps after the second skip, then the plan again
    assert [r["stage"] for r in rows] == ["fp8"] * 4 + ["bf16 fallback"] * 3 + ["fp8"] * 2
    assert summary["bf16_fallbacks"] == 1 and summary["skipped_steps"] == 2
    assert json.loads((tmp_path / "summary.json").read_text())["bf16_fallbacks"] == 1


def test_a_single_skip_does_not_trigger_the_fallback(tmp_path, monkeypatch):
    summary, spy, _ = run(tmp_path, monkeypatch, {1: "loss", 3: "loss"}, max_consecutive_skips=2)
    assert spy.skipped == [1, 3] and spy.high_precision_steps == [] and summary["bf16_fallbacks"] == 0


def test_stop_mode_raises_one_line(tmp_path, monkeypatch):
    err, spy, rows = run(tmp_path, monkeypatch, {1: "loss", 2: "grad"}, max_consecutive_skips=2, on_nonfinite="stop")
    assert isinstance(err, NonFiniteStop) and "\n" not in str(err)
    assert str(err).startswith("trainer.max_consecutive_skips: 2 steps in a row (to step 3)")
    assert max(spy.snapshots) == 2 and len(rows) == 3  # nothing ran after the second skip
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["stopped"] == str(err) and summary["skipped_steps"] == 2


def test_nonfinite_in_the_fallback_too_stops(tmp_path, monkeypatch):
    err, spy, _ = run(tmp_path, monkeypatch, {i: "loss" for i in range(2, 20)}, steps=20, max_consecutive_skips=2,
                      fallback_bf16_steps=4)
    assert isinstance(err, NonFiniteStop) and "BF16 fallback too" in str(err)
    assert spy.skipped == [2, 3, 4, 5] and spy.high_precision_steps == [4, 5]


def test_protocol_and_config():
    assert isinstance(NoPrecision(), Precision)
    cfg = TrainerConfig.from_cfg({})
    assert (cfg.on_nonfinite, cfg.max_consecutive_skips) == ("skip_then_bf16", 5)
    with pytest.raises(ValueError, match=r"trainer\.on_nonfinite='skip': choose one of skip_then_bf16 \| stop"):
        TrainerConfig.from_cfg({"on_nonfinite": "skip"})
    with pytest.raises(ValueError, match=r"trainer\.max_consecutive_skips=0: must be an integer >= 1"):
        TrainerConfig.from_cfg({"max_consecutive_skips": 0})


def test_emulated_skip_step_forgets_the_steps_amaxes():
    from fp8_recipes.backends.emulated import EmulatedLinearState, EmulatedPrecision

    state = EmulatedLinearState("layer")
    state.scalers = {Role.WEIGHTS: DelayedScaler(TensorPolicy(scaling=Scaling.DELAYED, amax_history_len=4))}
    precision = object.__new__(EmulatedPrecision)  # the attributes skip_step and the update use
    precision.states, precision.attention = {"layer": state}, {}
    precision._reducers = {id(state): None}  # (no amax reduction: one rank)
    scaler = state.scalers[Role.WEIGHTS]
    scaler.observe(torch.tensor(2.0))
    precision.after_optimizer_step(0)
    good_scale = scaler.scale.clone()
    scaler.observe(torch.tensor(float("inf")))  # the skipped step's forward
    precision.skip_step(1)
    scaler.observe(torch.tensor(1.0))
    precision.after_optimizer_step(2)
    assert torch.isfinite(scaler.history).all() and scaler.history.max() == 2.0
    assert torch.equal(scaler.scale, good_scale)


def test_stop_mode_checkpoints_the_last_good_state(tmp_path, monkeypatch):
    err, spy, _ = run(tmp_path, monkeypatch, {1: "loss", 2: "grad"}, max_consecutive_skips=2, on_nonfinite="stop",
                      save_checkpoints=True)
    step_dir = tmp_path / "checkpoints" / "step_3"
    assert isinstance(err, NonFiniteStop) and "\n" not in str(err)
    assert str(err).endswith(f"; the weights from before step 2 are checkpointed in {step_dir} (continue with "
                             f"trainer.resume={step_dir} and a lower trainer.lr or another recipe)")
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_3"
    saved = read_checkpoint(step_dir)
    model, optimizer, lr = spy.snapshots[1]  # at the start of the first bad step: what the last good one left
    weights = saved["model"][0]
    assert all(torch.equal(weights[k], v) for k, v in model.items() if torch.is_tensor(v))
    assert weights.keys() == model.keys()
    adam = saved["optimizer"]["state_dict"]["optimizer"]["state"]
    assert adam[0]["step"] == optimizer["optimizer"]["state"][0]["step"] == 1
    assert all(torch.equal(x, y) for x, y in zip(tensors(saved["optimizer"]["state_dict"]), tensors(optimizer)))
    assert json.loads((step_dir / "meta.json").read_text())["consumed_samples"] == 3 * BATCH


def test_resume_trains_at_the_configured_lr(tmp_path, monkeypatch):
    """A checkpoint restores the LR it was made with; a resumed run under another trainer.lr uses the new one on
    the configured schedule. Step 3 of 4 after a 2-step warmup is half-way down the cosine to min_lr 1e-3:
    1e-3 + (peak - 1e-3) / 2, i.e. 2.5e-3 for peak 4e-3 (6.25e-3 if the checkpoint's peak 1e-2 stayed)."""
    run(tmp_path, monkeypatch, {}, steps=2, save_checkpoints=True, lr=1e-2)
    same = run(tmp_path / "same", monkeypatch, {}, steps=4, lr=1e-2, resume_from=tmp_path)[2]
    lower = run(tmp_path / "lower", monkeypatch, {}, steps=4, lr=4e-3, resume_from=tmp_path)[2]
    assert [r["step"] for r in lower] == [3, 4]
    assert lower[0]["lr"] == pytest.approx(2.5e-3) and same[0]["lr"] == pytest.approx(5.5e-3)
    assert lower[1]["lr"] == pytest.approx(1e-3) and same[1]["lr"] == pytest.approx(1e-3)  # the end: min_lr


def test_policy_decides_skip_fallback_and_stop_without_a_model():
    from fp8_recipes.training.engine import StepResult
    from fp8_recipes.training.faults import NonFinitePolicy

    policy = NonFinitePolicy(TrainerConfig.from_cfg({"max_consecutive_skips": 2, "fallback_bf16_steps": 3}))
    bad, good = StepResult(float("nan"), 1.0, True, False), StepResult(1.0, 1.0, False, False)
    assert policy.decide(good, 1).notes == () and policy.decide(bad, 2).notes[0].startswith("step 2: non-finite")
    assert policy.decide(good, 3).stop is None and policy.in_a_row == 0  # a good step ends the run of skips
    assert policy.decide(bad, 4).stop is None and not policy.in_fallback
    fallback = policy.decide(bad, 5)
    assert fallback.stop is None and fallback.notes[1].startswith("step 5: 2 skipped steps in a row: the next 3")
    assert policy.in_fallback and policy.fallbacks == 1 and policy.skipped_steps == 3
    assert policy.decide(bad, 6).stop is None
    stop = policy.decide(bad, 7).stop  # the limit again inside the fallback
    assert stop is not None and stop.first_bad == 6 and stop.reason.endswith("(in the BF16 fallback too)")
    assert "not checkpointed" in stop.message(None)
