"""Recipe.from_dict: defaults, the accepted spellings (bare strings, the NeMo blog form), round trips, and a corpus
of broken recipes whose errors must name the dotted key and the bad value, one line per problem.
"""

from __future__ import annotations

import dataclasses
import math
import re
import traceback
from pathlib import Path

import pytest
import yaml

from fp8_recipes.recipe.pack import load_recipe, recipe_names
from fp8_recipes.recipe.schema import (
    ROLES, AmaxAlgo, AmaxReduction, Backend, Format, LayerRules, MxRounding, Recipe, RecipeError, Role, Scaling,
    Schedule, TensorPolicy, default_policy,
)

BROKEN = Path(__file__).parent / "broken_recipes"

HYBRID_YAML = """\
name: hybrid
description: MXFP8 weights, 1x128-block activations, per-tensor current-scaled gradients
backend: auto
weights:     {scaling: mxfp8,      format: e4m3}
activations: {scaling: blockwise,  format: e4m3, block: [1, 128]}
gradients:   {scaling: tensorwise, format: e5m2}
schedule:
  bf16_warmup_steps: 0
  enable: {weights: 0, activations: 0, gradients: 0}
  full_precision_eval_interval: 0
layers:
  bf16_first: 0
  bf16_last: 0
  bf16_modules: []
amax_reduction: data_tensor
"""

HYBRID_LONG = {
    "name": "hybrid",
    "weights": {"scaling": "mxfp8"},
    "activations": {"scaling": "blockwise", "block": [1, 128]},
    "gradients": {"scaling": "tensorwise"},
}
HYBRID_BLOG = {"fp8_recipe": {"name": "hybrid", "weights": "mxfp8", "activations": "blockwise",
                              "gradients": "tensorwise", "block_size": [1, 128]}}


# ---------------------------------------------------------------------------------------------------------------
# Defaults


def test_every_default():
    r = Recipe.from_dict({})
    assert r.name == "unnamed" and r.description == ""
    assert r.backend is Backend.AUTO
    assert r.amax_reduction is AmaxReduction.DATA_TENSOR  # Megatron-Core + TE's amax reduction group
    assert r.schedule == Schedule() and r.schedule.bf16_warmup_steps == 0
    assert (r.schedule.enable.weights, r.schedule.enable.activations, r.schedule.enable.gradients) == (0, 0, 0)
    assert r.schedule.full_precision_eval_interval == 0
    assert r.layers == LayerRules(bf16_first=0, bf16_last=0, bf16_modules=(), fp8_output_layer=False)
    expected_format = {Role.WEIGHTS: Format.E4M3, Role.ACTIVATIONS: Format.E4M3, Role.GRADIENTS: Format.E5M2}
    expected_block = {Role.WEIGHTS: (128, 128), Role.ACTIVATIONS: (1, 128), Role.GRADIENTS: (1, 128)}
    for role in Role:
        p = r.policy(role)
        assert p.scaling is Scaling.NONE and not p.is_fp8
        assert p.format is expected_format[role]
        assert p.margin == 0
        assert p.amax_history_len == 1024
        assert p.amax_compute_algo is AmaxAlgo.MAX
        assert p.percentile == 99.9
        assert p.amax_epsilon == 0.0
        assert p.pow2_scales is False
        assert p.block == expected_block[role]
        assert p.mx_rounding is MxRounding.RCEIL
        assert p.rht is False and p.stochastic_rounding is False
    assert not r.is_fp8
    assert Recipe.from_dict(None) == r


def test_dataclass_defaults_agree_with_the_reader():
    # Recipe() in code and an empty YAML mean the same recipe (apart from the name the reader gives)
    assert Recipe() == dataclasses.replace(Recipe.from_dict({}), name="bf16")
    assert Recipe(name="bf16", description=load_recipe("bf16").description) == load_recipe("bf16")


@pytest.mark.parametrize("scaling,pow2", [("tensorwise", False), ("delayed", False), ("blockwise", True),
                                          ("mxfp8", True)])
def test_pow2_default_per_scaling(scaling, pow2):
    r = Recipe.from_dict({"weights": scaling})
    assert r.weights.pow2_scales is pow2
    if scaling == "mxfp8":  # E8M0 scales are powers of two by construction: the setting does not apply
        with pytest.raises(ValueError, match=r"weights\.pow2_scales"):
            Recipe.from_dict({"weights": {"scaling": scaling, "pow2_scales": not pow2}})
    else:
        assert Recipe.from_dict({"weights": {"scaling": scaling, "pow2_scales": not pow2}}).weights.pow2_scales \
            is (not pow2)


