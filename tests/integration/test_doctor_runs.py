"""The doctor on real runs made to fail on purpose through scripts/train.py (tiny 2-layer model, 24 steps):

- a healthy BF16 baseline;
- delayed scaling with a learning rate 500x too high: diverged from the start, and, against the baseline, not an
  FP8 problem (its LR is named);
- delayed scaling with an outlier injected into one layer's activations (a test-only sitecustomize multiplies the
  input of ``decoder.layers.1.self_attention.linear_qkv`` by 1000 in one training step): the amax jumps, the stale
  delayed scale clips the layer's activations and the gradients spike. The doctor names that layer and writes a
  recipe that validates.

The three runs start together (2 cores, one thread each) once per module.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fp8_recipes import cli
from fp8_recipes.recipes import load_recipe
from test_train_cpu import dataset, small_run  # noqa: F401  (the shared tiny dataset fixture)

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

ROOT = Path(__file__).resolve().parents[2]
STEPS = 24
TARGET = "decoder.layers.1.self_attention.linear_qkv"
OUTLIER_CALL = 12  # 0-based training forward of TARGET: step 13 as metrics.jsonl counts (statistics: 1, 3, ...)

# FP8_TEST_OUTLIER="MODULE:CALL:FACTOR": that module's input x FACTOR in its CALL-th training forward.
OUTLIER_HOOK = r'''
import os
if os.environ.get("FP8_TEST_OUTLIER"):
    from fp8_recipes.megatron import emulated_layers as _el

    _module, _call, _factor = os.environ["FP8_TEST_OUTLIER"].split(":")
    _impl, _calls = _el._EmulatedGemmMixin._forward_impl, [0]

    def _forward_impl(self, input, weight, *args, **kwargs):
        state = self._fp8_state
        if self.training and state is not None and state.name == _module:
            if _calls[0] == int(_call):
                input = input * float(_factor)
            _calls[0] += 1
        return _impl(self, input, weight, *args, **kwargs)

    _el._EmulatedGemmMixin._forward_impl = _forward_impl
'''


@pytest.fixture(scope="module")
def runs(dataset, tmp_path_factory) -> dict[str, Path]:  # noqa: F811
    root = tmp_path_factory.mktemp("doctor")
    hook = root / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(OUTLIER_HOOK)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(hook), env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep))
    debug = ["++debug.interval=2"]
    plans = {
        "base": ([], {}),
        "high_lr": (["+recipe=delayed", "trainer.lr=1.0", *debug], {}),
        "outlier": (["+recipe=delayed", *debug], {"FP8_TEST_OUTLIER": f"{TARGET}:{OUTLIER_CALL}:1000"}),
    }
    procs = {}
    for name, (overrides, extra) in plans.items():
        cmd = [sys.executable, "scripts/train.py", *dataset, *small_run(root / name, steps=STEPS), *overrides]
        procs[name] = subprocess.Popen(cmd, cwd=ROOT, env={**env, **extra}, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True)
    for name, proc in procs.items():
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, (name, out[-4000:])
    return {name: root / name for name in plans}


def doctor(capsys, *argv) -> tuple[int, str, str]:
    rc = cli.main(["doctor", *map(str, argv)])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.slow
def test_healthy_baseline(runs, capsys):
    rc, out, err = doctor(capsys, runs["base"])
    assert (rc, err) == (0, "") and "verdict   healthy" in out


@pytest.mark.slow
def test_too_high_lr_diverges_from_the_start_and_is_not_fp8(runs, capsys):
    rc, out, err = doctor(capsys, runs["high_lr"], "--baseline", runs["base"])
    assert (rc, err) == (1, "")
    assert "verdict   diverged_from_start" in out
    assert "not an FP8 problem: its peak LR 1 is 500x the baseline's 0.002" in out
    assert "proposals" not in out  # no FP8 change proposed blindly
    rc, out, _ = doctor(capsys, runs["high_lr"])  # alone, FP8 cannot be ruled out: BF16 warmup, and ask for a baseline
    assert rc == 1 and "verdict   diverged_from_start" in out and "schedule.bf16_warmup_steps" in out
    assert "--baseline" in out and "scaling: tensorwise" not in out


@pytest.mark.slow
def test_outlier_names_the_layer_and_the_written_recipe_validates(runs, capsys, tmp_path):
    written = tmp_path / "fixed.yaml"
    rc, out, err = doctor(capsys, runs["outlier"], "--baseline", runs["base"], "--write", written)
    assert (rc, err) == (1, ""), out
    assert "verdict   spikes" in out or "verdict   mid_run_divergence" in out, out
    layers = out.split("layers and tensors (worst first)")[1].splitlines()
    assert layers[2].split()[:2] == [TARGET, "activations"], out  # the first row after the header
    saturation = re.search(r"saturation ([\d.]+)% \(step (\d+);", layers[2])  # clipped by the stale scale
    assert saturation and float(saturation[1]) > 50 and int(saturation[2]) == OUTLIER_CALL + 1, layers[2]
    assert cli.main(["validate", str(written)]) == 0
    recipe = load_recipe(written)
    assert TARGET in recipe.layers.bf16_modules
    assert str(recipe.activations.scaling) == "tensorwise"
