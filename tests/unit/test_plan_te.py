"""The plan for the Transformer Engine backend, on a simulated H200 (sm_90) and B200 (sm_100), without TE: what
every shipped recipe becomes, per stage and per GEMM; each TE rule; and the one-line refusal of `backend: te`."""

from __future__ import annotations

import dataclasses

import pytest

from fp8_recipes.plan.precision import Execution, Gemm, Hardware, ModelLayout, PrecisionPlan
from fp8_recipes.plan.format import format_plan
from fp8_recipes.plan.te import TERecipe, TERecipeKind, resolve_te, te_recipe_for
from fp8_recipes.recipe.pack import load_recipe, recipe_names
from fp8_recipes.recipe.schema import Backend, Format, Recipe, Role, Scaling, TensorPolicy

H200 = Hardware("cuda", (9, 0), "2.20.2", "NVIDIA H200")
B200 = Hardware("cuda", (10, 0), "2.20.2", "NVIDIA B200")
ADA = Hardware("cuda", (8, 9), "2.20.2", "NVIDIA L40S")
N = 4
LAYOUT = ModelLayout.gpt(N)
W, A, G = Role.WEIGHTS, Role.ACTIVATIONS, Role.GRADIENTS
ALL = frozenset((W, A, G))
BLOCK_1D = TensorPolicy(scaling=Scaling.BLOCKWISE, block=(1, 128), pow2_scales=True)
BLOCK_2D = TensorPolicy(scaling=Scaling.BLOCKWISE, block=(128, 128), pow2_scales=True)

# recipe -> (TE recipe of the FP8 layers once every role is on, its fp8_format, substituted keys)
EXPECTED = {
    "H200": {
        "blockwise": ("Float8BlockScaling", "E4M3", ()),
        "moe_blockwise": ("Float8BlockScaling", "E4M3", ()),
        "delayed": ("DelayedScaling", "HYBRID", ()),
        "moe_delayed": ("DelayedScaling", "HYBRID", ()),  # (a dense model: its experts' pattern matches nothing)
        "fast": ("DelayedScaling", "HYBRID", ()),
        "hybrid": ("Float8BlockScaling", "HYBRID", ("weights.scaling", "gradients.scaling")),
        "mxfp8": ("Float8BlockScaling", "E4M3", ("weights.scaling", "activations.scaling", "gradients.scaling")),
        "safe": ("Float8CurrentScaling", "HYBRID", ()),
        "tensorwise": ("Float8CurrentScaling", "HYBRID", ()),
    },
    "B200": {
        "nvfp4": ("NVFP4BlockScaling", "E4M3", ()),
        "blockwise": ("Float8BlockScaling", "E4M3", ()),
        "moe_blockwise": ("Float8BlockScaling", "E4M3", ()),
        "delayed": ("DelayedScaling", "HYBRID", ()),
        "moe_delayed": ("DelayedScaling", "HYBRID", ()),  # (a dense model: its experts' pattern matches nothing)
        "fast": ("DelayedScaling", "HYBRID", ()),
        "hybrid": ("MXFP8BlockScaling", "HYBRID", ("activations.scaling", "gradients.scaling")),
        "mxfp8": ("MXFP8BlockScaling", "E4M3", ()),
        "safe": ("Float8CurrentScaling", "HYBRID", ()),
        "tensorwise": ("Float8CurrentScaling", "HYBRID", ()),
    },
}
HARDWARE = {"H200": H200, "B200": B200}
EMULATED = {"H200": {"nvfp4": "weights.scaling: 'nvfp4': Transformer Engine's NVFP4 GEMMs need sm_100 (Blackwell)"}}
"""Recipes whose plan runs the emulated backend on that GPU under ``auto``, and the reason's words."""


def plan_for(recipe: Recipe | str | dict, hardware: Hardware = H200, layout: ModelLayout = LAYOUT) -> PrecisionPlan:
    if isinstance(recipe, str):
        recipe = load_recipe(recipe)
    elif isinstance(recipe, dict):
        recipe = Recipe.from_dict(recipe)
    return PrecisionPlan(recipe, layout, hardware)


def final(plan: PrecisionPlan):
    return plan.at(10**6)


# ---------------------------------------------------------------------------------------------------------------
# Every shipped recipe on each GPU


def test_the_expectations_cover_the_pack():
    for gpu in HARDWARE:
        assert set(EXPECTED[gpu]) | set(EMULATED.get(gpu, ())) == set(recipe_names()) - {"bf16"}
        assert not set(EXPECTED[gpu]) & set(EMULATED.get(gpu, ()))


@pytest.mark.parametrize("gpu,name", [(gpu, name) for gpu in HARDWARE for name in sorted(EMULATED.get(gpu, ()))])
def test_recipes_te_cannot_run_here_run_emulated_with_the_reason(gpu, name):
    plan = plan_for(name, HARDWARE[gpu])
    assert plan.backend is Backend.EMULATED and plan.te is None
    assert EMULATED[gpu][name] in plan.backend_reason and "\n" not in plan.backend_reason
    assert {g.execution for m in final(plan).modules.values() for g in m.gemms.values()} <= {Execution.EMULATED,
                                                                                             Execution.BF16}


