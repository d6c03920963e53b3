"""The autopilot's config and decisions on constructed statistics: numerics rows shaped like a real run's, written
for the policy each module runs under in the autopilot's current recipe (a module it put in BF16 stops reporting,
a module it moved to current scaling reports tensorwise rows), with failures planted per module and role.

Each rule acts on its planted failure and on nothing else; hysteresis, cool-down, caps, dry run, role-wide
actions, re-promotion, the recovery and a checkpoint round trip mid-streak are checked on the same rows.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from fp8_recipes.observe.autopilot import Action, Autopilot, AutopilotState, apply, read_rows
from fp8_recipes.observe.autopilot_actions import is_bf16_module
from fp8_recipes.observe.autopilot_config import ACTION_KINDS, AutopilotConfig, autopilot_config
from fp8_recipes.observe.doctor_findings import LIMITS
from fp8_recipes.recipe.pack import load_recipe
from fp8_recipes.recipe.schema import Format, Recipe, RecipeError, Role, Scaling
from test_doctor import healthy_row as doctor_healthy_row  # (the doctor's tests' rows: one home)

ROOT = Path(__file__).resolve().parents[2]
LAYERS = 4
LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
MODULES = [f"decoder.layers.{layer}.{linear}" for layer in range(LAYERS) for linear in LINEARS]
TARGET = "decoder.layers.2.mlp.linear_fc2"
OTHER = "decoder.layers.1.self_attention.linear_qkv"
OPERANDS = (("fprop", "activations"), ("fprop", "weights"), ("dgrad", "gradients"))
INTERVAL = 10
CONFIG = AutopilotConfig(enabled=True, interval=INTERVAL)  # patience 3, cool-down 50 steps, calm 10
TENSORWISE_E4M3_GRADS = {"name": "tw43", "weights": "tensorwise", "activations": "tensorwise",
                         "gradients": {"scaling": "tensorwise", "format": "e4m3"}}


def stat_steps(first: int, count: int) -> list[int]:
    """`count` statistics steps from `first` on, every INTERVAL steps (1, 11, 21, ... as debug.interval gives)."""
    return [first + INTERVAL * i for i in range(count)]


def healthy_row(step: int, module: str, gemm: str, role: str, policy: str) -> dict:
    """test_doctor.py's healthy row; an NVFP4 operand with what a healthy one shows (beyond the FP8 limits)."""
    row = doctor_healthy_row(step, module, gemm, role, policy)
    if policy.startswith("nvfp4"):
        row.update(underflow_pct=25.0, cosine=0.989)
    return row


def numerics(step: int, recipe: Recipe, poison=None, modules=MODULES) -> list[dict]:
    """One statistics step's rows: every module and role that runs FP8 under `recipe`, then `poison(row)`."""
    rows = []
    for module in modules:
        if is_bf16_module(recipe, module):
            continue
        for gemm, role in OPERANDS:
            policy = recipe.module_policy(module, role)
            if policy.is_fp8:
                row = healthy_row(step, module, gemm, role, policy.describe())
                if poison is not None:
                    poison(row)
                rows.append(row)
    return rows


def run(pilot: Autopilot, steps, poison=None, **kw) -> list[Action]:
    """Feed the rows of each step (under the recipe the autopilot has at that step); every action returned."""
    out = []
    for step in steps:
        out += pilot.observe(step, numerics(step, pilot.recipe, poison), **kw)
    return out


def planted(module: str = TARGET, role: str = "activations", scaling: str | None = None, start: int = 11, **values):
    """A poison: from step `start` on, `module`'s `role` rows (under `scaling`, if given) get `values`."""
    def poison(row: dict) -> None:
        if (row["module"] == module or module == "*") and row["role"] == role and row["step"] >= start and (
                scaling is None or row["policy"].startswith(scaling)):
            row.update(values)
    return poison


STALE = dict(underflow_pct=8.0, scale_ratio=0.001)  # a history that remembers 1000x larger values


# ---------------------------------------------------------------------------------------------------------------
# Config


def test_off_by_default_and_when_off_does_nothing():
    assert AutopilotConfig().enabled is False and autopilot_config(None).enabled is False
    assert yaml.safe_load((ROOT / "conf" / "autopilot" / "off.yaml").read_text()) == {"enabled": False}
    pilot = Autopilot(autopilot_config(None), load_recipe("delayed"))
    assert run(pilot, stat_steps(1, 20), planted(**STALE)) == []
    assert pilot.recipe == load_recipe("delayed") and pilot.state_dict() == AutopilotState().to_dict()


