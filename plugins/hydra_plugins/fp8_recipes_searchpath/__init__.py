"""Hydra SearchPathPlugin: puts fp8-recipes' configs (the `recipe` pack and the model/data/trainer groups) on the
search path of every Hydra app, from a checkout or from the installed package.

Any Hydra app can then say `+recipe=hybrid`. Discovered by Hydra through the `hydra_plugins` namespace package,
which Hydra imports before it composes a config: so the ``fp8_run_name`` resolver of conf/train.yaml's default
run_dir (fp8_recipes.rundir.default_run_name) is registered here, for scripts/train.py and the compose API alike.
"""

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin
from omegaconf import OmegaConf

from fp8_recipes.rundir import default_run_name

# use_cache: one name per composed config, however often run_dir is read
OmegaConf.register_new_resolver("fp8_run_name", default_run_name, use_cache=True, replace=True)


class FP8RecipesSearchPathPlugin(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        from fp8_recipes.recipe.pack import conf_search_path  # when Hydra asks: it imports every plugin of every app

        search_path.append(provider="fp8-recipes", path=conf_search_path())
