"""Numerics statistics of one quantized GEMM operand: how far the FP8 tensor is from the high-precision one.

    s = measure(hp_x, fq_x, policy, columnwise=..., scaler=..., amax_reduce=...)   # one quantization
    s.merge(other)                                                                 # micro-batches of a step
    s.row() -> {"amax": ..., "underflow_pct": ..., "cosine": ..., ...}             # plain floats, once per step

Definitions (every count over the operand's elements, NaN never counted as zero or saturated):

=================  ==========================================================================================
amax               max |x| (NaN ignored)
min_nonzero        smallest non-zero |x| (None for an all-zero tensor)
underflow_pct      % of the non-zero elements whose fake-quantized value is 0
saturation_pct     % of the elements the cast clips: |x * scale| beyond fp8_max + half an ulp (464 for E4M3, 61440 for
                   E5M2; below that the value rounds to fp8_max anyway, as the amax element of tensorwise
                   scaling may by one float32 rounding); inf included
mse                mean (fq - x)^2
cosine             <x, fq> / (|x| |fq|) (1 when both are zero)
scale              per-tensor scale used (tensorwise, delayed); blocks: scale_min and scale_median
scale_ratio        delayed only: the delayed scale / the scale current scaling would pick for this step's amax
                   with the same margin and pow2 setting (fp8_max / amax); < 1 wastes range, > 1 saturates
=================  ==========================================================================================

The scale is never re-derived by a rule of our own: delayed reads the scaler the quantization used (its scale
changes only after the optimizer step), tensorwise recomputes ``amax_to_scale`` of the (reduced) amax exactly as
``quantize`` does, and block modes use quantize's own block-scale rule (without the cast; block amaxes are never
reduced). Clipped elements are counted one by one only when some block's amax x scale passes the clip point.
Sums stay on the tensor's device until :func:`rows` (or :meth:`OperandStats.row`), which copies every pending
operand's numbers to the host at once. On a GPU measure() never waits for the device: the amax is taken
from |x| with NaN zeroed and clipped elements are counted unconditionally (:data:`SYNC_FREE`); on the CPU, where a
sync is free, it branches (NaN pass and element-wise clip count only when needed). Both give the same numbers.
Pure torch (plus our numerics), except :func:`measure_fused`: for an operand handed over without its FP8 copy
(the TE backend's), on CUDA, quantization and statistics are one Triton kernel (observe/stats_kernels.py) with the
same numbers; elsewhere the numerics core quantizes and the torch path measures. NVFP4 operands (``scaling:
nvfp4``) are measured by :mod:`~fp8_recipes.observe.stats_nvfp4` on the copy the GEMM reads, with the same keys
(underflow_pct: the share flushed to zero; saturation_pct: clipped at E2M1's ±6) plus block_underflow_pct and
block_saturation_pct (their E4M3 block scales flushed to 0, clamped at 448).
"""

from __future__ import annotations

import functools
import logging
import math
import os
from dataclasses import dataclass, field

import numpy as np
import torch

from fp8_recipes.numerics import (
    DelayedScaler, Quantized, amax_to_scale, dequantize, fp8_spec, nan_ignoring_amax, quantize,
)
from fp8_recipes.numerics.formats import FLOAT32_MAX
# quantize's own block-scale rule and block multiply, fed the |x| computed here (no second float copy, no cast)
from fp8_recipes.numerics.quantize import _block_scales, _rows_cols, _scale_blocks, block_for, block_scale_for_inf
from fp8_recipes.numerics.scaling import AmaxReduce
from fp8_recipes.observe.stats_nvfp4 import BLOCK_SUMS, nvfp4_sums
from fp8_recipes.recipe.schema import MxRounding, Scaling, TensorPolicy

logger = logging.getLogger(__name__)

__all__ = ["COLUMNWISE", "FUSED", "FUSED_ERROR", "OperandStats", "STAT_KEYS", "SYNC_FREE", "fused", "measure",
           "measure_fused", "rows"]

