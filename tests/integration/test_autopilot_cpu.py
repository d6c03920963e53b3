"""The autopilot on real CPU runs (scripts/train.py, the tiny 2-layer model, 40 steps), with the doctor's planted
failures (tests/integration/test_doctor_runs.py's hook):

- a stale delayed history in one layer (an amax of 1e6 recorded in ``decoder.layers.0.mlp.linear_fc2``'s activation
  history at step 4): its activations underflow for the rest of the run and the loss ends ~5 % above BF16's;
- E4M3 gradients with a margin of 16: every linear's gradients underflow, the loss ends ~10 % above BF16's;
- an FP8-only fault (one linear's input times inf while it runs FP8, from step 10 on): non-finite steps;
- an outlier channel from step 4 on (``decoder.layers.0.mlp.linear_fc2``'s input channel 0 x 2^24, its weight's
  column 0 / 2^24: exactly the same GEMM in BF16): the per-tensor scale of its input comes from that channel, the
  other channels are flushed (99.8 %) while the whole tensor's cosine stays at 0.9996; the loss ends ~6 % above
  BF16's.

With ``autopilot=on`` (statistics every 2 steps, patience 2, cool-down 4: the shipped preset's rules on a run 40
steps long) the loss gap to the BF16 run closes by at least 80 % with at most 3 actions, each one a ``kind:
autopilot`` row in metrics.jsonl, a console line and a plan appended to plan.txt. Measured (seed 1234, 2 cores,
2026-12-04): stale 4.72 % -> 0.30 % smoothed gap (one action: the history shortened to the 3 steps since it went
stale), margin 10.44 % -> -0.16 % (gradients to E5M2 role-wide, then the two QKV gradients to BF16). The shipped
recipes' healthy runs take no action; a dry run logs the same first action and trains bit for bit as without it; a
run resumed from a checkpoint taken after an action continues with the same plan, bit for bit. The fault: 10 skipped
steps and two BF16 fallbacks without the autopilot, 3 skipped steps and one recovery (that linear in BF16) with it.
The outlier channel (2026-12-06): 5.71 % -> 0.12 %, one action (that linear in BF16 at step 7).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fp8_recipes.observe.doctor import diagnose
from fp8_recipes.observe.doctor_report import load_run
from fp8_recipes.recipe.pack import recipe_names
from fp8_recipes.rundir import read_metrics
from test_doctor_runs import FAULT_HOOK, STALE, train_planted
from test_train_cpu import dataset, small_run  # noqa: F401  (the shared tiny dataset fixture)

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

ROOT = Path(__file__).resolve().parents[2]
STEPS = 40
NONFINITE = "decoder.layers.1.mlp.linear_fc1"
# FP8_TEST_NONFINITE="MODULE:CALL": from its (CALL + 1)-th training forward on, MODULE's input is multiplied by inf
# while the module runs FP8 (an FP8-only fault: in BF16, as after the autopilot's recovery, it stops)
NONFINITE_HOOK = r'''
if os.environ.get("FP8_TEST_NONFINITE"):
    from fp8_recipes.megatron import emulated_layers as _nf_layers

    _nf_module, _nf_from = os.environ["FP8_TEST_NONFINITE"].split(":")
    _nf_impl, _nf_calls = _nf_layers._EmulatedGemmMixin._forward_impl, [0]

    def _nf_forward_impl(self, input, weight, *args, **kwargs):
        state = self._fp8_state
        if self.training and state is not None and state.name == _nf_module:
            _nf_calls[0] += 1
            fp8 = state.plan is not None and state.enabled and state.plan.any_fp8
            if fp8 and _nf_calls[0] > int(_nf_from):
                input = input * float("inf")
        return _nf_impl(self, input, weight, *args, **kwargs)

    _nf_layers._EmulatedGemmMixin._forward_impl = _nf_forward_impl
'''
# FP8_TEST_OUTLIER_CHANNEL="MODULE:FACTOR:CALLS": after MODULE's first CALLS training forwards, its input's channel 0
# is FACTOR (a power of two) times larger and its weight's column 0 FACTOR times smaller: the same GEMM, exactly, in
# BF16 (an outlier channel with the weights that compensate it), while a per-tensor FP8 scale of its input now
# comes from channel 0 and flushes the others
CHANNEL_HOOK = r'''
if os.environ.get("FP8_TEST_OUTLIER_CHANNEL"):
    import torch
    from fp8_recipes.megatron import emulated_layers as _oc_layers

    _oc_module, _oc_factor, _oc_after = os.environ["FP8_TEST_OUTLIER_CHANNEL"].split(":")
    _oc_impl, _oc_calls = _oc_layers._EmulatedGemmMixin._forward_impl, [0]

    def _oc_forward_impl(self, input, weight, *args, **kwargs):
        state = self._fp8_state
        if state is not None and state.name == _oc_module:
            _oc_calls[0] += self.training
            if _oc_calls[0] > int(_oc_after):
                scale = torch.ones(input.shape[-1], dtype=input.dtype, device=input.device)
                scale[0] = float(_oc_factor)
                input, weight = input * scale, weight / scale.to(weight.dtype)
        return _oc_impl(self, input, weight, *args, **kwargs)

    _oc_layers._EmulatedGemmMixin._forward_impl = _oc_forward_impl
'''
CHANNEL = {"FP8_TEST_OUTLIER_CHANNEL": f"{STALE}:{2 ** 24}:3"}
PILOT = ["autopilot=on", "++autopilot.interval=2", "++autopilot.patience=2", "++autopilot.cooldown_steps=4"]
STALE_AT = {"FP8_TEST_STALE_AMAX": f"{STALE}:3:1e6"}
MARGIN = ["+recipe=tensorwise", "++recipe.gradients.format=e4m3", "++recipe.gradients.margin=16"]
PLANS = {
    "base": ([], {}),
    "stale": (["+recipe=delayed"], STALE_AT),
    "stale_pilot": (["+recipe=delayed", *PILOT, "trainer.save_checkpoints=true", "trainer.save_interval=7"],
                    STALE_AT),
    "stale_dry": (["+recipe=delayed", *PILOT, "++autopilot.dry_run=true"], STALE_AT),
    "margin": (MARGIN, {}),
    "margin_pilot": ([*MARGIN, *PILOT], {}),
    "channel_bf16": ([], CHANNEL),
    "channel": (["+recipe=delayed"], CHANNEL),
    # (as for the non-finite fault: the planted channel never goes away, so a re-promotion after the preset's calm
    # window brings it back; with it, a second demotion at step 33 and +1.25 % instead of +0.12 %)
    "channel_pilot": (["+recipe=delayed", *PILOT, f"++autopilot.calm={STEPS}"], CHANNEL),
    # every shipped recipe's healthy run (the MoE ones on tiny_moe)
    **{f"healthy_{r}": ([f"+recipe={r}", *PILOT], {}) for r in recipe_names() if r != "bf16" and not r.startswith("moe")},
    **{f"healthy_{r}": ([f"+recipe={r}", "model=tiny_moe", *PILOT], {}) for r in recipe_names() if r.startswith("moe")},
    "nonfinite": (["+recipe=delayed", "++debug.interval=2"], {"FP8_TEST_NONFINITE": f"{NONFINITE}:9"}),
    # (a calm window longer than the run: the planted fault never ends, so a re-promotion would only bring it back,
    # at a step that depends on when the other modules' statistics read calm; this run is about the recovery)
    "nonfinite_pilot": (["+recipe=delayed", *PILOT, "++autopilot.patience=5", f"++autopilot.calm={STEPS}"],
                        {"FP8_TEST_NONFINITE": f"{NONFINITE}:9"}),
}


def _args(dataset):  # noqa: F811
    return lambda run_dir: [*dataset, *small_run(run_dir, steps=STEPS), "trainer.eval_interval=40",
                            "trainer.eval_iters=2"]


@pytest.fixture(scope="module")
def runs(dataset, tmp_path_factory) -> dict[str, Path]:  # noqa: F811
    return train_planted(tmp_path_factory.mktemp("autopilot"), PLANS, FAULT_HOOK + NONFINITE_HOOK + CHANNEL_HOOK,
                         _args(dataset))


def actions(run: Path) -> list[dict]:
    return [r for r in read_metrics(run) if r.get("kind") == "autopilot"]


def gap(run: Path, base: Path) -> float:
    return diagnose(load_run(run), load_run(base)).gap.measure("smoothed").gap


@pytest.mark.slow
@pytest.mark.parametrize("planted", ["stale", "margin", "channel"])
def test_the_autopilot_closes_a_planted_gap_with_at_most_3_actions(runs, planted):
    without, with_pilot = gap(runs[planted], runs["base"]), gap(runs[f"{planted}_pilot"], runs["base"])
    taken = actions(runs[f"{planted}_pilot"])
    assert without > 0.03 and with_pilot < 0.2 * without, (without, with_pilot, taken)
    assert 1 <= len(taken) <= 3 and not any(a["dry"] for a in taken), taken
    plan = (runs[f"{planted}_pilot"] / "plan.txt").read_text()
    assert plan.count("the autopilot's plan after") == len(taken) and taken[0]["text"] in plan
    report = subprocess.run([sys.executable, "-m", "fp8_recipes.cli", "doctor", str(runs[f"{planted}_pilot"]),
                             "--baseline", str(runs["base"])], cwd=ROOT, capture_output=True, text=True)
    block = report.stdout.split("autopilot actions (metrics.jsonl)\n")[1].splitlines()
    said = list(itertools.takewhile(lambda line: line.startswith("  "), block))  # (then a blank line or a note)
    assert len(said) == len(taken) and all(f"step {a['step']}: {a['action']}" in line for a, line in
                                           zip(taken, said)), report.stdout  # the doctor reads what it did
    assert f"the autopilot changed the recipe during the run ({len(taken)} action(s)" in report.stdout
    if planted == "stale":  # the window shortened past the stale amax: current scaling was not needed
        assert "held: no finding" in said[0], said
        assert [(a["action"], a["module"], a["role"]) for a in taken] == [
            ("shorten_history", STALE, "activations")], taken
        assert int(taken[0]["after"].split("hist ")[1].split()[0]) < taken[0]["step"] - 3
    elif planted == "margin":  # role-wide first
        assert (taken[0]["action"], taken[0]["module"], taken[0]["role"]) == ("to_e5m2", "*", "gradients"), taken
    else:  # the outlier channel: nearly all of the module's input flushed while its cosine stays near 1
        assert [(a["action"], a["module"], a["role"]) for a in taken] == [("to_bf16", STALE, "activations")], taken
        assert "underflow 99." in taken[0]["reason"], taken


@pytest.mark.slow
def test_the_planted_outlier_channel_is_invisible_in_bf16(runs):
    """The plant changes nothing a BF16 run computes (powers of two, exact): the gap it makes is FP8's alone."""
    losses = [[r["loss"] for r in read_metrics(runs[n], "train")] for n in ("base", "channel_bf16")]
    assert losses[0] == losses[1] and len(losses[0]) == STEPS


