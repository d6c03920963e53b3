"""Mixture-of-Experts on the CPU (issue 28): Megatron-Core's MoE layers (TopKRouter, the allgather dispatcher,
SequentialMLP experts, a shared expert) under the emulated backend: the plan's names are the model's, the router is
left alone, BF16 stays bit-identical to Megatron-Core, each expert quantizes on its own (an expert without tokens
too), and scripts/train.py trains model=tiny_moe."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from megatron.core.transformer.moe.moe_utils import permute
from megatron.core.transformer.moe.router import TopKRouter
from omegaconf import OmegaConf

from fp8_recipes.megatron.emulated_layers import (
    EmulatedColumnParallelLinear, EmulatedRowParallelLinear, attach_emulated_backend,
)
from fp8_recipes.megatron.model import build_gpt_model, linear_module_names, model_layout, named_linear_modules, unwrap_model
from fp8_recipes.megatron.model_config import layout_of
from fp8_recipes.numerics.quantize import fake_quant, quantize
from fp8_recipes.plan.format import format_plan
from fp8_recipes.plan.precision import Gemm, PrecisionPlan
from fp8_recipes.recipe.pack import load_recipe
from fp8_recipes.recipe.schema import Role
from fp8_recipes.rundir import read_jsonl, read_metrics
from test_emulated_backend import forward_backward, identical
from test_train_cpu import ROOT, assert_learns, dataset, small_run  # noqa: F401  (the shared dataset fixture)

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def moe_cfg(**change) -> dict:
    """conf/model/tiny_moe.yaml, two layers: a dense one, then an MoE one (4 experts, top-2, a shared expert)."""
    cfg = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "model" / "tiny_moe.yaml"), resolve=False)
    return {**cfg, "vocab_size": 256, "num_layers": 2, "moe_layer_freq": [0, 1],
            "moe_shared_expert_intermediate_size": 128, **change}


def build(emulated: bool, cfg: dict | None = None, dtype=torch.bfloat16):
    torch.manual_seed(5)
    kw = dict(column_linear=EmulatedColumnParallelLinear, row_linear=EmulatedRowParallelLinear) if emulated else {}
    return build_gpt_model(cfg or moe_cfg(), params_dtype=dtype, device="cpu", **kw)


def test_the_plans_names_are_the_models_and_the_router_is_left_alone(megatron_cpu):
    model = build(emulated=True)
    assert linear_module_names(model) == list(layout_of(moe_cfg()).module_names)
    assert model_layout(model) == layout_of(moe_cfg())
    linears = dict(named_linear_modules(model))
    assert all(isinstance(m, (EmulatedColumnParallelLinear, EmulatedRowParallelLinear)) for m in linears.values()
               if m is not linears["output_layer"])
    assert type(linears["decoder.layers.1.mlp.experts.local_experts.3.linear_fc2"]) is EmulatedRowParallelLinear
    assert type(linears["decoder.layers.1.mlp.shared_experts.linear_fc1"]) is EmulatedColumnParallelLinear
    assert type(unwrap_model(model).decoder.layers[1].mlp.router) is TopKRouter


def test_bf16_is_bit_identical_to_megatron_core_and_each_expert_scales_on_its_own(megatron_cpu):
    plain, model = build(emulated=False), build(emulated=True)
    precision = attach_emulated_backend(model, PrecisionPlan(load_recipe("bf16"), model_layout(model)))
    precision.begin_step(0)
    reference = forward_backward(plain)
    assert identical(forward_backward(model), reference)
    delayed = build(emulated=True)
    precision = attach_emulated_backend(delayed, PrecisionPlan(load_recipe("delayed"), model_layout(delayed)))
    for step in range(3):
        precision.begin_step(step)
        fp8 = forward_backward(delayed, seed=step)
    assert not torch.equal(fp8[1], reference[1])
    experts = [precision.states[f"decoder.layers.1.mlp.experts.local_experts.{e}.linear_fc1"] for e in range(4)]
    for role, distinct in ((Role.WEIGHTS, 4), (Role.ACTIVATIONS, 2), (Role.GRADIENTS, 2)):
        histories = [s.scalers[role].history for s in experts]
        assert all(h.max() > 0 for h in histories), role  # every expert saw tokens and recorded its own amaxes
        # each its own weights; its own tokens (top-2: the largest token goes to two experts, which then agree)
        assert len({tuple(h.tolist()) for h in histories}) >= distinct, (role, histories)


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise", "blockwise", "hybrid", "mxfp8"])
def test_an_expert_without_tokens_runs_every_scaling(megatron_cpu, recipe):
    """SequentialMLP calls every local expert, one the router gave no token with an empty input: each scaling kind
    quantizes it (0 rows) and its weight gradient is zero."""
    model = build(emulated=True)
    precision = attach_emulated_backend(model, PrecisionPlan(load_recipe(recipe), model_layout(model)))
    precision.begin_step(10**6)
    fc1 = dict(named_linear_modules(model))["decoder.layers.1.mlp.experts.local_experts.2.linear_fc1"]
    x = torch.empty(0, 128, dtype=torch.bfloat16, requires_grad=True)
    y, _ = fc1(x)
    y.sum().backward()
    assert y.shape == (0, 512) and x.grad.shape == (0, 128)
    assert fc1.weight.grad is not None and not fc1.weight.grad.any()
    if recipe == "delayed":  # TE's GroupedLinear neither records nor rolls an empty split (test_te_grouped.py)
        scalers = precision.states["decoder.layers.1.mlp.experts.local_experts.2.linear_fc1"].scalers
        before = {r: (s.history.clone(), s.scale.clone()) for r, s in scalers.items()}
        precision.after_optimizer_step(10**6)
        for role in (Role.ACTIVATIONS, Role.GRADIENTS):
            assert torch.equal(scalers[role].history, before[role][0]) and torch.equal(scalers[role].scale,
                                                                                      before[role][1]), role
        assert scalers[Role.WEIGHTS].history[-1] > 0  # the weight was quantized: recorded, then rolled


COLUMNWISE = {(Gemm.FPROP, Role.ACTIVATIONS): False, (Gemm.FPROP, Role.WEIGHTS): False,
              (Gemm.DGRAD, Role.GRADIENTS): False, (Gemm.DGRAD, Role.WEIGHTS): True,
              (Gemm.WGRAD, Role.GRADIENTS): True, (Gemm.WGRAD, Role.ACTIVATIONS): True}
"""Along which dim each GEMM quantizes each operand (its reduction dim: TE's rowwise / columnwise copies)."""


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_each_expert_quantizes_its_own_tokens_as_the_reference_does(megatron_cpu, recipe):
    """Item 4 on the CPU: every operand of every expert GEMM, forward and backward, is the project's reference
    quantization (numerics.quantize) of that expert's own split, the tokens the router gave it in token order (TE's
    GroupedLinear: one quantizer per expert GEMM, the input split by m_splits), at uneven counts that are no
    multiples of 16; a scale shared over all experts' tokens would read differently."""
    model = build(emulated=True)
    precision = attach_emulated_backend(model, PrecisionPlan(load_recipe(recipe), model_layout(model)))
    precision.begin_step(10**6)
    moe = unwrap_model(model).decoder.layers[1].mlp
    seen, routing, moe_input = [], [], []
    moe.router.register_forward_hook(lambda mod, args, out: routing.append(out[1].detach().clone()))
    moe.register_forward_pre_hook(lambda mod, args: moe_input.append(args[0].detach().clone()))
    for e in range(4):
        state = precision.states[f"decoder.layers.1.mlp.experts.local_experts.{e}.linear_fc1"]
        state.observer = lambda st, gemm, role, hp, fq, q=None, e=e: seen.append((e, gemm, role, hp.clone(), fq, q))
    forward_backward(model, seed=3)
    routing_map, tokens = routing[-1], moe_input[-1].reshape(-1, moe_input[-1].shape[-1])  # the training forward
    counts = routing_map.sum(0).tolist()
    assert len(set(counts)) > 1 and any(c % 16 for c in counts), counts  # uneven splits, unpadded shapes
    assert {(e, g, r) for e, g, r, *_ in seen} == {(e, g, r) for e in range(4) for g, r in COLUMNWISE}
    reference_policy = precision.states["decoder.layers.1.mlp.experts.local_experts.0.linear_fc1"].policy
    permuted = permute(tokens, routing_map, num_out_tokens=sum(counts))[0]  # the dispatcher's input to the experts
    own_scales = 0
    for e, gemm, role, hp, fq, q in seen:
        policy, columnwise = reference_policy(gemm, role), COLUMNWISE[gemm, role]
        if role is Role.ACTIVATIONS:  # the expert's own tokens, in token order
            assert torch.equal(hp.reshape(-1, hp.shape[-1]), tokens[routing_map[:, e]]), (e, gemm)
        elif role is Role.GRADIENTS:
            assert hp.shape[0] == counts[e], (e, gemm, hp.shape, counts)
        assert torch.equal(fq, fake_quant(hp, policy, columnwise=columnwise)), (e, gemm, role)
        if q is None:  # a copy reused from an earlier GEMM (per-tensor scales, 128x128 weight blocks)
            continue
        reference = quantize(hp, policy, columnwise=columnwise)
        assert torch.equal(q.codes.view(torch.uint8), reference.codes.view(torch.uint8)), (e, gemm, role)
        assert torch.equal(q.scale_inv, reference.scale_inv), (e, gemm, role)
        if role is Role.ACTIVATIONS:  # all experts' tokens quantized as one tensor: other amaxes, other scales
            together = quantize(permuted, policy, columnwise=columnwise)
            own_scales += together.amax.shape == q.amax.shape and not torch.equal(together.amax, q.amax)
    assert own_scales > 0


def test_train_script_trains_tiny_moe_with_hybrid(dataset, tmp_path):  # noqa: F811
    """The issue's command, shortened: plan.txt shows the experts and the router, the loss falls."""
    args = ["model=tiny_moe", "+recipe=hybrid", *dataset, *small_run(tmp_path, num_layers=2, steps=8)]
    proc = subprocess.run([sys.executable, "scripts/train.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    plan = (tmp_path / "plan.txt").read_text()
    cfg = {**moe_cfg(), "vocab_size": 384, "moe_layer_freq": 2, "moe_shared_expert_intermediate_size": None}
    assert plan == format_plan(PrecisionPlan(load_recipe("hybrid"), layout_of(cfg)), max_steps=8) + "\n"
    assert "  0        mlp.router" in plan and "MoE: 4 routed experts in layers 0;" in plan
    assert "  1        (all linears)" in plan  # the dense layer
    assert_learns([r["loss"] for r in read_metrics(tmp_path, "train")])
    rows = read_jsonl(tmp_path / "routing.jsonl")  # the MoE layer's tokens per expert, every step
    assert [(r["step"], r["layer"]) for r in rows] == [(s, 0) for s in range(1, 9)]
    for r in rows:  # micro-batch 4 x 128 tokens, each routed to 2 experts
        assert len(r["tokens"]) == 4 and sum(r["tokens"]) == 4 * 128 * 2, r
        assert r["imbalance"] == max(r["tokens"]) / (sum(r["tokens"]) / 4) and r["idle"] == r["tokens"].count(0)


def test_module_policies_give_the_experts_their_own_delayed_history(megatron_cpu):
    """moe_delayed: the routed experts keep 16 amaxes, everything else TE's 1024; the
    model trains a step under it (the emulated backend quantizes each module with its own policies)."""
    model = build(emulated=True)
    precision = attach_emulated_backend(model, PrecisionPlan(load_recipe("moe_delayed"), model_layout(model)))
    lengths = {name: {str(r): len(s.history) for r, s in state.scalers.items()}
               for name, state in precision.states.items()}
    assert lengths["decoder.layers.1.mlp.experts.local_experts.0.linear_fc1"] == {
        "weights": 16, "activations": 16, "gradients": 16}
    for name in ("decoder.layers.1.mlp.shared_experts.linear_fc2", "decoder.layers.1.self_attention.linear_qkv",
                 "decoder.layers.0.mlp.linear_fc1"):
        assert lengths[name] == {"weights": 1024, "activations": 1024, "gradients": 1024}, name
    precision.begin_step(0)
    _, loss, grads = forward_backward(model)
    assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads.values())


def test_nvfp4_with_rht_trains_experts_whose_token_counts_are_not_multiples_of_16(dataset, tmp_path):  # noqa: F811
    """The shipped nvfp4 recipe on tiny_moe: an expert's share of the tokens is rarely a multiple of 16, and the RHT
    rotates the wgrad copies in 16-token blocks: the emulated wgrad pads them with zero tokens (it used to fail
    there, in the first backward). The statistics measure the padded copies."""
    from fp8_recipes.rundir import read_numerics

    args = ["model=tiny_moe", "model.moe_layer_freq=1", "+recipe=nvfp4", "++recipe.layers.bf16_last=0",
            "++debug.interval=1", *dataset, *small_run(tmp_path, num_layers=2, steps=3)]
    proc = subprocess.run([sys.executable, "scripts/train.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    counts = [t for r in read_jsonl(tmp_path / "routing.jsonl") for t in r["tokens"]]
    assert any(t % 16 for t in counts), counts  # (else this test would not test the padding)
    rows = [r for r in read_numerics(tmp_path) if ".local_experts." in r["module"] and r["gemm"] == "wgrad"]
    assert rows and all(r["numel"] % (16 * 32) == 0 and "rht" in r["policy"] for r in rows), rows[:2]
    assert all(math.isfinite(r["loss"]) for r in read_metrics(tmp_path, "train"))
