"""The recipe pack in recipes/: every recipe loads, composes through Hydra to the same Recipe, says what it promises,
and states only what differs from its base.
"""

from __future__ import annotations

import copy
import fnmatch
import re
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf import OmegaConf

from fp8_recipes.recipe.pack import conf_dir, load_recipe, load_recipe_dict, recipe_names, recipes_dir
from fp8_recipes.recipe.schema import AmaxAlgo, Format, Recipe, RecipeError, Role, Scaling

PACK = recipe_names()
EXPECTED_PACK = {"bf16", "blockwise", "delayed", "fast", "hybrid", "moe_blockwise", "moe_delayed", "mxfp8", "nvfp4",
                 "safe", "tensorwise"}
TRAIN_GROUPS = re.compile(r"\b(model|data|trainer)/")


def compose_recipe(name: str, overrides: tuple[str, ...] = (), config_dir: Path | None = None):
    """Compose `+recipe=NAME` the way scripts/train.py does; without train.yaml's groups when they are missing."""
    ovr = [f"+recipe={name}", *overrides]
    with initialize_config_dir(config_dir=str(config_dir or conf_dir()), version_base="1.3"):
        if config_dir is None:
            try:
                return compose("train", overrides=ovr)
            except MissingConfigException as e:
                if not TRAIN_GROUPS.search(str(e)):
                    raise
        return compose(config_name=None, overrides=ovr)


def recipe_from_cfg(cfg) -> Recipe:
    return Recipe.from_dict(OmegaConf.to_container(cfg.recipe, resolve=True))


# ---------------------------------------------------------------------------------------------------------------
# Loading and composing


def test_pack_contents():
    assert set(PACK) == EXPECTED_PACK
    assert (conf_dir() / "recipe").resolve() == recipes_dir().resolve()  # the Hydra group is the pack


@pytest.mark.parametrize("name", PACK)
def test_recipe_loads_and_validates(name):
    r = load_recipe(name)
    assert isinstance(r, Recipe)
    assert r.name == name, "a recipe's name is its file name"
    assert r.description.strip()
    assert r.is_fp8 is (name != "bf16")
    assert load_recipe(recipes_dir() / f"{name}.yaml") == r
    assert Recipe.from_dict(r.to_dict()) == r


def test_train_config_composes_with_a_recipe():
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        try:
            cfg = compose("train", overrides=["+recipe=tensorwise"])
        except MissingConfigException as e:
            if TRAIN_GROUPS.search(str(e)):
                pytest.skip(f"conf/train.yaml's groups are not all there yet: {str(e).splitlines()[0]}")
            raise
    assert recipe_from_cfg(cfg) == load_recipe("tensorwise")


@pytest.mark.parametrize("name", PACK)
def test_hydra_composition_equals_load_recipe(name):
    cfg = compose_recipe(name)
    data = OmegaConf.to_container(cfg.recipe, resolve=True)
    assert "defaults" not in data
    assert data == load_recipe_dict(name)  # our defaults-list resolver agrees with Hydra's, key for key
    assert Recipe.from_dict(data) == load_recipe(name)
    assert load_recipe(cfg.recipe) == load_recipe(name)  # load_recipe takes Hydra's mapping too


def test_hydra_override_reaches_the_recipe():
    base = load_recipe("tensorwise")
    # a key the recipe file sets: a plain override
    r = recipe_from_cfg(compose_recipe("tensorwise", ("recipe.weights.scaling=delayed",)))
    assert r.weights.scaling is Scaling.DELAYED and r.activations == base.activations
    # a key left at its default: Hydra wants `+` (recipes state only differences, and there is no schema in the
    # ConfigStore for Hydra to know the key)
    for op in ("+", "++"):
        r = recipe_from_cfg(compose_recipe("tensorwise", (f"{op}recipe.weights.margin=2",)))
        assert r.weights.margin == 2 and r.activations == base.activations and r.gradients == base.gradients
    r = recipe_from_cfg(compose_recipe("safe", ("recipe.schedule.enable.gradients=500",
                                                "+recipe.layers.fp8_output_layer=true")))
    assert r.schedule.enable.gradients == 500 and r.layers.fp8_output_layer is True


def test_plain_override_of_an_unstated_key_tells_the_fix():
    # Hydra's rule for keys a config does not state: add them with + (or ++); its message says so.
    with pytest.raises(ConfigCompositionException) as e:
        compose_recipe("tensorwise", ("recipe.weights.margin=2",))
    assert "+recipe.weights.margin=2" in str(e.value) + str(e.value.__cause__)


