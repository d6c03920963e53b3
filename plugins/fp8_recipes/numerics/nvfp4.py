"""NVFP4 (E2M1 codes, E4M3 block scales, one FP32 scale per tensor) as Transformer Engine 2.20.2 computes it.

Pure torch, any device. Bit-exact with TE's pure-PyTorch oracle, ``NVFP4QuantizerRef``
(``transformer_engine.pytorch.custom_recipes.reference_nvfp4``; tests/gpu/test_nvfp4_ref.py compares on the H200),
and with an independent float64 reference on the CPU (tests/unit/test_nvfp4.py). What TE does, and we do:

* **Copies.** A tensor is viewed as 2-D (leading dims flattened). The rowwise copy quantizes x; the columnwise
  copy quantizes x^T (TE's ``data_t``: what the wgrad GEMM reads, reducing over x's rows), with the RHT if enabled.
  Each copy has its own global amax (the columnwise one taken after the RHT).
* **Global scale.** amax = max |x| in float32 (NaN propagates, as torch.max). S_enc = 448 * 6 / amax (float32
  division), at most float32 max; 1 where that is 0 (amax inf). amax 0 gives 1 in TE's kernels and float32 max in
  the reference; no output differs (every code and block scale is 0 either way); we return the kernels' 1.
* **Blocks.** 1x16 along the row, or 16x16 (2-D, for weights), zero-padded to whole blocks (zeros never raise an
  amax). One E4M3 scale per 1x16 row segment: 16x16 blocks repeat theirs over their 16 rows (TE's reference keeps
  the padded rows too; we crop them).
* **Block scale.** E4M3 (round to nearest even) of min(block_amax * (S_enc * fp32(1/6)), float32 max) clamped to 448.
  Encode multiplier min(1 / (float(scale) * (1 / S_enc)), float32 max): a block whose scale underflows to 0 gets
  float32 max, so its (tiny) values saturate to ±6 codes that decode to 0.
* **Codes.** x * multiplier clamped to ±6, rounded to E2M1 {0, .5, 1, 1.5, 2, 3, 4, 6} nearest-even (ties to the
  even code). The sign bit is set for values < 0 only: -0.0 becomes code 0, a small negative that rounds to zero
  code 8. Two codes per byte, element 2j in the low nibble (an odd width: TE's reference keeps c // 2 bytes and
  drops the last element; we keep ceil(c / 2)). NaN anywhere makes amax NaN: every scale NaN, every code 0 (the
  reference's behaviour; TE's CUDA kernels ignore NaN in the amax instead).
* **RHT.** H = diag(s) H16 / 4: H16 the Sylvester Hadamard matrix, s = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1,
  -1, 1, -1, -1) (TE's ``get_wgrad_sign_vector``; bit mask 0xD7E8 in its kernels), applied to each 16 consecutive
  values along the last dim of x^T, x_16 @ H, on the columnwise copy only. TE's reference runs it as a torch
  matmul in the input dtype (float32 accumulation, one rounding to the input dtype at the end), so its last bits
  are cuBLAS's. We sum k = 0..15 in order in float32 and round once. Measured on the H200 (torch 2.11, CUDA 13):
  float32 inputs match where cuBLAS sums in order, 6144 to 524288 blocks of 16 (another order below 6144 blocks,
  and a few values differ at 2^20 blocks);
  bf16 inputs match wherever the float32 sums are exact (e.g. randn, 16M values), while bf16 values spread over 60
  binades differ in about 1 of 10^4 RHT'd values (the tensor cores' accumulation is no float32 sequence).
* **Dequantize** (TE's dequantize kernel): e2m1 * (float(scale) * amax * fp32(1 / 2688)), cast to the dtype.
* **Stochastic rounding** (TE: gradients; the reference has none). TE's kernels take 8 random bits per element
  from Philox (``cvt.rs.satfinite.e2m1x4.f32``, or its software fallback): t = |x| + u * step with u = r / 256 and
  step the grid spacing at |x|, then t floored onto the grid at t, at most 6, sign of x: up with probability
  P(u >= 1 - f) for a value a fraction f of a step above its lower neighbour. With u on a 1/256 grid that is
  floor(256 f) / 256: biased towards zero by up to 1/256 of a step. We round up where u < f (the same law, and
  exact in float32: f is computed without rounding) with u a float32 uniform (24 bits or more) from the caller's
  generator or seed: unbiased to 2^-24 of a step, deterministic given the seed; not TE's Philox stream. With a
  seed on a GPU, u of the copy's element k is word k % 4 of Triton's ``tl.rand4x(seed, k // 4)`` (Philox), drawn
  inside the values kernel (numerics/nvfp4_kernels.py) and written out only for the quantizer's codes; elsewhere
  a torch generator seeded with it: the same law, other draws.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from fp8_recipes.numerics.formats import FLOAT32_MAX, fp8_to_float32

__all__ = [
    "E2M1_MAX", "NVFP4Quantized", "RHT_SIGNS", "apply_rht", "dequantize_nvfp4", "e2m1_codes", "e2m1_to_float32",
    "fake_quant_nvfp4", "nvfp4_block_scales", "nvfp4_copy_2d", "nvfp4_global_scale", "pack_e2m1", "quantize_nvfp4",
    "rht_matrix", "stochastic_rounding_seed", "unpack_e2m1",
]

logger = logging.getLogger(__name__)

E2M1_MAX = 6.0
E4M3_MAX = 448.0
NVFP4_BLOCK = 16
NVFP4_BLOCKS = ((1, NVFP4_BLOCK), (NVFP4_BLOCK, NVFP4_BLOCK))
RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)
"""TE's wgrad sign vector: RHT row k of the Hadamard matrix is multiplied by RHT_SIGNS[k]."""
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


