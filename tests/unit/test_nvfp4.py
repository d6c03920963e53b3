"""NVFP4 numerics against an independent float64 reference, bit for bit, plus packing, the RHT and stochastic rounding.

The reference below is written from the format definitions, not from fp8_recipes.numerics.nvfp4: E2M1 is "the
nearest of {0, .5, 1, 1.5, 2, 3, 4, 6}, ties to the even code"; E4M3 is "round the significand to 3 bits, ties to
even, quantum 2^-9 below 2^-6"; each float32 operation TE performs is done in float64 and rounded to float32
(exact for a product of two float32 values; correctly rounded for a quotient, as float64 has > 2 * 24 + 2 bits);
the Hadamard matrix comes from H[i, j] = (-1)^popcount(i & j). The order of TE's float32 steps is the one
fp8_recipes.numerics.nvfp4's docstring records (TE 2.20.2's NVFP4QuantizerRef); tests/gpu/test_nvfp4_ref.py
checks the module against TE itself.
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch

from fp8_recipes.numerics import (
    NVFP4Quantized, apply_rht, dequantize_nvfp4, fake_quant_nvfp4, quantize_nvfp4, rht_matrix,
)
from fp8_recipes.numerics.nvfp4 import RHT_SIGNS, e2m1_codes, e2m1_to_float32, pack_e2m1, unpack_e2m1

F32_MAX = torch.finfo(torch.float32).max
GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)  # TE's get_wgrad_sign_vector, restated
BLOCKS = [(1, 16), (16, 16)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
KINDS = ["normal", "zeros", "zero_block", "huge", "tiny", "subnormal", "inf", "nan", "negzero", "spread"]


# ---------------------------------------------------------------------------------------------------------------
# The float64 reference


def t64(v: float) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float64)


def f32(t: torch.Tensor) -> torch.Tensor:
    """Round float64 values to float32 (nearest even; beyond float32 max: inf), kept as float64."""
    return t.to(torch.float32).to(torch.float64)


def ref_e4m3(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(value, byte) of E4M3 round-to-nearest-even of v in [0, 448] or NaN (1 sign, 4 exponent bits of bias 7,
    3 mantissa bits; exponent field 0: subnormals m * 2^-9; S.1111.111 is NaN)."""
    _, ex = torch.frexp(v.nan_to_num(0.0))
    e = torch.clamp(ex - 1, min=-6)  # v = 1.f * 2^e; below 2^-6 the quantum stays 2^-9
    quantum = torch.exp2((e - 3).double())
    q = torch.round(v / quantum) * quantum  # round() is half-to-even
    _, qex = torch.frexp(q)
    qe = qex - 1
    normal = q >= 2.0**-6
    exp_field = torch.where(normal, qe + 7, torch.zeros_like(qe))
    mant = torch.where(normal, q / torch.exp2(qe.double()) * 8 - 8, q / 2.0**-9)
    byte = (exp_field * 8 + mant.round().long()).to(torch.uint8)
    nan = torch.isnan(v)
    return torch.where(nan, v, q), torch.where(nan, torch.full_like(byte, 0x7F), byte)


def ref_e2m1(v: torch.Tensor) -> torch.Tensor:
    """E2M1 codes of v in [-6, 6] (or NaN -> 0): nearest grid magnitude, ties to the even code; sign for v < 0."""
    grid = torch.tensor(GRID, dtype=torch.float64)
    dist = (v.abs().nan_to_num(0.0)[..., None] - grid).abs()
    nearest = dist == dist.min(dim=-1, keepdim=True).values
    idx = torch.arange(8)
    key = torch.where(nearest, idx % 2, torch.full_like(idx, 2))  # among the nearest, an even code first
    mag = key.argmin(dim=-1)
    return (mag + 8 * (v < 0).long()).to(torch.uint8)


def ref_global_scale(amax: float) -> float:
    if math.isnan(amax):
        return math.nan
    if amax == 0 or math.isinf(amax):
        return 1.0
    return min(float(f32(t64(448.0 * 6.0 / amax))), F32_MAX)


