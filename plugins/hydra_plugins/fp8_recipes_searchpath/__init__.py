"""Hydra SearchPathPlugin: puts fp8-recipes' configs (the `recipe` pack and the model/data/trainer groups) on the
search path of every Hydra app, from a checkout or from the installed package.

Any Hydra app can then say `+recipe=hybrid`. Discovered by Hydra through the `hydra_plugins` namespace package.
"""

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin


class FP8RecipesSearchPathPlugin(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        from fp8_recipes.recipes import conf_search_path

        search_path.append(provider="fp8-recipes", path=conf_search_path())
