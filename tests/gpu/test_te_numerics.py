"""fp8_recipes.numerics against Transformer Engine's own quantizers, bit for bit: FP8 codes (as uint8) and
scale_inv for per-tensor current scaling, delayed scaling with a given scale and over several steps of a
DelayedScaling recipe (amax history, scale), and 1x128 / 128x128 block scaling (rowwise and columnwise data,
in TE's transposed columnwise layout with its padded scale tensors); bf16 and fp32 inputs with edge values.

Also: forward-only FP8 (backward_override="high_precision") must give exactly the BF16 gradients.
"""

from __future__ import annotations

import dataclasses
import math
import zlib

import pytest
import torch

from fp8_recipes.backends.te import te_available, te_recipe
from fp8_recipes.numerics import DelayedScaler, nan_ignoring_amax, quantize
from fp8_recipes.plan.precision import TERecipe
from fp8_recipes.recipe.schema import AmaxAlgo, Format, Scaling, TensorPolicy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not (torch.cuda.is_available() and te_available()),
                                                  reason="needs a CUDA GPU with Transformer Engine")]

DTYPES = [torch.bfloat16, torch.float32]
KINDS = ["normal", "zeros", "zero_block", "huge", "tiny", "subnormal", "inf", "nan"]
FORMATS = [Format.E4M3, Format.E5M2]


def edge_tensor(dtype: torch.dtype, kind: str, shape=(256, 384)) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(kind.encode()))  # hash() of a str changes per process
    x = torch.randn(shape, generator=g) * 3
    if kind == "zeros":
        x.zero_()
    elif kind == "zero_block":  # an all-zero 128x128 block and an all-zero row
        x[:128, :128] = 0
        x[shape[0] - 1, :] = 0
    elif kind == "huge":
        x[5, 7], x[130, 300] = 3.0e38, -1.0e30
    elif kind == "tiny":
        x *= 1e-30
    elif kind == "subnormal":  # below float32's smallest normal: the scale overflows to float32 max
        x *= 1e-40
    elif kind == "inf":
        x[3, 100], x[shape[0] - 3, 5] = math.inf, -math.inf
    elif kind == "nan":
        x[3, 100] = math.nan
    return x.to(dtype).cuda()


def te_dtype(fmt: Format):
    import transformer_engine_torch as tex

    return tex.DType.kFloat8E4M3 if fmt is Format.E4M3 else tex.DType.kFloat8E5M2


def assert_same_bits(te_t: torch.Tensor, ours: torch.Tensor, what: str, x: torch.Tensor | None = None) -> None:
    """Equal bit patterns (codes as uint8, scales as int32: NaN == NaN, -0 != +0)."""
    view = torch.uint8 if te_t.element_size() == 1 else torch.int32
    a, b = te_t.contiguous().view(view), ours.contiguous().view(view).to(te_t.device)
    assert a.shape == b.shape, f"{what}: TE shape {tuple(a.shape)}, ours {tuple(b.shape)}"
    bad = (a != b).nonzero()
    if len(bad):
        idx = [tuple(i.tolist()) for i in bad[:5]]
        detail = [(i, int(a[i]), int(b[i]), float(x[i]) if x is not None and x.shape == a.shape else None)
                  for i in idx]
        pytest.fail(f"{what}: {len(bad)} of {a.numel()} differ; (index, TE, ours, input): {detail}")


# ---------------------------------------------------------------------------------------------------------------
# Per-tensor scaling


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_current_scaling(dtype, kind, fmt, pow2):
    import transformer_engine.pytorch as te

    x = edge_tensor(dtype, kind)
    q = te.Float8CurrentScalingQuantizer(te_dtype(fmt), torch.device("cuda"), rowwise=True, columnwise=True,
                                         force_pow_2_scales=pow2)(x)
    ours = quantize(x, TensorPolicy(scaling=Scaling.TENSORWISE, format=fmt, pow2_scales=pow2))
    assert_same_bits(q._data, ours.codes.reshape(x.shape), "codes", x)
    assert_same_bits(q._scale_inv.reshape(()), ours.scale_inv.reshape(()), "scale_inv")
    if q._transpose is not None:  # Hopper keeps a transposed copy for the columnwise GEMM operand
        assert_same_bits(q._transpose, ours.codes.reshape(x.shape).t(), "transposed codes")


