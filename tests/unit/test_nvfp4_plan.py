"""NVFP4 roles in the plan, without TE: emulated per GEMM beside FP8 roles anywhere; on a simulated H200 (sm_90) the
emulated backend under ``auto`` and a one-line refusal under ``te``; on a simulated B200 (sm_100) TE's
NVFP4BlockScaling with its three switches derived from the policies, and the mixes it cannot run."""

from __future__ import annotations

import pytest

from fp8_recipes.plan.format import format_plan
from fp8_recipes.plan.precision import Execution, Gemm, Hardware, ModelLayout, PrecisionPlan
from fp8_recipes.plan.te import TERecipeKind
from fp8_recipes.recipe.schema import Backend, Recipe, Role, Scaling

H200 = Hardware("cuda", (9, 0), "2.20.2", "NVIDIA H200")
B200 = Hardware("cuda", (10, 0), "2.20.2", "NVIDIA B200")
LAYOUT = ModelLayout.gpt(4)
W, A, G = Role.WEIGHTS, Role.ACTIVATIONS, Role.GRADIENTS
PAPER = {"weights": {"scaling": "nvfp4", "block": [16, 16]}, "activations": {"scaling": "nvfp4", "rht": True},
         "gradients": {"scaling": "nvfp4", "rht": True, "stochastic_rounding": True}}


def plan_for(recipe: dict, hardware: Hardware = Hardware()) -> PrecisionPlan:
    return PrecisionPlan(Recipe.from_dict({"name": "t", **recipe}), LAYOUT, hardware)


def test_any_mix_of_nvfp4_and_fp8_roles_runs_emulated_per_gemm():
    plan = plan_for({"weights": "nvfp4", "activations": "blockwise", "gradients": "tensorwise"})
    assert plan.backend is Backend.EMULATED
    mp = plan.at(0).modules["decoder.layers.1.mlp.linear_fc1"]
    assert {g.execution for g in mp.gemms.values()} == {Execution.EMULATED}
    assert mp.gemms[Gemm.FPROP].policy(W).scaling is Scaling.NVFP4
    assert mp.gemms[Gemm.FPROP].policy(A).scaling is Scaling.BLOCKWISE
    assert mp.gemms[Gemm.WGRAD].policy(G).scaling is Scaling.TENSORWISE
    text = format_plan(plan)
    assert "weights      nvfp4 e2m1 1x16" in text and "note: nvfp4 operands are emulated" in text


def test_the_wgrad_rht_is_on_both_operands_or_neither():
    staged = plan_for({**PAPER, "schedule": {"enable": {"gradients": 10}}})
    name = "decoder.layers.0.self_attention.linear_qkv"
    early, late = staged.at(0).modules[name].gemms[Gemm.WGRAD], staged.at(10).modules[name].gemms[Gemm.WGRAD]
    assert early.policy(G) is None and early.policy(A).rht is False  # gradients still BF16: no rotation
    assert late.policy(A).rht and late.policy(G).rht
    assert staged.at(0).modules[name].gemms[Gemm.FPROP].policy(A).rht  # (rowwise copies are never rotated)
    own = plan_for({**PAPER, "modules": {"*linear_fc2": {"gradients": "tensorwise"}}})
    wgrad = own.at(0).modules["decoder.layers.0.mlp.linear_fc2"].gemms[Gemm.WGRAD]
    assert wgrad.policy(A).rht is False and wgrad.policy(G).scaling is Scaling.TENSORWISE


def test_hopper_has_no_nvfp4_auto_emulates_and_te_refuses_in_one_line():
    plan = plan_for(PAPER, H200)
    assert plan.backend is Backend.EMULATED and plan.te is None
    assert "nvfp4" in plan.backend_reason and "NVFP4" in plan.backend_reason and "sm_100" in plan.backend_reason
    assert "\n" not in plan.backend_reason
    with pytest.raises(ValueError) as e:
        plan_for({**PAPER, "backend": "te"}, H200)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("weights.scaling: 'nvfp4': ") and "sm_100" in msg
    assert "NVIDIA H200 is sm_90" in msg and "set backend: emulated" in msg


@pytest.mark.parametrize("weights_block,rht,sr", [((16, 16), True, True), ((1, 16), False, True),
                                                  ((16, 16), True, False), ((1, 16), False, False)])
def test_blackwell_runs_nvfp4_block_scaling_with_the_policies_switches(weights_block, rht, sr):
    recipe = {"weights": {"scaling": "nvfp4", "block": list(weights_block)},
              "activations": {"scaling": "nvfp4", "rht": rht},
              "gradients": {"scaling": "nvfp4", "rht": rht, "stochastic_rounding": sr}}
    for backend in ("auto", "te"):
        plan = plan_for({**recipe, "backend": backend}, B200)
        assert plan.backend is Backend.TE and plan.substitutions == ()
        te = plan.at(0).modules["decoder.layers.2.mlp.linear_fc2"].te
        assert te.recipe is TERecipeKind.NVFP4 and not te.forward_only
        assert te.nvfp4_switches() == {"disable_rht": not rht, "disable_stochastic_rounding": not sr,
                                       "disable_2d_quantization": weights_block == (1, 16)}
        assert f"TE: NVFP4BlockScaling(disable_rht={not rht}, " in format_plan(plan)


def test_blackwell_nvfp4_forward_only_while_gradients_stay_bf16():
    plan = plan_for({"weights": "nvfp4", "activations": "nvfp4"}, B200)
    te = plan.at(0).modules["decoder.layers.0.mlp.linear_fc1"].te
    assert te.recipe is TERecipeKind.NVFP4 and te.forward_only
    assert te.describe().endswith("disable_2d_quantization=True, backward_override=high_precision)")


@pytest.mark.parametrize("recipe,key", [
    ({**PAPER, "weights": "blockwise"}, "weights.scaling: 'blockwise' beside activations+gradients nvfp4"),
    ({**PAPER, "gradients": "tensorwise", "activations": "nvfp4"}, "gradients.scaling: 'tensorwise' beside"),
    ({**PAPER, "modules": {"*linear_qkv": {"weights": "mxfp8"}}}, "modules.*linear_qkv: weights.scaling: 'mxfp8'"),
])
def test_blackwell_mixes_te_cannot_run_emulate_under_auto_and_are_refused_under_te(recipe, key):
    plan = plan_for(recipe, B200)
    assert plan.backend is Backend.EMULATED and key in plan.backend_reason
    assert "NVFP4BlockScaling quantizes every role in NVFP4" in plan.backend_reason
    with pytest.raises(ValueError) as e:
        plan_for({**recipe, "backend": "te"}, B200)
    assert "\n" not in str(e.value) and str(e.value).startswith(key) and "backend: emulated" in str(e.value)
