"""training/notices.py: a setting that the run's length makes do nothing is named in one warning line, with the
key to change; a run whose settings all take effect gets none."""

from __future__ import annotations

from fp8_recipes.observe.config import debug_config
from fp8_recipes.recipe.pack import load_recipe
from fp8_recipes.training.config import TrainerConfig
from fp8_recipes.training.notices import run_notices, schedule_notice


def notices(max_steps: int, recipe: str = "hybrid", warmup_steps: int = 0, debug=None) -> list[str]:
    trainer = TrainerConfig.from_cfg({"max_steps": max_steps, "warmup_steps": warmup_steps})
    return run_notices(trainer, load_recipe(recipe), debug_config(debug, None))


def test_a_run_whose_settings_all_take_effect_says_nothing():
    assert notices(200, "hybrid", warmup_steps=20) == []
    assert notices(400, "safe", warmup_steps=20) == []       # the README's safe run reaches FP8 gradients at 300
    assert notices(3, "bf16") == []                          # no FP8 role: nothing to reach


def test_lr_warmup_longer_than_the_run():
    (line,) = notices(15, "hybrid", warmup_steps=20)
    assert line.startswith("trainer.warmup_steps=20 is longer than the run (trainer.max_steps=15)")
    assert "over 1 step(s)" in line and "\n" not in line


def test_safe_inside_its_bf16_warmup_and_before_fp8_gradients():
    (line,) = notices(20, "safe")
    assert line.startswith("recipe.schedule.bf16_warmup_steps=100: the whole run (trainer.max_steps=20) is BF16")
    (line,) = notices(250, "safe")
    assert line.startswith("recipe.schedule.enable.gradients=300: gradients stay BF16 for the whole run "
                           "(trainer.max_steps=250: steps 0-249); raise trainer.max_steps above 300 or lower it")
    (line,) = notices(200, "safe")  # the default run length: steps 0-199, activations would start at 200
    assert line.startswith("recipe.schedule.enable.activations=200, recipe.schedule.enable.gradients=300: "
                           "activations and gradients stay BF16")
    assert "raise trainer.max_steps above 300 or lower them" in line
    assert schedule_notice(load_recipe("safe"), 301) is None


def test_dump_and_statistics_steps_after_the_last_step():
    lines = notices(10, "delayed", debug={"interval": 5, "start_step": 20, "dump": {"steps": [5, 100]}})
    assert lines[0].startswith("debug.dump.steps: 100 after the last step (trainer.max_steps=10")
    assert lines[1].startswith("debug.start_step=20 is after the last step (trainer.max_steps=10)")
    assert len(lines) == 2


def test_a_setting_another_one_switches_off():
    def trainer(**kw):
        return TrainerConfig.from_cfg({"max_steps": 200, "warmup_steps": 0, **kw})

    hybrid = load_recipe("hybrid")
    (line,) = run_notices(trainer(save_interval=50, save_checkpoints=False), hybrid, None)
    assert line.startswith("trainer.save_interval=50 does nothing: trainer.save_checkpoints=false writes no checkpoint")
    (line,) = run_notices(trainer(save_interval=200), hybrid, None)
    assert line.startswith("trainer.save_interval=200 is not shorter than the run (trainer.max_steps=200): only the "
                           "final checkpoint is written")
    (line,) = run_notices(trainer(eval_iters=0), hybrid, None)
    assert line.startswith("trainer.eval_interval=50 never evaluates: trainer.eval_iters=0 reads no validation batch")
    (line,) = run_notices(trainer(reset_scaling_state=True), hybrid, None)
    assert line.startswith("trainer.reset_scaling_state=true does nothing: the run starts at step 0 with no checkpoint")
    assert run_notices(trainer(reset_scaling_state=True), hybrid, None, start=100) == []
    assert run_notices(trainer(save_interval=50, eval_iters=0, eval_interval=0), hybrid, None) == []


