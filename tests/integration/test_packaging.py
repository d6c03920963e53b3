"""The built wheel: it carries the configs and the recipe pack as fp8_recipes/_conf and the Hydra search-path
plugin, and an installed copy works without the checkout (recipes, CLI, Hydra composition through the plugin).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

from fp8_recipes.recipe.pack import load_recipe, recipe_names

ROOT = Path(__file__).resolve().parents[2]
PACK = {p.stem for p in (ROOT / "recipes").glob("*.yaml")}  # every recipe of the checkout goes into the wheel


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Build the wheel from a copy of the project files (a build writes build/ and *.egg-info into its source
    tree: not into the checkout). No build isolation: the venv's setuptools builds it, offline."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for f in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy2(ROOT / f, src / f)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for d in ("conf", "recipes", "plugins"):
        shutil.copytree(ROOT / d, src / d, symlinks=True, ignore=ignore)  # conf/recipe stays a link to recipes/
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                           "--disable-pip-version-check", "-q", "-w", str(tmp / "dist"), str(src)],
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0 and "No module named" in proc.stderr:
        pytest.fail(f"the venv cannot build without isolation (a build requirement is missing): {proc.stderr[-2000:]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (built,) = (tmp / "dist").glob("fp8_recipes-*.whl")
    return built


def test_wheel_contents(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    conf = "fp8_recipes/_conf/"
    assert conf + "train.yaml" in names
    for group in ("model", "data", "trainer"):
        shipped = {n[len(conf):] for n in names if n.startswith(f"{conf}{group}/") and n.endswith(".yaml")}
        assert shipped == {f"{group}/{p.name}" for p in (ROOT / "conf" / group).glob("*.yaml")}, group
    recipes = {Path(n).stem for n in names if n.startswith(conf + "recipe/") and n.endswith(".yaml")}
    assert recipes == PACK == set(recipe_names())
    with zipfile.ZipFile(wheel) as z:
        for name in PACK:  # the files themselves, not the link
            assert z.read(f"{conf}recipe/{name}.yaml") == (ROOT / "recipes" / f"{name}.yaml").read_bytes()
        assert z.read(conf + "train.yaml") == (ROOT / "conf" / "train.yaml").read_bytes()
        entry_points = next(z.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "hydra_plugins/fp8_recipes_searchpath/__init__.py" in names
    assert not any(n.startswith("hydra_plugins/__init__") for n in names)  # a namespace package shared by plugins
    assert "fp8-recipes = fp8_recipes.cli:main" in entry_points
    for module in ("cli", "recipe/pack", "recipe/schema", "plan/precision", "plan/te", "numerics/quantize",
                   "backends/emulated", "megatron/emulated_layers", "training/run", "observe/recorder"):
        assert f"fp8_recipes/{module}.py" in names, module


# Runs in a fresh interpreter: -I (no PYTHONPATH, no user site, not the cwd) -S (no site: the editable install's
# .pth, which puts the checkout's plugins/ on sys.path, is never read). sys.path is the standard library, the
# unpacked wheel and, for torch/hydra/omegaconf, the venv's site-packages read as a plain directory.
INSTALLED_CHECK = textwrap.dedent('''
    import json, sys
    sys.path.insert(0, {site!r})
    sys.path.append({venv_site!r})
    import fp8_recipes
    from fp8_recipes import cli
    from fp8_recipes.recipe import pack as recipes
    from hydra import compose, initialize
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.plugins import Plugins
    from hydra.plugins.search_path_plugin import SearchPathPlugin
    from omegaconf import OmegaConf
    import hydra_plugins.fp8_recipes_searchpath as plugin

    out = {{"sys_path": sys.path, "package": fp8_recipes.__file__, "plugin": plugin.__file__,
           "project_root": recipes.project_root(), "names": recipes.recipe_names(),
           "safe": recipes.load_recipe("safe").to_dict(), "search_path": recipes.conf_search_path(),
           "discovered": [p.__name__ for p in Plugins.instance().discover(SearchPathPlugin)]}}
    with initialize(version_base="1.3", config_path=None):
        cfg = compose("train", overrides=["+recipe=hybrid"])
        sources = GlobalHydra.instance().config_loader().get_sources()
        out["sources"] = [f"{{s.scheme()}}://{{s.path}}" for s in sources]
    out["recipe"] = OmegaConf.to_container(cfg.recipe)
    out["model_layers"] = cfg.model.num_layers
    out["trainer_steps"] = cfg.trainer.max_steps
    out["cli_rc"] = cli.main(["explain", "hybrid", "--layers", "2"])
    print("JSON" + json.dumps(out, default=str))
''')


def test_installed_wheel_works_without_the_checkout(wheel, tmp_path):
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    venv_site = sysconfig.get_paths()["purelib"]
    code = INSTALLED_CHECK.format(site=str(site), venv_site=venv_site)
    proc = subprocess.run([sys.executable, "-I", "-S", "-c", code], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("JSON", 1)[1])
    assert not any(p.startswith(str(ROOT)) for p in out["sys_path"] if p != venv_site), out["sys_path"]
    assert out["package"].startswith(str(site)) and out["plugin"].startswith(str(site))
    assert out["project_root"] is None
    assert set(out["names"]) == PACK
    assert out["safe"] == load_recipe("safe").to_dict()
    assert out["search_path"] == "pkg://fp8_recipes._conf"
    assert "FP8RecipesSearchPathPlugin" in out["discovered"]
    assert "pkg://fp8_recipes._conf" in out["sources"] and not any(str(ROOT) in s for s in out["sources"])
    assert out["recipe"]["name"] == "hybrid" and out["recipe"]["weights"] == {"scaling": "mxfp8"}
    assert (out["model_layers"], out["trainer_steps"]) == (4, 200)  # conf/model/tiny.yaml, conf/trainer/cpu.yaml
    assert out["cli_rc"] == 0 and "recipe    hybrid" in proc.stdout


def test_checkout_hydra_discovers_the_search_path_plugin():
    from hydra.core.plugins import Plugins
    from hydra.plugins.search_path_plugin import SearchPathPlugin

    from fp8_recipes.recipe.pack import conf_search_path

    found = {p.__name__: p for p in Plugins.instance().discover(SearchPathPlugin)}
    assert "FP8RecipesSearchPathPlugin" in found
    assert found["FP8RecipesSearchPathPlugin"].__module__ == "hydra_plugins.fp8_recipes_searchpath"
    assert conf_search_path() == f"file://{ROOT / 'conf'}"
    # and an app with no config dir of its own composes our train.yaml and the pack through it
    from hydra import compose, initialize
    from omegaconf import OmegaConf

    with initialize(version_base="1.3", config_path=None):
        cfg = compose("train", overrides=["+recipe=safe"])
    assert load_recipe(OmegaConf.to_container(cfg.recipe)) == load_recipe("safe")