def test_settings_it_cannot_act_on_get_one_warning_each():
    """Keys set while off do nothing; NVFP4 operands get only the non-finite recovery; none for a plain FP8 run."""
    from fp8_recipes.plan.precision import ModelLayout, PrecisionPlan
    from fp8_recipes.training.autopilot import autopilot_notices

    layout = ModelLayout.gpt(4)
    delayed, nvfp4 = (PrecisionPlan(load_recipe(n), layout) for n in ("delayed", "nvfp4"))
    off, on = autopilot_config({"enabled": False, "dry_run": True, "patience": 2}), autopilot_config({"enabled": True})
    (line,) = autopilot_notices({"enabled": False, "dry_run": True, "patience": 2}, off, delayed, 100)
    assert line.startswith("autopilot.dry_run (and patience) does nothing: the autopilot is off")
    assert autopilot_notices({"enabled": False}, off, delayed, 100) == []
    preset = yaml.safe_load((ROOT / "conf" / "autopilot" / "on.yaml").read_text())  # autopilot=on ++...enabled=false
    assert autopilot_notices({**preset, "enabled": False}, autopilot_config({**preset, "enabled": False}), delayed,
                             100) == []
    assert autopilot_notices({"enabled": True}, on, delayed, 100) == []
    (line,) = autopilot_notices({"enabled": True}, on, nvfp4, 100)
    assert "NVFP4 operands (8 module(s)" in line and "non-finite recovery only" in line
    # a run too short for patience statistics steps in a row (the preset's 3 x every 10: step 21)
    preset_on = autopilot_config({**preset, "enabled": True})
    assert autopilot_notices({**preset, "enabled": True}, preset_on, delayed, 21) == []
    (line,) = autopilot_notices({**preset, "enabled": True}, preset_on, delayed, 20)
    assert line.startswith("autopilot: it acts after autopilot.patience=3 statistics steps in a row, one every "
                           "autopilot.interval=10 steps: at step 21 at the earliest, after trainer.max_steps=20")


@pytest.mark.parametrize("recipe, actions, says", [
    ("delayed", ["repromote"], "repromote (nothing demotes a module without to_bf16 in the list) cannot act under "
                               "recipe delayed; so the autopilot changes nothing; list an action"),
    ("tensorwise", ["shorten_history"], "shorten_history (no role uses delayed scaling) cannot act under recipe "
                                        "tensorwise; so the autopilot changes nothing"),
    ("delayed", ["to_e5m2", "to_bf16"], "to_e5m2 (no E4M3 FP8 gradients to widen) cannot act under recipe delayed; "
                                        "drop it"),
    ("hybrid", ["to_current", "to_bf16", "repromote"], "to_current (no role uses delayed scaling) cannot act"),
    ("delayed", ["shorten_history", "to_current", "to_bf16", "repromote"], None),
    ("mxfp8", ["to_e5m2"], None),  # (E4M3 gradients)
    ("tensorwise", list(ACTION_KINDS), None),  # (the default list: each kind waits for a recipe it fits)
], ids=["repromote-alone", "no-delayed-role", "gradients-e5m2", "one-of-three", "all-act", "e4m3-gradients",
        "default-list"])
def test_action_lists_that_cannot_act_get_one_warning(recipe, actions, says):
    """Listed actions the recipe gives nothing to act on were accepted silently: one line naming
    autopilot.actions and each of them."""
    from fp8_recipes.plan.precision import ModelLayout, PrecisionPlan
    from fp8_recipes.training.autopilot import autopilot_notices

    raw = {"enabled": True, "actions": actions}
    lines = autopilot_notices(raw, autopilot_config(raw), PrecisionPlan(load_recipe(recipe), ModelLayout.gpt(4)), 100)
    assert (lines == []) if says is None else (len(lines) == 1 and lines[0].startswith(f"autopilot.actions: {says}")), \
        lines


def test_a_run_with_no_fp8_gemm_says_the_autopilot_has_nothing_to_act_on(tmp_path, caplog):
    """`autopilot=on` without an FP8 recipe warned 'debug: recipe bf16 runs no GEMM in FP8', naming a section the
    user never set: one line naming the autopilot instead (debug's own line stays for a debug section given)."""
    import logging

    from hydra import compose, initialize_config_dir

    from fp8_recipes.training.run import _checked_run, _warn_notices

    for extra, debug_line in (([], False), (["++debug.interval=10"], True)):
        with initialize_config_dir(str(ROOT / "conf"), version_base=None):
            cfg = compose("train", overrides=["autopilot=on", "trainer.max_steps=2", "trainer.warmup_steps=1",
                                              f"run_dir={tmp_path / 'run'}", *extra])
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="fp8_recipes"):
            _warn_notices(_checked_run(cfg))
        said = [r.getMessage() for r in caplog.records]
        assert [m for m in said if m.startswith("autopilot")] == [
            "autopilot: nothing to act on: no GEMM runs FP8 in this run (recipe bf16), and the autopilot changes FP8 "
            "scaling per module and role; train with an FP8 recipe (+recipe=hybrid), or autopilot=off"], said
        assert any(m.startswith("debug: recipe bf16") for m in said) is debug_line, said


