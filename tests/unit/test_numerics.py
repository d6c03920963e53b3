"""FP8 numerics against independent references: the saturating cast, amax -> scale, every scaling mode, delayed state.

The references here never go through torch's float8 cast: FP8 values are decoded from their bit patterns in plain
Python, rounding is "nearest representable value, ties to the even code" over that table, and scales are numpy
float32 arithmetic (one correctly rounded division, as TE's __fdiv_rn).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fp8_recipes.numerics import (
    DelayedScaler, amax_to_e8m0, amax_to_scale, dequantize, e8m0_to_multiplier, e8m0_to_scale_inv, fake_quant,
    fp8_spec, quantize, to_fp8_saturated,
)
from fp8_recipes.recipe.schema import AmaxAlgo, Format, MxRounding, Recipe, Scaling, TensorPolicy

F32_MAX = float(np.finfo(np.float32).max)
FMTS = (Format.E4M3, Format.E5M2)
MANTISSA_BITS = {Format.E4M3: 3, Format.E5M2: 2}
HALF_ULP = {f: 2.0 ** -(MANTISSA_BITS[f] + 1) for f in FMTS}  # 2^-4 (E4M3), 2^-3 (E5M2)


# ---------------------------------------------------------------------------------------------------------------
# Independent references


def decode(code: int, fmt: Format) -> float:
    """The value of an 8-bit code, from the bit layout (OCP FP8: E4M3 without inf, E5M2 IEEE-like)."""
    sign = -1.0 if code & 0x80 else 1.0
    if fmt is Format.E4M3:
        e, m = (code >> 3) & 0xF, code & 0x7
        if e == 0xF and m == 0x7:
            return math.nan
        return sign * (m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    e, m = (code >> 2) & 0x1F, code & 0x3
    if e == 0x1F:
        return math.nan if m else sign * math.inf
    return sign * (m / 4 * 2.0**-14 if e == 0 else (1 + m / 4) * 2.0 ** (e - 15))


def positive_table(fmt: Format) -> tuple[np.ndarray, np.ndarray]:
    """(values, codes) of the finite non-negative codes, ascending (codes 0x00..max are monotone in value)."""
    pairs = [(decode(c, fmt), c) for c in range(0x80)]
    pairs = [(v, c) for v, c in pairs if math.isfinite(v)]
    vals = np.array([v for v, _ in pairs])
    codes = np.array([c for _, c in pairs])
    assert np.all(np.diff(vals) > 0)
    return vals, codes


TABLES = {f: positive_table(f) for f in FMTS}


def ref_codes(x: np.ndarray, fmt: Format) -> np.ndarray:
    """Saturating round-to-nearest-even to FP8, as codes; -1 marks NaN. Computed in float64 on the given values."""
    vals, codes = TABLES[fmt]
    x = np.asarray(x, dtype=np.float64)
    mag = np.minimum(np.abs(x), vals[-1])  # saturate (inf too)
    hi = np.clip(np.searchsorted(vals, mag, side="left"), 0, len(vals) - 1)  # first value >= mag
    lo = np.maximum(hi - 1, 0)
    d_lo, d_hi = mag - vals[lo], vals[hi] - mag
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (codes[hi] % 2 == 0))
    pick_hi |= vals[hi] == mag
    out = np.where(pick_hi, codes[hi], codes[lo]) | np.where(np.signbit(x), 0x80, 0)
    return np.where(np.isnan(x), -1, out)


def ref_values(x: np.ndarray, fmt: Format) -> np.ndarray:
    c = ref_codes(x, fmt)
    return np.array([math.nan if k < 0 else decode(int(k), fmt) for k in c.ravel()]).reshape(c.shape)


def ref_scale(amax: float, fmt: Format, margin: int = 0, eps: float = 0.0, pow2: bool = False,
              value_for_inf: float = F32_MAX) -> np.float32:
    """TE's compute_scale_from_amax in numpy float32."""
    a = np.float32(amax)
    if eps > 0 and a < np.float32(eps):
        a = np.float32(eps)
    if not np.isfinite(a) or a == 0:
        return np.float32(1.0)
    with np.errstate(over="ignore", divide="ignore"):
        s = np.float32(fp8_spec(fmt).max) / a
    if np.isinf(s):
        s = np.float32(value_for_inf)
    s = np.float32(s * np.float32(2.0**-margin))
    if pow2:
        _, e = math.frexp(float(s))
        s = np.float32(2.0 ** (e - 1))
    return s


def codes_of(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.uint8).numpy().astype(np.int64)


