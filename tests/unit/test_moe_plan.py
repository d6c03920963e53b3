"""Mixture-of-Experts in the plan (issue 28): the model config's MoE keys, the layout's expert and router names, the
plan's per-expert rows and bf16_modules patterns on experts, and the printed table (experts collapsed, router BF16)."""

from __future__ import annotations

import pytest

from fp8_recipes.checks import ConfigError
from fp8_recipes.megatron.model_config import (
    check_model_cfg, check_model_device, layout_of, linear_shapes, model_notices, moe_layer_pattern,
)
from fp8_recipes.plan.format import format_plan
from fp8_recipes.plan.precision import ROUTER_REASON, Execution, ModelLayout, MoEShape, PrecisionPlan
from fp8_recipes.recipe.pack import load_recipe, load_recipe_dict
from fp8_recipes.recipe.schema import Recipe

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
                       ("moe_permute_fusion", True)):
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
    assert ["1-3", "(all", "linears)", "emulated", "emulated", "emulated"] in rows
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
    assert "mlp.experts[0-127] fc1+fc2" not in many  # (a layer whose linears all match prints one row)
    assert len(many.splitlines()) < 40


def test_moe_on_the_te_backend_is_refused_in_one_line_until_it_is_wired():
    from fp8_recipes.plan.precision import Hardware
    from fp8_recipes.training.run import check_moe_backend

    layout = layout_of(MOE)
    hopper = PrecisionPlan(load_recipe("hybrid"), layout, Hardware.target((9, 0)))
    with pytest.raises(ConfigError, match=r"^model\.num_moe_experts=4: .* emulated backend only so far .*"
                                          r"\+recipe\.backend=emulated"):
        check_moe_backend(MOE, hopper)
    emulated = Recipe.from_dict({**load_recipe_dict("hybrid"), "backend": "emulated"})
    check_moe_backend(MOE, PrecisionPlan(emulated, layout, Hardware.target((9, 0))))
    check_moe_backend(DENSE, PrecisionPlan(load_recipe("hybrid"), ModelLayout.gpt(4), Hardware.target((9, 0))))
