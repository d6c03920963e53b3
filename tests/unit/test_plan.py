"""PrecisionPlan: per step, per module, per GEMM, per operand role, for every shipped recipe; stages and explain()."""

from __future__ import annotations

import dataclasses
import fnmatch

import pytest

from fp8_recipes.plan.precision import (
    GEMM_OPERANDS, Execution, Gemm, Hardware, ModelLayout, PrecisionPlan,
)
from fp8_recipes.plan.format import format_plan
from fp8_recipes.recipe.pack import load_recipe, recipe_names
from fp8_recipes.recipe.schema import Backend, LayerRules, Recipe, Role, Schedule

N = 6
LAYOUT = ModelLayout.gpt(N)
ROLES = (Role.WEIGHTS, Role.ACTIVATIONS, Role.GRADIENTS)
PACK = recipe_names()


def plan_for(recipe: Recipe | str, layout: ModelLayout = LAYOUT, hardware: Hardware | None = None) -> PrecisionPlan:
    return PrecisionPlan(load_recipe(recipe) if isinstance(recipe, str) else recipe, layout, hardware or Hardware())


def with_layers(recipe: Recipe, **kw) -> Recipe:
    return dataclasses.replace(recipe, layers=dataclasses.replace(recipe.layers, **kw))


def steps_to_check(recipe: Recipe) -> list[int]:
    edges = {0, 1, recipe.schedule.bf16_warmup_steps} | {recipe.schedule.role_start(r) for r in ROLES}
    return sorted({s + d for s in edges for d in (-1, 0, 1) if s + d >= 0} | {10_000})


# ---------------------------------------------------------------------------------------------------------------
# The layout


def test_gpt_layout():
    assert len(LAYOUT.module_names) == 4 * N + 1
    assert LAYOUT.module_names[-1] == "output_layer"
    assert ModelLayout.layer_of("decoder.layers.3.mlp.linear_fc1") == 3
    assert ModelLayout.layer_of("decoder.layers.12.self_attention.linear_qkv") == 12
    assert ModelLayout.layer_of("output_layer") is None
    assert "output_layer" not in ModelLayout.gpt(2, output_layer=False).module_names


# ---------------------------------------------------------------------------------------------------------------
# Every shipped recipe, every interesting step


@pytest.mark.parametrize("name", PACK)
def test_plan_every_gemm_of_every_module(name):
    recipe = load_recipe(name)
    plan = plan_for(recipe)
    rules, sched = recipe.layers, recipe.schedule
    for step in steps_to_check(recipe):
        sp = plan.at(step)
        assert sp.step == step
        expected_roles = {r for r in ROLES if recipe.policy(r).is_fp8 and step >= sched.role_start(r)}
        assert sp.roles_fp8 == expected_roles, step
        assert set(sp.modules) == set(LAYOUT.module_names)
        for mname, mp in sp.modules.items():
            layer = LAYOUT.layer_of(mname)
            kept_bf16 = (
                (layer is not None and (layer < rules.bf16_first or layer >= N - rules.bf16_last))
                or (layer is None and not rules.fp8_output_layer)
                or any(fnmatch.fnmatchcase(mname, pat) for pat in rules.bf16_modules)
            )
            assert (mp.bf16_reason is not None) == kept_bf16, (step, mname, mp.bf16_reason)
            assert mp.layer == layer
            assert list(mp.gemms) == [Gemm.FPROP, Gemm.DGRAD, Gemm.WGRAD]
            for gemm, gp in mp.gemms.items():
                assert tuple(r for r, _ in gp.operands) == GEMM_OPERANDS[gemm]
                for role, policy in gp.operands:
                    want = recipe.policy(role) if (role in expected_roles and not kept_bf16) else None
                    assert policy == want, (step, mname, gemm, role)
                    assert gp.policy(role) == want
                all_hp = all(p is None for _, p in gp.operands)
                assert gp.execution is (Execution.BF16 if all_hp else Execution.EMULATED)
            assert mp.any_fp8 is any(g.execution is not Execution.BF16 for g in mp.gemms.values())


