"""Mixture-of-Experts in the plan (issue 28): the model config's MoE keys, the layout's expert and router names, the
plan's per-expert rows and bf16_modules patterns on experts, and the printed table (experts collapsed, router BF16)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fp8_recipes.checks import ConfigError
from fp8_recipes.megatron.model_config import (
    check_model_cfg, check_model_device, layout_of, linear_shapes, model_notices, moe_layer_pattern,
)
from fp8_recipes.plan.format import format_plan
from fp8_recipes.plan.precision import ROUTER_REASON, Execution, Gemm, ModelLayout, MoEShape, PrecisionPlan
from fp8_recipes.recipe.pack import load_recipe, load_recipe_dict
from fp8_recipes.recipe.schema import Recipe, Role, Scaling

DENSE = {"num_layers": 4, "hidden_size": 128, "num_attention_heads": 4, "seq_length": 128, "vocab_size": 4096,
         "ffn_hidden_size": 512, "activation": "swiglu"}
MOE = {**DENSE, "num_moe_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 256,
       "moe_shared_expert_intermediate_size": 128}


def test_moe_layer_pattern_reads_moe_layer_freq_as_megatron_core_does():
    assert moe_layer_pattern(DENSE) == ()
    assert moe_layer_pattern(MOE) == (0, 1, 2, 3)
    assert moe_layer_pattern({**MOE, "moe_layer_freq": 2}) == (0, 2)
    assert moe_layer_pattern({**MOE, "moe_layer_freq": [0, 1, 1, 0]}) == (1, 2)
    with pytest.raises(ConfigError, match=r"^model\.moe_layer_freq=\[1, 0\]: give an integer"):
        moe_layer_pattern({**MOE, "moe_layer_freq": [1, 0]})


@pytest.mark.parametrize("change, says", [
    ({"num_moe_experts": 0}, r"^model\.num_moe_experts=0: must be an integer >= 1"),
    ({"moe_router_topk": 5}, r"^model\.moe_router_topk=5 is more than model\.num_moe_experts=4"),
    ({"moe_router_topk": 1}, r"^model\.moe_router_topk=1: .*zero gradient"),
    ({"moe_router_load_balancing_type": "aux"}, r"^model\.moe_router_load_balancing_type='aux': choose one of"),
    ({"moe_router_dtype": "bf16"}, r"^model\.moe_router_dtype='bf16': choose one of null \| fp32 \| fp64"),
    ({"moe_token_dispatcher_type": "a2a"}, r"^model\.moe_token_dispatcher_type='a2a': choose one of"),
    ({"moe_z_loss_coeff": -0.1}, r"^model\.moe_z_loss_coeff=-0\.1: must be a number >= 0"),
    ({"moe_permute_fusion": "yes"}, r"^model\.moe_permute_fusion='yes': must be true or false"),
    ({"moe_router_padding_for_quantization": True}, r"^model\.moe_router_padding_for_quantization=true: .*allgather"),
    ({"moe_layer_freq": [0, 0, 0, 0]}, r"^model\.moe_layer_freq: every layer is 0"),
    ({"moe_router_fusion": 1}, r"^model\.moe_router_fusion=1: must be true or false"),
    ({"moe_router_fusion": True, "moe_router_padding_for_quantization": True, "moe_token_dispatcher_type": "alltoall"},
     r"^model\.moe_router_fusion=true with model\.moe_router_padding_for_quantization=true: .*set one of them false$"),
    ({"moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True,
      "moe_router_padding_for_quantization": True, "moe_token_dispatcher_type": "alltoall"},
     r"^model\.moe_router_padding_for_quantization=true with model\.moe_pad_expert_input_to_capacity=true: .*"
     r"set the router padding false$"),
    ({"moe_expert_count": 4}, r"^model\.moe_expert_count: unknown key"),
])
def test_moe_keys_are_checked_one_line_each(change, says):
    with pytest.raises(ConfigError, match=says):
        check_model_cfg({**MOE, **change})


def test_moe_widths_must_split_over_tensor_parallel_ranks():
    check_model_cfg(MOE, tensor_parallel=2)
    with pytest.raises(ConfigError, match=r"^model\.moe_shared_expert_intermediate_size=130 is not divisible by "
                                          r"trainer\.tensor_model_parallel_size=4"):
        check_model_cfg({**MOE, "moe_shared_expert_intermediate_size": 130}, tensor_parallel=4)


def test_gpu_only_moe_keys_are_refused_on_the_cpu_and_idle_ones_warned():
    for key, value in (("moe_token_dispatcher_type", "alltoall"), ("moe_token_dispatcher_type", "flex"),
                       ("moe_permute_fusion", True), ("moe_router_fusion", True)):
        with pytest.raises(ConfigError, match=rf"^model\.{key}=.*(needs a GPU|GPU only)"):
            check_model_device({**MOE, key: value}, "cpu")
        check_model_device({**MOE, key: value}, "cuda")
    check_model_device({**DENSE, "moe_permute_fusion": True}, "cpu")  # (a dense model: no MoE layer to run it)
    assert model_notices(MOE, device="cpu") == []
    [line] = model_notices({**DENSE, "moe_router_topk": 4}, device="cpu")
    assert line.startswith("model.moe_router_topk=4 does nothing: model.num_moe_experts is null")
    [line] = model_notices({**MOE, "moe_grouped_gemm": True}, device="cpu")
    assert line.startswith("model.moe_grouped_gemm=true does nothing on the CPU")
    assert model_notices({**MOE, "moe_grouped_gemm": True}, device="cuda") == []
    # (a hostile-input sweep: Megatron-Core's get_aux_loss_coeff is 0 under balancing type none)
    [line] = model_notices({**MOE, "moe_router_load_balancing_type": "none", "moe_aux_loss_coeff": 0.5}, device="cpu")
    assert line.startswith("model.moe_aux_loss_coeff=0.5 does nothing with model.moe_router_load_balancing_type=none")
    assert model_notices({**MOE, "moe_router_load_balancing_type": "none", "moe_aux_loss_coeff": 0}, device="cpu") == []


def test_moe_keys_of_a_dense_model_are_named_in_one_line_and_the_expert_width_said():
    """A dense model named only the first idle MoE key; an MoE model without moe_ffn_hidden_size got Megatron-Core's
    raw two-line UserWarning on stderr: the width is set to its default (moe_config_fields) and said in one line."""
    from fp8_recipes.megatron.model_config import moe_config_fields

    idle = {k: v for k, v in MOE.items() if k not in DENSE and k != "num_moe_experts"}
    [line] = model_notices({**DENSE, **idle}, device="cpu")
    assert line.startswith("model.moe_router_topk=2 (and moe_ffn_hidden_size, moe_shared_expert_intermediate_size) "
                           "does nothing: model.num_moe_experts is null"), line
    unset = {k: v for k, v in MOE.items() if k != "moe_ffn_hidden_size"}
    [line] = model_notices(unset, device="cpu")
    assert line == ("model.moe_ffn_hidden_size is not set: each expert's FFN takes the dense width, 512 "
                    "(Megatron-Core's default); set model.moe_ffn_hidden_size to choose")
    assert moe_config_fields(unset)["moe_ffn_hidden_size"] == 512
    assert moe_config_fields({**unset, "ffn_hidden_size": 384})["moe_ffn_hidden_size"] == 384
    assert "moe_ffn_hidden_size" not in moe_config_fields({"num_moe_experts": 4})  # (apply_moe: no dense shape)


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_router_padding_on_the_cpu_says_to_drop_it(dispatcher):
    """On the CPU no dispatcher pads: the fix is to drop the padding, never a dispatcher the CPU then refuses (was:
    'set alltoall', which check_model_device sent back to allgather)."""
    cfg = {**MOE, "moe_router_padding_for_quantization": True, "moe_token_dispatcher_type": dispatcher}
    with pytest.raises(ConfigError, match=r"^model\.moe_router_padding_for_quantization=true: router padding cannot "
                                          r"run on the CPU .*drop model\.moe_router_padding_for_quantization"):
        check_model_device(cfg, "cpu")
    check_model_cfg(cfg, device=None)  # (training: the device is not known yet; check_model_device says it)
    if dispatcher == "allgather":
        with pytest.raises(ConfigError, match=r"set model\.moe_token_dispatcher_type=alltoall"):
            check_model_device(cfg, "cuda")
    else:
        check_model_device(cfg, "cuda")


def test_layout_names_every_expert_shared_expert_and_router():
    layout = layout_of({**MOE, "moe_layer_freq": [0, 1, 0, 1]})
    assert layout == ModelLayout.gpt(4, moe=MoEShape(4, (1, 3), shared_experts=True)) and layout.experts == 4
    assert layout.routers == ("decoder.layers.1.mlp.router", "decoder.layers.3.mlp.router")
    layer1 = [n for n in layout.module_names if ModelLayout.layer_of(n) == 1]
    assert layer1 == ["decoder.layers.1.self_attention.linear_qkv", "decoder.layers.1.self_attention.linear_proj",
                      "decoder.layers.1.mlp.shared_experts.linear_fc1", "decoder.layers.1.mlp.shared_experts.linear_fc2",
                      *(f"decoder.layers.1.mlp.experts.local_experts.{e}.linear_fc{k}" for e in range(4)
                        for k in (1, 2))]
    assert "decoder.layers.0.mlp.linear_fc1" in layout.module_names and len(layout.module_names) == 2 * 4 + 2 * 12 + 1
    assert [ModelLayout.expert_of(n) for n in layer1] == [None] * 4 + [0, 0, 1, 1, 2, 2, 3, 3]
    assert layout_of(DENSE) == ModelLayout.gpt(4)


def test_expert_shapes_for_the_fp8_shape_check():
    shapes = linear_shapes(MOE, micro_batch=2, tensor_parallel=2)
    assert shapes["mlp.experts.linear_fc1"][2:] == (128, 256) and shapes["mlp.experts.linear_fc2"][2:] == (128, 128)
    assert shapes["mlp.shared_experts.linear_fc1"][2:] == (128, 128)
    assert "mlp.experts.linear_fc1" not in linear_shapes(DENSE, micro_batch=2)


def test_every_expert_runs_the_recipe_and_patterns_pick_experts():
    recipe = Recipe.from_dict({**load_recipe_dict("tensorwise"),
                               "layers": {"bf16_modules": ["*.layers.2.mlp.experts.local_experts.3.*"]}})
    plan = PrecisionPlan(recipe, layout_of(MOE))
    final = plan.at(10**6)
    expert = final.modules["decoder.layers.2.mlp.experts.local_experts.1.linear_fc1"]
    assert all(g.execution is Execution.EMULATED for g in expert.gemms.values())
    starved = final.modules["decoder.layers.2.mlp.experts.local_experts.3.linear_fc2"]
    assert starved.bf16_reason == "bf16_modules '*.layers.2.mlp.experts.local_experts.3.*'" and not starved.any_fp8
    assert not any(n.endswith("router") for n in final.modules)  # the router is no GEMM the plan decides
    assert plan.unmatched_patterns == ()


def test_plan_table_collapses_experts_and_says_the_router_is_bf16():
    text = format_plan(PrecisionPlan(load_recipe("hybrid"), layout_of({**MOE, "moe_layer_freq": [0, 1, 1, 1]})))
    rows = [line.split() for line in text.splitlines()]
    assert ["0", "(all", "linears)", "emulated", "emulated", "emulated"] in rows  # the dense layer
    assert ["1-3", "(other", "linears)", "emulated", "emulated", "emulated"] in rows  # attention: as the experts
    assert ["1-3", "mlp.experts[0-3]", "fc1+fc2", "emulated", "emulated", "emulated"] in rows  # always their count
    assert ["1-3", "mlp.router", "bf16", "bf16", "bf16", *ROUTER_REASON.split()] in rows
    assert ["0", "mlp.router"] not in [r[:2] for r in rows]
    assert "MoE: 4 routed experts in layers 1-3;" in text and "router's GEMM stays BF16" in text
    recipe = Recipe.from_dict({**load_recipe_dict("hybrid"),
                               "layers": {"bf16_modules": ["*local_experts.2.linear_fc1"]}})
    text = format_plan(PrecisionPlan(recipe, layout_of(MOE)))
    rows = [line.split() for line in text.splitlines()]
    assert ["0-3", "mlp.experts[0-1,3]", "fc1+fc2", "emulated", "emulated", "emulated"] not in rows
    assert ["0-3", "mlp.experts[0-3].linear_fc2", "emulated", "emulated", "emulated"] in rows
    assert ["0-3", "mlp.experts[0-1,3].linear_fc1", "emulated", "emulated", "emulated"] in rows
    assert ["0-3", "mlp.experts[2].linear_fc1", "bf16", "bf16", "bf16", "bf16_modules",
            "'*local_experts.2.linear_fc1'"] in rows
    assert ["0-3", "mlp.shared_experts.linear_fc1", "emulated", "emulated", "emulated"] in rows
    many = format_plan(PrecisionPlan(Recipe.from_dict({**load_recipe_dict("hybrid"), "layers": {"bf16_last": 1}}),
                                     layout_of({**MOE, "num_moe_experts": 128, "moe_router_topk": 8})))
    assert "  0-2      mlp.experts[0-127] fc1+fc2" in many and "  3        mlp.experts[0-127] fc1+fc2" in many
    assert len(many.splitlines()) < 40


def test_grouped_experts_must_share_one_te_recipe_per_layer():
    from fp8_recipes.plan.precision import Hardware
    from fp8_recipes.training.run import check_grouped_experts

    layout = layout_of(MOE)
    hopper = Hardware.target((9, 0))
    check_grouped_experts({**MOE, "moe_grouped_gemm": True}, PrecisionPlan(load_recipe("hybrid"), layout, hopper))
    split = Recipe.from_dict({**load_recipe_dict("delayed"), "layers": {"bf16_modules": ["*local_experts.2.*"]}})
    plan = PrecisionPlan(split, layout, hopper)
    with pytest.raises(ConfigError, match=r"^recipe: decoder\.layers\.0\.mlp\.experts\.local_experts\.2\.linear_fc1 "
                                          r"runs otherwise than .*local_experts\.0\.linear_fc1 from step 0, and "
                                          r"model\.moe_grouped_gemm=true .*set model\.moe_grouped_gemm=false$"):
        check_grouped_experts({**MOE, "moe_grouped_gemm": True}, plan)
    check_grouped_experts({**MOE, "moe_grouped_gemm": False}, plan)  # SequentialMLP: an autocast per expert linear
    # the experts one rank holds (expert parallelism): only those must agree
    rows = {"decoder.layers.0.mlp.experts.linear_fc1": tuple(
        f"decoder.layers.0.mlp.experts.local_experts.{e}.linear_fc1" for e in (0, 1))}
    assert plan.grouped_experts_problem(rows) is None
    emulated = Recipe.from_dict({**load_recipe_dict("delayed"), "backend": "emulated",
                                 "layers": {"bf16_modules": ["*local_experts.2.*"]}})
    assert PrecisionPlan(emulated, layout, hopper).grouped_experts_problem() is None


# ---------------------------------------------------------------------------------------------------------------
# Per-module policies (recipe `modules:`)

def _with_modules(modules, base="delayed") -> Recipe:
    return Recipe.from_dict({**load_recipe_dict(base), "modules": modules})


def test_module_policies_replace_the_recipes_roles_where_the_pattern_matches():
    recipe = _with_modules({"*.experts.*": {"gradients": {"scaling": "tensorwise"}, "activations": "none"},
                            "*.layers.1.*": {"weights": {"scaling": "delayed", "amax_history_len": 8}}})
    plan = PrecisionPlan(recipe, layout_of(MOE))
    expert = "decoder.layers.1.mlp.experts.local_experts.2.linear_fc1"
    assert plan.module_policy(expert, Role.GRADIENTS).describe() == "tensorwise e5m2"  # the role's default format
    assert plan.module_policy(expert, Role.WEIGHTS) == recipe.weights  # first match wins: not layer 1's weights
    assert plan.module_policy("decoder.layers.1.self_attention.linear_qkv", Role.WEIGHTS).amax_history_len == 8
    mp = plan.at(0).modules[expert]
    assert mp.gemms[Gemm.FPROP].policy(Role.ACTIVATIONS) is None  # activations BF16 in the experts
    assert mp.gemms[Gemm.FPROP].policy(Role.WEIGHTS) == recipe.weights
    assert mp.gemms[Gemm.WGRAD].policy(Role.GRADIENTS).scaling is Scaling.TENSORWISE
    assert mp.override == "modules '*.experts.*': activations bf16, gradients tensorwise e5m2"
    assert plan.at(0).modules["decoder.layers.0.mlp.linear_fc1" if False else
                              "decoder.layers.0.self_attention.linear_qkv"].override is None
    again = Recipe.from_dict(recipe.to_dict())  # show's YAML loads back to the same recipe
    assert again == recipe and [m.pattern for m in again.modules] == ["*.experts.*", "*.layers.1.*"]


@pytest.mark.parametrize("modules, says", [
    ("experts", r"^modules: 'experts' is not a mapping of module patterns"),
    ({"*experts*": {"grads": {"scaling": "tensorwise"}}}, r"^modules\.\*experts\*\.grads: unknown key"),
    ({"*experts*": {"gradients": {"scaling": "fast"}}}, r"^modules\.\*experts\*\.gradients\.scaling: 'fast'"),
    ({"*experts*": {"gradients": {"scaling": "tensorwise", "amax_history_len": 4}}},
     r"^modules\.\*experts\*\.gradients\.amax_history_len: 4 does not apply to scaling: tensorwise"),
    ({"*experts*": {}}, r"^modules\.\*experts\*: gives no role"),
])
def test_module_policies_are_checked_with_their_keys(modules, says):
    with pytest.raises(ValueError, match=says):
        _with_modules(modules)


def test_a_module_may_not_turn_fp8_a_role_the_recipe_keeps_bf16():
    base = {**load_recipe_dict("delayed"), "gradients": {"scaling": "none"}}
    with pytest.raises(ValueError, match=r"^modules\.\*experts\*\.gradients: tensorwise where the recipe keeps "
                                         r"gradients BF16"):
        Recipe.from_dict({**base, "modules": {"*experts*": {"gradients": {"scaling": "tensorwise"}}}})


def test_module_policies_show_in_the_table():
    from fp8_recipes.plan.precision import Hardware

    recipe = _with_modules({"*.experts.*": {"activations": {"scaling": "delayed", "amax_history_len": 16}},
                            "*nothing*": {"weights": "none"}})
    hopper = PrecisionPlan(recipe, layout_of(MOE), Hardware.target((9, 0)))  # (a pattern matching nothing: ignored)
    assert hopper.backend == "te" and [s.key for s in hopper.substitutions] == [
        "modules.*.experts.*.activations.amax_history_len"]
    text = format_plan(PrecisionPlan(recipe, layout_of(MOE)))
    assert "why BF16 / own policies (modules:)" in text
    assert ("0-3      mlp.experts[0-3] fc1+fc2      emulated  emulated  emulated  modules '*.experts.*': activations delayed "
            "e4m3 hist 16 max") in text
    assert "warning: modules pattern '*nothing*' matches no module of this model" in text
    assert "own policies" not in format_plan(PrecisionPlan(load_recipe("delayed"), layout_of(MOE)))


def test_patterns_that_change_less_than_they_say_are_warned_and_a_null_one_refused():
    """A pattern shadowed by an earlier one, one whose modules all stay BF16 (the router), one that leaves a
    module's activations RHT'd without its gradients: each one plan warning; an override of null is refused."""
    recipe = _with_modules({"*.mlp.*": {"gradients": "tensorwise"}, "*.experts.*": {"gradients": "blockwise"}})
    text = format_plan(PrecisionPlan(recipe, layout_of(MOE)))
    assert ("warning: modules pattern '*.experts.*' does nothing: every module it matches takes the earlier pattern "
            "'*.mlp.*' (the first match wins)") in text
    head = _with_modules({"*output_layer*": {"weights": "tensorwise"}}, base="safe")  # (safe keeps the head BF16)
    assert ("warning: modules pattern '*output_layer*' does nothing: every module it matches stays BF16 (output_layer:"
            in format_plan(PrecisionPlan(head, layout_of(MOE))))
    nvfp4 = load_recipe_dict("nvfp4")
    rotated = Recipe.from_dict({**nvfp4, "layers": {}, "modules": {"*linear_fc2": {"gradients": "tensorwise"}}})
    assert ("warning: modules pattern '*linear_fc2' leaves its modules activations.rht without gradients.rht"
            in format_plan(PrecisionPlan(rotated, layout_of(MOE))))
    assert "warning: modules pattern" not in format_plan(PrecisionPlan(_with_modules(
        {"*.experts.*": {"gradients": "tensorwise"}}), layout_of(MOE)))
    with pytest.raises(ValueError, match=r"modules\.\*\.experts\.\*: gives no role"):
        _with_modules({"*.experts.*": None})


def test_moe_presets():
    delayed = PrecisionPlan(load_recipe("moe_delayed"), layout_of(MOE))
    expert = "decoder.layers.0.mlp.experts.local_experts.0.linear_fc2"
    assert [delayed.module_policy(expert, r).amax_history_len for r in Role] == [16, 16, 16]
    assert delayed.module_policy("decoder.layers.0.self_attention.linear_qkv", Role.GRADIENTS).amax_history_len == 1024
    assert delayed.module_override("decoder.layers.0.mlp.shared_experts.linear_fc1") is None
    blockwise = load_recipe("moe_blockwise")
    assert [blockwise.policy(r).describe() for r in Role] == ["blockwise e4m3 128x128 pow2", "blockwise e4m3 1x128 pow2",
                                                             "blockwise e4m3 1x128 pow2"]
    plan = PrecisionPlan(blockwise, layout_of(MOE)).at(0)
    assert plan.modules["output_layer"].bf16_reason and not plan.attention


def test_module_policies_run_on_te_with_their_own_te_recipe():
    """Per-module policies on the TE backend (H200): each ``modules:`` override is resolved as the recipe with its
    policies; its modules run that TE recipe (the backend's per-module autocast), the others the recipe's."""
    from fp8_recipes.plan.precision import Hardware
    from fp8_recipes.recipe.schema import Backend, RecipeError

    h200 = Hardware("cuda", (9, 0), "2.20.2", "NVIDIA H200")
    plan = PrecisionPlan(load_recipe("moe_delayed"), layout_of(MOE), h200)
    assert plan.backend is Backend.TE and plan.substitutions == ()
    final = plan.at(10**6).modules
    expert = final["decoder.layers.0.mlp.experts.local_experts.0.linear_fc2"]
    assert expert.te.describe() == "DelayedScaling(fp8_format=HYBRID, margin=0, amax_history_len=16, amax_compute_algo=max)"
    assert expert.override.startswith("modules '*.experts.*': weights delayed e4m3 hist 16")
    for name in ("decoder.layers.0.self_attention.linear_qkv", "decoder.layers.0.mlp.shared_experts.linear_fc1"):
        assert final[name].te.weights.amax_history_len == 1024 and final[name].override is None, name
    assert plan.grouped_experts_problem() is None  # every expert the same: one GroupedLinear per fc runs them
    assert "modules '*.experts.*'" in format_plan(plan)
    # activations' history apart from the weights': TE keeps one delayed state for both (auto: the nearest)
    uneven = {**load_recipe_dict("delayed"), "modules": {"*.experts.*": {"activations": {
        "scaling": "delayed", "amax_history_len": 16}}}}
    plan = PrecisionPlan(Recipe.from_dict(uneven), layout_of(MOE), h200)
    assert plan.backend is Backend.TE
    assert [s.key for s in plan.substitutions] == ["modules.*.experts.*.activations.amax_history_len"]
    with pytest.raises(RecipeError, match=r"^modules\.\*\.experts\.\*\.activations\.amax_history_len: 16 cannot"):
        PrecisionPlan(Recipe.from_dict({**uneven, "backend": "te"}), layout_of(MOE), h200)
    # an override TE cannot run at all (BF16 weights with FP8 inputs): auto runs the whole plan emulated
    odd = {**load_recipe_dict("tensorwise"), "modules": {"*.linear_proj": {"weights": {"scaling": "none"}}}}
    plan = PrecisionPlan(Recipe.from_dict(odd), layout_of(MOE), h200)
    assert plan.backend is Backend.EMULATED and "modules.*.linear_proj: weights.scaling: 'none'" in plan.backend_reason


def test_routing_rows_say_the_imbalance_and_the_idle_experts():
    from fp8_recipes.observe.routing import routing_row

    assert routing_row(3, 1, [4, 4, 4, 4]) == {"step": 3, "layer": 1, "tokens": [4, 4, 4, 4], "imbalance": 1.0,
                                                "idle": 0}
    row = routing_row(3, 1, [10, 6, 0, 0])
    assert row["imbalance"] == 2.5 and row["idle"] == 2
    assert routing_row(1, 0, [0, 0])["imbalance"] == 0.0  # (no token at all: nothing to balance)


@pytest.mark.parametrize("name", sorted(p.stem for p in (Path(__file__).resolve().parents[2] / "conf" / "model")
                                        .glob("*.yaml")))
def test_every_shipped_model_passes_the_checks(name):
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(OmegaConf.load(Path(__file__).resolve().parents[2] / "conf" / "model" /
                                                f"{name}.yaml"), resolve=False)
    if not isinstance(cfg.get("vocab_size"), int):
        cfg["vocab_size"] = 4096  # (from the data group: ${data.vocab_size})
    check_model_cfg(cfg, tensor_parallel=2 if name not in ("tiny",) else 1)
    layout = layout_of(cfg)
    assert layout.num_layers == cfg["num_layers"] and bool(layout.routers) == (cfg.get("num_moe_experts") is not None)


def test_a_slurm_gpu_job_of_an_moe_model_is_checked_on_the_submitting_host():
    from hydra import compose, initialize_config_dir

    from fp8_recipes.launch.job import check_train_config
    from fp8_recipes.recipe.pack import conf_dir

    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        job = compose("train", overrides=["model=mixtral_8x7b_4l", "+recipe=delayed", "trainer=gpu"])
        split = compose("train", overrides=["model=mixtral_8x7b_4l", "+recipe=delayed", "trainer=gpu",
                                            "++recipe.layers.bf16_modules=['*local_experts.7.*']"])
    check_train_config(job, world_size=1)
    with pytest.raises(ConfigError, match=r"^recipe: decoder\.layers\.0\.mlp\.experts\.local_experts\.7\.linear_fc1 "
                                          r"runs otherwise than"):
        check_train_config(split, world_size=1)
    # router padding with allgather: a GPU job is refused on the submitting host, with the GPU's fix
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        padded = compose("train", overrides=["model=mixtral_8x7b_4l", "+recipe=delayed", "trainer=gpu",
                                             "model.moe_router_padding_for_quantization=true",
                                             "model.moe_token_dispatcher_type=allgather"])
    with pytest.raises(ConfigError, match=r"^model\.moe_router_padding_for_quantization=true: .*set "
                                          r"model\.moe_token_dispatcher_type=alltoall"):
        check_train_config(padded, world_size=1)


def test_routing_counts_leave_out_the_routers_fp8_padding():
    import types

    import torch

    from fp8_recipes.observe.routing import _real_tokens

    tokens = torch.tensor([16, 0, 32])  # padded to 16s: 5, 0 and 17 real tokens (probability > 0)
    probs = torch.cat([torch.rand(5) + 0.1, torch.zeros(11), torch.rand(17) + 0.1, torch.zeros(15)])
    padded = types.SimpleNamespace(token_dispatcher=types.SimpleNamespace(
        config=types.SimpleNamespace(moe_router_padding_for_quantization=True)))
    assert _real_tokens(padded, tokens, probs, 48).tolist() == [5, 0, 17]
    plain = types.SimpleNamespace(token_dispatcher=types.SimpleNamespace(
        config=types.SimpleNamespace(moe_router_padding_for_quantization=False)))
    assert _real_tokens(plain, tokens, probs, 48) is tokens


def test_moe_statistics_under_context_parallelism_are_refused():
    """The recorder merges experts over expert-parallel and expert tensor-parallel ranks (observe/recorder.py,
    tested on gloo ranks in tests/integration/test_expert_parallel_cpu.py); context parallelism is not measured."""
    import types

    from fp8_recipes.training.run import check_moe_statistics

    debug = types.SimpleNamespace(enabled=True)
    trainer = lambda **k: types.SimpleNamespace(**{"expert_model_parallel_size": 1,  # noqa: E731
                                                   "expert_tensor_parallel": 1, "tensor_model_parallel_size": 1,
                                                   "context_parallel_size": 1, **k})
    check_moe_statistics(trainer(), MOE, debug)
    check_moe_statistics(trainer(expert_model_parallel_size=2), MOE, debug)
    check_moe_statistics(trainer(tensor_model_parallel_size=2), MOE, debug)
    check_moe_statistics(trainer(context_parallel_size=2), DENSE, debug)
    check_moe_statistics(trainer(context_parallel_size=2), MOE, types.SimpleNamespace(enabled=False))
    with pytest.raises(ConfigError, match=r"^debug: numerics statistics of an MoE model at "
                                          r"trainer\.context_parallel_size=2 are not measured yet"):
        check_moe_statistics(trainer(context_parallel_size=2), MOE, debug)


def test_fp8_param_refuses_a_module_policy_inside_an_fp8_layer():
    from fp8_recipes.plan.precision import Hardware

    recipe = Recipe.from_dict({**load_recipe_dict("moe_delayed"), "fp8_param": True})
    plan = PrecisionPlan(recipe, layout_of(MOE), Hardware("cuda", (9, 0), "2.20.2", "NVIDIA H200"))
    line = plan.fp8_param_problem()
    assert line.startswith("fp8_param: true quantizes each layer's weights under one TE recipe, and modules "
                           "'*.experts.*'") and "set fp8_param: false" in line and "\n" not in line


def test_each_layer_runs_the_recipes_own_te_recipe_and_overrides_their_own():
    """The layer's autocast (and its core attention) is the recipe's TE recipe, whatever its linears' overrides; an
    override never carries FP8 attention; an all-BF16 override is BF16 modules; recipes TE cannot tell apart and
    layers of two recipe classes under fp8_param are refused."""
    from fp8_recipes.plan.precision import Hardware
    from fp8_recipes.recipe.schema import Backend

    h200 = Hardware("cuda", (9, 0), "2.20.2", "NVIDIA H200")
    recipe = Recipe.from_dict({**load_recipe_dict("moe_delayed"), "attention": "fp8"})
    final = PrecisionPlan(recipe, layout_of(MOE), h200).at(10**6)
    layer = final.layers_te[1]
    assert (layer.weights.amax_history_len, layer.fp8_dpa) == (1024, True)
    assert final.modules["decoder.layers.1.self_attention.linear_qkv"].te == layer
    expert = final.modules["decoder.layers.1.mlp.experts.local_experts.2.linear_fc1"].te
    assert (expert.weights.amax_history_len, expert.fp8_dpa) == (16, False)
    bf16 = {**load_recipe_dict("delayed"), "modules": {"*.experts.*": {r: {"scaling": "none"} for r in
                                                                        ("weights", "activations", "gradients")}}}
    plan = PrecisionPlan(Recipe.from_dict(bf16), layout_of(MOE), h200)
    assert plan.backend is Backend.TE
    assert plan.at(10**6).modules["decoder.layers.0.mlp.experts.local_experts.0.linear_fc2"].te is None
    assert plan.at(10**6).modules["decoder.layers.0.self_attention.linear_proj"].te is not None
    algo = {**load_recipe_dict("delayed"), "modules": {"*.experts.*": {r: {"scaling": "delayed",
            "amax_compute_algo": "most_recent"} for r in ("weights", "activations", "gradients")}}}
    plan = PrecisionPlan(Recipe.from_dict(algo), layout_of(MOE), h200)
    assert plan.backend is Backend.EMULATED and "modules.*.experts.*: forward delayed scaling that differs from " \
        "the recipe's only in amax_compute_algo" in plan.backend_reason
    # a CustomRecipe's backward state is keyed by the gradients' margin and history: E4M3 gradients with margin 16
    # (weights at margin 0: a CustomRecipe) share TE's backward buffer with experts under a DelayedScaling of
    # margin 16 whose amax algorithm differs, though no forward key and no weights' setting says so
    margin16 = {"scaling": "delayed", "format": "e4m3", "margin": 16}
    custom = {**load_recipe_dict("delayed"), "gradients": margin16, "modules": {"*.experts.*": {
        r: {**margin16, "amax_compute_algo": "most_recent"} for r in ("weights", "activations", "gradients")}}}
    plan = PrecisionPlan(Recipe.from_dict(custom), layout_of(MOE), h200)
    assert plan.backend is Backend.EMULATED and "modules.*.experts.*: backward delayed scaling that differs " \
        "from the recipe's only in amax_compute_algo" in plan.backend_reason, plan.backend_reason
    custom["modules"]["*.experts.*"] = {r: margin16 for r in ("weights", "activations", "gradients")}  # same: fine
    assert PrecisionPlan(Recipe.from_dict(custom), layout_of(MOE), h200).backend is Backend.TE
    mixed = Recipe.from_dict({**load_recipe_dict("delayed"), "fp8_param": True,
                              "modules": {"decoder.layers.3.*": {r: {"scaling": "tensorwise"} for r in
                                                                 ("weights", "activations", "gradients")}}})
    line = PrecisionPlan(mixed, layout_of(MOE), h200).fp8_param_problem()
    assert line.startswith("fp8_param: true hands Megatron-Core's optimizer one FP8 recipe for every FP8 weight, "
                           "and layer 3 runs Float8CurrentScaling where layer 0 runs DelayedScaling")