def test_current_scaling_amax_epsilon():
    import transformer_engine.pytorch as te

    x = edge_tensor(torch.float32, "tiny")
    q = te.Float8CurrentScalingQuantizer(te_dtype(Format.E4M3), torch.device("cuda"), amax_epsilon=1e-3)(x)
    ours = quantize(x, TensorPolicy(scaling=Scaling.TENSORWISE, amax_epsilon=1e-3))
    assert_same_bits(q._data, ours.codes.reshape(x.shape), "codes", x)
    assert_same_bits(q._scale_inv.reshape(()), ours.scale_inv.reshape(()), "scale_inv")


@pytest.mark.parametrize("scale", [1.0, 37.5, 2.0**20, 1e-3])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", ["normal", "huge", "tiny", "inf", "nan"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_delayed_quantizer_with_a_given_scale(dtype, kind, fmt, scale):
    import transformer_engine.pytorch as te

    x = edge_tensor(dtype, kind)
    te_scale = torch.tensor([scale], dtype=torch.float32, device="cuda")
    te_amax = torch.zeros(1, dtype=torch.float32, device="cuda")
    q = te.Float8Quantizer(te_scale, te_amax, te_dtype(fmt))(x)
    policy = TensorPolicy(scaling=Scaling.DELAYED, format=fmt)
    scaler = DelayedScaler(policy, device="cuda")
    scaler.scale = te_scale.reshape(()).clone()
    ours = quantize(x, policy, scaler=scaler)
    assert_same_bits(q._data, ours.codes.reshape(x.shape), "codes", x)
    assert_same_bits(q._scale_inv.reshape(()), ours.scale_inv.reshape(()), "scale_inv")
    assert_same_bits(te_amax.reshape(()), scaler.history[0], "recorded amax")


@pytest.mark.parametrize("algo,margin,history,pow2", [
    (AmaxAlgo.MAX, 0, 4, False), (AmaxAlgo.MOST_RECENT, 1, 4, False), (AmaxAlgo.PERCENTILE, 0, 8, False),
    (AmaxAlgo.MAX, 2, 1024, True)])
def test_delayed_scaling_steps_match_delayed_scaler(algo, margin, history, pow2):
    """Six steps of a te.Linear under our DelayedScaling recipe (te_recipe: callables for percentile and pow2):
    TE's amax histories and scales after each step equal DelayedScaler's, for input, weight and grad_output."""
    import transformer_engine.pytorch as te

    fwd = TensorPolicy(scaling=Scaling.DELAYED, margin=margin, amax_history_len=history, amax_compute_algo=algo,
                       percentile=90.0, pow2_scales=pow2)
    bwd = dataclasses.replace(fwd, format=Format.E5M2)
    recipe = te_recipe(TERecipe("DelayedScaling", fwd, fwd, bwd), reduce_amax=False)
    torch.manual_seed(0)
    lin = te.Linear(256, 128, bias=False, params_dtype=torch.bfloat16, device="cuda")
    ours = {"input": DelayedScaler(fwd, "cuda"), "weight": DelayedScaler(fwd, "cuda"),
            "grad_output": DelayedScaler(bwd, "cuda")}
    for step, magnitude in enumerate([1.0, 10.0, 0.1, 100.0, 3.0, 0.01]):
        x = (torch.randn(64, 256, device="cuda") * magnitude).bfloat16().requires_grad_()
        dy = (torch.randn(64, 128, device="cuda") * magnitude * 1e-3).bfloat16()
        with te.autocast(enabled=True, recipe=recipe):
            y = lin(x)
        y.backward(dy)
        for name, t in (("input", x), ("weight", lin.weight), ("grad_output", dy)):
            ours[name].observe(nan_ignoring_amax(t))
            ours[name].update()
        states = {"input": (lin.fp8_meta["scaling_fwd"], 0), "weight": (lin.fp8_meta["scaling_fwd"], 1),
                  "grad_output": (lin.fp8_meta["scaling_bwd"], 0)}
        for name, (state, i) in states.items():
            assert_same_bits(state.amax_history[:, i], ours[name].history, f"step {step} {name} amax history")
            assert_same_bits(state.scale[i], ours[name].scale, f"step {step} {name} scale")