def test_defaults_are_the_doctors_limits():
    limits = AutopilotConfig().limits
    assert (limits.underflow_pct, limits.saturation_pct, limits.cosine_drop, limits.scale_gap) == (
        LIMITS["underflow_pct"], LIMITS["saturation_pct"], LIMITS["cosine_drop"], LIMITS["scale_gap"])


def test_every_bad_key_in_one_error():
    with pytest.raises(RecipeError) as e:
        autopilot_config({"enabled": True, "interval": 0, "patience": 0, "history_factor": 1.5, "calm_fraction": 1.0,
                          "actions": ["to_current", "to_fp4"], "limits": {"underflow_pct": -1, "cosine": 0.1},
                          "max_actions": "many", "colldown_steps": 5})
    lines = str(e.value).splitlines()
    expected = ["autopilot.interval: 0 with enabled: true", "autopilot.patience: 0 is out of range",
                "autopilot.history_factor: 1.5 is out of range", "autopilot.calm_fraction: 1.0 is out of range",
                "autopilot.actions[1]: 'to_fp4' is not one of", "autopilot.limits.underflow_pct: -1 is out of range",
                "autopilot.limits.cosine: unknown key (did you mean 'cosine_drop'?)",
                "autopilot.max_actions: 'many' is not an integer",
                "autopilot.colldown_steps: unknown key (did you mean 'cooldown_steps'?)"]
    for want in expected:
        assert any(line.startswith(want) for line in lines), (want, lines)
    assert len(lines) == len(expected)


def test_interval_zero_is_fine_when_off_and_actions_keep_their_order():
    assert autopilot_config({"interval": 0}).interval == 0
    cfg = autopilot_config({"enabled": True, "actions": ["to_bf16", "shorten_history"]})
    assert cfg.actions == ("shorten_history", "to_bf16")
    with pytest.raises(RecipeError, match=r"^autopilot\.actions: \[\] is not a non-empty list"):
        autopilot_config({"enabled": True, "actions": []})


def test_shipped_presets_validate():
    on = autopilot_config(yaml.safe_load((ROOT / "conf" / "autopilot" / "on.yaml").read_text()))
    assert on.enabled and not on.dry_run and on.actions == ACTION_KINDS
    assert dataclass_fields(on) == dataclass_fields(AutopilotConfig(enabled=True))  # the preset states the defaults


def test_on_preset_composes_through_hydra():
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(str(ROOT / "conf"), version_base=None):
        cfg = compose("train", overrides=["autopilot=on", "++autopilot.dry_run=true"])
    assert autopilot_config(dict(cfg.autopilot)).dry_run is True


def dataclass_fields(cfg: AutopilotConfig) -> dict:
    return {k: getattr(cfg, k) for k in AutopilotConfig.__dataclass_fields__}


# ---------------------------------------------------------------------------------------------------------------
# Healthy runs and hysteresis


@pytest.mark.parametrize("name", ["delayed", "tensorwise", "hybrid", "moe_delayed", "nvfp4"])
def test_healthy_rows_never_act(name):
    pilot = Autopilot(CONFIG, load_recipe(name))
    losses = [3.0 + 3.0 * math.exp(-i / 8) + 0.05 * math.sin(1.7 * i) for i in range(60)]
    actions = []
    for i, step in enumerate(stat_steps(1, 60)):
        actions += pilot.observe(step, numerics(step, pilot.recipe), loss=losses[i], grad_norm=1.0 + 0.1 * (i % 3))
    assert actions == [] and pilot.recipe == load_recipe(name)
    assert pilot.on_nonfinite(600, 1) is None  # one non-finite step is the trainer's to skip


def test_one_flagged_step_does_nothing_patience_in_a_row_acts():
    pilot = Autopilot(CONFIG, load_recipe("delayed"))
    blip = planted(start=11, **STALE)
    assert pilot.observe(11, numerics(11, pilot.recipe, blip)) == []
    assert run(pilot, stat_steps(21, 5)) == []                          # healthy again: the streak is over
    assert run(pilot, stat_steps(71, 2), planted(start=71, **STALE)) == []  # two in a row: not yet
    (action,) = run(pilot, [91], planted(start=91, **STALE))           # the third in a row acts
    assert (action.step, action.module, action.role, action.kind) == (91, TARGET, "activations", "shorten_history")
    assert "steps 71, 81, 91" in action.reason and "scale 0.001x" in action.reason


# ---------------------------------------------------------------------------------------------------------------
# The rules


