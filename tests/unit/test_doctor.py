"""The doctor on constructed runs: metrics.jsonl / numerics.jsonl / recipe.yaml written here, shaped like a real
run's (see tests/integration/test_doctor_runs.py for runs made to fail through scripts/train.py).

Three runs: diverged from the start, a mid-run spike with one layer's delayed activations poisoned by an outlier
(saturation at the spike, then a 1000x scale gap and underflow), and a healthy one. Each is classified, the
findings name the right layer, and the written recipe validates and carries the expected change.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
import yaml

from fp8_recipes import cli
from fp8_recipes.observe.doctor import Spike, detect_spikes, diagnose
from fp8_recipes.observe.doctor_findings import find_problems
from fp8_recipes.observe.doctor_gap import SEED_Z, STEP_Z, noise_floor
from fp8_recipes.observe.doctor_remedies import propose
from fp8_recipes.observe.doctor_report import format_report, load_run, patched_recipe
from fp8_recipes.recipe.pack import load_recipe

LAYERS = 4
LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
TARGET = "decoder.layers.2.mlp.linear_fc2"
STEPS = 40
SPIKE_AT = 25


def smooth_losses(n: int = STEPS) -> list[float]:
    """A learning curve with a little deterministic noise (as a tiny model's 512-token batches have)."""
    return [3.0 + 3.0 * math.exp(-i / 8) + 0.05 * math.sin(1.7 * i) for i in range(n)]


def grad_norms(n: int = STEPS) -> list[float]:
    return [1.0 + 2.0 * math.exp(-i / 6) + 0.1 * math.cos(2.3 * i) for i in range(n)]


def healthy_row(step: int, module: str, gemm: str, role: str, policy: str) -> dict:
    row = {"step": step, "module": module, "gemm": gemm, "role": role, "policy": policy, "numel": 65536,
           "amax": 1.0, "min_nonzero": 1e-6, "underflow_pct": 0.05, "saturation_pct": 0.0, "mse": 1e-6,
           "cosine": 0.9996, "scale": 400.0}
    if policy.startswith("delayed"):
        row["scale_ratio"] = 0.9 if role != "gradients" else 0.2
        if step == 1:
            row.update(scale=1.0, scale_ratio=0.002, underflow_pct=40.0)  # empty history: ignored by the doctor
    return row


def numerics(steps, scaling: str = "delayed", poison=None) -> list[dict]:
    rows = []
    for step in steps:
        for layer in range(LAYERS):
            for linear in LINEARS:
                module = f"decoder.layers.{layer}.{linear}"
                for gemm, role in (("fprop", "activations"), ("fprop", "weights"), ("dgrad", "gradients")):
                    fmt = "e5m2" if role == "gradients" else "e4m3"
                    policy = f"{scaling} {fmt} hist 1024 max" if scaling == "delayed" else f"{scaling} {fmt}"
                    row = healthy_row(step, module, gemm, role, policy)
                    if poison is not None:
                        poison(row)
                    rows.append(row)
    return rows


def outlier_poison(row: dict) -> None:
    """The TARGET's activations: clipped at the outlier step, then a stale 1000x-too-small scale afterwards."""
    if row["module"] != TARGET or row["role"] != "activations":
        return
    if row["step"] == SPIKE_AT:
        row.update(saturation_pct=95.0, scale_ratio=950.0, cosine=0.6, mse=2e4)
    elif row["step"] > SPIKE_AT:
        row.update(underflow_pct=8.0, scale_ratio=0.001)


def write_run(path: Path, losses, norms=None, *, recipe: str | dict = "delayed", stage: str = "fp8 w+a+g",
              rows: list[dict] | None = None, lr: float = 2e-3) -> Path:
    path.mkdir(parents=True)
    norms = norms or grad_norms(len(losses))
    with open(path / "metrics.jsonl", "w") as f:
        for i, (loss, norm) in enumerate(zip(losses, norms), 1):
            finite = math.isfinite(loss)
            f.write(json.dumps({"kind": "train", "step": i, "loss": loss if finite else str(loss), "lr": lr,
                                "grad_norm": norm, "stage": stage(i) if callable(stage) else stage,
                                "skipped": not finite}) + "\n")
        f.write(json.dumps({"kind": "eval", "step": len(losses), "val_loss": 9.0}) + "\n")  # ignored
    resolved = load_recipe(recipe).to_dict() if isinstance(recipe, str) else recipe
    (path / "recipe.yaml").write_text(yaml.safe_dump(resolved, sort_keys=False))
    (path / "summary.json").write_text(json.dumps({"steps": len(losses)}))
    if rows:
        (path / "numerics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def diverging_losses() -> list[float]:
    return [6.0, 7.6, 21.0, 48.0, 60.0, 55.0, 70.0, float("nan"), 80.0, 75.0, 90.0, 85.0]


def spike_run(tmp_path: Path, name: str = "spike") -> Path:
    losses, norms = smooth_losses(), grad_norms()
    losses[SPIKE_AT - 1] += 2.0   # the outlier step (metrics rows count steps from 1)
    losses[SPIKE_AT] += 0.8
    norms[SPIKE_AT - 1] *= 12.0
    return write_run(tmp_path / name, losses, norms, rows=numerics(range(1, STEPS + 1, 4), poison=outlier_poison)
                     + numerics([SPIKE_AT], poison=outlier_poison))


def doctor(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli.main(["doctor", *map(str, argv)])
    out, err = capsys.readouterr()
    return rc, out, err


# ---------------------------------------------------------------------------------------------------------------
# The three runs


def test_diverged_from_start_is_classified_and_warmup_proposed(tmp_path):
    run = write_run(tmp_path / "run", diverging_losses(), rows=numerics([1, 5, 9]))
    d = diagnose(load_run(run))
    assert d.verdict == "diverged_from_start"
    assert "step 3" in d.summary  # 21 > 1.5 x 6.0 is where it starts (7.6 is not yet)
    # FP8 was active and no baseline says otherwise: BF16 warmup, and a note asking for a BF16 run
    assert [list(p.changes) for p in d.proposals] == [["schedule.bf16_warmup_steps"]]  # nothing blind
    assert any("--baseline" in n for n in d.notes)
    assert load_recipe(patched_recipe(d)).schedule.bf16_warmup_steps >= 10
    # against a healthy BF16 run with the same LR, FP8 is to blame: the layer that clipped at the onset (the
    # first statistics at or after step 3) has its role changed too
    def clipped_at_onset(row):
        if row["module"] == TARGET and row["role"] == "activations" and row["step"] == 5:
            row.update(saturation_pct=95.0, scale_ratio=950.0, cosine=0.6)

    base = load_run(write_run(tmp_path / "base", smooth_losses(), recipe="bf16", stage="bf16"))
    run2 = write_run(tmp_path / "run2", diverging_losses(), rows=numerics([1, 5, 9], poison=clipped_at_onset))
    d = diagnose(load_run(run2), base)
    assert d.verdict == "diverged_from_start" and "not an FP8 problem" not in d.summary
    assert {"activations.scaling", "layers.bf16_modules", "schedule.bf16_warmup_steps"} <= {
        k for p in d.proposals for k in p.changes}
    # the same layer's trouble only long after the onset is a consequence of the divergence: listed, not blamed
    run3 = write_run(tmp_path / "run3", diverging_losses(), rows=numerics([1, 5, 9, SPIKE_AT, 29],
                                                                          poison=outlier_poison))
    d = diagnose(load_run(run3), base)
    assert d.findings[0].module == TARGET
    assert [list(p.changes) for p in d.proposals] == [["schedule.bf16_warmup_steps"]]


def test_spike_names_the_poisoned_layer_and_writes_a_valid_recipe(tmp_path, capsys):
    run = spike_run(tmp_path)
    d = diagnose(load_run(run))
    assert d.verdict == "spikes"
    assert {(s.metric, s.start) for s in d.spikes} >= {("loss", SPIKE_AT), ("grad_norm", SPIKE_AT)}
    assert all(not s.terminal for s in d.spikes)
    top = d.findings[0]
    assert (top.module, top.role) == (TARGET, "activations")
    kinds = {f.kind for f in d.findings if f.module == TARGET}
    assert kinds >= {"saturation_pct", "underflow_pct", "scale_gap", "cosine_drop"}
    assert {f.module for f in d.findings} == {TARGET}  # the healthy modules raise nothing, step 1 included

    written = tmp_path / "fixed.yaml"
    rc, out, err = doctor(capsys, run, "--write", written)
    assert rc == 1 and err == ""
    assert "verdict   spikes" in out and TARGET in out
    recipe = load_recipe(written)  # validates
    assert str(recipe.activations.scaling) == "tensorwise"
    assert str(recipe.weights.scaling) == str(recipe.gradients.scaling) == "delayed"  # only the role behind it
    assert TARGET in recipe.layers.bf16_modules
    assert recipe.schedule.bf16_warmup_steps == 0  # a spike at step 25 of 40 is not a warmup problem
    # the shorter history is offered as an alternative, not applied
    alternative = [p for p in d.proposals if p.alternative and "activations.amax_history_len" in p.changes]
    assert alternative and alternative[0].changes["activations.amax_history_len"] == 512
    assert recipe.name == "delayed-doctor"


def test_a_recipe_yaml_that_does_not_validate_is_read_as_unknown(tmp_path, capsys):
    """The spike run with a recipe.yaml the schema refuses: the doctor still diagnoses it from the metrics and the
    statistics, names the problem, rules no FP8 role out, changes no role and has nothing to --write."""
    broken = load_recipe("delayed").to_dict()
    broken["activations"]["scaling"] = "delayd"
    run = spike_run(tmp_path)
    (run / "recipe.yaml").write_text(yaml.safe_dump(broken, sort_keys=False))
    d = diagnose(load_run(run))
    assert d.verdict == "spikes" and d.findings[0].module == TARGET
    assert any("recipe.yaml does not validate (activations.scaling: 'delayd'" in n for n in d.notes)
    assert all(not k.startswith(("weights.", "activations.", "gradients.")) for p in d.proposals for k in p.changes)
    assert patched_recipe(d) is None
    rc, out, err = doctor(capsys, run)
    assert rc == 1 and "(recipe ?," in out and "does not validate" in out
    (run / "recipe.yaml").write_text("a: &x [1]\nb: *y\n")  # not safe YAML at all: a one-line user error
    rc, _, err = doctor(capsys, run)
    assert rc == 2 and err.startswith("error: RUN_DIR: ") and "recipe.yaml" in err and "\n" not in err.strip()


def test_healthy_run_exits_0_and_writes_nothing(tmp_path, capsys):
    run = write_run(tmp_path / "run", smooth_losses(), rows=numerics(range(1, STEPS + 1, 4)))
    d = diagnose(load_run(run))
    assert (d.verdict, d.spikes, d.findings, d.proposals) == ("healthy", [], [], [])
    written = tmp_path / "fixed.yaml"
    rc, out, err = doctor(capsys, run, "--write", written)
    assert rc == 0 and "verdict   healthy" in out and not written.exists()


# ---------------------------------------------------------------------------------------------------------------
# Not an FP8 problem; baselines


def test_bf16_baseline_diverging_too_is_not_an_fp8_problem(tmp_path):
    run = write_run(tmp_path / "run", diverging_losses(), rows=numerics([1, 5, 9]))
    base = write_run(tmp_path / "base", diverging_losses(), recipe="bf16", stage="bf16")
    d = diagnose(load_run(run), load_run(base))
    assert d.verdict == "diverged_from_start" and "not an FP8 problem: the baseline diverges too" in d.summary
    assert d.proposals == [] and patched_recipe(d) is None


@pytest.mark.parametrize("case", ["higher_lr", "bf16_stage", "bf16_recipe"])
def test_other_causes_are_named(tmp_path, case):
    kwargs = {"higher_lr": {"lr": 1.0}, "bf16_stage": {"stage": "bf16 warmup"},
              "bf16_recipe": {"recipe": "bf16", "stage": "bf16"}}[case]
    run = write_run(tmp_path / "run", diverging_losses(), **kwargs)
    base = write_run(tmp_path / "base", smooth_losses(), recipe="bf16", stage="bf16")
    d = diagnose(load_run(run), load_run(base) if case == "higher_lr" else None)
    expected = {"higher_lr": "peak LR 1 is 500x the baseline's 0.002", "bf16_stage": "no FP8 was active at step 3",
                "bf16_recipe": "the recipe has no FP8 role"}[case]
    assert expected in d.summary and d.proposals == []


def test_spikes_are_matched_to_the_baselines_by_step(tmp_path):
    run = load_run(spike_run(tmp_path))
    d = diagnose(run, load_run(spike_run(tmp_path, "same")))  # the same event in both runs: not FP8's
    assert d.verdict == "healthy" and {s.start for s in d.shared} == {SPIKE_AT}
    assert any("same steps as the baseline's" in n for n in d.notes)
    calm = load_run(write_run(tmp_path / "calm", smooth_losses(), recipe="bf16", stage="bf16"))
    d = diagnose(run, calm)
    assert d.verdict == "spikes" and "the baseline has no spike at those steps" in d.summary
    # a larger spike of the baseline at other steps explains nothing (the old rule compared the largest sizes)
    losses, norms = smooth_losses(), grad_norms()
    losses[9] += 4.0
    norms[9] *= 30.0
    elsewhere = load_run(write_run(tmp_path / "elsewhere", losses, norms, recipe="bf16", stage="bf16"))
    d = diagnose(run, elsewhere)
    assert d.verdict == "spikes" and d.onset == SPIKE_AT and not d.shared
    # FP8 amplifying a shared event (12x against the baseline's 2x) still counts
    losses, norms = smooth_losses(), grad_norms()
    norms[SPIKE_AT - 1] *= 2.0
    losses[SPIKE_AT - 1] += 0.3
    small = load_run(write_run(tmp_path / "small", losses, norms, recipe="bf16", stage="bf16"))
    assert diagnose(run, small).verdict == "spikes"


def test_mid_run_divergence(tmp_path):
    losses = smooth_losses()[:25] + [5.0 + 0.5 * i for i in range(15)]  # learnt to ~3.3, then climbs for good
    d = diagnose(load_run(write_run(tmp_path / "run", losses)))
    assert d.verdict == "mid_run_divergence" and "step 26" in d.summary
    assert any("no numerics.jsonl" in n for n in d.notes)


# ---------------------------------------------------------------------------------------------------------------
# Pieces


def test_detect_spikes_length_size_and_nonfinite():
    values = [2.0] * 12 + [5.0, 6.0] + [2.0] * 5 + [float("inf")] + [2.0] * 3
    spikes = detect_spikes(list(enumerate(values, 1)), "loss")
    assert spikes == [Spike("loss", 13, 2, 3.0, False), Spike("loss", 20, 1, math.inf, False)]
    assert detect_spikes(list(enumerate([2.0] * 10 + [9.0] * 3, 1)), "loss")[0].terminal


def test_saturation_under_tensorwise_proposes_a_margin_and_first_layer_bf16(tmp_path):
    def poison(row):  # every linear of layer 0 saturates (the embedding feeds it)
        if row["module"].startswith("decoder.layers.0.") and row["role"] == "activations":
            row.update(saturation_pct=5.0)

    rows = numerics(range(1, STEPS + 1, 4), scaling="tensorwise", poison=poison)
    assert {f.module for f in find_problems(rows)} == {f"decoder.layers.0.{lin}" for lin in LINEARS}
    losses = smooth_losses()
    losses[SPIKE_AT - 1] += 2.0
    d = diagnose(load_run(write_run(tmp_path / "run", losses, recipe="tensorwise", rows=rows)))
    recipe = load_recipe(patched_recipe(d))
    assert recipe.activations.margin == 1 and recipe.layers.bf16_first == 1 and recipe.layers.bf16_modules == ()


def test_a_spikes_own_one_step_underflow_is_noted_not_proposed(tmp_path):
    """A hard batch at step 25 (stats every 4 steps from 1, and at 25): its large gradients set that step's
    current scale and 1.2 % of one linear's gradients fall to zero there. That is the spike's consequence: noted,
    nothing proposed. The same one-step underflow at a quiet step, or a lasting one, still names the module."""
    losses, norms = smooth_losses(), grad_norms()
    losses[SPIKE_AT - 1] += 2.0
    norms[SPIKE_AT - 1] *= 12.0

    def underflow_at(steps):
        def poison(row):
            if row["module"] == TARGET and row["role"] == "gradients" and row["step"] in steps:
                row.update(underflow_pct=1.2)
        return poison

    def run(name, steps):
        rows = numerics([*range(1, STEPS + 1, 4), SPIKE_AT], scaling="tensorwise", poison=underflow_at(steps))
        return diagnose(load_run(write_run(tmp_path / name, losses, norms, recipe="tensorwise", rows=rows)))

    at_spike = run("at_spike", {SPIKE_AT})
    assert at_spike.verdict == "spikes" and at_spike.findings[0].module == TARGET  # still listed
    assert at_spike.proposals == [], at_spike.proposals
    assert any(f"{TARGET} gradients: underflow 1.20% at the spike of step {SPIKE_AT} only" in n
               for n in at_spike.notes), at_spike.notes
    for name, steps in (("quiet", {9}), ("lasting", {SPIKE_AT, *range(29, STEPS + 1, 4)})):
        d = run(name, steps)
        assert d.verdict == "spikes" and any(TARGET in p.changes.get("layers.bf16_modules", ()) for p in
                                             d.proposals), (name, d.proposals)


def test_bad_inputs_end_in_one_line_exit_2(tmp_path, capsys):
    rc, out, err = doctor(capsys, tmp_path / "missing")
    assert rc == 2 and out == "" and err.count("\n") == 1 and err.startswith("error: RUN_DIR: ")
    (tmp_path / "empty").mkdir()
    rc, _, err = doctor(capsys, tmp_path / "empty")
    assert rc == 2 and "has no metrics.jsonl" in err
    run = spike_run(tmp_path)
    rc, _, err = doctor(capsys, run, "--baseline", tmp_path / "nope")
    assert rc == 2 and err.startswith("error: --baseline: ")
    for bad in (tmp_path / "no" / "dir" / "x.yaml", tmp_path, run / "metrics.jsonl", "/dev/null", ""):
        rc, out, err = doctor(capsys, run, "--write", bad)
        assert rc == 2 and err.startswith("error: --write: ") and out == "" and err.count("\n") == 1, (bad, err)
    assert (run / "metrics.jsonl").read_text().startswith("{")  # (the run's own file was left alone)
    (tmp_path / "garbled").mkdir()
    (tmp_path / "garbled" / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "loss": 3}\n{oops\n')
    rc, _, err = doctor(capsys, tmp_path / "garbled")
    assert rc == 2 and "line 2 is not JSON" in err and err.count("\n") == 1
    for name, content, says in (("list", b"[1, 2]\n", "line 1 is not a JSON object (a list)"),
                                ("stepless", b'{"kind": "train", "iteration": 1, "loss": 2.5}\n',
                                 'row 1 has no integer "step" (not written by scripts/train.py)'),
                                ("binary", b"\xff\xfe{}\n", "metrics.jsonl is not UTF-8 text (invalid start byte")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_bytes(content)
        rc, out, err = doctor(capsys, tmp_path / name)
        assert rc == 2 and out == "" and err.startswith("error: RUN_DIR: ") and says in err and err.count("\n") == 1
    good = '{"step": 1, "module": "m", "gemm": "fprop", "role": "activations", "underflow_pct": 0.5, "mse": "nan"}'
    for field, value, says in (("step", '"a"', "'step' is 'a', not an integer"), ("step", "null", "'step' is None"),
                               ("underflow_pct", '"x"', "'underflow_pct' is 'x', not a number"),
                               ("role", '["a"]', "'role' is ['a'], not text"),
                               # (the doctor printed a 309-digit underflow and "verdict healthy")
                               ("underflow_pct", "1e308", "'underflow_pct' is 1e+308, not a number from 0 to 100"),
                               ("role", '"bias"', "'role' is 'bias', not one of weights | activations | gradients")):
        (run / "numerics.jsonl").write_text(good + "\n" + good.replace(f'"{field}": ', f'"{field}": {value}, "_":')
                                            + "\n")
        rc, out, err = doctor(capsys, run)
        assert rc == 2 and out == "" and err.count("\n") == 1 and f"numerics.jsonl line 2 is not a row of " \
            f"statistics ({says}" in err, err


PILOT = {"kind": "autopilot", "step": 5, "action": "to_current", "module": "*", "role": "activations",
         "before": "delayed e4m3", "after": "tensorwise e4m3", "reason": "scale gap", "dry": False,
         "changes": {"activations": {"scaling": "tensorwise"}}}
"""An autopilot row as training/autopilot.py writes it (Action.to_dict())."""


def rewrite_metrics(run: Path, edit) -> Path:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in edit(rows)))
    return run


@pytest.mark.parametrize("edit, says", [
    (lambda rows: [{**r, "loss": "high"} if r["kind"] == "train" else r for r in rows],
     "metrics.jsonl line 1 is not a row of statistics ('loss' of a train row is 'high', not a number)"),
    # (float() read "NaN", "Infinity" or " 3" where numerics.jsonl refused them: jsonable() writes "nan", "inf")
    (lambda rows: [{**r, "loss": "NaN"} if r["step"] == 7 else r for r in rows],
     "metrics.jsonl line 7 is not a row of statistics ('loss' of a train row is 'NaN', not a number)"),
    (lambda rows: [{**r, "val_loss": " 3"} if r["kind"] == "eval" else r for r in rows],
     f"metrics.jsonl line {STEPS + 1} is not a row of statistics ('val_loss' of a eval row is ' 3', not a number)"),
    (lambda rows: [{k: v for k, v in r.items() if k != "loss"} for r in rows],
     'metrics.jsonl has no "loss" in its train rows'),
    (lambda rows: rows + [{"kind": "autopilot", "step": 2, "action": "fly", "module": "x", "role": "weights"}],
     f"metrics.jsonl line {STEPS + 2} is not a row of statistics ('action' of an autopilot row is 'fly', not one "
     f"of shorten_history | to_current"),
    (lambda rows: rows + [{"kind": "autopilot", "step": 2, "action": "to_bf16", "module": "x", "role": "wieghts"}],
     "'role' of an autopilot row is 'wieghts', not one of weights | activations | gradients | *"),
    # (a note "'str' object has no attribute 'items'", exit 0 or 1; a row without a step was dropped, and --write
    # patched a recipe the run never ended with)
    (lambda rows: rows + [{**PILOT, "changes": "activations.scaling=tensorwise"}],
     f"metrics.jsonl line {STEPS + 2} is not a row of statistics ('changes' of an autopilot row is "
     f"'activations.scaling=tensorwise', not a mapping of recipe keys to values)"),
    (lambda rows: rows + [{**PILOT, "step": None}],
     f"metrics.jsonl line {STEPS + 2} is not a row of statistics ('step' of an autopilot row is None, not an "
     f"integer >= 0)"),
    (lambda rows: rows + [{**PILOT, "step": "three"}], "('step' of an autopilot row is 'three', not an integer"),
    (lambda rows: rows + [{**PILOT, "step": 3.5}], "('step' of an autopilot row is 3.5, not an integer"),
    # (a step past any run's was read as one, and drawn)
    (lambda rows: [{**r, "step": 10**30} if r["step"] == 9 else r for r in rows],
     "metrics.jsonl line 9 is not a row of statistics ('step' of a train row is 1000000000000000000000000000000, "
     "more than any run takes (at most 1,000,000,000,000))"),
    (lambda rows: [{**r, "step": -3} if r["step"] == 9 else r for r in rows],
     "('step' of a train row is -3, not an integer >= 0)"),
    (lambda rows: rows + [{**PILOT, "step": 10**13}], "('step' of an autopilot row is 10000000000000, more than"),
])
def test_damaged_metrics_rows_are_one_line_exit_2(tmp_path, capsys, edit, says):
    """A non-numeric loss was an IndexError traceback (run and --baseline alike); an unknown autopilot action was
    listed as `step 2: fly x weights:`."""
    run = rewrite_metrics(spike_run(tmp_path), edit)
    for argv, key in (([run], "RUN_DIR"), ([spike_run(tmp_path, "other"), "--baseline", run], "--baseline")):
        rc, out, err = doctor(capsys, *argv)
        assert rc == 2 and out == "" and err.count("\n") == 1 and err.startswith(f"error: {key}: "), err
        assert says in err and err.rstrip().endswith("give a run directory written by scripts/train.py"), err


def test_a_damaged_routing_row_is_one_line_exit_2(tmp_path, capsys):
    """Damaged routing.jsonl rows were read without a word (the experts' causes come from them)."""
    run = spike_run(tmp_path)
    (run / "routing.jsonl").write_text('{"step": 1, "layer": -7, "tokens": [1, 2, 3, 4]}\n')
    rc, out, err = doctor(capsys, run)
    assert rc == 2 and out == "" and err.count("\n") == 1, err
    assert "routing.jsonl line 1 is not a row of statistics ('layer' is -7, not an integer >= 0)" in err


def test_report_is_short_and_names_everything(tmp_path):
    d = diagnose(load_run(spike_run(tmp_path)))
    text = format_report(d)
    assert len(text.splitlines()) < 40
    for needle in ("verdict", "evidence", "layers and tensors", "proposals", "activations.scaling: tensorwise"):
        assert needle in text


def test_spike_in_a_bf16_stage_is_not_fp8_and_summary_notes_are_shown(tmp_path):
    losses = smooth_losses()
    losses[SPIKE_AT - 1] += 2.0
    run = write_run(tmp_path / "run", losses, stage=lambda step: "bf16 fallback" if step >= 20 else "fp8 w+a+g")
    (run / "summary.json").write_text(json.dumps({"skipped_steps": 5, "bf16_fallbacks": 1, "stopped": None}))
    d = diagnose(load_run(run))
    assert d.verdict == "spikes" and d.proposals == []
    assert "not an FP8 problem: no FP8 was active at step 25 (stage 'bf16 fallback')" in d.summary
    assert "5 step(s) skipped on non-finite values, 1 BF16 fallback(s)" in d.notes


def test_a_run_that_never_learns_diverged_from_the_start(tmp_path):
    flat = [6.0 + 0.01 * i + 0.05 * math.sin(i) for i in range(STEPS)]  # ends no lower than it started
    assert diagnose(load_run(write_run(tmp_path / "run", flat))).verdict == "diverged_from_start"


# ---------------------------------------------------------------------------------------------------------------
# The loss gap, the onset, role-wide remedies, quiet runs


def gapped_losses(gap: float, opens: int = 10) -> list[float]:
    """smooth_losses() with the run's loss `gap` (relative) above it from step `opens` on, reached in 5 steps."""
    return [v * (1 + gap * min(1.0, max(0, i + 1 - opens) / 5)) for i, v in enumerate(smooth_losses())]


def e4m3_gradients(margin: int = 0) -> dict:
    recipe = load_recipe("tensorwise").to_dict()
    recipe["gradients"].update(format="e4m3", margin=margin)
    return recipe


def gradient_underflow(row: dict) -> None:
    """Every linear's gradients underflow (a role-wide problem); steps 1 and 5 are still clean."""
    if row["role"] == "gradients" and row["step"] > 5:
        row.update(underflow_pct=12.0 + row["step"] / 10, policy="tensorwise e4m3")


@pytest.mark.parametrize("margin", [0, 4])
def test_a_role_wide_gap_gets_a_role_wide_change(tmp_path, margin):
    base = load_run(write_run(tmp_path / "base", smooth_losses(), recipe="bf16", stage="bf16"))
    rows = numerics(range(1, STEPS + 1, 4), scaling="tensorwise", poison=gradient_underflow)
    run = load_run(write_run(tmp_path / "run", gapped_losses(0.08), recipe=e4m3_gradients(margin), rows=rows))
    d = diagnose(run, base)
    assert d.verdict == "worse_than_baseline" and "+8.0% above the baseline's" in d.summary
    assert d.onset == d.gap.opens and 10 <= d.onset <= 16  # where the gap opens, and what the stage check read
    applied = [p for p in d.proposals if not p.alternative]
    expected = {"gradients.margin": 0} if margin else {"gradients.format": "e5m2"}
    assert [p.changes for p in applied] == [expected]  # no BF16 modules for a role-wide problem
    assert "16 of 16 gradients linears show lasting underflow" in applied[0].reason
    alternatives = [p.changes.get("gradients.block") for p in d.proposals if p.alternative]
    assert [1, 128] in alternatives  # 1x128 blocks, ranked below
    written = load_recipe(patched_recipe(d))
    assert (str(written.gradients.format), written.gradients.margin) == (("e4m3", 0) if margin else ("e5m2", 0))
    text = format_report(d)
    assert "loss gap to the baseline" in text and "smoothed" in text and "+8.00%" in text


def test_a_gap_within_noise_is_healthy_and_another_seed_widens_the_threshold(tmp_path):
    """Batches as noisy as a tiny run's (a 4% wiggle a step): +1% is inside the baseline's step floor, +4% is not."""
    noisy = [v * (1 + 0.06 * math.sin(2.3 * i)) for i, v in enumerate(smooth_losses())]
    base = load_run(write_run(tmp_path / "base", noisy, recipe="bf16", stage="bf16"))
    gapped = [v * g / b for v, g, b in zip(noisy, gapped_losses(0.01), smooth_losses())]
    d = diagnose(load_run(write_run(tmp_path / "small", gapped)), base)
    assert d.verdict == "healthy" and "+1.0% against the baseline, within noise" in d.summary, d.summary
    assert 0.01 < d.gap.floor.value < 0.04
    # another seed: other batches, so the step-to-step wiggles do not match; the noise widens the threshold
    other = [v + 0.3 * math.sin(2.9 * i + 1) for i, v in enumerate(smooth_losses())]
    d = diagnose(load_run(write_run(tmp_path / "other", [v * 1.04 for v in other])), base)
    assert not d.gap.paired and d.gap.measure("smoothed").threshold > 0.04 and d.verdict == "healthy"
    assert any("did not see the run's batches" in n for n in d.notes)
    paired = [v * g / b for v, g, b in zip(noisy, gapped_losses(0.05, opens=1), smooth_losses())]
    d = diagnose(load_run(write_run(tmp_path / "paired", paired)), base)
    assert d.gap.paired and d.verdict == "worse_than_baseline"


def test_the_noise_floor_is_measured_on_the_baseline_and_printed():
    """One baseline: STEP_Z standard errors of its own tail level (the robust spread of each loss over its running
    median, over the square root of the tail's steps); with other seeds: SEED_Z standard deviations of the
    baselines' tail levels instead."""
    base = list(enumerate(smooth_losses(), 1))
    tail = list(range(31, 41))
    wiggle = [v / statistics.median(smooth_losses()[max(0, i - 5):i + 6]) - 1 for i, v in enumerate(smooth_losses())]
    spread = 1.4826 * statistics.median(abs(w - statistics.median(wiggle[30:])) for w in wiggle[30:])
    one = noise_floor([base], tail)
    assert one.step_noise == pytest.approx(spread) and spread > 0.005 and one.baselines == 1
    assert one.value == pytest.approx(STEP_Z * spread / math.sqrt(10)) and one.seed_noise is None
    assert "one baseline, so seed-to-seed noise is not measured" in one.how and f"{one.value:.2%}" in one.how
    seeds = [[(s, v * k) for s, v in base] for k in (1.03, 0.975)]
    many = noise_floor([base, *seeds], tail)
    levels = [statistics.median(v * k for s, v in base if s in tail) for k in (1.0, 1.03, 0.975)]
    sd = statistics.stdev(levels) / statistics.fmean(levels)
    assert many.seed_noise == pytest.approx(sd) and many.value == pytest.approx(SEED_Z * sd)
    assert many.baselines == 3 and "3 baselines' levels across seeds" in many.how and f"{SEED_Z * sd:.2%}" in many.how


def test_a_gap_inside_the_seed_noise_is_within_noise_exit_0_nothing_written(tmp_path, capsys):
    """A +3% run: beyond one baseline's step floor, inside the spread of three seeds (BF16 at 1.03x and 0.975x the
    baseline: 2.8% standard deviation, floor 5.5%). Before the floor was measured: --baseline kept the last one,
    and 3% was above the fixed 2%."""
    base = write_run(tmp_path / "base", smooth_losses(), recipe="bf16", stage="bf16")
    seeds = [write_run(tmp_path / f"seed{k}", [v * k for v in smooth_losses()], recipe="bf16", stage="bf16")
             for k in (1.03, 0.975)]
    run = write_run(tmp_path / "run", gapped_losses(0.03, opens=1))
    written = tmp_path / "fixed.yaml"
    rc, out, err = doctor(capsys, run, "--baseline", base, "--write", tmp_path / "one.yaml")
    assert (rc, err) == (1, "") and "verdict   worse_than_baseline" in out, out
    assert (tmp_path / "one.yaml").exists()  # a recipe written: the false alarm several seeds avoid
    assert "one baseline measures its step-to-step noise" in out and "another --baseline" in out
    rc, out, err = doctor(capsys, run, "--baseline", base, *[a for s in seeds for a in ("--baseline", s)],
                          "--write", written)
    assert (rc, err) == (0, "") and "verdict   healthy" in out and "+3.0% against the baseline, within noise" in out
    assert "noise     floor 5.5" in out and "3 baselines' levels across seeds (2.7" in out, out
    assert "smoothed" in out.split("loss gap to the baseline")[1]  # the table shows what stayed inside the floor
    assert "nothing written" in out and not written.exists() and "proposals" not in out
    # a planted gap beyond the seed noise still counts
    big = write_run(tmp_path / "big", gapped_losses(0.08, opens=1))
    d = diagnose(load_run(big), load_run(base), [load_run(s) for s in seeds])
    assert d.verdict == "worse_than_baseline" and d.gap.floor.baselines == 3


def test_a_seed_baseline_that_is_not_a_run_or_too_short_is_a_user_error(tmp_path, capsys):
    base = write_run(tmp_path / "base", smooth_losses(), recipe="bf16", stage="bf16")
    run = write_run(tmp_path / "run", gapped_losses(0.03, opens=1))
    rc, out, err = doctor(capsys, run, "--baseline", base, "--baseline", tmp_path / "nope")
    assert rc == 2 and out == "" and err.startswith("error: --baseline: ") and err.count("\n") == 1
    short = write_run(tmp_path / "short", smooth_losses()[:30], recipe="bf16", stage="bf16")
    rc, out, err = doctor(capsys, run, "--baseline", base, "--baseline", short)
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("error: --baseline: ") and "lacks 10 of the steps" in err, err


def test_an_fp8_baseline_is_warned_about(tmp_path, capsys):
    """--baseline takes a BF16 run: another FP8 run was accepted silently (a hostile-input sweep); one warning."""
    run = write_run(tmp_path / "run", gapped_losses(0.03, opens=1))
    fp8 = write_run(tmp_path / "fp8", smooth_losses(), recipe="delayed")
    rc, out, err = doctor(capsys, run, "--baseline", fp8)
    assert err.count("\n") == 1 and err.startswith(f"warning: --baseline {fp8} trained recipe 'delayed', not BF16"), err
    bf16 = write_run(tmp_path / "bf16", smooth_losses(), recipe="bf16", stage="bf16")
    rc, out, err = doctor(capsys, run, "--baseline", bf16)
    assert "warning: --baseline" not in err, err


def test_the_role_with_the_worst_evidence_comes_first_even_when_another_is_role_wide():
    """One dead layer's activations (100 % underflow: the cause) and, as its consequence, stale delayed gradient
    scales in half the linears (role-wide, mild): the activations' change comes first, as the stale-history run
    at seed 1234 needs (tests/integration/test_doctor_runs.py). Before, every role-wide change came first."""
    def poison(row: dict) -> None:
        if row["step"] > 1 and row["module"] == TARGET and row["role"] == "activations":
            row.update(underflow_pct=100.0, cosine=0.0, scale_ratio=1e-6)
        elif row["step"] > 1 and row["role"] == "gradients" and row["module"].startswith(("decoder.layers.0.",
                                                                                       "decoder.layers.1.")):
            row.update(scale_ratio=0.01)
    rows = numerics(range(1, STEPS + 1, 4), poison=poison)
    findings = find_problems(rows)
    proposals = propose(findings, load_recipe("delayed"), rows)
    roles = [next(iter(p.changes)).split(".")[0] for p in proposals if not p.alternative]
    assert roles[:2] == ["activations", "gradients"], roles
    assert "8 of 16 gradients linears" in next(p.reason for p in proposals if "gradients.scaling" in p.changes)


def test_onset_is_the_earliest_spike_kept_after_the_baseline_filter(tmp_path):
    losses, norms = smooth_losses(), grad_norms()
    losses[29] += 2.0      # a loss spike at step 30
    norms[19] *= 12.0      # a grad-norm spike at step 20, earlier (the loss is listed first)
    norms[11] *= 12.0      # and one at step 12 that the baseline shares
    run = load_run(write_run(tmp_path / "run", losses, norms))
    d = diagnose(run)
    assert d.onset == 12 and "the first at step 12" in d.summary
    base_norms = grad_norms()
    base_norms[11] *= 10.0
    d = diagnose(run, load_run(write_run(tmp_path / "base", smooth_losses(), base_norms, recipe="bf16",
                                         stage="bf16")))
    assert [s.start for s in d.shared] == [12] and d.onset == 20 and "the first at step 20" in d.summary
    assert "20" in format_report(d).split("evidence")[1].splitlines()[2]  # the onset is in its own table


def test_an_early_blow_up_without_a_baseline_blames_nothing(tmp_path):
    losses = [6.0, 5.0, 4.4, 30.0, 60.0] + [70.0 + i for i in range(STEPS - 5)]  # a dip, then up at step 4
    rows = numerics(range(1, STEPS + 1, 4), poison=outlier_poison)
    d = diagnose(load_run(write_run(tmp_path / "run", losses, rows=rows)))
    assert d.verdict == "mid_run_divergence" and d.onset == 4
    assert [list(p.changes) for p in d.proposals] == [["schedule.bf16_warmup_steps"]]
    assert any("without a baseline" in n and "--baseline" in n for n in d.notes)


def test_spikes_in_a_run_without_fp8_are_quiet(tmp_path, capsys):
    run = write_run(tmp_path / "run", spike_run_losses(), recipe="bf16", stage="bf16")
    d = diagnose(load_run(run))
    assert d.verdict == "healthy" and any("in a run without FP8" in n for n in d.notes)
    rc, out, _ = doctor(capsys, run)
    assert rc == 0 and "verdict   healthy" in out


def spike_run_losses() -> list[float]:
    losses = smooth_losses()
    losses[SPIKE_AT - 1] += 2.0
    return losses


# ---------------------------------------------------------------------------------------------------------------
# The README's own first run

README_RUNS = Path(__file__).parent / "doctor_runs"
"""metrics.jsonl (the fields the doctor reads) and recipe.yaml of two real 200-step runs of the README's default
config on a 2-core CPU: ``python scripts/train.py +recipe=hybrid`` and ``python scripts/train.py`` (BF16). Both
have grad-norm blips of 2.5-3x at steps 9 and 31 that the earlier rules called spikes (exit 1)."""


@pytest.mark.parametrize("argv", [["readme_hybrid"], ["readme_bf16"], ["readme_hybrid", "--baseline", "readme_bf16"]],
                         ids=["hybrid", "bf16", "hybrid-vs-bf16"])
def test_the_readmes_first_run_is_healthy(capsys, argv):
    rc, out, err = doctor(capsys, *[a if a.startswith("--") else README_RUNS / a for a in argv])
    assert (rc, err) == (0, "") and "verdict   healthy" in out and "spike(s)" not in out, out
    assert ("--baseline" in out) == (argv == ["readme_hybrid"])  # alone, an FP8 run is told how to see a gap


def test_a_baseline_that_cannot_measure_the_gap_is_said(tmp_path):
    """The run itself, another model's run, or an FP8 run as the baseline: one note each, not a quiet verdict."""
    from fp8_recipes.observe.doctor import _baseline_notes

    run = write_run(tmp_path / "run", smooth_losses())
    bf16 = write_run(tmp_path / "bf16", smooth_losses(), recipe="bf16", stage="bf16")
    other = write_run(tmp_path / "other", smooth_losses(), recipe="bf16", stage="bf16")
    for path, layers in ((run, 2), (bf16, 2), (other, 4)):
        (path / ".hydra").mkdir()
        (path / ".hydra" / "config.yaml").write_text(yaml.safe_dump({"model": {"num_layers": layers}}))
    assert _baseline_notes(load_run(run), load_run(bf16)) == []
    (same,) = _baseline_notes(load_run(run), load_run(run))
    assert same.startswith("the baseline is the run itself")
    (model,) = _baseline_notes(load_run(run), load_run(other))
    assert model.startswith("the baseline trained another model (model.num_layers differ)")
    (fp8,) = _baseline_notes(load_run(bf16), load_run(run))
    assert fp8.startswith("the baseline ran recipe 'delayed', which has FP8 roles")
