"""The autopilot's actions: what one changes in the recipe (a patch of dotted keys), and :func:`apply`.

    new_recipe = apply(recipe, actions)      # the applied (not dry) actions' changes, in order; validated

An :class:`Action`'s ``changes`` has the doctor's form (:class:`~fp8_recipes.observe.doctor_remedies.Proposal`):
dotted recipe keys -> new value (None: remove the key), where ``modules`` maps module patterns to their role
policies. Per-module changes are ``modules:`` entries named by the module itself (the roles its current entry
sets come along, so the others keep their policy); a demotion adds the module to ``layers.bf16_modules`` and a
re-promotion removes it; a role-wide change edits the role's policy and every ``modules:`` entry's for that
role. Changes are computed against the recipe as it stands when the action is taken (the earlier actions
applied), so they are applied in order to the recipe they came from. Pure (the schema only).
"""

from __future__ import annotations

import copy
import dataclasses
import fnmatch
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from fp8_recipes.recipe.schema import ROLES, Format, Recipe, Role, Scaling, TensorPolicy, default_policy

__all__ = ["Action", "SHORT_HISTORY", "apply", "demote_changes", "is_bf16_module", "module_changes", "patch",
           "repromote_changes", "restore_changes", "role_changes", "role_snapshot", "shortened", "to_bf16",
           "to_current", "to_e5m2"]

SHORT_HISTORY = 16
"""A delayed amax history this short is not shortened again (the next remedy is current scaling): 16 steps is
already what moe_delayed gives experts whose inputs change from step to step."""


@dataclass(frozen=True)
class Action:
    step: int
    """The statistics step it was decided at; it applies from the next step on."""
    module: str
    """The module name, or ``*`` for a role-wide action (every module of the role)."""
    role: str
    """weights | activations | gradients; ``*`` for a recovery that changes every delayed role."""
    kind: str
    """shorten_history | to_current | to_e5m2 | to_bf16 | repromote; ``cap_reached`` (no change: the note that
    max_actions stopped the autopilot)."""
    before: str
    """The policy it ran under (TensorPolicy.describe(), ``bf16``)."""
    after: str
    """The policy it runs under next."""
    reason: str
    """One line with the evidence: the signal, its value, the steps."""
    dry: bool = False
    """dry_run: logged only, never applied."""
    changes: Mapping[str, Any] = field(default_factory=dict)
    """The recipe patch (see the module docstring); empty for cap_reached."""
    recovery: bool = False
    """Taken after a streak of non-finite steps: the run goes back to its last good state and applies it."""

    def line(self) -> str:
        """The console / train.log line."""
        where = "every module" if self.module == "*" else self.module
        what = f"{self.before} -> {self.after}" if self.before or self.after else ""
        tags = "".join([" (dry run)"] * self.dry + [" (recovery)"] * self.recovery)
        return f"autopilot step {self.step}{tags}: {self.kind} {where} {self.role}: {what}; {self.reason}"

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON data (a metrics.jsonl row's fields, a checkpoint's entry)."""
        return {**dataclasses.asdict(self), "changes": copy.deepcopy(dict(self.changes))}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Action:
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data})


# ---------------------------------------------------------------------------------------------------------------
# Policy transforms: a policy they do not apply to comes back unchanged


def shortened(policy: TensorPolicy, factor: float, within: int | None = None) -> TensorPolicy:
    """A delayed policy's amax history, `factor` of its length, and at most `within` steps (the steps since its
    scale went stale: a window that still holds the stale amax would not change the scale); at least 1."""
    if policy.scaling is not Scaling.DELAYED:
        return policy
    length = int(policy.amax_history_len * factor)
    return dataclasses.replace(policy, amax_history_len=max(1, min(length, within or length)))


def to_current(policy: TensorPolicy) -> TensorPolicy:
    """Delayed -> tensorwise (current) scaling, with the same format, margin and power-of-two setting."""
    return dataclasses.replace(policy, scaling=Scaling.TENSORWISE) if policy.scaling is Scaling.DELAYED else policy


def to_e5m2(policy: TensorPolicy) -> TensorPolicy:
    """E4M3 -> E5M2 (2^32 of range instead of 2^18) under an FP8 scaling."""
    fp8 = policy.scaling not in (Scaling.NONE, Scaling.NVFP4)
    return dataclasses.replace(policy, format=Format.E5M2) if fp8 and policy.format is Format.E4M3 else policy


def to_bf16(policy: TensorPolicy) -> TensorPolicy:
    return dataclasses.replace(policy, scaling=Scaling.NONE)


# ---------------------------------------------------------------------------------------------------------------
# Changes


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else (str(value) if isinstance(value, StrEnum) else value)


def _policy_diff(role: Role, old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """``role.key`` -> value for each key of `new` that differs from `old` (a new key left out when it is the
    default), None for each key of `old` that `new` does not have."""
    d = default_policy(role)
    out = {f"{role}.{k}": v for k, v in new.items() if old.get(k) != v and (k in old or v != _plain(getattr(d, k)))}
    out.update({f"{role}.{k}": None for k in old if k not in new})
    return out


def role_changes(recipe: Recipe, roles: Iterable[Role | str],
                 transform: Callable[[TensorPolicy], TensorPolicy]) -> dict[str, Any]:
    """`transform` applied to each of `roles`' policies: the recipe's own and every ``modules:`` entry's."""
    roles = [Role(r) for r in roles]
    out: dict[str, Any] = {}
    for role in roles:
        old = recipe.policy(role)
        out.update(_policy_diff(role, old.to_dict(), transform(old).to_dict()))
    entries = {}
    for m in recipe.modules:
        new = {r: (transform(p) if r in roles else p) for r, p in m.policies}
        if any(new[r] != p for r, p in m.policies):
            entries[m.pattern] = {str(r): new[r].to_dict() for r in ROLES if r in new}
    if entries:
        out["modules"] = entries
    return out