# Which copy each GEMM reads (the emulated backend's layout, TE's too): the backward GEMMs read the weights, the
# gradients of wgrad and the activations of wgrad along the other dimension.
COLUMNWISE: dict[tuple[str, str], bool] = {
    ("fprop", "activations"): False, ("fprop", "weights"): False,
    ("dgrad", "gradients"): False, ("dgrad", "weights"): True,
    ("wgrad", "gradients"): True, ("wgrad", "activations"): True,
}

STAT_KEYS = ("numel", "amax", "min_nonzero", "underflow_pct", "saturation_pct", "mse", "cosine", "scale",
             "scale_min", "scale_median", "scale_ratio", "block_underflow_pct", "block_saturation_pct")
"""Every key a row may hold (a key that does not apply to the policy is absent; the last two: NVFP4 only)."""

_SUMS = ("numel", "nonzero", "underflow", "saturated", "sq_err", "dot", "hp_sq", "fq_sq")

FUSED: bool | None = None
"""measure()'s quantize-and-measure path for an operand handed over without its FP8 copy (``fq_x`` None): None =
the Triton kernel on CUDA (or anywhere under ``TRITON_INTERPRET=1``), True/False = forced (tests; True still
needs Triton and a block of powers of two). Both give the same numbers (tests/unit/test_fused_stats.py, and
compiled on the GPU tests/gpu/test_fused_stats_gpu.py)."""

SYNC_FREE: bool | None = None
"""measure()'s path: None = sync-free on any device but the CPU (no ``bool(tensor)``), True/False = forced (tests).
The sync-free path zeroes NaN in |x| in place and counts clipped elements unconditionally; the CPU path takes the
NaN-ignoring amax and the element-wise clip count only when a check says they are needed."""


@dataclass
class OperandStats:
    """Sums over every quantization of one operand in one step (0-dim tensors on the operand's device)."""

    policy: TensorPolicy
    sums: torch.Tensor
    """float64 (8,): numel, nonzero, underflow, saturated, sum sq err, <x,fq>, |x|^2, |fq|^2; NVFP4: (12,), the
    block counts of stats_nvfp4.BLOCK_SUMS after them."""
    amax: torch.Tensor
    min_nonzero: torch.Tensor
    """inf when every element is zero."""
    scales: list[torch.Tensor] = field(default_factory=list)
    """The scale of each quantization (one element per tensor, or one per block)."""
    scale_hist: torch.Tensor | None = None
    """Block scales that are powers of two (measure_fused): int32 (256,) counts by float32 exponent field, from
    which rows() takes scale_min and scale_median on the host (no sort on the device); None: from `scales`."""
    packed: torch.Tensor | None = None
    """measure_fused's whole output buffer (see _output), while it holds every number of the row (one quantization;
    a per-tensor scale or exponent counts): rows() then copies the step's packed buffers in one stacked transfer
    and reads them on the host, with no device op per operand. merge() drops it."""

    def copy(self) -> OperandStats:
        return OperandStats(self.policy, self.sums, self.amax, self.min_nonzero, list(self.scales), self.scale_hist,
                            self.packed)

    def merge(self, other: OperandStats) -> OperandStats:
        """Fold another quantization of the same operand (the next micro-batch) into this one."""
        self.sums = self.sums + other.sums
        self.amax = torch.maximum(self.amax, other.amax)
        self.min_nonzero = torch.minimum(self.min_nonzero, other.min_nonzero)
        self.scales.extend(other.scales)
        both = self.scale_hist is not None and other.scale_hist is not None
        self.scale_hist = self.scale_hist + other.scale_hist if both else None
        self.packed = None
        return self

    def row(self) -> dict[str, float | int | None]:
        """The statistics as plain Python numbers (one device->host transfer; see :func:`rows`)."""
        return rows([self])[0]


