"""The one guarded YAML reader (issue 19): each hostile input refused in one line naming the line and the fix,
before any object is built; recipes read through it in validate and in training alike; sizes bounded."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from fp8_recipes.recipe.pack import load_recipe
from fp8_recipes.recipe.schema import Recipe, RecipeError
from fp8_recipes.recipe.yaml_guard import MAX_BYTES, UnsafeYAML, load_yaml

ROOT = Path(__file__).resolve().parents[2]
BOMB = "".join(f"{c}: &{c} [{', '.join([f'*{p}'] * 9) if p else ', '.join(['x'] * 9)}]\n"
               for p, c in zip([None, "a", "b", "c", "d", "e", "f", "g"], "abcdefgh"))  # 9^8 values in ~300 bytes

CASES = {
    "alias bomb": (BOMB.encode(), "expands to more than 100,000 values"),
    "duplicate key": (b"name: x\nweights: tensorwise\nweights: delayed\n", "line 3: duplicate key 'weights' "
                                                                            "(first at line 2); keep one"),
    "two documents": (b"name: x\n---\nname: y\n", "line 3: 2 YAML documents"),
    "not UTF-8": (b"name: \xff\n", "line 1: not UTF-8"),
    "unknown tag": (b"name: !custom x\n", "line 1: unknown tag '!custom'"),
    "python object": (b"name: !!python/object/apply:os.system [echo hi]\n", "unknown tag"),
    "recursive": (b"a: &a [*a]\n", "recursive structure"),
    "deep": (("a:\n" + "".join(" " * (i + 1) + "a:\n" for i in range(40))).encode(), "nested deeper than 32"),
    "huge": (b"name: x\n" + b"# " + b"x" * MAX_BYTES + b"\n", "bytes is more than"),
    "syntax": (b"name: [x\n", "YAML syntax error"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_hostile_yaml_is_one_line(case):
    raw, says = CASES[case]
    t = time.perf_counter()
    with pytest.raises(UnsafeYAML) as e:
        load_yaml(raw, "x.yaml")
    assert says in str(e.value) and "\n" not in str(e.value)
    assert time.perf_counter() - t < 2  # the bomb is measured, never expanded


def test_plain_yaml_loads_as_before():
    text = (ROOT / "recipes" / "safe.yaml").read_bytes()
    import yaml

    assert load_yaml(text) == yaml.safe_load(text)
    assert load_yaml(b"a: &x {b: 1}\nc: *x\n") == {"a": {"b": 1}, "c": {"b": 1}}  # plain aliases still work
    assert load_yaml(b"") is None and load_yaml(b"# only a comment\n") is None


def test_recipe_files_go_through_it(tmp_path):
    bad = tmp_path / "dup.yaml"
    bad.write_bytes(b"name: dup\nweights: tensorwise\nactivations: tensorwise\nweights: delayed\n")
    with pytest.raises(RecipeError) as e:
        load_recipe(bad)
    assert str(e.value) == f"{bad}: line 4: duplicate key 'weights' (first at line 2); keep one"
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(BOMB)
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), f"+recipe={bomb}",
                        f"run_dir={tmp_path / 'run'}"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr[-1500:]
    assert [ln for ln in p.stderr.splitlines() if ln.startswith("error:")] == [
        f"error: {bomb}: line 6: expands to more than 100,000 values (aliases repeated inside aliases?); "
        f"write the values out"]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("data, key", [
    ({"weights": {"scaling": "delayed", "amax_history_len": 10**12}}, "weights.amax_history_len"),
    ({"weights": {"scaling": "blockwise", "block": [1, 10**12]}}, "weights.block"),
    ({"weights": "delayed", "schedule": {"bf16_warmup_steps": 10**12}}, "schedule.bf16_warmup_steps"),
    ({"weights": "delayed", "schedule": {"enable": {"weights": 10**12}}}, "schedule.enable.weights"),
])
def test_sizes_are_bounded(data, key):
    with pytest.raises(RecipeError) as e:
        Recipe.from_dict(data)
    assert str(e.value).startswith(f"{key}: ") and "\n" not in str(e.value)


def test_samples_are_bounded():
    from fp8_recipes.training.config import TrainerConfig

    with pytest.raises(ValueError, match=r"^trainer.max_steps=2000000000 x trainer.global_batch_size=16 = "):
        TrainerConfig.from_cfg({"max_steps": 2_000_000_000, "global_batch_size": 16, "micro_batch_size": 4})


_MODEL = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32, "vocab_size": 128}


@pytest.mark.parametrize("key, value, start", [
    ("seq_length", 1_000_000, "model.seq_length=1000000: larger than"),
    ("hidden_size", 2**20, "model.hidden_size=1048576: larger than"),
    ("num_layers", 10**6, "model.num_layers=1000000: larger than"),
    ("vocab_size", 10**9, "model.vocab_size=1000000000: larger than"),
    ("num_attention_heads", 64, "model.num_attention_heads=64: the head dimension"),  # 64 / 64 = 1
])
def test_model_sizes_are_bounded(key, value, start):
    from fp8_recipes.megatron.model_config import check_model_cfg

    with pytest.raises(ValueError) as e:
        check_model_cfg({**_MODEL, key: value})
    assert str(e.value).startswith(start) and "\n" not in str(e.value)
    check_model_cfg(_MODEL)


def test_seed_is_bounded():
    from fp8_recipes.training.config import TrainerConfig

    with pytest.raises(ValueError, match=r"^trainer.seed=18446744073709551616: must be below 2\*\*32"):
        TrainerConfig.from_cfg({"seed": 2**64})
    TrainerConfig.from_cfg({"seed": 2**32 - 1})


@pytest.mark.parametrize("case", ["alias bomb", "duplicate key", "not UTF-8"])
def test_pack_recipes_go_through_it_before_hydra(tmp_path, monkeypatch, case):
    """+recipe=NAME of the pack: Hydra would read the file with its own loader; scripts/train.py's pre-compose
    step (recipe_file_overrides) reads it, and the recipes of its defaults list, through the guard first."""
    from fp8_recipes.recipe import pack as recipes

    data, message = CASES[case]
    (tmp_path / "base.yaml").write_bytes(data)
    (tmp_path / "mine.yaml").write_text("defaults: [base, _self_]\nname: mine\n")
    (tmp_path / "good.yaml").write_text("name: good\nweights: tensorwise\n")
    monkeypatch.setattr(recipes, "recipes_dir", lambda: tmp_path)
    for name, bad in (("base", "base"), ("mine", "base")):
        with pytest.raises(RecipeError) as e:
            recipes.recipe_file_overrides([f"+recipe={name}", "trainer.max_steps=2"])
        assert str(e.value).startswith(f"{tmp_path / bad}.yaml: ") and message in str(e.value)
        assert "\n" not in str(e.value)
    assert recipes.recipe_file_overrides(["+recipe=good", "recipe=nosuch"]) == ["+recipe=good", "recipe=nosuch"]


@pytest.mark.parametrize("case", ["alias bomb", "python object", "deep", "not UTF-8"])
def test_search_path_recipes_go_through_it_before_hydra(tmp_path, case):
    """+recipe=NAME of the user's own group (hydra.searchpath=[file://DIR], DIR/recipe/NAME.yaml, or
    --config-dir DIR): the same guard as a pack recipe, the file and its defaults list (names looked up in the
    pack and the search path's recipe folders, as Hydra does)."""
    from fp8_recipes.recipe import pack as recipes

    data, message = CASES[case]
    group = tmp_path / "recipe"
    group.mkdir()
    (group / "base.yaml").write_bytes(data)
    (group / "mine.yaml").write_text("defaults: [base, _self_]\nname: mine\n")
    (group / "fine.yaml").write_text("defaults: [tensorwise, _self_]\nname: fine\n")
    for how in ([f"hydra.searchpath=[file://{tmp_path}]"], ["--config-dir", str(tmp_path)]):
        for name in ("base", "mine"):
            with pytest.raises(RecipeError) as e:
                recipes.recipe_file_overrides([*how, f"+recipe={name}"])
            assert str(e.value).startswith(f"{group / 'base'}.yaml: ") and message in str(e.value)
        assert recipes.recipe_file_overrides([*how, "+recipe=fine"]) == [*how, "+recipe=fine"]


def test_unreadable_search_path_recipe_names_the_file(tmp_path, monkeypatch):
    """chmod 000 (simulated: the tests may run as root, who reads it anyway): the recipe file named, not run_dir."""
    from fp8_recipes.recipe import pack as recipes

    (tmp_path / "recipe").mkdir()
    locked = tmp_path / "recipe" / "locked.yaml"
    locked.write_text("name: locked\n")
    real = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda p: (_ for _ in ()).throw(PermissionError(13, "Permission denied"))
                        if p == locked else real(p))
    with pytest.raises(RecipeError) as e:
        recipes.recipe_file_overrides([f"hydra.searchpath=[file://{tmp_path}]", "+recipe=locked"])
    assert str(e.value) == f"{locked}: cannot read: Permission denied"