def module_changes(recipe: Recipe, module: str, role: Role | str, policy: TensorPolicy) -> dict[str, Any]:
    """A ``modules:`` entry for `module` alone: `role` under `policy`, the other roles its entry sets as they were."""
    override = recipe.module_override(module)
    roles = dict(override.policies) if override else {}
    roles[Role(role)] = policy
    return {"modules": {module: {str(r): roles[r].to_dict() for r in ROLES if r in roles}}}


def is_bf16_module(recipe: Recipe, module: str) -> bool:
    """A ``layers.bf16_modules`` pattern matches `module` (it runs BF16, whatever its policies say)."""
    return any(fnmatch.fnmatchcase(module, p) for p in recipe.layers.bf16_modules)


def demote_changes(recipe: Recipe, module: str) -> dict[str, Any]:
    return {"layers.bf16_modules": [*recipe.layers.bf16_modules, module]}


def repromote_changes(recipe: Recipe, module: str) -> dict[str, Any]:
    return {"layers.bf16_modules": [p for p in recipe.layers.bf16_modules if p != module]}


def role_snapshot(recipe: Recipe, role: Role | str) -> dict[str, Any]:
    """`role`'s policies before a role-wide demotion (the recipe's and each ``modules:`` entry's): what a
    re-promotion restores. Plain data, for the checkpoint."""
    role = Role(role)
    return {"policy": recipe.policy(role).to_dict(),
            "modules": {m.pattern: p.to_dict() for m in recipe.modules if (p := m.policy(role)) is not None}}


def restore_changes(recipe: Recipe, role: Role | str, snapshot: Mapping[str, Any]) -> dict[str, Any]:
    """The changes that give `role` back the policies of `snapshot` (:func:`role_snapshot`), the other roles of
    each ``modules:`` entry as they are now."""
    role = Role(role)
    out = _policy_diff(role, recipe.policy(role).to_dict(), snapshot["policy"])
    entries = {}
    for m in recipe.modules:
        if m.pattern in snapshot["modules"] and m.policy(role) is not None:
            entry = {str(r): p.to_dict() for r, p in m.policies}
            entry[str(role)] = copy.deepcopy(snapshot["modules"][m.pattern])
            entries[m.pattern] = {str(r): entry[str(r)] for r in ROLES if str(r) in entry}
    if entries:
        out["modules"] = entries
    return out


def patch(data: Mapping[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
    """`data` (a Recipe.to_dict()) with `changes` applied: dotted keys set (None: removed); ``modules`` entries
    replace the entry of the same pattern where it stands, and a new pattern goes first (the first match wins)."""
    out = copy.deepcopy(dict(data))
    for dotted, value in changes.items():
        if dotted == "modules":
            old = out.get("modules") or {}
            merged = {p: copy.deepcopy(e) for p, e in value.items() if p not in old}
            merged.update({p: copy.deepcopy(value.get(p, e)) for p, e in old.items()})
            out["modules"] = merged
            continue
        *parents, leaf = dotted.split(".")
        node = out
        for k in parents:
            node = node.setdefault(k, {})
        if value is None:
            node.pop(leaf, None)
        else:
            node[leaf] = copy.deepcopy(value)
    return out


def apply(recipe: Recipe, actions: Iterable[Action]) -> Recipe:
    """`recipe` with the changes of the applied (not dry) actions, in order; a RecipeError (source
    ``autopilot``) if the result is not a valid recipe."""
    changes = [a.changes for a in actions if not a.dry and a.changes]
    if not changes:
        return recipe
    data = recipe.to_dict()
    for c in changes:
        data = patch(data, c)
    return Recipe.from_dict(data, source="autopilot")
