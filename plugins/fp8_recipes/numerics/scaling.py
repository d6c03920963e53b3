"""From amax to scale, exactly as Transformer Engine 2.20 computes it, plus the delayed-scaling state.

Conventions (TE's): ``scale`` multiplies the high-precision tensor before the cast; ``scale_inv = 1 / scale``
(float32 reciprocal) multiplies the FP8 codes to dequantize. For MXFP8 the scale is an E8M0 exponent code.
Pure torch: distributed reductions are passed in as callables.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fp8_recipes.numerics.formats import FLOAT32_MAX, fp8_spec
from fp8_recipes.recipe.schema import AmaxAlgo, Format, MxRounding, TensorPolicy

__all__ = [
    "AmaxReduce", "DelayedScaler", "amax_to_e8m0", "amax_to_scale", "delayed_scale_update", "e8m0_to_multiplier",
    "e8m0_to_scale_inv", "history_percentile", "nan_ignoring_amax", "pow2_floor", "resized_history", "retaken_scale",
    "window_amax",
]

AmaxReduce = Callable[[torch.Tensor], torch.Tensor]
"""Takes a float32 amax tensor, returns its MAX over a process group (e.g. an all_reduce); identity if None."""


def nan_ignoring_amax(hp_x: torch.Tensor, dim=None) -> torch.Tensor:
    """max |x| in float32, NaN ignored (the hardware's fmaxf does the same); inf is kept."""
    a = hp_x.detach().float().abs().nan_to_num_(nan=0.0, posinf=float("inf"))  # abs() made a copy: in place
    if dim is None:
        return a.amax() if a.numel() else torch.zeros((), dtype=torch.float32, device=a.device)
    return a.amax(dim=dim)


def pow2_floor(scale: torch.Tensor) -> torch.Tensor:
    """Keep sign and exponent bits only: the largest power of two <= scale (TE's force_pow_2_scales)."""
    bits = scale.float().contiguous().view(torch.int32) & torch.tensor(0xFF800000 - (1 << 32), dtype=torch.int32)
    return bits.view(torch.float32)


def amax_to_scale(
    amax: torch.Tensor,
    fmt: Format | str,
    *,
    margin: int = 0,
    epsilon: float = 0.0,
    pow2: bool = False,
    value_for_inf: float = FLOAT32_MAX,
) -> torch.Tensor:
    """TE's ``compute_scale_from_amax``, elementwise: scale = fp8_max / max(amax, eps) / 2^margin.

    amax 0, inf or NaN -> scale 1 (never a NaN or inf scale); a scale that overflows float32 -> value_for_inf.
    """
    amax = amax.float()
    fp8_max = torch.full((), fp8_spec(fmt).max, dtype=torch.float32, device=amax.device)  # no host copy (a sync on CUDA)
    if epsilon > 0:
        amax = torch.where(amax < epsilon, torch.full_like(amax, epsilon), amax)
    degenerate = ~torch.isfinite(amax) | (amax == 0)
    safe_amax = torch.where(degenerate, torch.ones_like(amax), amax)
    scale = fp8_max / safe_amax  # float32 division, round-to-nearest (TE's __fdiv_rn)
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, value_for_inf), scale)
    if margin:
        scale = scale * (2.0 ** -margin)  # exact: a power of two
    if pow2:
        scale = pow2_floor(scale)
    return torch.where(degenerate, torch.ones_like(scale), scale)