def ref_rht(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Each 16 values along the last dim times diag(SIGNS) H16 / 4, summed k = 0..15 in float32, then `dtype`."""
    h = torch.tensor([[SIGNS[i] * (-1) ** bin(i & j).count("1") / 4 for j in range(16)] for i in range(16)],
                     dtype=torch.float64)
    blocks = x.reshape(-1, 16)
    acc = torch.zeros_like(blocks)
    for k in range(16):
        acc = f32(acc + blocks[:, k:k + 1] * h[k])
    return acc.reshape(x.shape).to(torch.float32).to(dtype).to(torch.float64)


def ref_quantize(x: torch.Tensor, block, columnwise: bool, rht: bool) -> dict:
    rows, cols = math.prod(x.shape[:-1]), x.shape[-1]
    v = x.reshape(rows, cols).double()
    if columnwise:
        v = v.T
        if rht:
            v = ref_rht(v, x.dtype)
    r, c = v.shape
    amax = math.nan if torch.isnan(v).any() else (float(v.abs().max()) if v.numel() else 0.0)
    s_enc = ref_global_scale(amax)
    padded = torch.zeros(-(-r // block[0]) * block[0], -(-c // 16) * 16, dtype=torch.float64)
    padded[:r, :c] = v
    nb = padded.shape[1] // 16
    seg = padded.reshape(padded.shape[0], nb, 16)
    if block[0] == 1:
        bamax = seg.abs().amax(dim=-1)
    else:
        bamax = padded.reshape(-1, 16, nb, 16).abs().amax(dim=(1, 3)).repeat_interleave(16, dim=0)
    dec = f32(bamax * f32(t64(s_enc) * f32(t64(1 / 6))))  # torch.amax keeps NaN, as torch.max
    dec_val, dec_byte = ref_e4m3(torch.clamp(torch.minimum(dec, t64(F32_MAX)), max=448.0))
    s_dec = f32(t64(1.0 / s_enc))
    enc = torch.minimum(f32(1.0 / f32(dec_val * s_dec)), t64(F32_MAX))
    codes = ref_e2m1(torch.clamp(f32(seg * enc[..., None]), -6, 6)).reshape(padded.shape)[:r, :c]
    if c % 2:
        codes = torch.cat([codes, torch.zeros(r, 1, dtype=torch.uint8)], dim=1)
    packed = codes[:, 0::2] + 16 * codes[:, 1::2]
    # dequantize: code * ((scale * amax) * fp32(1/2688)), float32 products, then the input dtype
    per_block = f32(f32(dec_val * amax) * f32(t64(1 / 2688)))
    grid = torch.tensor(GRID + tuple(-g for g in GRID), dtype=torch.float64)
    values = grid[codes[:, :c].long()]
    deq = f32(values * per_block[:r].repeat_interleave(16, dim=1)[:, :c])
    deq = (deq.T if columnwise else deq).reshape(x.shape).to(torch.float32).to(x.dtype)
    return {"codes": packed, "scales": dec_byte[:r], "amax": amax, "scale": s_enc, "deq": deq}


# ---------------------------------------------------------------------------------------------------------------
# Inputs


def edge_tensor(kind: str, dtype: torch.dtype, shape=(64, 48), seed: int = 0) -> torch.Tensor:
    """3 * randn of `shape` (on the CPU), made into edge case `kind` (one of KINDS). Also tests/gpu's inputs."""
    g = torch.Generator().manual_seed(seed + zlib.crc32(f"{kind}{dtype}{shape}".encode()))
    x = torch.randn(shape, generator=g) * 3
    flat = x.view(-1, shape[-1])
    if kind == "zeros":
        x.zero_()
    elif kind == "zero_block":  # an all-zero 16x16 block and an all-zero row
        flat[:16, :16] = 0
        flat[-1] = 0
    elif kind == "huge":
        flat[5, 7], flat[-2, 3] = 3.0e38, -1.0e30
    elif kind == "tiny":
        x *= 1e-30
    elif kind == "subnormal":  # below float32's smallest normal: S_enc overflows to float32 max
        x *= 1e-40
    elif kind == "inf":
        flat[3, 10], flat[-3, 5] = math.inf, -math.inf
    elif kind == "nan":
        flat[3, 10] = math.nan
    elif kind == "negzero":
        x[x.abs() < 1] = -0.0
    elif kind == "spread":  # 60 binades: blocks whose scale underflows or saturates
        x = x * torch.exp2(torch.randint(-30, 30, shape, generator=g).float())
    if dtype is torch.float16 and kind in ("huge", "subnormal", "spread"):
        x = x.clamp(-6e4, 6e4)  # float16 would make these inf or zero: another case
    return x.to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit patterns (-0.0 != 0.0), any NaN equal to any NaN (its sign and payload depend on the device)."""
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    nan = torch.isnan(a)
    if a.shape != b.shape or not torch.equal(nan, torch.isnan(b)):
        return False
    return torch.equal(a.contiguous().view(view)[~nan], b.contiguous().view(view)[~nan])


def assert_matches_reference(x: torch.Tensor, block, columnwise: bool, rht: bool) -> None:
    q = quantize_nvfp4(x, block=block, columnwise=columnwise, rht=rht)
    ref = ref_quantize(x, block, columnwise, rht)
    where = f"block={block} columnwise={columnwise} rht={rht} dtype={x.dtype}"
    bad = (q.codes != ref["codes"]).nonzero()
    assert q.codes.shape == ref["codes"].shape and not len(bad), f"{where}: codes differ at {bad[:5].tolist()}"
    assert torch.equal(q.block_scales.view(torch.uint8), ref["scales"]), f"{where}: block scales differ"
    amax, scale = float(q.global_amax), float(q.global_scale)
    assert amax == ref["amax"] or (math.isnan(amax) and math.isnan(ref["amax"])), where
    assert scale == ref["scale"] or (math.isnan(scale) and math.isnan(ref["scale"])), where
    assert same_bits(dequantize_nvfp4(q), ref["deq"]), f"{where}: dequantized values differ"


# ---------------------------------------------------------------------------------------------------------------
# Bit-exact against the reference


@pytest.mark.parametrize("rht", [False, True])
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("kind", KINDS)
def test_matches_reference(kind, dtype, block, rht):
    x = edge_tensor(kind, dtype)
    for columnwise in (False, True):
        assert_matches_reference(x, block, columnwise, rht)


@pytest.mark.parametrize("shape", [(7, 30), (17, 18), (2, 3, 40), (1, 16), (33, 5)])
@pytest.mark.parametrize("block", BLOCKS)
def test_partial_blocks_and_odd_shapes_match_reference(shape, block):
    x = edge_tensor("normal", torch.bfloat16, shape)
    for columnwise in (False, True):
        assert_matches_reference(x, block, columnwise, rht=False)


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("kind", KINDS)
def test_fake_quant_is_quantize_then_dequantize_bit_for_bit(kind, dtype, block):
    """fake_quant_nvfp4 (no codes: steps x step size x decode factor, the amax from the block amaxes) against the
    quantizer's codes decoded, every edge kind, both copies, RHT or not, stochastic rounding with one seed."""
    x = edge_tensor(kind, dtype)
    for columnwise, rht, sr in ((False, False, False), (True, False, False), (True, True, False),
                                (False, False, True), (True, True, True)):
        kw = dict(block=block, columnwise=columnwise, rht=rht, stochastic_rounding=sr, seed=7 if sr else None)
        assert same_bits(fake_quant_nvfp4(x, **kw), dequantize_nvfp4(quantize_nvfp4(x, **kw))), (kind, kw)


@pytest.mark.parametrize("shape", [(7, 30), (17, 18), (2, 3, 40), (1, 16), (33, 5), (0, 16)])
def test_fake_quant_pads_and_crops_as_the_quantizer(shape):
    x = edge_tensor("normal", torch.bfloat16, shape) if math.prod(shape) else torch.zeros(shape)
    for block in BLOCKS:
        for columnwise in (False, True):
            kw = dict(block=block, columnwise=columnwise)
            assert same_bits(fake_quant_nvfp4(x, **kw), dequantize_nvfp4(quantize_nvfp4(x, **kw))), (shape, kw)


def test_rht_on_3d_input_matches_reference():
    x = edge_tensor("normal", torch.float32, (2, 16, 48))
    assert_matches_reference(x, (1, 16), columnwise=True, rht=True)


def test_layout_shapes_and_fields():
    x = torch.randn(40, 50)
    row = quantize_nvfp4(x, block=(16, 16))
    col = quantize_nvfp4(x, block=(16, 16), columnwise=True, rht=False)
    assert isinstance(row, NVFP4Quantized)
    assert row.codes.shape == (40, 25) and row.codes.dtype == torch.uint8
    assert row.block_scales.shape == (40, 4) and row.block_scales.dtype == torch.float8_e4m3fn
    assert col.codes.shape == (50, 20) and col.block_scales.shape == (50, 3)
    assert row.global_amax.shape == () and row.global_scale.dtype == torch.float32
    # 16x16 blocks: every row of a block carries its scale
    assert torch.equal(row.block_scales[:16].view(torch.uint8), row.block_scales[:1].expand(16, 4).view(torch.uint8))
    assert not row.rht and not col.rht and quantize_nvfp4(torch.randn(32, 16), columnwise=True, rht=True).rht
    assert not quantize_nvfp4(torch.randn(32, 16), rht=True).rht  # rowwise copies are never transformed


def test_global_scale_edges():
    for value, expected in [(0.0, 1.0), (math.inf, 1.0), (1e-40, F32_MAX), (2688.0, 1.0), (5.25, 512.0)]:
        x = torch.zeros(1, 16)
        x[0, 3] = value
        q = quantize_nvfp4(x)
        assert float(q.global_scale) == expected, value
    assert math.isnan(float(quantize_nvfp4(torch.tensor([[math.nan] + [1.0] * 15])).global_scale))


def test_columnwise_16x16_without_rht_dequantizes_like_rowwise():
    x = torch.randn(48, 64, dtype=torch.bfloat16)
    row = fake_quant_nvfp4(x, block=(16, 16))
    col = fake_quant_nvfp4(x, block=(16, 16), columnwise=True)
    assert same_bits(row, col)  # the same blocks, amaxes and scales, transposed


def test_fake_quant_shape_dtype_and_error():
    x = torch.randn(4, 32, 64, dtype=torch.bfloat16)
    y = fake_quant_nvfp4(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    rel = ((y.float() - x.float()).norm() / x.float().norm()).item()
    assert 0.02 < rel < 0.15  # 4-bit codes: about 10 % error; not the identity
    assert torch.equal(dequantize_nvfp4(quantize_nvfp4(x), torch.float32).to(x.dtype), y)


# ---------------------------------------------------------------------------------------------------------------
# Codes and packing


def test_e2m1_decode_table():
    values = e2m1_to_float32(torch.arange(16, dtype=torch.uint8))
    assert values.tolist() == list(GRID) + [-g for g in GRID]
    assert math.copysign(1.0, float(values[8])) == -1.0  # code 8 is -0.0


def test_pack_nibble_order_and_round_trip():
    assert pack_e2m1(torch.tensor([[1, 2, 15]], dtype=torch.uint8)).tolist() == [[0x21, 0x0F]]
    g = torch.Generator().manual_seed(3)
    for cols in (1, 16, 31):
        codes = torch.randint(0, 16, (5, cols), generator=g).to(torch.uint8)
        packed = pack_e2m1(codes)
        assert packed.shape == (5, (cols + 1) // 2)
        assert torch.equal(unpack_e2m1(packed, cols), codes)


def test_rne_on_exact_ties():
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    expect = [0, 2, 2, 4, 4, 6, 6]  # 0 | 1.0 | 1.0 | 2.0 | 2.0 | 4.0 | 4.0: the even code of each pair
    assert e2m1_codes(ties).tolist() == expect
    assert e2m1_codes(-ties).tolist() == [c + 8 for c in expect]
    assert e2m1_codes(torch.tensor([-0.0, -0.1, 0.26, 6.0, math.nan])).tolist() == [0, 8, 1, 7, 0]


def test_rne_ties_through_the_quantizer():
    """Global amax 5.25 makes S_enc = 512; a block of amax 3 then gets scale 256 and multiplier exactly 2."""
    halves = [0.125, 0.375, 0.625, 0.875, 1.25, 1.75, 2.5]  # doubled: the seven ties
    x = torch.zeros(2, 16)
    x[0] = torch.tensor([3.0] + halves + [-h for h in halves] + [0.0])
    x[1, 0] = 5.25
    q = quantize_nvfp4(x)
    assert float(q.global_scale) == 512.0 and float(q.block_scales[0, 0].float()) == 256.0
    codes = unpack_e2m1(q.codes)[0].tolist()
    assert codes == [7, 0, 2, 2, 4, 4, 6, 6, 8, 10, 10, 12, 12, 14, 14, 0]


# ---------------------------------------------------------------------------------------------------------------
# Random Hadamard transform


def test_rht_matrix_is_tes_signed_sylvester_hadamard():
    h = rht_matrix()
    assert RHT_SIGNS == SIGNS
    assert sum(1 << i for i, s in enumerate(RHT_SIGNS) if s < 0) == 0xD7E8  # the mask TE's kernels use
    unsigned = torch.tensor([[(-1) ** bin(i & j).count("1") for j in range(16)] for i in range(16)],
                            dtype=torch.float32)
    assert torch.equal(h * 4, torch.tensor(SIGNS, dtype=torch.float32)[:, None] * unsigned)
    assert torch.equal((h * 4) @ (h * 4).T, 16 * torch.eye(16))  # H H^T = 16 I before TE's 1/sqrt(16)
    assert torch.equal(h @ h.T, torch.eye(16))


def test_apply_rht_is_orthogonal_per_block():
    x = torch.randn(8, 64, dtype=torch.float64).float()
    y = apply_rht(x)
    back = (y.double().reshape(-1, 16) @ rht_matrix().double().T).reshape(x.shape)
    assert torch.allclose(back, x.double(), atol=1e-5)
    assert torch.allclose(y.reshape(-1, 16).norm(dim=1), x.reshape(-1, 16).norm(dim=1), rtol=1e-5)
    assert apply_rht(x.bfloat16()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="multiple of 16"):
        apply_rht(torch.randn(4, 24))


def test_rht_cancels_in_the_wgrad_product():
    """Both wgrad operands rotated along the reduction dim: their product is the unrotated one."""
    g = torch.Generator().manual_seed(0)
    dy, x = torch.randn(64, 8, generator=g), torch.randn(64, 12, generator=g)
    rot = [dequantize_nvfp4(quantize_nvfp4(t, columnwise=True, rht=True), torch.float64) for t in (dy, x)]
    plain = [dequantize_nvfp4(quantize_nvfp4(t, columnwise=True), torch.float64) for t in (dy, x)]
    exact = dy.double().T @ x.double()
    err_rht = (rot[0].T @ rot[1] - exact).norm() / exact.norm()
    err_plain = (plain[0].T @ plain[1] - exact).norm() / exact.norm()
    assert err_rht < 0.3 and err_plain < 0.3  # both estimate dY^T X; RHT'd values are not x itself
    assert (rot[0] - dy.double()).norm() > 0.5 * dy.norm()


# ---------------------------------------------------------------------------------------------------------------
# Stochastic rounding


def test_stochastic_rounding_deterministic_per_seed_and_generator():
    x = torch.randn(64, 64)
    a = quantize_nvfp4(x, stochastic_rounding=True, seed=7).codes
    assert torch.equal(a, quantize_nvfp4(x, stochastic_rounding=True, seed=7).codes)
    b = quantize_nvfp4(x, stochastic_rounding=True, seed=8).codes
    assert (unpack_e2m1(a) != unpack_e2m1(b)).float().mean() > 0.2
    g = torch.Generator().manual_seed(7)
    state = g.get_state()
    first = quantize_nvfp4(x, stochastic_rounding=True, generator=g).codes
    second = quantize_nvfp4(x, stochastic_rounding=True, generator=g).codes
    assert torch.equal(first, a) and not torch.equal(first, second)  # the generator advances
    g.set_state(state)  # a resume restores the state: the same draws again
    assert torch.equal(quantize_nvfp4(x, stochastic_rounding=True, generator=g).codes, first)


def test_stochastic_rounding_picks_a_neighbour():
    x = torch.linspace(-6, 6, 4097)
    lo_hi = torch.tensor(GRID + tuple(-g for g in GRID))
    sr = e2m1_to_float32(e2m1_codes(x, torch.Generator().manual_seed(1)))
    below = torch.where(lo_hi[None] <= x[:, None], lo_hi[None], -math.inf).amax(dim=1)
    above = torch.where(lo_hi[None] >= x[:, None], lo_hi[None], math.inf).amin(dim=1)
    assert torch.all((sr == below) | (sr == above))


def test_stochastic_rounding_is_unbiased():
    """Mean over 1e6 draws within 5 sigma of the value, in every grid region, near both ends of a step: a rounding
    with 8 random bits (probabilities on a 1/256 grid, TE's) would be 40 sigma off at 0.998 of a step."""
    steps = [(0.0, 0.5), (1.5, 0.5), (2.0, 1.0), (3.0, 1.0), (4.0, 2.0)]
    values = torch.tensor([lo + f * s for lo, s in steps for f in (0.002, 0.3, 0.502, 0.998)])
    values = torch.cat([values, -values[:4]])
    n = 1_000_000
    g = torch.Generator().manual_seed(1234)
    for v in values:
        draws = e2m1_to_float32(e2m1_codes(v.expand(n).contiguous(), g)).double()
        lo = max(x for x in GRID if x <= abs(float(v)))
        hi = min(x for x in GRID if x >= abs(float(v)))
        p = (abs(float(v)) - lo) / (hi - lo)
        sigma = (hi - lo) * math.sqrt(p * (1 - p) / n)
        assert abs(draws.mean().item() - float(v)) < 5 * sigma + 1e-7, (float(v), draws.mean().item(), sigma)


def test_stochastic_rounding_unbiased_through_the_quantizer():
    """Blocks [3, v...] beside a global amax of 5.25: multiplier 2, dequantized = code / 2 (to ~1e-7)."""
    vs = torch.tensor([0.1, 0.2, 0.3, 0.45, 0.55, 0.8, 1.1, 1.3, 1.6, 1.9, 2.2, 2.9, -0.7, -1.7])
    blocks = 65536
    x = torch.zeros(blocks, 16)
    x[:, 0], x[:, 1:15] = 3.0, vs
    x[0, 15] = 5.25
    y = fake_quant_nvfp4(x, stochastic_rounding=True, seed=99).double()
    mean = y[1:, 1:15].mean(dim=0)
    sigma = 0.5 / math.sqrt(blocks - 1)  # a draw's deviation is at most half a step: 1 (2 before the multiplier)
    assert torch.all((mean - vs.double()).abs() < 5 * sigma), (mean - vs.double()).abs().max()
    assert not torch.equal(y[1:, 1:15], fake_quant_nvfp4(x).double()[1:, 1:15])


# ---------------------------------------------------------------------------------------------------------------
# Errors


def test_errors_name_the_setting():
    with pytest.raises(ValueError, match=r"block: \[1, 32\]"):
        quantize_nvfp4(torch.randn(4, 32), block=(1, 32))
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize_nvfp4(torch.randn(24, 16), columnwise=True, rht=True)
    with pytest.raises(ValueError, match="generator= or seed="):
        quantize_nvfp4(torch.randn(4, 16), stochastic_rounding=True)
    with pytest.raises(ValueError, match="stochastic_rounding=True only"):
        quantize_nvfp4(torch.randn(4, 16), seed=3)
    for dtype in (torch.int32, torch.float64, torch.float8_e4m3fn):
        with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
            quantize_nvfp4(torch.ones(4, 16).to(dtype))


def test_a_float32_rht_on_the_gpu_runs_eagerly_and_the_cpu_never_compiles():
    """The compiled RHT rounded float32 subnormals' inexact products otherwise than cuBLAS (tests/gpu, the H100):
    a float32 tensor's RHT takes the eager in-order FMAs there; the CPU runs every pass eagerly."""
    from types import SimpleNamespace

    from fp8_recipes.numerics import nvfp4

    cuda_fp32 = SimpleNamespace(device=torch.device("cuda", 0), dtype=torch.float32, numel=lambda: 16)
    assert nvfp4._kernel("rht", cuda_fp32) is nvfp4.apply_rht
    for name, eager in nvfp4._EAGER.items():
        assert nvfp4._kernel(name, torch.ones(16, 16)) is eager
    assert "rht" not in nvfp4._COMPILED


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_rht_of_a_transposed_view_runs_in_its_base_layout_with_the_same_bits(dtype):
    """The columnwise copy's RHT reads x^T, a transposed view: it sums 16 rows of x in x's layout (whole rows per
    pass), each output the same in-order sum as through the view, and returns a transposed view as the copy
    without the RHT does."""
    from fp8_recipes.numerics import apply_rht

    torch.manual_seed(7)
    base = torch.randn(64, 48) * torch.logspace(-40, 30, 48)  # float32 subnormals to huge, per column
    base[3, :5] = torch.tensor([0.0, -0.0, float("inf"), float("nan"), 1e-45])
    base = base.to(dtype)
    x = base.t()
    assert not x.is_contiguous()
    fast, through = apply_rht(x), apply_rht(x.contiguous())
    ints = torch.int32 if dtype == torch.float32 else torch.int16
    assert fast.shape == through.shape == x.shape and fast.t().is_contiguous()
    assert torch.equal(fast.contiguous().view(ints), through.view(ints))


def test_a_columnwise_copy_is_quantized_in_its_base_layout(monkeypatch):
    """x^T's 1x16 segments are 16 rows of a column of x: the amaxes and values passes read x row by row (not the
    transposed view) where x's rows are whole segments, and give the same bits as the quantizer; the output is
    x's layout. Rows that need padding (17) take the copy's own layout."""
    from fp8_recipes.numerics import nvfp4

    calls = []
    for name in ("column_amax", "column_values", "column_values_sr"):
        f = nvfp4._EAGER[name]
        monkeypatch.setitem(nvfp4._EAGER, name, lambda *a, _f=f, _n=name: calls.append(_n) or _f(*a))
    x = edge_tensor("normal", torch.bfloat16, (64, 48))
    for rht, sr in ((False, False), (True, False), (True, True)):
        kw = dict(columnwise=True, rht=rht, stochastic_rounding=sr, seed=5 if sr else None)
        out = fake_quant_nvfp4(x, **kw)
        assert out.is_contiguous() and same_bits(out, dequantize_nvfp4(quantize_nvfp4(x, **kw))), kw
    assert calls == ["column_amax", "column_values"] * 2 + ["column_amax", "column_values_sr"]
    calls.clear()
    fake_quant_nvfp4(edge_tensor("normal", torch.bfloat16, (17, 48)), columnwise=True)
    fake_quant_nvfp4(x, columnwise=True, block=(16, 16))
    fake_quant_nvfp4(x, columnwise=False)
    assert calls == []


def test_every_pass_traces_under_symbolic_shapes(monkeypatch):
    """The GPU compiles each pass with every size a symbol (_symbolic_shapes): a pass that cannot trace so fell back
    to eager on every call (a size-1 input dimension does not broadcast there; the H100, 2026-12-06: emulated nvfp4
    at 0.32x BF16's speed instead of 0.63x). Here dynamo traces each pass on the CPU (backend "eager", fullgraph:
    no inductor, the same aten ops), for each copy, block, RHT and rounding, and the result is the eager one."""
    from fp8_recipes.numerics import fake_quant_nvfp4, nvfp4

    torch._dynamo.reset()
    monkeypatch.setattr(nvfp4, "_COMPILED", {})
    monkeypatch.setattr(nvfp4, "_COMPILE_ON", ("cpu",))
    monkeypatch.setattr(nvfp4, "_COMPILE_OPTIONS", {"backend": "eager", "fullgraph": True})
    gen = torch.Generator().manual_seed(0)
    for shape in ((64, 96), (2, 32, 48), (16, 48)):
        x = (3 * torch.randn(shape, generator=gen)).to(torch.bfloat16)
        for block in ((1, 16), (16, 16)):
            for columnwise, rht, sr in ((False, False, False), (True, True, False), (True, False, False),
                                        (False, False, True), (True, True, True)):
                kw = dict(block=block, columnwise=columnwise, rht=rht, stochastic_rounding=sr, seed=3 if sr else None)
                got = fake_quant_nvfp4(x, **kw)
                with monkeypatch.context() as m:
                    m.setattr(nvfp4, "_COMPILE_ON", ())
                    assert torch.equal(got, fake_quant_nvfp4(x, **kw)), f"{shape} {kw}"
    assert set(nvfp4._COMPILED) == set(nvfp4._EAGER), nvfp4._COMPILED
    assert False not in nvfp4._COMPILED.values(), nvfp4._COMPILED  # (a failed trace leaves False: eager ever after)
    torch._dynamo.reset()


def triton_rht_operands():
    """bf16 / fp16 copies x^T (the base layout) of x with rows in 16s: normal values, values over the dtype's whole
    range (subnormals and the largest finite included), inf, -inf, NaN, -0.0, and a column of zeros."""
    gen = torch.Generator().manual_seed(7)
    for dtype, lo, hi in ((torch.bfloat16, -133, 127), (torch.float16, -24, 15)):
        for rows, cols in ((32, 48), (48, 300), (16, 16)):
            spread = torch.exp2(torch.empty(rows, cols).uniform_(lo, hi, generator=gen))
            spread *= torch.where(torch.rand(rows, cols, generator=gen) < 0.5, -1.0, 1.0)
            for x in (3 * torch.randn(rows, cols, generator=gen), spread):
                x = x.to(dtype)
                x[1, 2], x[5, 3], x[7, 4], x[0, 5], x[:, 6] = float("inf"), float("-inf"), float("nan"), -0.0, 0.0
                yield x.t()


def check_triton_rht() -> int:
    """The Triton RHT (Triton's CPU interpreter) against apply_rht, bit for bit (NaN where NaN), directly and inside
    fake_quant_nvfp4; the count checked. Run by the test below with TRITON_INTERPRET=1."""
    from fp8_recipes.numerics import fake_quant_nvfp4, nvfp4, nvfp4_kernels

    def same(a, b):
        nan = torch.isnan(a.float())
        assert torch.equal(nan, torch.isnan(b.float())) and a.shape == b.shape and a.stride() == b.stride()
        assert torch.equal(a[~nan].view(torch.int16), b[~nan].view(torch.int16))

    n = 0
    for v in triton_rht_operands():
        assert nvfp4._base_layout(v)
        same(nvfp4_kernels.rht_base_layout(v, nvfp4.rht_matrix("cpu")), nvfp4.apply_rht(v))
        x = v.t()  # (fake_quant_nvfp4 takes x and makes the columnwise copy x^T itself)
        for sr in (False, True):
            kw = dict(columnwise=True, rht=True, stochastic_rounding=sr, seed=3 if sr else None)
            nvfp4._TRITON_ON = ("cpu",)
            got = fake_quant_nvfp4(x, **kw)
            nvfp4._TRITON_ON = ()
            same(got, fake_quant_nvfp4(x, **kw))
        n += 1
    assert not nvfp4._TRITON
    return n


@pytest.mark.timeout(600)
def test_the_triton_rht_is_apply_rht_bit_for_bit_in_the_interpreter():
    """On a GPU a bf16 / fp16 columnwise copy's RHT is a Triton kernel (numerics/nvfp4_kernels.py); here it runs in
    Triton's CPU interpreter against the eager sums, over the dtypes' whole range and inf / NaN / -0.0."""
    from triton_interpreter import interpreted

    pytest.importorskip("triton", reason="the RHT kernel needs Triton (a dependency of torch on Linux)")
    out = interpreted("test_nvfp4", "check_triton_rht")
    assert "checked 12" in out, out[-2000:]


def test_only_a_gpus_16_bit_base_layout_copy_takes_the_triton_rht(monkeypatch):
    from fp8_recipes.numerics import nvfp4

    x = torch.ones(32, 16, dtype=torch.bfloat16)
    assert nvfp4._rotate(x) is nvfp4.apply_rht  # (the CPU: eager)
    monkeypatch.setattr(nvfp4, "_TRITON_ON", ("cpu",))
    assert nvfp4._rotate(x) is not nvfp4.apply_rht and nvfp4._rotate(x.float()) is nvfp4.apply_rht
    monkeypatch.setattr(nvfp4, "_TRITON", {"rht": True})
    assert nvfp4._rotate(x) is nvfp4.apply_rht


def check_triton_stochastic_rounding() -> int:
    """Stochastic rounding in Triton (the CPU interpreter): fake_quant_nvfp4's fused values kernel, which draws its
    uniforms itself, against the quantizer's codes rounded on the uniforms Triton writes out, bit for bit (NaN where
    NaN), on the edge operands, rowwise and columnwise (with and without the RHT), 1x16 and 16x16; the fused kernel
    taken where it applies; seeded and unbiased. The count checked. Run below with TRITON_INTERPRET=1."""
    from fp8_recipes.numerics import nvfp4, nvfp4_kernels

    fused = []
    values_sr = nvfp4_kernels.values_sr
    nvfp4_kernels.values_sr = lambda *a, **k: fused.append(k["column"]) or values_sr(*a, **k)
    nvfp4._TRITON_ON = ("cpu",)
    n = compared = 0
    for m, v in enumerate(triton_rht_operands()):
        x = v.t()  # (each operand holds inf and NaN, which make every value NaN: all but the first without them)
        x = x if m == 0 else torch.where(x.isfinite(), x, 1.5).to(x.dtype)
        if x.dtype == torch.bfloat16:  # (the interpreter converts bf16 subnormals wrongly: tests/gpu has them)
            x = torch.where(x.abs() < torch.finfo(x.dtype).tiny, 0.0, x).to(x.dtype)
        for x in (x, x.float())[:1 if m % 4 else 2]:  # (x as a step holds it; a few in float32 as well)
            for kw in (dict(), dict(columnwise=True), dict(columnwise=True, rht=True), dict(block=(16, 16)),
                       dict(columnwise=True, block=(16, 16))):
                if kw.get("rht") and x.dtype == torch.float32:
                    continue  # (a float32 RHT runs eagerly: covered by the tests of the compiled passes)
                kw.update(stochastic_rounding=True, seed=2 ** 62 + n)  # (a 63-bit seed, as stochastic_rounding_seed's)
                got, want = fake_quant_nvfp4(x, **kw), dequantize_nvfp4(quantize_nvfp4(x, **kw))
                assert same_bits(got, want), kw
                compared += int(not torch.isnan(want).any())
                n += 1
    assert fused.count(True) >= 12 and fused.count(False) >= 12, fused  # (both layouts of the fused kernel)
    assert compared >= 50, compared  # (the cases whose values are not all NaN)
    u = nvfp4_kernels.uniforms(5, (256, 256), "cpu")
    assert torch.equal(u, nvfp4_kernels.uniforms(5, (256, 256), "cpu"))
    assert not torch.equal(u, nvfp4_kernels.uniforms(6, (256, 256), "cpu"))
    assert 0 <= u.min() and u.max() < 1 and abs(u.double().mean() - 0.5) < 5 * (1 / 12 / u.numel()) ** 0.5
    # unbiased through the fused kernel: blocks [3, v...] beside a global amax of 5.25 (multiplier 2), 16 blocks a
    # row, as test_stochastic_rounding_unbiased_through_the_quantizer (16384 draws of each value)
    vs = torch.tensor([0.1, 0.2, 0.3, 0.45, 0.55, 0.8, 1.1, 1.3, 1.6, 1.9, 2.2, 2.9, -0.7, -1.7])
    x = torch.zeros(16, 1024, 16)
    x[..., 0], x[..., 1:15] = 3.0, vs
    x[0, 0, 15] = 5.25
    before = len(fused)
    y = fake_quant_nvfp4(x.reshape(16, 16384), stochastic_rounding=True, seed=99).double().reshape(-1, 16)
    assert len(fused) == before + 1
    mean = y[1:, 1:15].mean(dim=0)
    sigma = 0.5 / math.sqrt(y.shape[0] - 1)
    assert torch.all((mean - vs.double()).abs() < 5 * sigma), (mean - vs.double()).abs().max()
    assert not nvfp4._TRITON
    return n


@pytest.mark.timeout(600)
def test_the_fused_stochastic_rounding_is_the_quantizers_bit_for_bit_in_the_interpreter():
    """On a GPU stochastic rounding draws Philox uniforms inside a Triton kernel (numerics/nvfp4_kernels.py); here
    it runs in Triton's CPU interpreter against the quantizer on the same uniforms, and for its law."""
    from triton_interpreter import interpreted

    pytest.importorskip("triton", reason="the stochastic rounding kernels need Triton (a dependency of torch)")
    out = interpreted("test_nvfp4", "check_triton_stochastic_rounding")
    assert "checked 72" in out, out[-2000:]


def block_factor_cases(device="cpu"):
    """(block amaxes, global amax) pairs: block amaxes spread over float32's range (zeros, subnormals, inf, NaN)
    beside global amaxes from subnormal to inf and NaN, rowwise and transposed; and every E4M3 rounding tie (the
    midpoints between neighbouring scales, 0 included) with its float32 neighbours and values past 448, beside global
    amaxes 448 * 2^k, whose S_enc * fp32(1/6) is exactly 2^-k: the block amaxes are the ties times 2^k, so the
    unrounded scales are the ties themselves (checked); and beside other global amaxes, block amaxes whose scales
    fall within an ulp of the ties (where the order of the products decides the rounding)."""
    gen = torch.Generator().manual_seed(11)
    spread = torch.exp2(torch.empty(64, 48).uniform_(-149, 128, generator=gen))
    spread[0, :8] = torch.tensor([0.0, float("inf"), float("nan"), 1e-45, 1e-40, 448.0, 6.0, 3e38])
    for block_amax in (spread, spread.t()):
        peak = block_amax[block_amax.isfinite()].amax()
        for amax in (peak, peak * 3, torch.tensor(1e-42), torch.tensor(float("inf")), torch.tensor(float("nan")),
                     torch.tensor(0.0)):
            yield block_amax.to(device), amax.to(device)
    e4m3 = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    e4m3 = torch.cat([torch.zeros(1), e4m3[e4m3.isfinite() & (e4m3 > 0)].sort().values])
    mid = (e4m3[:-1] + e4m3[1:]) / 2  # (exact: 3-bit mantissas)
    inf = torch.full_like(mid, float("inf"))
    ties = torch.cat([e4m3, mid, torch.nextafter(mid, inf), torch.nextafter(mid, -inf),
                      torch.tensor([449.0, 464.0, 480.0, 1e30])])
    ties = torch.cat([ties, ties.new_zeros(-ties.numel() % 16)]).reshape(-1, 16)
    from fp8_recipes.numerics import nvfp4

    for k in (0, 5, -7):
        amax = torch.tensor(448.0 * 2.0 ** k)
        enc = nvfp4.nvfp4_global_scale(amax)
        assert torch.equal(ties * 2.0 ** k * (enc * (torch.tensor(1.0) / 6)), ties)  # (the scales land on the ties)
        yield (ties * 2.0 ** k).to(device), amax.to(device)
    for amax in (torch.tensor(476.0), torch.tensor(1428.0), torch.tensor(1e-3)):  # (S_enc * fp32(1/6) inexact)
        near = ties[:, :-1] / (nvfp4.nvfp4_global_scale(amax) * (torch.tensor(1.0) / 6))  # (within an ulp of a tie)
        yield torch.cat([near, torch.nextafter(near, near * 2), torch.nextafter(near, near / 2)], 1).to(device), \
            amax.to(device)


def check_block_factors(device="cpu") -> int:
    """nvfp4_kernels.block_factors (Triton: its CPU interpreter, or the GPU) against the eager functions, bit for
    bit (NaN where NaN), in block_amax's layout; the count checked."""
    from fp8_recipes.numerics import nvfp4, nvfp4_kernels

    n = 0
    for block_amax, amax in block_factor_cases(device):
        got = nvfp4_kernels.block_factors(block_amax, amax)
        want = nvfp4._block_factors_eager(block_amax, amax)
        for name, g, w in zip(("S_enc", "scales", "multiplier", "decode"), got, want, strict=True):
            assert g.shape == w.shape and g.dtype == w.dtype, name
            assert g.stride() == block_amax.stride() or g.dim() < 2, name  # (the layout of the blocks)
            if g.dtype == torch.float8_e4m3fn:
                g, w = g.view(torch.uint8).float(), w.view(torch.uint8).float()
            nan = torch.isnan(w)
            assert torch.equal(nan, torch.isnan(g)), (name, amax)
            assert torch.equal(g[~nan].view(torch.int32), w[~nan].view(torch.int32)), (name, amax, (g != w).sum())
        n += 1
    return n


@pytest.mark.timeout(600)
def test_the_fused_block_scales_are_the_eager_ones_bit_for_bit_in_the_interpreter():
    """On a GPU the block scales' arithmetic is one Triton kernel (numerics/nvfp4_kernels.block_factors); here it
    runs in Triton's CPU interpreter against the eager functions (tests/gpu/test_nvfp4_ref.py: on the GPU)."""
    from triton_interpreter import interpreted

    pytest.importorskip("triton", reason="the block scales kernel needs Triton (a dependency of torch)")
    out = interpreted("test_nvfp4", "check_block_factors")
    assert "checked 18" in out, out[-2000:]


def test_stochastic_rounding_takes_triton_on_a_gpu_only_with_a_seed(monkeypatch):
    """The CPU draws from torch's generator; with a generator (not a seed) every device does; a failed Triton
    leaves torch's generator, seeded the same."""
    from fp8_recipes.numerics import nvfp4

    pytest.importorskip("triton", reason="the stochastic rounding kernels need Triton (a dependency of torch)")
    from fp8_recipes.numerics import nvfp4_kernels

    x = torch.randn(32, 32)
    calls = []
    monkeypatch.setattr(nvfp4, "_TRITON", {})
    monkeypatch.setattr(nvfp4_kernels, "uniforms", lambda *a: calls.append("u") or torch.rand(32, 32))
    monkeypatch.setattr(nvfp4_kernels, "values_sr", lambda *a, **k: calls.append("v") or a[0].clone())
    monkeypatch.setattr(nvfp4_kernels, "block_factors", nvfp4._block_factors_eager)  # (Triton's, outside a GPU)
    monkeypatch.setattr(nvfp4, "_TRITON_ON", ())
    cpu = fake_quant_nvfp4(x, stochastic_rounding=True, seed=3)
    assert calls == [] and torch.equal(cpu, dequantize_nvfp4(quantize_nvfp4(x, stochastic_rounding=True, seed=3)))
    monkeypatch.setattr(nvfp4, "_TRITON_ON", ("cpu",))
    fake_quant_nvfp4(x, stochastic_rounding=True, seed=3)
    quantize_nvfp4(x, stochastic_rounding=True, seed=3)
    assert calls == ["v", "u"]
    fake_quant_nvfp4(x, stochastic_rounding=True, generator=torch.Generator().manual_seed(3))
    assert calls == ["v", "u"]
    monkeypatch.setattr(nvfp4_kernels, "values_sr", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no Triton")))
    assert torch.equal(fake_quant_nvfp4(x, stochastic_rounding=True, seed=3), cpu)
    assert nvfp4._TRITON == {"stochastic rounding": True}  # (the other kernels run on)
    assert nvfp4._triton_here(x.device, "block scales") and not nvfp4._triton_here(x.device, "stochastic rounding")
