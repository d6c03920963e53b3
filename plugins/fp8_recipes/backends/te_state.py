"""A Transformer Engine module's delayed-scaling state: read it, put a checkpoint's back, move it to a new recipe.

    tensors = delayed_tensors(module)                  # {scale_fwd, amax_history_fwd, scale_bwd, amax_history_bwd}
    restore_delayed(name, module, saved, recipe)       # a checkpoint's tensors, before the module's next FP8 forward
    move_delayed(module, recipe, old, new, autocast)   # the plan changed mid-run (the autopilot): old TERecipe -> new
    reregister(modules)                                # then every module joins TE's amax buffers again

How TE 2.20.2 keeps it (its ``module/base.py`` and ``quantization.py``): per direction a RecipeState whose ``scale``
(n,) and ``amax_history`` (length, n) have one column per quantizer slot that has delayed state. A linear's slots
are, per GEMM, ``input, weight, output`` forward and ``grad_output, grad_input`` backward (Linear, LayerNormLinear,
and GroupedLinear once per expert); DelayedScaling gives every slot state, a CustomRecipe only the slots its
factory asked a ``DelayedScalingRequest`` for (:func:`delayed_slots`). History rows: row 0 the step being recorded,
then the past steps oldest first (TE's update rolls them).

Why moving needs us: TE keeps a module's quantizers while the next recipe has the same class ("Match built-in
recipes by full config, not just RecipeState type", a TODO in 2.20.2's ``set_meta_tensor``): a DelayedScaling that
turns its gradients E5M2 would go on casting them to E4M3. Its ``adjust_amax_history_length`` keeps the oldest
rows, and a module registers its state in TE's global amax buffers once, under the recipe it first ran with, whose
margin and format then update it. So :func:`move_delayed` rebuilds the module's state under the new recipe (TE's own
``init_fp8_meta_tensors``, as a checkpoint restore does) and fills each slot from the old state: the history resized
with the newest amaxes kept and the scale taken again from it under the slot's new policy
(numerics/scaling.py, as the emulated backend's ``DelayedScaler.resized``), unchanged where the slot's policy is;
a slot new to delayed scaling starts as TE starts one. :func:`reregister` then empties TE's global amax buffers,
and every module registers again at its next FP8 forward, under its recipe now.

TE is never imported here: the functions work on the module's own attributes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, ContextManager

import torch

from fp8_recipes.checks import ConfigError
from fp8_recipes.numerics.scaling import resized_history, retaken_scale
from fp8_recipes.plan.precision import TERecipe
from fp8_recipes.plan.te import TERecipeKind
from fp8_recipes.recipe.schema import Role

__all__ = ["SLOT_ROLES", "StepSnapshot", "carry_delayed", "delayed_column", "delayed_slots", "delayed_tensors",
           "move_delayed", "reregister", "restore_delayed"]

SLOT_ROLES = {"input": Role.ACTIVATIONS, "weight": Role.WEIGHTS, "grad_output": Role.GRADIENTS}
"""A TE linear's quantizer slot -> the role it quantizes (``output`` and ``grad_input``, the boundary slots, none)."""
_SLOTS = {True: ("input", "weight", "output"), False: ("grad_output", "grad_input")}
"""One GEMM's quantizer slots, forward and backward, in TE's order (repeated per GEMM of a module)."""


def delayed_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's delayed-scaling scale / amax-history tensors (built-in or CustomRecipe), empty if none."""
    meta = getattr(module, "fp8_meta", None) or {}
    out = {}
    for direction, key in (("fwd", "scaling_fwd"), ("bwd", "scaling_bwd")):
        state = meta.get(key)
        scale, history = getattr(state, "scale", None), getattr(state, "amax_history", None)
        if isinstance(scale, torch.Tensor) and isinstance(history, torch.Tensor):
            out[f"scale_{direction}"], out[f"amax_history_{direction}"] = scale, history
    return out