def test_bad_override_is_a_recipe_error():
    cfg = compose_recipe("tensorwise", ("recipe.weights.scaling=tensorwize",))
    with pytest.raises(ValueError, match=r"weights\.scaling: 'tensorwize'.*did you mean 'tensorwise'"):
        recipe_from_cfg(cfg)


def test_a_recipe_path_that_is_no_file_says_what_it_is(tmp_path):
    """A directory (or a device) given as the recipe was reported as a file that does not exist."""
    for path, says in ((tmp_path, f"'{tmp_path}' is a directory, not a YAML file"),
                       (Path("/dev/null"), "'/dev/null' is not a regular file"),
                       (tmp_path / "no.yaml", f"file '{tmp_path / 'no.yaml'}' does not exist")):
        with pytest.raises(RecipeError) as e:
            load_recipe(str(path))
        assert str(e.value).startswith(f"recipe: {says}; give a recipe name (bf16, "), str(e.value)


def test_defaults_resolver_agrees_with_hydra_on_a_private_pack(tmp_path):
    """Multi-level inheritance, `_self_` first and last, nested merge, lists replaced: ours == Hydra's."""
    group = tmp_path / "recipe"
    group.mkdir()
    files = {
        "base": {"name": "base", "weights": {"scaling": "tensorwise", "margin": 1}, "activations": "tensorwise",
                 "layers": {"bf16_modules": ["*.linear_qkv", "output_layer"], "bf16_first": 2}},
        "mid": {"defaults": ["base", "_self_"], "name": "mid", "weights": {"format": "e5m2"},
                "layers": {"bf16_modules": ["output_layer"]}, "schedule": {"bf16_warmup_steps": 5}},
        "top": {"defaults": ["_self_", "mid"], "name": "top", "weights": {"margin": 3, "scaling": "delayed"},
                "gradients": {"scaling": "tensorwise"}},
    }
    for stem, data in files.items():
        (group / f"{stem}.yaml").write_text(yaml.safe_dump(data))
    for stem in files:
        ours = load_recipe_dict(group / f"{stem}.yaml")
        hydra = OmegaConf.to_container(compose_recipe(stem, config_dir=tmp_path).recipe, resolve=True)
        assert ours == hydra, stem
    top = load_recipe(group / "top.yaml")
    assert top.name == "mid"  # `_self_` first: the defaults after it win
    assert top.weights.scaling is Scaling.TENSORWISE and top.weights.margin == 1 and top.weights.format is Format.E5M2
    assert top.layers.bf16_modules == ("output_layer",) and top.layers.bf16_first == 2
    assert top.gradients.scaling is Scaling.TENSORWISE


# ---------------------------------------------------------------------------------------------------------------
# What each recipe promises


def test_delayed_facts():
    r = load_recipe("delayed")
    for role in Role:
        p = r.policy(role)
        assert p.scaling is Scaling.DELAYED
        assert p.amax_history_len == 1024 and p.amax_compute_algo is AmaxAlgo.MAX and p.margin == 0
    assert r.weights.format is r.activations.format is Format.E4M3
    assert r.gradients.format is Format.E5M2


def test_blockwise_facts():
    r = load_recipe("blockwise")
    assert all(r.policy(role).scaling is Scaling.BLOCKWISE and r.policy(role).pow2_scales for role in Role)
    assert r.weights.block == (128, 128)
    assert r.activations.block == r.gradients.block == (1, 128)
    assert all(r.policy(role).format is Format.E4M3 for role in Role)


def test_mxfp8_facts():
    r = load_recipe("mxfp8")
    for role in Role:
        p = r.policy(role)
        assert p.scaling is Scaling.MXFP8 and p.format is Format.E4M3 and p.block == (1, 32)


def test_nvfp4_facts():  # NVIDIA's NVFP4 paper (arXiv 2509.25149), as issue 29 sums it up
    r = load_recipe("nvfp4")
    assert all(r.policy(role).scaling is Scaling.NVFP4 and r.policy(role).format is Format.E2M1 for role in Role)
    assert (r.weights.block, r.activations.block, r.gradients.block) == ((16, 16), (1, 16), (1, 16))
    assert (r.weights.rht, r.activations.rht, r.gradients.rht) == (False, True, True)  # the wgrad GEMM's inputs
    assert [r.policy(role).stochastic_rounding for role in Role] == [False, False, True]  # gradients only
    assert r.layers.bf16_last == 2 and r.layers.bf16_first == 0  # ~15% of gpt_125m's 12 layers, the last ones
    assert not r.layers.fp8_output_layer and r.attention == "bf16"  # LM head and attention BF16 (embeddings: never)