def codes_of_t(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def is_pow2(v: float) -> bool:
    return v > 0 and math.frexp(v)[0] == 0.5


def expand(per_block: torch.Tensor, block: tuple[int, int], rows: int, cols: int) -> torch.Tensor:
    """Each element's block value, by repetition (an independent path from the library's padded view)."""
    br, bc = block
    return per_block.repeat_interleave(br, 0).repeat_interleave(bc, 1)[:rows, :cols]


def pol(scaling: Scaling, fmt: Format = Format.E4M3, **kw) -> TensorPolicy:
    return TensorPolicy(scaling=scaling, format=fmt, **kw)


# ---------------------------------------------------------------------------------------------------------------
# The reference itself: decoding agrees with the documented constants


@pytest.mark.parametrize("fmt,max_,min_sub,min_norm,n_finite", [
    (Format.E4M3, 448.0, 2.0**-9, 2.0**-6, 254),
    (Format.E5M2, 57344.0, 2.0**-16, 2.0**-14, 248),
])
def test_decoded_tables_match_spec(fmt, max_, min_sub, min_norm, n_finite):
    vals = [decode(c, fmt) for c in range(256)]
    finite = [v for v in vals if math.isfinite(v)]
    spec = fp8_spec(fmt)
    assert len(finite) == n_finite
    assert max(finite) == max_ == spec.max
    assert min(v for v in finite if v > 0) == min_sub == spec.min_subnormal
    assert spec.min_normal == min_norm
    assert 2.0**spec.emax <= spec.max < 2.0 ** (spec.emax + 1)


# ---------------------------------------------------------------------------------------------------------------
# Saturating cast


@pytest.mark.parametrize("fmt", FMTS)
def test_saturation_inf_nan(fmt):
    m = fp8_spec(fmt).max
    x = torch.tensor([m, -m, m * 1.01, -m * 1.01, 1e30, -1e30, math.inf, -math.inf, F32_MAX, math.nan])
    y = to_fp8_saturated(x, fmt).float()
    assert y[:9].tolist() == [m, -m, m, -m, m, -m, m, -m, m]
    assert torch.isnan(y[9])
    assert to_fp8_saturated(x, fmt).dtype == fp8_spec(fmt).dtype


@pytest.mark.parametrize("fmt,x,expected", [
    # E4M3: min subnormal 2^-9; subnormal spacing 2^-9
    (Format.E4M3, 2.0**-9, 2.0**-9),
    (Format.E4M3, 2.0**-10, 0.0),                 # halfway 0 .. 2^-9: tie to even (code 0)
    (Format.E4M3, 2.0**-10 * (1 + 2**-20), 2.0**-9),  # just above halfway
    (Format.E4M3, 3 * 2.0**-11, 2.0**-9),         # 0.75 of the min subnormal: nearest is 2^-9
    (Format.E4M3, 2.0**-11, 0.0),
    (Format.E4M3, 3 * 2.0**-10, 2.0**-8),         # halfway code 1 .. code 2: to code 2 (even)
    (Format.E4M3, 5 * 2.0**-10, 2.0**-8),         # halfway code 2 .. code 3: to code 2 (even)
    (Format.E4M3, 15 * 2.0**-10, 2.0**-6),        # halfway 7*2^-9 (code 7) .. 2^-6 (code 8, first normal)
    (Format.E4M3, 1 + 1 / 16, 1.0),               # halfway 1 .. 1.125: to 1 (mantissa 0)
    (Format.E4M3, 1 + 3 / 16, 1.25),              # halfway 1.125 .. 1.25: to 1.25
    (Format.E4M3, 432.0, 448.0),                  # halfway 416 .. 448: 448 has the even code (0x7E)
    (Format.E4M3, 464.0, 448.0),                  # beyond max: saturates
    (Format.E4M3, -(2.0**-10), -0.0),
    # E5M2: min subnormal 2^-16
    (Format.E5M2, 2.0**-17, 0.0),                 # halfway: tie to even
    (Format.E5M2, 3 * 2.0**-18, 2.0**-16),
    (Format.E5M2, 3 * 2.0**-17, 2.0**-15),        # halfway code 1 .. code 2
    (Format.E5M2, 1 + 1 / 8, 1.0),                # halfway 1 .. 1.25
    (Format.E5M2, 1 + 3 / 8, 1.5),                # halfway 1.25 .. 1.5
    (Format.E5M2, 53248.0, 49152.0),              # halfway 49152 (0x7A) .. 57344 (0x7B): even code
    (Format.E5M2, 61440.0, 57344.0),              # would round to inf without saturation
])
def test_cast_hand_picked(fmt, x, expected):
    y = to_fp8_saturated(torch.tensor([x], dtype=torch.float32), fmt).float().item()
    assert y == expected and math.copysign(1, y) == math.copysign(1, expected)
    assert decode(int(ref_codes(np.array([x]), fmt)[0]), fmt) == expected  # the reference agrees


def edge_values(fmt: Format) -> np.ndarray:
    """Every representable value, every midpoint, and their float32 neighbours, both signs, plus extremes."""
    vals, _ = TABLES[fmt]
    mids = (vals[:-1] + vals[1:]) / 2
    base = np.concatenate([vals, mids, [vals[-1] * 1.03, vals[-1] * 1.5, vals[-1] * 4, 1e30, F32_MAX]])
    base32 = base.astype(np.float32)
    n = len(vals) + len(mids)
    assert np.array_equal(base32[:n].astype(np.float64), base[:n])  # values and midpoints are exact in float32
    with np.errstate(over="ignore"):  # F32_MAX's upper neighbour is inf
        ups = np.nextafter(base32, np.float32(np.inf))
    downs = np.nextafter(base32, np.float32(0))
    allv = np.concatenate([base32, ups, downs])
    return np.concatenate([allv, -allv, np.array([np.inf, -np.inf, 0.0, -0.0], dtype=np.float32)])


def random_values(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    mag = np.exp2(rng.uniform(-30, 20, n)) * rng.uniform(1, 2, n)
    return (mag * rng.choice([-1.0, 1.0], n)).astype(np.float32)


@pytest.mark.parametrize("fmt", FMTS)
def test_cast_matches_reference_on_edges_and_random(fmt):
    x = np.concatenate([edge_values(fmt), random_values(200_000, seed=int(fmt == Format.E5M2))])
    got = codes_of(to_fp8_saturated(torch.from_numpy(x), fmt))
    want = ref_codes(x, fmt)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, f"{bad.size} mismatches, e.g. x={x[bad[:5]]} got={got[bad[:5]]} want={want[bad[:5]]}"


@pytest.mark.parametrize("fmt", FMTS)
def test_cast_nan_stays_nan(fmt):
    x = np.array([np.nan, -np.nan, 1.0], dtype=np.float32)
    y = to_fp8_saturated(torch.from_numpy(x), fmt).float()
    assert torch.isnan(y[:2]).all() and y[2] == 1.0


# ---------------------------------------------------------------------------------------------------------------
# amax -> scale


AMAXES = [1e-30, 1e-6, 0.1, 0.3, 1.0, 3.0, 7.0, 123.456, 448.0, 449.0, 1e4, 57344.0, 1e20, 3e38]


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("margin", [0, 1, 3])
@pytest.mark.parametrize("pow2", [False, True])
def test_amax_to_scale_matches_numpy_float32(fmt, margin, pow2):
    rng = np.random.default_rng(margin)
    amax = np.concatenate([np.array(AMAXES, dtype=np.float32),
                           (np.exp2(rng.uniform(-40, 40, 500)) * rng.uniform(1, 2, 500)).astype(np.float32)])
    got = amax_to_scale(torch.from_numpy(amax), fmt, margin=margin, pow2=pow2).numpy()
    want = np.array([ref_scale(a, fmt, margin=margin, pow2=pow2) for a in amax], dtype=np.float32)
    assert got.dtype == np.float32
    assert np.array_equal(got.view(np.int32), want.view(np.int32))
    if pow2:
        assert all(is_pow2(float(s)) for s in got)


def test_amax_to_scale_is_fdiv_not_reciprocal_multiply():
    # fp8_max / amax in one rounding differs from fp8_max * (1/amax) for some amaxes: the scale must be the former
    amax = np.linspace(1.0, 2.0, 4001, dtype=np.float32)
    got = amax_to_scale(torch.from_numpy(amax), Format.E4M3).numpy()
    fdiv = np.float32(448) / amax
    via_rcp = np.float32(448) * (np.float32(1) / amax)
    assert np.array_equal(got, fdiv)
    assert not np.array_equal(got, via_rcp)


@pytest.mark.parametrize("eps", [1e-3, 1.0, 1e-12])
def test_amax_to_scale_epsilon(eps):
    amax = torch.tensor([0.0, eps / 2, eps, eps * 2, 5.0])
    got = amax_to_scale(amax, Format.E4M3, epsilon=eps)
    want = [ref_scale(float(a), Format.E4M3, eps=eps) for a in amax]
    assert got.tolist() == [float(w) for w in want]
    # amax 0 is lifted to epsilon first (TE: `if (amax < epsilon) amax = epsilon`), so it no longer gives scale 1
    assert got[0].item() == float(np.float32(448) / np.float32(eps))


@pytest.mark.parametrize("fmt", FMTS)
def test_amax_to_scale_degenerate(fmt):
    amax = torch.tensor([0.0, math.inf, math.nan, -0.0])
    assert amax_to_scale(amax, fmt).tolist() == [1.0, 1.0, 1.0, 1.0]
    assert amax_to_scale(amax, fmt, margin=2, pow2=True, epsilon=0.0).tolist() == [1.0] * 4


@pytest.mark.parametrize("fmt", FMTS)
def test_amax_to_scale_overflow_gives_float32_max(fmt):
    tiny = torch.tensor([1e-45, 1e-40, 1e-38], dtype=torch.float32)  # fp8_max / tiny overflows float32
    s = amax_to_scale(tiny, fmt)
    assert s.tolist() == [F32_MAX] * 3
    assert amax_to_scale(tiny, fmt, value_for_inf=1234.0).tolist() == [1234.0] * 3
    assert amax_to_scale(tiny, fmt, pow2=True).tolist() == [2.0**127] * 3
    assert amax_to_scale(tiny, fmt, margin=1).tolist() == [F32_MAX / 2] * 3


def test_amax_to_scale_never_nan_or_inf():
    amax = torch.tensor([0.0, 1e-45, 1e-38, 1e-30, 1.0, 448.0, 1e30, F32_MAX, math.inf, -math.inf, math.nan])
    for fmt in FMTS:
        for margin in range(4):
            for pow2 in (False, True):
                for eps in (0.0, 1e-12):
                    s = amax_to_scale(amax, fmt, margin=margin, epsilon=eps, pow2=pow2)
                    assert torch.isfinite(s).all() and (s > 0).all(), (fmt, margin, pow2, eps, s)


# ---------------------------------------------------------------------------------------------------------------
# Tensorwise


@pytest.mark.parametrize("fmt", FMTS)
def test_tensorwise_codes_and_dequantize(fmt):
    torch.manual_seed(0)
    x = torch.randn(8, 96) * 3.7
    q = quantize(x, pol(Scaling.TENSORWISE, fmt))
    amax = x.abs().max().item()
    s = ref_scale(amax, fmt)
    assert q.scale.numpy().view(np.int32)[0, 0] == np.array([s]).view(np.int32)[0]
    assert q.amax.item() == amax
    scaled = x.numpy() * s  # float32 multiply
    assert scaled.dtype == np.float32
    assert np.array_equal(codes_of(q.codes), ref_codes(scaled, fmt))
    # dequantize: float32 reciprocal of the scale, then multiply (TE's order)
    rcp = np.float32(1) / s
    want = ref_values(scaled, fmt).astype(np.float32) * rcp
    got = dequantize(q).numpy()
    assert np.array_equal(got.view(np.int32), want.view(np.int32))
    by_division = ref_values(scaled, fmt).astype(np.float32) / s
    assert not np.array_equal(got, by_division), "dequantize must multiply by 1/scale, not divide by scale"
    assert dequantize(q).shape == x.shape and dequantize(q).dtype == x.dtype


def test_tensorwise_keeps_shape_and_dtype():
    x = (torch.randn(2, 3, 16) * 5).to(torch.bfloat16)
    q = quantize(x, pol(Scaling.TENSORWISE))
    assert q.codes.shape == (6, 16)
    y = dequantize(q)
    assert y.shape == x.shape and y.dtype == torch.bfloat16
    assert dequantize(q, torch.float32).dtype == torch.float32


def test_tensorwise_all_zero():
    for fmt in FMTS:
        q = quantize(torch.zeros(4, 33), pol(Scaling.TENSORWISE, fmt))
        assert q.scale.item() == 1.0 and q.scale_inv.item() == 1.0
        y = dequantize(q)
        assert torch.equal(y, torch.zeros(4, 33)) and not torch.isnan(y).any()


def test_tensorwise_with_inf_input():
    x = torch.tensor([[1.0, -2.0, math.inf, 3.0]])
    q = quantize(x, pol(Scaling.TENSORWISE))
    assert q.scale.item() == 1.0 and torch.isfinite(q.scale).all()
    y = dequantize(q)
    assert y.tolist() == [[1.0, -2.0, 448.0, 3.0]]


def test_tensorwise_nan_elements_stay_nan_scale_finite():
    x = torch.tensor([[1.0, math.nan, -3.0, 0.5]])
    q = quantize(x, pol(Scaling.TENSORWISE))
    assert q.amax.item() == 3.0  # NaN ignored by the amax
    assert q.scale.item() == float(np.float32(448) / np.float32(3))
    y = dequantize(q)
    assert torch.isnan(y[0, 1]) and not torch.isnan(y[0, [0, 2, 3]]).any()


@pytest.mark.parametrize("fmt", FMTS)
def test_tensorwise_margin_epsilon_pow2_reach_the_scale(fmt):
    x = torch.tensor([[0.3, -1.7, 2.9]])
    for kw, ref_kw in [({"margin": 2}, {"margin": 2}), ({"pow2_scales": True}, {"pow2": True}),
                       ({"amax_epsilon": 10.0}, {"eps": 10.0})]:
        q = quantize(x, pol(Scaling.TENSORWISE, fmt, **kw))
        assert q.scale.item() == float(ref_scale(2.9, fmt, **ref_kw)), kw


def test_amax_reduce_applies_to_tensorwise():
    x = torch.tensor([[1.0, -2.0, 0.5]])
    seen = []

    def reduce(a):
        seen.append(a.clone())
        return a * 4  # "another rank had a 4x larger amax"

    q = quantize(x, pol(Scaling.TENSORWISE), amax_reduce=reduce)
    assert len(seen) == 1 and seen[0].item() == 2.0
    assert q.scale.item() == float(np.float32(448) / np.float32(8))
    assert q.amax.item() == 2.0  # this rank's amax is kept
    # the reduce callable may modify its argument without corrupting q.amax
    q2 = quantize(x, pol(Scaling.TENSORWISE), amax_reduce=lambda a: a.mul_(4))
    assert q2.amax.item() == 2.0 and q2.scale.item() == q.scale.item()


def test_amax_reduce_not_used_for_block_amaxes():
    calls = []
    for scaling in (Scaling.BLOCKWISE, Scaling.MXFP8):
        quantize(torch.randn(4, 64), pol(scaling), amax_reduce=lambda a: calls.append(a) or a)
    assert calls == []


def test_quantize_none_raises():
    with pytest.raises(ValueError, match="none"):
        quantize(torch.ones(2, 2), pol(Scaling.NONE))
    x = torch.randn(3)
    assert fake_quant(x, pol(Scaling.NONE)) is x


# ---------------------------------------------------------------------------------------------------------------
# Blockwise


def hand_blockwise(x: np.ndarray, block, fmt, pow2=True):
    """Loop over blocks: scales, codes and dequantized values."""
    rows, cols = x.shape
    br, bc = block
    nbr, nbc = -(-rows // br), -(-cols // bc)
    scales = np.zeros((nbr, nbc), dtype=np.float32)
    codes = np.zeros(x.shape, dtype=np.int64)
    deq = np.zeros(x.shape, dtype=np.float32)
    for i in range(nbr):
        for j in range(nbc):
            sl = (slice(i * br, (i + 1) * br), slice(j * bc, (j + 1) * bc))
            blk = x[sl]
            a = np.nanmax(np.abs(blk)) if blk.size and not np.isnan(blk).all() else 0.0
            s = ref_scale(float(a), fmt, pow2=pow2)
            scales[i, j] = s
            scaled = blk * s
            codes[sl] = ref_codes(scaled, fmt)
            deq[sl] = ref_values(scaled, fmt).astype(np.float32) * (np.float32(1) / s)
    return scales, codes, deq


@pytest.mark.parametrize("shape,block", [
    ((4, 256), (1, 128)), ((256, 256), (128, 128)), ((512, 3), (256, 1)), ((100, 130), (1, 128)),
    ((100, 130), (128, 128)), ((7, 50), (2, 16)),
])
@pytest.mark.parametrize("fmt", FMTS)
def test_blockwise_matches_hand_loop(shape, block, fmt):
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-8, 8, shape, generator=g).float())
    x[0, : min(shape[1], 5)] *= 1000  # an outlier in the first block(s)
    q = quantize(x, pol(Scaling.BLOCKWISE, fmt, block=block, pow2_scales=True))
    scales, codes, deq = hand_blockwise(x.numpy(), block, fmt)
    assert q.scale.shape == scales.shape == (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    assert np.array_equal(q.scale.numpy(), scales)
    assert all(is_pow2(float(s)) for s in q.scale.flatten())
    assert np.array_equal(codes_of(q.codes), codes)
    assert np.array_equal(dequantize(q).numpy().view(np.int32), deq.view(np.int32))


def test_blockwise_non_pow2_scales():
    x = torch.randn(3, 200) * 3
    q = quantize(x, pol(Scaling.BLOCKWISE, block=(1, 128), pow2_scales=False))
    scales, codes, deq = hand_blockwise(x.numpy(), (1, 128), Format.E4M3, pow2=False)
    assert np.array_equal(q.scale.numpy(), scales)
    assert not all(is_pow2(float(s)) for s in q.scale.flatten())
    assert np.array_equal(dequantize(q).numpy(), deq)


def test_blockwise_partial_edge_blocks_equal_zero_padding():
    x = torch.randn(100, 130) * 5
    x[:, 128:] *= 1e-6  # the partial edge blocks hold tiny values: any non-zero padding would raise their amax
    p = pol(Scaling.BLOCKWISE, block=(1, 128), pow2_scales=True)
    padded = torch.nn.functional.pad(x, (0, 126))  # 130 -> 256
    q, qp = quantize(x, p), quantize(padded, p)
    assert torch.equal(q.scale, qp.scale)
    assert torch.equal(q.amax[:, 1], x[:, 128:].abs().amax(dim=1))
    assert torch.equal(dequantize(q), dequantize(qp)[:, :130])
    p2 = pol(Scaling.BLOCKWISE, block=(128, 128), pow2_scales=True)
    padded2 = torch.nn.functional.pad(x, (0, 126, 0, 28))
    assert torch.equal(dequantize(quantize(x, p2)), dequantize(quantize(padded2, p2))[:100, :130])


def test_blockwise_all_zero_block():
    x = torch.randn(2, 256)
    x[1, 128:] = 0
    q = quantize(x, pol(Scaling.BLOCKWISE, block=(1, 128), pow2_scales=True))
    assert q.scale[1, 1].item() == 1.0 and q.amax[1, 1].item() == 0.0
    y = dequantize(q)
    assert torch.equal(y[1, 128:], torch.zeros(128)) and not torch.isnan(y).any()


def test_blockwise_outlier_only_costs_its_block():
    x = torch.ones(1, 256)
    x[0, 0] = 1000.0
    y = fake_quant(x, pol(Scaling.BLOCKWISE, block=(1, 128), pow2_scales=True))
    assert torch.equal(y[0, 128:], torch.ones(128))
    q = quantize(x, pol(Scaling.BLOCKWISE, block=(1, 128), pow2_scales=True))
    assert q.scale[0, 0] < q.scale[0, 1]


def test_blockwise_pow2_by_default_from_the_schema():
    r = Recipe.from_dict({"weights": "blockwise", "activations": "blockwise", "gradients": "blockwise"})
    for role in ("weights", "activations", "gradients"):
        p = r.policy(role)
        assert p.pow2_scales is True
        q = quantize(torch.randn(130, 260) * 3, p)
        assert all(is_pow2(float(s)) for s in q.scale.flatten())
    assert r.weights.block == (128, 128) and r.activations.block == (1, 128)


@pytest.mark.parametrize("block", [(1, 128), (128, 128), (2, 16), (256, 1)])
@pytest.mark.parametrize("fmt", FMTS)
def test_blockwise_columnwise_equals_transpose(block, fmt):
    x = torch.randn(100, 130) * 7
    p = pol(Scaling.BLOCKWISE, fmt, block=block, pow2_scales=True)
    qc = quantize(x, p, columnwise=True)
    qt = quantize(x.t().contiguous(), p)
    assert qc.block == (block[1], block[0])
    assert torch.equal(qc.scale, qt.scale.t())
    assert torch.equal(codes_of_t(qc.codes), codes_of_t(qt.codes).t())
    assert torch.equal(dequantize(qc), dequantize(qt).t())


def test_blockwise_input_dtype_bf16_scale_overflow():
    # TE's blockwise kernel uses the input type's max when fp8_max / amax overflows float32
    x = torch.zeros(1, 128, dtype=torch.bfloat16)
    x[0, 0] = 1e-38
    q = quantize(x, pol(Scaling.BLOCKWISE, block=(1, 128), pow2_scales=False))
    assert q.scale.item() == torch.finfo(torch.bfloat16).max
    assert torch.isfinite(q.scale_inv).all()


# ---------------------------------------------------------------------------------------------------------------
# MXFP8


@pytest.mark.parametrize("fmt,amax,rceil,floor", [
    (Format.E4M3, 448.0, 127, 127),
    (Format.E4M3, 449.0, 128, 127),
    (Format.E4M3, 1.0, 119, 119),      # 1/448 -> 2^-8 (rceil); 2^(0-8) (floor)
    (Format.E4M3, 0.0, 0, 0),
    (Format.E4M3, 224.0, 126, 126),
    (Format.E4M3, 256.0, 127, 127),
    (Format.E4M3, 255.0, 127, 126),
    (Format.E4M3, 896.0, 128, 128),
    (Format.E4M3, math.nan, 0, 0),
    (Format.E4M3, math.inf, 254, 254),
    (Format.E5M2, 57344.0, 127, 127),
    (Format.E5M2, 57345.0, 128, 127),
    (Format.E5M2, 1.0, 112, 112),      # emax 15
    (Format.E5M2, 0.0, 0, 0),
    (Format.E5M2, 32768.0, 127, 127),
    (Format.E5M2, 32767.0, 127, 126),
])
def test_e8m0_hand_codes(fmt, amax, rceil, floor):
    a = torch.tensor([amax], dtype=torch.float32)
    got_rceil = amax_to_e8m0(a, fmt, MxRounding.RCEIL)
    assert got_rceil.dtype == torch.uint8
    assert got_rceil.item() == rceil
    assert amax_to_e8m0(a, fmt, MxRounding.FLOOR).item() == floor
    assert amax_to_e8m0(a, fmt).item() == rceil  # rceil is the default


def test_e8m0_rceil_is_smallest_pow2_at_least_amax_over_max():
    rng = np.random.default_rng(3)
    amax = (np.exp2(rng.uniform(-60, 60, 3000)) * rng.uniform(1, 2, 3000)).astype(np.float32)
    for fmt in FMTS:
        codes = amax_to_e8m0(torch.from_numpy(amax), fmt, MxRounding.RCEIL).numpy().astype(np.int64)
        val = amax * (np.float32(1) / np.float32(fp8_spec(fmt).max))  # TE: amax * max_norm_rcp, float32
        want = np.array([math.ceil(math.log2(v)) + 127 for v in val.astype(np.float64)])
        assert np.array_equal(codes, want)
        floor = amax_to_e8m0(torch.from_numpy(amax), fmt, MxRounding.FLOOR).numpy().astype(np.int64)
        exponent = np.floor(np.log2(amax.astype(np.float64))).astype(np.int64)
        assert np.array_equal(floor, exponent - fp8_spec(fmt).emax + 127)


def test_e8m0_scale_inv_and_multiplier():
    code = torch.tensor([0, 1, 119, 127, 128, 254], dtype=torch.uint8)
    assert e8m0_to_scale_inv(code).tolist() == [2.0**-127, 2.0**-126, 2.0**-8, 1.0, 2.0, 2.0**127]
    assert e8m0_to_multiplier(code).tolist() == [1.0, 2.0**126, 2.0**8, 1.0, 0.5, 2.0**-127]


@pytest.mark.parametrize("fmt", FMTS)
def test_mxfp8_floor_saturates_rceil_does_not(fmt):
    m = fp8_spec(fmt).max
    x = torch.linspace(-1, 1, 32).reshape(1, 32)
    x[0, 5] = m * 1.1  # the block's max is above the format's max at scale 1: floor keeps scale 1 and saturates
    qf = quantize(x, pol(Scaling.MXFP8, fmt, mx_rounding=MxRounding.FLOOR))
    qr = quantize(x, pol(Scaling.MXFP8, fmt, mx_rounding=MxRounding.RCEIL))
    assert qf.e8m0.item() == 127 and qr.e8m0.item() == 128
    assert dequantize(qf)[0, 5].item() == m  # saturated
    assert dequantize(qr)[0, 5].item() > m
    assert qr.scale_inv.item() == 2.0 and qr.scale.item() == 0.5


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("rounding", list(MxRounding))
def test_mxfp8_blocks_of_32_and_scale_inv(fmt, rounding):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(6, 100, generator=g) * torch.exp2(torch.randint(-10, 10, (6, 100), generator=g).float())
    q = quantize(x, pol(Scaling.MXFP8, fmt, mx_rounding=rounding))
    assert q.block == (1, 32) and q.e8m0.shape == q.scale.shape == (6, 4)
    # hand loop: amax of each 32-element chunk of each row (the last chunk has 4 elements)
    for i in range(6):
        for j in range(4):
            blk = x[i, 32 * j: 32 * (j + 1)]
            assert q.amax[i, j].item() == blk.abs().max().item()
            code = int(amax_to_e8m0(blk.abs().max().reshape(1), fmt, rounding).item())
            assert q.e8m0[i, j].item() == code
            assert q.scale_inv[i, j].item() == 2.0 ** (code - 127)
            scaled = (blk * (2.0 ** (127 - code) if code else 1.0)).numpy()
            assert np.array_equal(codes_of(q.codes[i, 32 * j: 32 * (j + 1)]), ref_codes(scaled, fmt))
    assert torch.equal(dequantize(q), q.codes.float() * expand(q.scale_inv, (1, 32), 6, 100))
    # columnwise: blocks of 32 along dim 0
    qc = quantize(x.t().contiguous(), pol(Scaling.MXFP8, fmt, mx_rounding=rounding), columnwise=True)
    assert qc.block == (32, 1) and qc.e8m0.shape == (4, 6)
    assert torch.equal(qc.e8m0, q.e8m0.t())
    assert torch.equal(dequantize(qc), dequantize(q).t())


def test_mxfp8_outlier_stays_in_its_block():
    x = torch.ones(1, 96)
    x[0, 40] = 1e4
    q = quantize(x, pol(Scaling.MXFP8))
    assert q.e8m0[0, 0] == q.e8m0[0, 2] != q.e8m0[0, 1]
    assert torch.equal(dequantize(q)[0, :32], torch.ones(32))


def test_mxfp8_all_zero_block():
    x = torch.zeros(2, 64)
    x[0, 0] = 3.0
    q = quantize(x, pol(Scaling.MXFP8))
    assert q.e8m0[1].tolist() == [0, 0] and q.e8m0[0, 1].item() == 0
    y = dequantize(q)
    assert torch.equal(y[1], torch.zeros(64)) and not torch.isnan(y).any() and y[0, 0].item() == 3.0


def test_mxfp8_schema_forces_block_and_pow2():
    p = Recipe.from_dict({"weights": {"scaling": "mxfp8"}}).weights
    assert p.block == (1, 32) and p.pow2_scales is True
    # E8M0 scales are powers of two by construction: asking otherwise is an error naming the key
    with pytest.raises(ValueError, match=r"weights\.pow2_scales: false does not apply to scaling: mxfp8"):
        Recipe.from_dict({"weights": {"scaling": "mxfp8", "pow2_scales": False}})


# ---------------------------------------------------------------------------------------------------------------
# Delayed scaling


class RefDelayed:
    """TE's DelayedScaling in plain Python: history[0] holds this step's amax; update rolls by -1, clears slot 0."""

    def __init__(self, n, fmt, margin=0, algo="max"):
        self.h = [0.0] * n
        self.scale = np.float32(1.0)
        self.fmt, self.margin, self.algo = fmt, margin, algo

    def observe(self, a):
        self.h[0] = max(self.h[0], float(np.float32(a)))

    def update(self):
        amax = max(self.h) if self.algo == "max" else self.h[0]
        if amax > 0 and math.isfinite(amax):
            s = np.float32(fp8_spec(self.fmt).max) / np.float32(amax)
            self.scale = np.float32(s * np.float32(2.0**-self.margin))
        if len(self.h) > 1:
            self.h = self.h[1:] + self.h[:1]
        self.h[0] = 0.0


def delayed(n=8, fmt=Format.E4M3, margin=0, algo=AmaxAlgo.MAX, **kw):
    return TensorPolicy(scaling=Scaling.DELAYED, format=fmt, margin=margin, amax_history_len=n,
                        amax_compute_algo=algo, **kw)


def test_delayed_first_quantization_uses_scale_one():
    p = delayed(4)
    s = DelayedScaler(p)
    x = torch.tensor([[3.0, -5.0, 0.25]])
    q = quantize(x, p, scaler=s)
    assert q.scale.item() == 1.0 and s.history.tolist() == [5.0, 0, 0, 0]
    assert torch.equal(dequantize(q), x)  # exact in E4M3 at scale 1
    quantize(x * 2, p, scaler=s)  # a second quantization in the same step keeps the max
    assert s.history[0].item() == 10.0
    s.update()
    assert s.scale.item() == float(np.float32(448) / np.float32(10))
    assert s.history.tolist() == [0, 0, 0, 10.0]
    assert quantize(x, p, scaler=s).scale.item() == s.scale.item()


def test_delayed_needs_a_scaler():
    with pytest.raises(ValueError, match="DelayedScaler"):
        quantize(torch.ones(2, 2), delayed())


@pytest.mark.parametrize("algo", [AmaxAlgo.MAX, AmaxAlgo.MOST_RECENT])
@pytest.mark.parametrize("n,margin,fmt", [(1, 0, Format.E4M3), (4, 0, Format.E4M3), (16, 2, Format.E5M2)])
def test_delayed_matches_te_rule(algo, n, margin, fmt):
    rng = np.random.default_rng(n + margin)
    p = delayed(n, fmt, margin, algo)
    s, ref = DelayedScaler(p), RefDelayed(n, fmt, margin, str(algo))
    for step in range(60):
        for _ in range(int(rng.integers(0, 3))):  # 0..2 quantizations per step
            a = float(np.float32(rng.choice([0.0, rng.uniform(0.1, 10), rng.uniform(100, 1000)])))
            x = torch.tensor([[a, -a / 2]])
            assert quantize(x, p, scaler=s).scale.item() == float(ref.scale)
            ref.observe(a)
        assert s.history.tolist() == ref.h, step
        s.update()
        ref.update()
        assert s.history.tolist() == ref.h, step
        assert s.scale.item() == float(ref.scale), step


def test_delayed_roll_is_torch_roll_minus_one_then_clear():
    p = delayed(5)
    s = DelayedScaler(p)
    s.history.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]))
    s.update()
    assert s.history.tolist() == [0.0, 3.0, 4.0, 5.0, 1.0]  # slot 1's amax is dropped, as in TE
    assert s.scale.item() == float(np.float32(448) / np.float32(5))


