"""Quantize / dequantize / fake-quantize a tensor under a :class:`~fp8_recipes.recipe.schema.TensorPolicy`.

Every scaling mode is one block quantizer with a different block and scale rule:

==========  =================================  =========================================================
scaling     block (rows x cols of the 2-D view)   scale
==========  =================================  =========================================================
tensorwise  the whole tensor                    fp8_max / amax (TE's compute_scale_from_amax)
delayed     the whole tensor                    from the amax history (:class:`DelayedScaler`)
blockwise   ``policy.block`` (e.g. 1x128)       fp8_max / block amax, power of two by default
mxfp8       1x32                                E8M0 exponent, rceil (NVIDIA) or floor (OCP MX v1.0)
nvfp4       ``policy.block`` (1x16 or 16x16)    E4M3 per 16 values x FP32 per tensor (:mod:`.nvfp4`)
==========  =================================  =========================================================

A tensor is viewed as 2-D: (all leading dims flattened, last dim). The last dim is the GEMM's reduction dim
for the operand as it is laid out (rowwise usage). ``columnwise=True`` quantizes for the transposed usage (as
TE's columnwise copy): the block is transposed, e.g. 1x128 becomes 128x1 and MXFP8's 1x32 becomes 32x1.
Dimensions not divisible by the block are allowed: edge blocks are partial, which is the same as zero
padding (zeros never raise an amax), and is what TE does. NVFP4 is :mod:`.nvfp4`'s (TE's reference quantizer):
its columnwise copy is the RHT'd one when the policy asks (``rht``, the wgrad operands), and its stochastic rounding
draws from ``seed``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fp8_recipes.numerics.formats import FLOAT32_MAX, fp8_to_float32, to_fp8_saturated
from fp8_recipes.numerics.nvfp4 import NVFP4Quantized, dequantize_nvfp4, fake_quant_nvfp4, quantize_nvfp4
from fp8_recipes.numerics.scaling import (
    AmaxReduce, DelayedScaler, amax_to_e8m0, amax_to_scale, e8m0_to_multiplier, e8m0_to_scale_inv,
    nan_ignoring_amax,
)
from fp8_recipes.recipe.schema import MXFP8_BLOCK, Format, Scaling, TensorPolicy

__all__ = ["Quantized", "block_for", "dequantize", "fake_quant", "quantize"]


@dataclass
class Quantized:
    """FP8 codes plus what is needed to read them back."""

    codes: torch.Tensor
    """FP8 tensor (torch.float8_e4m3fn / float8_e5m2), the 2-D view's shape (rows, cols)."""
    scale: torch.Tensor
    """float32 multiplier applied before the cast, one per block: shape (ceil(rows/br), ceil(cols/bc))."""
    scale_inv: torch.Tensor
    """float32 dequantization multiplier per block (1/scale; 2^(code-127) for MXFP8)."""
    block: tuple[int, int]
    """Block shape in the 2-D view's layout (already transposed for columnwise use)."""
    format: Format
    shape: torch.Size
    """The original tensor's shape."""
    dtype: torch.dtype
    """The original tensor's dtype (what dequantize returns)."""
    amax: torch.Tensor
    """float32 amax per block (before any reduction: this rank's)."""
    e8m0: torch.Tensor | None = None
    """MXFP8 only: the biased E8M0 exponent codes (uint8), shape as scale."""


def block_for(policy: TensorPolicy, shape: torch.Size | tuple[int, ...], columnwise: bool = False) -> tuple[int, int]:
    """The block (rows, cols) a policy uses on a tensor of `shape` viewed as 2-D."""
    rows, cols = _rows_cols(shape)
    if policy.scaling in (Scaling.TENSORWISE, Scaling.DELAYED):
        return (max(rows, 1), max(cols, 1))
    if policy.scaling is Scaling.MXFP8:
        block = (1, MXFP8_BLOCK)
    elif policy.scaling in (Scaling.BLOCKWISE, Scaling.NVFP4):
        block = tuple(policy.block)
    else:
        raise ValueError(f"scaling: {policy.scaling!s} does not quantize")
    return (block[1], block[0]) if columnwise else block


def _rows_cols(shape) -> tuple[int, int]:
    if len(shape) == 0:
        return 1, 1
    return math.prod(shape[:-1]), shape[-1]


