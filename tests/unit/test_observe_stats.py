"""Numerics statistics on constructed tensors (known underflow, cosine, saturation, delayed scale gap), their
merging over micro-batches, and the `debug:` config's validation."""

from __future__ import annotations

import math

import pytest
import torch

from fp8_recipes.numerics import DelayedScaler, fake_quant, quantize
from fp8_recipes.observe.config import DebugConfig, debug_config
from fp8_recipes.observe.stats import measure
from fp8_recipes.recipe.schema import Format, MxRounding, RecipeError, Role, Scaling, TensorPolicy

TENSORWISE = TensorPolicy(scaling=Scaling.TENSORWISE)
DELAYED = TensorPolicy(scaling=Scaling.DELAYED, amax_history_len=4)


def stats(x: torch.Tensor, policy: TensorPolicy, scaler: DelayedScaler | None = None, fq=None) -> dict:
    if fq is None:
        fq = fake_quant(x, policy, scaler=scaler, record_amax=False)
    return measure(x, fq, policy, scaler=scaler).row()


def test_known_underflow_fraction():
    # amax 448 -> scale 1; E4M3's smallest subnormal is 2^-9, so 2^-11 rounds to 0 and 2^-9 survives
    x = torch.tensor([448.0, 1.0, 2.0**-11, -(2.0**-11), 2.0**-11, 2.0**-9, 0.0, 0.0])
    s = stats(x, TENSORWISE)
    assert s["underflow_pct"] == pytest.approx(100 * 3 / 6)  # 3 of the 6 non-zero values; zeros are not counted
    assert s["amax"] == 448.0 and s["min_nonzero"] == 2.0**-11 and s["scale"] == 1.0
    assert s["saturation_pct"] == 0.0 and s["numel"] == 8
    assert "scale_ratio" not in s  # only for delayed scaling


def test_known_cosine_and_mse():
    x = torch.tensor([3.0, 4.0])
    s = stats(x, TENSORWISE, fq=torch.tensor([4.0, 3.0]))  # any "dequantized" tensor: the math is checked
    assert s["cosine"] == pytest.approx(24 / 25) and s["mse"] == pytest.approx(1.0)
    exact = stats(torch.tensor([1.0, -2.0, 0.5]), TENSORWISE)  # these are E4M3 values: quantized exactly
    assert exact["cosine"] == pytest.approx(1.0) and exact["mse"] == 0.0 and exact["underflow_pct"] == 0.0


def test_zero_tensor():
    s = stats(torch.zeros(4, 8), TENSORWISE)
    assert s["cosine"] == 1.0 and s["min_nonzero"] is None and s["underflow_pct"] == 0.0 and s["amax"] == 0.0


def test_delayed_saturation_count_and_scale_gap():
    scaler = DelayedScaler(DELAYED)
    scaler.scale = torch.tensor(0.5)  # a stale scale: current scaling would pick 448 / 1000
    x = torch.tensor([1000.0, -950.0, 920.0, 448.0, 10.0, 0.0, 1.0, -2.0])
    s = stats(x, DELAYED, scaler)
    # clipped: |x| * 0.5 beyond 464 (448 + half an ulp) for 1000 and -950; 920 -> 460 rounds to 448 anyway
    assert s["saturation_pct"] == pytest.approx(100 * 2 / 8)
    assert s["scale"] == 0.5 and s["scale_ratio"] == pytest.approx(0.5 / (448.0 / 1000.0))
    assert scaler.history.sum() == 0  # statistics read the scaler, never record into it
    # a scale that fits: ratio 1, nothing saturated; inf saturates
    scaler.scale = torch.tensor(448.0 / 1000.0)
    s = stats(torch.tensor([1000.0, 1.0]), DELAYED, scaler)
    assert s["scale_ratio"] == pytest.approx(1.0) and s["saturation_pct"] == 0.0
    s = stats(torch.tensor([math.inf, 1.0, float("nan"), 2.0]), DELAYED, scaler)
    assert s["saturation_pct"] == 25.0 and s["scale_ratio"] is None