@dataclass
class NVFP4Quantized:
    """One NVFP4 copy (rowwise or columnwise) of a tensor, in TE's layout."""

    codes: torch.Tensor
    """uint8, (r, ceil(c / 2)): two E2M1 codes per byte, element 2j in the low nibble. (r, c) is the copy's 2-D
    view: (rows, cols) of x rowwise, (cols, rows) columnwise (x^T)."""
    block_scales: torch.Tensor
    """torch.float8_e4m3fn, (r, ceil(c / 16)): one decode scale per 1x16 segment (repeated over 16 rows for 16x16
    blocks). ``.view(torch.uint8)`` gives the bytes."""
    global_amax: torch.Tensor
    """float32 0-dim: max |value| of this copy (after the RHT for a transformed columnwise copy)."""
    global_scale: torch.Tensor
    """float32 0-dim: S_enc = 448 * 6 / global_amax (TE's global encode scale), 1 for amax 0 or inf."""
    shape: torch.Size
    """The original tensor's shape."""
    dtype: torch.dtype
    """The original tensor's dtype (what dequantize_nvfp4 returns)."""
    block: tuple[int, int]
    """(1, 16) or (16, 16), in the copy's 2-D view."""
    columnwise: bool
    rht: bool
    """Whether the RHT was applied (columnwise copies only): dequantized values are then H-rotated."""
    rotated: torch.Tensor | None = field(default=None, repr=False, compare=False)
    """With the RHT: the H-rotated 2-D copy that was quantized, in x's dtype (the statistics read it rather than
    rotating x again); None otherwise."""


def rht_matrix(device: torch.device | str | None = None) -> torch.Tensor:
    """TE's RHT matrix diag(RHT_SIGNS) @ H16 / 4 in float32 (entries ±1/4; H H^T = I), made once per device: a
    tensor made from Python numbers on a GPU is a copy the host waits for, at every call otherwise."""
    key = _device_key(device if device is not None else "cpu")
    if key not in _RHT:
        h = torch.ones(1, 1, dtype=torch.float32)
        while h.shape[0] < NVFP4_BLOCK:  # Sylvester: [[H, H], [H, -H]]
            h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)], dim=0)
        signs = torch.tensor(RHT_SIGNS, dtype=torch.float32)
        _RHT[key] = (signs[:, None] * h * 0.25).to(key)
    return _RHT[key]


_RHT: dict[torch.device, torch.Tensor] = {}


def _device_key(device: torch.device | str) -> torch.device:
    """A device with its index ("cuda" is the current GPU's): the per-device caches' key. The cached tensors are
    read-only: every caller reads them, none writes."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def apply_rht(x: torch.Tensor) -> torch.Tensor:
    """x_16 @ rht_matrix() for each 16 consecutive values along the last dim, in x's dtype: a float32 sum over
    k = 0..15 in order, rounded once to x's dtype (see the module docstring for how that matches cuBLAS)."""
    if x.shape[-1] % NVFP4_BLOCK:
        raise ValueError(f"rht: the last dim ({x.shape[-1]}) must be a multiple of {NVFP4_BLOCK}")
    if _base_layout(x):
        # x = base^T (the columnwise copy's view): its 16-value sums read 16 consecutive rows of base, so sum in
        # base's layout, each pass over whole rows, and hand back a transposed view as the copy without the RHT
        # (through the view, a GPU kernel read 2 bytes of each 32-byte sector: 82 ms of an emulated NVFP4 step's
        # 446 on 8 Llama-3-8B layers, the H100, 2026-12-06). The same in-order sums: the same bits.
        base = x.t()
        return _rht_sums(base.reshape(-1, NVFP4_BLOCK, base.shape[1]), x.device).reshape(base.shape).to(x.dtype).t()
    return _rht_sums(x.reshape(-1, NVFP4_BLOCK, 1), x.device).reshape(x.shape).to(x.dtype)


def _rht_sums(blocks: torch.Tensor, device: torch.device) -> torch.Tensor:
    """(B, 16, C) -> float32 out[b, j, c] = sum over k = 0..15, in order, of blocks[b, k, c] * H[k, j]."""
    h = rht_matrix(device)
    blocks = blocks.float()
    out = torch.zeros_like(blocks)
    for k in range(NVFP4_BLOCK):  # products are exact (x * ±1/4): only the order of the sums matters
        out.addcmul_(blocks[:, k:k + 1, :], h[k][None, :, None])
    return out