def _block_view(x2d: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Zero-pad to whole blocks and view as (row_blocks, br, col_blocks, bc)."""
    br, bc = block
    rows, cols = x2d.shape
    pr, pc = -rows % br, -cols % bc
    if pr or pc:
        x2d = torch.nn.functional.pad(x2d, (0, pc, 0, pr))
    return x2d.reshape(x2d.shape[0] // br, br, x2d.shape[1] // bc, bc)


def _scale_blocks(x2d: torch.Tensor, per_block: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """x2d * per_block[block of each element], computed on the padded block view, then cropped back."""
    rows, cols = x2d.shape
    if per_block.numel() == 1:
        return x2d * per_block.reshape(())  # a 0-dim multiplier: ~4x faster on the CPU than a broadcast 1x1
    view = _block_view(x2d, block) * per_block[:, None, :, None]
    # (explicit sizes: an expert that the router gave no tokens has 0 rows, and -1 cannot be inferred from 0)
    return view.reshape(view.shape[0] * view.shape[1], view.shape[2] * view.shape[3])[:rows, :cols]


def _block_scales(hp_x: torch.Tensor, policy: TensorPolicy, block: tuple[int, int], dtype: torch.dtype,
                  nan_free_abs: bool = False):
    """Blockwise and MXFP8: (amax, scale, scale_inv, e8m0 or None) per block of the float32 2-D `hp_x` (`dtype`:
    the original tensor's). Shared with observe.stats, which needs the scales without the cast and passes |x|
    known to hold no NaN (`nan_free_abs`: the block maxima are then a plain amax, without another copy)."""
    blocks = _block_view(hp_x, block)
    amax = blocks.amax(dim=(1, 3)) if nan_free_abs else nan_ignoring_amax(blocks, dim=(1, 3))  # (row_blocks, col_blocks)
    e8m0 = None
    if policy.scaling is Scaling.MXFP8:
        e8m0 = amax_to_e8m0(amax, policy.format, policy.mx_rounding)
        scale, scale_inv = e8m0_to_multiplier(e8m0), e8m0_to_scale_inv(e8m0)
    else:
        scale = amax_to_scale(amax, policy.format, margin=policy.margin, epsilon=policy.amax_epsilon,
                              pow2=policy.pow2_scales, value_for_inf=block_scale_for_inf(dtype))
        scale_inv = torch.reciprocal(scale)
    return amax, scale, scale_inv, e8m0


def block_scale_for_inf(dtype: torch.dtype) -> float:
    """The scale blockwise scaling uses where fp8_max / amax overflows float32: TE's blockwise kernel takes the
    input type's max (float32's for wider or non-float inputs)."""
    return torch.finfo(dtype).max if dtype.is_floating_point and torch.finfo(dtype).bits <= 32 else FLOAT32_MAX


def quantize(
    x: torch.Tensor,
    policy: TensorPolicy,
    *,
    columnwise: bool = False,
    scaler: DelayedScaler | None = None,
    amax_reduce: AmaxReduce | None = None,
    record_amax: bool = True,
    seed: int | None = None,
) -> Quantized | NVFP4Quantized:
    """Quantize `x` to FP8 (NVFP4 for ``scaling: nvfp4``) as the hardware would under `policy`.

    scaler: the delayed-scaling state (required for ``scaling: delayed``; it records this tensor's amax unless
    ``record_amax`` is False, e.g. for evaluation, which must not steer training's scales).
    amax_reduce: MAX-reduction of a per-tensor amax over a process group (tensorwise; TE reduces only
    per-tensor current-scaling amaxes, never block amaxes).
    seed: NVFP4 with ``stochastic_rounding``: the draws' seed (required then; derive it from the run's seed and
    where the tensor is, e.g. :func:`~fp8_recipes.numerics.nvfp4.stochastic_rounding_seed`).
    """
    if policy.scaling is Scaling.NONE:
        raise ValueError("quantize: policy.scaling is 'none'; nothing to quantize")
    if policy.scaling is Scaling.NVFP4:  # (no amax history, no reduction: one global amax per copy, as TE's)
        return quantize_nvfp4(x, block=policy.block, columnwise=columnwise, rht=policy.rht,
                              stochastic_rounding=policy.stochastic_rounding, seed=seed)
    shape, dtype = x.shape, x.dtype
    rows, cols = _rows_cols(shape)
    hp_x = x.detach().reshape(rows, cols).float()
    block = block_for(policy, shape, columnwise)
    e8m0 = None

    if policy.scaling in (Scaling.TENSORWISE, Scaling.DELAYED):
        amax = nan_ignoring_amax(hp_x).reshape(1, 1)
        if policy.scaling is Scaling.DELAYED:
            if scaler is None:
                raise ValueError("quantize: scaling 'delayed' needs its DelayedScaler state (scaler=...)")
            if record_amax and x.numel():  # an expert the router gave no token records nothing (TE's GroupedLinear)
                scaler.observe(amax.reshape(()))
            scale = scaler.scale.to(hp_x.device).reshape(1, 1)
        else:
            reduced = amax_reduce(amax.clone()) if amax_reduce is not None else amax
            scale = amax_to_scale(reduced, policy.format, margin=policy.margin, epsilon=policy.amax_epsilon,
                                  pow2=policy.pow2_scales)
        scale_inv = torch.reciprocal(scale)
        hp_scaled = hp_x * scale
    else:
        amax, scale, scale_inv, e8m0 = _block_scales(hp_x, policy, block, dtype)
        hp_scaled = _scale_blocks(hp_x, scale, block)

    codes = to_fp8_saturated(hp_scaled, policy.format)
    return Quantized(codes=codes, scale=scale, scale_inv=scale_inv, block=block, format=policy.format,
                     shape=shape, dtype=dtype, amax=amax, e8m0=e8m0)


def dequantize(q: Quantized | NVFP4Quantized, dtype: torch.dtype | None = None) -> torch.Tensor:
    """codes * scale_inv per block (float32 multiply, TE's order), back in the original shape and dtype."""
    if isinstance(q, NVFP4Quantized):
        return dequantize_nvfp4(q, dtype)
    hp = _scale_blocks(fp8_to_float32(q.codes), q.scale_inv, q.block)
    return hp.reshape(q.shape).to(dtype or q.dtype)


def fake_quant(
    x: torch.Tensor,
    policy: TensorPolicy,
    *,
    columnwise: bool = False,
    scaler: DelayedScaler | None = None,
    amax_reduce: AmaxReduce | None = None,
    record_amax: bool = True,
    seed: int | None = None,
) -> torch.Tensor:
    """dequantize(quantize(x)): x as the FP8 GEMM sees it, in x's dtype. Identity for scaling 'none'."""
    if policy.scaling is Scaling.NONE:
        return x
    if policy.scaling is Scaling.NVFP4:  # the same values without the packed codes (compiled on a GPU)
        return fake_quant_nvfp4(x, block=policy.block, columnwise=columnwise, rht=policy.rht,
                                stochastic_rounding=policy.stochastic_rounding, seed=seed)
    return dequantize(quantize(x, policy, columnwise=columnwise, scaler=scaler, amax_reduce=amax_reduce,
                               record_amax=record_amax, seed=seed))
