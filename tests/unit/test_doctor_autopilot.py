"""The doctor's reading of the autopilot's actions (observe/doctor_autopilot.py) on synthetic rows."""

from __future__ import annotations

import json

from fp8_recipes.observe.doctor import diagnose
from fp8_recipes.observe.doctor_autopilot import action_outcomes, rows_after_actions
from fp8_recipes.observe.doctor_report import load_run
from fp8_recipes.recipe.pack import load_recipe

A, B = "decoder.layers.0.mlp.linear_fc2", "decoder.layers.1.mlp.linear_fc2"


def row(step: int, module: str, role: str, underflow: float = 0.0) -> dict:
    return {"step": step, "module": module, "gemm": "fprop", "role": role, "policy": "delayed e4m3 hist 3 max",
            "underflow_pct": underflow, "saturation_pct": 0.0, "cosine": 0.9995, "amax": 1.0, "mse": 1e-6}


def action(step: int, kind: str, module: str, role: str, **kw) -> dict:
    return {"kind": "autopilot", "step": step, "action": kind, "module": module, "role": role, "before": "x",
            "after": "y", "reason": "r", "dry": False, "changes": {"k": 1}, **kw}


def test_held_did_not_hold_bf16_dry_and_role_wide():
    rows = [row(s, m, "activations", 5.0 if (m == A and s < 4) or (m == B and s >= 9) else 0.1)
            for s in range(1, 20, 2) for m in (A, B)]
    lines = action_outcomes([action(7, "shorten_history", A, "activations"),
                             action(5, "to_current", B, "activations"),
                             action(11, "to_bf16", B, "gradients"),
                             action(13, "to_e5m2", "*", "activations", dry=True),
                             action(3, "to_current", "*", "activations")], rows)
    assert lines[0].startswith("step 3: to_current * activations") and "held in 1 of 2 modules; not in 1" in lines[0]
    assert lines[1].startswith(f"step 5: to_current {B}") and "did not hold" in lines[1] and "step 9" in lines[1]
    assert lines[2] == f"step 7: shorten_history {A} activations (x -> y): held: no finding in 6 statistics steps " \
                       f"(from step 8)"
    assert "in BF16 from step 12: no FP8 rows to judge" in lines[3]
    assert lines[4].endswith("dry run, nothing changed")


def test_an_action_up_to_the_next_one_on_the_same_module_and_role():
    rows = [row(s, A, "activations", 5.0 if s >= 15 else 0.0) for s in range(1, 20, 2)]
    first, second = action_outcomes([action(5, "shorten_history", A, "activations"),
                                     action(13, "to_current", A, "activations")], rows)
    assert "held: no finding in 4 statistics steps (steps 6-13)" in first  # 7, 9, 11, 13: before the next action
    assert "did not hold" in second


# ---------------------------------------------------------------------------------------------------------------
# The doctor's proposals on an autopilot run: the recipe it ended with, the statistics after its actions


def test_rows_after_actions_keep_each_module_and_role_after_its_last_action():
    rows = [row(s, m, r) for s in range(1, 12, 2) for m in (A, B) for r in ("activations", "gradients")]
    acts = [action(5, "shorten_history", A, "activations"), action(7, "to_e5m2", "*", "gradients"),
            action(9, "to_bf16", B, "activations", dry=True), {"kind": "autopilot", "step": 9, "action": "cap_reached",
                                                                "module": "*", "role": "*", "changes": {}}]
    kept = {(r["step"], r["module"], r["role"]) for r in rows_after_actions(acts, rows)}
    assert {s for s, m, r in kept if (m, r) == (A, "activations")} == {7, 9, 11}  # after its own action
    assert {s for s, m, r in kept if r == "gradients"} == {9, 11}  # after the role-wide one, every module
    assert {s for s, m, r in kept if (m, r) == (B, "activations")} == set(range(1, 12, 2))  # dry: nothing changed
    assert rows_after_actions([], rows) == rows


def test_the_proposals_patch_the_recipe_the_autopilot_ended_with(tmp_path, capsys):
    """Two layers' fc2 activations underflow under delayed scaling, and the loss ends above a BF16 baseline's. The
    autopilot shortened A's history at step 13; A is clean after it, B is not. The doctor proposes for B only, and
    --write keeps A's shorter history."""
    from test_doctor import STEPS, doctor, numerics, smooth_losses, write_run

    def poison(r):
        bad = (r["module"] == A and r["step"] <= 13) or r["module"] == B
        if r["role"] == "activations" and bad and r["step"] > 1:
            r.update(underflow_pct=6.0, scale_ratio=0.001)
    run = write_run(tmp_path / "run", [v + 0.02 * i for i, v in enumerate(smooth_losses())],
                    rows=numerics(range(1, STEPS + 1, 4), poison=poison))
    base = load_run(write_run(tmp_path / "base", smooth_losses(), recipe="bf16", stage="bf16"))
    pilot = action(13, "shorten_history", A, "activations", before="delayed e4m3 hist 1024 max",
                   after="delayed e4m3 hist 12 max",
                   changes={"modules": {A: {"activations": {"scaling": "delayed", "amax_history_len": 12}}}})
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps(pilot) + "\n")
    d = diagnose(load_run(run), base)
    assert d.verdict == "worse_than_baseline" and {f.module for f in d.findings} == {A, B}  # the whole run's findings are still listed
    proposed = {m for p in d.proposals for m in p.changes.get("modules", {})} | {
        m for p in d.proposals for m in p.changes.get("layers.bf16_modules", [])}
    assert B in proposed and A not in proposed, d.proposals
    assert any("proposals patch the recipe it ended with" in n and "not proposed again" in n for n in d.notes)
    written = tmp_path / "fixed.yaml"
    doctor(capsys, run, "--baseline", base.path, "--write", written)
    recipe = load_recipe(written)
    assert recipe.module_policy(A, "activations").amax_history_len == 12  # the autopilot's change kept
    assert "the autopilot's 1 action(s)" in recipe.description
    # actions that do not apply to recipe.yaml (another run's metrics): the proposals patch recipe.yaml, and say so
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps(action(17, "to_e5m2", "*", "gradients", changes={"gradients.format": "e9m9"})) + "\n")
    d = diagnose(load_run(run), base)
    assert d.run.ended_with is None and any("do not apply to recipe.yaml" in n and "gradients.format: 'e9m9'" in n for n in d.notes)