@pytest.mark.slow
def test_a_streak_of_nonfinite_steps_is_recovered_from_without_waiting(runs):
    """An FP8-only fault in one linear from step 10 on (its input times inf while it runs FP8): without the
    autopilot the trainer skips 5 steps, falls back to BF16 for 20, returns to the plan and skips again; with it,
    the third skipped step's recovery puts that linear in BF16 (the first row with non-finite values in the
    forward order names it) and the run trains on in FP8 elsewhere. Patience 5: no ordinary action comes first."""
    plain, pilot = (json.loads((runs[n] / "summary.json").read_text()) for n in ("nonfinite", "nonfinite_pilot"))
    taken = actions(runs["nonfinite_pilot"])
    assert [(a["step"], a["action"], a["module"], a["recovery"]) for a in taken] == [(12, "to_bf16", NONFINITE, True)]
    assert "3 non-finite steps in a row" in taken[0]["reason"]
    assert pilot["steps"] == STEPS and pilot["skipped_steps"] == 3 and pilot["bf16_fallbacks"] == 0, pilot
    assert plain["skipped_steps"] > 5 and plain["bf16_fallbacks"] >= 1, plain
    stages = {r["stage"] for r in read_metrics(runs["nonfinite_pilot"], "train") if r["step"] > 12}
    assert stages == {"fp8 w+a+g"}, stages  # the plan's stage (one linear BF16), never the BF16 fallback
    assert gap(runs["nonfinite_pilot"], runs["base"]) < gap(runs["nonfinite"], runs["base"])