def restore_delayed(name: str, module: torch.nn.Module, saved: Mapping[str, torch.Tensor], recipe: Any,
                    num_gemms: int = 1) -> None:
    """A checkpoint's delayed tensors into `module`, whose state is built for `recipe` first (ConfigError, one
    line, when the shapes differ: another amax_history_len)."""
    meta = module.fp8_meta
    # TE's Linear and LayerNormLinear run one GEMM; its DotProductAttention keeps the state of three (its own
    # init_fp8_metadata(num_gemms=3)), a GroupedLinear one per expert
    meta.setdefault("num_gemms", num_gemms)
    meta["recipe"] = recipe
    with torch.no_grad():
        module.init_fp8_meta_tensors(recipe)  # allocates the state the next FP8 forward will find and keep
        current = delayed_tensors(module)
        for key, value in saved.items():
            if key not in current or current[key].shape != value.shape:
                have = tuple(current[key].shape) if key in current else None
                raise ConfigError(f"{name}: delayed-scaling {key} has shape {tuple(value.shape)} in the checkpoint "
                                  f"and {have} here; resume with the recipe it was saved with (amax_history_len), "
                                  f"or set trainer.reset_scaling_state=true")
            current[key].copy_(value)


class StepSnapshot:
    """The delayed-scaling state of TE modules as a step found it, put back when the step is skipped (a non-finite
    loss or gradient): the emulated backend forgets a skipped step's amaxes before they reach a history, but TE has
    rolled them in already (at each micro-batch's autocast exit and after the backward) and may have updated the
    scales from them between micro-batches. A non-finite amax left in a history keeps its scale where it is until it
    leaves the window (TE's update keeps the scale when the window's amax is not finite); a huge finite one shrinks
    the scale for as long. :meth:`take` at the start of a step (into buffers kept from step to step: one fused copy),
    :meth:`restore` when it is skipped; state a module first built during the skipped step starts as TE starts it."""

    def __init__(self) -> None:
        self._saved: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}

    def take(self, modules: Sequence[torch.nn.Module]) -> None:
        saved, dst, src = {}, [], []
        for m in modules:
            for key, live in delayed_tensors(m).items():
                old = self._saved.get((id(m), key))
                if old is not None and old[0] is live:
                    dst.append(old[1])
                    src.append(live)
                    saved[(id(m), key)] = old
                else:
                    saved[(id(m), key)] = (live, live.detach().clone())
        if dst:
            torch._foreach_copy_(dst, src)
        self._saved = saved

    def restore(self, modules: Sequence[torch.nn.Module]) -> None:
        dst, src = [], []
        for m in modules:
            for key, live in delayed_tensors(m).items():
                old = self._saved.get((id(m), key))
                if old is not None and old[0] is live:
                    dst.append(live)
                    src.append(old[1])
                elif key.startswith("amax_history"):
                    live.zero_()
                else:
                    live.fill_(1.0)
        if dst:
            with torch.no_grad():
                torch._foreach_copy_(dst, src)


# ---------------------------------------------------------------------------------------------------------------
# A new recipe mid-run


def delayed_slots(choice: TERecipe | None, slots: int, fwd: bool) -> list[tuple[int, Role | None]]:
    """(slot, role) of each of a linear's `slots` quantizer slots that its delayed state holds under `choice`, in
    the state's column order: every slot under DelayedScaling (role None for a boundary slot), the delayed roles'
    slots under a CustomRecipe (where :class:`~fp8_recipes.backends.te.RoleQuantizers` asks for a
    DelayedScalingRequest), or its boundary slots in the direction it anchors (``TERecipe.delayed_anchor``), none
    otherwise."""
    if choice is None or choice.recipe not in (TERecipeKind.DELAYED, TERecipeKind.CUSTOM):
        return []
    names = _SLOTS[fwd]
    roles = [SLOT_ROLES.get(names[i % len(names)]) for i in range(slots)]
    if choice.recipe is TERecipeKind.DELAYED:
        return list(enumerate(roles))
    if choice.delayed_anchor is fwd:
        return [(i, None) for i, r in enumerate(roles) if r is None]
    return [(i, r) for i, r in enumerate(roles) if r is not None and choice.delayed_role(r)]


def delayed_column(choice: TERecipe | None, num_gemms: int, role: Role, gemm: int = 0) -> tuple[str, int] | None:
    """Where a TE linear of `num_gemms` GEMMs keeps the delayed scale of `role` in its GEMM `gemm` under `choice`:
    (``scale_fwd`` | ``scale_bwd``, column); None when that operand has no delayed state there."""
    fwd = role is not Role.GRADIENTS
    names = _SLOTS[fwd]
    slot = gemm * len(names) + names.index(next(n for n, r in SLOT_ROLES.items() if r is role))
    columns = [s for s, _ in delayed_slots(choice, num_gemms * len(names), fwd)]
    return (f"scale_{'fwd' if fwd else 'bwd'}", columns.index(slot)) if slot in columns else None


