"""Numerics statistics of one NVFP4 GEMM operand (``scaling: nvfp4``): what :func:`~fp8_recipes.observe.stats.measure`
returns for it, measured on the copy the GEMM reads.

    s = measure(hp_x, fq_x, nvfp4_policy, columnwise=..., quantized=q)   # nvfp4_sums here; q: the NVFP4Quantized
    s.row() -> {..., "underflow_pct": ..., "block_underflow_pct": ..., "block_saturation_pct": ...}

The copy is the one :func:`~fp8_recipes.numerics.nvfp4.quantize_nvfp4` quantizes: x viewed as 2-D, transposed for
a columnwise copy (the wgrad GEMM's), and H-rotated where the policy has ``rht`` (columnwise only). Every statistic
is of that copy's values against its dequantized values (the RHT is orthogonal: the MSE and the cosine are those of
the un-rotated tensor, up to the rotation's one rounding in x's dtype). The keys the FP8 modes have mean:

=====================  ==========================================================================================
amax, min_nonzero      of the copy (after the RHT: its global amax, from which S_enc comes)
underflow_pct          flush to zero: % of the copy's non-zero values that read back as 0 (an E2M1 code 0, or any
                       code of a block whose E4M3 scale is 0)
saturation_pct         % of the values E2M1 clips at ±6 in blocks with a non-zero scale: |x| x the block's encode
                       multiplier beyond 7 (6 + half the top step: in blocks whose scale was clamped at 448, or
                       rounded down by a subnormal E4M3 scale's coarse steps)
mse, cosine            the dequantized copy against the copy
scale_min/median       of the E4M3 block scales (decoded, 0 .. 448; one per 1x16 segment)
block_underflow_pct    % of the non-zero 16-value blocks whose E4M3 scale is 0 (block amax x S_enc / 6 below half
                       E4M3's smallest subnormal, 2^-10): every value of the block reads as 0. An outlier that
                       raises the tensor's amax far above a block's (by ~2^19) does it
block_saturation_pct   % of the 16-value blocks whose scale the E4M3 cast clamps: block amax x S_enc / 6 beyond
                       464 (448 + half an E4M3 step); with S_enc from the same amax this needs an inf in the copy
=====================  ==========================================================================================

Blocks are counted per 1x16 segment, as the block scales are stored: a 16x16 weight block counts its 16 rows. The
block scales and S_enc are the backend's (`quantized`) when it hands them over, else :func:`quantize_nvfp4`'s
again (they do not depend on stochastic rounding); the dequantized values are the backend's (`fq_x`), else those of
a quantization here, whose stochastic rounding (if any) draws from `seed` (the recorder's: one per step, module,
GEMM, role and micro-batch, so a dump of the same copy holds the same codes). An RHT'd copy is rotated once: the
statistics read the quantizer's rotated copy (``NVFP4Quantized.rotated``). Pure torch, no host sync.
"""

from __future__ import annotations

import torch

from fp8_recipes.numerics.formats import fp8_to_float32
from fp8_recipes.numerics.nvfp4 import (
    E2M1_MAX, E4M3_MAX, NVFP4_BLOCK, NVFP4Quantized, dequantize_nvfp4, nvfp4_copy_2d, quantize_nvfp4,
)
# the quantizer's own block maxima and encode multiplier, fed the copy measured here
from fp8_recipes.numerics.nvfp4 import _block_amax, _encode_multiplier, _padded_blocks, _rows_cols
from fp8_recipes.recipe.schema import Scaling, TensorPolicy

__all__ = ["BLOCK_SUMS", "E2M1_CLIP", "E4M3_CLIP", "nvfp4_sums"]

BLOCK_SUMS = ("blocks", "nonzero_blocks", "saturated_blocks", "underflow_blocks")
"""The counts an NVFP4 operand's sums hold after the FP8 ones (stats._SUMS)."""
E2M1_CLIP = E2M1_MAX + 1.0
"""|x| x multiplier beyond which a value is clipped: 6 + half the step of 2 between E2M1's 4 and 6."""
E4M3_CLIP = E4M3_MAX + 16.0
"""A block scale beyond this is clamped to 448: 448 + half E4M3's step of 32 there (below, it rounds to 448)."""


