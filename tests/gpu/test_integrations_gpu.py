"""The Bridge / NeMo 2 integrations' Megatron-Core side on a real GPU (no Bridge or NeMo needed): a GPTModel with
the TE layer spec built with the fields a recipe maps to, Megatron-Core's own FP8 path running them (a named
recipe, and ``fp8_recipe="custom"`` importing our quantizer factory, whose quantizers are the recipe's per role;
an MoE model's TE experts), and plugin-owned precision (the schedule callbacks' ScheduleDriver) switching BF16 ->
FP8 at the planned step."""

from __future__ import annotations

import math

import pytest
import torch

from fp8_recipes.backends.te import BF16, FP8, te_available

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not (torch.cuda.is_available() and te_available()),
                                                  reason="needs a CUDA GPU with Transformer Engine")]

TINY = dict(num_layers=4, hidden_size=128, ffn_hidden_size=512, num_attention_heads=4, num_query_groups=2,
            seq_length=128, vocab_size=4096, normalization="RMSNorm", activation="swiglu",
            position_embedding_type="rope", share_embeddings_and_output_weights=False)
MIX = {"name": "mix", "weights": {"scaling": "tensorwise", "pow2_scales": True}, "activations": "tensorwise",
       "gradients": "tensorwise"}  # per-role scale options: Megatron-Core's named tensorwise cannot pass them
QKV = "decoder.layers.1.self_attention.linear_qkv"


def batch(device, batch_size: int = 8, seq: int = 128, vocab: int = 4096) -> dict:
    from fp8_recipes.megatron.data import repeated_batch

    return {k: v.to(device) for k, v in next(repeated_batch(batch_size, seq, vocab)).items()}


def loss_and_backward(model, b) -> float:
    losses = model(b["tokens"], b["position_ids"], None, labels=b["labels"])
    loss = (losses.float() * b["loss_mask"]).sum() / b["loss_mask"].sum()
    loss.backward()
    return float(loss)


def build(device, fields: dict | None = None):
    from fp8_recipes.megatron.model import build_gpt_model

    torch.manual_seed(0)
    return build_gpt_model(TINY, use_te_spec=True, params_dtype=torch.bfloat16, device=device,
                           config_overrides=fields)


def linear(model, name: str):
    from fp8_recipes.megatron.model import named_linear_modules

    return dict(named_linear_modules(model))[name]


@pytest.mark.parametrize("ref", ["tensorwise", "hybrid", "mix"])
def test_megatron_runs_the_mapped_fields(ref, megatron_gpu, monkeypatch):
    """Native path: Megatron-Core's own autocast from the config fields; for 'mix', fp8_recipe="custom" imports
    our factory by its dotted path and every TE role gets the recipe's quantizer."""
    import fp8_recipes.integrations.common as common

    cc = torch.cuda.get_device_capability()
    recipe = MIX if ref == "mix" else ref
    mp = common.megatron_precision(recipe, compute_capability=cc, num_layers=TINY["num_layers"])
    common.activate_quantizer_factory(mp)
    calls: list[tuple[str, str]] = []
    factory = common.fp8_quantizer_factory

    def recording(role):  # Megatron-Core resolves the dotted path at each get_fp8_recipe: it finds this one
        q = factory(role)
        calls.append((getattr(role, "tensor_type", None), type(q).__name__, getattr(q, "force_pow_2_scales", None)))
        return q

    monkeypatch.setattr(common, "fp8_quantizer_factory", recording)
    model = build(megatron_gpu[2], mp.fields)
    loss = loss_and_backward(model, batch(megatron_gpu[2]))
    assert math.isfinite(loss)
    qkv = linear(model, QKV)
    assert qkv.fp8, "the TE linear did not run FP8 under Megatron-Core's autocast"
    ran = type(qkv.fp8_meta["recipe"]).__name__
    assert ran == ("CustomRecipe" if ref == "mix" else mp.te.recipe), (ran, mp.te.describe())
    if ref != "mix":
        assert calls == []
        return
    assert mp.fields["fp8_recipe"] == "custom"
    by_role = {role: (kind, pow2) for role, kind, pow2 in calls}
    assert by_role["weight"] == ("Float8CurrentScalingQuantizer", True)        # weights: tensorwise, pow2 scales
    assert by_role["input"] == ("Float8CurrentScalingQuantizer", False)        # activations: tensorwise
    assert by_role["grad_output"] == ("Float8CurrentScalingQuantizer", False)  # gradients: tensorwise (E5M2)
    assert any(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_schedule_driver_switches_at_the_planned_step(megatron_gpu):
    """Plugin-owned path (Bridge's FP8RecipeCallback, NeMo's FP8ScheduleCallback): the model built without fp8,
    BF16 for the warmup steps, then FP8 in every TE linear."""
    from fp8_recipes.integrations.common import ScheduleDriver

    model = build(megatron_gpu[2])
    driver = ScheduleDriver({"name": "warm", "weights": "tensorwise", "activations": "tensorwise",
                             "gradients": "tensorwise", "schedule": {"bf16_warmup_steps": 2}}, max_steps=4)
    driver.attach([model])
    b = batch(megatron_gpu[2])
    stages = []
    for step in range(4):
        stages.append(driver.begin_step(step))
        assert math.isfinite(loss_and_backward(model, b))
        model.zero_grad(set_to_none=True)
        driver.end_step(step)
    n = 4 * 4  # 4 layers x 4 TE linears
    assert stages == ["bf16 warmup", "bf16 warmup", "fp8 w+a+g", "fp8 w+a+g"]
    assert {s: dict(driver.precision.step_kinds[s]) for s in range(4)} == \
        {0: {BF16: n}, 1: {BF16: n}, 2: {FP8: n}, 3: {FP8: n}}


def test_schedule_driver_refuses_a_model_built_with_fp8(megatron_gpu):
    from fp8_recipes.integrations.common import ScheduleDriver

    model = build(megatron_gpu[2], {"fp8": "hybrid", "fp8_recipe": "tensorwise"})
    with pytest.raises(ValueError, match="without"):
        ScheduleDriver("safe").attach([model])


# An MoE model as Bridge / NeMo would build it from our keys (apply_moe; moe_config_fields): 4 experts of FFN 256,
# top-2, in layers 0 and 2, with Megatron-Core's GPU MoE settings (alltoall, TE grouped GEMM, fused permutation).
MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=256, moe_layer_freq=2, moe_router_dtype="fp32",
           moe_token_dispatcher_type="alltoall", moe_grouped_gemm=True, moe_permute_fusion=True)


