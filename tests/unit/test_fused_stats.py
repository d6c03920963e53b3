"""measure()'s fused path (observe/stats_kernels.py, one Triton kernel per operand) against the numerics core's
quantize + measure(): the FP8 values bit for bit, the counts, amax, smallest non-zero and scales exactly, the float
sums up to summation order; every scaling mode, both layouts, BF16 and float32, NaN, inf, zeros, clipping.

Without a GPU the kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``, read when the kernels are
defined, so in a subprocess). The same checks on the H200, compiled, at TE's shapes: tests/gpu/test_fused_stats_gpu.py.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from fp8_recipes.numerics import DelayedScaler, dequantize, quantize
from fp8_recipes.observe import stats as stats_mod
from fp8_recipes.observe.stats import measure, measure_fused
from fp8_recipes.recipe.schema import Format, MxRounding, Scaling, TensorPolicy
from triton_interpreter import interpreted

POLICIES = {
    "tensorwise": TensorPolicy(scaling=Scaling.TENSORWISE),
    "tensorwise-e5m2-margin-pow2": TensorPolicy(scaling=Scaling.TENSORWISE, format=Format.E5M2, margin=1,
                                                pow2_scales=True),
    "tensorwise-epsilon": TensorPolicy(scaling=Scaling.TENSORWISE, amax_epsilon=1e6),
    "delayed-stale": TensorPolicy(scaling=Scaling.DELAYED, amax_history_len=4),
    "blockwise-1x16": TensorPolicy(scaling=Scaling.BLOCKWISE, block=(1, 16)),
    "blockwise-16x16-no-pow2": TensorPolicy(scaling=Scaling.BLOCKWISE, block=(16, 16), pow2_scales=False),
    "blockwise-128x128": TensorPolicy(scaling=Scaling.BLOCKWISE, block=(128, 128)),
    "blockwise-e5m2-32x1": TensorPolicy(scaling=Scaling.BLOCKWISE, format=Format.E5M2, block=(32, 1)),
    "mxfp8-rceil": TensorPolicy(scaling=Scaling.MXFP8),
    "mxfp8-floor": TensorPolicy(scaling=Scaling.MXFP8, mx_rounding=MxRounding.FLOOR),
}


def operand(rows: int, cols: int, dtype: torch.dtype, special: bool, device="cpu", seed=0) -> torch.Tensor:
    """Values over ten decades (underflow in some columns, clipping under a stale scale), zeros, a zero row;
    `special`: NaN and inf too."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-7, 3, cols)
    x[3, 5] = x[7, :] = 0.0
    if special:
        x[2, 9] = x[rows - 1, cols - 2] = math.nan
        x[5, 1] = math.inf
    return x.to(device=device, dtype=dtype)


def compare(x: torch.Tensor, policy: TensorPolicy, columnwise: bool) -> None:
    """Assert measure_fused(x) == the numerics core's quantization measured by the torch path."""
    scaler = None
    if policy.scaling is Scaling.DELAYED:
        scaler = DelayedScaler(policy, device=x.device)
        scaler.scale = torch.tensor(448.0 / 50.0, device=x.device)  # stale: values above 50 clip
    q = quantize(x, policy, columnwise=columnwise, scaler=scaler, record_amax=False)
    fq_core = dequantize(q, torch.float32)
    ref = measure(x, fq_core, policy, columnwise=columnwise, scaler=scaler, quantized=q)
    fq = torch.full(x.shape, -7.0, dtype=torch.float32, device=x.device)
    got = measure_fused(x, policy, columnwise=columnwise, scaler=scaler, fq_out=fq)
    where = f"{policy.describe()} columnwise={columnwise} {x.dtype} {tuple(x.shape)}"
    same = (fq == fq_core) | (fq.isnan() & fq_core.isnan())
    assert bool(same.all()), (where, x[~same][:4], fq[~same][:4], fq_core[~same][:4])
    # counts (numel, nonzero, underflow, saturated) exactly; the float sums up to summation order
    assert torch.equal(ref.sums[:4], got.sums[:4]), (where, ref.sums[:4], got.sums[:4])
    torch.testing.assert_close(got.sums[4:], ref.sums[4:], rtol=2e-5, atol=0, equal_nan=True, msg=where)
    assert torch.equal(ref.amax, got.amax) and torch.equal(ref.min_nonzero, got.min_nonzero), where
    assert torch.equal(ref.scales[0].reshape(-1), got.scales[0].reshape(-1)), where
    a, b = ref.row(), got.row()
    assert a.keys() == b.keys() and a["numel"] == b["numel"] and a["underflow_pct"] == b["underflow_pct"], where
    assert a["saturation_pct"] == b["saturation_pct"] and a.get("scale_ratio") == b.get("scale_ratio"), where
    # block scales: min and median (from the exponent counts when they are powers of two) as torch gives them
    assert (a.get("scale_min"), a.get("scale_median")) == (b.get("scale_min"), b.get("scale_median")), (where, a, b)
    pow2 = policy.scaling is Scaling.MXFP8 or (policy.scaling is Scaling.BLOCKWISE and policy.pow2_scales)
    assert (got.scale_hist is not None) == pow2, where
    # rows() reads a packed buffer on the host: the same row as the device path (the core's numbers, above)
    assert (got.packed is not None) == (pow2 or policy.scaling in (Scaling.TENSORWISE, Scaling.DELAYED)), where
    assert same_row(dataclasses.replace(got, packed=None).row(), b), where
    two = measure_fused(x, policy, columnwise=columnwise, scaler=scaler).merge(
        measure_fused(x * 0.5, policy, columnwise=columnwise, scaler=scaler))  # micro-batches: counts add up
    q2 = quantize(x * 0.5, policy, columnwise=columnwise, scaler=scaler, record_amax=False)
    ref2 = measure(x, fq_core, policy, columnwise=columnwise, scaler=scaler, quantized=q).merge(
        measure(x * 0.5, dequantize(q2, torch.float32), policy, columnwise=columnwise, scaler=scaler, quantized=q2))
    assert two.packed is None, where  # merged: the device path
    a2, b2 = ref2.row(), two.row()
    together = stats_mod.rows([got, two, ref])  # packed and not, in one call
    assert all(same_row(r, want) for r, want in zip(together, (b, b2, a))), where
    assert (a2.get("scale_min"), a2.get("scale_median"), a2["underflow_pct"]) == \
        (b2.get("scale_min"), b2.get("scale_median"), b2["underflow_pct"]), (where, a2, b2)


