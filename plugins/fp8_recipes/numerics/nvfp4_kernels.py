"""The Triton kernel of the NVFP4 random Hadamard transform (imported by numerics/nvfp4.py only, lazily, on a GPU or
in Triton's CPU interpreter, ``TRITON_INTERPRET=1``, which the tests use on machines without one).

The columnwise copy the wgrad GEMM reads is x^T, and its RHT mixes each 16 consecutive values of a row of x^T: 16
consecutive rows of x, column by column. :func:`rht_base_layout` takes that copy as the transposed view it is and
works in x's own layout: each program loads a tile of 16 rows x ``BLOCK_M`` columns once (whole rows, coalesced) and
keeps the 16 outputs of each column in float32 registers, adding the products ``x[k] * H[k, j]`` for k = 0..15 in
order, as :func:`~fp8_recipes.numerics.nvfp4.apply_rht` does, then rounds each sum once to x's dtype: the same bits
for bf16 and fp16 inputs, whose products with +-1/4 are exact (so a fused multiply-add rounds as a multiply and an
add do). A float32 input's products are not exact for subnormals: it never comes here. torch.compile's form of
the same sums took 57 ms of an emulated NVFP4 step of 8 Llama-3-8B layers on the H100 (2026-12-06): one pass over
memory each way should take a few.
"""

import torch
import triton
import triton.language as tl

BLOCK_M = 256  # columns per program: 16 x 256 float32 sums, 32 registers a thread with 4 warps


@triton.jit
def _bf16_bits(acc):
    """float32 -> the bits of bf16 (int16), rounded to nearest even as torch rounds finite values and infinities, in
    integer arithmetic (Triton's interpreter casts to bf16 by truncation); NaN -> 0x7FC0, a quiet NaN (torch's own
    NaN bits differ by device; the tests compare where NaN is, not its bits)."""
    bits = acc.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return tl.where(acc != acc, 0x7FC0, rounded).to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def _rht_rows_kernel(x_ptr, h_ptr, out_ptr, groups, cols, BLOCK_M: tl.constexpr, BF16: tl.constexpr):
    """out[16 g + j, m] = sum over k = 0..15, in order, of x[16 g + k, m] * h[k, j] (float32), in out's dtype (the
    bits of bf16 as int16 with BF16); x and out row-major (groups * 16, cols)."""
    g = tl.program_id(0).to(tl.int64)
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    j = tl.arange(0, 16)
    keep = m < cols
    first = g * 16 * cols + m  # row 16 g, the tile's columns
    acc = tl.zeros((16, BLOCK_M), dtype=tl.float32)
    for k in tl.static_range(16):
        xk = tl.load(x_ptr + first + k * cols, mask=keep, other=0.0).to(tl.float32)
        hk = tl.load(h_ptr + k * 16 + j)  # H[k, :]
        acc += hk[:, None] * xk[None, :]
    rows = first[None, :] + j[:, None].to(tl.int64) * cols
    if BF16:
        tl.store(out_ptr + rows, _bf16_bits(acc), mask=keep[None, :])
    else:
        tl.store(out_ptr + rows, acc.to(out_ptr.dtype.element_ty), mask=keep[None, :])