def test_stale_history_is_shortened_then_current_scaling():
    pilot = Autopilot(CONFIG, load_recipe("delayed"))
    actions = run(pilot, stat_steps(1, 20), planted(scaling="delayed", **STALE))
    assert [(a.step, a.kind) for a in actions] == [(31, "shorten_history"), (81, "to_current")]
    # flagged at 11, 21, 31: a window of the 21 steps since (not 2/3 of 1024, which still holds the stale amax)
    assert actions[0].before == "delayed e4m3 hist 1024 max" and actions[0].after == "delayed e4m3 hist 21 max"
    assert actions[0].changes == {"modules": {TARGET: {"activations": {
        "scaling": "delayed", "format": "e4m3", "margin": 0, "amax_history_len": 21, "amax_compute_algo": "max",
        "pow2_scales": False}}}}
    assert "still after shorten_history" in actions[1].reason and actions[1].after == "tensorwise e4m3"
    r = pilot.recipe
    assert r.module_policy(TARGET, "activations").scaling is Scaling.TENSORWISE
    assert r.module_policy(TARGET, "weights") == r.weights and r.module_policy(OTHER, "activations") == r.activations
    assert r == apply(load_recipe("delayed"), actions) == Recipe.from_dict(r.to_dict())


def test_a_stale_scale_that_loses_nothing_is_not_acted_on():
    """The history still holds the first steps' larger amaxes (scale 1/100 of the current one) but nothing
    underflows and the cosine holds (E5M2 gradients on tiny_moe, measured): no action, and not calm either."""
    pilot = Autopilot(CONFIG, load_recipe("delayed"))
    wasted = planted(role="gradients", scaling="delayed", scale_ratio=0.01, underflow_pct=0.0)
    assert run(pilot, stat_steps(1, 20), wasted) == []
    costly = planted(role="gradients", scaling="delayed", scale_ratio=0.01, underflow_pct=0.6)  # half the limit
    assert [a.kind for a in run(Autopilot(CONFIG, load_recipe("delayed")), stat_steps(1, 4), costly)] == [
        "shorten_history"]


def test_an_underflow_the_cosine_does_not_show_is_not_acted_on():
    """E5M2 gradients flushing 2-3 % of their smallest values with the cosine at 0.9986 (the H100 gpt_125m shoot-out,
    delayed and fast, from step ~260): no action; the same underflow with the cosine down to 0.993 acts."""
    costless = planted(role="gradients", underflow_pct=3.0, cosine=0.9986)
    assert run(Autopilot(CONFIG, load_recipe("delayed")), stat_steps(1, 20), costless) == []
    costly = planted(role="gradients", underflow_pct=3.0, cosine=0.993)
    (first, *_) = run(Autopilot(CONFIG, load_recipe("delayed")), stat_steps(1, 5), costly)
    assert first.kind == "to_bf16" and "underflow 3.00% (dgrad, cosine 0.9930)" in first.reason, first.reason


def test_a_tensor_nearly_all_flushed_acts_whatever_its_cosine():
    """An outlier channel keeps the cosine near 1 (the channel carries the norm) while every other value is
    flushed: 99.8 % underflow at cosine 0.9996 acts (FLUSHED_PCT); the healthy runs' worst, 32 % at 0.9994, does not."""
    outlier = planted(role="activations", underflow_pct=99.8, cosine=0.9996)
    (first, *_) = run(Autopilot(CONFIG, load_recipe("delayed")), stat_steps(1, 5), outlier)
    assert first.kind == "to_bf16" and "underflow 99.80% (fprop, cosine 0.9996)" in first.reason, first.reason
    healthy = planted(role="gradients", underflow_pct=32.0, cosine=0.9994)
    assert run(Autopilot(CONFIG, load_recipe("delayed")), stat_steps(1, 20), healthy) == []


def test_a_short_history_goes_to_current_scaling_at_once():
    recipe = Recipe.from_dict({"name": "short", "weights": "delayed",
                               "activations": {"scaling": "delayed", "amax_history_len": 16}, "gradients": "delayed"})
    (action,) = run(Autopilot(CONFIG, recipe), stat_steps(1, 4), planted(**STALE))
    assert action.kind == "to_current" and action.before == "delayed e4m3 hist 16 max"


def test_clipping_under_delayed_goes_to_current_scaling():
    clip = planted(role="gradients", scaling="delayed", saturation_pct=6.0, scale_ratio=9.0)
    pilot = Autopilot(CONFIG, load_recipe("delayed"))
    (action,) = run(pilot, stat_steps(1, 12), clip)
    assert (action.kind, action.role, action.after) == ("to_current", "gradients", "tensorwise e5m2")
    assert pilot.recipe.module_policy(TARGET, Role.GRADIENTS).format is Format.E5M2  # format and margin kept