def test_role_as_bare_string():
    for s in Scaling:
        assert Recipe.from_dict({"activations": str(s)}) == Recipe.from_dict({"activations": {"scaling": str(s)}})
    assert Recipe.from_dict({"weights": "MXFP8"}).weights.scaling is Scaling.MXFP8
    assert Recipe.from_dict({"gradients": "tensorwise"}).gradients.format is Format.E5M2


def test_schedule_enable_shorthand_and_integral_floats():
    r = Recipe.from_dict({"weights": "tensorwise", "activations": "tensorwise", "gradients": "tensorwise",
                          "schedule": {"enable": 100}})
    assert (r.schedule.enable.weights, r.schedule.enable.activations, r.schedule.enable.gradients) == (100,) * 3
    assert Recipe.from_dict({"weights": {"scaling": "tensorwise", "margin": 2.0}}).weights.margin == 2
    assert Recipe.from_dict({"weights": "tensorwise", "schedule": {"enable": {"weights": 5}}}).schedule.role_start(
        "weights") == 5


# ---------------------------------------------------------------------------------------------------------------
# The NeMo blog form and the full YAML form


def test_nemo_blog_form_equals_long_form():
    blog = Recipe.from_dict(HYBRID_BLOG)
    assert blog == Recipe.from_dict(HYBRID_LONG)
    assert blog == dataclasses.replace(load_recipe("hybrid"), description="")
    assert blog.weights.scaling is Scaling.MXFP8 and blog.weights.block == (1, 32)
    assert blog.activations.block == (1, 128) and blog.gradients.scaling is Scaling.TENSORWISE


def test_nemo_blog_block_size_only_sets_blockwise_roles():
    blog = Recipe.from_dict({"fp8_recipe": {"name": "b", "weights": "blockwise", "activations": "blockwise",
                                            "gradients": "tensorwise", "block_size": [128, 128]}})
    long = Recipe.from_dict({"name": "b", "weights": "blockwise",
                             "activations": {"scaling": "blockwise", "block": [128, 128]}, "gradients": "tensorwise"})
    assert blog.weights.block == blog.activations.block == (128, 128)
    assert blog == long


def test_nemo_blog_form_beside_matching_top_level_keys():
    r = Recipe.from_dict({"name": "hybrid", **HYBRID_BLOG})
    assert r == Recipe.from_dict(HYBRID_BLOG)
    r = Recipe.from_dict({"description": "d", "backend": "emulated", **HYBRID_BLOG})
    assert r.description == "d" and r.backend is Backend.EMULATED


def test_full_hybrid_yaml_equals_pack_hybrid(tmp_path):
    path = tmp_path / "my_hybrid.yaml"
    path.write_text(HYBRID_YAML)
    assert load_recipe(path) == load_recipe("hybrid")
    assert Recipe.from_dict(yaml.safe_load(HYBRID_YAML)) == load_recipe("hybrid")


# ---------------------------------------------------------------------------------------------------------------
# to_dict round trips


ROUND_TRIP_EXTRA = [
    {"name": "d", "weights": {"scaling": "delayed", "amax_history_len": 16, "amax_compute_algo": "percentile",
                              "percentile": 99.0, "margin": 1, "pow2_scales": True},
     "gradients": {"scaling": "delayed", "amax_compute_algo": "most_recent"}, "amax_reduction": "tensor"},
    {"name": "t", "backend": "emulated", "weights": {"scaling": "tensorwise", "amax_epsilon": 1e-6, "margin": 3},
     "layers": {"bf16_first": 2, "bf16_modules": ["*.linear_qkv"], "fp8_output_layer": True},
     "schedule": {"bf16_warmup_steps": 10, "enable": {"weights": 20}, "full_precision_eval_interval": 50}},
    {"name": "m", "weights": {"scaling": "mxfp8", "mx_rounding": "floor", "format": "e5m2"},
     "activations": {"scaling": "blockwise", "block": [4, 64], "pow2_scales": False}},
]


@pytest.mark.parametrize("recipe", [load_recipe(n) for n in recipe_names()]
                         + [Recipe.from_dict(d) for d in ROUND_TRIP_EXTRA], ids=lambda r: r.name)
def test_to_dict_round_trip(recipe):
    d = recipe.to_dict()
    assert Recipe.from_dict(d) == recipe
    assert Recipe.from_dict(yaml.safe_load(yaml.safe_dump(d))) == recipe  # plain YAML-able data
    assert set(d["weights"]) == set(recipe.weights.relevant_fields())


# ---------------------------------------------------------------------------------------------------------------
# Errors