def test_delayed_outlier_ages_out_after_history_len_updates():
    n = 6
    s = DelayedScaler(delayed(n))
    s.observe(torch.tensor(1000.0))
    s.update()
    outlier_scale = float(np.float32(448) / np.float32(1000))
    normal_scale = float(np.float32(448) / np.float32(2))
    scales = [s.scale.item()]
    for _ in range(n):
        s.observe(torch.tensor(2.0))
        s.update()
        scales.append(s.scale.item())
    assert scales[:n] == [outlier_scale] * n  # the outlier rules for n updates (its own and n-1 more)
    assert scales[n] == normal_scale


def test_delayed_amax_zero_keeps_previous_scale():
    for algo in (AmaxAlgo.MAX, AmaxAlgo.MOST_RECENT):
        s = DelayedScaler(delayed(1, algo=algo))
        s.observe(torch.tensor(2.0))
        s.update()
        assert s.scale.item() == 224.0
        s.update()  # nothing observed: amax 0
        assert s.scale.item() == 224.0
        s.observe(torch.tensor(math.inf))
        s.update()  # non-finite amax: keep
        assert s.scale.item() == 224.0


def test_delayed_most_recent_ignores_history():
    s = DelayedScaler(delayed(8, algo=AmaxAlgo.MOST_RECENT))
    for a in (100.0, 1.0):
        s.observe(torch.tensor(a))
        s.update()
    assert s.scale.item() == 448.0


