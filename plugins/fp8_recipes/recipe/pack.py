"""Finding and loading recipes: the pack in ``recipes/`` (Hydra group ``recipe``), or any YAML file.

In a checkout the pack is ``<root>/recipes`` and the Hydra app config ``<root>/conf`` (where ``conf/recipe`` links
to ``../recipes``); an installed package carries both as ``fp8_recipes/_conf`` (``_conf/recipe`` = the pack).
A recipe may build on others with a Hydra defaults list (``defaults: [tensorwise, _self_]``): Hydra composes it
for ``scripts/train.py +recipe=NAME``; :func:`load_recipe_dict` applies the same rule to files outside Hydra
(names are looked up beside the file first, then in the pack; ``_self_`` last unless placed).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

from fp8_recipes.checks import did_you_mean
from fp8_recipes.recipe.schema import Recipe, RecipeError
from fp8_recipes.recipe.yaml_guard import UnsafeYAML, load_yaml

__all__ = [
    "conf_dir", "conf_search_path", "load_recipe", "load_recipe_dict", "project_root", "recipe_file_overrides",
    "check_pack_names", "is_recipe_file", "recipe_names", "recipes_dir", "resolve_recipe_file",
]


EMPTY_RECIPE = ("the recipe states nothing (an empty file, or only comments), so it would train BF16 "
                "unnamed; build on a recipe (defaults: [tensorwise, _self_]) or state a role (weights: tensorwise); "
                "the BF16 baseline is the recipe bf16")


@lru_cache(maxsize=1)
def project_root() -> Path | None:
    """The checkout this package runs from (editable install or PYTHONPATH=plugins), else None."""
    root = Path(__file__).resolve().parents[3]
    return root if (root / "recipes").is_dir() and (root / "conf" / "train.yaml").is_file() else None


def conf_dir() -> Path:
    root = project_root()
    if root is not None:
        return root / "conf"
    # _conf has no __init__.py (it is conf/ shipped as data), so it is a namespace package: files() returns a
    # MultiplexedPath there, whose str() is its repr, not a path. The installed files sit in the package, one folder up.
    return Path(__file__).resolve().parents[1] / "_conf"


def recipes_dir() -> Path:
    root = project_root()
    return root / "recipes" if root is not None else conf_dir() / "recipe"


def conf_search_path() -> str:
    """The Hydra search-path entry holding train.yaml and the groups (recipe, model, data, trainer, ...)."""
    return f"file://{conf_dir()}" if project_root() is not None else "pkg://fp8_recipes._conf"


def recipe_names() -> list[str]:
    return sorted(p.stem for p in recipes_dir().glob("*.yaml"))


def check_pack_names(option: str, names: list[str]) -> None:
    """ValueError, one line naming ``option``, for the first of ``names`` that is no recipe of the pack: the
    benchmark scripts' --recipes run each as ``+recipe=NAME`` and name their runs by it, so they take pack names
    only (not the files ``+recipe=`` takes)."""
    pack = recipe_names()
    for name in names:
        if name not in pack:
            what = "a path, not a recipe of the pack" if _is_file_ref(name) else \
                f"not a recipe of the pack{did_you_mean(name, pack)}"
            raise RecipeError([f"{option}: {name!r} is {what}; choose from {', '.join(pack)}"])


def _read_yaml(path: Path) -> dict[str, Any]:
    from omegaconf import OmegaConf

    try:  # the guarded reader (size, encoding, one document, aliases, duplicate keys, tags), then interpolations
        raw = load_yaml(path.read_bytes(), str(path))
        if raw is not None and not isinstance(raw, dict):  # (OmegaConf would read a string as YAML text again)
            raise RecipeError([f"(top level): a recipe is a mapping of keys, got {type(raw).__name__} "
                               f"{_preview(raw)}; write key: value lines (fp8-recipes show hybrid prints one)"],
                              str(path))
        data = OmegaConf.to_container(OmegaConf.create(raw), resolve=True) if raw is not None else None
    except RecipeError:
        raise
    except UnsafeYAML as e:
        raise RecipeError([str(e)], str(path)) from None
    except OSError as e:
        raise RecipeError([f"cannot read: {e.strerror or e}"], str(path)) from None
    except Exception as e:  # omegaconf interpolation and type errors
        raise RecipeError([f"cannot read: {str(e).splitlines()[0]}"], str(path)) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise RecipeError([f"(top level): a recipe is a mapping of keys, got {type(data).__name__}"], str(path))
    return data


def _preview(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:60]}... ({len(text):,} characters)"


def _resolve_ref(ref: str | Path, near: Path | None = None, key: str = "recipe", source: str | None = None,
                 group: tuple[Path, ...] = ()) -> Path:
    """The YAML file `ref` names; `key` and `source` say where the name was written, for the error message;
    `group`: the recipe folders of Hydra's search path after the pack (``hydra.searchpath``), looked in last."""
    s = str(ref)
    p = Path(s).expanduser()
    if near is not None and not p.is_absolute():  # a defaults entry: relative to the recipe that names it
        p = near / p
    if s.endswith((".yaml", ".yml")) or "/" in s:
        if not p.is_file():  # (a directory or a device exists: "does not exist" would send the user looking for it)
            what = ("'{}' is a directory, not a YAML file" if p.is_dir() else "'{}' is not a regular file"
                    if p.exists() else "file '{}' does not exist").format(s)
            raise RecipeError([f"{key}: {what}; give a recipe name ({', '.join(recipe_names())}) or a path to a "
                               f"YAML file"], source)
        return p
    for d in ([near] if near is not None else []) + [recipes_dir(), *group]:  # beside the recipe, the pack, the rest
        cand = d / f"{s}.yaml"
        if cand.is_file():
            return cand
    names = recipe_names()
    raise RecipeError([f"{key}: '{s}' is not a recipe{did_you_mean(s, names)}; choices: {', '.join(names)} "
                       f"(or a path to a YAML file)"], source)


