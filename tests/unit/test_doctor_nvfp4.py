"""The doctor on NVFP4 roles (observe/doctor_nvfp4.py): NVFP4 limits, and remedies that touch only what is broken:
the last layers BF16, the RHT where it is off, FP8 for the one role that fails; each written recipe validates."""

from __future__ import annotations

import torch

from fp8_recipes.numerics import dequantize, quantize
from fp8_recipes.observe.doctor import Diagnosis, RunData
from fp8_recipes.observe.doctor_findings import find_problems
from fp8_recipes.observe.doctor_remedies import propose
from fp8_recipes.observe.doctor_report import patched_recipe
from fp8_recipes.observe.stats import measure
from fp8_recipes.recipe.pack import load_recipe
from fp8_recipes.recipe.schema import Recipe, Scaling

LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
OPERANDS = (("fprop", "activations"), ("fprop", "weights"), ("dgrad", "gradients"), ("dgrad", "weights"),
            ("wgrad", "gradients"), ("wgrad", "activations"))


def nvfp4_row(step: int, module: str, gemm: str, role: str, policy: str) -> dict:
    """What the paper's recipe records on the tiny CPU model (docs/nvfp4.md)."""
    return {"step": step, "module": module, "gemm": gemm, "role": role, "policy": policy, "numel": 65536,
            "amax": 4.0, "min_nonzero": 1e-7, "underflow_pct": 9.0, "saturation_pct": 0.01, "mse": 1e-3,
            "cosine": 0.991, "block_underflow_pct": 0.2, "block_saturation_pct": 0.0, "scale_min": 0.0,
            "scale_median": 200.0}


def numerics(recipe: Recipe, layers: int = 2, poison=None) -> list[dict]:
    rows = []
    for step in range(2, 17, 2):
        for layer in range(layers):
            for linear in LINEARS:
                for gemm, role in OPERANDS:
                    row = nvfp4_row(step, f"decoder.layers.{layer}.{linear}", gemm, role,
                                    recipe.policy(role).describe())
                    if poison is not None:
                        poison(row)
                    rows.append(row)
    return rows


def no_rht() -> Recipe:
    d = load_recipe("nvfp4").to_dict()
    d["activations"]["rht"] = d["gradients"]["rht"] = False
    return Recipe.from_dict(d)


def applied(recipe: Recipe, proposals) -> Recipe:
    d = Diagnosis(RunData(path=None, train=[], numerics=[], recipe=recipe, summary={}), "worse_than_baseline", "",
                  proposals=proposals)
    return Recipe.from_dict(patched_recipe(d))  # validated: every proposal keeps the recipe valid


def test_a_healthy_nvfp4_run_has_no_finding_but_the_same_numbers_under_fp8_would():
    recipe = load_recipe("nvfp4")
    assert find_problems(numerics(recipe)) == []  # 9 % flushed, cosine 0.991: healthy for E2M1
    as_fp8 = [{**r, "policy": "tensorwise e4m3"} for r in numerics(recipe)]
    assert {f.kind for f in find_problems(as_fp8)} == {"underflow_pct"}  # FP8's 1 % limit


def test_wgrad_flush_without_the_rht_turns_it_on_for_both_operands():
    recipe = no_rht()

    def poison(row):  # tokens of very different scales: the wgrad copies (blocks along the tokens) flush
        if row["gemm"] == "wgrad" and row["role"] == "activations":
            row["underflow_pct"] = 92.0
    rows = numerics(recipe, poison=poison)
    findings = find_problems(rows)
    assert {(f.role, f.gemm, f.kind) for f in findings} == {("activations", "wgrad", "underflow_pct")}
    assert "flushed to zero 92.00%" in findings[0].text
    proposals = propose(findings, recipe, rows)
    assert proposals[0].changes == {"activations.rht": True, "gradients.rht": True} and not proposals[0].alternative
    assert all(p.alternative for p in proposals[1:])  # mxfp8, blockwise, BF16 for the activations: alternatives
    assert any(p.changes.get("activations.scaling") == "mxfp8" for p in proposals)
    fixed = applied(recipe, proposals)
    assert fixed.activations.rht and fixed.gradients.rht and fixed.gradients.stochastic_rounding
    assert fixed.weights == recipe.weights and fixed.layers == recipe.layers  # nothing else changed


