"""bench/profile.py's kernel categories, on kernel names of a measured profile (2 Mixtral layers, delayed scaling,
one H100, 2026-12-07: docs/bench/h100_2026-12-07_mixtral2l/bench_mixtral2l_te_clone_profile.json)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fp8_recipes.bench.profile import categorize, format_profile, timeline

PROFILE = Path(__file__).resolve().parents[2] / "docs" / "bench" / "h100_2026-12-07_mixtral2l" / \
    "bench_mixtral2l_te_clone_profile.json"


@pytest.mark.parametrize("name, category", [
    ("nvjet_sm90_qrsss_128x160_128x5_2x1_v_badd_coopA_algo2_TNT", "gemm fp8"),  # E4M3 x E5M2: dgrad / wgrad
    ("nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_TNT", "gemm bf16"),
    ("void transformer_engine::(anonymous namespace)::multi_cast_transpose_kernel<4, 8, true, float, __nv_bfloat16, "
     "__nv_fp8_e5m2>", "fp8 quantize/amax/transpose"),
    ("cast_transpose_optimized_kernel(__nv_bfloat16 const*, float const*, __nv_fp8_e4m3*",
     "fp8 quantize/amax/transpose"),
    # the gradient clipping's scale of every fp32 gradient: TE's multi-tensor kernel, the same in BF16 and FP8
    ("void multi_tensor_apply_kernel<TensorListMetadata<2, false>, transformer_engine::multi_tensor_scale::"
     "ScaleFunctor<float, float>, float>", "optimizer"),
    ("void multi_tensor_apply_kernel<TensorListMetadata<4, false>, transformer_engine::multi_tensor_adam::AdamFuncto",
     "optimizer"),
    ("triton_poi_fused__to_copy_add_cat_mul_rsub_sigmoid_silu_split_0", "activation / elementwise"),
    ("Memcpy DtoD (Device -> Device)", "other"),
])
def test_kernels_fall_in_their_category(name, category):
    assert categorize(name) == category


def test_a_bf16_step_has_no_fp8_kernels():
    """The measured BF16 rows of that profile: no kernel lands in an FP8 category (the clipping's scale did, before
    the optimizer's pattern came first)."""
    rows = json.loads(PROFILE.read_text())["rows"]
    bf16 = [r for r in rows if r["config"].startswith("bf16") and r.get("profile")]
    assert bf16
    for row in bf16:
        assert not [k for k in row["profile"]["kernels"] if categorize(k).startswith(("fp8", "gemm fp8"))]


def test_the_printed_profile_names_what_each_category_is_made_of():
    """Each category's largest kernels under it (the 32 ms of "other" in the graphed step were TE's gradient clones,
    Memcpy DtoD, which the overall top list showed only by luck), by the categories as they are sorted now."""
    rows = json.loads(PROFILE.read_text())["rows"]
    prof = next(r["profile"] for r in rows if r["config"] == "delayed+capacity+graphs")
    text = format_profile("2-layer delayed+capacity+graphs", prof).splitlines()
    assert text[0] == "2-layer delayed+capacity+graphs: 425.2 ms of GPU kernels per step"
    other = next(i for i, line in enumerate(text) if line.startswith("  other "))
    assert "Memcpy DtoD" in text[other + 1] and text[other + 1].strip().startswith("32.07 ms")
    quantize = next(i for i, line in enumerate(text) if line.startswith("  fp8 quantize/amax/transpose "))
    assert all("cast_transpose" in line for line in text[quantize + 1:quantize + 4])
    assert text[quantize].split()[-3:] == ["22.3", "ms", "5.2%"]  # (saved as 31.6 ms: the clipping's scale in it)


def test_the_timeline_tells_idle_from_concurrent():
    """busy is the union of the GPU's intervals: a gap is the GPU waiting on the host, an overlap two streams at
    once; both per step."""
    spans = [(0.0, 1000.0), (500.0, 1500.0), (1500.0, 2000.0), (3000.0, 4000.0)]  # microseconds, 2 steps
    assert timeline(spans, 2) == {"span_ms": 2.0, "busy_ms": 1.5}  # 4 ms window, 3 ms busy, 1 ms idle
    assert timeline(list(reversed(spans)), 1) == {"span_ms": 4.0, "busy_ms": 3.0}
    assert timeline([], 2) == {}
    prof = {"total_ms": 3.5 / 2, "categories": {"gemm bf16": 1.75}, "top": [],
            "kernels": {"nvjet_sm90_tst": 1.75}, **timeline(spans, 2)}
    assert format_profile("x", prof).splitlines()[1] == (
        "  GPU busy 1.5 of 2.0 ms per step: idle 0.5 ms (waiting on the host), 0.2 ms of kernels beside others "
        "(other streams)")
    saved = json.loads(PROFILE.read_text())["rows"][-1]["profile"]  # (before the timeline: no such line)
    assert "GPU busy" not in format_profile("x", saved)


def test_profiled_configs_read_side_by_side_in_a_table_and_a_plot(tmp_path):
    """--profile's configs in one table (a line per config: the step's GPU span, idle time, ms per category in the
    categories' order) and a stacked plot beside bench_train.png, from the measured 4-layer Mixtral profile (H100,
    2026-12-07): BF16's GEMMs against FP8's, the optimizer alike in both, raw Megatron-Core's clones in "other"."""
    from fp8_recipes.bench.profile import profile_parts, profile_table
    from fp8_recipes.bench.train import plot

    saved = PROFILE.parents[1] / "h100_2026-12-07_mixtral4l" / "bench_mixtral4l.json"
    result = json.loads(saved.read_text())
    profiled, parts = profile_parts(result["rows"])
    assert len(profiled) == 8 and list(parts)[:2] == ["gemm fp8", "gemm bf16"] and list(parts)[-1] == "other"
    lines = {line.split(" | ")[1]: line for line in profile_table(result["rows"]).splitlines()[2:]}
    header = profile_table(result["rows"]).splitlines()[0]
    assert header.startswith("| model | config | step (GPU span) | GPU idle | gemm fp8 | gemm bf16 | attention |")
    assert lines["bf16+capacity+graphs+grads16+moments16"].startswith(
        "| mixtral_8x7b_4l | bf16+capacity+graphs+grads16+moments16 | 728.0 | 11.1 | 0.0 | 624.6 | 40.1 |")
    bf16, fp8 = ({cat: ms[i] for cat, ms in parts.items()} for i in (0, 2))  # (bf16, delayed+head)
    assert profiled[2]["config"] == "delayed+capacity+graphs+head+grads16+moments16"
    assert abs(bf16["optimizer"] - fp8["optimizer"]) < 1 and fp8["gemm fp8"] < 0.6 * bf16["gemm bf16"]
    assert parts["other"][3] > 60  # (delayed:raw: TE's weight-gradient clones, 64 ms of Memcpy DtoD)
    assert profile_table([{"model": "m", "config": "bf16", "tokens_per_s": 1.0}]) is None
    plot(result, tmp_path / "bench_train.png")
    assert (tmp_path / "bench_train.png").stat().st_size and (tmp_path / "bench_train_profile.png").stat().st_size