def test_tensorwise_and_rceil_never_saturate_but_mxfp8_floor_does():
    torch.manual_seed(0)
    for _ in range(20):  # the amax element may land a float32 ulp above 448: that is rounding, not clipping
        x = torch.randn(64, 64) * 3
        assert stats(x, TENSORWISE)["saturation_pct"] == 0.0
    rceil = TensorPolicy(scaling=Scaling.MXFP8, pow2_scales=True, block=(1, 32))
    floor = TensorPolicy(scaling=Scaling.MXFP8, pow2_scales=True, block=(1, 32), mx_rounding=MxRounding.FLOOR)
    block = torch.ones(2, 32)
    block[0, 0] = 1.9  # floor: scale 2^(8 - 0) = 256, 1.9 * 256 = 486 > 464: clipped; the 1.0s are not
    assert stats(block, rceil)["saturation_pct"] == 0.0
    assert stats(block, floor)["saturation_pct"] == pytest.approx(100 / 64)


def test_block_scales_are_quantize_scales():
    policy = TensorPolicy(scaling=Scaling.BLOCKWISE, block=(1, 16), pow2_scales=True)
    x = torch.randn(8, 64) * torch.logspace(-3, 2, 64)
    s = stats(x, policy)
    q = quantize(x, policy)
    assert s["scale_min"] == float(q.scale.min()) and s["scale_median"] == float(q.scale.median())
    assert "scale" not in s
    # columnwise (the dgrad/wgrad copies): the transposed blocks' scales
    qc = quantize(x, policy, columnwise=True)
    sc = measure(x, fake_quant(x, policy, columnwise=True), policy, columnwise=True).row()
    assert sc["scale_min"] == float(qc.scale.min())


def test_micro_batches_merge_into_the_whole_step():
    scaler = DelayedScaler(DELAYED)
    scaler.scale = torch.tensor(4.0)
    torch.manual_seed(0)
    a, b = torch.randn(16, 32) * 50, torch.randn(16, 32) * 1e-3
    parts = [measure(t, fake_quant(t, DELAYED, scaler=scaler, record_amax=False), DELAYED, scaler=scaler)
             for t in (a, b)]
    merged = parts[0].merge(parts[1]).row()
    whole = stats(torch.cat([a, b]), DELAYED, scaler)
    for k in ("numel", "amax", "min_nonzero", "underflow_pct", "saturation_pct", "scale", "scale_ratio"):
        assert merged[k] == pytest.approx(whole[k]), k
    assert merged["mse"] == pytest.approx(whole["mse"], rel=1e-5)
    assert merged["cosine"] == pytest.approx(whole["cosine"], rel=1e-6)


def test_bf16_operands():
    x = (torch.randn(32, 64) * 0.01).to(torch.bfloat16)
    policy = TensorPolicy(scaling=Scaling.TENSORWISE, format=Format.E5M2)
    s = stats(x, policy)
    assert 0.99 < s["cosine"] <= 1.0 and s["amax"] == float(x.float().abs().max())


# ---------------------------------------------------------------------------------------------------------------
# The `debug:` section


def test_debug_config_defaults_and_schedule():
    off = DebugConfig.from_dict(None)
    assert not off.enabled and not off.stats_due(1)
    cfg = DebugConfig.from_dict({"interval": 10, "start_step": 5, "end_step": 30, "tensors": "gradients",
                                 "layers": r"layers\.1\.", "dump": {"steps": [3, 1]}})
    assert [s for s in range(1, 50) if cfg.stats_due(s)] == [5, 15, 25]
    assert cfg.tensors == (Role.GRADIENTS,) and cfg.dump.steps == (1, 3) and cfg.dump_due(3)
    assert cfg.stats_module("decoder.layers.1.mlp.linear_fc1") and not cfg.stats_module("decoder.layers.11.x")
    assert cfg.dump_module("output_layer")  # dump.layers defaults to every module


def test_debug_config_errors_name_every_key():
    with pytest.raises(RecipeError) as e:
        DebugConfig.from_dict({"interval": -1, "layers": "(", "tensors": ["activation"], "start_step": 0,
                               "dump": {"stepz": [1], "steps": ["x"]}, "intervall": 3})
    text = str(e.value)
    for key in ("debug.interval:", "debug.layers:", "debug.tensors[0]:", "debug.start_step:", "debug.dump.stepz:",
                "debug.dump.steps[0]:", "debug.intervall: unknown key (did you mean 'interval'?)"):
        assert key in text, (key, text)
    assert "did you mean 'activations'" in text
    with pytest.raises(RecipeError, match=r"debug.end_step: 2 is before start_step 5"):
        DebugConfig.from_dict({"interval": 1, "start_step": 5, "end_step": 2})


