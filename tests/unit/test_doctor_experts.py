"""The doctor per expert on plain rows (observe/doctor_experts.py): the cause from the routing rows (starved, a
routing shift, neither), the per-expert remedy (a modules: entry for that expert only, in front of the recipe's
own), the verdict of an otherwise healthy run, and the heat map's expert grid. The same on real runs:
tests/integration/test_moe_doctor_cpu.py."""

from __future__ import annotations

import json

import pytest

from fp8_recipes import cli
from fp8_recipes.observe.doctor import Diagnosis, RunData, diagnose
from fp8_recipes.observe.doctor_experts import expert_causes, expert_of, expert_proposals
from fp8_recipes.observe.doctor_findings import find_problems
from fp8_recipes.observe.doctor_report import patched_recipe
from fp8_recipes.observe.heatmap import expert_grid
from fp8_recipes.observe.routing import routing_row
from fp8_recipes.recipe.pack import load_recipe
from fp8_recipes.recipe.schema import Recipe

EXPERT = "decoder.layers.0.mlp.experts.local_experts.{}.linear_fc2"
STEPS = range(1, 33)


def numerics(ratios: dict[int, float], expert: int = 1, role: str = "activations") -> list[dict]:
    """Delayed fprop rows of one expert's fc2 every 4 steps (the first at scale 1, as an empty history gives)."""
    rows = []
    for step in range(1, 33, 4):
        ratio = ratios.get(step, 1.0)
        rows.append({"step": step, "module": EXPERT.format(expert), "gemm": "fprop", "role": role,
                     "policy": "delayed e4m3 hist 1024 max", "scale": 1.0 if step == 1 else 0.5,
                     "scale_ratio": ratio, "underflow_pct": 0.0, "cosine": 1.0, "amax": 1.0, "mse": 0.0})
    return rows


def routing(tokens, weights) -> list[dict]:
    """Layer 0 rows: `tokens(step)` and `weights(step)` are the 4 experts' counts and summed weights."""
    return [routing_row(s, 0, tokens(s), weights(s), 2.0) for s in STEPS]


def test_routing_rows_hold_the_mean_weight_and_the_z_loss():
    row = routing_row(3, 1, [10, 6, 0, 0], [5.0, 3.0, 0.0, 0.0], 1.5)
    assert row == {"step": 3, "layer": 1, "tokens": [10, 6, 0, 0], "imbalance": 2.5, "idle": 2,
                   "weight": [0.5, 0.5, None, None], "z_loss": 1.5}
    assert "weight" not in routing_row(1, 0, [1, 1]) and "z_loss" not in routing_row(1, 0, [1, 1])


def test_expert_names():
    assert expert_of(EXPERT.format(3)) == ("decoder.layers.0.mlp.experts.local_experts.3", 0, 3)
    assert expert_of("decoder.layers.0.mlp.linear_fc2") is None
    assert expert_of("decoder.layers.1.mlp.shared_experts.linear_fc1") is None


def shifted() -> list[dict]:
    """Expert 1 keeps 300 tokens a step; its weight falls 1000-fold at step 9."""
    return routing(lambda s: [200, 300, 300, 224], lambda s: [100.0, 150.0 if s < 9 else 0.15, 150.0, 112.0])


def starved() -> list[dict]:
    """Expert 1 gets tokens only every 4th step from step 5 on."""
    return routing(lambda s: [300, 0 if s >= 5 and (s - 1) % 4 else 100, 300, 324],
                   lambda s: [150.0, 0.0 if s >= 5 and (s - 1) % 4 else 50.0, 150.0, 160.0])


@pytest.mark.parametrize("rows,cause,step", [(shifted(), "routing_shift", 9), (starved(), "starved", 6)])
def test_the_cause_comes_from_the_routing_rows(rows, cause, step):
    stats = numerics({s: 0.001 for s in range(9, 33, 4)})
    (c,) = expert_causes(find_problems(stats), stats, rows)
    assert (c.layer, c.expert, c.cause, c.step, c.roles) == (0, 1, cause, step, ("activations",)), c
    assert c.pattern == "decoder.layers.0.mlp.experts.local_experts.1.*"