def test_delayed_percentile():
    s = DelayedScaler(delayed(16, algo=AmaxAlgo.PERCENTILE, percentile=50.0))
    vals = [1.0, 2.0, 3.0, 4.0, 100.0]
    for a in vals:
        s.observe(torch.tensor(a))
        s.update()
    assert s.scale.item() == pytest.approx(448 / 3.0, rel=1e-6)  # median of the seen amaxes (zeros skipped)
    s2 = DelayedScaler(delayed(16, algo=AmaxAlgo.PERCENTILE, percentile=90.0))
    for a in vals:
        s2.observe(torch.tensor(a))
        s2.update()
    assert s2.scale.item() == pytest.approx(448 / np.percentile(vals, 90), rel=1e-6)


def test_delayed_pow2_and_margin():
    s = DelayedScaler(delayed(4, margin=1, pow2_scales=True))
    s.observe(torch.tensor(3.0))
    s.update()
    assert s.scale.item() == 64.0  # 448/3/2 = 74.67 -> 64


def test_delayed_reduce_callable():
    s = DelayedScaler(delayed(4))
    s.observe(torch.tensor(2.0))
    s.update(reduce=lambda a: a * 8)
    assert s.scale.item() == 28.0  # 448 / 16
    assert s.history.tolist() == [0.0, 0.0, 0.0, 16.0]


