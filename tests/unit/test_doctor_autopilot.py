"""The doctor's reading of the autopilot's actions (observe/doctor_autopilot.py) on synthetic rows."""

from __future__ import annotations

from fp8_recipes.observe.doctor_autopilot import action_outcomes

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