@pytest.mark.slow
def test_healthy_runs_take_no_action(runs):
    for name in (n for n in runs if n.startswith("healthy_")):
        assert actions(runs[name]) == [], (name, actions(runs[name]))
        assert "autopilot" not in (runs[name] / "plan.txt").read_text()


@pytest.mark.slow
def test_a_dry_run_logs_and_changes_nothing(runs):
    dry, real = actions(runs["stale_dry"]), actions(runs["stale_pilot"])
    assert dry and all(a["dry"] for a in dry) and "(dry run)" in dry[0]["text"]
    assert (dry[0]["step"], dry[0]["action"], dry[0]["module"]) == (real[0]["step"], real[0]["action"],
                                                                    real[0]["module"])
    losses = lambda name: [r["loss"] for r in read_metrics(runs[name], "train")]  # noqa: E731
    assert losses("stale_dry") == losses("stale")  # bit for bit: nothing applied


@pytest.mark.slow
def test_a_resumed_run_continues_with_the_autopilots_plan(runs, dataset, tmp_path):  # noqa: F811
    """stale_pilot shortened the history at step 7, a statistics step, and checkpointed that step (after its
    decision): resumed from there (without the plant, which fired at step 4), steps 8-40 give the same losses, and
    its plan.txt ends with the resumed plan. The checkpoint read by scripts/eval_checkpoint.py (no autopilot there)
    runs the plan the action made, and says so."""
    first = runs["stale_pilot"]
    assert actions(first) and actions(first)[0]["step"] == 7
    again = tmp_path / "resumed"
    resumed = train_planted(tmp_path, {"resumed": (
        ["+recipe=delayed", *PILOT, f"trainer.resume={first / 'checkpoints' / 'step_7'}"], {})}, FAULT_HOOK,
        _args(dataset))["resumed"]
    assert resumed == again
    theirs = {r["step"]: r["loss"] for r in read_metrics(first, "train") if r["step"] > 7}
    mine = {r["step"]: r["loss"] for r in read_metrics(again, "train")}
    assert mine == theirs
    plan = (again / "plan.txt").read_text()
    assert "resumed with" in plan and actions(first)[0]["after"] in plan
    evaluated = subprocess.run([sys.executable, "scripts/eval_checkpoint.py", str(first)], cwd=ROOT,
                               capture_output=True, text=True, timeout=300)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert "the checkpoint's run had the autopilot on: its 1 action(s) applied" in evaluated.stdout + evaluated.stderr
    other = train_planted(tmp_path, {"other": (  # another recipe: its scaling state, actions included, starts afresh
        ["+recipe=tensorwise", *PILOT, f"trainer.resume={first / 'checkpoints' / 'step_7'}", "trainer.max_steps=8"],
        {})}, FAULT_HOOK, _args(dataset))["other"]
    assert "the autopilot's 1 recorded action(s) on 'delayed' are dropped with it" in (other / "train.log").read_text()