def test_delayed_state_dict_round_trip():
    p = delayed(4)
    s = DelayedScaler(p)
    for a in (3.0, 7.0):
        s.observe(torch.tensor(a))
        s.update()
    s.observe(torch.tensor(5.0))
    state = s.state_dict()
    s.history[0] = 999.0  # the state dict is a copy
    assert state["history"][0].item() == 5.0
    t = DelayedScaler(p)
    t.load_state_dict(state)
    assert t.history.tolist() == [5.0, 0.0, 3.0, 7.0] and t.scale.item() == s.scale.item()
    with pytest.raises(ValueError, match="amax_history_len"):
        DelayedScaler(delayed(8)).load_state_dict(state)


# ---------------------------------------------------------------------------------------------------------------
# Properties (hypothesis)


PROPERTY_POLICIES = {
    "tensorwise-e4m3": pol(Scaling.TENSORWISE, Format.E4M3),
    "tensorwise-e5m2": pol(Scaling.TENSORWISE, Format.E5M2),
    "tensorwise-pow2-e4m3": pol(Scaling.TENSORWISE, Format.E4M3, pow2_scales=True),
    "tensorwise-pow2-e5m2": pol(Scaling.TENSORWISE, Format.E5M2, pow2_scales=True),
    "delayed-e4m3": delayed(4, Format.E4M3),
    "delayed-e5m2": delayed(4, Format.E5M2),
    "blockwise-1x128-e4m3": pol(Scaling.BLOCKWISE, Format.E4M3, block=(1, 128), pow2_scales=True),
    "blockwise-2x16-e5m2": pol(Scaling.BLOCKWISE, Format.E5M2, block=(2, 16), pow2_scales=True),
    "blockwise-128x128-e4m3": pol(Scaling.BLOCKWISE, Format.E4M3, block=(128, 128), pow2_scales=True),
    "blockwise-1x16-nonpow2-e4m3": pol(Scaling.BLOCKWISE, Format.E4M3, block=(1, 16), pow2_scales=False),
    "mxfp8-rceil-e4m3": pol(Scaling.MXFP8, Format.E4M3),
    "mxfp8-rceil-e5m2": pol(Scaling.MXFP8, Format.E5M2),
    "mxfp8-floor-e4m3": pol(Scaling.MXFP8, Format.E4M3, mx_rounding=MxRounding.FLOOR),
    "mxfp8-floor-e5m2": pol(Scaling.MXFP8, Format.E5M2, mx_rounding=MxRounding.FLOOR),
}
IDEMPOTENT = [k for k, p in PROPERTY_POLICIES.items()
              if p.scaling in (Scaling.BLOCKWISE, Scaling.MXFP8) and (p.pow2_scales or p.scaling is Scaling.MXFP8)
              or (p.scaling is Scaling.TENSORWISE and p.pow2_scales)]