def test_all_problems_reported_at_once():
    with pytest.raises(RecipeError) as e:
        Recipe.from_dict({"weights": {"scaling": "tensorwize", "margin": -1}, "backend": "gpu", "colour": 1})
    err = e.value
    assert isinstance(err, ValueError)
    keys = [p.split(":", 1)[0] for p in err.problems]
    assert sorted(keys) == sorted(["colour", "weights.scaling", "weights.margin", "backend"])
    assert str(err).splitlines() == err.problems


def test_value_hints_are_for_values_not_keys():
    with pytest.raises(RecipeError, match=r"did you mean 'tensorwise'"):
        Recipe.from_dict({"weights": "per_tensor"})
    with pytest.raises(RecipeError, match=r"did you mean 'none'"):
        Recipe.from_dict({"weights": "bf16"})
    with pytest.raises(RecipeError) as e:
        Recipe.from_dict({"fp8_recipe": {"block": [1, 128]}})
    assert "did you mean 'block_size'" in str(e.value)


def test_error_source_prefix():
    with pytest.raises(RecipeError) as e:
        Recipe.from_dict({"backend": "x"}, source="my.yaml")
    assert str(e.value).startswith("my.yaml: backend: 'x'")
    assert e.value.source == "my.yaml"


def broken_cases():
    cases = []
    for path in sorted(BROKEN.glob("*.yaml")):
        head = {}
        for line in path.read_text().splitlines():
            m = re.match(r"#\s*(expect|value|problems):\s*(.*)$", line)
            if not m:
                break
            head[m.group(1)] = m.group(2).strip()
        cases.append(pytest.param(path, head, id=path.stem))
    return cases


def test_broken_corpus_is_complete():
    cases = broken_cases()
    assert len(cases) >= 30
    for case in cases:
        path, head = case.values
        assert re.fullmatch(r"\d\d_[a-z0-9_]+", path.stem), path.name
        assert "expect" in head, f"{path.name} must start with '# expect: <dotted.key>'"
        assert path.read_text().startswith("# expect: ")


@pytest.mark.parametrize("path,head", broken_cases())
def test_broken_recipe(path, head):
    with pytest.raises(RecipeError) as e:
        load_recipe(path)
    err = e.value
    msg = str(err)
    assert isinstance(err, ValueError)
    lines = msg.splitlines()
    assert len(lines) == len(err.problems) == int(head.get("problems", 1)), msg
    assert all(line.startswith(f"{path}: ") for line in lines), msg  # every line says which file
    assert f"{head['expect']}:" in lines[0], msg
    if "value" in head:
        assert head["value"] in lines[0], msg
    assert "Traceback" not in msg
    # nothing chained behind it: a CLI printing the error shows no parser internals
    assert err.__cause__ is None and (err.__context__ is None or err.__suppress_context__)
    assert "".join(traceback.format_exception_only(err)).count("\n") == len(lines)


def test_broken_values_rejected_by_from_dict_too():
    # the same checks apply to mappings (Hydra's cfg.recipe), without a file
    for bad in ({"weights": {"scaling": "delayed", "percentile": 101, "amax_compute_algo": "percentile"}},
                {"layers": {"bf16_modules": False}}, {"weights": {"scaling": "blockwise", "block": [True, 128]}},
                {"activations": {"scaling": "tensorwise", "amax_epsilon": math.nan}}):
        with pytest.raises(RecipeError):
            Recipe.from_dict(bad)


@pytest.mark.parametrize("value", ["data_tensor", "DATA_TENSOR", "data", "tensor", "none"])
def test_amax_reduction_values(value):
    r = Recipe.from_dict({"weights": "delayed", "amax_reduction": value})
    assert r.amax_reduction is AmaxReduction(value.lower()) and r.amax_reduction == value.lower()
    assert r.to_dict()["amax_reduction"] == value.lower() and Recipe.from_dict(r.to_dict()) == r


def test_amax_reduction_misspelt_names_the_choices():
    with pytest.raises(RecipeError) as e:
        Recipe.from_dict({"amax_reduction": "data-tensor"})
    assert str(e.value) == ("amax_reduction: 'data-tensor' is not one of data_tensor | data | tensor | none "
                            "(did you mean 'data_tensor'?)")


def test_mxfp8_block_1x32_is_allowed():
    assert Recipe.from_dict({"weights": {"scaling": "mxfp8", "block": [1, 32]}}).weights.block == (1, 32)