def _summary_pieces(s: OperandStats) -> tuple[list[torch.Tensor], int]:
    """float32 1-D pieces: amax, min_nonzero, then the scale summary (per tensor: the median; blocks: min and
    median; nothing without scales), all computed on the device; and the summary's length."""
    pieces = [s.amax.reshape(1).float(), s.min_nonzero.reshape(1).float()]
    if not s.scales:
        return pieces, 0
    per_tensor = s.policy.scaling in (Scaling.TENSORWISE, Scaling.DELAYED)
    if s.scale_hist is not None and not per_tensor:  # min and median from the counts, for all at once: _hist_summary
        return pieces, _FROM_HIST
    if per_tensor and len(s.scales) == 1:  # the common case: one micro-batch (the median of one value is itself)
        return pieces + [s.scales[0].reshape(1).float()], 1
    scales = s.scales[0].reshape(-1).float() if len(s.scales) == 1 else \
        torch.cat([t.reshape(-1).float() for t in s.scales])
    if per_tensor:
        return pieces + [scales.median().reshape(1)], 1
    return pieces + [scales.min().reshape(1), scales.median().reshape(1)], 2


def rows(stats: list[OperandStats]) -> list[dict[str, float | int | None]]:
    """:meth:`OperandStats.row` of each, with one device->host transfer per device (one per step on a GPU) for the
    `packed` operands (their buffers stacked, decoded on the host: :func:`_packed_rows`) and one for the others,
    whose numbers (sums, amax, min_nonzero, scale min/median) are gathered into one float64 tensor first."""
    stats = list(stats)
    out: list[dict[str, float | int | None] | None] = [None] * len(stats)
    packed: dict[torch.device, list[int]] = {}
    by_device: dict[torch.device, list[int]] = {}
    for i, s in enumerate(stats):
        (packed if s.packed is not None else by_device).setdefault(s.sums.device, []).append(i)
    for idx in packed.values():
        for i, row in zip(idx, _packed_rows([stats[i] for i in idx])):
            out[i] = row
    for device, idx in by_device.items():
        sums = torch.cat([stats[i].sums.reshape(-1).double() for i in idx])
        pieces, lengths, hists = [], [], []
        for i in idx:
            p, n = _summary_pieces(stats[i])
            pieces.extend(p)
            lengths.append(n)
            if n == _FROM_HIST:
                hists.append(stats[i].scale_hist)
        if hists:
            pieces.append(_hist_summary(torch.stack(hists)).reshape(-1))
        values = torch.cat([sums, torch.cat([t.to(device) for t in pieces]).double()]).tolist()  # the one sync
        sums_v, rest = values[:sums.numel()], values[sums.numel():]
        pos, from_hist, at = 0, len(rest) - 2 * len(hists), 0
        for i, n in zip(idx, lengths):
            if n == _FROM_HIST:
                summary, pos = rest[pos:pos + 2] + rest[from_hist:from_hist + 2], pos + 2
                from_hist += 2
            else:
                summary, pos = rest[pos:pos + 2 + n], pos + 2 + n
            width = stats[i].sums.numel()  # (NVFP4's hold block counts too)
            out[i] = _row(stats[i].policy, sums_v[at:at + width], summary[0], summary[1], summary[2:])
            at += width
    return out  # type: ignore[return-value]


def _packed_rows(stats: list[OperandStats]) -> list[dict[str, float | int | None]]:
    """The rows of operands whose `packed` buffers (on one device) hold everything: one stacked copy to the host,
    decoded there as rows() does on the device (scale min and median from the counts: :func:`_hist_summary`)."""
    table = torch.stack([s.packed for s in stats]).cpu().numpy()
    n = len(_SUMS)
    f32 = np.ascontiguousarray(table[:, n:n + 2]).view(np.float32)  # amax, min_nonzero, per-tensor scale, unused
    hist = [k for k, s in enumerate(stats) if s.scale_hist is not None]
    from_hist = dict(zip(hist, _hist_summary(torch.from_numpy(
        np.ascontiguousarray(table[hist, n + 2:]).view(np.int32))).tolist())) if hist else {}
    return [_row(s.policy, table[k, :n].tolist(), float(f32[k, 0]), float(f32[k, 1]),
                 from_hist[k] if k in from_hist else [float(f32[k, 2])])
            for k, s in enumerate(stats)]


_FROM_HIST = -1
"""_summary_pieces' length for an operand whose scale min and median come from its exponent counts."""