def test_e4m3_gradients_underflowing_go_to_e5m2_then_bf16():
    pilot = Autopilot(CONFIG, Recipe.from_dict(TENSORWISE_E4M3_GRADS))
    actions = run(pilot, stat_steps(1, 12), planted(role="gradients", underflow_pct=5.0, cosine=0.993))
    assert [(a.step, a.kind) for a in actions] == [(31, "to_e5m2"), (81, "to_bf16")]
    assert actions[1].changes == {"layers.bf16_modules": [TARGET]} and actions[1].after == "bf16"
    assert pilot.recipe.layers.bf16_modules == (TARGET,)
    assert pilot.recipe.module_policy(TARGET, "gradients").format is Format.E5M2  # the policy kept for re-promotion


def test_a_cosine_drop_demotes_and_calm_repromotes_once():
    pilot = Autopilot(CONFIG, load_recipe("tensorwise"))
    actions = run(pilot, stat_steps(1, 3), planted(start=1, cosine=0.95))
    assert [(a.step, a.kind, a.changes) for a in actions] == [(21, "to_bf16", {"layers.bf16_modules": [TARGET]})]
    # BF16 from step 22: the module reports nothing; calm counts from the end of the cool-down (step 71), and a
    # grad-norm spike at step 121 starts it again
    norms = {s: (50.0 if s == 121 else 1.0) for s in stat_steps(31, 30)}
    back = []
    for step in stat_steps(31, 30):
        back += pilot.observe(step, numerics(step, pilot.recipe), grad_norm=norms[step])
    assert [(a.step, a.kind, a.before, a.after) for a in back] == [(221, "repromote", "bf16", "tensorwise e4m3")]
    assert pilot.recipe == load_recipe("tensorwise")
    # the trouble again: demoted again, and for good
    again = run(pilot, stat_steps(331, 30), planted(start=331, cosine=0.95))
    assert [a.kind for a in again] == ["to_bf16"] and pilot.recipe.layers.bf16_modules == (TARGET,)


def test_an_mse_jump_supports_but_never_acts_alone():
    """MSE / amax^2 jumping 1000x its own median (the doctor's supporting mse_jump): no action on its own, but not
    calm either: a demoted module is not re-promoted while its role's rows jump; the median is kept per track and
    starts afresh after an action."""
    tensorwise = load_recipe("tensorwise")
    pilot = Autopilot(CONFIG, tensorwise)
    assert run(pilot, stat_steps(1, 10), planted(start=41, mse=1e-3)) == []  # healthy rows: mse 1e-6, amax 1
    track = pilot.state.tracks[f"{TARGET}|activations"]
    assert len(track.mse) == 10 and track.mse[-1] == pytest.approx(1e-3)
    # demoted for a cosine drop; then calm rows, but the role's MSE keeps jumping in the modules still FP8: no return
    pilot = Autopilot(CONFIG, tensorwise)
    assert [a.kind for a in run(pilot, stat_steps(1, 3), planted(start=1, cosine=0.95))] == ["to_bf16"]
    steady = Autopilot(CONFIG, tensorwise)
    run(steady, stat_steps(1, 3), planted(start=1, cosine=0.95))
    assert [(a.step, a.kind) for a in run(steady, stat_steps(31, 30))] == [(161, "repromote")]
    # from step 101 (calm counted from 81) the role's MSE is 1000x: those steps are not calm until its median has
    # caught up (6 of its 10 steps), and the calm count starts again
    jumping = planted(module="*", start=101, mse=1e-3)
    assert [(a.step, a.kind) for a in run(pilot, stat_steps(31, 30), jumping)] == [(241, "repromote")]
    assert not read_rows([{**doctor_healthy_row(1, TARGET, "fprop", "activations", "tensorwise e4m3"),
                           "mse": 1e-3}], CONFIG, mse_median=lambda m, r: 1e-6)[(TARGET, "activations")].calm


def test_allowed_actions_and_the_callers_veto_pick_the_next_remedy():
    only_bf16 = AutopilotConfig(enabled=True, actions=("to_bf16",))
    (action,) = run(Autopilot(only_bf16, load_recipe("delayed")), stat_steps(1, 4), planted(**STALE))
    assert action.kind == "to_bf16"

    def refuse_history(recipe: Recipe) -> str | None:  # e.g. the run's plan check: None = it can run this recipe
        return "no" if recipe.module_policy(TARGET, "activations").amax_history_len < 1024 else None

    (action,) = run(Autopilot(CONFIG, load_recipe("delayed"), accept=refuse_history), stat_steps(1, 4),
                    planted(**STALE))
    assert action.kind == "to_current"
    none = AutopilotConfig(enabled=True, actions=("to_e5m2",))
    assert run(Autopilot(none, load_recipe("delayed")), stat_steps(1, 10), planted(**STALE)) == []


# ---------------------------------------------------------------------------------------------------------------
# Role-wide, cool-down, caps, dry run