# ---------------------------------------------------------------------------------------------------------------
# Block scaling


@pytest.mark.parametrize("shape", [(256, 384), (200, 320)])
@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dim", [1, 2])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_block_scaling(dtype, kind, dim, fmt, pow2, shape):
    import transformer_engine.pytorch as te

    x = edge_tensor(dtype, kind, shape)
    m, k = x.shape
    mt, kt = -(-m // 128), -(-k // 128)
    q = te.Float8BlockQuantizer(te_dtype(fmt), rowwise=True, columnwise=True, force_pow_2_scales=pow2,
                                block_scaling_dim=dim)(x)
    policy = TensorPolicy(scaling=Scaling.BLOCKWISE, format=fmt, pow2_scales=pow2,
                          block=(1, 128) if dim == 1 else (128, 128))
    row, col = quantize(x, policy), quantize(x, policy, columnwise=True)
    # rowwise: the data as laid out; scales (k-tiles, m padded to 4) for 1x128, (m-tiles, k-tiles padded) for 2D
    assert_same_bits(q._rowwise_data, row.codes, "rowwise codes", x)
    te_row = q._rowwise_scale_inv[:, :m].t() if dim == 1 else q._rowwise_scale_inv[:, :kt]
    assert_same_bits(te_row, row.scale_inv, "rowwise scale_inv")
    # columnwise: TE stores x^T quantized along its last dim (128x1 blocks of x for 1D); scales likewise transposed
    assert_same_bits(q._columnwise_data, col.codes.t(), "columnwise codes (x^T)", x.t())
    te_col = q._columnwise_scale_inv[:, :k] if dim == 1 else q._columnwise_scale_inv[:, :mt].t()
    assert_same_bits(te_col, col.scale_inv, "columnwise scale_inv")


# ---------------------------------------------------------------------------------------------------------------
# Forward-only FP8: the backward must be the BF16 one (docs/facts.md records a training anomaly: check the gradients)


def _policies(scaling: Scaling):
    fwd = TensorPolicy(scaling=scaling, pow2_scales=scaling is Scaling.BLOCKWISE,
                       block=(128, 128) if scaling is Scaling.BLOCKWISE else (1, 128))
    act = dataclasses.replace(fwd, block=(1, 128))
    grad = dataclasses.replace(act, format=Format.E5M2)
    return fwd, act, grad


@pytest.mark.parametrize("module", ["Linear", "LayerNormLinear"])
@pytest.mark.parametrize("carrier,scaling", [("Float8CurrentScaling", Scaling.TENSORWISE),
                                             ("Float8BlockScaling", Scaling.BLOCKWISE),
                                             ("CustomRecipe", Scaling.DELAYED)])
def test_forward_only_fp8_gives_the_bf16_gradients(module, carrier, scaling):
    import transformer_engine.pytorch as te

    w, a, g = _policies(scaling)
    recipe = te_recipe(TERecipe(carrier, w, a, g, forward_only=True), reduce_amax=False)
    torch.manual_seed(0)
    kw = dict(bias=False, params_dtype=torch.bfloat16, device="cuda")
    lin = te.Linear(512, 256, **kw) if module == "Linear" else te.LayerNormLinear(512, 256, normalization="RMSNorm",
                                                                                  **kw)
    x0 = torch.randn(256, 512, device="cuda").bfloat16()
    dy = torch.randn(256, 256, device="cuda").bfloat16() * 0.01
    grads = {}
    for mode in ("bf16", "fp8 fwd"):
        x = x0.clone().requires_grad_()
        for p in lin.parameters():
            p.grad = None
        with te.autocast(enabled=mode != "bf16", recipe=recipe):
            y = lin(x)
        y.backward(dy)
        grads[mode] = [x.grad] + [p.grad for p in lin.parameters()]
        if mode == "fp8 fwd":
            assert lin.fp8 and lin.fp8_meta["recipe"].backward_override == "high_precision"
    for i, (ref, got) in enumerate(zip(grads["bf16"], grads["fp8 fwd"], strict=True)):
        err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
        assert err < 1e-3, f"gradient {i}: relative error {err:.3g} against BF16 (FP8 gradients would be ~0.04)"