@pytest.mark.parametrize("gpu,name", [(gpu, name) for gpu in HARDWARE for name in sorted(EXPECTED[gpu])])
def test_every_recipe_every_module_every_gemm(gpu, name):
    recipe_cls, fmt, subs = EXPECTED[gpu][name]
    plan = plan_for(name, HARDWARE[gpu])
    assert plan.backend is Backend.TE, plan.backend_reason
    assert tuple(s.key for s in plan.substitutions) == subs
    sp = final(plan)
    for mname, mp in sp.modules.items():
        if mp.bf16_reason is not None:  # first/last layer, pattern or LM head: BF16 and no TE recipe
            assert mp.te is None and all(g.execution is Execution.BF16 for g in mp.gemms.values()), mname
            assert all(p is None for g in mp.gemms.values() for _, p in g.operands)
            continue
        te = mp.te
        assert (te.recipe, te.fp8_format, te.forward_only) == (recipe_cls, fmt, False), mname
        for gemm, gp in mp.gemms.items():
            assert gp.execution is Execution.FP8, (mname, gemm)
            for role, policy in gp.operands:  # the operands show what TE really quantizes with
                assert policy == te.policy(role) == plan.te.policies[role]
                assert policy.is_fp8
    assert f"TE: {next(m.te for m in sp.modules.values() if m.te).describe()}" in format_plan(plan)
    assert plan_for(name, HARDWARE[gpu]).at(3) == plan.at(3)  # pure


def test_bf16_runs_te_layers_without_fp8():
    for hw in (H200, B200):  # the FP8 runs' TE layers, every GEMM BF16: a baseline that differs from them by FP8
        plan = plan_for("bf16", hw)
        assert plan.backend is Backend.TE and plan.substitutions == ()
        assert all(m.te is None and not m.any_fp8 for m in plan.at(0).modules.values())


@pytest.mark.parametrize("name", ["tensorwise", "delayed", "blockwise", "safe"])
def test_backend_te_runs_the_exact_recipes(name):
    for hw in (H200, B200):
        r = dataclasses.replace(load_recipe(name), backend=Backend.TE)
        plan = PrecisionPlan(r, LAYOUT, hw)
        assert plan.backend is Backend.TE and plan.backend_reason == "requested" and plan.substitutions == ()


@pytest.mark.parametrize("name,hw,key,value", [("hybrid", H200, "weights.scaling", "mxfp8"),
                                                ("mxfp8", H200, "weights.scaling", "mxfp8"),
                                                ("hybrid", B200, "activations.scaling", "blockwise")])
def test_backend_te_refuses_in_one_line(name, hw, key, value):
    r = dataclasses.replace(load_recipe(name), backend=Backend.TE)
    with pytest.raises(ValueError) as e:
        PrecisionPlan(r, LAYOUT, hw)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{key}: {value!r} cannot run on Transformer Engine as asked")
    assert "backend: auto" in msg and "backend: emulated" in msg
    if hw is H200:
        assert "MXFP8 needs sm_100; NVIDIA H200 is sm_90" in msg


def test_hybrid_on_h200_says_what_it_became():
    plan = plan_for("hybrid")
    assert plan.backend_reason == "auto: FP8 GPU with Transformer Engine; 2 settings substituted, see below"
    assert plan.te.policies == {W: BLOCK_2D, A: BLOCK_1D, G: dataclasses.replace(BLOCK_1D, format=Format.E5M2)}
    text = format_plan(plan)
    assert "Transformer Engine runs the nearest legal recipe on NVIDIA H200 (sm_90):" in text
    assert ("weights.scaling          mxfp8 e4m3 1x32 e8m0/rceil -> blockwise e4m3 128x128 pow2 "
            "(MXFP8 needs sm_100; NVIDIA H200 is sm_90)") in text
    assert ("gradients.scaling        tensorwise e5m2 -> blockwise e5m2 1x128 pow2 "
            "(one TE GEMM cannot mix per-tensor with block scaling)") in text
    assert "TE: Float8BlockScaling(fp8_format=HYBRID, x 1x128, w 128x128, grad 1x128)" in text


# ---------------------------------------------------------------------------------------------------------------
# Stages


def test_safe_stages_on_te():
    plan = plan_for("safe")
    mid = "decoder.layers.1.mlp.linear_fc1"
    for step in (0, 99, 100, 199):  # BF16 warmup, then weights alone: no GEMM has two FP8 operands
        mp = plan.at(step).modules[mid]
        assert mp.te is None and not mp.any_fp8, step
    assert "with weights alone every GEMM has a BF16 operand" in plan.at(150).note
    fwd = plan.at(200).modules[mid]  # weights + activations: forward-only FP8
    assert fwd.te.forward_only and fwd.te.recipe == "Float8CurrentScaling"
    assert [g.execution for g in fwd.gemms.values()] == [Execution.FP8, Execution.BF16, Execution.BF16]
    assert fwd.gemms[Gemm.DGRAD].operands == ((G, None), (W, None))
    assert plan.at(250).note.startswith("forward only")
    full = plan.at(300).modules[mid]
    assert not full.te.forward_only and all(g.execution is Execution.FP8 for g in full.gemms.values())
    assert dataclasses.replace(fwd.te, forward_only=False) == full.te  # same recipe object family: only the override
    assert plan.at(300).note == ""
    text = format_plan(plan)
    assert "TE: Float8CurrentScaling(fp8_format=HYBRID, backward_override=high_precision)" in text
    for layer in (0, N - 1):  # first/last layer BF16 at every stage
        assert all(m.te is None for n, m in plan.at(300).modules.items() if m.layer == layer)