def test_a_role_flagged_in_half_the_modules_gets_one_role_wide_action():
    half = set(MODULES[::2])  # 8 of 16

    def poison(row):
        if row["module"] in half and row["role"] == "gradients" and row["policy"] == "tensorwise e4m3":
            row.update(underflow_pct=3.0, cosine=0.993)  # (E5M2 has the range: fixed by the action)

    pilot = Autopilot(CONFIG, Recipe.from_dict(TENSORWISE_E4M3_GRADS))
    actions = run(pilot, stat_steps(1, 12), poison)
    assert [(a.module, a.role, a.kind) for a in actions] == [("*", "gradients", "to_e5m2")]
    assert actions[0].changes == {"gradients.format": "e5m2"} and "8 of 16 gradients linears" in actions[0].reason
    assert pilot.recipe.gradients.format is Format.E5M2 and pilot.recipe.modules == ()
    # seven modules are not half: one action per module, the worst first, one per statistics step
    def seven(row):  # the later the module, the worse
        if MODULES.index(row["module"]) < 7 and row["role"] == "gradients" and row["step"] >= 11:
            row.update(underflow_pct=3.0 + MODULES.index(row["module"]), cosine=0.993)

    pilot = Autopilot(CONFIG, Recipe.from_dict(TENSORWISE_E4M3_GRADS))
    actions = run(pilot, stat_steps(1, 5), seven)
    assert [(a.step, a.module) for a in actions] == [(31, MODULES[6]), (41, MODULES[5])]
    # no valid role-wide remedy (safe enables weights at step 100: they cannot all be BF16): one module at a time,
    # the worst first, then by name
    def half_weights(row):
        if row["module"] in half and row["role"] == "weights":
            row["cosine"] = 0.9

    pilot = Autopilot(CONFIG, load_recipe("safe"))
    actions = run(pilot, stat_steps(1, 4), half_weights)
    assert [(a.step, a.module, a.kind) for a in actions] == [(21, MODULES[2], "to_bf16"), (31, MODULES[0], "to_bf16")]


def test_role_wide_to_bf16_keeps_module_entries_valid_and_comes_back():
    recipe = load_recipe("moe_delayed")  # modules: "*.experts.*" with its own delayed policies
    pilot = Autopilot(AutopilotConfig(enabled=True, actions=("to_bf16", "repromote")), recipe)
    actions = run(pilot, stat_steps(1, 4), planted(module="*", role="weights", cosine=0.9))
    assert [(a.module, a.role, a.kind) for a in actions] == [("*", "weights", "to_bf16")]
    assert pilot.recipe.weights.scaling is Scaling.NONE
    assert pilot.recipe.module_policy("decoder.layers.0.mlp.experts.local_experts.1.linear_fc1", "weights").scaling \
        is Scaling.NONE
    back = run(pilot, stat_steps(41, 16))
    assert [a.kind for a in back] == ["repromote"] and pilot.recipe == recipe


def test_cooldown_holds_the_next_action():
    cfg = AutopilotConfig(enabled=True, cooldown_steps=100)
    actions = run(Autopilot(cfg, load_recipe("delayed")), stat_steps(1, 20), planted(scaling="delayed", **STALE))
    assert [(a.step, a.kind) for a in actions] == [(31, "shorten_history"), (131, "to_current")]


def test_caps_per_step_and_in_total():
    cosine = {TARGET: 0.8, OTHER: 0.9}  # TARGET the worse: it goes first

    def both(row):
        if row["module"] in cosine and row["role"] == "weights":
            row["cosine"] = cosine[row["module"]]

    pilot = Autopilot(CONFIG, load_recipe("tensorwise"))
    assert [(a.step, a.module) for a in run(pilot, stat_steps(1, 5), both)] == [(21, TARGET), (31, OTHER)]
    pilot = Autopilot(AutopilotConfig(enabled=True, max_actions=1), load_recipe("tensorwise"))
    actions = run(pilot, stat_steps(1, 30), both)
    assert [a.kind for a in actions] == ["to_bf16", "cap_reached"] and actions[1].changes == {}
    assert "max_actions=1 reached" in actions[1].reason
    assert pilot.recipe.layers.bf16_modules == (TARGET,)


def test_dry_run_changes_nothing():
    pilot = Autopilot(AutopilotConfig(enabled=True, dry_run=True), load_recipe("delayed"))
    actions = run(pilot, stat_steps(1, 20), planted(scaling="delayed", **STALE))
    # said once per cool-down, never escalated: nothing was applied
    assert [(a.step, a.kind, a.dry) for a in actions] == [(s, "shorten_history", True) for s in (31, 81, 131, 181)]
    assert pilot.recipe == load_recipe("delayed") and pilot.actions == []
    assert apply(load_recipe("delayed"), actions) == load_recipe("delayed")  # dry actions are never applied
    assert "(dry run)" in actions[0].line()


# ---------------------------------------------------------------------------------------------------------------
# Checkpoints, apply(), recovery