def nvfp4_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """S_enc = 448 * 6 / amax (float32), at most float32 max; 1 for amax 0 or inf; NaN for NaN (TE's reference)."""
    amax = amax.float()
    fp8_fp4_max = torch.full((), E4M3_MAX * E2M1_MAX, dtype=torch.float32, device=amax.device)
    scale = torch.minimum(fp8_fp4_max / amax, _float32_max(amax))  # minimum keeps NaN, as the reference's torch.min
    return torch.where((amax == 0) | (scale == 0), torch.ones_like(scale), scale)


def nvfp4_block_scales(block_amax: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """E4M3 decode scale per block: block_amax * (S_enc * fp32(1/6)), at most float32 max, clamped to 448."""
    fp4_max_inv = torch.reciprocal(torch.full((), E2M1_MAX, dtype=torch.float32, device=block_amax.device))
    scale = torch.minimum(block_amax.float() * (global_scale * fp4_max_inv), _float32_max(block_amax))
    # (scale >= 0 or NaN; abs makes a NaN +NaN, byte 0x7F, on every device: CUDA's canonical NaN is positive)
    return scale.abs_().clamp_(max=E4M3_MAX).to(torch.float8_e4m3fn)


def _encode_multiplier(block_scales: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """What each block's values are multiplied by before rounding: 1 / (scale * (1 / S_enc)), at most float32 max."""
    global_decode = torch.reciprocal(global_scale)
    return torch.minimum(torch.reciprocal(fp8_to_float32(block_scales) * global_decode), _float32_max(global_scale))


def _float32_max(like: torch.Tensor) -> torch.Tensor:
    return torch.full((), FLOAT32_MAX, dtype=torch.float32, device=like.device)


def e2m1_codes(scaled: torch.Tensor, generator: torch.Generator | None = None, *,
               uniforms: torch.Tensor | None = None) -> torch.Tensor:
    """E2M1 codes (uint8, 0..15, unpacked) of float32 values already clamped to ±6: round to nearest even, or
    stochastic rounding with one float32 uniform per element, from `generator` (the tensor's device) or given as
    `uniforms` (scaled's shape). NaN -> 0."""
    a = scaled.abs().nan_to_num(nan=0.0)
    region = _e2m1_region(a)
    in_steps = a * _region_inv_step(region)  # exact (the step is a power of two); region r starts at code 2r
    if generator is None and uniforms is None:
        mag = torch.round(in_steps)  # round() is half-to-even: ties go to the even code
    else:
        mag = torch.floor(in_steps)
        fraction = in_steps - mag  # exact: the part of a step above the lower neighbour
        u = uniforms if uniforms is not None else torch.rand(a.shape, generator=generator, dtype=torch.float32,
                                                              device=a.device)
        mag += (u < fraction).float()  # up with probability fraction (TE: |x| + u * step reaches the upper one)
    codes = (mag + 2 * region).clamp_(max=7).to(torch.uint8)
    return codes | ((scaled < 0).to(torch.uint8) << 3)


def _e2m1_region(a: torch.Tensor) -> torch.Tensor:
    """0 below 2 (step 0.5), 1 in [2, 4) (step 1), 2 from 4 (step 2), as float32."""
    return (a >= 2).float() + (a >= 4).float()


def _region_inv_step(region: torch.Tensor) -> torch.Tensor:
    return torch.where(region == 0, 2.0, torch.where(region == 1, 1.0, 0.5)).float()


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """(r, c) codes 0..15 -> (r, ceil(c / 2)) bytes, element 2j in the low nibble (TE's order)."""
    if codes.shape[-1] % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor, cols: int | None = None) -> torch.Tensor:
    """Inverse of pack_e2m1: (r, n) bytes -> (r, cols) codes (cols defaults to 2n)."""
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])
    return codes if cols is None else codes[..., :cols]


def e2m1_to_float32(codes: torch.Tensor) -> torch.Tensor:
    """Values of unpacked E2M1 codes (0..15; code 8 is -0.0)."""
    key = _device_key(codes.device)
    if key not in _E2M1_TABLE:  # (once per device, as rht_matrix)
        values = _E2M1_VALUES + tuple(-v for v in _E2M1_VALUES)
        _E2M1_TABLE[key] = torch.tensor(values, dtype=torch.float32).to(key)
    return torch.take(_E2M1_TABLE[key], codes.to(torch.int64))


_E2M1_TABLE: dict[torch.device, torch.Tensor] = {}


def _rows_cols(shape) -> tuple[int, int]:
    """The 2-D view: (leading dims flattened, last dim)."""
    return (math.prod(shape[:-1]), shape[-1]) if len(shape) else (1, 1)