def staged(scaling: str, **grad) -> dict:
    return {"weights": scaling, "activations": scaling, "gradients": {"scaling": scaling, **grad},
            "schedule": {"bf16_warmup_steps": 2, "enable": {"weights": 2, "activations": 4, "gradients": 6}}}


def test_delayed_with_a_forward_only_stage_keeps_one_carrier():
    plan = plan_for(staged("delayed"))
    assert plan.te.custom_delayed and any("CustomRecipe(DelayedScalingRequest)" in n for n in plan.te.notes)
    fwd, full = (plan.at(s).modules["decoder.layers.1.mlp.linear_fc2"].te for s in (4, 6))
    assert (fwd.recipe, fwd.forward_only, full.recipe, full.forward_only) == (
        "CustomRecipe", True, "CustomRecipe", False)
    assert fwd.delayed and full.delayed
    plain = plan_for("delayed")
    assert not plain.te.custom_delayed and final(plain).modules["decoder.layers.1.mlp.linear_fc2"].te.recipe == \
        "DelayedScaling"


def test_stage_with_weights_and_gradients_only_is_bf16():
    r = {"weights": "tensorwise", "activations": "tensorwise", "gradients": "tensorwise",
         "schedule": {"enable": {"weights": 0, "gradients": 0, "activations": 10}}}
    plan = plan_for(r)
    mp = plan.at(5).modules["decoder.layers.1.mlp.linear_fc1"]
    assert plan.at(5).roles_fp8 == {W, G} and mp.te is None and not mp.any_fp8
    assert "TE runs no FP8 backward under a BF16 forward" in plan.at(5).note


def test_gradients_never_fp8_runs_forward_only():
    plan = plan_for({"weights": "tensorwise", "activations": "tensorwise"})
    te = final(plan).modules["decoder.layers.0.self_attention.linear_qkv"].te
    assert te.forward_only and te.recipe == "Float8CurrentScaling" and plan.substitutions == ()


# ---------------------------------------------------------------------------------------------------------------
# The rules, one by one


def subs(recipe: dict, hw: Hardware = H200) -> dict[str, tuple[str, str]]:
    res = resolve_te(Recipe.from_dict(recipe), hw.compute_capability, hw.name)
    assert res.unsupported is None, res.unsupported
    return {s.key: (s.before, s.after) for s in res.substitutions}


def test_margin_only_on_delayed():
    assert subs({"weights": "tensorwise", "activations": {"scaling": "tensorwise", "margin": 2},
                 "gradients": "tensorwise"}) == {"activations.margin": ("tensorwise e4m3 margin 2", "tensorwise e4m3")}
    assert subs({"weights": {"scaling": "delayed", "margin": 2}, "activations": {"scaling": "delayed", "margin": 2},
                 "gradients": "delayed"}) == {}


def test_block_shapes_te_has():
    out = subs({"weights": {"scaling": "blockwise", "block": [64, 64]},
                "activations": {"scaling": "blockwise", "block": [1, 32]}, "gradients": "blockwise"})
    assert out == {"weights.block": ("blockwise e4m3 64x64 pow2", "blockwise e4m3 128x128 pow2"),
                   "activations.block": ("blockwise e4m3 1x32 pow2", "blockwise e4m3 1x128 pow2")}


def test_one_2d_block_role_at_most():
    out = subs({"weights": "blockwise", "activations": {"scaling": "blockwise", "block": [128, 128]},
                "gradients": "blockwise"})
    assert out == {"activations.block": ("blockwise e4m3 128x128 pow2", "blockwise e4m3 1x128 pow2")}
    te = te_recipe_for(resolve_te(Recipe.from_dict({"weights": {"scaling": "blockwise", "block": [1, 128]},
                                                    "activations": "blockwise", "gradients": "blockwise"}),
                                  (9, 0)), ALL)
    assert te.recipe == "Float8BlockScaling" and "w 1x128" in te.describe()


def test_mx_floor_rounding_becomes_rceil_on_b200():
    assert subs({"weights": {"scaling": "mxfp8", "mx_rounding": "floor"}, "activations": "mxfp8",
                 "gradients": "mxfp8"}, B200) == {"weights.mx_rounding": ("mxfp8 e4m3 1x32 e8m0/floor",
                                                                          "mxfp8 e4m3 1x32 e8m0/rceil")}


def test_no_mxfp8_on_sm120_and_no_blocks_before_hopper():
    sm120 = Hardware("cuda", (12, 0), "2.20.2", "RTX PRO 6000")
    assert set(subs({"weights": "mxfp8", "activations": "mxfp8", "gradients": "mxfp8"}, sm120)) == {
        "weights.scaling", "activations.scaling", "gradients.scaling"}
    out = subs({"weights": "blockwise", "activations": "blockwise", "gradients": "blockwise"}, ADA)
    assert out["weights.scaling"] == ("blockwise e4m3 128x128 pow2", "tensorwise e4m3")
    assert final(plan_for("blockwise", ADA)).modules["decoder.layers.1.mlp.linear_fc1"].te.recipe == \
        "Float8CurrentScaling"