def test_tensorwise_and_hybrid_facts():
    t = load_recipe("tensorwise")
    assert all(t.policy(role).scaling is Scaling.TENSORWISE for role in Role)
    assert (t.weights.format, t.activations.format, t.gradients.format) == (Format.E4M3, Format.E4M3, Format.E5M2)
    h = load_recipe("hybrid")
    assert (h.weights.scaling, h.activations.scaling, h.gradients.scaling) == (
        Scaling.MXFP8, Scaling.BLOCKWISE, Scaling.TENSORWISE)
    assert h.activations.block == (1, 128) and h.gradients.format is Format.E5M2
    assert not load_recipe("bf16").is_fp8


def test_safe_facts():
    raw = yaml.safe_load((recipes_dir() / "safe.yaml").read_text())
    assert raw["defaults"][0] == "tensorwise"
    safe, tw = load_recipe("safe"), load_recipe("tensorwise")
    for role in Role:
        assert safe.policy(role) == tw.policy(role)  # inherits tensorwise's policies unchanged
    s = safe.schedule
    assert s.bf16_warmup_steps > 0
    starts = [s.role_start(role) for role in (Role.WEIGHTS, Role.ACTIVATIONS, Role.GRADIENTS)]
    assert starts[0] >= s.bf16_warmup_steps
    assert starts[0] < starts[1] < starts[2]
    assert safe.layers.bf16_first == 1 and safe.layers.bf16_last == 1
    assert any(fnmatch.fnmatchcase("output_layer", pat) for pat in safe.layers.bf16_modules)
    assert safe.layers.fp8_output_layer is False


# ---------------------------------------------------------------------------------------------------------------
# Recipes state only differences


def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def _leaves(d: dict, prefix=()) -> list[tuple[str, ...]]:
    out = []
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out += _leaves(v, prefix + (k,))
        else:
            out.append(prefix + (k,))
    return out


def _without(d: dict, path: tuple[str, ...]) -> dict:
    d = copy.deepcopy(d)
    node = d
    for k in path[:-1]:
        node = node[k]
    del node[path[-1]]
    return d


def restated_keys(name: str) -> list[str]:
    """Keys of the recipe file whose removal leaves the resolved recipe unchanged: each restates the schema's
    default (the role- and scaling-dependent one) or the value of a recipe it inherits from."""
    raw = yaml.safe_load((recipes_dir() / f"{name}.yaml").read_text()) or {}
    defaults = [d for d in raw.pop("defaults", []) if d != "_self_"]
    base: dict = {}
    for d in defaults:
        base = _merge(base, load_recipe_dict(d))
    # role strings are shorthand for {scaling: ...}: compare leaf by leaf
    for role in Role:
        if isinstance(raw.get(str(role)), str):
            raw[str(role)] = {"scaling": raw[str(role)]}
    full = Recipe.from_dict(_merge(base, raw))
    assert full == load_recipe(name)
    return [".".join(path) for path in _leaves(raw)
            if path not in (("name",), ("description",)) and _resolved(_merge(base, _without(raw, path))) == full]


def _resolved(data: dict) -> Recipe | None:
    """The recipe of `data`, or None where it is no recipe (a key that others need, e.g. activations.rht beside
    gradients.rht, is no restated one)."""
    try:
        return Recipe.from_dict(data)
    except RecipeError:
        return None


@pytest.mark.parametrize("name", [
    n for n in PACK])
def test_pack_recipe_states_only_differences(name):
    assert restated_keys(name) == []


def test_restated_key_detector_works(monkeypatch, tmp_path):
    # the detector above finds a restated default and a restated inherited value
    (tmp_path / "r.yaml").write_text(
        "defaults: [tensorwise, _self_]\nname: r\ndescription: d\n"
        "weights: {scaling: tensorwise, margin: 0, format: e4m3}\ngradients: {format: e5m2}\n"
        "layers: {bf16_first: 1}\n")
    monkeypatch.setitem(globals(), "recipes_dir", lambda: tmp_path)
    monkeypatch.setitem(globals(), "load_recipe", lambda n: Recipe.from_dict(load_recipe_dict(tmp_path / f"{n}.yaml")))
    assert sorted(restated_keys("r")) == ["gradients.format", "weights.format", "weights.margin", "weights.scaling"]