def carry_delayed(old: tuple[torch.Tensor, torch.Tensor, list[tuple[int, Role | None]], TERecipe] | None,
                  history: torch.Tensor, scale: torch.Tensor, slots: list[tuple[int, Role | None]],
                  choice: TERecipe) -> None:
    """Fill one direction of a module's new delayed state (`history` (length, n), `scale` (n,): in place; `slots`
    its columns under `choice`) from the old one (history, scale, slots, TERecipe; None: nothing to carry). A slot
    both hold keeps its column and scale when its policy is unchanged, else its history resized (the newest amaxes
    kept) and its scale taken again under the new policy; a slot the old state did not hold starts as TE starts one
    (no amax, scale 1)."""
    history.zero_()
    scale.fill_(1.0)
    if old is None:
        return
    old_history, old_scale, old_slots, old_choice = old
    column = {slot: k for k, (slot, _) in enumerate(old_slots)}
    for k, (slot, role) in enumerate(slots):
        j = column.get(slot)
        if j is None:
            continue
        before, after = (None, None) if role is None else (old_choice.policy(role), choice.policy(role))
        if before == after and old_history.shape[0] == history.shape[0]:
            history[:, k], scale[k] = old_history[:, j], old_scale[j]
            continue
        history[:, k] = resized_history(old_history[:, j], history.shape[0])
        scale[k] = old_scale[j] if after is None else retaken_scale(history[:, k], old_scale[j], after)


def move_delayed(module: torch.nn.Module, recipe: Any, old: TERecipe | None, new: TERecipe,
                 autocast: Callable[[], ContextManager]) -> None:
    """Rebuild the TE module's quantizers and delayed state for `recipe` (the TE recipe object of `new`), carrying
    the state it held under `old` (None: start afresh, e.g. back from BF16). ``autocast()``: TE's autocast with
    `recipe`, entered for the rebuild, because TE's linears finish their quantizers from the autocast's recipe
    (``set_meta_tensor`` reads ``FP8GlobalStateManager.get_fp8_recipe()``: current scaling's per-role options, a
    GroupedLinear's custom-recipe flag); under no_grad its exit reduces and updates nothing. A module that never
    ran FP8 has nothing to move: TE builds its state at its first FP8 forward."""
    meta = getattr(module, "fp8_meta", None)
    if not getattr(module, "fp8_meta_tensors_initialized", False) or not meta or "num_gemms" not in meta:
        return
    before = {k: v.detach().clone() for k, v in delayed_tensors(module).items()}
    meta["recipe"] = recipe
    module.fp8_meta_tensors_initialized = False  # (else TE keeps the quantizers of a recipe of the same class)
    # Nothing for the new state to inherit: a CustomRecipe's would take over the old delayed sub-state whenever its
    # slot count, dtype and history length match, with the DelayedScaling TE built from the old requests (their
    # margin, algorithm, scale rule), which then keys and updates it. The values are carried below.
    meta.pop("scaling_fwd", None)
    meta.pop("scaling_bwd", None)
    with torch.no_grad(), autocast():
        module.init_fp8_meta_tensors(recipe)
        now = delayed_tensors(module)
        for fwd, d in ((True, "fwd"), (False, "bwd")):
            if f"scale_{d}" not in now:
                continue
            n = meta["num_gemms"] * len(_SLOTS[fwd])
            carried = None
            if old is not None and f"scale_{d}" in before:
                carried = (before[f"amax_history_{d}"], before[f"scale_{d}"], delayed_slots(old, n, fwd), old)
            carry_delayed(carried, now[f"amax_history_{d}"], now[f"scale_{d}"], delayed_slots(new, n, fwd), new)
    getattr(module, "_fp8_workspaces", {}).clear()  # cached FP8 weights belong to the old quantizers


def reregister(manager: Any, modules: Sequence[torch.nn.Module]) -> None:
    """Empty TE's global amax buffers (`manager`: its FP8GlobalStateManager) and forget every module's place in them,
    so that each registers again at its next FP8 forward under the recipe it runs now (TE registers a module once,
    under its first recipe). Between steps only: the buffers hold nothing pending then."""
    state = manager.quantization_state
    for buffer in (state.global_amax_buffer, state.global_amax_history_buffer, state.global_scale_buffer):
        buffer.clear()
    place = manager.get_buffer_info()  # the fp8_meta key of a module's place in the buffers
    for module in modules:
        meta = getattr(module, "fp8_meta", None)
        if isinstance(meta, dict):
            meta.pop(place, None)
