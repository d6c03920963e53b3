"""Numerics statistics of NVFP4 operands (observe/stats_nvfp4.py): known counts on constructed tensors, and every
statistic against an independent float64 computation from the reference quantizer of tests/unit/test_nvfp4.py."""

from __future__ import annotations

import math

import pytest
import torch

from fp8_recipes.numerics import dequantize, quantize
from fp8_recipes.observe.recorder import _on_host
from fp8_recipes.observe.stats import STAT_KEYS, measure, rows
from fp8_recipes.recipe.schema import Format, Scaling, TensorPolicy
from test_nvfp4 import ref_quantize, ref_rht

NVFP4 = TensorPolicy(scaling=Scaling.NVFP4, format=Format.E2M1, block=(1, 16))


def nvfp4(block=(1, 16), rht=False, sr=False) -> TensorPolicy:
    return TensorPolicy(scaling=Scaling.NVFP4, format=Format.E2M1, block=block, rht=rht, stochastic_rounding=sr)


def row_of(x: torch.Tensor, policy: TensorPolicy, columnwise: bool = False) -> dict:
    q = quantize(x, policy, columnwise=columnwise, seed=7 if policy.stochastic_rounding else None)
    return measure(x, dequantize(q), policy, columnwise=columnwise, quantized=q).row()


def test_known_flush_and_block_underflow():
    x = torch.zeros(2, 16)
    x[0, :5] = torch.tensor([6.0, 0.2, 0.3, -0.1, 1.0])  # S_enc 448, block scale 448: multiplier 1
    x[1] = 1e-6  # block scale 1e-6 * 448 / 6 = 7.5e-5, below 2^-10: flushed to 0 with its 16 values
    s = row_of(x, NVFP4)
    # 0.2 and -0.1 are below 0.25 (half E2M1's smallest code, 0.5): 2 + 16 of the 21 non-zero values read 0
    assert s["underflow_pct"] == pytest.approx(100 * 18 / 21)
    assert s["block_underflow_pct"] == pytest.approx(50.0)  # 1 of the 2 non-zero blocks
    assert s["block_saturation_pct"] == 0.0 and s["saturation_pct"] == 0.0
    assert s["amax"] == 6.0 and s["min_nonzero"] == pytest.approx(1e-6) and s["numel"] == 32
    assert s["scale_min"] == 0.0 and set(s) <= set(STAT_KEYS)


def test_known_block_saturation_with_an_inf():
    x = torch.zeros(2, 16)
    x[0, :2] = torch.tensor([math.inf, 1.0])
    x[1, :3] = torch.tensor([6000.0, 3000.0, 100.0])  # amax inf: S_enc 1, scales amax / 6 clamped at 448
    s = row_of(x, NVFP4)
    assert s["block_saturation_pct"] == 100.0  # inf / 6 and 1000 are beyond 464
    # clipped at ±6: inf and 6000 / 448 = 13.4 (beyond 7); 3000 / 448 = 6.7 rounds to 6 anyway
    assert s["saturation_pct"] == pytest.approx(100 * 2 / 32)
    assert s["block_underflow_pct"] == 0.0


