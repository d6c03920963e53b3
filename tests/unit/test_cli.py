"""`fp8-recipes list/show/validate/explain`: output, exit codes (0 ok, 1 bad recipe, 2 bad usage), one line per
problem naming file and key, the installed console script, the README's command-line block, and a frozen
public surface (renaming or removing a subcommand or option fails here first)."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fp8_recipes import cli
from fp8_recipes.plan.precision import ModelLayout, PrecisionPlan
from fp8_recipes.plan.format import format_plan
from fp8_recipes.recipe.pack import load_recipe, recipe_names, recipes_dir
from fp8_recipes.recipe.schema import Recipe

ROOT = Path(__file__).resolve().parents[2]
BROKEN = sorted((Path(__file__).parent / "broken_recipes").glob("*.yaml"))

# The public surface: subcommand -> (positionals, options). Changing it breaks users' scripts: do it on purpose.
SURFACE = {
    "list": ([], []),
    "show": (["recipe"], []),
    "validate": (["recipes"], []),
    "explain": (["recipe"], ["--detect", "--layers", "--layout", "--model", "--steps"]),
    "memory": (["model"], ["--emulated", "--exp-avg-dtype", "--exp-avg-sq-dtype", "--fp8", "--fp8-param",
                           "--grad-reduce-in-bf16",
                           "--layout", "--main-params-dtype", "--mbs", "--microbatches", "--precision-aware-optimizer",
                           "--recipe", "--replicated-optimizer", "--seq"]),
    "doctor": (["run_dir"], ["--baseline", "--write"]),
    "heatmap": (["run_dir"], ["--out", "--role", "--stat"]),
    "export": (["out", "source"], ["--block", "--dtype", "--to"]),
}


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def console_script() -> str:
    found = shutil.which("fp8-recipes", path=str(Path(sys.executable).parent))
    assert found, f"no fp8-recipes console script beside {sys.executable}: run scripts/setup.sh"
    return found


def surface(parser: argparse.ArgumentParser) -> dict:
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    out = {}
    for name, p in sub.choices.items():
        actions = [a for a in p._actions if not isinstance(a, argparse._HelpAction)]
        out[name] = (sorted(a.dest for a in actions if not a.option_strings),
                     sorted(s for a in actions for s in a.option_strings))
    return out


def test_public_cli_surface_is_frozen():
    parser = cli.build_parser()
    assert parser.prog == "fp8-recipes"
    assert surface(parser) == SURFACE
    top = [a for a in parser._actions if a.option_strings]
    assert [a.option_strings for a in top] == [["-h", "--help"]]
    args = parser.parse_args(["explain", "safe"])  # the defaults are part of the surface too
    # --layers: 4, or the --model's own layers (None means: not given)
    assert (args.layers, args.model, args.steps, args.detect) == (None, None, None, False)


# ---------------------------------------------------------------------------------------------------------------
# list, show


def test_list_names_every_recipe_with_its_description(capsys):
    rc, out, err = run_cli(capsys, "list")
    assert rc == 0 and err == ""
    lines = out.splitlines()
    assert [line.split()[0] for line in lines] == recipe_names()
    for line, name in zip(lines, recipe_names()):
        assert line.split(None, 1)[1] == load_recipe(name).description


@pytest.mark.parametrize("name", recipe_names())
def test_show_prints_yaml_that_loads_back_to_the_recipe(capsys, name):
    rc, out, err = run_cli(capsys, "show", name)
    assert rc == 0 and err == ""
    data = yaml.safe_load(out)
    assert Recipe.from_dict(data) == load_recipe(name)
    assert "defaults" not in data and data["name"] == name  # resolved: the defaults list is applied
    assert {"weights", "activations", "gradients", "schedule", "layers", "backend"} <= data.keys()


def test_show_a_file_and_an_unknown_name(capsys, tmp_path):
    f = tmp_path / "mine.yaml"
    f.write_text("defaults: [hybrid, _self_]\nname: mine\ngradients: {scaling: tensorwise, margin: 1}\n")
    rc, out, _ = run_cli(capsys, "show", str(f))
    assert rc == 0
    mine = Recipe.from_dict(yaml.safe_load(out))
    assert mine.gradients.margin == 1 and mine.weights == load_recipe("hybrid").weights
    rc, out, err = run_cli(capsys, "show", "hybird")
    assert rc == 1 and out == ""
    assert len(err.splitlines()) == 1 and "did you mean 'hybrid'" in err


def test_a_file_that_is_no_mapping_and_usage_errors_are_one_short_line(capsys, tmp_path):
    """A recipe file holding a number, or prose (read as one long YAML string), is refused as such, and the line
    never echoes a whole file; argparse's usage errors are one `error:` line too (exit 2)."""
    (tmp_path / "n.yaml").write_text("42\n")
    (tmp_path / "prose.txt").write_text(" ".join(["word"] * 5000) + "\n")
    for name, says in (("n.yaml", "got int 42"), ("prose.txt", "got str 'word word")):
        rc, out, err = run_cli(capsys, "show", str(tmp_path / name))
        assert rc == 1 and out == "" and err.count("\n") == 1 and says in err and "a recipe is a mapping" in err
        assert len(err) < cli.MAX_ERROR_CHARS + 40
    for argv in (["explain", "safe", "--layers", "x"], ["nosuch"]):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith("error: fp8-recipes") and err.count("\n") == 1, err
        assert "usage:" not in err