def test_amax_reduction_without_delayed_scaling():
    """It reduces delayed scaling's amaxes only: set under a recipe with no delayed policy it trained silently."""
    import dataclasses

    from fp8_recipes.recipe.pack import load_recipe_dict
    from fp8_recipes.recipe.schema import AmaxReduction, Recipe

    trainer = TrainerConfig.from_cfg({"max_steps": 200, "warmup_steps": 0})
    nvfp4 = dataclasses.replace(load_recipe("nvfp4"), amax_reduction=AmaxReduction.DATA)
    (line,) = [x for x in run_notices(trainer, nvfp4, None) if x.startswith("recipe.amax_reduction")]
    assert line == ("recipe.amax_reduction=data does nothing: no role of recipe nvfp4 uses delayed scaling, the only "
                    "one whose amaxes it reduces (current, block and NVFP4 scaling take each rank's own); drop it")
    for name in ("delayed", "nvfp4"):  # (delayed: it works; nvfp4: the default, which says nothing)
        recipe = load_recipe(name)
        reduced = dataclasses.replace(recipe, amax_reduction=AmaxReduction.NONE) if name == "delayed" else recipe
        assert not any(x.startswith("recipe.amax_reduction") for x in run_notices(trainer, reduced, None))
    # a delayed policy in a modules: entry alone is enough
    data = {**load_recipe_dict("tensorwise"), "amax_reduction": "tensor",
            "modules": {"*.experts.*": {"gradients": {"scaling": "delayed"}}}}
    assert run_notices(trainer, Recipe.from_dict(data), None) == []
    (line,) = run_notices(trainer, Recipe.from_dict({**data, "modules": {}}), None)
    assert line.startswith("recipe.amax_reduction=tensor does nothing: no role of recipe tensorwise")


def test_debug_settings_that_record_nothing():
    trainer = TrainerConfig.from_cfg({"max_steps": 200, "warmup_steps": 0})
    stats = debug_config({"interval": 10}, None)
    (line,) = run_notices(trainer, load_recipe("bf16"), stats)
    assert line.startswith("debug: recipe bf16 runs no GEMM in FP8") and "nothing is recorded" in line
    assert run_notices(trainer, load_recipe("bf16"), stats, debug_set=False) == []  # (the autopilot's: it says so)
    fp8 = {"decoder.layers.0.mlp.linear_fc1", "decoder.layers.1.mlp.linear_fc1"}
    assert run_notices(trainer, load_recipe("hybrid"), stats, fp8_modules=fp8) == []
    lines = run_notices(trainer, load_recipe("hybrid"), debug_config(
        {"interval": 10, "layers": r"layers\.9\.", "dump": {"steps": [3, 150], "layers": "linear_fc1"}}, None),
        start=100, fp8_modules=fp8)
    assert lines == [
        "debug.dump.steps: 3 at or before the resumed step 100: never dumped in this run; pick steps in 101..200",
        "debug.layers='layers\\\\.9\\\\.' matches no module that runs FP8 (of 2, e.g. "
        "'decoder.layers.0.mlp.linear_fc1'): nothing is recorded; widen it"], lines
    (line,) = run_notices(trainer, load_recipe("hybrid"), debug_config({"interval": 10, "end_step": 50}, None),
                          start=100)
    assert line.startswith("debug.end_step=50 is at or before the resumed step 100: no statistics are recorded")


def test_debug_settings_of_a_kind_that_is_off():
    """Statistics settings with interval 0, dump settings without dump steps: one line each; a dump alone keeps
    micro_batches meaningful (it limits the dumped micro-batches too)."""
    trainer = TrainerConfig.from_cfg({"max_steps": 200, "warmup_steps": 0})
    lines = run_notices(trainer, load_recipe("hybrid"), debug_config(
        {"layers": "fc1", "tensors": ["weights"], "dump": {"dir": "x"}}, None))
    assert lines == [
        "debug.layers (and tensors) does nothing: debug.interval=0 records no statistics; set debug.interval "
        "(e.g. 10), or drop it",
        "debug.dump.dir does nothing: debug.dump.steps is empty, so nothing is dumped; give debug.dump.steps "
        "(e.g. [1, 100]), or drop it"], lines
    assert run_notices(trainer, load_recipe("hybrid"), debug_config(
        {"micro_batches": 2, "dump": {"steps": [5]}}, None), fp8_modules={"decoder.layers.0.mlp.linear_fc1"}) == []


def test_gradient_accumulation_fusion_on_te_by_default_and_said_where_nothing_fuses():
    import types

    from fp8_recipes.plan.precision import Backend
    from fp8_recipes.training.run import _wgrad_fusion_notice, engine_config_overrides

    auto, off, on = (TrainerConfig.from_cfg({"gradient_accumulation_fusion": v}) for v in (None, False, True))
    assert engine_config_overrides(auto, te=True)["gradient_accumulation_fusion"] is True
    assert engine_config_overrides(off, te=True)["gradient_accumulation_fusion"] is False
    assert "gradient_accumulation_fusion" not in engine_config_overrides(on, te=False)  # the local spec has none
    emulated, te = types.SimpleNamespace(backend=Backend.EMULATED), types.SimpleNamespace(backend=Backend.TE)
    line = _wgrad_fusion_notice(on, emulated)
    assert line.startswith("trainer.gradient_accumulation_fusion=true does nothing on the emulated backend")
    assert "\n" not in line
    assert _wgrad_fusion_notice(auto, emulated) is None and _wgrad_fusion_notice(on, te) is None