def test_state_round_trip_mid_streak_gives_the_same_future():
    poison = planted(scaling="delayed", **STALE)
    a = Autopilot(CONFIG, load_recipe("delayed"))
    first = run(a, stat_steps(1, 6), poison, loss=3.0, grad_norm=1.0)  # shortened at 31, flagged at 41 and 51
    assert [x.kind for x in first] == ["shorten_history"] and a.state.tracks[f"{TARGET}|activations"].flagged == 2
    state = json.loads(json.dumps(a.state_dict()))
    b = Autopilot.from_state_dict(CONFIG, load_recipe("delayed"), state)
    assert b.recipe == a.recipe and b.state_dict() == a.state_dict()
    future = stat_steps(61, 30)
    got_a, got_b = run(a, future, poison, loss=3.0, grad_norm=1.0), run(b, future, poison, loss=3.0, grad_norm=1.0)
    assert [x.to_dict() for x in got_a] == [x.to_dict() for x in got_b] and [x.kind for x in got_a] == ["to_current"]
    assert a.state_dict() == b.state_dict()


def test_apply_validates_and_gives_the_new_module_policy():
    recipe = load_recipe("moe_delayed")
    expert = "decoder.layers.0.mlp.experts.local_experts.3.linear_fc2"
    pilot = Autopilot(CONFIG, recipe)

    def rows(step):  # one expert's rows (under its current policies), its delayed activations' scale stale (costly)
        out = [healthy_row(step, expert, g, r, pilot.recipe.module_policy(expert, r).describe()) for g, r in OPERANDS]
        return [row | ({"scale_ratio": 0.001, "underflow_pct": 2.0} if row["role"] == "activations" and step > 1
                       and "scale_ratio" in row else {}) for row in out]

    actions = [a for step in stat_steps(1, 4) for a in pilot.observe(step, rows(step))]
    assert [(a.module, a.kind) for a in actions] == [(expert, "to_current")]  # a 16-step history: not shortened
    new = apply(recipe, actions)
    assert new == pilot.recipe and new.module_policy(expert, "activations").scaling is Scaling.TENSORWISE
    assert new.module_policy(expert, "weights") == recipe.module_policy(expert, "weights")  # its entry's, not 1024
    assert new.module_policy(expert, "weights").amax_history_len == 16
    assert new.module_policy("decoder.layers.0.mlp.experts.local_experts.2.linear_fc2", "activations") == \
        recipe.module_policy(expert, "activations")
    assert [m.pattern for m in new.modules] == [expert, "*.experts.*"]  # the new entry first: it wins
    bad = Action(1, "*", "gradients", "to_bf16", "", "", "", changes={"gradients.scaling": "none"})
    with pytest.raises(RecipeError, match="autopilot: schedule.enable.gradients"):
        apply(load_recipe("safe"), [bad])  # safe enables gradients at step 300: not valid with gradients BF16


def test_nonfinite_streak_recovers():
    pilot = Autopilot(CONFIG, load_recipe("moe_delayed"))
    assert pilot.on_nonfinite(40, 2) is None
    action = pilot.on_nonfinite(40, 3)
    assert (action.module, action.role, action.kind, action.recovery) == ("*", "*", "shorten_history", True)
    r = pilot.recipe
    assert [r.policy(role).amax_history_len for role in ("weights", "activations", "gradients")] == [686] * 3
    assert r.module_policy("decoder.layers.0.mlp.experts.local_experts.0.linear_fc1", "gradients").amax_history_len \
        == 10
    rows = numerics(41, r, planted(role="gradients", amax=math.inf, saturation_pct=0.5))
    action = pilot.on_nonfinite(45, 3, rows)
    assert (action.module, action.kind, action.changes) == (TARGET, "to_bf16", {"layers.bf16_modules": [TARGET]})
    assert "non-finite values" in action.reason
    pilot.observe(51, rows)  # a non-finite row in the tracks: the state stays strict JSON
    assert json.loads(json.dumps(pilot.state_dict(), allow_nan=False)) == pilot.state_dict()
    assert Autopilot(CONFIG, load_recipe("tensorwise")).on_nonfinite(40, 5) is None  # nothing delayed, no culprit
    one = Recipe.from_dict({"name": "h1", "weights": {"scaling": "delayed", "amax_history_len": 1}})
    assert Autopilot(CONFIG, one).on_nonfinite(40, 5) is None  # a history of 1 cannot be shortened


# ---------------------------------------------------------------------------------------------------------------
# The run's wiring (training/autopilot.py)