def _hist_summary(hists: torch.Tensor) -> torch.Tensor:
    """(n, 2) float32 [min, median] of power-of-two scales from their counts by float32 exponent field (n, 256),
    on the counts' device for all n at once; the median is torch's (the lower of the two middle values for an even
    count). Field 0 is 2^-127 (MXFP8's smallest multiplier, subnormal). Every row counts at least one scale."""
    counts = hists.float()  # exact: fewer than 2^24 blocks per operand
    seen = counts.cumsum(1)
    middle = torch.div(seen[:, -1:] - 1, 2, rounding_mode="floor")
    fields = torch.stack([(counts > 0).int().argmax(1), (seen > middle).int().argmax(1)], 1)  # first bin passing
    return torch.ldexp(torch.ones_like(counts[:, :2]), fields - 127)


def _row(policy: TensorPolicy, sums_list: list[float], amax: float, min_nz: float,
         scale_summary: list[float]) -> dict[str, float | int | None]:
    """A row from host numbers: `scale_summary` is [] (no scales), [median] (per tensor) or [min, median]."""
    sums = dict(zip(_SUMS + BLOCK_SUMS, sums_list))
    numel = int(sums["numel"])
    norm = math.sqrt(sums["hp_sq"] * sums["fq_sq"])
    if norm > 0:
        cosine = sums["dot"] / norm
    else:  # both zero: the same tensor; one zero: nothing in common
        cosine = 1.0 if sums["hp_sq"] == sums["fq_sq"] == 0 else 0.0
    out: dict[str, float | int | None] = {
        "numel": numel,
        "amax": amax,
        "min_nonzero": min_nz if math.isfinite(min_nz) else None,
        "underflow_pct": 100.0 * sums["underflow"] / max(sums["nonzero"], 1.0),
        "saturation_pct": 100.0 * sums["saturated"] / max(numel, 1),
        "mse": sums["sq_err"] / max(numel, 1),
        "cosine": cosine,
    }
    if "blocks" in sums:  # NVFP4 (observe/stats_nvfp4.py): its 16-value blocks' E4M3 scales
        out["block_underflow_pct"] = 100.0 * sums["underflow_blocks"] / max(sums["nonzero_blocks"], 1.0)
        out["block_saturation_pct"] = 100.0 * sums["saturated_blocks"] / max(sums["blocks"], 1.0)
    per_tensor = policy.scaling in (Scaling.TENSORWISE, Scaling.DELAYED)
    if scale_summary and per_tensor:
        out["scale"] = scale_summary[0]
    elif scale_summary:
        out["scale_min"], out["scale_median"] = scale_summary
    if policy.scaling is Scaling.DELAYED and scale_summary:
        out["scale_ratio"] = None
        if amax > 0 and math.isfinite(amax):
            # on the host, from the float32 amax copied exactly: the same float32 arithmetic as on the device
            current = amax_to_scale(torch.tensor(amax, dtype=torch.float32), policy.format, margin=policy.margin,
                                    pow2=policy.pow2_scales)
            out["scale_ratio"] = out["scale"] / float(current)
    return out


def _clip_point(spec) -> float:
    """|x * scale| beyond which an element counts as clipped: above fp8_max + half its ulp (below that it rounds
    to fp8_max in an FP8 format with more exponent anyway)."""
    return spec.max + 2.0**spec.emax * torch.finfo(spec.dtype).eps / 2


