"""The fused statistics kernel (observe/stats_kernels.py) compiled on the GPU, against the numerics core's
quantize + measure() at TE's shapes (gpt_125m's activations, weights and gradients) and at odd ones: FP8 values
bit for bit, counts, amax, scales exactly (the checks of tests/unit/test_fused_stats.py, which runs them in Triton's
CPU interpreter)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_fused_stats import POLICIES, check_all, compare, operand  # noqa: E402


def test_fused_statistics_equal_the_numerics_core_on_the_gpu():
    # BF16 at one TE shape: every kernel variant compiles once (~2 s each); odd shapes and float32 inputs are
    # checked in the interpreter (tests/unit) and by the block-shape cases below
    assert check_all("cuda", shapes=((768, 3072),), dtypes=(torch.bfloat16,)) == 2 * len(POLICIES) * 2


@pytest.mark.parametrize("block", [(1, 128), (128, 128), (256, 1)])
def test_te_block_shapes(block):
    from fp8_recipes.recipe.schema import Scaling, TensorPolicy

    for x in (operand(4096, 3072, torch.bfloat16, special=False, device="cuda", seed=3),
              operand(1000, 300, torch.float32, special=True, device="cuda", seed=4)):  # partial blocks
        for columnwise in (False, True):
            compare(x, TensorPolicy(scaling=Scaling.BLOCKWISE, block=block), columnwise)


def test_the_recorder_takes_the_fused_path_on_cuda(monkeypatch):
    from fp8_recipes.observe import stats as stats_mod

    calls = []
    real = stats_mod.measure_fused
    monkeypatch.setattr(stats_mod, "measure_fused", lambda *a, **k: calls.append(1) or real(*a, **k))
    x = operand(64, 256, torch.bfloat16, special=False, device="cuda")
    row = stats_mod.measure(x, None, POLICIES["tensorwise"]).row()
    assert calls and stats_mod.FUSED_ERROR is None  # the kernel ran (no fallback to the core)
    assert row["numel"] == x.numel() and 0.99 < row["cosine"] <= 1.0 + 1e-6


@pytest.mark.parametrize("name", ["tensorwise", "delayed-stale", "blockwise-128x128", "blockwise-16x16-no-pow2",
                                  "mxfp8-rceil"])
def test_direct_launches_equal_tritons_own(name):
    """stats_kernels.Launcher calls the compiled kernel itself once Triton has compiled it for a specialization:
    the same kernel on the same arguments as Triton's own launch, so the same numbers (float sums up to the order of
    the atomics), and the direct path is really taken."""
    from fp8_recipes.numerics import DelayedScaler
    from fp8_recipes.observe import stats_kernels as k
    from fp8_recipes.observe.stats import measure_fused

    policy = POLICIES[name]
    scaler = None
    if name.startswith("delayed"):
        scaler = DelayedScaler(policy, device="cuda")
        scaler.scale = torch.tensor(448.0 / 50.0, device="cuda")
    x = operand(1024, 768, torch.bfloat16, special=True, device="cuda", seed=5)
    launchers = (k.stats, k.amax)
    try:
        for launcher in launchers:
            launcher.direct = False
        own = measure_fused(x, policy, scaler=scaler)
        for launcher in launchers:
            launcher.direct = True
        measure_fused(x, policy, scaler=scaler)  # Triton's launch, remembered
        before = [launcher.direct_launches for launcher in launchers]
        direct = measure_fused(x, policy, scaler=scaler)
    finally:
        for launcher in launchers:
            launcher.direct = True
    assert k.stats.direct_launches == before[0] + 1
    assert k.amax.direct_launches == before[1] + (name == "tensorwise")
    assert torch.equal(own.sums[:4], direct.sums[:4])  # counts
    torch.testing.assert_close(direct.sums[4:], own.sums[4:], rtol=1e-9, atol=0, equal_nan=True)
    assert torch.equal(own.amax, direct.amax) and torch.equal(own.min_nonzero, direct.min_nonzero)
    assert all(torch.equal(a, b) for a, b in zip(own.scales, direct.scales))
    assert (own.scale_hist is None) == (direct.scale_hist is None)
    assert own.scale_hist is None or torch.equal(own.scale_hist, direct.scale_hist)