def _check_block(block) -> tuple[int, int]:
    block = tuple(block)
    if block not in NVFP4_BLOCKS:
        raise ValueError(f"block: {list(block)} is not an NVFP4 block; use [1, 16] or [16, 16] (2-D, for weights)")
    return block


def _check_inputs(who: str, x: torch.Tensor, block, stochastic_rounding: bool, generator, seed) -> tuple[int, int]:
    """The block as a tuple; ValueError for an input type TE's reference does not take, or draws without SR."""
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):  # TE's reference's input types
        raise ValueError(f"{who}: x is {x.dtype}; NVFP4 quantizes float32, bfloat16 or float16 tensors")
    if not stochastic_rounding and (generator is not None or seed is not None):
        raise ValueError(f"{who}: generator= / seed= are for stochastic_rounding=True only")
    return _check_block(block)


def _scales(hp: torch.Tensor, block: tuple[int, int], block_amax_of: Callable | None = None):
    """One copy's scales from its 2-D values (float32, or x's dtype: every step is exact in either): (the values
    zero-padded to whole blocks, the global amax, S_enc, the E4M3 block scales, each block's encode multiplier, its
    decode factor). The global amax is the largest block amax: the same number as max |x| (blocks cover x, padding
    adds zeros, NaN propagates), from the pass the blocks need. `block_amax_of`: the block's amax function compiled
    (padded -> block amaxes; default _block_amax's)."""
    padded = _padded_blocks(hp, block)
    block_amax = block_amax_of(padded) if block_amax_of else _block_amax(padded, block)
    amax = block_amax.amax() if hp.numel() else torch.zeros((), dtype=torch.float32, device=hp.device)
    return padded, amax, *_block_factors(block_amax, amax)


def _block_factors(block_amax: torch.Tensor, amax: torch.Tensor):
    """(S_enc, the E4M3 block scales, each block's encode multiplier, its decode factor): on a GPU one Triton kernel
    (numerics/nvfp4_kernels.block_factors: the same arithmetic, checked bit for bit in tests/gpu/test_nvfp4_ref.py),
    elsewhere, or if it fails, the eager functions."""
    if block_amax.numel() and _triton_here(block_amax.device, "block scales"):
        fused = _in_triton("block scales", block_amax.device, lambda kernels: kernels.block_factors(block_amax, amax))
        if fused is not None:
            return fused
    return _block_factors_eager(block_amax, amax)


def _block_factors_eager(block_amax: torch.Tensor, amax: torch.Tensor):
    global_scale = nvfp4_global_scale(amax)
    block_scales = nvfp4_block_scales(block_amax, global_scale)
    return (global_scale, block_scales, _encode_multiplier(block_scales, global_scale),
            _decode_factors(block_scales, amax))


def _decode_factors(block_scales: torch.Tensor, global_amax: torch.Tensor) -> torch.Tensor:
    """Per block, what a code's value is multiplied by: float(scale) * global amax * fp32(1 / 2688), in that order
    (TE's dequantize kernel)."""
    factor_inv = torch.reciprocal(torch.full((), E4M3_MAX * E2M1_MAX, dtype=torch.float32,
                                             device=block_scales.device))
    return fp8_to_float32(block_scales) * global_amax * factor_inv


