"""The FP8 GEMM shapes Transformer Engine runs, beside the rule the run checks before anything is built
(plan.te.te_fp8_shape_problem, used by training/run.py's check_fp8_shapes): a te.Linear under each recipe kind the
plan builds, forward and backward, runs exactly when the rule finds no problem with the GEMMs the plan runs in FP8.

Found on the H200 (2026-12-02): TE's forward assertion (rows and out_features multiples of 8, in_features of 16) is
not all; the first FP8 backward fails in cuBLAS unless out_features (dgrad) and the tokens (wgrad) are multiples of
16 as well. A forward-only stage (gradients BF16) needs only the forward's."""

from __future__ import annotations

import pytest
import torch

from fp8_recipes.backends.te import te_available

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not (torch.cuda.is_available() and te_available()),
                                                  reason="needs a CUDA GPU with Transformer Engine")]

# (tokens, in_features, out_features): aligned, then each dimension off by 8 or 4 in turn
SHAPES = [(64, 512, 512), (36, 512, 512), (72, 512, 512), (200, 512, 512), (64, 500, 512), (64, 520, 512),
          (128, 528, 512), (64, 512, 500), (64, 512, 504), (128, 512, 520), (1024, 4096, 3072)]
RECIPES = {"delayed": "delayed", "tensorwise": "tensorwise", "blockwise": "blockwise",
           "forward-only": {"name": "fwd", "weights": {"scaling": "tensorwise"},
                            "activations": {"scaling": "tensorwise"}, "gradients": {"scaling": "none"}}}


def _module_plan(recipe):
    from fp8_recipes.plan.precision import Hardware, ModelLayout, PrecisionPlan
    from fp8_recipes.recipe.pack import load_recipe
    from fp8_recipes.recipe.schema import Recipe

    recipe = load_recipe(recipe) if isinstance(recipe, str) else Recipe.from_dict(recipe)
    plan = PrecisionPlan(recipe, ModelLayout.gpt(1), Hardware.detect())
    return plan.at(plan.final_step()).modules["decoder.layers.0.mlp.linear_fc2"]


@pytest.mark.parametrize("name", list(RECIPES))
def test_te_runs_exactly_the_shapes_the_rule_allows(name):
    import transformer_engine.pytorch as te

    from fp8_recipes.backends.te import te_recipe
    from fp8_recipes.plan.precision import Execution
    from fp8_recipes.plan.te import te_fp8_shape_problem

    module = _module_plan(RECIPES[name])
    gemms = frozenset(str(g) for g, p in module.gemms.items() if p.execution is not Execution.BF16)
    assert "fprop" in gemms and (gemms == {"fprop"}) == (name == "forward-only"), gemms
    disagree = []
    for rows, fin, fout in SHAPES:
        torch.manual_seed(0)
        linear = te.Linear(fin, fout, bias=False, params_dtype=torch.bfloat16, device="cuda")
        x = torch.randn(rows, fin, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        try:
            with te.autocast(enabled=True, recipe=te_recipe(module.te)):
                y = linear(x)
            y.float().square().mean().backward()
            torch.cuda.synchronize()
            ran = None
        except (ValueError, RuntimeError) as e:  # TE's forward assertion, cuBLAS's in the backward
            ran = str(e).splitlines()[0][:120]
        rule = te_fp8_shape_problem(rows, fin, fout, gemms)
        if (ran is None) != (rule is None):
            disagree.append(((rows, fin, fout), ran, rule))
    assert not disagree, disagree