def test_tensor_policy_describe():
    assert TensorPolicy().describe() == "bf16"
    r = load_recipe("hybrid")
    assert r.weights.describe() == "mxfp8 e4m3 1x32 e8m0/rceil"
    assert r.activations.describe() == "blockwise e4m3 1x128 pow2"
    assert load_recipe("delayed").gradients.describe() == "delayed e5m2 hist 1024 max"


def test_nvfp4_defaults_and_describe():
    r = Recipe.from_dict({"weights": "nvfp4", "activations": "nvfp4", "gradients": "nvfp4"})
    for role in Role:  # E2M1 codes in 1x16 blocks for every role (the paper's 16x16 weights: the nvfp4 preset)
        p = r.policy(role)
        assert (p.scaling, p.format, p.block, p.rht, p.stochastic_rounding) == \
            (Scaling.NVFP4, Format.E2M1, (1, 16), False, False)
        assert p.describe() == "nvfp4 e2m1 1x16" and p.is_fp8
    full = Recipe.from_dict({"weights": {"scaling": "nvfp4", "block": [16, 16]},
                             "activations": {"scaling": "nvfp4", "rht": True},
                             "gradients": {"scaling": "nvfp4", "rht": True, "stochastic_rounding": True}})
    assert [full.policy(x).describe() for x in Role] == ["nvfp4 e2m1 16x16", "nvfp4 e2m1 1x16 rht",
                                                         "nvfp4 e2m1 1x16 rht sr"]
    assert full.gradients.to_dict() == {"scaling": "nvfp4", "format": "e2m1", "block": [1, 16], "rht": True,
                                        "stochastic_rounding": True}
    assert Recipe.from_dict(full.to_dict()) == full
    # NVFP4 beside FP8 roles, and settings of a BF16 role kept
    mixed = Recipe.from_dict({"weights": "nvfp4", "activations": "blockwise",
                              "gradients": {"scaling": "none", "format": "e2m1"}})
    assert mixed.activations.format is Format.E4M3 and mixed.gradients.format is Format.E2M1


def test_nvfp4_problems_are_one_line_each_naming_the_key():
    with pytest.raises(RecipeError) as e:
        Recipe.from_dict({"weights": {"scaling": "nvfp4", "rht": True, "margin": 1},
                          "activations": {"scaling": "nvfp4", "block": [16, 16], "stochastic_rounding": True},
                          "gradients": {"scaling": "mxfp8", "format": "e2m1"}})
    assert [line.split(":")[0] for line in str(e.value).splitlines()] == [
        "weights.margin", "weights.rht", "activations.block", "activations.stochastic_rounding", "gradients.format"]
    assert all(("remove it" in line or "use [1, 16]" in line or "set scaling: nvfp4" in line)
               for line in str(e.value).splitlines()), str(e.value)


def test_attention_key():
    assert Recipe().attention == "bf16" and Recipe.from_dict({}).to_dict()["attention"] == "bf16"
    r = Recipe.from_dict({"weights": "delayed", "activations": "delayed", "gradients": "tensorwise",
                          "attention": "FP8"})
    assert r.attention == "fp8" and Recipe.from_dict(r.to_dict()) == r
    for bad, says in (({"weights": "blockwise", "activations": "blockwise", "gradients": "blockwise"},
                       "activations.scaling is blockwise"),
                      ({"weights": "tensorwise", "activations": "tensorwise"}, "gradients.scaling is none")):
        with pytest.raises(RecipeError) as e:
            Recipe.from_dict({**bad, "attention": "fp8"})
        assert str(e.value).startswith("attention: 'fp8' quantizes") and says in str(e.value)
        assert str(e.value).endswith("set attention: bf16") and "\n" not in str(e.value)


def test_fp8_param_key():
    assert Recipe().fp8_param is False and Recipe.from_dict({}).to_dict()["fp8_param"] is False
    r = Recipe.from_dict({"weights": "tensorwise", "activations": "tensorwise", "gradients": "tensorwise",
                          "fp8_param": True})
    assert r.fp8_param is True and Recipe.from_dict(r.to_dict()) == r
    fp8 = {"weights": "delayed", "activations": "delayed", "gradients": "delayed", "fp8_param": True}
    for bad, key, says in (
            ({"fp8_param": "yes"}, "fp8_param", "'yes' is not a boolean"),
            ({"activations": "tensorwise", "fp8_param": True}, "fp8_param", "weights.scaling is none"),
            ({**fp8, "schedule": {"bf16_warmup_steps": 10}}, "schedule.bf16_warmup_steps", "a BF16 warmup"),
            ({**fp8, "schedule": {"enable": {"gradients": 5}}}, "schedule.enable.gradients", "a later stage")):
        with pytest.raises(RecipeError) as e:
            Recipe.from_dict(bad)
        assert str(e.value).startswith(f"{key}: ") and says in str(e.value) and "\n" not in str(e.value)
        assert str(e.value).endswith("fp8_param: false") or "boolean" in says