def same_row(a: dict, b: dict) -> bool:
    """Equal rows, NaN equal to NaN."""
    return a.keys() == b.keys() and all(
        a[k] == b[k] or (isinstance(a[k], float) and isinstance(b[k], float) and math.isnan(a[k]) and math.isnan(b[k]))
        for k in a)


def check_all(device: str = "cpu", shapes=((40, 96), (33, 50)), dtypes=(torch.bfloat16, torch.float32)) -> int:
    """Every policy x layout x dtype x (finite, NaN/inf) x shape (whole and partial blocks); the count run."""
    n = 0
    for rows, cols in shapes:
        for dtype in dtypes:
            for special in (False, True):
                x = operand(rows, cols, dtype, special, device)
                for policy in POLICIES.values():
                    for columnwise in (False, True):
                        compare(x, policy, columnwise)
                        n += 1
    return n


@pytest.mark.timeout(600)
def test_fused_statistics_equal_the_numerics_core_in_the_triton_interpreter():
    pytest.importorskip("triton", reason="the fused statistics need Triton (a dependency of torch on Linux)")
    assert f"checked {2 * 2 * 2 * len(POLICIES) * 2}" in interpreted("test_fused_stats", "check_all")


def test_measure_without_a_copy_quantizes_like_the_core(monkeypatch):
    """fq_x None (the TE backend hands no FP8 copy): off the GPU the numerics core quantizes, and the statistics
    are those of the float32 dequantized copy (what the GEMM reads); delayed reads the scaler, recording nothing."""
    x = operand(24, 64, torch.bfloat16, special=False)
    for policy in POLICIES.values():
        scaler = DelayedScaler(policy) if policy.scaling is Scaling.DELAYED else None
        history = scaler.history.clone() if scaler else None
        q = quantize(x, policy, columnwise=True, scaler=scaler, record_amax=False)
        want = measure(x, dequantize(q, torch.float32), policy, columnwise=True, scaler=scaler).row()
        assert measure(x, None, policy, columnwise=True, scaler=scaler).row() == want, policy.describe()
        if scaler:
            assert torch.equal(scaler.history, history)


def test_the_fused_path_is_taken_on_cuda_or_in_the_interpreter_only(monkeypatch):
    x = torch.ones(4, 32)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not stats_mod.fused(x, POLICIES["tensorwise"])  # a CPU tensor: the numerics core
    monkeypatch.setattr(stats_mod, "FUSED", True)
    assert stats_mod.fused(x, POLICIES["tensorwise"]) == stats_mod._triton()
    odd = TensorPolicy(scaling=Scaling.BLOCKWISE, block=(1, 24))  # not a power of two: the core measures it
    assert not stats_mod.fused(x, odd) and not stats_mod.fused(torch.ones(0), POLICIES["tensorwise"])
    monkeypatch.setattr(stats_mod, "FUSED", False)
    assert not stats_mod.fused(x, POLICIES["tensorwise"])


if __name__ == "__main__":
    print("checked", check_all())


def test_a_failing_kernel_falls_back_to_the_core_once(monkeypatch, caplog):
    """A Triton that cannot compile or launch the kernel here must not fail training: the numerics core measures
    (same numbers), with one warning, and the kernel is not tried again in this process."""
    calls = []

    def broken(*a, **k):
        calls.append(1)
        raise RuntimeError("PTX .version 9.9 does not support .target sm_90a")

    monkeypatch.setattr(stats_mod, "FUSED", True)
    monkeypatch.setattr(stats_mod, "FUSED_ERROR", None)
    monkeypatch.setattr(stats_mod, "_triton", lambda: True)
    monkeypatch.setattr(stats_mod, "measure_fused", broken)
    x = operand(24, 64, torch.bfloat16, special=False)
    policy = POLICIES["blockwise-1x16"]
    q = quantize(x, policy, record_amax=False)
    want = measure(x, dequantize(q, torch.float32), policy).row()
    with caplog.at_level("WARNING"):
        assert measure(x, None, policy).row() == want and measure(x, None, policy).row() == want
    assert len(calls) == 1 and "sm_90a" in stats_mod.FUSED_ERROR
    assert sum("fused Triton kernel failed" in r.message for r in caplog.records) == 1
