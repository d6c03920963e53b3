"""The memory estimator's NVFP4 storage (fp8_recipes/plan/memory.py, `OperandStorage`): the `nvfp4` recipe and
per-role mixes against their FP8 counterparts, by byte counts worked out here by hand for a small model; what the
emulated backend holds; what the trainer refuses with NVFP4 weights."""

import dataclasses

import pytest

from fp8_recipes import cli
from fp8_recipes.plan.memory import (OperandStorage, estimate_memory, fp8_modules_of, fp8_weight_copy_bytes,
                                     operand_storage_of)
from fp8_recipes.plan.precision import ParallelLayout
from fp8_recipes.recipe.pack import load_recipe, load_recipe_dict
from fp8_recipes.recipe.schema import Recipe

# A Llama-style model, 4 layers: hidden 64, FFN 128 (SwiGLU), 4 heads in 2 KV groups (head dim 16). Per layer
# the linears hold qkv 128 x 64 + proj 64 x 64 + fc1 256 x 64 + fc2 64 x 128 = 36,864 parameters.
SMALL = {"num_layers": 4, "hidden_size": 64, "ffn_hidden_size": 128, "num_attention_heads": 4, "num_query_groups": 2,
         "vocab_size": 256, "normalization": "RMSNorm", "activation": "swiglu"}
H, FFN, QKV_OUT, LINEARS = 64, 128, 128, 36_864
TOKENS = 32  # micro-batch 1 x seq 32
BF16_LAYER = 2 * (2 * H + H + QKV_OUT + H) + 2 * (H + 2 * FFN + FFN)  # per token: residuals, norms, q/k/v, ...
QUANTIZED_INPUTS = H + H + FFN  # per token: the two norm outputs and fc2's input, kept only as the quantized copy
ATTENTION_OUT = H  # per token: the attention output, kept BF16 for the attention and copied for proj's wgrad
NVFP4 = 0.5 + 1 / 16  # bytes per element of one NVFP4 copy: two E2M1 codes a byte, one E4M3 scale per 16


def recipe(base: str, **changes) -> Recipe:
    """A pack recipe with the last 2 of the 4 layers BF16 (as `nvfp4` keeps them) and ``changes``."""
    return Recipe.from_dict({**load_recipe_dict(base), "layers": {"bf16_last": 2}, **changes})


def estimate(r: Recipe, layout: ParallelLayout | None = None, *, emulated: bool = False, **kwargs):
    """What `fp8-recipes memory --recipe` estimates for SMALL."""
    return estimate_memory(SMALL, layout or ParallelLayout(), micro_batch_size=1, seq_length=TOKENS, fp8=True,
                           fp8_param=r.fp8_param, fp8_modules=fp8_modules_of(r, SMALL),
                           storage=operand_storage_of(r, emulated=emulated), **kwargs)


def quantized_layer(copy_bytes: float) -> float:
    """One TE layer's activations per token with its linears' inputs kept as copies of ``copy_bytes`` each."""
    return BF16_LAYER - 2 * QUANTIZED_INPUTS + copy_bytes * (QUANTIZED_INPUTS + ATTENTION_OUT)


def test_weight_copies_per_parameter():
    assert fp8_weight_copy_bytes(load_recipe("nvfp4")) == 2 * (0.5 + 1 / 16)  # rowwise + columnwise, 16x16 too
    assert fp8_weight_copy_bytes(recipe("nvfp4", weights={"scaling": "nvfp4"})) == 1.125  # 1x16 blocks: the same


def test_nvfp4_recipe_against_fp8_by_the_bytes():
    nvfp4, fp8 = estimate(load_recipe("nvfp4")), estimate(recipe("tensorwise"))
    layers = 2  # layers 0 and 1 quantized, 2 and 3 BF16
    assert nvfp4.fp8_weights == NVFP4 * 2 * layers * LINEARS == 82_944
    assert fp8.fp8_weights == 2 * layers * LINEARS
    assert nvfp4.activations == TOKENS * (layers * quantized_layer(NVFP4) + 2 * BF16_LAYER) == 191_744
    assert fp8.activations == TOKENS * (layers * quantized_layer(1) + 2 * BF16_LAYER)
    # FP8 -> NVFP4: 7/8 B less per linear parameter, 7/16 B less per element of the 320 kept per token and layer
    assert fp8.total - nvfp4.total == 7 / 8 * layers * LINEARS + 7 / 16 * 320 * TOKENS * layers == 73_472
    for part in ("weights", "grads", "optimizer", "logits"):
        assert getattr(nvfp4, part) == getattr(fp8, part), part


def test_mixed_recipes_counted_per_role():
    fp8 = estimate(recipe("tensorwise"))
    nvfp4_weights = recipe("tensorwise", weights={"scaling": "nvfp4", "block": [16, 16]})
    w = estimate(nvfp4_weights)
    assert fp8.fp8_weights - w.fp8_weights == (2 - 1.125) * 2 * LINEARS and w.activations == fp8.activations
    nvfp4_activations = recipe("tensorwise", activations={"scaling": "nvfp4"})
    a = estimate(nvfp4_activations)
    assert a.fp8_weights == fp8.fp8_weights
    assert fp8.activations - a.activations == (1 - NVFP4) * (QUANTIZED_INPUTS + ATTENTION_OUT) * TOKENS * 2 == 8_960
    # a mix TE cannot run says so; an all-NVFP4 or all-FP8 recipe has no note
    assert "Transformer Engine runs no recipe mixing NVFP4" in operand_storage_of(nvfp4_weights).note
    assert operand_storage_of(load_recipe("nvfp4")).note == operand_storage_of(recipe("tensorwise")).note == ""
    assert operand_storage_of(nvfp4_weights).label == "NVFP4 + FP8"