def amax_to_e8m0(amax: torch.Tensor, fmt: Format | str, rounding: MxRounding | str = MxRounding.RCEIL) -> torch.Tensor:
    """The MXFP8 block exponent as a biased E8M0 code (uint8), scale_inv = 2^(code - 127).

    rceil (NVIDIA, TE's ``float_to_e8m0(amax * max_norm_rcp)``): the smallest power of two >= amax / fp8_max,
    so a block never saturates. floor (OCP MX v1.0): 2^(floor(log2 amax) - emax), which can saturate the top
    values of a block. amax 0 -> code 0; codes are clamped to [0, 254] (255 is E8M0's NaN).
    """
    spec = fp8_spec(fmt)
    amax = amax.float()
    amax = torch.where(torch.isnan(amax), torch.zeros_like(amax), amax)
    if MxRounding(rounding) is MxRounding.RCEIL:
        rcp = torch.full((), 1.0 / spec.max, dtype=torch.float32, device=amax.device)  # TE's float32 max_norm_rcp
        val = amax * rcp
        bits = val.contiguous().view(torch.int32)
        exponent = (bits >> 23) & 0xFF
        mantissa = bits & 0x7FFFFF
        round_up = (mantissa > 0) & (exponent != 0xFE) & ~((exponent == 0) & (mantissa <= 0x400000))
        code = exponent + round_up.to(torch.int32)
        code = torch.where(torch.isinf(val), torch.full_like(code, 0xFE), code)
        code = torch.where(val == 0, torch.zeros_like(code), code)
    else:
        bits = amax.contiguous().view(torch.int32)
        unbiased = ((bits >> 23) & 0xFF) - 127 - spec.emax
        code = unbiased + 127
        code = torch.where(torch.isinf(amax), torch.full_like(code, 0xFE), code)
    return code.clamp(0, 254).to(torch.uint8)


def e8m0_to_scale_inv(code: torch.Tensor) -> torch.Tensor:
    """2^(code - 127) as float32 (the dequantization multiplier the GEMM applies)."""
    return torch.ldexp(torch.ones_like(code, dtype=torch.float32), code.to(torch.int32) - 127)


def e8m0_to_multiplier(code: torch.Tensor) -> torch.Tensor:
    """What TE multiplies elements by before the cast: 2^(127 - code), and 1 for code 0 (TE's exp2f_rcp)."""
    m = torch.ldexp(torch.ones_like(code, dtype=torch.float32), 127 - code.to(torch.int32))
    return torch.where(code == 0, torch.ones_like(m), m)


def history_percentile(history: torch.Tensor, percentile: float) -> torch.Tensor:
    """The `percentile`-th percentile of the recorded (positive) amaxes along dim 0; 0 where none was recorded.

    history: (history_len,) or (history_len, n). Unfilled slots (0) are not amaxes, so they are left out.
    """
    h = history.float()
    seen = torch.where(h > 0, h, torch.full_like(h, float("nan")))
    return torch.nan_to_num(torch.nanquantile(seen, percentile / 100.0, dim=0), nan=0.0)


def window_amax(history: torch.Tensor, policy: TensorPolicy) -> torch.Tensor:
    """The amax a delayed `policy` takes from `history` (TE's layout, along dim 0: slot 0 the step being recorded,
    then the past steps oldest first): its max, its slot 0 (most_recent) or its percentile."""
    if policy.amax_compute_algo is AmaxAlgo.MOST_RECENT:
        return history[0].clone()
    if policy.amax_compute_algo is AmaxAlgo.PERCENTILE:
        return history_percentile(history, policy.percentile)
    return history.amax(dim=0)


def resized_history(history: torch.Tensor, length: int) -> torch.Tensor:
    """A delayed amax history (TE's layout along dim 0, any columns) as one of `length` rows: slot 0 and the most
    recent ``length - 1`` past amaxes kept, zeros where it grows. (TE's own ``adjust_amax_history_length`` keeps the
    first rows, the oldest amaxes: a window shortened to drop an old outlier would keep it.)"""
    out = history.new_zeros((length, *history.shape[1:]))
    out[0] = history[0]
    keep = min(length, history.shape[0]) - 1
    if keep > 0:
        out[-keep:] = history[-keep:]
    return out


def retaken_scale(history: torch.Tensor, scale: torch.Tensor, policy: TensorPolicy) -> torch.Tensor:
    """The scale a delayed `policy` takes from `history` (a resized window): TE's update rule without the roll, the
    previous `scale` kept where the window holds no amax."""
    return delayed_scale_update(window_amax(history, policy), scale, fp8_spec(policy.format).max, policy.margin,
                                policy.pow2_scales)