def test_run_config_wins_over_the_recipe():
    cfg = debug_config({"interval": 5, "layers": "fc1", "dump": {"steps": [1], "layers": "qkv"}},
                       {"interval": 2, "dump": {"steps": [4]}})
    assert cfg.interval == 2 and cfg.layers == "fc1" and cfg.dump.steps == (4,) and cfg.dump.layers == "qkv"
    with pytest.raises(RecipeError, match=r"^recipe\.debug\.interval:"):
        debug_config({"interval": "often"}, None)


def test_validate_checks_a_recipes_debug_section(tmp_path, capsys):
    from fp8_recipes import cli

    path = tmp_path / "dbg.yaml"
    path.write_text("defaults: [tensorwise, _self_]\nname: dbg\ndebug: {interval: -2, layers: fc2}\n")
    assert cli.main(["validate", str(path)]) == 1
    err = capsys.readouterr().err
    assert f"{path}: debug.interval: -2 is out of range" in err and "layers" not in err


@pytest.mark.parametrize("policy", [
    TENSORWISE, DELAYED, TensorPolicy(scaling=Scaling.BLOCKWISE, block=(1, 16), pow2_scales=True),
    TensorPolicy(scaling=Scaling.BLOCKWISE, block=(16, 16)),
    TensorPolicy(scaling=Scaling.MXFP8, mx_rounding=MxRounding.FLOOR)], ids=str)
@pytest.mark.parametrize("columnwise", [False, True])
def test_the_backends_quantized_scales_give_the_same_statistics(policy, columnwise):
    """measure(quantized=q), the backends' path, reads q's scales and block maxima instead of deriving them:
    every statistic equals the derived one, saturation (OCP floor clips) included."""
    x = torch.randn(24, 64) * torch.logspace(-4, 3, 64)
    x[3, 5] = 0.0
    scaler = DelayedScaler(policy) if policy.scaling is Scaling.DELAYED else None
    if scaler is not None:
        scaler.observe(x.abs().amax() / 40)  # a stale scale: some values clip
        scaler.update()
    q = quantize(x, policy, columnwise=columnwise, scaler=scaler, record_amax=False)
    fq = fake_quant(x, policy, columnwise=columnwise, scaler=scaler, record_amax=False)
    derived = measure(x, fq, policy, columnwise=columnwise, scaler=scaler).row()
    given = measure(x, fq, policy, columnwise=columnwise, scaler=scaler, quantized=q).row()
    assert given == derived
    assert derived["saturation_pct"] > 0 or policy.scaling in (Scaling.TENSORWISE, Scaling.BLOCKWISE)


# ---------------------------------------------------------------------------------------------------------------
# The GPU's sync-free measure() and the one-transfer rows()


def _same(a, b) -> bool:
    """Row equality with NaN equal to NaN."""
    if a.keys() != b.keys():
        return False
    return all(x == y or (isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y))
               for x, y in ((a[k], b[k]) for k in a))


@pytest.mark.parametrize("policy", [
    TENSORWISE, DELAYED, TensorPolicy(scaling=Scaling.BLOCKWISE, block=(1, 16), pow2_scales=True),
    TensorPolicy(scaling=Scaling.BLOCKWISE, block=(16, 16)),
    TensorPolicy(scaling=Scaling.MXFP8, mx_rounding=MxRounding.FLOOR)], ids=str)