def _merge(base: dict, over: Mapping) -> dict:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = _merge(dict(out[k]), v)
        else:
            out[k] = v
    return out


def load_recipe_dict(ref: str | Path, _seen: tuple[Path, ...] = (), group: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The recipe's data after its defaults list is applied (Hydra's merge order), without validation. `group`:
    further recipe folders (Hydra's search path) where names are looked up after the pack."""
    path = _resolve_ref(ref, group=group)
    if path.resolve() in _seen:
        chain = " -> ".join(p.stem for p in _seen + (path.resolve(),))
        raise RecipeError([f"defaults: circular recipe inheritance {chain}; remove one of the defaults"], str(path))
    data = _read_yaml(path)
    if not data:
        raise RecipeError([f"(top level): {EMPTY_RECIPE}"], str(path))
    defaults = data.pop("defaults", None) or []
    if not isinstance(defaults, list):
        raise RecipeError([f"defaults: {defaults!r} is not a list (e.g. [tensorwise, _self_])"], str(path))
    if "_self_" not in defaults:
        defaults = defaults + ["_self_"]
    out: dict[str, Any] = {}
    for entry in defaults:
        if entry == "_self_":
            out = _merge(out, data)
            continue
        if not isinstance(entry, str):
            raise RecipeError([f"defaults: {entry!r} is not a recipe name (group overrides are not supported "
                               f"in recipes; name a recipe such as tensorwise)"], str(path))
        base_path = _resolve_ref(entry, near=path.parent, key="defaults", source=str(path), group=group)
        out = _merge(out, load_recipe_dict(base_path, _seen + (path.resolve(),), group))
    return out


def load_recipe(ref: str | Path | Mapping[str, Any]) -> Recipe:
    """A validated Recipe from a pack name, a YAML path or a mapping (e.g. Hydra's ``cfg.recipe``)."""
    if isinstance(ref, Mapping):
        if not ref:
            raise RecipeError([f"(top level): {EMPTY_RECIPE}"])
        return Recipe.from_dict(dict(ref))
    path = _resolve_ref(ref)
    return Recipe.from_dict(load_recipe_dict(path), source=str(path))


def _is_file_ref(value: str) -> bool:
    return value.endswith((".yaml", ".yml")) or "/" in value


def is_recipe_file(ref: str) -> bool:
    """Whether ``+recipe=REF`` names a file (``*.yaml``, ``*.yml`` or a path) rather than a recipe by name."""
    return _is_file_ref(ref)


def resolve_recipe_file(ref: str, key: str = "recipe") -> Path:
    """The recipe file `ref` names; RecipeError (a ValueError, one line naming `key`) for a missing file, a
    directory or anything but a regular file."""
    return _resolve_ref(ref, key=key)


def _search_path_groups(args: list[str]) -> tuple[Path, ...]:
    """The ``recipe`` folders Hydra adds after the pack for ``hydra.searchpath=[...]`` and ``--config-dir DIR``
    (``file://DIR`` or ``pkg://module``: ``DIR/recipe``), in Hydra's order; those that exist."""
    return tuple(root / "recipe" for root in search_path_roots(args) if (root / "recipe").is_dir())


def search_path_roots(args: list[str]) -> tuple[Path, ...]:
    """The config folders Hydra adds after the pack's for ``hydra.searchpath=[...]`` and ``--config-dir DIR``
    (``file://DIR``, a plain path, or ``pkg://module``), in Hydra's order; those that exist. A group's options are
    ``ROOT/GROUP/NAME.yaml``."""
    entries: list[str] = []
    for i, arg in enumerate(args):
        if arg in ("--config-dir", "-cd") and i + 1 < len(args):
            entries.append(f"file://{args[i + 1]}")
        elif arg.startswith("--config-dir="):
            entries.append(f"file://{arg.partition('=')[2]}")
        elif arg.lstrip("+").startswith("hydra.searchpath="):
            from hydra.core.override_parser.overrides_parser import OverridesParser
            from hydra.errors import OverrideParseException

            try:  # Hydra's own parser: the list syntax and quoting are Hydra's
                value = OverridesParser.create().parse_overrides([arg])[0].value()
            except OverrideParseException:
                continue  # Hydra reports it as one line when it composes
            entries += [v for v in value if isinstance(v, str)] if isinstance(value, list) else []
    dirs = []
    for entry in entries:
        scheme, _, where = entry.partition("://")
        if scheme == "pkg":
            import importlib.util

            try:
                spec = importlib.util.find_spec(where.replace("/", "."))
            except (ImportError, ValueError):
                continue
            roots = list(spec.submodule_search_locations or []) if spec else []
        else:
            roots = [where if scheme == "file" else entry]
        dirs += [Path(r).expanduser() for r in roots if Path(r).expanduser().is_dir()]
    return tuple(dirs)


def recipe_file_overrides(overrides: list[str]) -> list[str]:
    """Hydra overrides in which ``+recipe=PATH.yaml`` (a recipe file anywhere, as ``fp8-recipes show`` takes it)
    names a recipe Hydra can compose: the file, its defaults list applied, goes into Hydra's ConfigStore as the
    option ``file:<stem>`` of the group ``recipe``, and the override names that option. Overrides of its keys
    (``recipe.weights.scaling=...``) then work as for a pack recipe, and its problems are named ``recipe.<key>``
    when the run checks it. A missing or empty file is a RecipeError here. ``+recipe=NAME`` of the pack stays as
    it is, after its file (and its defaults) passed the guarded YAML reader: unsafe YAML is a RecipeError here too."""
    out = []
    for override in overrides:
        key, eq, value = override.partition("=")
        if eq and key.lstrip("+") == "recipe" and _is_file_ref(value.strip("'\"")):
            value = value.strip("'\"")
            path = _resolve_ref(value)
            data = load_recipe_dict(path)
            data.setdefault("name", path.stem)
            from hydra.core.config_store import ConfigStore

            # quoted: Hydra's override grammar takes unquoted values of ASCII word characters only (mine_中文.yaml
            # was a parse error); the option's name holds no quote or backslash to escape
            option = "file:" + re.sub(r"['\"\\]", "_", path.stem)
            ConfigStore.instance().store(group="recipe", name=option, node=data)
            override = f"{key}='{option}'"
        elif eq and key.lstrip("+") == "recipe" and value.strip("'\"") in recipe_names():
            # Hydra reads the pack's files with its own YAML loader (duplicate keys, tags, alias bombs pass or end
            # in tracebacks there): the guarded reader first, the recipe and its defaults chain, one line if bad
            load_recipe_dict(value.strip("'\""))
        elif eq and key.lstrip("+") == "recipe" and value.strip("'\""):
            # a recipe of the user's own group (hydra.searchpath=[file://DIR], DIR/recipe/NAME.yaml): the same guard;
            # a name found nowhere is left to Hydra, whose error lists the options
            group = _search_path_groups(overrides)
            found = [d / f"{value.strip(chr(39) + chr(34))}.yaml" for d in group]
            found = [f for f in found if f.is_file()]
            if found:  # the first in Hydra's search order is the one Hydra loads
                load_recipe_dict(found[0], group=group)
        out.append(override)
    return out