# After training, each rank writes its autopilot's state and its final scales (a sitecustomize beside the planting
# hook: run_training imports `train` from the loop module when it runs, so patching the module suffices).
RANK_HOOK = FAULT_HOOK + r'''
if os.environ.get("FP8_TEST_AUTOPILOT_DUMP") and os.environ.get("RANK") is not None:
    import json
    from fp8_recipes.training import loop as _loop

    _inner_train = _loop.train

    def _train(*args, **kwargs):
        summary = _inner_train(*args, **kwargs)
        precision, rank = kwargs["precision"] if "precision" in kwargs else args[4], kwargs.get("rank", 0)
        out = {"autopilot": precision.pilot.state_dict(), "scales": precision.scales(),
               "plan": precision.plan.recipe.to_dict()}
        with open(os.path.join(os.environ["FP8_TEST_AUTOPILOT_DUMP"], f"rank{rank}.json"), "w") as f:
            json.dump(out, f)
        return summary

    _loop.train = _train
'''


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dp2", "pp2"])
def test_every_rank_takes_the_same_actions(layout, dataset, tmp_path):  # noqa: F811
    """Two gloo ranks (torchrun), the stale history planted on both: data-parallel ranks see other batches (other
    rows), pipeline stages other layers (stage 1 has no row of layer 0, where the plant is); the rows are
    all-gathered, so both ranks take the same actions, end with the same recipe and (DP) the same scales."""
    hook, dump = tmp_path / "hook", tmp_path / "dump"
    hook.mkdir()
    dump.mkdir()
    (hook / "sitecustomize.py").write_text(RANK_HOOK)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "OMP_NUM_THREADS")}
    env.update(PYTHONPATH=os.pathsep.join([str(hook), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               FP8_TEST_AUTOPILOT_DUMP=str(dump), OMP_NUM_THREADS="1", **STALE_AT)
    parallel = (["trainer.micro_batch_size=2"] if layout == "dp2" else
                ["trainer.pipeline_model_parallel_size=2", "trainer.global_batch_size=8"])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "scripts/train.py",
           *_args(dataset)(tmp_path / "run"), "+recipe=delayed", *PILOT, *parallel]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-4000:]
    r0, r1 = (json.loads((dump / f"rank{i}.json").read_text()) for i in (0, 1))
    assert r0["autopilot"] == r1["autopilot"] and r0["plan"] == r1["plan"]
    assert r0["autopilot"]["applied"] and STALE in r0["plan"]["modules"], r0["autopilot"]  # acted on, on both
    rows = actions(tmp_path / "run")
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if "autopilot step" in line]
    assert rows and rows[0]["module"] == STALE and len(lines) == len(rows), (rows, lines)
    if layout == "dp2":
        assert r0["scales"] == r1["scales"]