# ---------------------------------------------------------------------------------------------------------------
# validate


def test_validate_the_pack_and_a_name(capsys, monkeypatch):
    files = sorted(str(p.relative_to(ROOT)) for p in recipes_dir().glob("*.yaml"))
    monkeypatch.chdir(ROOT)
    rc, out, err = run_cli(capsys, "validate", *files, "hybrid")
    assert rc == 0 and err == ""
    assert out.splitlines() == [f"{f}: ok ({Path(f).stem})" for f in files] + ["hybrid: ok (hybrid)"]


def test_validate_one_line_per_problem_naming_file_and_key(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nweights: {scaling: mxfp9}\nschedule: {bf16_warmup_steps: -1}\n"
                   "layers: {bf16_first: one}\n")
    good = tmp_path / "good.yaml"
    good.write_text("name: good\nweights: mxfp8\n")
    rc, out, err = run_cli(capsys, "validate", str(good), str(bad))
    assert rc == 1
    assert out == f"{good}: ok (good)\n"
    lines = err.splitlines()
    assert len(lines) == 3
    for line, key in zip(lines, ("weights.scaling", "schedule.bf16_warmup_steps", "layers.bf16_first")):
        assert line.startswith(f"{bad}: {key}: "), line
    assert "did you mean 'mxfp8'" in lines[0]