def test_gemm_operands_are_the_documented_pairs():
    assert GEMM_OPERANDS == {
        Gemm.FPROP: (Role.ACTIVATIONS, Role.WEIGHTS),
        Gemm.DGRAD: (Role.GRADIENTS, Role.WEIGHTS),
        Gemm.WGRAD: (Role.GRADIENTS, Role.ACTIVATIONS),
    }


def test_hybrid_operand_policies():
    r = load_recipe("hybrid")
    g = plan_for(r).at(0).modules["decoder.layers.2.mlp.linear_fc1"].gemms
    assert g[Gemm.FPROP].operands == ((Role.ACTIVATIONS, r.activations), (Role.WEIGHTS, r.weights))
    assert g[Gemm.DGRAD].operands == ((Role.GRADIENTS, r.gradients), (Role.WEIGHTS, r.weights))
    assert g[Gemm.WGRAD].operands == ((Role.GRADIENTS, r.gradients), (Role.ACTIVATIONS, r.activations))


def test_safe_warmup_and_staged_enablement():
    r = load_recipe("safe")
    plan = plan_for(r)
    w, a, g = (r.schedule.role_start(x) for x in ROLES)
    assert r.schedule.bf16_warmup_steps == w == 100 and (a, g) == (200, 300)
    for step in (0, 1, 50, w - 1):
        sp = plan.at(step)
        assert sp.roles_fp8 == frozenset() and sp.stage == "bf16 warmup"
        assert not any(m.any_fp8 for m in sp.modules.values())
    mid = "decoder.layers.2.self_attention.linear_proj"
    ex = {s: {k: v.execution for k, v in plan.at(s).modules[mid].gemms.items()} for s in (w, a - 1, a, g - 1, g)}
    # weights only: fprop and dgrad have one FP8 operand, wgrad (gradients x activations) none
    assert ex[w] == ex[a - 1] == {Gemm.FPROP: Execution.EMULATED, Gemm.DGRAD: Execution.EMULATED,
                                  Gemm.WGRAD: Execution.BF16}
    assert ex[a] == ex[g - 1] == {Gemm.FPROP: Execution.EMULATED, Gemm.DGRAD: Execution.EMULATED,
                                  Gemm.WGRAD: Execution.EMULATED}
    assert plan.at(a - 1).modules[mid].gemms[Gemm.WGRAD].policy(Role.ACTIVATIONS) is None
    assert plan.at(a).modules[mid].gemms[Gemm.WGRAD].policy(Role.ACTIVATIONS) == r.activations
    assert plan.at(g - 1).modules[mid].gemms[Gemm.DGRAD].policy(Role.GRADIENTS) is None
    assert plan.at(g).modules[mid].gemms[Gemm.DGRAD].policy(Role.GRADIENTS) == r.gradients
    assert [plan.at(s).stage for s in (w - 1, w, a, g)] == ["bf16 warmup", "fp8 w", "fp8 w+a", "fp8 w+a+g"]


def test_enable_before_warmup_waits_for_warmup():
    r = Recipe.from_dict({"weights": "tensorwise", "gradients": "tensorwise",
                          "schedule": {"bf16_warmup_steps": 50, "enable": {"weights": 10, "gradients": 80}}})
    plan = plan_for(r)
    assert plan.at(49).roles_fp8 == frozenset() and plan.at(50).roles_fp8 == {Role.WEIGHTS}
    assert plan.at(79).roles_fp8 == {Role.WEIGHTS} and plan.at(80).roles_fp8 == {Role.WEIGHTS, Role.GRADIENTS}
    assert plan.stages() == [(0, 49, "bf16 warmup"), (50, 79, "fp8 w"), (80, None, "fp8 w+g")]