def test_per_tensor_family_mixes_run_as_a_custom_recipe():
    r = {"weights": "delayed", "activations": "delayed", "gradients": "tensorwise"}
    assert subs(r) == {}
    te = final(plan_for(r)).modules["decoder.layers.1.mlp.linear_fc1"].te
    assert te.recipe == "CustomRecipe" and te.delayed and "gradients: tensorwise e5m2" in te.describe()
    r = {"weights": "tensorwise", "activations": {"scaling": "tensorwise", "format": "e5m2"},
         "gradients": {"scaling": "tensorwise", "format": "e4m3"}}  # E5M2 activations: one quantizer per role
    assert subs(r) == {} and final(plan_for(r)).modules["decoder.layers.1.mlp.linear_fc1"].te.recipe == "CustomRecipe"


def test_delayed_forward_roles_share_one_state():
    out = subs({"weights": "delayed", "activations": {"scaling": "delayed", "amax_history_len": 16},
                "gradients": "delayed"})
    assert out == {"activations.amax_history_len": ("delayed e4m3 hist 16 max", "delayed e4m3 hist 1024 max")}
    # the gradients have their own state: different settings there are fine
    r = {"weights": "delayed", "activations": "delayed", "gradients": {"scaling": "delayed", "margin": 1}}
    assert subs(r) == {} and final(plan_for(r)).modules["decoder.layers.1.mlp.linear_fc1"].te.recipe == "CustomRecipe"


def test_percentile_and_pow2_delayed_run_on_te():
    r = {"weights": {"scaling": "delayed", "amax_compute_algo": "percentile", "percentile": 99.0, "pow2_scales": True},
         "activations": {"scaling": "delayed", "amax_compute_algo": "percentile", "percentile": 99.0,
                         "pow2_scales": True},
         "gradients": {"scaling": "delayed", "amax_compute_algo": "percentile", "percentile": 99.0,
                       "pow2_scales": True}}
    te = final(plan_for(r)).modules["decoder.layers.1.mlp.linear_fc1"].te
    assert subs(r) == {} and te.recipe == "DelayedScaling"
    assert "amax_compute_algo=percentile 99 (callable)" in te.describe() and "pow2 scales (callable)" in te.describe()


def test_nothing_sensible_on_te_falls_back_to_emulated():
    for r, key in (({"weights": "tensorwise", "gradients": "tensorwise"}, "activations.scaling: 'none'"),
                   ({"weights": {"scaling": "tensorwise", "format": "e5m2"},
                     "activations": {"scaling": "tensorwise", "format": "e5m2"}}, "activations.format: 'e5m2'")):
        plan = plan_for(r)
        assert plan.backend is Backend.EMULATED and plan.te is None
        assert plan.backend_reason.startswith("auto: the emulated backend runs the whole model as asked, because")
        assert key in plan.backend_reason
        with pytest.raises(ValueError) as e:
            plan_for({**r, "backend": "te"})
        assert str(e.value).startswith(key) and "\n" not in str(e.value) and "backend: emulated" in str(e.value)


def test_fp8_output_layer_runs_fp8_on_te():
    """The LM head runs the stage's TE recipe when fp8_output_layer is on (a te.Linear: megatron/te_layers.py),
    with nothing substituted; off (the default) or kept by a pattern, it stays BF16 with the reason named."""
    r = {"weights": "tensorwise", "activations": "tensorwise", "gradients": "tensorwise",
         "layers": {"fp8_output_layer": True}}
    plan = plan_for(r)
    assert plan.substitutions == ()
    out, layer = final(plan).modules["output_layer"], final(plan).modules["decoder.layers.1.mlp.linear_fc1"]
    assert out.te is not None and out.te == layer.te and out.bf16_reason is None and out.any_fp8
    assert plan_for({**r, "backend": "te"}).te is not None  # asked for TE explicitly: runs, no refusal
    off = final(plan_for({**r, "layers": {}})).modules["output_layer"]
    assert off.te is None and off.bf16_reason == "LM head (fp8_output_layer: false)"
    kept = final(plan_for({**r, "layers": {"fp8_output_layer": True, "bf16_modules": ["output_layer"]}}))
    assert kept.modules["output_layer"].te is None
    assert kept.modules["output_layer"].bf16_reason == "bf16_modules 'output_layer'"


def test_bf16_module_patterns_on_te():
    plan = plan_for({"weights": "tensorwise", "activations": "tensorwise", "gradients": "tensorwise",
                     "layers": {"bf16_modules": ["*.linear_qkv"]}})
    for name, mp in final(plan).modules.items():
        if name.endswith("linear_qkv") or name == "output_layer":
            assert mp.te is None and not mp.any_fp8
        else:
            assert mp.te is not None and mp.any_fp8


# ---------------------------------------------------------------------------------------------------------------
# Hardware and the backend's presence