PROPS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def tensors(draw):
    rows = draw(st.integers(1, 5))
    cols = draw(st.integers(1, 70))
    elems = st.one_of(st.just(0.0), st.floats(-1000, 1000, width=32, allow_subnormal=False))
    vals = draw(st.lists(elems, min_size=rows * cols, max_size=rows * cols))
    exp = draw(st.integers(-30, 30))  # overall magnitude
    return torch.tensor(vals, dtype=torch.float32).reshape(rows, cols) * 2.0**exp


def run(x: torch.Tensor, policy: TensorPolicy, columnwise: bool = False):
    scaler = None
    if policy.scaling is Scaling.DELAYED:  # a scaler that has seen this tensor once: scale from its amax
        scaler = DelayedScaler(policy)
        scaler.observe(x.abs().max())
        scaler.update()
    q = quantize(x, policy, columnwise=columnwise, scaler=scaler)
    return q, dequantize(q)


@pytest.mark.parametrize("name", list(PROPERTY_POLICIES))
@PROPS
@given(x=tensors(), columnwise=st.booleans())
def test_property_relative_error_within_half_ulp(name, x, columnwise):
    p = PROPERTY_POLICIES[name]
    q, y = run(x, p, columnwise)
    spec = fp8_spec(p.format)
    s_el = expand(q.scale, q.block, *x.shape)
    scaled = (x * s_el).abs()
    ok = (scaled >= spec.min_normal) & (scaled <= spec.max) & (x != 0)
    rel = ((y - x).abs() / x.abs())[ok]
    assert (rel <= HALF_ULP[p.format] + 1e-6).all(), rel.max()
    assert not torch.isnan(y).any()
    assert ((torch.sign(y) == torch.sign(x)) | (y == 0)).all()
    # |y| never exceeds the block's amax by more than one rounding step: half an ulp in the normal range, half the
    # smallest subnormal (in scaled units) below it (e.g. a 1e-41 block whose scale saturates at 2^127)
    amax_el = expand(q.amax, q.block, *x.shape)
    step = spec.min_subnormal / 2 / s_el
    assert (y.abs() <= amax_el * (1 + HALF_ULP[p.format]) * (1 + 1e-6) + step).all()