def test_the_run_records_statistics_for_the_autopilot_on_either_backend(caplog):
    from fp8_recipes.checks import ConfigError
    from fp8_recipes.observe.config import debug_config
    from fp8_recipes.plan.precision import Hardware, ModelLayout, PrecisionPlan
    from fp8_recipes.training.autopilot import check_autopilot, statistics_for

    on, off = autopilot_config({"enabled": True, "interval": 6}), autopilot_config(None)
    quiet = debug_config(None, None)
    assert statistics_for(off, quiet) is quiet and not quiet.enabled
    forced = statistics_for(on, quiet)  # every module and role, at the autopilot's steps
    assert forced.interval == 6 and [s for s in range(1, 20) if forced.stats_due(s)] == [1, 7, 13, 19]
    mine = debug_config(None, {"interval": 4})
    with caplog.at_level("WARNING"):
        assert statistics_for(on, mine) is mine
    assert "autopilot.interval=6 does nothing" in caplog.text
    emulated = PrecisionPlan(load_recipe("delayed"), ModelLayout.gpt(2), Hardware())
    check_autopilot(on, emulated)
    te = PrecisionPlan(load_recipe("delayed"), ModelLayout.gpt(2), Hardware.target((9, 0)))
    check_autopilot(on, te)
    stored = PrecisionPlan(apply_dict(load_recipe("tensorwise"), {"fp8_param": True}), ModelLayout.gpt(2),
                           Hardware.target((9, 0)))
    check_autopilot(off, stored)
    with pytest.raises(ConfigError, match=r"^autopilot.enabled: FP8-stored weights .* set recipe.fp8_param=false"):
        check_autopilot(on, stored)


class Inner:
    """The precision controller AutopilotPrecision wraps, as far as these tests reach it."""

    full_precision_eval_interval = 0

    def __init__(self):
        self.plans = []

    def replan(self, plan):
        self.plans.append(plan)


def apply_dict(recipe: Recipe, changes: dict) -> Recipe:
    return Recipe.from_dict({**recipe.to_dict(), **changes})


def test_on_te_an_action_te_would_not_run_as_asked_is_vetoed():
    """TE keeps one delayed state for a module's inputs and weights: a shorter history for one module's activations
    alone is a substitution there (TE would run it unchanged), so the autopilot's veto refuses it and the next
    remedy, current scaling for those activations (a CustomRecipe), is taken. The emulated backend runs both."""
    from fp8_recipes.plan.precision import Hardware, ModelLayout, PrecisionPlan
    from fp8_recipes.training.autopilot import AutopilotPrecision

    checked = []
    for hardware, backend in ((Hardware.target((9, 0)), "te"), (Hardware(), "emulated")):
        plan = PrecisionPlan(apply_dict(load_recipe("delayed"), {"backend": "auto"}), ModelLayout.gpt(LAYERS),
                             hardware)
        assert str(plan.backend) == backend
        pilot = AutopilotPrecision(Inner(), None, plan, CONFIG, ".", check=checked.append).pilot
        for step in stat_steps(11, CONFIG.patience):
            rows = numerics(step, pilot.recipe, poison=lambda r: r.update(underflow_pct=5.0, scale_ratio=0.001)
                            if (r["module"], r["role"]) == (TARGET, "activations") else None)
            taken = pilot.observe(step, rows)
        assert [a.kind for a in taken] == (["to_current"] if backend == "te" else ["shorten_history"]), taken
    assert checked  # the run's own checks saw every candidate plan
    te = PrecisionPlan(load_recipe("delayed"), ModelLayout.gpt(LAYERS), Hardware.target((9, 0)))
    vetoed = AutopilotPrecision(Inner(), None, te, CONFIG, ".")._accept(
        apply_dict(load_recipe("delayed"), {"backend": "auto", "modules": {TARGET: {"activations": {
            "scaling": "delayed", "amax_history_len": 12}}}}))
    assert vetoed is not None and f"would not run {TARGET} activations as asked" in vetoed, vetoed


def test_a_plan_txt_that_cannot_be_written_is_a_warning_and_the_action_holds(tmp_path, caplog):
    """Rank 0 alone appends the new plan to plan.txt; the other ranks took the same action and go on, so a failing
    write (here plan.txt is a directory) must not stop rank 0: one warning, the backend replanned, the row logged."""
    from fp8_recipes.plan.precision import Hardware, ModelLayout, PrecisionPlan
    from fp8_recipes.training.autopilot import AutopilotPrecision

    (tmp_path / "plan.txt").mkdir()
    plan = PrecisionPlan(load_recipe("delayed"), ModelLayout.gpt(LAYERS), Hardware())
    precision = AutopilotPrecision(Inner(), None, plan, CONFIG, tmp_path)
    demote = Action(11, TARGET, "activations", "to_bf16", "delayed", "bf16", "planted", False,
                    {"layers.bf16_modules": [TARGET]})
    precision.pilot._book(demote)  # (what observe() does with an action it takes)
    with caplog.at_level("WARNING"):
        precision._take([demote], 11)
    assert "autopilot: could not append the plan from step 12" in caplog.text
    assert precision._inner.plans and TARGET in precision.plan.recipe.layers.bf16_modules
    assert [e.row["action"] for e in precision.drain_events()] == ["to_bf16"]
