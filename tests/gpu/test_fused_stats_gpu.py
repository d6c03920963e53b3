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
    from fp8_recipes.schema import Scaling, TensorPolicy

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