def test_te_needs_fp8_hardware_and_te():
    plan = plan_for("tensorwise", Hardware("cuda", (9, 0), None, "NVIDIA H200"))
    assert plan.backend is Backend.EMULATED and plan.te is None
    with pytest.raises(ValueError, match=r"^backend: 'te' needs a CUDA GPU with FP8"):
        plan_for({"weights": "tensorwise", "activations": "tensorwise", "backend": "te"},
                 Hardware("cuda", (8, 0), "2.20.2", "A100"))
    assert H200.sm == "sm_90" and B200.sm == "sm_100" and Hardware().sm == "no GPU"


def test_the_te_backend_ships_and_imports_without_te():
    from fp8_recipes.backends import te

    assert te.te_available() is False  # no Transformer Engine on the CPU machines, by design


def test_te_recipe_fp8_format_and_describe():
    pol = TensorPolicy(scaling=Scaling.TENSORWISE)
    e5 = dataclasses.replace(pol, format=Format.E5M2)
    assert TERecipe("Float8CurrentScaling", pol, pol, e5).fp8_format == "HYBRID"
    assert TERecipe("Float8CurrentScaling", pol, pol, pol).fp8_format == "E4M3"
    assert TERecipe("Float8CurrentScaling", pol, pol, TensorPolicy()).fp8_format == "HYBRID"
    both = TERecipe("Float8CurrentScaling", dataclasses.replace(pol, pow2_scales=True), pol, e5, forward_only=True)
    assert both.describe() == ("Float8CurrentScaling(fp8_format=HYBRID, weights pow2, "
                               "backward_override=high_precision)")


def test_te_recipe_kind_is_the_te_class_name():
    pol = TensorPolicy(scaling=Scaling.TENSORWISE)
    assert TERecipe("Float8CurrentScaling", pol, pol, pol).recipe is TERecipeKind.CURRENT  # a name is taken too
    assert [str(k) for k in TERecipeKind] == ["DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling",
                                              "MXFP8BlockScaling", "NVFP4BlockScaling", "CustomRecipe"]
    with pytest.raises(ValueError, match="Float8CurentScaling"):
        TERecipe("Float8CurentScaling", pol, pol, pol)


# ---------------------------------------------------------------------------------------------------------------
# attention: fp8 (TE's FP8 dot-product attention, fp8_dpa)


def attention_recipe(scaling: str, **extra) -> dict:
    return {"weights": scaling, "activations": scaling, "gradients": scaling, "attention": "fp8", **extra}


def test_fp8_attention_on_te_follows_what_te_runs():
    # H200, delayed: the FP8 layers' recipe carries fp8_dpa; BF16 layers (bf16_first) keep BF16 attention
    plan = plan_for(attention_recipe("delayed", layers={"bf16_first": 1}))
    sp = final(plan)
    assert plan.substitutions == () and sp.attention == frozenset(range(1, LAYOUT.num_layers))
    assert sp.modules["decoder.layers.1.mlp.linear_fc1"].te.fp8_dpa
    assert sp.modules["decoder.layers.0.mlp.linear_fc1"].te is None
    assert "fp8_dpa=True" in sp.modules["decoder.layers.1.self_attention.linear_qkv"].te.describe()
    # H200, tensorwise: TE has no current-scaled FP8 attention before sm_100: BF16 attention, said once; refused
    # (one line) when backend: te asks for exactly this recipe; on a B200 it runs
    plan = plan_for(attention_recipe("tensorwise"))
    assert [s.key for s in plan.substitutions] == ["attention"] and final(plan).attention == frozenset()
    assert "before sm_100; this GPU is sm_90" in plan.substitutions[0].reason
    assert not any(m.te is not None and m.te.fp8_dpa for m in final(plan).modules.values())
    with pytest.raises(ValueError, match=r"^attention: 'fp8' cannot run on Transformer Engine as asked") as e:
        plan_for(attention_recipe("tensorwise", backend="te"))
    assert "\n" not in str(e.value)
    b200 = plan_for(attention_recipe("tensorwise"), B200)
    assert b200.substitutions == () and final(b200).modules["decoder.layers.0.mlp.linear_fc1"].te.fp8_dpa
    # a per-role mix runs as a CustomRecipe: TE's attention does not run FP8 under it
    mix = plan_for({"weights": "delayed", "activations": "tensorwise", "gradients": "tensorwise",
                    "attention": "fp8"}, B200)
    assert [s.key for s in mix.substitutions] == ["attention"] and "not CustomRecipe" in mix.substitutions[0].reason


def test_fp8_attention_waits_for_activations_and_gradients():
    staged = {"schedule": {"bf16_warmup_steps": 2, "enable": {"weights": 2, "activations": 4, "gradients": 6}}}
    for scaling, hardware in (("delayed", Hardware()), ("tensorwise", B200)):  # emulated, and TE where it runs
        plan = plan_for(attention_recipe(scaling, **staged), hardware)
        assert [bool(plan.at(s).attention) for s in range(8)] == [False] * 6 + [True] * 2
        assert "core attention (softmax(Q K^T) V): fp8 in layers 0-" in format_plan(plan)
    # staged delayed scaling runs TE's CustomRecipe (one history across the forward-only stage): BF16 attention
    plan = plan_for(attention_recipe("delayed", **staged), H200)
    assert final(plan).attention == frozenset() and "not CustomRecipe" in plan.substitutions[-1].reason
    assert "core attention (softmax(Q K^T) V): bf16 (attention: fp8 cannot run here" in format_plan(plan)
    assert "core attention" not in format_plan(plan_for("delayed"))  # nothing printed unless asked for