def independent_row(x: torch.Tensor, block, columnwise: bool, rht: bool) -> dict:
    """The statistics from test_nvfp4's float64 reference quantizer, computed here in float64."""
    ref = ref_quantize(x, block, columnwise, rht)
    v = x.reshape(-1, x.shape[-1]).double()
    deq = ref["deq"].reshape(v.shape).double()
    if columnwise:
        v, deq = v.T, deq.T
        v = ref_rht(v, x.dtype) if rht else v
    scale_val = ref["scales"].view(torch.float8_e4m3fn).double()
    r, c = v.shape
    padded = torch.zeros(r, -(-c // 16) * 16, dtype=torch.float64)
    padded[:, :c] = v.abs()
    if block[0] == 1:
        bamax = padded.reshape(r, -1, 16).amax(-1)
    else:
        pr = -(-r // 16) * 16
        tiles = torch.zeros(pr, padded.shape[1], dtype=torch.float64)
        tiles[:r] = padded
        bamax = tiles.reshape(pr // 16, 16, -1, 16).amax(dim=(1, 3)).repeat_interleave(16, 0)[:r]
    nonzero = v != 0
    return {"underflow_pct": 100 * float((nonzero & (deq == 0)).sum() / nonzero.sum()),
            "mse": float(((deq - v) ** 2).mean()),
            "cosine": float((v * deq).sum() / (v.norm() * deq.norm())),
            "amax": float(v.abs().max()),
            "block_underflow_pct": 100 * float(((bamax > 0) & (scale_val == 0)).sum() / (bamax > 0).sum())}


@pytest.mark.parametrize("block,columnwise,rht", [((1, 16), False, False), ((1, 16), True, False),
                                                  ((1, 16), True, True), ((16, 16), False, False),
                                                  ((16, 16), True, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_statistics_match_an_independent_computation(block, columnwise, rht, dtype):
    torch.manual_seed(0)
    # values 2^-6 .. 2^2 apart: many flushed; tokens 16-31 2^-24 below the rest: their blocks' scales flush to 0
    scales = torch.randint(-6, 3, (64, 40)).float()
    scales[16:32] -= 24
    x = (torch.randn(64, 40) * torch.exp2(scales)).to(dtype)
    policy = nvfp4(block, rht)
    want = independent_row(x, block, columnwise, rht)
    assert 5 < want["underflow_pct"] < 95 and want["block_underflow_pct"] > 1  # the case has both
    q = quantize(x, policy, columnwise=columnwise)
    handed = measure(x, dequantize(q), policy, columnwise=columnwise, quantized=q).row()
    alone = measure(x, None, policy, columnwise=columnwise).row()  # the recorder quantizes
    reused = measure(x, dequantize(q), policy, columnwise=columnwise).row()  # a reused copy: scales again
    for got in (handed, alone, reused):
        # (alone: the recorder's own copy reads codes x scales in float32, as TE's GEMM; the reference's is in x's
        # dtype, as the emulated backend's: a bf16 rounding apart)
        rel = 1e-4 if got is not alone or dtype is torch.float32 else 1e-2
        assert got["underflow_pct"] == pytest.approx(want["underflow_pct"])
        assert got["block_underflow_pct"] == pytest.approx(want["block_underflow_pct"])
        assert got["amax"] == pytest.approx(want["amax"], rel=1e-6)
        assert got["mse"] == pytest.approx(want["mse"], rel=rel)
        assert got["cosine"] == pytest.approx(want["cosine"], abs=rel / 100)
        assert got["block_saturation_pct"] == 0.0


def test_rht_statistics_are_of_the_rotated_copy():
    torch.manual_seed(1)
    x = torch.randn(32, 48) * torch.exp(3 * torch.randn(32, 1))  # tokens of very different scales
    plain, rotated = row_of(x, nvfp4(), columnwise=True), row_of(x, nvfp4(rht=True), columnwise=True)
    # the RHT spreads each 16-token block's largest values: fewer of the others flushed
    assert rotated["underflow_pct"] < plain["underflow_pct"] / 2
    assert rotated["amax"] != plain["amax"]  # the rotated copy's global amax, from which S_enc comes
    assert rotated["cosine"] > 0.98


def test_stochastic_rounding_copies_are_measured_as_rounded():
    torch.manual_seed(2)
    x = torch.randn(64, 64)
    policy = nvfp4(sr=True)
    q = quantize(x, policy, seed=3)
    fq = dequantize(q)
    s = measure(x, fq, policy, quantized=q).row()
    want = independent_row(x, (1, 16), False, False)  # round-to-nearest: another set of codes, similar error
    flushed = 100 * float(((x != 0) & (fq == 0)).sum() / (x != 0).sum())
    assert s["underflow_pct"] == pytest.approx(flushed) and s["mse"] > want["mse"]


def test_micro_batches_merge_and_rows_mix_fp8_and_nvfp4():
    torch.manual_seed(3)
    a, b = torch.randn(32, 32), torch.randn(16, 32) * 1e-3
    ma, mb = (measure(t, None, NVFP4) for t in (a, b))
    merged = ma.copy().merge(mb).row()
    whole = [ma.row(), mb.row()]
    assert merged["numel"] == 32 * 32 + 16 * 32
    nz = [32 * 32, 16 * 32]  # (randn has no zeros)
    assert merged["underflow_pct"] == pytest.approx(sum(r["underflow_pct"] * n for r, n in zip(whole, nz)) / sum(nz))
    fp8 = measure(a, None, TensorPolicy(scaling=Scaling.TENSORWISE))
    together = rows([fp8, ma, mb])
    assert together == [fp8.row(), ma.row(), mb.row()] and "block_underflow_pct" not in together[0]
    assert rows(_on_host([fp8, ma, mb])) == together  # (how the shards of a TP group travel)


def test_an_rht_copy_is_rotated_once_and_measured_the_same(monkeypatch):
    """quantize keeps the rotated copy it quantized; the statistics read it instead of rotating x again."""
    import dataclasses

    from fp8_recipes.numerics.nvfp4 import nvfp4_copy_2d
    from fp8_recipes.observe import stats_nvfp4

    torch.manual_seed(4)
    x = torch.randn(64, 48, dtype=torch.bfloat16) * torch.exp(2 * torch.randn(64, 1)).bfloat16()
    policy = nvfp4(rht=True)
    q = quantize(x, policy, columnwise=True)
    assert torch.equal(q.rotated, nvfp4_copy_2d(x, columnwise=True, rht=True))
    assert quantize(x, policy).rotated is None  # the rowwise copy is never rotated
    again = measure(x, dequantize(q), policy, columnwise=True, quantized=dataclasses.replace(q, rotated=None)).row()
    calls = []
    monkeypatch.setattr(stats_nvfp4, "nvfp4_copy", lambda *a: calls.append(a))
    assert measure(x, dequantize(q), policy, columnwise=True, quantized=q).row() == again and not calls


def test_the_recorders_own_draws_differ_per_step_and_match_its_dump(tmp_path):
    """A backend that keeps its NVFP4 copies (TE) hands over none: the recorder's stochastic rounding draws one
    seed per step, operand and micro-batch (never seed 0 at every step), the same for the statistics and the dump."""
    from fp8_recipes.observe.config import DebugConfig
    from fp8_recipes.observe.recorder import NumericsRecorder

    from fp8_recipes.observe.recorder import load_dump

    rec = NumericsRecorder(DebugConfig.from_dict({"interval": 1, "dump": {"steps": [1]}}), tmp_path,
                           tensorboard=False)
    key = ("decoder.layers.0.mlp.linear_fc1", "wgrad", "gradients")
    seeds = {}
    for step in (1, 2):
        rec.step = step
        for index in (1, 2):
            rec._count[key] = index
            seeds[step, index] = rec._draws(key)
    assert len(set(seeds.values())) == 4
    rec.step, rec._count[key] = 1, 1
    assert rec._draws(key) == seeds[1, 1]  # deterministic: a resumed run measures the same
    policy = nvfp4(sr=True)
    x = torch.randn(64, 64)
    kept = measure(x, None, policy, columnwise=True, seed=seeds[1, 1]).row()
    assert kept == row_of_seed(x, policy, seeds[1, 1]) != row_of_seed(x, policy, seeds[2, 1])
    rec._dump(key, x, policy, True, None, None)  # (what _observe does for a dumped operand)
    dumped = load_dump(tmp_path / "dumps" / "step_1" / f"{key[0]}.wgrad.gradients.0.pt")
    assert torch.equal(dumped["dequantized"], dequantize(quantize(x, policy, columnwise=True, seed=seeds[1, 1])))


def row_of_seed(x, policy, seed):
    q = quantize(x, policy, columnwise=True, seed=seed)
    return measure(x, dequantize(q), policy, columnwise=True, quantized=q).row()