def test_staged_without_warmup_is_plain_bf16_label():
    r = Recipe.from_dict({"weights": "tensorwise", "schedule": {"enable": {"weights": 10}}})
    assert plan_for(r).at(0).stage == "bf16" and plan_for(r).at(10).stage == "fp8 w"


# ---------------------------------------------------------------------------------------------------------------
# Layers kept BF16


def test_first_and_last_layers_bf16_with_reason():
    r = with_layers(load_recipe("tensorwise"), bf16_first=2, bf16_last=1)
    sp = plan_for(r).at(0)
    for mname, mp in sp.modules.items():
        layer = mp.layer
        if layer is None:
            continue
        if layer < 2:
            assert mp.bf16_reason == "bf16_first: 2" and not mp.any_fp8, mname
        elif layer == N - 1:
            assert mp.bf16_reason == "bf16_last: 1" and not mp.any_fp8, mname
        else:
            assert mp.bf16_reason is None and all(g.execution is Execution.EMULATED for g in mp.gemms.values())


def test_bf16_module_patterns():
    r = with_layers(load_recipe("tensorwise"), bf16_modules=("*.linear_qkv", "decoder.layers.2.*"))
    plan = plan_for(r)
    sp = plan.at(0)
    for mname, mp in sp.modules.items():
        if mname.endswith(".linear_qkv"):
            assert mp.bf16_reason == "bf16_modules '*.linear_qkv'" and not mp.any_fp8
        elif mname.startswith("decoder.layers.2."):
            assert mp.bf16_reason == "bf16_modules 'decoder.layers.2.*'" and not mp.any_fp8
        elif mname == "output_layer":
            assert mp.bf16_reason == "LM head (fp8_output_layer: false)"
        else:
            assert mp.bf16_reason is None and mp.any_fp8, mname
    assert plan.unmatched_patterns == ()


def test_output_layer_bf16_unless_fp8_output_layer():
    tw = load_recipe("tensorwise")
    out = plan_for(tw).at(0).modules["output_layer"]
    assert out.bf16_reason == "LM head (fp8_output_layer: false)" and not out.any_fp8
    out = plan_for(with_layers(tw, fp8_output_layer=True)).at(0).modules["output_layer"]
    assert out.bf16_reason is None and out.any_fp8
    assert out.gemms[Gemm.FPROP].policy(Role.WEIGHTS) == tw.weights
    # safe keeps it BF16 by pattern even when a recipe built on it turns fp8_output_layer on
    safe = with_layers(load_recipe("safe"), fp8_output_layer=True)
    out = plan_for(safe).at(10_000).modules["output_layer"]
    assert out.bf16_reason == "bf16_modules 'output_layer'" and not out.any_fp8


def test_unmatched_pattern_reported_and_warned():
    r = with_layers(load_recipe("tensorwise"), bf16_modules=("*.linear_qkvv", "*.linear_proj", "decoder.layers.99.*"))
    plan = plan_for(r)
    assert plan.unmatched_patterns == ("*.linear_qkvv", "decoder.layers.99.*")
    text = format_plan(plan)
    assert "warning: layers.bf16_modules pattern '*.linear_qkvv' matches no module of this model" in text
    assert "warning: layers.bf16_modules pattern 'decoder.layers.99.*' matches no module of this model" in text
    assert "'*.linear_proj' matches" not in text


def test_a_recipe_whose_layer_rules_keep_every_gemm_bf16_is_warned():
    """safe on 2 layers: bf16_first=1 and bf16_last=1 cover both, the LM head is BF16 by pattern; the stages still
    say fp8, so the plan names the rules that leave nothing in FP8."""
    text = format_plan(plan_for("safe", ModelLayout.gpt(2)))
    assert ("warning: no GEMM of this model runs FP8, every linear layer stays BF16 (why BF16 above: "
            "recipe.layers.bf16_first=1, bf16_last=1, bf16_modules of 2 layers)") in text
    for fine in (plan_for("safe", ModelLayout.gpt(3)), plan_for("bf16", ModelLayout.gpt(2))):
        assert "no GEMM of this model runs FP8" not in format_plan(fine)