def measure(
    hp_x: torch.Tensor,
    fq_x: torch.Tensor | None,
    policy: TensorPolicy,
    *,
    columnwise: bool = False,
    scaler: DelayedScaler | None = None,
    amax_reduce: AmaxReduce | None = None,
    quantized: Quantized | None = None,
    sync_free: bool | None = None,
    seed: int = 0,
) -> OperandStats:
    """Statistics of one quantization: `hp_x` the GEMM operand, `fq_x` what the GEMM read (dequantized FP8).

    `scaler` is the operand's DelayedScaler (delayed scaling: read, never written); `amax_reduce` the reduction
    tensorwise scaling used (a collective: every rank must measure the same operands, as the recorder does).
    `quantized`: the :class:`~fp8_recipes.numerics.Quantized` that `fq_x` was dequantized from, when the backend
    has it: its scales (and block maxima) are used as they are instead of being derived again (a third of the
    cost for block scaling; no amax collective for tensorwise).
    `sync_free`: None = :data:`SYNC_FREE` (default: sync-free unless the tensors are on the CPU); both paths give
    the same numbers. `seed`: NVFP4 with stochastic rounding whose copy the backend kept: the draws of the
    quantization here.
    `fq_x` None: quantize `hp_x` here (delayed: with `scaler`'s scale, recording nothing). Where :func:`fused`
    holds, in one Triton kernel (:func:`measure_fused`), otherwise with the numerics core.
    """
    if not policy.is_fp8:
        raise ValueError("measure: policy.scaling is 'none'; there is no quantization to measure")
    if policy.scaling is Scaling.NVFP4:  # E2M1 codes and two-level scales: statistics of their own (torch only)
        return OperandStats(policy, *nvfp4_sums(hp_x, fq_x, policy, columnwise=columnwise, quantized=quantized,
                                                  seed=seed))
    if fq_x is None:
        if amax_reduce is None and fused(hp_x, policy, columnwise):
            try:
                return measure_fused(hp_x, policy, columnwise=columnwise, scaler=scaler)
            except Exception as e:  # noqa: BLE001 - e.g. a Triton that cannot compile the kernel: the core measures
                _fused_failed(e)
        quantized = quantize(hp_x, policy, columnwise=columnwise, scaler=scaler, amax_reduce=amax_reduce,
                             record_amax=False)
        fq_x = dequantize(quantized, torch.float32)  # what the GEMM reads: codes x scale_inv in float32
    if sync_free is None:
        sync_free = SYNC_FREE if SYNC_FREE is not None else hp_x.device.type != "cpu"
    return _measured(hp_x, fq_x, policy, columnwise, scaler, amax_reduce, quantized, sync_free)


def _measured(hp_x, fq_x, policy, columnwise, scaler, amax_reduce, quantized, sync_free: bool) -> OperandStats:
    """measure() of an FP8 copy the GEMM read (`fq_x`, dequantized)."""
    clip = _clip_point(fp8_spec(policy.format))
    numel = hp_x.numel()
    hp = hp_x.detach().reshape(-1).float()
    fq = fq_x.detach().reshape(-1).float()
    mag = hp.abs()
    if sync_free:  # NaN -> 0 in place (abs made a copy): nan_ignoring_amax's values, no check on the host
        mag.nan_to_num_(nan=0.0, posinf=math.inf)  # NaN is neither > 0 nor clipped: the counts below are unchanged
    amax = mag.max() if numel else torch.zeros((), device=mag.device)
    has_nan = not sync_free and bool(torch.isnan(amax))  # a host sync (free on the CPU)
    if has_nan:
        amax = nan_ignoring_amax(mag)
    min_nonzero = torch.where(mag > 0, mag, math.inf).min() if numel else \
        torch.full((), math.inf, device=mag.device)
    # 0 quantizes to 0 (and NaN to NaN), so the values that underflow are fq's zeros beyond x's own
    zeros_hp = numel - torch.count_nonzero(hp_x)
    underflow = (numel - torch.count_nonzero(fq_x)) - zeros_hp
    per_tensor = policy.scaling in (Scaling.DELAYED, Scaling.TENSORWISE)
    block = None if per_tensor else block_for(policy, hp_x.shape, columnwise)
    mag2d = mag if per_tensor else mag.reshape(_rows_cols(hp_x.shape))
    scale, block_amax = _scales_used(mag2d, amax, policy, block, hp_x.dtype, scaler, amax_reduce, quantized,
                                     nan_free_abs=not has_nan)
    # Rounding is monotonic: no element of a block passes the clip point after scaling unless its amax does, so
    # the element-wise count runs only when some block is clipped (delayed scaling's stale scale, OCP's floor rule).
    # Sync-free: count unconditionally (one pass; no host check).
    if sync_free or bool((block_amax * scale > clip).any()):
        saturated = ((mag * scale if per_tensor else _scale_blocks(mag2d, scale, block)) > clip).sum()
    else:
        saturated = torch.zeros((), device=mag.device)
    err = fq - hp
    sums = torch.stack([
        torch.full((), float(numel), device=hp.device, dtype=torch.float64),  # a fill: no host->device copy
        torch.as_tensor(numel - zeros_hp, device=hp.device).double(),
        torch.as_tensor(underflow, device=hp.device).double(),
        saturated.double(),
        torch.dot(err, err).double(),
        torch.dot(hp, fq).double(),
        torch.dot(hp, hp).double(),
        torch.dot(fq, fq).double(),
    ])
    return OperandStats(policy, sums, amax, min_nonzero, [scale.detach()])