# ---------------------------------------------------------------------------------------------------------------
# fp8_param: true (FP8 primary weights)


def fp8_param_recipe(scaling: str, **extra) -> dict:
    return {"weights": scaling, "activations": scaling, "gradients": scaling, "fp8_param": True, **extra}


@pytest.mark.parametrize("scaling, te_class", [("delayed", "DelayedScaling"), ("tensorwise", "Float8CurrentScaling"),
                                               ("blockwise", "Float8BlockScaling")])
def test_fp8_param_layers_are_the_fp8_layers(scaling, te_class):
    plan = plan_for(fp8_param_recipe(scaling, layers={"bf16_first": 1, "bf16_last": 1}))
    layers = plan.fp8_param_layers()
    assert plan.fp8_param_problem() is None and sorted(layers) == [1, 2]
    # each layer's weights are quantized under the TE recipe its linears run under (one object per TERecipe)
    sp = final(plan)
    assert all(te == sp.modules[f"decoder.layers.{i}.mlp.linear_fc1"].te and te.recipe == te_class
               for i, te in layers.items())
    line = next(x for x in format_plan(plan).splitlines() if "fp8_param" in x)
    assert f"fp8 in layers 1-2 (TE {te_class} tensors" in line and "bf16: layers 0, 3, LM head, embeddings" in line
    assert "fp8_param" not in format_plan(plan_for(scaling)) and plan_for(scaling).fp8_param_layers() == {}


def test_fp8_param_with_fp8_attention_uses_the_layers_recipe():
    plan = plan_for(fp8_param_recipe("delayed", attention="fp8"))
    assert all(te.fp8_dpa for te in plan.fp8_param_layers().values())


@pytest.mark.parametrize("recipe, hardware, says", [
    (fp8_param_recipe("tensorwise"), Hardware(), "needs the te backend"),
    (fp8_param_recipe("tensorwise", backend="emulated"), H200, "runs the emulated backend (requested)"),
    ({**fp8_param_recipe("tensorwise"), "weights": "delayed"}, H200, "run CustomRecipe here"),
    ({**fp8_param_recipe("blockwise"), "weights": {"scaling": "blockwise", "block": [1, 128]}}, H200,
     "weights.block [1, 128]"),
    (fp8_param_recipe("tensorwise", layers={"bf16_modules": ["*.linear_fc2"]}), H200,
     "keeps decoder.layers.0.mlp.linear_fc2 BF16 inside FP8 layer 0"),
])
def test_fp8_param_refusals_are_one_line_naming_the_key(recipe, hardware, says):
    plan = plan_for(recipe, hardware)
    problem = plan.fp8_param_problem()
    assert problem.startswith("fp8_param: true") and says in problem and "\n" not in problem
    assert problem.endswith("fp8_param: false") and plan.fp8_param_layers() == {}
    assert f"weights stored (fp8_param): refused: {problem}" in format_plan(plan)


def test_fp8_param_whole_layer_patterns_and_all_bf16_layers_are_fine():
    plan = plan_for(fp8_param_recipe("tensorwise", layers={"bf16_modules": ["decoder.layers.2.*"]}))
    assert plan.fp8_param_problem() is None and sorted(plan.fp8_param_layers()) == [0, 1, 3]
    none = plan_for(fp8_param_recipe("tensorwise", layers={"bf16_first": N}))
    assert none.fp8_param_problem() is None and none.fp8_param_layers() == {}
    assert "weights stored (fp8_param): bf16 everywhere" in format_plan(none)


def test_training_refuses_fp8_param_in_one_line_before_anything_is_built():
    import types

    from fp8_recipes.training.run import check_fp8_param

    trainer = types.SimpleNamespace(use_distributed_optimizer=True, params_dtype="bf16")
    check_fp8_param(trainer, plan_for(fp8_param_recipe("tensorwise")))  # runs
    check_fp8_param(types.SimpleNamespace(), plan_for("tensorwise"))  # not asked: nothing checked
    for plan, tcfg, starts in (
            (plan_for(fp8_param_recipe("tensorwise"), Hardware()), trainer, "recipe.fp8_param: true needs the te"),
            (plan_for(fp8_param_recipe("tensorwise")), types.SimpleNamespace(**{**vars(trainer),
                                                                              "use_distributed_optimizer": False}),
             "trainer.use_distributed_optimizer=false: recipe fp8_param: true needs"),
            (plan_for(fp8_param_recipe("tensorwise")), types.SimpleNamespace(**{**vars(trainer), "params_dtype": "fp32"}),
             "trainer.params_dtype=fp32: recipe fp8_param: true")):
        with pytest.raises(ValueError) as e:
            check_fp8_param(tcfg, plan)
        assert str(e.value).startswith(starts) and "\n" not in str(e.value)