# ---------------------------------------------------------------------------------------------------------------
# Stages and explain()


def test_stages():
    assert plan_for("safe").stages() == [
        (0, 99, "bf16 warmup"), (100, 199, "fp8 w"), (200, 299, "fp8 w+a"), (300, None, "fp8 w+a+g")]
    assert plan_for("safe").stages(max_steps=250) == [
        (0, 99, "bf16 warmup"), (100, 199, "fp8 w"), (200, 249, "fp8 w+a")]
    assert plan_for("safe").stages(max_steps=50) == [(0, 49, "bf16 warmup")]
    assert plan_for("tensorwise").stages() == [(0, None, "fp8 w+a+g")]
    assert plan_for("tensorwise").stages(max_steps=10) == [(0, 9, "fp8 w+a+g")]
    assert plan_for("bf16").stages() == [(0, None, "bf16")]


@pytest.mark.parametrize("name", PACK)
def test_stage_labels_match_at(name):
    plan = plan_for(name)
    for first, last, label in plan.stages():
        assert plan.at(first).stage == label
        if last is not None:
            assert plan.at(last).stage == label and plan.at(last + 1).stage != label


def test_explain_safe():
    plan = plan_for("safe", ModelLayout.gpt(4))
    text = format_plan(plan)
    lines = text.splitlines()
    assert lines[0].startswith("recipe    safe: ")
    assert "backend   emulated (auto: CPU has no Transformer Engine FP8 backend)" in lines
    assert "hardware  CPU" in lines
    # the role table: policy and first FP8 step
    r = load_recipe("safe")
    for role, start in zip(ROLES, (100, 200, 300)):
        row = next(line for line in lines if line.split()[:1] == [str(role)])
        assert r.policy(role).describe() in row and row.split()[-1] == str(start)
    # the stages
    for span, label in (("0-99", "bf16 warmup"), ("100-199", "fp8 w"), ("200-299", "fp8 w+a"), ("300-", "fp8 w+a+g")):
        assert any(line.split()[:2] == ["steps", span] and line.endswith(label) for line in lines), span
    # the layer rows: layer 0 and 3 BF16 with their reason, 1-2 FP8 (emulated), the LM head by pattern
    rows = {line.split()[0]: line for line in lines if line.startswith("  ") and "(all linears)" in line}
    assert set(rows) == {"0", "1-2", "3"}
    assert rows["0"].split()[3:6] == ["bf16"] * 3 and rows["0"].endswith("bf16_first: 1")
    assert rows["1-2"].split()[3:6] == ["emulated"] * 3
    assert rows["3"].endswith("bf16_last: 1")
    assert any(line.split()[:2] == ["-", "output_layer"] and line.endswith("bf16_modules 'output_layer'")
               for line in lines)
    assert "warning" not in text


def test_explain_splits_a_layer_with_mixed_modules():
    r = with_layers(load_recipe("tensorwise"), bf16_modules=("*.linear_qkv",))
    lines = format_plan(plan_for(r, ModelLayout.gpt(3))).splitlines()
    qkv = [line for line in lines if "linear_qkv" in line and "bf16_modules" in line]
    assert len(qkv) == 1 and qkv[0].split()[0] == "0-2"  # layers grouped, modules listed one by one
    assert any("mlp.linear_fc1" in line and "emulated" in line for line in lines)


def test_explain_mentions_full_precision_eval():
    r = dataclasses.replace(load_recipe("tensorwise"), schedule=Schedule(full_precision_eval_interval=500))
    assert "full-precision evaluation every 500 steps" in format_plan(plan_for(r))
    assert "full-precision evaluation" not in format_plan(plan_for("tensorwise"))