@pytest.mark.parametrize("command", ["show", "explain"])
def test_a_recipe_with_several_problems_is_one_error_line(capsys, tmp_path, command):
    """show / explain (and scripts/train.py) say the first problem and how many more, in one `error:` line; validate
    lists them all (above)."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nweights: {scaling: mxfp9}\nschedule: {bf16_warmup_steps: -1}\n")
    rc, out, err = run_cli(capsys, command, str(bad))
    assert rc != 0 and len(err.splitlines()) == 1, err
    assert err.startswith("error: ") and "weights.scaling" in err and err.rstrip().endswith("(and 1 more problem)")


def test_validate_every_broken_recipe(capsys):
    rc, out, err = run_cli(capsys, "validate", *map(str, BROKEN))
    assert rc == 1 and out == ""
    named = [next((f for f in map(str, BROKEN) if line.startswith(f + ": ")), None) for line in err.splitlines()]
    assert None not in named, err  # every line starts with the file it is about...
    assert set(named) == set(map(str, BROKEN))  # ...and every broken file has at least one line
    assert all(len(line.split(": ", 2)) == 3 for line in err.splitlines())  # file: key: message
    assert "Traceback" not in err


def test_validate_unknown_recipe_name(capsys):
    rc, out, err = run_cli(capsys, "validate", "hybird")
    assert rc == 1 and out == "" and err.startswith("hybird: ") and "did you mean 'hybrid'" in err


# ---------------------------------------------------------------------------------------------------------------
# explain


def test_explain_layers_8(capsys):
    rc, out, err = run_cli(capsys, "explain", "safe", "--layers", "8")
    assert rc == 0 and err == ""
    assert out == format_plan(PrecisionPlan(load_recipe("safe"), ModelLayout.gpt(8))) + "\n"
    # read independently of the formatter: the stage table and the per-layer rows of safe on 8 layers
    stages = re.findall(r"^  steps (\d+)-(\d*)\s+(.+)$", out, re.M)
    assert stages == [("0", "99", "bf16 warmup"), ("100", "199", "fp8 w"), ("200", "299", "fp8 w+a"),
                      ("300", "", "fp8 w+a+g")]
    table = out.split("why BF16\n", 1)[1]  # the rows below the GEMM table's header
    rows = re.findall(r"^  (\S+)\s+(\(all linears\)|\S+)\s+(\S+)\s+(\S+)\s+(\S+)", table, re.M)
    assert rows == [
        ("0", "(all linears)", "bf16", "bf16", "bf16"),
        ("1-6", "(all linears)", "emulated", "emulated", "emulated"),
        ("7", "(all linears)", "bf16", "bf16", "bf16"),
        ("-", "output_layer", "bf16", "bf16", "bf16")]


def test_explain_steps_bounds_the_stage_table(capsys):
    rc, out, _ = run_cli(capsys, "explain", "safe", "--steps", "150")
    assert rc == 0
    assert re.findall(r"^  steps (\S+)\s+(.+)$", out, re.M) == [("0-99", "bf16 warmup"), ("100-149", "fp8 w")]


@pytest.mark.parametrize("argv", [[], ["frobnicate"], ["show"], ["validate"], ["explain"],
                                  ["explain", "safe", "--layers", "x"], ["explain", "safe", "--layers", "0"],
                                  ["explain", "safe", "--steps", "0"], ["list", "--bogus"],
                                  ["memory", "llama3-8b", "--mbs", "-4"], ["memory", "llama3-8b", "--seq", "0"],
                                  ["memory", "llama3-8b", "--microbatches", "0"]])
def test_bad_usage_exits_2(capsys, argv):
    try:
        rc = cli.main(argv)
    except SystemExit as e:  # argparse's own usage errors
        rc = e.code
    _, err = capsys.readouterr()
    assert rc == 2 and err.strip() and "Traceback" not in err


# ---------------------------------------------------------------------------------------------------------------
# The installed console script, and the README's command-line block run through it


def test_console_script_exit_codes(tmp_path):
    exe = console_script()
    bad = tmp_path / "bad.yaml"
    bad.write_text("weights: {scaling: mxfp9}\n")
    cases = {("list",): 0, ("validate", "safe"): 0, ("validate", str(bad)): 1, ("show", "hybird"): 1, (): 2,
             ("explain", "safe", "--layers", "0"): 2}
    procs = {argv: subprocess.Popen([exe, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for argv in cases}
    for argv, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == cases[argv], (argv, err)
        assert "Traceback" not in out + err
    assert procs[("validate", str(bad))].returncode == 1


def readme_cli_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## The command line\s+```bash\n(.*?)```", readme, re.S).group(1)
    return [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]


def test_readme_command_line_block_runs():
    commands = readme_cli_commands()
    assert {c.split()[1] for c in commands} == set(SURFACE)  # the README shows every subcommand
    env = {**os.environ, "PATH": f"{Path(console_script()).parent}{os.pathsep}{os.environ['PATH']}"}
    procs = [(c, subprocess.Popen(["bash", "-c", c], cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE)) for c in commands]
    for command, proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, (command, err)
        assert out.strip() and err == "", command


def test_explain_a_conf_model_prints_its_experts_and_routers(capsys):
    rc, out, err = run_cli(capsys, "explain", "hybrid", "--model", "tiny_moe", "--steps", "50")
    assert rc == 0 and err == ""
    assert "  0        mlp.router" in out and "  2        mlp.router" in out
    assert "MoE: 4 routed experts in layers 0, 2;" in out
    rc, out, _ = run_cli(capsys, "explain", "hybrid", "--model", "tiny_moe", "--layers", "6")
    assert rc == 0 and "MoE: 4 routed experts in layers 0, 2, 4;" in out
    rc, out, _ = run_cli(capsys, "explain", "hybrid", "--model", "tiny")
    assert rc == 0 and "router" not in out and "0-3      (all linears)" in out
    rc, _, err = run_cli(capsys, "explain", "hybrid", "--model", "tiny_mo")
    assert rc != 0 and err.startswith("error: explain --model: 'tiny_mo' is not a model; give one of ") and "tiny_moe" in err
    rc, _, err = run_cli(capsys, "explain", "hybrid", "--model", "tiny_moe", "--layout", "ep=3,dp=3")
    assert rc == 1 and err.startswith("error: --layout: ep=3 does not divide the 4 routed experts")
    rc, _, err = run_cli(capsys, "explain", "hybrid", "--model", "mixtral_8x7b_4l", "--layout", "etp=3,dp=3")
    assert rc == 1 and err.startswith("error: --layout: etp=3 (the experts' TP size) does not divide the experts' "
                                      "FFN width (model.moe_ffn_hidden_size=14336)")
    rc, out, err = run_cli(capsys, "memory", "tiny_moe", "--seq", "128")
    assert rc == 0 and "of which the routed experts" in out  # an MoE model's estimate (tests/unit/test_memory.py)
    rc, _, err = run_cli(capsys, "explain", "hybrid", "--layout", "ep=2")  # a dense model: as memory refuses it
    assert rc == 1 and err.startswith("error: --layout: ep / etp split routed experts, and this model has none")
    for argv in (["explain", "safe", "--model", "llama3_8b_8l", "--layout", "tp=3"],  # FFN 14336 over 3 ranks
                 ["memory", "llama3-8b", "--layout", "tp=3"]):  # (a published shape too)
        rc, _, err = run_cli(capsys, *argv)
        assert rc == 1 and err == ("error: model.ffn_hidden_size=14336 is not divisible by --layout tp=3; set --layout "
                                   "tp to a divisor of 14336\n"), (argv, err)
    rc, _, err = run_cli(capsys, "explain", "nvfp4", "--model", "tiny_moe", "--layout", "tp=4")  # (said trainer.*)
    assert rc == 1 and err == ("error: model.num_query_groups=2 is not divisible by --layout tp=4; set --layout tp to "
                               "a divisor of 2\n"), err
    rc, _, err = run_cli(capsys, "explain", "safe", "--layers", "100000000")  # (a million layers filled 20 GB)
    assert rc == 2 and err.startswith("error: explain: --layers 100000000 is more than this plugin plans")


@pytest.mark.parametrize("layout, lower", [("etp=2", "etp"), ("ep=2,etp=2,dp=2", "ep"), ("ep=4,dp=2", "ep")])
def test_memory_names_the_expert_size_that_does_not_fit_a_stage(capsys, layout, lower):
    """Expert TP x EP must divide a stage's tp x cp x dp ranks: the fix lowers the size at fault (`etp=2` alone on
    one rank said "lower ep", which is 1 already)."""
    rc, _, err = run_cli(capsys, "memory", "tiny_moe", "--layout", layout)
    assert rc == 1 and re.match(r"error: --layout: expert TP x EP = \d x \d does not divide a stage's tp x cp x dp = "
                                rf"\d ranks; raise dp or lower {lower}\n$", err), err
    from fp8_recipes.plan.precision import TRAINER_WORDS, ParallelLayout

    with pytest.raises(ValueError, match=r"or lower trainer\.expert_tensor_parallel_size$"):  # (the trainer's words)
        ParallelLayout(dp=2, ep=2, etp=4).check_experts(4, 256, TRAINER_WORDS)


def test_explain_prints_any_layout_it_is_given(capsys):
    """At one pipeline stage too (it printed nothing more than without --layout), with the experts' split; a TP
    size no model's heads allow is refused without --model too (as with it)."""
    rc, out, err = run_cli(capsys, "explain", "nvfp4", "--layout", "tp=2,dp=8,cp=2")
    assert rc == 0 and err == "" and "\nparallel layout (tp=2, pp=1, cp=2, dp=8: 32 GPUs; one pipeline stage)\n" in out
    rc, out, _ = run_cli(capsys, "explain", "nvfp4", "--model", "tiny_moe", "--layout", "tp=2,dp=2,ep=2")
    assert rc == 0 and "parallel layout (tp=2, pp=1, cp=1, dp=2, ep=2: 4 GPUs; one pipeline stage)" in out
    assert "  routed experts: 4 per MoE layer, 2 on each of the ep=2 ranks, each expert split over expert TP 2;" in out
    rc, _, err = run_cli(capsys, "explain", "nvfp4", "--layout", "tp=99999999999")
    assert rc == 1 and err.startswith("error: --layout: tp=99999999999 is more than the attention heads TP splits, "
                                      "in any model this plugin plans (at most 1,024); lower tp"), err
    assert run_cli(capsys, "explain", "nvfp4", "--layout", "tp=1024")[0] == 0


def test_export_warns_of_a_block_without_fp8(capsys, monkeypatch):
    import fp8_recipes.training.hf as hf

    calls = []
    monkeypatch.setattr(hf, "export_hf", lambda *a, **kw: calls.append(kw))
    rc, _, err = run_cli(capsys, "export", "RUN", "--to", "hf", "OUT", "--block", "tensor")
    assert rc == 0 and err.startswith("warning: --block tensor does nothing with --dtype bf16") and calls
    rc, _, err = run_cli(capsys, "export", "RUN", "--to", "hf", "OUT", "--dtype", "fp8", "--block", "tensor")
    assert rc == 0 and err == "" and calls[-1] == {"dtype": "fp8", "block": None}
    rc, _, err = run_cli(capsys, "export", "RUN", "--to", "hf", "OUT", "--dtype", "fp8")
    assert rc == 0 and err == "" and calls[-1]["block"] == (128, 128)