def _scales_used(mag2d, amax, policy, block, dtype, scaler, amax_reduce, quantized, *, nan_free_abs: bool):
    """(the scale the GEMM used: 0-dim, or one per block; the amax each scale was taken from) of a copy whose
    |values| are `mag2d` (flat for a per-tensor scale)."""
    per_tensor = block is None
    if quantized is not None:  # the backend's own scales: nothing to derive (they are what the GEMM used)
        return (quantized.scale.reshape(()), amax) if per_tensor else (quantized.scale, quantized.amax)
    if policy.scaling is Scaling.DELAYED:
        if scaler is None:
            raise ValueError("measure: scaling 'delayed' needs the operand's DelayedScaler (scaler=...)")
        return scaler.scale.to(mag2d.device).reshape(()), amax
    if policy.scaling is Scaling.TENSORWISE:
        reduced = amax_reduce(amax.reshape(1, 1).clone()) if amax_reduce is not None else amax
        return amax_to_scale(reduced.reshape(()), policy.format, margin=policy.margin, epsilon=policy.amax_epsilon,
                             pow2=policy.pow2_scales), amax
    # blockwise, mxfp8: the block scales quantize() derives (no amax reduction for blocks)
    block_amax, scale, _, _ = _block_scales(mag2d, policy, block, dtype, nan_free_abs=nan_free_abs)
    return scale, block_amax



# -- one Triton kernel per operand (observe/stats_kernels.py) --------------------------------------------------------

_TILE = 8192
"""Elements per program: a tile of whole blocks, at least one block (128x128 blocks: 16384)."""
_WARPS = 8
"""Warps per program of the fused kernels."""


