"""The emulated backend's NVFP4 GEMMs against dequantize(quantize(...)) products computed here, independently of the
backend: 1x16 blocks along each GEMM's reduction dim, 16x16 weights, the RHT on both wgrad copies (cancelling in the
product), stochastic rounding of gradients drawn from (run seed, step, module, GEMM, micro-batch)."""

from __future__ import annotations

import pytest
import torch

from fp8_recipes.backends.emulated import EmulatedLinearState, EmulatedPrecision, emulated_linear
from fp8_recipes.numerics.nvfp4 import dequantize_nvfp4, quantize_nvfp4, stochastic_rounding_seed
from fp8_recipes.plan.precision import ModelLayout, PrecisionPlan
from fp8_recipes.recipe.schema import Recipe

NAME = "decoder.layers.0.mlp.linear_fc1"
PAPER = {"weights": {"scaling": "nvfp4", "block": [16, 16]}, "activations": {"scaling": "nvfp4", "rht": True},
         "gradients": {"scaling": "nvfp4", "rht": True, "stochastic_rounding": True}}


def controller(recipe: dict, seed: int = 1234) -> tuple[EmulatedPrecision, EmulatedLinearState]:
    state = EmulatedLinearState(NAME)
    plan = PrecisionPlan(Recipe.from_dict({"name": "t", "backend": "emulated", **recipe}), ModelLayout(1, (NAME,)))
    return EmulatedPrecision(plan, {NAME: state}, seed=seed), state


def operands(seed: int = 0):
    """x [2, 24, 80] (48 tokens), w [96, 80], dy [2, 24, 96]: rows of very different magnitudes."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 24, 80, generator=g) * torch.exp(torch.randn(2, 24, 1, generator=g))
    w = torch.randn(96, 80, generator=g) * 0.05 * torch.exp(torch.randn(96, 1, generator=g))
    dy = torch.randn(2, 24, 96, generator=g) * 1e-3 * torch.exp(torch.randn(96, generator=g))
    return x, w, dy


def run(state, x, w, dy):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = emulated_linear(x, w, state)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


def fq(t, **kw):
    return dequantize_nvfp4(quantize_nvfp4(t, **kw))


def test_fprop_and_dgrad_equal_the_dequantized_operands_product():
    precision, state = controller(PAPER)
    precision.begin_step(0)
    x, w, dy = operands()
    y, dx, _ = run(state, x, w, dy)
    xq, wq = fq(x, block=(1, 16)), fq(w, block=(16, 16))  # rowwise: 16 values along in_features
    assert torch.equal(y, torch.matmul(xq, wq.t()))
    dy2 = dy.reshape(-1, 96)
    seed = stochastic_rounding_seed(1234, 0, NAME, "dgrad", 1)
    dyq = fq(dy2, block=(1, 16), stochastic_rounding=True, seed=seed)  # along out_features
    wq_t = fq(w, block=(16, 16), columnwise=True)  # 16x16: the same values as fprop's copy
    assert torch.equal(wq_t, wq)
    assert torch.equal(dx, torch.matmul(dyq, wq_t).reshape(dx.shape))


def test_wgrad_reads_both_copies_rotated_along_the_tokens():
    precision, state = controller(PAPER)
    precision.begin_step(3)
    x, w, dy = operands(1)
    _, _, dw = run(state, x, w, dy)
    x2, dy2 = x.reshape(-1, 80), dy.reshape(-1, 96)
    seed = stochastic_rounding_seed(1234, 3, NAME, "wgrad", 1)
    dyq = fq(dy2, columnwise=True, rht=True, stochastic_rounding=True, seed=seed)
    xq = fq(x2, columnwise=True, rht=True)
    assert torch.equal(dw, torch.matmul(dyq.t(), xq))
    # the rotation cancels: dw is as near dy^T x as without it, and a rotation of one side only is far off
    exact = dy2.double().t() @ x2.double()
    err = (dw.double() - exact).norm() / exact.norm()
    plain = fq(dy2, columnwise=True).double().t() @ fq(x2, columnwise=True).double()
    one_sided = dyq.double().t() @ fq(x2, columnwise=True).double()
    assert err < 0.3 and err < 2 * (plain - exact).norm() / exact.norm()
    assert (one_sided - exact).norm() / exact.norm() > 0.8


def test_a_mixed_recipe_quantizes_each_role_its_own_way():
    precision, state = controller({"weights": "nvfp4", "activations": "blockwise", "gradients": "tensorwise"})
    precision.begin_step(0)
    x, w, dy = operands(2)
    y, _, _ = run(state, x, w, dy)
    from fp8_recipes.numerics import fake_quant

    xq = fake_quant(x, Recipe.from_dict({"activations": "blockwise"}).activations)
    assert torch.equal(y, torch.matmul(xq, fq(w, block=(1, 16)).t()))


def test_stochastic_rounding_repeats_per_step_and_differs_across_steps_and_micro_batches():
    x, w, dy = operands(3)

    def grads(step, seed=1234, micro_batches=1):
        precision, state = controller(PAPER, seed)
        precision.begin_step(step)
        return [run(state, x, w, dy)[1:] for _ in range(micro_batches)]

    (dx0, dw0), = grads(5)
    (dx1, dw1), = grads(5)
    assert torch.equal(dx0, dx1) and torch.equal(dw0, dw1)  # a resumed step draws the same numbers
    (dx2, _), = grads(6)
    (dx3, _), = grads(5, seed=99)
    first, second = grads(5, micro_batches=2)
    assert not torch.equal(dx0, dx2) and not torch.equal(dx0, dx3) and not torch.equal(first[0], second[0])
    assert torch.equal(first[0], dx0)
    rtn, state = controller({**PAPER, "gradients": {"scaling": "nvfp4", "rht": True}})
    rtn.begin_step(5)
    assert not torch.equal(run(state, x, w, dy)[1], dx0)  # (and SR is not round-to-nearest)


def test_rht_pads_the_tokens_to_whole_16_token_blocks():
    """14 tokens (an expert's share, an odd seq x micro-batch): wgrad reads both copies zero-padded to 16 tokens
    and rotated, as a run that pads its tokens computes it; fprop and dgrad see the 14 tokens as they are."""
    precision, state = controller(PAPER)
    precision.begin_step(2)
    x, w, dy = operands(4)
    x, dy = x[:, :7], dy[:, :7]
    y, dx, dw = run(state, x, w, dy)
    x2, dy2 = x.reshape(-1, 80), dy.reshape(-1, 96)
    pad = torch.nn.functional.pad
    seed = stochastic_rounding_seed(1234, 2, NAME, "wgrad", 1)
    dyq = fq(pad(dy2, (0, 0, 0, 2)), columnwise=True, rht=True, stochastic_rounding=True, seed=seed)
    xq = fq(pad(x2, (0, 0, 0, 2)), columnwise=True, rht=True)
    assert dyq.shape == (16, 96) and torch.equal(dw, torch.matmul(dyq.t(), xq))
    exact = dy2.double().t() @ x2.double()
    assert (dw.double() - exact).norm() / exact.norm() < 0.3  # the zeros add nothing; the rotation cancels
    assert y.shape == (2, 7, 96) and dx.shape == x.shape