def _padded_blocks(hp: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Zero-pad a 2-D float32 tensor to whole blocks: rows to block[0], cols to 16."""
    pr, pc = -hp.shape[0] % block[0], -hp.shape[1] % NVFP4_BLOCK
    return torch.nn.functional.pad(hp, (0, pc, 0, pr)) if pr or pc else hp


def _block_amax(padded: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """max |x| per 1x16 segment in float32, (R, C / 16); a 16x16 block's amax repeated over its 16 rows. NaN
    propagates. (abs, max and the cast are exact: the same numbers from x's dtype as from its float32 copy.)"""
    return (_segment_amax if block[0] == 1 else _tile_amax)(padded)


def _segment_amax(padded: torch.Tensor) -> torch.Tensor:
    r, c = padded.shape
    return padded.reshape(r, c // NVFP4_BLOCK, NVFP4_BLOCK).abs().amax(dim=-1).float()


def _tile_amax(padded: torch.Tensor) -> torch.Tensor:
    r, c = padded.shape
    tiles = padded.reshape(r // NVFP4_BLOCK, NVFP4_BLOCK, c // NVFP4_BLOCK, NVFP4_BLOCK).abs().amax(dim=(1, 3))
    return tiles.float().repeat_interleave(NVFP4_BLOCK, dim=0)


def stochastic_rounding_seed(*where: int | str) -> int:
    """A 63-bit seed from where a tensor is rounded, e.g. (run seed, step, module, GEMM, micro-batch): the same
    draws after a resume, independent ones elsewhere (BLAKE2b of the parts, not Python's salted hash)."""
    digest = hashlib.blake2b("\x1f".join(map(str, where)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _sr_generator(device: torch.device, generator: torch.Generator | None, seed: int | None) -> torch.Generator:
    if (generator is None) == (seed is None):
        raise ValueError("stochastic_rounding: pass exactly one of generator= or seed= (never the global RNG, "
                         "which a resumed run would not reproduce)")
    if generator is None:
        return torch.Generator(device=device).manual_seed(seed)
    if generator.device.type != device.type:
        raise ValueError(f"stochastic_rounding: the generator is on {generator.device}, the tensor on {device}; "
                         "use a generator of the tensor's device")
    return generator


def _sr_uniforms(shape, device: torch.device, generator: torch.Generator | None, seed: int | None) -> torch.Tensor:
    """Stochastic rounding's float32 uniforms, one per element of a copy's padded 2-D view: from `generator`, or
    from `seed` (on a GPU Triton's Philox stream, nvfp4_kernels.uniforms: what the fused values kernel draws, so
    the quantizer's codes and fake_quant_nvfp4's values agree; elsewhere a torch generator seeded with it)."""
    if generator is None and seed is not None and _triton_here(device, "stochastic rounding"):
        u = _in_triton("stochastic rounding", device, lambda kernels: kernels.uniforms(seed, shape, device))
        if u is not None:
            return u  # (else torch's generator, seeded the same: another stream)
    return torch.rand(shape, generator=_sr_generator(device, generator, seed), dtype=torch.float32, device=device)


def _values_sr_in_triton(padded: torch.Tensor, multiplier: torch.Tensor, decode: torch.Tensor,
                         generator: torch.Generator | None, seed: int | None, by_rows: bool) -> torch.Tensor | None:
    """fake_quant_nvfp4's stochastically rounded values in one Triton kernel that draws its uniforms itself (as
    _sr_uniforms would write them): (pr, pc) rowwise, or in x's layout `by_rows`; None where it does not apply
    (a generator, not a GPU, a copy that is not a contiguous rowwise one or a base's transposed view)."""
    x = padded.t() if by_rows else padded
    if generator is not None or seed is None or not _triton_here(x.device, "stochastic rounding") \
            or not x.is_contiguous():
        return None
    return _in_triton("stochastic rounding", x.device,
                      lambda kernels: kernels.values_sr(x, multiplier, decode, seed, x.dtype, column=by_rows))


def nvfp4_copy_2d(x: torch.Tensor, *, columnwise: bool, rht: bool, rotate=apply_rht) -> torch.Tensor:
    """The 2-D values one copy of `x` quantizes, in x's dtype: x (leading dims flattened), or x^T for the columnwise
    copy, H-rotated there with `rht` (in x's dtype, as TE's reference: its amax and codes see the rounding)."""
    rows, cols = _rows_cols(x.shape)
    x2d = x.detach().reshape(rows, cols)
    if not columnwise:
        return x2d
    if rht and rows % NVFP4_BLOCK:
        raise ValueError(f"rht: the columnwise copy is transformed along x's rows, so they must be a multiple "
                         f"of {NVFP4_BLOCK}; x has shape {tuple(x.shape)} ({rows} rows)")
    return rotate(x2d.t()) if rht else x2d.t()  # (the RHT reads 16 consecutive values of x^T: the transposed view)


def quantize_nvfp4(
    x: torch.Tensor,
    *,
    block: tuple[int, int] = (1, NVFP4_BLOCK),
    columnwise: bool = False,
    rht: bool = False,
    stochastic_rounding: bool = False,
    generator: torch.Generator | None = None,
    seed: int | None = None,
) -> NVFP4Quantized:
    """Quantize one copy of `x` to NVFP4 as TE's NVFP4QuantizerRef does.

    block: (1, 16), or (16, 16) for 2-D weight blocks. columnwise: quantize x^T (TE's columnwise copy, the wgrad
    GEMM's operand) instead of x. rht: TE's ``with_rht``: the columnwise copy is transformed (x's rows must then be
    a multiple of 16); the rowwise copy never is. stochastic_rounding: round the codes stochastically with
    uniforms from `generator` (on x's device, advanced by one draw per padded element) or from `seed` (on a GPU
    Triton's Philox stream, elsewhere a fresh torch generator seeded with it; runs before 2026-12-06 drew from a
    torch generator on the GPU too): derive the seed from (run seed, step, layer, role) and a resumed run rounds
    the same.
    """
    block = _check_inputs("quantize_nvfp4", x, block, stochastic_rounding, generator, seed)
    shape = x.shape
    copy = nvfp4_copy_2d(x, columnwise=columnwise, rht=rht)
    hp = copy.float()
    r, c = hp.shape
    padded, amax, global_scale, block_scales, multiplier, _ = _scales(hp, block)
    pr, pc = padded.shape
    scaled = padded.reshape(pr, pc // NVFP4_BLOCK, NVFP4_BLOCK) * multiplier[..., None]
    scaled = scaled.clamp_(-E2M1_MAX, E2M1_MAX).reshape(pr, pc)
    u = _sr_uniforms((pr, pc), hp.device, generator, seed) if stochastic_rounding else None
    codes = e2m1_codes(scaled, uniforms=u)[:r, :c]
    return NVFP4Quantized(codes=pack_e2m1(codes), block_scales=block_scales[:r], global_amax=amax,
                          global_scale=global_scale, shape=shape, dtype=x.dtype, block=block, columnwise=columnwise,
                          rht=rht and columnwise, rotated=copy if rht and columnwise else None)


def dequantize_nvfp4(q: NVFP4Quantized, dtype: torch.dtype | None = None) -> torch.Tensor:
    """codes * (block scale * global amax * fp32(1/2688)) as TE's dequantize kernel, in x's shape and `dtype`
    (q.dtype by default). A columnwise copy is transposed back; with the RHT its values stay rotated (what the
    wgrad GEMM multiplies: both operands rotated along the reduction dim, so the product is unchanged)."""
    rows, cols = _rows_cols(q.shape)
    r, c = (cols, rows) if q.columnwise else (rows, cols)
    padded_cols = q.block_scales.shape[1] * NVFP4_BLOCK  # >= the 2 * ceil(c / 2) unpacked codes
    values = e2m1_to_float32(unpack_e2m1(q.codes))
    values = torch.nn.functional.pad(values, (0, padded_cols - values.shape[1]))
    per_block = _decode_factors(q.block_scales, q.global_amax)
    blocks = values.reshape(r, padded_cols // NVFP4_BLOCK, NVFP4_BLOCK)  # (explicit sizes: r may be 0)
    hp = (blocks * per_block[..., None]).reshape(r, padded_cols)[:, :c]
    return (hp.t() if q.columnwise else hp).reshape(q.shape).to(dtype or q.dtype)


def fake_quant_nvfp4(
    x: torch.Tensor,
    *,
    block: tuple[int, int] = (1, NVFP4_BLOCK),
    columnwise: bool = False,
    rht: bool = False,
    stochastic_rounding: bool = False,
    generator: torch.Generator | None = None,
    seed: int | None = None,
) -> torch.Tensor:
    """dequantize_nvfp4(quantize_nvfp4(x, ...)) bit for bit (tests/unit/test_nvfp4.py; compiled on the H200:
    tests/gpu/test_nvfp4_ref.py), without the codes: x as the NVFP4 GEMM sees it, in x's shape and dtype.

    The scales are the quantizer's (the same functions, on tensors 16x smaller than x); a value's E2M1 magnitude is
    its rounded count of grid steps times the step, which is what the code decodes to, times the block's decode
    factor. The passes over x's size read x's dtype (no float32 copy of x): on a GPU the three of them, the RHT,
    the block amaxes and the values, are torch.compile'd (no division in any: float32 products, in-order sums and
    maxima, as the eager ones), the RHT of a bf16 / fp16 columnwise copy a Triton kernel of the same sums
    (numerics/nvfp4_kernels.py); anywhere else, and if compiling fails, they run eagerly. A columnwise copy's
    passes read x in its own layout where x's rows are whole 1x16 segments of x^T (16 rows of a column of x),
    and its values come back in x's layout."""
    block = _check_inputs("fake_quant_nvfp4", x, block, stochastic_rounding, generator, seed)
    copy = nvfp4_copy_2d(x, columnwise=columnwise, rht=rht, rotate=_rotate(x))  # x's dtype
    r, c = copy.shape
    by_rows = columnwise and block[0] == 1 and c % NVFP4_BLOCK == 0 and copy.t().is_contiguous()
    if by_rows:  # x^T's 1x16 segments are 16 rows of a column of its base: each pass reads whole base rows
        amax_of = lambda view: _kernel("column_amax", x)(view.t()).t()  # noqa: E731
    else:
        amax_of = _kernel("segment_amax" if block[0] == 1 else "tile_amax", x)
    padded, amax, _, _, multiplier, decode = _scales(copy, block, amax_of)
    pr, pc = padded.shape
    u = None
    if stochastic_rounding:
        fused = _values_sr_in_triton(padded, multiplier, decode, generator, seed, by_rows)
        if fused is not None:
            values = fused if by_rows else fused[:r, :c]
            return (values if by_rows or not columnwise else values.t()).reshape(x.shape)
        u = _sr_uniforms((pr, pc), x.device, generator, seed)  # e2m1_codes' draws
    if by_rows:  # (the values in x's layout: the copy's transposed back, contiguous)
        args = (padded.t(), multiplier.t(), decode.t(), *(() if u is None else (u.t(),)))
        return _kernel("column_values" if u is None else "column_values_sr", x)(*args, x.dtype).reshape(x.shape)
    blocks = padded.reshape(pr, pc // NVFP4_BLOCK, NVFP4_BLOCK)
    if u is None:
        values = _kernel("values", x)(blocks, multiplier, decode, x.dtype)
    else:
        u = u.reshape(pr, pc // NVFP4_BLOCK, NVFP4_BLOCK)
        values = _kernel("values_sr", x)(blocks, multiplier, decode, u, x.dtype)
    values = values.reshape(pr, pc)[:r, :c]
    return (values.t() if columnwise else values).reshape(x.shape)


def _dequantized_values(blocks: torch.Tensor, multiplier: torch.Tensor, decode: torch.Tensor,
                        u: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Values (float32 or x's dtype, read as float32) -> their NVFP4 values in `dtype`: e2m1_codes' rounding
    (nearest even, or up where u < the fraction of a step) as steps x the step size, signed, times the block's
    decode factor. `multiplier` and `decode` broadcast over the values of each block: (R, C/16, 1) against
    (R, C/16, 16) blocks, or (R/16, 1, C) against a base's (R/16, 16, C) columns."""
    scaled = (blocks.float() * multiplier).clamp(-E2M1_MAX, E2M1_MAX)
    a = scaled.abs().nan_to_num(nan=0.0)
    region = _e2m1_region(a)
    in_steps = a * _region_inv_step(region)
    if u is None:
        mag = torch.round(in_steps)
    else:
        mag = torch.floor(in_steps)
        mag = mag + (u < in_steps - mag).float()
    step = torch.where(region == 0, 0.5, torch.where(region == 1, 1.0, 2.0))
    value = mag * step  # what the code decodes to: region r's codes start at 2r steps of its step size
    # -0.0 for a small negative, as code 8 decodes: copysign, not `-value`, which Triton computes as 0 - value
    # (+0.0 from 0; the compiled pass on the H200 gave +0.0 where the codes decode to -0.0, 2026-12-06)
    signed = torch.copysign(value, torch.where(scaled < 0, -1.0, 1.0))
    return (signed * decode).to(dtype)


def _values(blocks, multiplier, decode, dtype):
    """The NVFP4 values of (R, C/16, 16) blocks; multiplier and decode are the blocks' (R, C/16). Their size-1
    dimension is made here, inside the compiled graph: an input's size 1 is a symbol under _symbolic_shapes, which
    does not broadcast (torch.compile failed on every call, the H100, 2026-12-06)."""
    return _dequantized_values(blocks, multiplier[..., None], decode[..., None], None, dtype)


def _values_sr(blocks, multiplier, decode, u, dtype):
    return _dequantized_values(blocks, multiplier[..., None], decode[..., None], u, dtype)


def _column_amax(base: torch.Tensor) -> torch.Tensor:
    """max |base| over each 16 rows of each column, (R/16, C) float32: the 1x16 segment amaxes of base^T,
    transposed (the same maxima, read row by row). NaN propagates."""
    r, c = base.shape
    return base.reshape(r // NVFP4_BLOCK, NVFP4_BLOCK, c).abs().amax(dim=1).float()


def _column_values(base, multiplier_t, decode_t, dtype):
    """The NVFP4 values of base^T's 1x16 segments, in base's (R, C) layout: multiplier_t and decode_t are the
    segments' (R/16, C), the copy's transposed."""
    r, c = base.shape
    blocks = base.reshape(r // NVFP4_BLOCK, NVFP4_BLOCK, c)
    return _dequantized_values(blocks, multiplier_t[:, None, :], decode_t[:, None, :], None, dtype).reshape(r, c)


def _column_values_sr(base, multiplier_t, decode_t, u_t, dtype):
    r, c = base.shape
    blocks, u = base.reshape(r // NVFP4_BLOCK, NVFP4_BLOCK, c), u_t.reshape(r // NVFP4_BLOCK, NVFP4_BLOCK, c)
    return _dequantized_values(blocks, multiplier_t[:, None, :], decode_t[:, None, :], u, dtype).reshape(r, c)


_EAGER = {"rht": apply_rht, "segment_amax": _segment_amax, "tile_amax": _tile_amax, "values": _values,
          "values_sr": _values_sr, "column_amax": _column_amax, "column_values": _column_values,
          "column_values_sr": _column_values_sr}
"""The passes over a tensor's size, one function (one code object: its own torch.compile cache) per variant."""
_COMPILED: dict[str, object] = {}
_COMPILE_ON, _COMPILE_OPTIONS = ("cuda",), {}
"""The devices whose passes compile, and torch.compile's options (a CPU test traces every pass with dynamo alone:
backend "eager", fullgraph, so a graph that cannot trace under _symbolic_shapes fails there, not on the GPU)."""


def _symbolic_shapes():
    """Around a compiled call: every size a symbol, with no guard on sizes that happen to be equal (duck shaping)
    or 0 / 1 (an expert with one token), and room for a few more forms than dynamo's default 8."""
    import torch._dynamo.config
    import torch.fx.experimental._config

    stack = contextlib.ExitStack()
    stack.enter_context(torch.fx.experimental._config.patch(use_duck_shape=False, backed_size_oblivious=True))
    stack.enter_context(torch._dynamo.config.patch(recompile_limit=COMPILE_LIMIT))
    return stack


COMPILE_LIMIT = 32
"""Compiled forms a pass may hold (one per dtype and memory layout is the rule: 2 per dtype, checked on the GPU)."""


def _rotate(x: torch.Tensor):
    """The RHT fake_quant_nvfp4 runs for x's columnwise copy: on a GPU, a bf16 / fp16 copy in its base layout (x^T
    of a contiguous x, the emulated backend's case) goes to the Triton kernel of numerics/nvfp4_kernels.py (the same
    sums in the same order, one pass over memory); any other copy to _kernel("rht", x). A failed launch logs one
    warning and leaves _kernel's form for the rest of the run."""
    other = _kernel("rht", x)
    if not _triton_here(x.device, "rht") or x.dtype not in (torch.bfloat16, torch.float16):
        return other

    def rotate(v: torch.Tensor) -> torch.Tensor:
        if not _triton_here(v.device, "rht") or not _base_layout(v):
            return other(v)
        out = _in_triton("rht", v.device, lambda kernels: kernels.rht_base_layout(v, rht_matrix(v.device)))
        return out if out is not None else other(v)  # (a failed launch: the other form computes the same)
    return rotate


def _base_layout(v: torch.Tensor) -> bool:
    """Whether ``v`` is the transposed view of a contiguous 2-D tensor whose rows come in 16s (a columnwise copy)."""
    return v.dim() == 2 and v.shape[0] > 1 and not v.is_contiguous() and v.t().is_contiguous() \
        and v.shape[1] % NVFP4_BLOCK == 0


_TRITON: dict[str, bool] = {}
"""The Triton kernels that failed in this process, by what they compute ("rht", "stochastic rounding", "block
scales"): each is left alone, the others run on."""
_TRITON_ON = ("cuda",)
"""The devices whose RHT, stochastic rounding and block scales run the Triton kernels (a test adds "cpu" under
Triton's interpreter)."""


def _triton_here(device: torch.device, what: str) -> bool:
    return device.type in _TRITON_ON and not _TRITON.get(what)


def _in_triton(what: str, device: torch.device, launch: Callable):
    """launch(numerics/nvfp4_kernels) on `device` (Triton: imported on first use, where it runs), or None after one
    warning (_triton_failed) if it fails; running out of memory is raised (the other forms need more, not less)."""
    try:
        from fp8_recipes.numerics import nvfp4_kernels

        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            return launch(nvfp4_kernels)
    except torch.OutOfMemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - no Triton, a launch failure
        _triton_failed(what, e)
        return None


def _triton_failed(what: str, e: Exception) -> None:
    """One warning; that kernel is left for the rest of the run, the others run on (the RHT's and the block
    scales' other forms compute the same bits; stochastic rounding draws from torch's generator instead, seeded the
    same: other draws). One failed kernel had taken the others with it: an emulated NVFP4 step of 16 Llama-3-8B
    layers then ran 1.92x BF16's instead of 1.36x (the H100, 2026-12-07)."""
    logger.warning("NVFP4 %s: a Triton kernel failed (%s); using torch's forms for the rest of the run", what,
                   str(e).splitlines()[0] if str(e) else type(e).__name__)
    _TRITON[what] = True


def _kernel(name: str, x: torch.Tensor):
    """The eager function `name`, or for a non-empty CUDA tensor `x` its torch.compile'd form, compiled with
    dynamic shapes at its first call: the shapes of a run's GEMMs and an expert's token counts change no kernel;
    a form per dtype and memory layout (a rowwise copy, a transposed view). The tensors go in detached: a view's
    base would add guards of its own. A failure to compile logs one warning and leaves the eager one for the rest
    of the run. The RHT of a float32 tensor runs eagerly too: its products x * (+-1/4) are inexact for float32
    subnormals, and there the compiled sum rounded otherwise than cuBLAS and the eager in-order FMAs (3 of 6.3M
    values of tests/gpu's subnormal case, the H100, 2026-12-06); a bf16 x's products are exact (its smallest
    subnormal / 4 is a float32 subnormal), and a run's operands are bf16 on the GPU. (The other passes' products
    are exact. Inductor's CPU code differs from the CPU's eager kernels on subnormals, so the CPU runs eagerly.)"""
    if x.device.type not in _COMPILE_ON or not x.numel() or _COMPILED.get(name) is False or (
            name == "rht" and x.dtype == torch.float32):
        return _EAGER[name]
    if name not in _COMPILED:
        _COMPILED[name] = torch.compile(_EAGER[name], dynamic=True, **_COMPILE_OPTIONS)
        if name == "rht":
            rht_matrix(x.device)  # (made before tracing: the graph reads the cached tensor and never recompiles for it)

    def call(*args):
        args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)  # (not a view: no _base)
        try:
            with _symbolic_shapes():
                return _COMPILED[name](*args)
        except torch.OutOfMemoryError:
            raise  # (the eager form needs more memory, not less)
        except Exception as e:  # noqa: BLE001 - no Triton, an inductor bug: the eager form computes the same
            logger.warning("NVFP4 %s: torch.compile failed (%s); running it eagerly", name,
                           str(e).splitlines()[0] if str(e) else type(e).__name__)
            _COMPILED[name] = False
            return _EAGER[name](*args)
    return call