@pytest.mark.parametrize("reduction", ["none", "data"])
def test_sequence_parallel_delayed_scaling_needs_the_tensor_parallel_ranks_in_the_amax_group(reduction):
    """TE gathers sequence-parallel FP8 tensors assuming one delayed scale on every TP rank: none (TE's assertion at
    the first FP8 forward) and data (silently wrong) are refused before anything is built."""
    import types

    from fp8_recipes.training.run import check_sequence_parallel_amax

    sp = types.SimpleNamespace(sequence_parallel=True)
    plan = plan_for({**load_recipe("delayed").to_dict(), "amax_reduction": reduction})
    with pytest.raises(ValueError) as e:
        check_sequence_parallel_amax(sp, plan)
    assert str(e.value).startswith(f"recipe.amax_reduction: {reduction} with delayed scaling") and "\n" not in str(e.value)
    check_sequence_parallel_amax(types.SimpleNamespace(sequence_parallel=False), plan)  # no SP: each rank its own
    for fine in ("data_tensor", "tensor"):
        check_sequence_parallel_amax(sp, plan_for({**load_recipe("delayed").to_dict(), "amax_reduction": fine}))
    check_sequence_parallel_amax(sp, plan_for({**load_recipe("tensorwise").to_dict(), "amax_reduction": reduction}))
    check_sequence_parallel_amax(sp, plan_for({**load_recipe("delayed").to_dict(), "amax_reduction": reduction},
                                              Hardware()))  # the emulated backend (refuses SP itself)


def test_recompute_that_would_not_replay_the_forwards_fp8_is_refused_on_te():
    """Megatron-Core recomputes through tensor_parallel.checkpoint here (no fp8 in its config): full recompute under
    delayed scaling and selective recompute of FP8 attention are refused; stateless recipes recompute exactly."""
    import types

    from fp8_recipes.training.run import check_recompute

    full, selective = (types.SimpleNamespace(recompute_granularity=g) for g in ("full", "selective"))
    with pytest.raises(ValueError, match=r"^trainer\.recompute_granularity=full with delayed scaling"):
        check_recompute(full, plan_for("delayed"))
    check_recompute(selective, plan_for("delayed"))  # BF16 attention: nothing FP8 is recomputed
    check_recompute(full, plan_for("tensorwise"))
    check_recompute(full, plan_for("delayed", Hardware()))  # the emulated backend
    check_recompute(types.SimpleNamespace(recompute_granularity=None), plan_for("delayed"))
    fp8_attention = plan_for({**load_recipe("delayed").to_dict(), "attention": "fp8"})
    with pytest.raises(ValueError, match=r"^trainer\.recompute_granularity=selective with recipe attention: fp8"):
        check_recompute(selective, fp8_attention)


TINY = {"num_layers": N, "hidden_size": 128, "ffn_hidden_size": 512, "num_attention_heads": 4, "num_query_groups": 2,
        "seq_length": 128, "vocab_size": 4096, "activation": "swiglu"}


def shape_trainer(mbs=2, tp=1, cp=1, sp=False, max_steps=1000):
    import types

    return types.SimpleNamespace(micro_batch_size=mbs, tensor_model_parallel_size=tp, context_parallel_size=cp,
                                 sequence_parallel=sp, max_steps=max_steps)


def test_linear_shapes_are_megatron_cores_per_rank_shapes():
    from fp8_recipes.megatron.model_config import linear_shapes

    llama = {**TINY, "hidden_size": 4096, "ffn_hidden_size": 14336, "num_attention_heads": 32, "num_query_groups": 8,
             "seq_length": 4096, "vocab_size": 128256}
    # (rows the layer receives, rows its GEMMs multiply, in_features, out_features)
    assert linear_shapes(llama, micro_batch=2) == {
        "self_attention.linear_qkv": (8192, 8192, 4096, 6144), "self_attention.linear_proj": (8192, 8192, 4096, 4096),
        "mlp.linear_fc1": (8192, 8192, 4096, 28672), "mlp.linear_fc2": (8192, 8192, 14336, 4096),
        "output_layer": (8192, 8192, 4096, 128256)}
    # TP=2 with SP, CP=2: columns' outputs and rows' inputs halved, the sequence halved by CP, and again into the
    # column-parallel layers by SP (all-gathered for their GEMMs); the vocabulary padded to 128 x TP
    assert linear_shapes({**llama, "vocab_size": 50257, "activation": "gelu"}, micro_batch=1, tensor_parallel=2,
                         context_parallel=2, sequence_parallel=True) == {
        "self_attention.linear_qkv": (1024, 2048, 4096, 3072), "self_attention.linear_proj": (2048, 2048, 2048, 4096),
        "mlp.linear_fc1": (1024, 2048, 4096, 7168), "mlp.linear_fc2": (2048, 2048, 7168, 4096),
        "output_layer": (1024, 2048, 4096, 25216)}