@pytest.mark.parametrize("ref, padding", [("moe_blockwise", False), ("delayed", False), ("delayed", True)])
def test_megatron_runs_an_moe_model_under_the_mapped_fields(ref, padding, megatron_gpu):
    """Native path for an MoE model: the fields the recipe maps to over the model's MoE layout, Megatron-Core's own
    autocast; the experts' TE GroupedLinears run the mapped TE recipe in FP8, forward and backward, with and without
    the router padding each expert's tokens to the FP8 GEMMs' multiple of 16."""
    from fp8_recipes.integrations.common import megatron_precision
    from fp8_recipes.megatron.model import build_gpt_model, unwrap_model
    from fp8_recipes.megatron.model_config import layout_of

    cfg = {**TINY, **MOE, "moe_router_padding_for_quantization": padding}
    mp = megatron_precision(ref, compute_capability=torch.cuda.get_device_capability(), layout=layout_of(cfg))
    torch.manual_seed(0)
    model = build_gpt_model(cfg, use_te_spec=True, params_dtype=torch.bfloat16, device=megatron_gpu[2],
                            config_overrides=mp.fields)
    losses = []
    for step in range(2):  # a second step: delayed scaling's histories rolled once
        if step:
            model.zero_grad(set_to_none=False)
        losses.append(loss_and_backward(model, batch(megatron_gpu[2])))
    assert all(math.isfinite(x) for x in losses), losses
    gpt = unwrap_model(model)  # (a Float16Module around the GPTModel for bf16 params)
    experts = {n: m for n, m in gpt.named_modules() if n.endswith(("experts.linear_fc1", "experts.linear_fc2"))}
    assert sorted(experts) == [f"decoder.layers.{i}.mlp.experts.linear_fc{k}" for i in (0, 2) for k in (1, 2)]
    from megatron.core.extensions.transformer_engine import TEGroupedLinear

    for name, module in experts.items():  # (TEColumnParallelGroupedLinear / TERowParallelGroupedLinear)
        assert isinstance(module, TEGroupedLinear) and module.fp8, f"{name} did not run FP8"
        # (Megatron-Core builds its own subclass of TE's recipe for delayed scaling: TEDelayedScaling)
        kinds = {cls.__name__ for cls in type(module.fp8_meta["recipe"]).__mro__}
        assert getattr(mp.te.recipe, "value", mp.te.recipe) in kinds, (name, kinds, mp.te.describe())
    router = gpt.decoder.layers[0].mlp.router  # not a TE module: Megatron-Core's own GEMM, outside FP8
    grad = router.weight.grad  # (the second step's)
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0