def test_no_cause_without_a_lasting_gap_or_a_routing_change():
    stats = numerics({s: 0.001 for s in range(9, 33, 4)})
    steady = routing(lambda s: [256] * 4, lambda s: [128.0] * 4)
    assert expert_causes(find_problems(stats), stats, steady) == []  # the gap has another cause: general rules
    one_step = numerics({9: 0.001})
    assert expert_causes(find_problems(one_step), one_step, shifted()) == []  # one bad row is an event
    assert expert_causes(find_problems(stats), stats, []) == []  # no routing rows (a dense run's files)


def test_the_remedy_is_a_modules_entry_for_that_expert_in_front_of_the_recipes():
    stats = numerics({s: 0.001 for s in range(9, 33, 4)})
    recipe = load_recipe("moe_delayed")  # "*.experts.*": every role with a 16-step history
    (shift,) = expert_causes(find_problems(stats), stats, shifted())
    applied, *alternatives = expert_proposals([shift], recipe)
    entry = applied.changes["modules"]["decoder.layers.0.mlp.experts.local_experts.1.*"]
    assert entry["activations"]["amax_history_len"] == 8  # half of the 16 it already had
    assert entry["weights"]["amax_history_len"] == 8  # (TE keeps one delayed state for a module's input and weight)
    assert entry["gradients"] == recipe.module_policy(EXPERT.format(1), "gradients").to_dict()  # kept as it was
    assert [a.alternative for a in alternatives] == [True, True]
    run = RunData(path=None, train=[], numerics=stats, recipe=recipe, summary={})
    d = Diagnosis(run, "stale_expert_scales", "", proposals=[applied])
    patched = patched_recipe(d)
    assert list(patched["modules"]) == ["decoder.layers.0.mlp.experts.local_experts.1.*", "*.experts.*"]
    assert Recipe.from_dict(patched).module_policy(EXPERT.format(1), "activations").amax_history_len == 8
    assert Recipe.from_dict(patched).module_policy(EXPERT.format(2), "activations").amax_history_len == 16
    (hungry,) = expert_causes(find_problems(stats), stats, starved())
    applied = expert_proposals([hungry], load_recipe("delayed"))[0]
    assert applied.changes == {"modules": {"decoder.layers.0.mlp.experts.local_experts.1.*": {
        "activations": {"scaling": "tensorwise", "format": "e4m3", "margin": 0}}}}


def test_a_healthy_loss_with_a_stale_expert_scale_is_reported_and_patched():
    stats = numerics({s: 0.001 for s in range(9, 33, 4)})
    train = [{"kind": "train", "step": s, "loss": 5.0 - 0.05 * s, "grad_norm": 1.0, "lr": 1e-3, "stage": "fp8"}
             for s in STEPS]
    run = RunData(path=None, train=train, numerics=stats, recipe=load_recipe("delayed"), summary={},
                  routing=starved())
    d = diagnose(run)
    assert d.verdict == "stale_expert_scales" and not d.healthy and "layer 0 expert 1 (starved" in d.summary
    assert [list(p.changes) for p in d.proposals if not p.alternative] == [["modules"]]
    assert diagnose(RunData(path=None, train=train, numerics=stats, recipe=load_recipe("delayed"), summary={},
                            routing=routing(lambda s: [256] * 4, lambda s: [128.0] * 4))).verdict == "healthy"


def test_the_expert_grid():
    stats = numerics({s: 2.0 ** -10 for s in range(9, 33, 4)}) + numerics({}, expert=2)
    grid = expert_grid(stats, starved(), "scale_gap")
    assert list(grid) == ["L0 E0", "L0 E1", "L0 E2", "L0 E3"]
    assert grid["L0 E1"] == {5: 0.0, **{s: 10.0 for s in range(9, 33, 4)}}  # step 1 (scale 1) left out
    assert grid["L0 E0"] == {}
    tokens = expert_grid([], starved(), "tokens")
    assert tokens["L0 E1"][6] == 0 and tokens["L0 E1"][9] == 100 and len(tokens["L0 E1"]) == 32
    assert 6 not in expert_grid([], starved(), "weight")["L0 E1"]  # an idle step has no weight
    with pytest.raises(ValueError, match="--stat"):
        expert_grid([], [], "cosine")