def test_fp8_shapes_te_would_refuse_are_refused_before_anything_is_built():
    """TE and cuBLAS check FP8 GEMM shapes only at the first FP8 forward and backward, after any BF16 warmup: refused
    up front on TE, a warning on the emulated backend, silent where the module stays BF16 or the run ends before
    FP8 (tests/gpu/test_te_shapes.py holds the rule against TE itself)."""
    from fp8_recipes.plan.te import te_fp8_shape_problem
    from fp8_recipes.training.run import check_fp8_shapes

    assert te_fp8_shape_problem(72, 512, 504) == ("out_features 504 is not a multiple of 16, "
                                                  "tokens 72 is not a multiple of 16")
    assert te_fp8_shape_problem(72, 512, 504, frozenset({"fprop"})) is None  # forward-only: multiples of 8 will do
    assert te_fp8_shape_problem(36, 500, 512, frozenset({"fprop"})) == ("in_features 500 is not a multiple of 16, "
                                                                        "tokens 36 is not a multiple of 8")
    # sequence parallelism: the forward checks the rank's slice, wgrad sums over the all-gathered tokens
    assert te_fp8_shape_problem(24, 512, 512, gemm_rows=48) is None
    assert te_fp8_shape_problem(20, 512, 512, gemm_rows=40) == ("tokens 20 is not a multiple of 8, "
                                                                "gathered tokens 40 is not a multiple of 16")
    assert check_fp8_shapes(shape_trainer(), TINY, plan_for("delayed")) is None
    assert check_fp8_shapes(shape_trainer(), {**TINY, "vocab_size": None}, plan_for("delayed")) is None  # (null)
    assert check_fp8_shapes(shape_trainer(tp=2, sp=True, cp=2), TINY, plan_for("tensorwise")) is None
    odd_ffn = {**TINY, "ffn_hidden_size": 504}  # linear_fc2's in_features (linear_fc1's 2 x 504 outputs are fine)
    with pytest.raises(ValueError, match=r"^model: Transformer Engine runs decoder\.layers\.0\.mlp\.linear_fc2 in FP8 "
                                         r"only .*: in_features 504 is not a multiple of 16 .*features: model\.hidden_"
                                         r"size and ffn_hidden_size\); .*bf16_modules: \['\*mlp\.linear_fc2'\]$"):
        check_fp8_shapes(shape_trainer(), odd_ffn, plan_for("delayed"))
    kept = {**load_recipe("delayed").to_dict(), "layers": {"bf16_modules": ["*mlp.linear_fc2"]}}
    assert check_fp8_shapes(shape_trainer(), odd_ffn, plan_for(kept)) is None  # the fix the line names
    safe = plan_for("safe")  # first and last layers BF16: the first FP8 module is layer 1's
    with pytest.raises(ValueError, match=r"decoder\.layers\.1\.mlp\.linear_fc2"):
        check_fp8_shapes(shape_trainer(), odd_ffn, safe)
    assert check_fp8_shapes(shape_trainer(max_steps=100), odd_ffn, safe) is None  # BF16 warmup to the end
    warning = check_fp8_shapes(shape_trainer(), odd_ffn, plan_for("delayed", Hardware()))  # emulated
    assert warning.startswith("on Transformer Engine this run would stop at its first FP8 step: model: ")
    assert "504" in warning
    assert check_fp8_shapes(shape_trainer(), odd_ffn, plan_for("bf16", Hardware())) is None
    # tokens: wgrad sums over them (multiples of 16); a forward-only stage needs multiples of 8
    short = {**TINY, "seq_length": 72}
    with pytest.raises(ValueError, match=r"linear_qkv .*: tokens 72 is not a multiple of 16 \(tokens: trainer\.micro_"
                                         r"batch_size x model\.seq_length; features: .* at trainer\.tensor_model_par"):
        check_fp8_shapes(shape_trainer(mbs=1, tp=2), short, plan_for("tensorwise"))
    forward_only = {**load_recipe("tensorwise").to_dict(), "gradients": {"scaling": "none"}}
    assert check_fp8_shapes(shape_trainer(mbs=1, tp=2), short, plan_for(forward_only)) is None
    # ...and so does the emulated backend's warning (TE's stages, not the emulated GEMMs with one FP8 operand)
    assert check_fp8_shapes(shape_trainer(mbs=1), short, plan_for(forward_only, Hardware())) is None
    weights_only = {**load_recipe("tensorwise").to_dict(), "activations": {"scaling": "none"},
                    "gradients": {"scaling": "none"}}  # TE runs no GEMM of it in FP8
    assert check_fp8_shapes(shape_trainer(mbs=1), odd_ffn, plan_for(weights_only, Hardware())) is None
    # sequence parallelism at TP=2: 48 tokens give linear_qkv 24 (gathered 48 for wgrad): fine; 36 give it 18
    assert check_fp8_shapes(shape_trainer(mbs=1, tp=2, sp=True), {**TINY, "seq_length": 48},
                            plan_for("tensorwise")) is None
    with pytest.raises(ValueError, match=r"linear_qkv .*: tokens 18 is not a multiple of 8, gathered tokens 36 is not "
                                         r"a multiple of 16 \(tokens: trainer\.micro_batch_size x model\.seq_length / "
                                         r"trainer\.tensor_model_parallel_size;"):
        check_fp8_shapes(shape_trainer(mbs=1, tp=2, sp=True), {**TINY, "seq_length": 36}, plan_for("tensorwise"))
