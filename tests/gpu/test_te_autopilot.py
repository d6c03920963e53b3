"""The autopilot on the TE backend (issue 30): a plan changed between steps moves each changed TE linear to its new
TE recipe, its delayed amaxes carried (backends/te_state.py), and TE's amax buffers update every module under its
recipe now; a real run acts on a planted failure, trains on, checkpoints and resumes with the same plan.

    bash tests/gpu/run_gpu.sh autopilot        # on the GPU machine (with the overhead measurement)
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from fp8_recipes.backends.te import BF16, FP8, te_available, what_ran

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not (torch.cuda.is_available() and te_available()),
                                                  reason="needs a CUDA GPU with Transformer Engine")]

ROOT = Path(__file__).resolve().parents[2]
HISTORY = 16
def delayed(history: int = HISTORY, gradients: str = "e4m3") -> dict:
    """Delayed scaling with one history length; E4M3 gradients (TE's E4M3 format, so E5M2 is a change)."""
    return {**{r: {"scaling": "delayed", "amax_history_len": history} for r in ("weights", "activations")},
            "gradients": {"scaling": "delayed", "amax_history_len": history, "format": gradients}}


DELAYED = delayed()
E5M2 = "decoder.layers.1.mlp.linear_fc1"      # gradients E4M3 -> E5M2: DelayedScaling(HYBRID), the same class
CURRENT = "decoder.layers.1.mlp.linear_fc2"   # activations to current scaling: a CustomRecipe
SHORT = "decoder.layers.2.mlp.linear_fc1"     # every role's history 16 -> 4
DEMOTED = "decoder.layers.2.mlp.linear_fc2"   # BF16
KEPT = "decoder.layers.3.mlp.linear_fc1"


def changed_recipe() -> dict:
    return {**DELAYED, "layers": {"bf16_modules": [DEMOTED]}, "modules": {
        E5M2: {"gradients": delayed(gradients="e5m2")["gradients"]},
        CURRENT: {"activations": "tensorwise"},
        SHORT: delayed(history=4)}}


class ReplanAt:
    """The TE controller, given a new plan before step `step` (as the autopilot does between steps); what each
    module held just before and just after the move is kept for the checks."""

    def __init__(self, inner, step: int, plan):
        self._inner, self.step, self.new_plan = inner, step, plan
        self.before: dict = {}
        self.after: dict = {}
        self.buffers_left = None

    def begin_step(self, step: int) -> str:
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager

        from fp8_recipes.backends.te_state import delayed_tensors

        if step != self.step:
            return self._inner.begin_step(step)
        snap = lambda: {n: {k: v.clone() for k, v in delayed_tensors(m).items()}  # noqa: E731
                        for n, m in self._inner.linears.items()}
        self.before = snap()
        self._inner.replan(self.new_plan)
        stage = self._inner.begin_step(step)  # the move happens here, before any forward of the new plan
        self.after = snap()
        self.buffers_left = dict(FP8GlobalStateManager.quantization_state.global_amax_buffer)
        return stage

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


def test_a_replanned_te_run_moves_each_changed_linear_to_its_new_recipe(megatron_gpu, tmp_path):
    import transformer_engine_torch as tex
    from transformer_engine.common.recipe import CustomRecipe, Format

    from fp8_recipes.backends.te_state import delayed_tensors
    from fp8_recipes.megatron.model import model_layout
    from fp8_recipes.plan.precision import Hardware, PrecisionPlan
    from fp8_recipes.recipe.schema import Recipe
    from test_te_training import build, run

    model, precision = build(DELAYED, megatron_gpu[2])
    at = ReplanAt(precision, 4, PrecisionPlan(Recipe.from_dict(changed_recipe()), model_layout(model),
                                              Hardware.detect()))
    summary = run(model, at, tmp_path, 7)  # steps 0-3 under delayed, 4-6 under the new plan
    assert summary["nonfinite_loss_steps"] == 0 and not precision.mismatches, precision.mismatches
    assert not at.buffers_left  # every module registers again, under its recipe now
    old, short = at.before[SHORT]["amax_history_fwd"], at.after[SHORT]["amax_history_fwd"]
    assert torch.equal(short, torch.cat([old[:1], old[-3:]])), "the newest amaxes kept"
    window = short[:, :2].amax(0)  # (divided as the code divides: fp8_max / amax, one rounding)
    assert torch.equal(at.after[SHORT]["scale_fwd"][:2], torch.full_like(window, 448.0) / window), "rescaled"
    assert delayed_tensors(precision.linears[SHORT])["amax_history_fwd"].shape[0] == 4

    fc1 = precision.linears[E5M2]
    assert fc1.fp8_meta["recipe"].fp8_format is Format.HYBRID
    assert fc1.quantizers["scaling_bwd"][0].dtype == tex.DType.kFloat8E5M2  # not TE's stale E4M3 quantizer
    bwd = delayed_tensors(fc1)  # updated under E5M2's range by TE's own reduction (its buffers re-registered)
    torch.testing.assert_close(bwd["scale_bwd"][0], 57344.0 / bwd["amax_history_bwd"][:, 0].amax(), rtol=1e-6,
                               atol=0)
    fc2 = precision.linears[CURRENT]
    assert isinstance(fc2.fp8_meta["recipe"], CustomRecipe) and what_ran(fc2) == FP8
    assert type(fc2.quantizers["scaling_fwd"][0]).__name__ == "Float8CurrentScalingQuantizer"
    assert type(fc2.quantizers["scaling_fwd"][1]).__name__ == "Float8Quantizer"  # the weight: still delayed
    weight = delayed_tensors(fc2)["amax_history_fwd"][:, 0]  # its only forward column now: the weight's
    assert torch.equal(weight[1:HISTORY - 3], at.before[CURRENT]["amax_history_fwd"][4:, 1]), "carried, rolled 3x"
    assert what_ran(precision.linears[DEMOTED]) == BF16
    kept = delayed_tensors(precision.linears[KEPT])["amax_history_fwd"]
    assert torch.equal(kept[1:HISTORY - 3], at.before[KEPT]["amax_history_fwd"][4:]), "untouched modules roll on"


def compose(overrides: list[str]):
    from test_te_training import compose as _compose

    return _compose(overrides)


PILOT = ["autopilot=on", "++autopilot.interval=2", "++autopilot.patience=2", "++autopilot.cooldown_steps=4"]
MARGIN = ["+recipe=delayed", "++recipe.gradients.format=e4m3", "++recipe.gradients.margin=16"]


def train(data_dir: Path, run_dir: Path, *extra: str, steps: int = 16) -> dict:
    from fp8_recipes.training.run import run_training

    return run_training(compose([
        *MARGIN, "model=tiny", "trainer=gpu", f"trainer.max_steps={steps}", "trainer.warmup_steps=2",
        "trainer.micro_batch_size=16", "trainer.global_batch_size=16", "trainer.lr=3e-3", "trainer.min_lr=3e-4",
        "trainer.eval_interval=0", "trainer.eval_iters=0", "data.tokenizer=bytes", f"data.path={data_dir}",
        f"run_dir={run_dir}", *extra]))


def test_the_autopilot_acts_on_te_and_a_resume_keeps_its_plan(tmp_path, monkeypatch):
    """E4M3 gradients with a margin of 16 under delayed scaling (a CustomRecipe on TE) underflow: the autopilot takes
    them to E5M2 on TE, the run trains on with every linear running what the plan says, and a resume from the
    checkpoint after the action replays it before the TE state loads (same shapes, same plan)."""
    from fp8_recipes.rundir import read_metrics, read_numerics

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(var, raising=False)
    data, first = tmp_path / "data", tmp_path / "run"
    summary = train(data, first, *PILOT, "trainer.save_checkpoints=true", "trainer.save_interval=8")
    assert summary["backend"] == "te" and summary["te_execution"]["plan_mismatches"] == 0, summary["te_execution"]
    actions = [r for r in read_metrics(first) if r.get("kind") == "autopilot"]
    # (a history shortened first, had the amax fallen fast at the first statistics steps, would be right too)
    e5m2 = next((a for a in actions if a["action"] == "to_e5m2"), None)
    assert e5m2 is not None, actions
    assert all(math.isfinite(r["loss"]) for r in read_metrics(first, "train"))
    after = [r for r in read_numerics(first) if r["role"] == "gradients" and r["step"] > e5m2["step"]
             and r["module"] != "output_layer"]
    assert after and all("e5m2" in r["policy"] for r in after if r["policy"] != "bf16"), after[:3]
    resumed = train(data, tmp_path / "resumed", *PILOT, f"trainer.resume={first / 'checkpoints' / 'step_8'}",
                    steps=12)
    assert resumed["te_execution"]["plan_mismatches"] == 0
    assert "resumed with" in (tmp_path / "resumed" / "plan.txt").read_text()


def test_a_skipped_step_leaves_no_amax_in_tes_histories(megatron_gpu, tmp_path):
    """An FP8-only fault at one step (one linear's input times inf): the engine skips the step, and TE's histories
    keep none of its amaxes (skip_step puts back the state the step found): every history and scale finite, one
    recorded row fewer than the steps run. Without it the inf would freeze that module's scales for a window."""
    from fp8_recipes.backends.te_state import delayed_tensors
    from test_te_training import build, recorded, run

    model, precision = build(DELAYED, megatron_gpu[2])
    calls = [0]

    def poison(module, args):
        if module.training:
            calls[0] += 1
            if calls[0] == 3:
                return (args[0] * float("inf"), *args[1:])
        return None

    precision.linears[E5M2].register_forward_pre_hook(poison)
    summary = run(model, precision, tmp_path, 6)
    assert summary["skipped_steps"] == 1, summary
    for name, module in precision.linears.items():
        tensors = delayed_tensors(module)
        assert all(bool(torch.isfinite(t).all()) for t in tensors.values()), name
        assert len(recorded(tensors["amax_history_fwd"])) == 5, (name, recorded(tensors["amax_history_fwd"]))