@pytest.mark.parametrize("nan", [False, True], ids=["finite", "nan"])
@pytest.mark.parametrize("given", [False, True], ids=["derived", "quantized"])
def test_sync_free_measure_equals_the_branchy_one(policy, nan, given):
    """The GPU path (no host check: NaN zeroed in |x|, clipped elements always counted), forced on the CPU, gives
    the CPU path's numbers exactly: NaN, inf, zeros, clipping (stale delayed scale, OCP floor) and blocks."""
    torch.manual_seed(1)
    x = torch.randn(24, 64) * torch.logspace(-4, 3, 64)
    x[3, 5] = x[7, :] = 0.0
    if nan:
        x[2, 9] = x[20, 60] = math.nan
        x[5, 1] = math.inf
    scaler = DelayedScaler(policy) if policy.scaling is Scaling.DELAYED else None
    if scaler is not None:
        scaler.observe(torch.nan_to_num(x, nan=0.0, posinf=0.0).abs().amax() / 40)  # stale: some values clip
        scaler.update()
    fq = fake_quant(x, policy, scaler=scaler, record_amax=False)
    q = quantize(x, policy, scaler=scaler, record_amax=False) if given else None
    branchy = measure(x, fq, policy, scaler=scaler, quantized=q, sync_free=False)
    free = measure(x, fq, policy, scaler=scaler, quantized=q, sync_free=True)
    assert torch.equal(branchy.sums.nan_to_num(nan=-1.0), free.sums.nan_to_num(nan=-1.0))
    assert torch.equal(branchy.amax, free.amax) and torch.equal(branchy.min_nonzero, free.min_nonzero)
    assert all(torch.equal(a, b) for a, b in zip(branchy.scales, free.scales))
    assert _same(branchy.row(), free.row())
    if policy.scaling is Scaling.DELAYED or policy.mx_rounding is MxRounding.FLOOR:
        assert free.row()["saturation_pct"] > 0
    if nan:
        assert free.row()["amax"] == math.inf  # NaN ignored, inf kept


def test_sync_free_switch_defaults_to_the_device(monkeypatch):
    from fp8_recipes.observe import stats as stats_mod

    x = torch.tensor([1.0, math.nan, 500.0])
    calls = []
    real_bool = torch.Tensor.__bool__
    monkeypatch.setattr(torch.Tensor, "__bool__", lambda t: calls.append(1) or real_bool(t))
    measure(x, fake_quant(x, TENSORWISE, record_amax=False), TENSORWISE)
    assert calls  # the CPU branches (a sync is free there)
    calls.clear()
    monkeypatch.setattr(stats_mod, "SYNC_FREE", True)
    measure(x, fake_quant(x, TENSORWISE, record_amax=False), TENSORWISE)
    assert not calls  # no host check at all: what a CUDA tensor gets


def test_rows_of_many_equal_each_row():
    """rows() gathers every operand's numbers into one transfer; each row is the one row() gives alone (per
    tensor, merged micro-batches, blocks, delayed scale_ratio, an all-zero tensor)."""
    from fp8_recipes.observe.stats import rows

    scaler = DelayedScaler(DELAYED)
    scaler.scale = torch.tensor(4.0)
    blocks = TensorPolicy(scaling=Scaling.BLOCKWISE, block=(1, 16))
    torch.manual_seed(2)
    a, b = torch.randn(16, 32) * 50, torch.randn(16, 32)
    items = [measure(a, fake_quant(a, TENSORWISE, record_amax=False), TENSORWISE),
             measure(a, fake_quant(a, DELAYED, scaler=scaler, record_amax=False), DELAYED, scaler=scaler),
             measure(b, fake_quant(b, blocks, record_amax=False), blocks),
             measure(torch.zeros(4, 16), torch.zeros(4, 16), blocks)]
    merged = measure(a, fake_quant(a, blocks, record_amax=False), blocks).merge(items[2].copy())
    per_tensor_merged = items[0].copy().merge(measure(b, fake_quant(b, TENSORWISE, record_amax=False), TENSORWISE))
    items += [merged, per_tensor_merged]
    singles = [s.row() for s in items]
    assert rows(items) == singles
    assert singles[1]["scale"] == 4.0 and singles[1]["scale_ratio"] is not None
    assert singles[3]["min_nonzero"] is None and {"scale_min", "scale_median"} <= set(singles[2])
    assert singles[4]["numel"] == 2 * 16 * 32


def test_debug_config_micro_batches():
    assert DebugConfig.from_dict(None).micro_batches == 1
    assert DebugConfig.from_dict({"interval": 1, "micro_batches": 0}).micro_batches == 0
    with pytest.raises(RecipeError, match=r"debug\.micro_batches: -1 is out of range"):
        DebugConfig.from_dict({"interval": 1, "micro_batches": -1})
    assert debug_config({"micro_batches": 3}, {"interval": 2}).micro_batches == 3