def _tile(block: tuple[int, int]) -> tuple[int, int]:
    br, bc = block
    tc = max(bc, min(128, max(1, _TILE // br)))
    return max(br, _TILE // tc), tc


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@functools.cache
def _triton() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # noqa: BLE001 - no Triton (or one that cannot load): the numerics core measures
        return False
    return True


FUSED_ERROR: str | None = None
"""Why the fused kernel failed in this process (then the numerics core measures for the rest of it), or None."""


def _fused_failed(e: Exception) -> None:
    global FUSED_ERROR
    FUSED_ERROR = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
    logger.warning("numerics statistics: the fused Triton kernel failed (%s); measuring with the numerics core "
                   "from now on (same numbers, slower)", FUSED_ERROR)


def fused(hp_x: torch.Tensor, policy: TensorPolicy, columnwise: bool = False) -> bool:
    """Whether :func:`measure_fused` takes this operand: :data:`FUSED`, else a CUDA tensor (or Triton's
    interpreter), and in either case Triton present, the kernel not failed before (:data:`FUSED_ERROR`) and a
    block whose sides are powers of two."""
    want = FUSED if FUSED is not None else (hp_x.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")
    if not (want and _triton()) or FUSED_ERROR is not None or hp_x.numel() == 0 or policy.scaling is Scaling.NVFP4:
        return False
    if policy.scaling in (Scaling.TENSORWISE, Scaling.DELAYED):
        return True
    br, bc = block_for(policy, hp_x.shape, columnwise)
    return _pow2(br) and _pow2(bc) and br * bc <= 2 * _TILE


_OUTPUT: dict[torch.device, torch.Tensor] = {}


def _output(device: torch.device) -> torch.Tensor:
    """A fresh output buffer (one device copy of a template made once per device): float64 sums of _SUMS, then
    float32 amax (0), min_nonzero (inf), scale (0) in the next two float64 slots, then 256 int32 zeros (the block
    scales' counts by exponent)."""
    template = _OUTPUT.get(device)
    if template is None:
        template = torch.zeros(len(_SUMS) + 2 + 256 // 2, dtype=torch.float64)
        template[len(_SUMS):].view(torch.float32)[1] = math.inf
        template = _OUTPUT[device] = template.to(device)
    return template.clone()


def measure_fused(hp_x: torch.Tensor, policy: TensorPolicy, *, columnwise: bool = False,
                  scaler: DelayedScaler | None = None, fq_out: torch.Tensor | None = None) -> OperandStats:
    """:func:`measure` of `hp_x` quantized under `policy`, in one Triton kernel (tensorwise: two, the amax first):
    the FP8 copy is never written (`fq_out`, a float32 tensor of hp_x's size: write it there, for tests).
    Delayed scaling reads `scaler.scale` and records nothing. Same numbers as the numerics core's quantize +
    :func:`measure` (counts, amax, min_nonzero and scales equal; float sums up to summation order)."""
    from fp8_recipes.observe import stats_kernels as k  # Triton: imported only where a fused kernel runs (GPUs)

    spec = fp8_spec(policy.format)
    rows, cols = _rows_cols(hp_x.shape)
    x = hp_x.detach().reshape(rows, cols)
    if not x.is_contiguous():
        x = x.contiguous()
    buf = _output(x.device)
    out64, out32 = buf[:len(_SUMS)], buf[len(_SUMS):len(_SUMS) + 2].view(torch.float32)
    hist = buf[len(_SUMS) + 2:].view(torch.int32)
    per_tensor = policy.scaling in (Scaling.TENSORWISE, Scaling.DELAYED)
    block = (1, 1) if per_tensor else block_for(policy, hp_x.shape, columnwise)
    tr, tc = _tile(block)
    grid = ((rows + tr - 1) // tr, (cols + tc - 1) // tc)
    scale, block_scales = out32, out32  # placeholders where the mode reads none
    if policy.scaling is Scaling.DELAYED:
        if scaler is None:
            raise ValueError("measure: scaling 'delayed' needs the operand's DelayedScaler (scaler=...)")
        scale = scaler.scale.to(x.device, torch.float32).reshape(1)
        mode = k.MODE_DELAYED
    elif policy.scaling is Scaling.TENSORWISE:
        k.amax(grid, (x, rows, cols, out32), (tr, tc), _WARPS)
        mode = k.MODE_TENSORWISE
    else:
        block_scales = torch.empty(((rows + block[0] - 1) // block[0], (cols + block[1] - 1) // block[1]),
                                   dtype=torch.float32, device=x.device)
        mode = k.MODE_MXFP8 if policy.scaling is Scaling.MXFP8 else k.MODE_BLOCKWISE
    big = block_scale_for_inf(hp_x.dtype) if mode == k.MODE_BLOCKWISE else FLOAT32_MAX
    clip = _clip_point(spec)
    pow2 = mode == k.MODE_MXFP8 or (mode == k.MODE_BLOCKWISE and policy.pow2_scales)  # histogram-able scales
    k.stats(grid, (x, rows, cols, scale, out64, out32, block_scales, hist, fq_out if fq_out is not None else out32,
                   spec.max, clip, policy.amax_epsilon, 2.0 ** -policy.margin, big, 1.0 / spec.max),
            (mode, policy.pow2_scales, policy.mx_rounding is MxRounding.RCEIL, pow2,  # MODE POW2 RCEIL HIST
             round(math.log2(spec.min_normal / spec.min_subnormal)), round(math.log2(spec.min_normal)),  # MBITS EMIN
             spec.emax, block[0], block[1], tr, tc, fq_out is not None),  # EMAX BR BC TR TC STORE_FQ
            _WARPS)
    return OperandStats(policy, out64, out32[0], out32[1], [out32[2:3] if per_tensor else block_scales],
                        hist if pow2 else None, buf if per_tensor or pow2 else None)
