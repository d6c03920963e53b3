"""training/notices.py: a setting that the run's length makes do nothing is named in one warning line, with the
key to change; a run whose settings all take effect gets none."""

from __future__ import annotations

from fp8_recipes.observe.config import debug_config
from fp8_recipes.recipes import load_recipe
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