def nvfp4_copy(hp_x: torch.Tensor, policy: TensorPolicy, columnwise: bool) -> torch.Tensor:
    """The float32 2-D values the copy quantizes: x (rows, cols), or x^T, H-rotated with ``rht`` (in x's dtype,
    as quantize_nvfp4 does)."""
    return nvfp4_copy_2d(hp_x, columnwise=columnwise, rht=policy.rht).float()


def _quantized(hp_x, policy, columnwise, stochastic: bool, seed: int) -> NVFP4Quantized:
    return quantize_nvfp4(hp_x, block=policy.block, columnwise=columnwise, rht=policy.rht,
                          stochastic_rounding=stochastic, seed=seed if stochastic else None)


def nvfp4_sums(hp_x: torch.Tensor, fq_x: torch.Tensor | None, policy: TensorPolicy, *, columnwise: bool = False,
               quantized: NVFP4Quantized | None = None, seed: int = 0):
    """What OperandStats holds of one NVFP4 copy of `hp_x` (the module docstring): (sums, amax, min_nonzero,
    scales), on hp_x's device. `fq_x`: the dequantized copy the GEMM read (x's shape; rotated values for an RHT
    copy); `quantized`: the NVFP4Quantized it came from."""
    if policy.scaling is not Scaling.NVFP4:
        raise ValueError(f"nvfp4_sums: scaling is {policy.scaling}, not nvfp4")
    if fq_x is None:  # the backend kept its copy to itself: quantize it here, stochastic rounding from `seed`
        quantized = _quantized(hp_x, policy, columnwise, policy.stochastic_rounding, seed)
        fq_x = dequantize_nvfp4(quantized, torch.float32)
    elif quantized is None:  # a reused copy: the scales again (codes aside, stochastic rounding changes nothing)
        quantized = _quantized(hp_x, policy, columnwise, False, seed)
    hp = quantized.rotated.float() if quantized.rotated is not None else nvfp4_copy(hp_x, policy, columnwise)
    fq = fq_x.detach().reshape(_rows_cols(hp_x.shape)).float()
    fq = fq.t() if columnwise else fq
    mag = hp.abs().nan_to_num_(nan=0.0)  # NaN is neither non-zero-and-lost nor clipped
    numel = hp.numel()
    amax = mag.max() if numel else torch.zeros((), device=hp.device)
    min_nonzero = torch.where(mag > 0, mag, torch.inf).min() if numel else torch.full((), torch.inf, device=hp.device)
    nonzero = mag > 0
    underflow = (nonzero & (fq == 0)).sum()

    block = tuple(quantized.block)
    r, c = hp.shape
    segment_amax = _block_amax(_padded_blocks(mag, block), block)[:r]  # (r, ceil(c / 16)); a 16x16 block's repeated
    scales = fp8_to_float32(quantized.block_scales)
    unclamped = segment_amax * (quantized.global_scale * (1.0 / E2M1_MAX))  # the scale before the 448 clamp
    multiplier = _encode_multiplier(quantized.block_scales, quantized.global_scale)
    scaled = _padded_blocks(mag, (1, NVFP4_BLOCK)).reshape(r, -1, NVFP4_BLOCK) * multiplier[..., None]
    saturated = ((scaled > E2M1_CLIP) & (scales > 0)[..., None]).sum()
    nonzero_blocks = segment_amax > 0
    err = fq - hp
    hp_flat, fq_flat, err_flat = hp.reshape(-1), fq.reshape(-1), err.reshape(-1)
    counts = torch.stack([torch.count_nonzero(nonzero), underflow, saturated]).double()
    blocks = torch.stack([torch.count_nonzero(nonzero_blocks), (unclamped > E4M3_CLIP).sum(),
                          (nonzero_blocks & (scales == 0)).sum()]).double()
    sums = torch.cat([
        torch.full((1,), float(numel), dtype=torch.float64, device=hp.device), counts,
        torch.stack([torch.dot(err_flat, err_flat), torch.dot(hp_flat, fq_flat), torch.dot(hp_flat, hp_flat),
                     torch.dot(fq_flat, fq_flat)]).double(),
        torch.full((1,), float(scales.numel()), dtype=torch.float64, device=hp.device), blocks,
    ])
    return sums, amax, min_nonzero, [scales.reshape(-1)]