def rht_base_layout(v: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """apply_rht(v) for ``v`` = base^T (nvfp4._base_layout: base contiguous, its rows in 16s), bf16 or fp16, ``h``
    the float32 RHT matrix on v's device: a transposed view of a new tensor in base's layout, as apply_rht returns
    it."""
    base = v.t()
    out = torch.empty_like(base)
    rows, cols = base.shape
    if base.numel():
        bf16 = base.dtype == torch.bfloat16
        _rht_rows_kernel[(rows // 16, triton.cdiv(cols, BLOCK_M))](
            base, h, out.view(torch.int16) if bf16 else out, rows // 16, cols, BLOCK_M=BLOCK_M, BF16=bf16, num_warps=4)
    return out.t()


# ---------------------------------------------------------------------------------------------------------------
# Stochastic rounding with the random numbers drawn in the kernel
#
# The uniform of element k of a copy (its padded 2-D view, row-major) is component k % 4 of tl.rand4x(seed, k // 4):
# Philox4x32 (10 rounds) of the 64-bit seed and the 64-bit counter k // 4, each of its four 32-bit words scaled into
# [0, 1) (Triton's uint_to_uniform_float: 31 bits). The same number whether a kernel draws it beside the value it
# rounds (values_sr) or writes it out (uniforms, which the quantizer's codes read): fake_quant_nvfp4 and
# dequantize_nvfp4(quantize_nvfp4(...)) agree bit for bit. Drawn in the values kernel, no float32 uniform goes
# through memory: torch.rand's 4 bytes a value written and read back cost 26 of the 92 ms six emulated NVFP4 layers
# add to a step (the H100, 2026-12-06). All four words of a Philox call are used: one call a value (tl.rand) made
# the kernel compute-bound, 24.5 ms a step on 16 Llama-3-8B layers at micro-batch 1 (the H100, 2026-12-06).

BLOCK_SR = 256  # Philox calls (of 4 values each) per program of uniforms
TILE_SR = (16, 128)  # rows x columns of x per program of values_sr (16 rows: one block of a column of x^T)


@triton.jit
def _uniforms_kernel(out_ptr, n, seed, BLOCK: tl.constexpr):
    g = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    u0, u1, u2, u3 = tl.rand4x(seed, g)
    tl.store(out_ptr + 4 * g, u0, mask=4 * g < n)
    tl.store(out_ptr + 4 * g + 1, u1, mask=4 * g + 1 < n)
    tl.store(out_ptr + 4 * g + 2, u2, mask=4 * g + 2 < n)
    tl.store(out_ptr + 4 * g + 3, u3, mask=4 * g + 3 < n)


def uniforms(seed: int, shape, device) -> torch.Tensor:
    """float32 uniforms in [0, 1): u.flatten()[k] is component k % 4 of tl.rand4x(seed, k // 4), what values_sr
    draws for element k."""
    out = torch.empty(shape, dtype=torch.float32, device=device)
    if out.numel():
        _uniforms_kernel[(triton.cdiv(out.numel(), 4 * BLOCK_SR),)](out, out.numel(), seed, BLOCK=BLOCK_SR)
    return out


@triton.jit
def _interleave4(u0, u1, u2, u3):
    """(..., n) x 4 -> (..., 4 n): u_c's element b at 4 b + c."""
    return tl.interleave(tl.interleave(u0, u2), tl.interleave(u1, u3))


@triton.jit
def _tile_uniforms(seed, i0, j0, n0, n1, COLUMN: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    """The (ROWS, COLS) tile of uniforms whose element (0, 0) is x's (i0, j0): rowwise, k = the
    element's index in x (runs of 4 along a row: n1 % 4 == 0); COLUMN, its index in x^T (runs of 4 down a column:
    n0 % 4 == 0). One Philox call per 4 values, interleaved back to the elements."""
    if COLUMN:  # (drawn as the x^T tile, (COLS, ROWS), and transposed)
        j = j0 + tl.arange(0, COLS)[:, None]
        a = tl.arange(0, ROWS // 4)[None, :]
        u0, u1, u2, u3 = tl.rand4x(seed, (j * n0 + i0) // 4 + a)
        return tl.trans(_interleave4(u0, u1, u2, u3))
    i = i0 + tl.arange(0, ROWS)[:, None]
    b = tl.arange(0, COLS // 4)[None, :]
    u0, u1, u2, u3 = tl.rand4x(seed, (i * n1 + j0) // 4 + b)
    return _interleave4(u0, u1, u2, u3)


@triton.jit
def _values_sr_kernel(x_ptr, mult_ptr, dec_ptr, out_ptr, n0, n1, m0, m1, d0, d1, seed,
                      COLUMN: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr, BF16: tl.constexpr):
    """out = the NVFP4 value of each x (contiguous (n0, n1)), rounded stochastically: nvfp4._dequantized_values
    with the uniforms of _tile_uniforms. Rows: the copy is x, its blocks 1x16 along a row, the factors of block
    (i, j // 16) (multiplier at i * m0 + (j // 16) * m1, decode by d0, d1). COLUMN: the copy is x^T (x its base),
    a block is 16 rows of a column of x: the factors of x^T's block (j, i // 16)."""
    i0 = tl.program_id(0).to(tl.int64) * ROWS
    j0 = tl.program_id(1).to(tl.int64) * COLS
    i = i0 + tl.arange(0, ROWS)[:, None]
    j = j0 + tl.arange(0, COLS)[None, :]
    keep = (i < n0) & (j < n1)
    e = i * n1 + j
    if COLUMN:
        p, q = j, i // 16
    else:
        p, q = i, j // 16
    multiplier = tl.load(mult_ptr + p * m0 + q * m1, mask=keep, other=1.0)
    scaled = tl.load(x_ptr + e, mask=keep, other=0.0).to(tl.float32) * multiplier
    scaled = tl.where(scaled > 6.0, 6.0, tl.where(scaled < -6.0, -6.0, scaled))  # (NaN stays NaN)
    a = tl.abs(scaled)
    a = tl.where(a != a, 0.0, a)
    in_steps = a * tl.where(a < 2.0, 2.0, tl.where(a < 4.0, 1.0, 0.5))  # exact: the steps are powers of two
    mag = tl.floor(in_steps)
    u = _tile_uniforms(seed, i0, j0, n0, n1, COLUMN, ROWS, COLS)
    mag += tl.where(u < in_steps - mag, 1.0, 0.0)  # up with probability the fraction of a step
    value = mag * tl.where(a < 2.0, 0.5, tl.where(a < 4.0, 1.0, 2.0))
    # the sign as a bit, so that a small negative rounded to 0 is -0.0 (code 8), as copysign in the eager form
    sign = tl.where(scaled < 0.0, 0x80000000, 0).to(tl.uint32)
    signed = (value.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    out = signed * tl.load(dec_ptr + p * d0 + q * d1, mask=keep, other=1.0)
    if BF16:
        tl.store(out_ptr + e, _bf16_bits(out), mask=keep)
    else:
        tl.store(out_ptr + e, out.to(out_ptr.dtype.element_ty), mask=keep)


def values_sr(x: torch.Tensor, multiplier: torch.Tensor, decode: torch.Tensor, seed: int, dtype: torch.dtype,
              column: bool) -> torch.Tensor:
    """The stochastically rounded NVFP4 values of contiguous 2-D ``x`` in ``dtype``, x's layout: the copy is x
    (``column`` False: multiplier and decode (rows, cols / 16); cols a multiple of 4) or x^T (True: (cols, rows /
    16); rows a multiple of 4), the factors in any strides."""
    if x.shape[0 if column else 1] % 4:
        raise ValueError(f"values_sr: the copy's rows must be runs of 4 values; x is {tuple(x.shape)}")
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    if x.numel():
        bf16 = dtype == torch.bfloat16
        rows, cols = TILE_SR
        _values_sr_kernel[(triton.cdiv(x.shape[0], rows), triton.cdiv(x.shape[1], cols))](
            x, multiplier, decode, out.view(torch.int16) if bf16 else out, x.shape[0], x.shape[1],
            *multiplier.stride(), *decode.stride(), seed, COLUMN=column, ROWS=rows, COLS=cols, BF16=bf16,
            num_warps=4)
    return out


# ---------------------------------------------------------------------------------------------------------------
# The block scales' arithmetic in one pass
#
# From the block amaxes and the global amax: S_enc, each block's E4M3 scale, its encode multiplier and its decode
# factor, as nvfp4.nvfp4_global_scale / nvfp4_block_scales / _encode_multiplier / _decode_factors compute them
# eagerly: the same float32 products in the same order, divisions correctly rounded (div_rn, as torch's CUDA
# division and reciprocal), minima that keep NaN, the E4M3 cast rounded to nearest even (saturating: the value is
# at most 448 by then; NaN -> 0x7F). Eagerly they were a dozen launches over the per-block tensors for each copy,
# 28 ms of an emulated NVFP4 step of 16 Llama-3-8B layers on the H100 (2026-12-06).

BLOCK_FACTORS = 1024  # blocks per program
FP4_MAX_INV = float(torch.tensor(1.0) / torch.tensor(6.0))  # fp32(1/6) (a float32 quotient: exact as a Python float)
FACTOR_INV = float(torch.tensor(1.0) / torch.tensor(2688.0))  # fp32(1/2688)
FLOAT32_MAX: tl.constexpr = tl.constexpr(3.4028234663852886e38)  # (a global a kernel reads is a constexpr)


@triton.jit
def _e4m3_code(scale):
    """float32 0 <= scale <= 448, or NaN -> its E4M3 code (uint32), rounded to nearest even as torch's cast, NaN
    0x7F; in integer and exact float32 arithmetic (Triton's interpreter casts E4M3 subnormals and NaN wrongly)."""
    bits = scale.to(tl.uint32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - (120 << 3)  # float32's exponent and 3 bits, rebiased
    subnormal = ((scale * 512.0 + 8388608.0) - 8388608.0).to(tl.uint32)  # m of m * 2^-9, even ties (8: 2^-6)
    return tl.where(scale != scale, 0x7F, tl.where(scale < 0.015625, subnormal, normal))


@triton.jit
def _e4m3_value(code):
    """An E4M3 code (uint32, not NaN's) -> its float32 value."""
    e, m = code >> 3, code & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    return tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)


@triton.jit
def _block_factors_kernel(bamax_ptr, amax_ptr, enc_ptr, scale_ptr, mult_ptr, dec_ptr, n, fp4_max_inv, factor_inv,
                          BLOCK: tl.constexpr):
    """For each of n blocks (block amax at bamax_ptr, float32): its E4M3 scale (bits, uint8), encode multiplier and
    decode factor (float32); S_enc at enc_ptr (program 0). fp4_max_inv = fp32(1/6), factor_inv = fp32(1/2688)."""
    amax = tl.load(amax_ptr)
    enc = tl.minimum(tl.math.div_rn(tl.full([], 2688.0, tl.float32), amax), FLOAT32_MAX,
                     propagate_nan=tl.PropagateNan.ALL)
    enc = tl.where((amax == 0.0) | (enc == 0.0), 1.0, enc)
    tl.store(enc_ptr, enc, mask=tl.program_id(0) == 0)
    k = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    keep = k < n
    scale = tl.minimum(tl.load(bamax_ptr + k, mask=keep, other=0.0) * (enc * fp4_max_inv), FLOAT32_MAX,
                       propagate_nan=tl.PropagateNan.ALL)
    scale = tl.abs(scale)
    scale = tl.where(scale > 448.0, 448.0, scale)  # (NaN stays NaN)
    code = _e4m3_code(scale)
    tl.store(scale_ptr + k, code.to(tl.uint8), mask=keep)
    decoded = tl.where(scale != scale, scale, _e4m3_value(code))
    global_decode = tl.math.div_rn(tl.full([], 1.0, tl.float32), enc)
    multiplier = tl.minimum(tl.math.div_rn(tl.full([BLOCK], 1.0, tl.float32), decoded * global_decode),
                            FLOAT32_MAX, propagate_nan=tl.PropagateNan.ALL)
    tl.store(mult_ptr + k, multiplier, mask=keep)
    tl.store(dec_ptr + k, decoded * amax * factor_inv, mask=keep)


def block_factors(block_amax: torch.Tensor, amax: torch.Tensor):
    """(S_enc, the E4M3 block scales, the encode multipliers, the decode factors) of float32 ``block_amax`` and the
    0-d float32 global ``amax``, as nvfp4's eager functions compute them; the per-block ones in block_amax's layout
    where it is a transposed view of a contiguous 2-D tensor (a columnwise copy's, read in its base's layout)."""
    if block_amax.dim() == 2 and not block_amax.is_contiguous() and block_amax.t().is_contiguous():
        enc, *per_block = block_factors(block_amax.t(), amax)
        return enc, *(t.t() for t in per_block)
    bamax = block_amax.float().contiguous()  # (float32 factors from any block amaxes, as the eager functions')
    enc = torch.empty((), dtype=torch.float32, device=bamax.device)
    scales = torch.empty(bamax.shape, dtype=torch.uint8, device=bamax.device)
    multiplier, decode = torch.empty_like(bamax), torch.empty_like(bamax)
    n = bamax.numel()
    _block_factors_kernel[(max(1, triton.cdiv(n, BLOCK_FACTORS)),)](
        bamax, amax.float().contiguous(), enc, scales, multiplier, decode, n, FP4_MAX_INV, FACTOR_INV,
        BLOCK=BLOCK_FACTORS, num_warps=4)
    return enc, scales.view(torch.float8_e4m3fn), multiplier, decode