def moe_run(path, routing_rows, numerics_rows=()):
    """A run directory holding just the rows the heat map reads."""
    path.mkdir()
    (path / "routing.jsonl").write_text("".join(json.dumps(r) + "\n" for r in routing_rows))
    if numerics_rows:
        (path / "numerics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in numerics_rows))
    return path


def heatmap(capsys, *argv) -> tuple[int, str, str]:
    rc = cli.main(["heatmap", *map(str, argv)])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("line, says", [
    ('{"step": 1, "layer": 0, "tokens": [{"a": 1}, 2, 3, 4], "weight": [1, 1, 1, 1]}', "'tokens' is [{'a': 1}"),
    ('{"step": "x", "layer": 0, "tokens": [1, 2, 3, 4]}', "'step' is 'x', not an integer >= 1"),
    ('{"step": 2, "layer": 0, "tokens": [1, 2]}', "'tokens' has 2 entries, not one per expert (4, as in the first"),
    ('{"step": 1e9, "layer": 0, "tokens": [1, 2, 3, 4]}', "'step' is 1000000000.0, not an integer >= 1"),
    ('{"step": 10000000000000, "layer": 0, "tokens": [1, 2, 3, 4]}', "'step' is 10000000000000, more than any run"),
    ('{"step": 2, "layer": 0, "tokens": [1e400, 2, 3, 4]}', "'tokens' is [inf, 2, 3, 4], not a list of token"),
])
def test_the_heat_map_refuses_a_damaged_routing_row_in_one_line(tmp_path, capsys, line, says):
    """Was a TypeError traceback, or `error: invalid literal for int()` naming no file, line or key."""
    run = moe_run(tmp_path / "run", starved()[:1])
    with open(run / "routing.jsonl", "a") as f:
        f.write(line + "\n")
    rc, out, err = heatmap(capsys, run, "--stat", "tokens")
    assert rc == 1 and out == "" and err.count("\n") == 1, err
    assert err.startswith(f"error: RUN_DIR: {run / 'routing.jsonl'} line 2 is not a row of statistics ({says}")
    assert err.rstrip().endswith("give a run directory written by scripts/train.py")
    assert not (run / "experts_tokens.png").exists()


def test_a_routing_jsonl_that_is_a_directory_is_named(tmp_path, capsys):
    (tmp_path / "routing.jsonl").mkdir()
    rc, _, err = heatmap(capsys, tmp_path, "--stat", "tokens")
    assert rc == 1 and "routing.jsonl is not a readable file (it is a directory)" in err and err.count("\n") == 1


def with_weight(rows: list[dict], step: int, weight: float) -> list[dict]:
    return [{**r, "weight": [weight, *r["weight"][1:]]} if r["step"] == step else r for r in rows]


def with_underflow(rows: list[dict], step: int, pct: float) -> list[dict]:
    return [{**r, "underflow_pct": pct} if r["step"] == step else r for r in rows]


@pytest.mark.parametrize("routing_rows, numerics_rows, stat, says", [
    (with_weight(shifted(), 4, 1e308), [], "weight",
     "error: --stat weight: '{run}' has values from 0.0005 to 1e+308, too far apart for a colour bar (a damaged or "
     "hand-edited routing.jsonl); give a run directory written by scripts/train.py"),
    (with_weight(shifted(), 4, -1e308), [], "weight", "error: --stat weight: '{run}' has values from -1e+308 to"),
    (shifted(), with_underflow(numerics({}), 9, 1e308), "underflow_pct",
     "error: RUN_DIR: {run}/numerics.jsonl line 3 is not a row of statistics ('underflow_pct' is 1e+308, not a "
     "number from 0 to 100)"),
])
def test_values_matplotlib_cannot_draw_are_one_line_of_ours(tmp_path, capsys, routing_rows, numerics_rows, stat,
                                                           says):
    """Were matplotlib's RuntimeWarnings and `error: arange: cannot compute length`, or a garbled PNG, exit 0."""
    run = moe_run(tmp_path / "run", routing_rows, numerics_rows)
    (run / f"experts_{stat}.png").write_bytes(b"an earlier plot")
    rc, out, err = heatmap(capsys, run, "--stat", stat)
    assert rc == 1 and out == "" and err.count("\n") == 1 and err.startswith(says.format(run=run)), err
    assert (run / f"experts_{stat}.png").read_bytes() == b"an earlier plot"
    assert sorted(p.name for p in run.iterdir() if p.name.startswith(".")) == []  # (no temporary file left)


@pytest.mark.parametrize("out, says", [
    ("", "--out: '' names no file; give a .png file path, e.g. experts.png"),
    ("/", "--out: '/' names no file; give a .png file path"), ("..", "--out: '..' names no file"),
    ("x.jpg", "--out: 'x.jpg' is not a .png file path; give one, e.g. x.png"),
])
def test_an_out_that_names_no_png_file_is_named(tmp_path, capsys, out, says):
    """--out "" was `error: PosixPath('.') has an empty name`."""
    rc, stdout, err = heatmap(capsys, moe_run(tmp_path / "run", starved()), "--stat", "tokens", "--out", out)
    assert rc == 1 and stdout == "" and err.count("\n") == 1 and err.startswith(f"error: {says}"), err
    assert not list((tmp_path / "run").glob("*.png"))


def nvfp4(rows: list[dict]) -> list[dict]:
    return [{**{k: v for k, v in r.items() if k != "scale_ratio"}, "policy": "nvfp4 e2m1 1x16",
             "block_underflow_pct": 0.0} for r in rows]


@pytest.mark.parametrize("routing_rows, numerics_rows, argv, says", [
    ([], [], ["--stat", "tokens"], "its routing.jsonl has no row (a run that took no training step); let the run"),
    (starved(), numerics({}), ["--stat", "block_underflow_pct"],
     "block_underflow_pct is NVFP4's statistic and the experts' activations ran delayed; pick another --stat"),
    (starved(), nvfp4(numerics({})), ["--stat", "scale_gap"],
     "scale_gap is delayed scaling's statistic and the experts' activations ran nvfp4; pick another --stat"),
    (starved(), [{k: v for k, v in r.items() if k != "role"} for r in numerics({})], ["--stat", "underflow_pct"],
     "the experts' numerics rows name no role"),
    (starved(), numerics({}), ["--stat", "scale_gap", "--role", "weights"],
     "the experts' numerics rows have no role 'weights' (they have activations); pick --role activations"),
    (starved(), numerics({})[:1], ["--stat", "scale_gap"], "a delayed operand's first row is left out"),
])
def test_nothing_to_plot_says_the_reason_that_applies(tmp_path, capsys, routing_rows, numerics_rows, argv, says):
    """Was always "a delayed operand's first row is left out", whatever the reason."""
    rc, out, err = heatmap(capsys, moe_run(tmp_path / "run", routing_rows, numerics_rows), *argv)
    assert rc == 1 and out == "" and err.count("\n") == 1, err
    assert err.startswith(f"error: {argv[0]} {argv[1]}: '{tmp_path / 'run'}' has nothing to plot: {says}"), err


def test_role_with_a_routing_stat_is_warned_about(tmp_path, capsys):
    """--role picks numerics rows: with --stat tokens or weight it did nothing, silently."""
    run = moe_run(tmp_path / "run", starved())
    rc, out, err = heatmap(capsys, run, "--stat", "weight", "--role", "weights")
    assert rc == 0 and out.strip() == str(run / "experts_weight.png") and (run / "experts_weight.png").is_file()
    assert err == ("warning: --role weights does nothing with --stat weight (routing.jsonl has no roles); drop "
                   "--role, or plot --stat underflow_pct or scale_gap\n")
    assert heatmap(capsys, run, "--stat", "tokens")[2] == ""  # (the default role is no --role)