def delayed_scale_update(amax: torch.Tensor, scale: torch.Tensor, fp8_max: float, margin: int = 0,
                         pow2: bool = False) -> torch.Tensor:
    """TE's delayed-scaling update (``_default_sf_compute``): fp8_max / amax / 2^margin, float32 max when that
    overflows, the previous `scale` where amax is 0 or not finite; optionally rounded down to a power of two."""
    amax = amax.float()
    sf = torch.full((), fp8_max, dtype=torch.float32, device=amax.device) / amax
    sf = sf / (2.0 ** margin)
    sf = torch.where(torch.isinf(sf), torch.full_like(sf, FLOAT32_MAX), sf)
    if pow2:
        sf = pow2_floor(sf)
    return torch.where((amax > 0) & torch.isfinite(amax), sf, scale.to(sf.device))


class DelayedScaler:
    """Delayed scaling state for one tensor: an amax history and the scale the next quantization uses.

    Follows TE's DelayedScaling: a quantization uses ``scale`` (from earlier steps) and records its amax in
    ``history[0]``; :meth:`update` (after the step) reduces that slot over the group, takes the history's max /
    most recent / percentile, sets ``scale = fp8_max / amax / 2^margin`` (unchanged when amax is 0 or not
    finite), then rolls the history and clears slot 0. A step that quantized nothing with it (an MoE expert the
    router gave no token, in every micro-batch) leaves history and scale as they were: TE 2.20.2's GroupedLinear
    neither records nor rolls an empty split's amax (measured on an H200, tests/gpu/test_te_grouped.py).
    """

    def __init__(self, policy: TensorPolicy, device: torch.device | str = "cpu"):
        self.policy = policy
        self.history = torch.zeros(policy.amax_history_len, dtype=torch.float32, device=device)
        self.scale = torch.ones((), dtype=torch.float32, device=device)
        self.observed = False
        """Whether a quantization recorded an amax since the last update."""

    def observe(self, amax: torch.Tensor) -> None:
        self.history[0] = torch.maximum(self.history[0], amax.detach().float().to(self.history.device))
        self.observed = True

    def history_amax(self) -> torch.Tensor:
        return window_amax(self.history, self.policy)

    def update(self, reduce: AmaxReduce | None = None, *, skip_unobserved: bool = False) -> None:
        """``skip_unobserved``: keep history and scale when nothing was observed since the last update (an expert
        without tokens, on one GPU as measured). Off where amaxes are all-reduced: every rank must update."""
        if skip_unobserved and not self.observed:
            return
        self.observed = False
        if reduce is not None:
            self.history[0] = reduce(self.history[0].clone())
        amax = self.history_amax()
        self.scale = delayed_scale_update(amax, self.scale, fp8_spec(self.policy.format).max, self.policy.margin,
                                          self.policy.pow2_scales)
        if self.history.numel() > 1:
            self.history.copy_(torch.roll(self.history, -1, 0))
        self.history[0] = 0.0

    def resized(self, policy: TensorPolicy) -> DelayedScaler:
        """This state under another delayed `policy` (a run's plan changed between steps, e.g. a shorter history):
        the most recent ``policy.amax_history_len - 1`` amaxes and slot 0 kept (zeros where the history grows), and
        the scale taken again from the kept history with the new policy's rules, so an amax that fell out of the
        window no longer sets it (a history of zeros keeps the scale, as an update would)."""
        new = DelayedScaler(policy, self.history.device)
        new.history = resized_history(self.history, policy.amax_history_len)
        new.observed = self.observed
        new.scale = retaken_scale(new.history, self.scale, policy)
        return new

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"history": self.history.clone(), "scale": self.scale.clone()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if state["history"].shape != self.history.shape:
            raise ValueError(f"amax_history_len: checkpoint has {state['history'].numel()}, recipe has "
                             f"{self.history.numel()}; resume with the same recipe or reset the scaling state")
        self.history.copy_(state["history"])
        self.scale = state["scale"].clone().to(self.history.device)