@pytest.mark.parametrize("name", PACK)
def test_explain_every_recipe(name):
    text = format_plan(plan_for(name), max_steps=1000)
    assert f"recipe    {name}" in text and "stages" in text
    r = load_recipe(name)
    for role in ROLES:
        assert r.policy(role).describe() in text


# ---------------------------------------------------------------------------------------------------------------
# Backend resolution


def test_backend_te_on_cpu_is_a_one_line_error():
    r = dataclasses.replace(load_recipe("tensorwise"), backend=Backend.TE)
    with pytest.raises(ValueError) as e:
        PrecisionPlan(r, LAYOUT, Hardware())
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("backend: 'te'") and "emulated" in msg


def test_backend_te_on_fp8_gpu_without_te():
    # An H100 where Transformer Engine does not import (Hardware.detect() leaves te_version None); with TE,
    # test_plan_te.py covers what it runs.
    h100 = Hardware("cuda", (9, 0), None, "NVIDIA H100")
    assert not h100.has_fp8 and not h100.has_mxfp8
    r = dataclasses.replace(load_recipe("tensorwise"), backend=Backend.TE)
    with pytest.raises(ValueError, match=r"^backend: 'te' needs a CUDA GPU with FP8 \(sm_89\+\) and Transformer"):
        PrecisionPlan(r, LAYOUT, h100)
    plan = PrecisionPlan(load_recipe("tensorwise"), LAYOUT, h100)
    assert plan.backend is Backend.EMULATED and "H100" in plan.backend_reason


def test_backend_resolution():
    assert plan_for("tensorwise").backend is Backend.EMULATED
    emu = dataclasses.replace(load_recipe("mxfp8"), backend=Backend.EMULATED)
    assert plan_for(emu).backend is Backend.EMULATED and plan_for(emu).backend_reason == "requested"
    bf16_te = dataclasses.replace(load_recipe("bf16"), backend=Backend.TE)
    assert plan_for(bf16_te).backend is Backend.EMULATED  # nothing FP8 to run: no error
    h200 = Hardware("cuda", (9, 0), "2.20.2", "NVIDIA H200")
    on_te = PrecisionPlan(load_recipe("bf16"), LAYOUT, h200)  # a BF16 baseline in the FP8 runs' TE layers
    assert on_te.backend is Backend.TE and "BF16" in on_te.backend_reason
    assert all(m.te is None and not m.any_fp8 for m in on_te.at(0).modules.values())
    emu = PrecisionPlan(dataclasses.replace(load_recipe("bf16"), backend=Backend.EMULATED), LAYOUT, h200)
    assert emu.backend is Backend.EMULATED
    assert not any(m.any_fp8 for m in plan_for("bf16").at(0).modules.values())


def test_hardware_capabilities():
    assert not Hardware().has_te and not Hardware().has_fp8 and Hardware().describe() == "CPU"
    assert not Hardware("cuda", (8, 0), "2.20.2").has_fp8  # A100: no FP8 tensor cores
    assert Hardware("cuda", (8, 9), "2.20.2").has_fp8
    assert Hardware("cuda", (10, 0), "2.20.2").has_mxfp8
    assert not Hardware("cuda", (9, 0), None).has_fp8  # no TE
    assert Hardware("cuda", (9, 0), "2.20.2", "H200").describe() == "H200 (sm 9.0), Transformer Engine 2.20.2"


# ---------------------------------------------------------------------------------------------------------------
# Purity


@pytest.mark.parametrize("name", PACK)
def test_plan_is_pure(name):
    a, b = plan_for(name), plan_for(name)
    for step in steps_to_check(a.recipe):
        assert a.at(step) == b.at(step) == a.at(step)
    assert a.stages() == b.stages() and format_plan(a) == format_plan(b) == format_plan(a)
    assert a.at(3).step == 3 and a.at(4).step == 4  # the cached modules are shared, the step is not


