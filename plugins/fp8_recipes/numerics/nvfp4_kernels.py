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