def test_the_emulated_backend_holds_dequantized_copies():
    r = load_recipe("nvfp4")
    bf16 = estimate_memory(SMALL, ParallelLayout(), micro_batch_size=1, seq_length=TOKENS, fp8=False)
    emulated = estimate(r, emulated=True)
    # no cached copies; each forward saves its 16x16 weights dequantized (BF16) for dgrad; activations: the inputs
    # in BF16 (NVFP4's 1x16 / RHT'd copies are made again in the backward, not kept)
    assert emulated.fp8_weights == 2 * 2 * LINEARS and emulated.activations == bf16.activations == 4 * 32 * 1_664
    # per micro-batch in flight: stage 0 of 2 holds layers 0 and 1 for 2 micro-batches
    assert estimate(r, ParallelLayout(pp=2), emulated=True).fp8_weights == 2 * 2 * 2 * LINEARS
    assert estimate(r, emulated=True, recompute="full").fp8_weights == 2 * LINEARS  # the one layer recomputed
    one_by_16 = dataclasses.replace(r, weights=dataclasses.replace(r.weights, block=(1, 16)))
    assert estimate(one_by_16, emulated=True).fp8_weights == 0  # dgrad quantizes w along out_features itself
    # per-tensor FP8 weights: fprop's copy serves dgrad whatever the shape (one scale reads the same both ways:
    # the backend's reusable), so every linear of the 2 quantized layers keeps its BF16 copy
    assert estimate(recipe("tensorwise"), emulated=True).fp8_weights == 2 * 2 * LINEARS
    assert isinstance(operand_storage_of(r, emulated=True), OperandStorage)


def test_nvfp4_moe_pads_expert_rows_to_32():
    moe = {**SMALL, "num_moe_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 32, "moe_layer_freq": 2}
    r = recipe("nvfp4", layers={"bf16_last": 0})
    e = estimate_memory(moe, ParallelLayout(ep=2, dp=2), micro_batch_size=1, seq_length=TOKENS, fp8=True,
                        fp8_modules=fp8_modules_of(r, moe), storage=operand_storage_of(r))
    row = 2 * (H + 2 * 32 + 32) - (2 - NVFP4) * (H + 32)  # fc1's and fc2's inputs kept as NVFP4 copies
    rows = TOKENS * 2 + 2 * 32  # top-2 rows, each of the 2 local experts padded by up to 32 (get_fp4_align_size)
    assert dict(e.experts)["activations"] == 2 * rows * row
    assert dict(e.experts)["fp8_weights"] == 1.125 * 2 * 2 * (64 * 64 + 32 * 64)  # 2 layers x 2 local experts


def test_what_the_trainer_refuses_with_nvfp4_weights(tmp_path, capsys):
    stored = recipe("nvfp4", fp8_param=True)
    with pytest.raises(ValueError, match=r"^fp8_param: true with weights.scaling: nvfp4: .*set fp8_param: false$"):
        estimate(stored)
    with pytest.raises(ValueError, match=r"^fp8_param: true needs the te backend"):
        estimate(recipe("tensorwise", fp8_param=True), emulated=True)
    path = tmp_path / "nvfp4_stored.yaml"
    path.write_text("defaults: [nvfp4, _self_]\nname: nvfp4_stored\nfp8_param: true\n")
    assert cli.main(["memory", "llama3-8b", "--layout", "dp=8", "--recipe", str(path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: fp8_param: true with weights.scaling: nvfp4")


def test_memory_command_says_which_storage_it_counts(capsys):
    assert cli.main(["memory", "llama3-8b", "--layout", "dp=8", "--recipe", "nvfp4"]) == 0
    assert "NVFP4 (recipe nvfp4; NVFP4 as Transformer Engine stores it on sm_100+" in capsys.readouterr().out
    assert cli.main(["memory", "llama3-8b", "--layout", "dp=8", "--recipe", "nvfp4", "--emulated"]) == 0
    assert "as the emulated backend holds it: dequantized BF16 copies" in capsys.readouterr().out
    assert cli.main(["memory", "llama3-8b", "--emulated"]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: memory: --emulated estimates a recipe's run on the emulated backend; give --recipe NAME"]


def test_scale_md_quotes_the_estimator():
    from pathlib import Path

    from fp8_recipes.plan.memory import LLAMA3, estimate_stages

    r = load_recipe("nvfp4")
    totals = []
    for emulated in (False, True):
        stages = estimate_stages(LLAMA3["llama3-8b"], ParallelLayout(dp=8), micro_batch_size=1, seq_length=8192,
                                 fp8=True, fp8_modules=fp8_modules_of(r, LLAMA3["llama3-8b"]),
                                 storage=operand_storage_of(r, emulated=emulated))
        totals.append(round(stages[0].total_gib))
    text = " ".join((Path(__file__).resolve().parents[2] / "docs" / "scale.md").read_text().split())
    assert f"Llama 3 8B at DP=8: {totals[1]} GiB against TE's {totals[0]}" in text