def test_the_readers_defaults_are_the_dataclasses():
    """Each default is written once, in the dataclasses: a recipe that says nothing reads as Recipe(), and a role
    that names only its scaling gets the role's default policy with that scaling."""
    assert Recipe.from_dict({"name": "bf16"}) == Recipe()
    for role in ROLES:
        for scaling in ("delayed", "tensorwise"):
            read = Recipe.from_dict({str(role): scaling}).policy(role)
            assert read == dataclasses.replace(default_policy(role), scaling=Scaling(scaling))


@pytest.mark.parametrize("fields", [
    {"scaling": "tensorwise"}, {"scaling": "delayed"}, {"scaling": "mxfp8"}, {"scaling": "blockwise"},
    {"scaling": "blockwise", "block": (128, 128)}, {"scaling": "nvfp4", "block": (1, 16)},
    {"scaling": "nvfp4", "block": (16, 16)}, {"scaling": "nvfp4", "block": (16, 16), "rht": True},
    {"scaling": "nvfp4", "block": (16, 16), "stochastic_rounding": True}, {"scaling": "none"}])
def test_one_copy_both_ways_is_the_quantizers_block_rule(fields):
    """The torch-free rule (the memory estimator's and the emulated backend's) against the quantizer's blocks: the
    same block rowwise and columnwise at any shape, and neither the RHT nor stochastic rounding."""
    from fp8_recipes.numerics import block_for

    p = TensorPolicy(**{**fields, "scaling": Scaling(fields["scaling"])})
    same = p.is_fp8 and all(block_for(p, s) == block_for(p, s, columnwise=True) for s in ((4096, 768), (96, 96)))
    assert p.one_copy_both_ways == (same and not p.rht and not p.stochastic_rounding), p.describe()


@pytest.mark.parametrize("change, says", [
    ({"activations": {"scaling": "nvfp4", "rht": None}}, "activations.rht: null is not a boolean"),
    ({"weights": {"scaling": "mxfp8", "pow2_scales": True}}, "weights.pow2_scales: true does not apply"),
    ({"weights": {"scaling": "delayed", "margin": [1, None, False]}}, "weights.margin: [1, null, false] is not an"),
    ({"weights": {"scaling": "delayed", "margin": {"a": True}}}, "weights.margin: {'a': true} is not an integer"),
    ({"weights": {"scaling": "delayed", "margin": "2"}}, "weights.margin: '2' is not an integer"),
])
def test_values_are_written_as_yaml_in_error_lines(change, says):
    """Recipe errors wrote values as Python prints them (`rht: None`, `pow2_scales: True`); a recipe is YAML."""
    with pytest.raises(RecipeError) as e:
        Recipe.from_dict({"name": "x", **change})
    assert [p for p in e.value.problems if p.startswith(says)], e.value.problems


def test_one_mistake_is_one_problem():
    """A key that does not apply is said so, not range-checked too; rules that read another key's value are not
    run on a bad key's default (the RHT pair, percentile without its algorithm, a module turning FP8 a role the
    recipe keeps BF16); several bad module patterns are each reported."""
    from fp8_recipes.recipe.pack import load_recipe_dict

    nvfp4, delayed = load_recipe_dict("nvfp4"), load_recipe_dict("delayed")
    for base, change, says in (
            (nvfp4, {"weights": {**nvfp4["weights"], "amax_epsilon": -1}}, "weights.amax_epsilon: -1 does not apply"),
            (nvfp4, {"activations": {**nvfp4["activations"], "rht": None}}, "activations.rht: null is not"),
            (delayed, {"weights": {"scaling": "delayed", "amax_compute_algo": "percentil", "percentile": 99.9}},
             "weights.amax_compute_algo: 'percentil' is not one of"),
            (delayed, {"gradients": {"scaling": "tensorwyse"}, "modules": {"*fc1": {"gradients": "tensorwise"}}},
             "gradients.scaling: 'tensorwyse' is not one of")):
        with pytest.raises(RecipeError) as e:
            Recipe.from_dict({**base, **change})
        assert len(e.value.problems) == 1 and e.value.problems[0].startswith(says), e.value.problems
    with pytest.raises(RecipeError) as e:
        Recipe.from_dict({**delayed, "modules": {1: {"weights": "none"}, 2: {"weights": "none"}}})
    assert [p.split(":")[0] for p in e.value.problems] == ["modules.1", "modules.2"]