def test_an_action_at_the_last_step_is_evaluated_and_checkpointed(dataset, tmp_path):  # noqa: F811
    """A hostile-input sweep: hair-trigger limits made the autopilot move a role to BF16 at every statistics step,
    the last one at the final step, and the evaluation right after it ended in an internal error (the emulated
    modules still held that step's old plan, their delayed scalers already the new plan's). The step's modules now
    take their new plans with their new scalers: the run evaluates, checkpoints and finishes."""
    run = tmp_path / "run"
    hair_trigger = ["++autopilot.interval=1", "++autopilot.patience=1", "++autopilot.limits.cosine_drop=1e-9",
                    "++autopilot.limits.underflow_pct=1e-6", "++autopilot.cooldown_steps=0"]
    p = subprocess.run([sys.executable, "scripts/train.py", "+recipe=delayed", "autopilot=on", *hair_trigger, *dataset,
                        *small_run(run, steps=4), "trainer.save_checkpoints=true", "trainer.save_interval=2",
                        "trainer.eval_interval=2"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0 and "Traceback" not in p.stdout + p.stderr, p.stderr[-3000:]
    assert 4 in [r["step"] for r in actions(run)], actions(run)
    assert [r["step"] for r in read_metrics(run, "eval") if "val_loss" in r] == [2, 4]
    assert (run / "checkpoints" / "step_4").is_dir() and json.loads((run / "summary.json").read_text())["steps"] == 4