@pytest.mark.parametrize("name", IDEMPOTENT)
@PROPS
@given(x=tensors(), columnwise=st.booleans())
def test_property_fake_quant_idempotent(name, x, columnwise):
    p = PROPERTY_POLICIES[name]
    once = fake_quant(x, p, columnwise=columnwise)
    twice = fake_quant(once, p, columnwise=columnwise)
    assert torch.equal(once, twice)


@pytest.mark.parametrize("name", [k for k, p in PROPERTY_POLICIES.items() if p.scaling is Scaling.MXFP8
                                  and p.mx_rounding is MxRounding.RCEIL])
@PROPS
@given(x=tensors())
def test_property_mxfp8_rceil_never_clips(name, x):
    # rceil picks 2^k >= amax / fp8_max, so the scaled block max rounds to at most fp8_max: no value is clipped
    p = PROPERTY_POLICIES[name]
    q, y = run(x, p)
    scaled = (x * expand(q.scale, q.block, *x.shape)).abs()
    assert (scaled <= fp8_spec(p.format).max * (1 + HALF_ULP[p.format])).all()


def test_idempotence_list_covers_the_modes():
    assert {PROPERTY_POLICIES[k].scaling for k in IDEMPOTENT} == {Scaling.TENSORWISE, Scaling.BLOCKWISE, Scaling.MXFP8}