def test_fprop_block_underflow_gets_fp8_for_that_role_only():
    recipe = load_recipe("nvfp4")  # the RHT on: activations leaving nvfp4 take the gradients' RHT off with them

    def poison(row):  # outlier features: the tensor's amax 2^20 above most blocks', their E4M3 scales flush to 0
        if row["role"] == "activations" and row["gemm"] == "fprop":
            row.update(underflow_pct=85.0, block_underflow_pct=80.0, cosine=0.9996)
    rows = numerics(recipe, poison=poison)
    kinds = {f.kind for f in find_problems(rows)}
    assert kinds == {"underflow_pct", "block_underflow_pct"}
    proposals = propose(find_problems(rows), recipe, rows)
    first = [p for p in proposals if not p.alternative]
    assert len(first) == 1 and first[0].changes["activations.scaling"] == "mxfp8"
    assert "8 of 8 activations linears" in first[0].reason
    fixed = applied(recipe, proposals)
    assert fixed.activations.scaling is Scaling.MXFP8 and fixed.activations.format == "e4m3"
    assert fixed.gradients.scaling is Scaling.NVFP4 and fixed.gradients.stochastic_rounding
    assert not fixed.gradients.rht  # (the schema refuses the RHT on one wgrad operand)
    assert fixed.weights == recipe.weights and fixed.layers == recipe.layers
    assert any(p.alternative and p.changes.get("activations.scaling") == "blockwise" for p in proposals)


def test_trouble_in_the_last_quantized_layer_keeps_one_more_layer_bf16():
    recipe = load_recipe("nvfp4")  # bf16_last 2: on a 4-layer model layers 0 and 1 are recorded

    def poison(row):
        if row["module"].startswith("decoder.layers.1.") and row["role"] == "gradients":
            row.update(cosine=0.95, underflow_pct=55.0)
    rows = numerics(recipe, poison=poison)
    proposals = propose(find_problems(rows), recipe, rows)
    assert [p.changes for p in proposals] == [{"layers.bf16_last": 3}]
    assert "last 1 quantized layer" in proposals[0].reason
    assert applied(recipe, proposals).layers.bf16_last == 3


def test_one_bad_module_gets_bf16_for_it_alone():
    recipe = load_recipe("nvfp4")

    def poison(row):
        if row["module"] == "decoder.layers.0.mlp.linear_fc1" and row["role"] == "gradients":
            row["block_saturation_pct"] = 3.0
    rows = numerics(recipe, layers=4, poison=poison)
    proposals = propose(find_problems(rows), recipe, rows)
    assert [p.changes for p in proposals] == [{"layers.bf16_modules": ["decoder.layers.0.mlp.linear_fc1"]}]


def test_gradients_flushed_without_stochastic_rounding_list_it_as_an_alternative():
    d = load_recipe("nvfp4").to_dict()
    d["gradients"]["stochastic_rounding"] = False
    recipe = Recipe.from_dict(d)

    def poison(row):
        if row["role"] == "gradients" and row["gemm"] == "dgrad":
            row["underflow_pct"] = 70.0
    rows = numerics(recipe, poison=poison)
    proposals = propose(find_problems(rows), recipe, rows)
    sr = [p for p in proposals if p.changes == {"gradients.stochastic_rounding": True}]
    assert len(sr) == 1 and sr[0].alternative
    assert proposals[0].changes["gradients.scaling"] == "mxfp8"  # dgrad: not the RHT's GEMM


def test_the_rht_remedy_lowers_the_measured_flush_share():
    """The wgrad copy of activations whose tokens span many binades, measured, diagnosed, patched, measured again."""
    torch.manual_seed(0)
    x = torch.randn(512, 64) * torch.exp2(torch.randint(-12, 1, (512, 1)).float())
    recipe = no_rht()

    def rows_of(r: Recipe) -> list[dict]:
        p = r.activations
        q = quantize(x, p, columnwise=True)
        s = measure(x, dequantize(q), p, columnwise=True, quantized=q).row()
        rows = numerics(r)
        for row in rows:
            if row["role"] == "activations" and row["gemm"] == "wgrad":
                row.update(s)
        return rows
    before = rows_of(recipe)
    flushed = before[-1]["underflow_pct"]
    assert flushed >= 40.0
    fixed = applied(recipe, propose(find_problems(before), recipe, before))
    after = rows_of(fixed)
    assert after[-1]["underflow_pct"] < flushed / 2 and find_problems(after) == []
