"""Megatron-Core's TE experts quantize like the emulated experts (issue 28, item 4): Transformer Engine 2.20.2's
GroupedLinear keeps one quantizer per expert GEMM, and each expert's operands are its own split of the tokens.

Checked against fp8_recipes.numerics, bit for bit, on uneven splits with an expert that receives no token:
- delayed scaling: after each of several steps, every expert GEMM's amax history and scale (input, weight,
  grad_output) equal a DelayedScaler fed that expert's own split; for an expert without tokens TE neither records
  an amax nor rolls the input's and grad_output's histories (their scales stay), while the weight's rolls;
- current (tensorwise) and block (1x128, 128x128) scaling: each split's FP8 codes, as TE's split quantization
  produced them inside GroupedLinear's forward (captured), equal ours quantizing that split alone.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fp8_recipes.backends.te import te_available, te_recipe
from fp8_recipes.numerics import DelayedScaler, nan_ignoring_amax, quantize
from fp8_recipes.plan.precision import TERecipe
from fp8_recipes.recipe.schema import Format, Scaling, TensorPolicy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not (torch.cuda.is_available() and te_available()),
                                                  reason="needs a CUDA GPU with Transformer Engine")]

EXPERTS, K, N = 4, 256, 384
SPLITS = [[48, 0, 80, 128], [16, 112, 0, 128], [0, 0, 256, 0], [64, 64, 64, 64], [96, 32, 0, 128]]
"""Tokens per expert per step (multiples of 16, TE's FP8 GEMM rule; an expert without tokens in most steps)."""


def grouped(dtype=torch.bfloat16):
    import transformer_engine.pytorch as te

    torch.manual_seed(0)
    return te.GroupedLinear(EXPERTS, K, N, bias=False, params_dtype=dtype, device="cuda")


def step_inputs(step: int, splits: list[int]):
    g = torch.Generator(device="cuda").manual_seed(100 + step)
    scale = [1.0, 10.0, 0.1, 100.0, 3.0][step % 5]
    x = (torch.randn(sum(splits), K, device="cuda", generator=g) * scale).bfloat16().requires_grad_()
    dy = (torch.randn(sum(splits), N, device="cuda", generator=g) * scale * 1e-3).bfloat16()
    return x, dy


def run_step(module, recipe, splits, x, dy):
    import transformer_engine.pytorch as te

    with te.autocast(enabled=True, recipe=recipe):
        y = module(x, splits)
    y.backward(dy)


def test_delayed_histories_and_scales_are_per_expert():
    fwd = TensorPolicy(scaling=Scaling.DELAYED, amax_history_len=4)
    bwd = dataclasses.replace(fwd, format=Format.E5M2)
    recipe = te_recipe(TERecipe("DelayedScaling", fwd, fwd, bwd), reduce_amax=False)
    module = grouped()
    ours = [{"input": DelayedScaler(fwd, "cuda"), "weight": DelayedScaler(fwd, "cuda"),
             "grad_output": DelayedScaler(bwd, "cuda")} for _ in range(EXPERTS)]
    for step, splits in enumerate(SPLITS):
        x, dy = step_inputs(step, splits)
        run_step(module, recipe, splits, x, dy)
        for e, (xs, dys) in enumerate(zip(torch.split(x, splits), torch.split(dy, splits))):
            w = getattr(module, f"weight{e}")
            for name, t in (("input", xs), ("weight", w), ("grad_output", dys)):
                if t.numel() == 0:  # an empty split neither records nor rolls (what TE does: measured here)
                    continue
                ours[e][name].observe(nan_ignoring_amax(t))
                ours[e][name].update()
        fwd_meta, bwd_meta = module.fp8_meta["scaling_fwd"], module.fp8_meta["scaling_bwd"]
        for e in range(EXPERTS):
            for name, meta, i in (("input", fwd_meta, 3 * e), ("weight", fwd_meta, 3 * e + 1),
                                  ("grad_output", bwd_meta, 2 * e)):
                what = f"step {step} expert {e} ({splits[e]} tokens) {name}"
                assert torch.equal(meta.amax_history[:, i].view(torch.int32),
                                   ours[e][name].history.view(torch.int32)), (
                    what, meta.amax_history[:, i].tolist(), ours[e][name].history.tolist())
                assert torch.equal(meta.scale[i].view(torch.int32), ours[e][name].scale.view(torch.int32)), (
                    what, float(meta.scale[i]), float(ours[e][name].scale))


def _capture(monkeypatch):
    """Every split quantization inside GroupedLinear's forward: (the 2-D input, the splits, TE's outputs)."""
    import transformer_engine.pytorch.module.grouped_linear as gl

    calls = []
    real = gl._split_quantization._split_quantize

    def spy(tensor, splits, quantizers, *args, **kwargs):
        out = real(tensor, splits, quantizers, *args, **kwargs)
        parts = out[0] if isinstance(out, tuple) else out  # (TE 2.20.2 returns (quantized splits, extra))
        # copied now: the backward frees the saved inputs' FP8 data
        calls.append((tensor.detach().clone(), list(splits), [_codes(q) for q in parts]))
        return out

    monkeypatch.setattr(gl._split_quantization, "_split_quantize", spy)
    return calls


def _codes(q) -> torch.Tensor | None:
    """A copy of TE's rowwise FP8 codes of one split as uint8 (a Float8 or a Float8Blockwise storage), or None."""
    for attr in ("_data", "_rowwise_data"):
        data = getattr(q, attr, None)
        if data is not None:
            return data.view(torch.uint8).clone()
    return None


@pytest.mark.parametrize("kind", ["Float8CurrentScaling", "block1d"])
def test_each_split_is_quantized_alone(monkeypatch, kind):
    if kind == "Float8CurrentScaling":
        act = TensorPolicy(scaling=Scaling.TENSORWISE)
        choice = TERecipe("Float8CurrentScaling", act, act, dataclasses.replace(act, format=Format.E5M2))
    else:
        act = TensorPolicy(scaling=Scaling.BLOCKWISE, pow2_scales=True, block=(1, 128))  # (TE: no 2D x 2D GEMM)
        weights = dataclasses.replace(act, block=(128, 128))
        choice = TERecipe("Float8BlockScaling", weights, act, dataclasses.replace(act, block=(1, 128)))
    recipe = te_recipe(choice, reduce_amax=False)
    module = grouped()
    calls = _capture(monkeypatch)
    splits = SPLITS[0]
    x, dy = step_inputs(0, splits)
    run_step(module, recipe, splits, x, dy)
    assert calls, "GroupedLinear took no split-quantize path (the native grouped-tensor path?)"
    tensor, got_splits, outs = calls[0]  # the forward's input
    assert got_splits == splits and len(outs) == EXPERTS
    for e, (part, codes) in enumerate(zip(torch.split(tensor, splits), outs)):
        if part.shape[0] == 0:  # TE quantizes nothing for an expert without tokens
            assert codes is None or codes.numel() == 0, f"expert {e}: codes for an empty split"
            continue
        assert codes is not None, f"expert {e}: no rowwise codes"
        mine = quantize(part, choice.activations)
        te_codes = codes.reshape(-1)[: part.numel()].reshape(part.shape)
        bad = int((te_codes != mine.codes.reshape(part.shape).view(torch.uint8)).sum())
        assert bad == 0, f"{kind} expert {e} ({splits[e]} tokens): {bad} of {part.numel()} codes differ"
