"""The doctor on real runs made to fail on purpose through scripts/train.py (tiny 2-layer model, 40 steps):

- BF16 baselines at three seeds, and a healthy hybrid run (the README's first recipe) at each: judged against its own
  seed's baseline with the other two as the noise floor (their spread), never worse than it, and quiet but for
  the spikes of a hard batch the baseline takes too (see test_healthy_and_bf16_runs_are_quiet for the numbers);
- delayed scaling with a learning rate 500x too high: diverged from the start, and, against the baseline, not an
  FP8 problem (its LR is named);
- delayed scaling with an outlier injected into one layer's activations (a test-only sitecustomize multiplies the
  input of ``decoder.layers.1.self_attention.linear_qkv`` by 1000 in one training step): the amax jumps, the stale
  delayed scale clips the layer's activations and the gradients spike. The doctor names that layer;
- a stale delayed history in one layer (the same sitecustomize records an amax of 1e6 in the activation history
  of ``decoder.layers.0.mlp.linear_fc2`` in step 4, as a corrupted amax reduction or a bad restore would): the
  layer's activations underflow for the rest of the run and the loss ends ~5% above BF16's. Layer-local: the doctor
  names the layer and role first and proposes that layer's fallback and current scaling;
- E4M3 gradients with a margin of 16 (margin abuse: every gradient shrunk 65536x before the cast): every linear's
  gradients underflow and the loss ends ~9-11% above BF16's. Role-wide: the doctor proposes ``gradients.margin: 0``
  and no BF16 modules.

For the last two, the written recipe is trained again (the same fault planted) and must close most of the gap.
Their gaps are judged with the three BF16 seeds (the measured floor), the outlier and the LR with one baseline.
The runs start together (2 cores, one thread each) once per module; the two reruns after them.
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from fp8_recipes import cli
from fp8_recipes.observe.doctor import diagnose
from fp8_recipes.observe.doctor_report import load_run
from fp8_recipes.recipe.pack import load_recipe
from test_train_cpu import dataset, processes_at_once, small_run  # noqa: F401  (the shared tiny dataset fixture)

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

ROOT = Path(__file__).resolve().parents[2]
STEPS = 40
TARGET = "decoder.layers.1.self_attention.linear_qkv"
OUTLIER_CALL = 12  # 0-based training forward of TARGET: step 13 as metrics.jsonl counts (statistics: 1, 3, ...)
STALE = "decoder.layers.0.mlp.linear_fc2"

# FP8_TEST_OUTLIER="MODULE:CALL:FACTOR": that module's input x FACTOR in its CALL-th training forward.
# FP8_TEST_STALE_AMAX="MODULE:CALL:AMAX": AMAX recorded in that module's delayed activation history in its CALL-th
# training forward (nothing happens to a module without one: BF16, or current scaling).
FAULT_HOOK = r'''
import os
if os.environ.get("FP8_TEST_OUTLIER") or os.environ.get("FP8_TEST_STALE_AMAX"):
    import torch
    from fp8_recipes.megatron import emulated_layers as _el

    _outlier = os.environ.get("FP8_TEST_OUTLIER", "::").split(":")
    _stale = os.environ.get("FP8_TEST_STALE_AMAX", "::").split(":")
    _impl, _calls = _el._EmulatedGemmMixin._forward_impl, {}

    def _forward_impl(self, input, weight, *args, **kwargs):
        state = self._fp8_state
        if self.training and state is not None and state.name in (_outlier[0], _stale[0]):
            call = _calls[state.name] = _calls.get(state.name, -1) + 1
            if state.name == _outlier[0] and call == int(_outlier[1]):
                input = input * float(_outlier[2])
            scaler = state.scalers.get("activations")
            if state.name == _stale[0] and call == int(_stale[1]) and scaler is not None:
                scaler.observe(torch.tensor(float(_stale[2])))
        return _impl(self, input, weight, *args, **kwargs)

    _el._EmulatedGemmMixin._forward_impl = _forward_impl
'''
DEBUG = ["++debug.interval=4"]
SEEDS = ("", "_s1", "_s2")
"""trainer.seed 1234 (the config's), 1 and 2: plan names "base", "base_s1", "base_s2", "healthy", ..."""
PLANS = {
    "base": ([], {}),
    "base_s1": (["trainer.seed=1"], {}),
    "base_s2": (["trainer.seed=2"], {}),
    "healthy": (["+recipe=hybrid", *DEBUG], {}),  # the README's first recipe
    "healthy_s1": (["+recipe=hybrid", "trainer.seed=1", *DEBUG], {}),
    "healthy_s2": (["+recipe=hybrid", "trainer.seed=2", *DEBUG], {}),
    "high_lr": (["+recipe=delayed", "trainer.lr=1.0", *DEBUG], {}),
    "outlier": (["+recipe=delayed", *DEBUG], {"FP8_TEST_OUTLIER": f"{TARGET}:{OUTLIER_CALL}:1000"}),
    "stale": (["+recipe=delayed", *DEBUG], {"FP8_TEST_STALE_AMAX": f"{STALE}:3:1e6"}),
    "margin": (["+recipe=tensorwise", "++recipe.gradients.format=e4m3", "++recipe.gradients.margin=16", *DEBUG], {}),
}


def _train(root: Path, runs: dict[str, tuple[list[str], dict[str, str]]], dataset: list[str]) -> dict[str, Path]:  # noqa: F811
    return train_planted(root, runs, FAULT_HOOK, lambda run_dir: [
        *dataset, *small_run(run_dir, steps=STEPS), "trainer.eval_interval=40", "trainer.eval_iters=2"])


RUNS_AT_ONCE = processes_at_once()  # (this worker's share of the cores: see train_planted)


def train_planted(root: Path, runs: dict[str, tuple[list[str], dict[str, str]]], hook_text: str,
                  args) -> dict[str, Path]:
    """Train every run, RUNS_AT_ONCE at a time (scripts/train.py with `args(run_dir)`, then the run's overrides; one
    thread each, `hook_text` as the sitecustomize that plants the faults, the run's own environment on top);
    {name: run_dir} once all have finished (each must exit 0). Started all at once they oversubscribed the cores:
    test_autopilot_cpu's 21 runs took 285 s on 2 cores (142 s of it in the kernel), 4 at a time 164 s, 2 at a
    time 145 s (2026-12-07)."""
    hook = root / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(hook_text)
    planted = {k for _, extra in runs.values() for k in extra}  # (never inherited: a run without them has none)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", *planted)}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(hook), env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep))

    def train(name: str) -> tuple[str, subprocess.CompletedProcess]:
        overrides, extra = runs[name]
        return name, subprocess.run([sys.executable, "scripts/train.py", *args(root / name), *overrides], cwd=ROOT,
                                    env={**env, **extra}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    timeout=600)

    with ThreadPoolExecutor(max_workers=RUNS_AT_ONCE) as pool:
        for name, proc in pool.map(train, runs):
            assert proc.returncode == 0, (name, proc.stdout[-4000:])
    return {name: root / name for name in runs}


@pytest.fixture(scope="module")
def runs(dataset, tmp_path_factory) -> dict[str, Path]:  # noqa: F811
    return _train(tmp_path_factory.mktemp("doctor"), PLANS, dataset)


@pytest.fixture(scope="module")
def reruns(runs, dataset, tmp_path_factory) -> dict[str, Path]:  # noqa: F811
    """The stale and margin runs trained again with the recipe the doctor wrote for each (same fault planted)."""
    root = tmp_path_factory.mktemp("doctor_fixed")
    (root / "pack" / "recipe").mkdir(parents=True)
    plans = {}
    for name in ("stale", "margin"):
        written = root / "pack" / "recipe" / f"{name}_fixed.yaml"
        assert cli.main(["doctor", str(runs[name]), *baselines(runs), "--write", str(written)]) == 1
        plans[name] = ([f"hydra.searchpath=[file://{root / 'pack'}]", f"+recipe={name}_fixed", *DEBUG],
                       PLANS[name][1])
    return _train(root, plans, dataset)


def doctor(capsys, *argv) -> tuple[int, str, str]:
    rc = cli.main(["doctor", *map(str, argv)])
    out, err = capsys.readouterr()
    return rc, out, err


def baselines(runs: dict[str, Path], seed: str = "") -> list[str]:
    """--baseline arguments: the BF16 run of `seed` first, the other seeds' after it (the noise floor)."""
    order = [seed, *(s for s in SEEDS if s != seed)]
    return [a for s in order for a in ("--baseline", str(runs[f"base{s}"]))]


def diagnosis(runs: dict[str, Path], name: str, seed: str = ""):
    """The run against its seed's BF16 baseline, the other seeds measuring the noise floor."""
    others = [load_run(runs[f"base{s}"]) for s in SEEDS if s != seed]
    return diagnose(load_run(runs[name]), load_run(runs[f"base{seed}"]), others)


def smoothed_gap(run: Path, base: Path) -> float:
    return diagnose(load_run(run), load_run(base)).gap.measure("smoothed").gap


def hardest_steps(base: Path, metric: str, top: int = 3) -> set[int]:
    """The steps of the baseline's `top` largest excursions of its own (each value over the median of its 10 steps
    before, after 5 settling steps): its hardest batches."""
    rows = {r["step"]: r[metric] for r in load_run(base).train}
    steps = sorted(rows)
    ratio = {s: rows[s] / statistics.median([rows[t] for t in steps if t < s][-10:]) for s in steps[5:]}
    return set(sorted(ratio, key=ratio.get, reverse=True)[:top])


@pytest.mark.slow
def test_healthy_and_bf16_runs_are_quiet(runs, capsys, tmp_path):
    """Measured at seeds 1234, 1 and 2 (this module's runs, torch 2.11, 2 cores): the hybrid run's smoothed loss
    gap to its own seed's BF16 is +0.43 %, +0.35 %, +0.48 %; the three BF16 tail levels spread 2.85 % (standard
    deviation 1.57 %), so the floor is 3.1 %, 6x the largest healthy gap (the planted gaps below: +4.5 % to +5.1 %
    stale, +8.9 % to +10.8 % margin 16, at the same three seeds). The spikes: at seed 1234 a hard batch at step 33
    that BF16 takes at 3x its grad-norm median, hybrid at 38x (and 1.4x in loss): current-scaled activations
    amplify it on this model (docs/doctor.md), which the doctor reports as spikes; seeds 1 and 2 have none. Step 33
    is that BF16 run's largest excursion of its own in both metrics (1.18x its running loss median, 3.2x in grad
    norm; the next: 1.15x and 2.8x). So a healthy run is never worse than its baseline, proposes nothing, and any
    spike it has falls on one of its baseline's three hardest batches (one step either side). On CI's 2-core
    machine (2026-12-04) seed 1234 spikes at steps 23, 33 and 38, and step 33 leaves 1.16 % of layer 0's QKV
    gradients at zero (0 % in every other recorded step): the spike's consequence, noted and not proposed."""
    for seed in SEEDS:
        rc, out, err = doctor(capsys, runs[f"base{seed}"])
        assert (rc, err) == (0, "") and "verdict   healthy" in out and "proposals" not in out, out
        written = tmp_path / f"fixed{seed}.yaml"
        rc, out, err = doctor(capsys, runs[f"healthy{seed}"], *baselines(runs, seed), "--write", written)
        d = diagnosis(runs, f"healthy{seed}", seed)
        assert err == "" and d.verdict in ("healthy", "spikes") and rc == (d.verdict != "healthy"), out
        assert d.gap.measure("smoothed").gap < d.gap.floor.value and d.gap.floor.baselines == 3, out
        assert "noise     floor" in out and "3 baselines' levels across seeds" in out, out
        assert not d.proposals and not written.exists(), out
        alone = diagnose(load_run(runs[f"healthy{seed}"]))
        for spike in d.spikes + alone.spikes:  # FP8 amplifying a hard batch the baseline takes too, nothing else
            hardest = hardest_steps(runs[f"base{seed}"], spike.metric)
            assert hardest & {spike.start - 1, spike.start, spike.start + 1}, (seed, spike, hardest, out)


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
    """Measured at seeds 1234, 1, 2: verdict spikes (grad norm 12.9x, 13.8x, 20.7x at step 13), the target's
    activations first with saturation 99.6-99.8 % at step 13, the written recipe with it in BF16 and tensorwise
    activations at each; the smoothed gap +1.0 to +1.1 %, inside every floor."""
    written = tmp_path / "fixed.yaml"
    rc, out, err = doctor(capsys, runs["outlier"], "--baseline", runs["base"], "--write", written)
    assert (rc, err) == (1, ""), out
    assert re.search(r"verdict   (spikes|mid_run_divergence|worse_than_baseline)", out), out
    layers = out.split("layers and tensors (worst first)")[1].splitlines()
    assert layers[2].split()[:2] == [TARGET, "activations"], out  # the first row after the header
    saturation = re.search(r"saturation ([\d.]+)% \(step (\d+);", layers[2])  # clipped by the stale scale
    assert saturation and float(saturation[1]) > 50 and int(saturation[2]) == OUTLIER_CALL + 1, layers[2]
    assert cli.main(["validate", str(written)]) == 0
    recipe = load_recipe(written)
    assert TARGET in recipe.layers.bf16_modules
    assert str(recipe.activations.scaling) == "tensorwise"


@pytest.mark.slow
def test_a_stale_history_in_one_layer_gets_that_layers_fallback(runs, reruns, capsys):
    d = diagnosis(runs, "stale")
    assert d.verdict == "worse_than_baseline", d.summary
    top = d.findings[0]
    assert (top.module, top.role, top.kind) == (STALE, "activations", "underflow_pct")
    applied = {k: v for p in d.proposals if not p.alternative for k, v in p.changes.items()}
    assert applied["layers.bf16_modules"] == [STALE] and applied["activations.scaling"] == "tensorwise"
    # the role behind it ranked first. Measured at seeds 1234, 1, 2: the same top finding and first proposal at
    # each; at 1234 the spikes the stale layer causes (steps 13-36) also leave layer 0's delayed gradient scales
    # stale in 4 of 8 linears, a role-wide consequence that the earlier order (role-wide changes before any local
    # one) put first; roles now go worst evidence first (activations 203, gradients 50 there)
    assert d.proposals[0].changes.get("activations.scaling") == "tensorwise"
    before, after = smoothed_gap(runs["stale"], runs["base"]), smoothed_gap(reruns["stale"], runs["base"])
    assert after < 0.5 * before, (before, after)  # the written recipe closes most of the gap
    rc, out, _ = doctor(capsys, reruns["stale"], *baselines(runs))
    assert "worse_than_baseline" not in out, out


@pytest.mark.slow
def test_margin_abuse_gets_a_role_wide_change(runs, reruns, capsys):
    rc, out, err = doctor(capsys, runs["margin"], *baselines(runs))
    assert (rc, err) == (1, "") and "verdict   worse_than_baseline" in out, out
    d = diagnosis(runs, "margin")
    assert {f.role for f in d.findings if f.kind == "underflow_pct"} == {"gradients"}
    applied = [p for p in d.proposals if not p.alternative]
    assert [p.changes for p in applied] == [{"gradients.margin": 0}], out  # role-wide: no BF16 modules
    assert "8 of 8 gradients linears show lasting underflow" in applied[0].reason
    alternatives = [p.changes for p in d.proposals if p.alternative]
    assert {"gradients.format": "e5m2"} in alternatives
    before, after = smoothed_gap(runs["margin"], runs["base"]), smoothed_gap(reruns["margin"], runs["base"])
    assert before > 0.05 and after < 0.5 * before, (before, after)
    rc, out, _ = doctor(capsys, reruns["margin"], *baselines(runs))
    assert "worse_than_baseline" not in out and "gradients.margin" not in out, out