def test_plan_does_not_depend_on_query_order():
    r = load_recipe("safe")
    fwd = [plan_for(r).at(s) for s in (0, 150, 250, 400)]
    p = plan_for(r)
    rev = [p.at(s) for s in (400, 250, 150, 0)][::-1]
    assert fwd == rev


def test_layer_rules_default_plan_is_all_fp8_but_lm_head():
    r = dataclasses.replace(load_recipe("mxfp8"), layers=LayerRules())
    sp = plan_for(r).at(0)
    assert [n for n, m in sp.modules.items() if not m.any_fp8] == ["output_layer"]


def test_parallel_layout_places_layers_as_megatron_core():
    """Megatron-Core's even split (tests/integration/test_parallel_cpu.py checks it against built models): chunk v of
    stage s holds the (v x pp + s)-th run of layers."""
    from fp8_recipes.plan.precision import ParallelLayout

    layout = ParallelLayout.parse("tp=2,pp=2,vpp=2,cp=2,dp=8")
    assert (layout.tp, layout.pp, layout.vpp, layout.cp, layout.dp, layout.gpus) == (2, 2, 2, 2, 8, 64)
    assert layout.chunk_layers(8) == {(0, 0): range(0, 2), (1, 0): range(2, 4), (0, 1): range(4, 6),
                                      (1, 1): range(6, 8)}
    assert ParallelLayout.parse("pp=4").chunk_layers(8)[(3, 0)] == range(6, 8)
    assert ParallelLayout.parse("pp=2,vpp=1").vpp is None
    assert ParallelLayout.parse("") == ParallelLayout.parse(" ") == ParallelLayout()  # (memory's default)
    assert ParallelLayout.parse(" tp=2 , pp=2 ") == ParallelLayout(tp=2, pp=2)
    assert ParallelLayout.parse("tp=2,ep=4,etp=1,dp=4").expert_dp == ParallelLayout.parse("ep=4,dp=8").expert_dp == 2
    for text, match in (("tp=2,xp=4", r"'xp' is not one of tp, pp, vpp, cp, dp, ep, etp"), ("pp=0", r"'pp=0'.* >= 1"),
                        ("pp=x", r"'pp=x'"), ("tp=2,tp=4", r"^--layout: tp is given twice \(tp=2, tp=4\); give each "
                                                           r"size once$"),
                        ("tp=2,,pp=2", r"^--layout: 'tp=2,,pp=2' has an empty part; write KEY=N parts separated"),
                        ("tp=2,", "empty part"), (",", "empty part")):
        with pytest.raises(ValueError, match=match):
            ParallelLayout.parse(text)
    with pytest.raises(ValueError, match=r"8 layers do not split evenly over pp x vpp = 3 chunks"):
        ParallelLayout.parse("pp=3").check(8)
    with pytest.raises(ValueError, match=r"vpp needs pp >= 2"):
        ParallelLayout(vpp=2).check(8)


def test_explain_shows_which_stage_runs_which_layers():
    from fp8_recipes.plan.precision import ParallelLayout

    plan = PrecisionPlan(load_recipe("safe"), ModelLayout.gpt(4))
    text = format_plan(plan, parallel=ParallelLayout(pp=2, dp=4))
    assert "pipeline stages (tp=1, pp=2, cp=1, dp=4: 8 GPUs; layer numbers are global)" in text
    assert "  stage 0          layers 0-1      0 bf16, 1 emulated  + embedding" in text
    assert "  stage 1          layers 2-3      2 emulated, 3 bf16  + LM head bf16" in text
    assert "pipeline stages" not in format_plan(plan)  # one stage: nothing to add
    assert "parallel layout" not in format_plan(plan, parallel=ParallelLayout(tp=2))  # (a run's plan.txt at PP=1)
    text = format_plan(plan, parallel=ParallelLayout(tp=2, cp=2, dp=8), show_layout=True)  # explain --layout
    assert "\nparallel layout (tp=2, pp=1, cp=2, dp=8: 32 GPUs; one pipeline stage)\n  stage 0          layers 0-3" in text
