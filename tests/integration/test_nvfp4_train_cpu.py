"""NVFP4 on the CPU end to end: the tiny model trained a few steps through ``run_training`` with an all-NVFP4 recipe
(the paper's: 16x16 weights, RHT on the wgrad operands, stochastic rounding of gradients) and with NVFP4 beside
FP8 roles: finite, falling loss, and the plan executed (each NVFP4 operand quantized as the plan says)."""

from __future__ import annotations

import importlib

import pytest
from omegaconf import OmegaConf

from fp8_recipes.plan.format import format_plan
from fp8_recipes.plan.precision import ModelLayout, PrecisionPlan
from fp8_recipes.recipe.schema import Recipe
from fp8_recipes.rundir import read_metrics
from test_train_cpu import assert_learns, compose_train, dataset, small_run  # noqa: F401  (the shared dataset)

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

quantize_module = importlib.import_module("fp8_recipes.numerics.quantize")  # (the package exports its function)
STEPS = 8
PAPER = ["+recipe.weights.block=[16,16]", "+recipe.activations.rht=true", "+recipe.gradients.rht=true",
         "+recipe.gradients.stochastic_rounding=true"]
ROLES = ("weights", "activations", "gradients")
# (block, columnwise, rht, stochastic rounding) of each NVFP4 copy the emulated GEMMs make, per recipe
ALL_NVFP4 = {((16, 16), False, False, False),  # weights: fprop (the dgrad copy is the same values: reused)
             ((1, 16), False, False, False), ((1, 16), True, True, False),  # activations: fprop, wgrad (RHT)
             ((1, 16), False, False, True), ((1, 16), True, True, True)}  # gradients: dgrad, wgrad (RHT, SR)
MIXED = {((1, 16), False, False, False), ((1, 16), True, False, False)}  # NVFP4 weights: fprop, dgrad


@pytest.mark.parametrize("roles,copies", [
    ({r: "nvfp4" for r in ROLES} | {"extra": PAPER}, ALL_NVFP4),
    ({"weights": "nvfp4", "activations": "blockwise", "gradients": "tensorwise"}, MIXED),
], ids=["all-nvfp4", "nvfp4-weights-fp8-rest"])
def test_train_nvfp4(roles, copies, dataset, tmp_path, monkeypatch):  # noqa: F811 (the dataset fixture)
    from fp8_recipes.training.run import run_training

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(var, raising=False)
    seen = set()

    def recording(real):
        def quantizer(x, **kw):
            seen.add((kw["block"], kw["columnwise"], kw["rht"] and kw["columnwise"], kw["stochastic_rounding"]))
            return real(x, **kw)
        return quantizer

    # (training makes its copies with fake_quant_nvfp4; statistics steps, none here, with quantize_nvfp4)
    for name in ("quantize_nvfp4", "fake_quant_nvfp4"):
        monkeypatch.setattr(quantize_module, name, recording(getattr(quantize_module, name)))
    overrides = ["+recipe=bf16", "recipe.name=nvfp4_test", "+recipe.backend=emulated"]
    overrides += [f"+recipe.{r}.scaling={roles[r]}" for r in ROLES] + roles.get("extra", [])
    cfg = compose_train(overrides + dataset + small_run(tmp_path, 2, STEPS))
    summary = run_training(cfg)

    losses = [r["loss"] for r in read_metrics(tmp_path, "train")]
    assert len(losses) == STEPS and summary["nonfinite_loss_steps"] == 0
    assert_learns(losses)
    assert seen == copies
    recipe = Recipe.from_dict(OmegaConf.to_container(cfg.recipe, resolve=True))
    assert recipe.weights.describe().startswith("nvfp4 e2m1")
    plan_txt = (tmp_path / "plan.txt").read_text()
    assert plan_txt == format_plan(PrecisionPlan(recipe, ModelLayout.gpt(2)), max_steps=STEPS) + "\n"
    assert "emulated" in plan_txt and "note: nvfp4 operands are emulated" in plan_txt
