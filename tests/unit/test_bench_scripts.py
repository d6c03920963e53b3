"""scripts/bench_*.py's user errors, without a GPU: --plot-only of a file another script (or none) wrote, and what
they refuse before any run: one ``error:`` line naming the option, exit code 2, no traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fp8_recipes.bench.output import RESULTS, load_result

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "docs" / "bench"


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize("kind, content, says", [
    ("stats", {"a": 1}, "is not a bench_stats result; give the .json a run of scripts/bench_stats.py wrote"),
    ("train", {"a": 1}, "is not a bench_train result; give the .json a run of scripts/bench_train.py wrote"),
    ("train", {"kind": "compare", "runs": []}, "is not a bench_train result (its kind is 'compare')"),
    ("gemm", {"kind": ["x"]}, "is not a bench_gemm result;"),
    ("train", {"kind": "train", "rows": []}, "is not a complete bench_train result (no 'device')"),
    ("stats", {"interval": 2, "steps": 8, "repeats": 1, "rows": {}}, "('rows' is not a list of rows)"),
    ("parallel", {"date": "x", "runs": [{"layout": "1gpu", "recipe": "bf16"}]}, "(runs[0] has no 'gpus')"),
    ("train", [1], "holds a list, not a benchmark result"),
])
def test_plot_only_refuses_a_foreign_result_in_one_line(tmp_path, capsys, kind, content, says):
    path = tmp_path / "foreign.json"
    path.write_text(json.dumps(content))
    with pytest.raises(SystemExit) as e:
        load_result(path, kind)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(f"error: --plot-only: '{path}' ") and says in err, err
    assert err.count("\n") == 1


def test_plot_only_names_the_script_of_another_benchmarks_result(capsys):
    with pytest.raises(SystemExit):
        load_result(BENCH / "bench_stats.json", "train")  # written before results said their kind
    assert capsys.readouterr().err == (f"error: --plot-only: '{BENCH / 'bench_stats.json'}' is a bench_stats result, "
                                       f"not a bench_train one; redraw it with scripts/bench_stats.py --plot-only "
                                       f"{BENCH / 'bench_stats.json'}\n")


def test_every_published_result_is_read_as_its_own_kind_only():
    """Each benchmark result in docs/bench is one kind's (by its key `kind`, or by its keys when written before it)."""
    published = {"bench_gemm.json": "gemm", "bench_stats.json": "stats", "bench_stats_h200.json": "stats",
                 "bench_engine_h200.json": "parallel", "bench_train.json": "train",
                 "bench_moe_engine_h200.json": "train"}
    for name, kind in published.items():
        assert load_result(BENCH / name, kind)
        for other in set(RESULTS) - {kind}:
            with pytest.raises(SystemExit):
                load_result(BENCH / name, other)


@pytest.mark.parametrize("script, path, says", [
    ("bench_stats", "foreign.json", "'foreign.json' is not a bench_stats result"),
    ("bench_train", "foreign.json", "'foreign.json' is not a bench_train result"),
    ("bench_train", str(BENCH / "bench_stats.json"), "is a bench_stats result, not a bench_train one"),
])
def test_plot_only_of_a_foreign_json_through_the_script(tmp_path, script, path, says):
    (tmp_path / "foreign.json").write_text('{"a": 1}\n')
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / f"{script}.py"), "--plot-only", path],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert says in one_error_line(proc)
    assert not list(tmp_path.glob("*.png"))


@pytest.mark.parametrize("argv, says", [
    (["bench_stats", "--recipes", "delayed", "--steps", "8", "--interval", "2", "--repeats", "1", "--no-warmup",
      "--json", "/etc/hostname/x.json"],
     "error: --json: '/etc/hostname' is a file, not a directory; give a file path in a writable directory, e.g. "
     "bench_stats.json"),
    (["bench_stats", "--json", "."], "error: --json: '.' is a directory; give a file path, e.g. bench_stats.json"),
    (["bench_train", "--out", "/etc/hostname/x"], "error: --out: '/etc/hostname/x' cannot be created"),
    (["bench_gemm", "--out", "/proc/x"], "error: --out: '/proc/x' is not writable ('/proc')"),
    (["bench_parallel", "--out", "/etc/hostname/x"], "error: --out: '/etc/hostname/x' cannot be created"),
    (["compare_recipes", "--recipes", "tensorwise", "--out", "/etc/hostname/x"],
     "error: --out: '/etc/hostname/x' cannot be created ('/etc/hostname' is a file); point --out at a writable "
     "directory"),
])
def test_output_paths_are_checked_before_any_run(tmp_path, argv, says):
    """An output the script could not write is refused before it runs anything (bench_stats wrote its --json after
    minutes of training: FileNotFoundError; the GPU scripts say so before their GPU check; compare_recipes named its
    first run's run_dir, OUT/bf16, not --out)."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / f"{argv[0]}.py"), *argv[1:]], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert one_error_line(proc).startswith(says)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("interval, steps, says", [
    (10, 40, None), (2, 7, None), (3, 7, None),
    (1, 40, "--interval 1 records statistics at every step, leaving no plain step to compare with; give --interval >= 2"),
    (2, 2, "--steps 2: the in-run measure leaves out the first 5 steps and needs a step with statistics (every 2: "
           "--interval) and one without after them; give --steps >= 7"),
    (10, 10, "give --steps >= 11"), (50, 40, "give --steps >= 51"),
])
def test_bench_stats_steps_leave_the_in_run_measure_something(interval, steps, says):
    from fp8_recipes.bench.observe import steps_problem

    problem = steps_problem(interval, steps)
    assert problem is None if says is None else says in problem, problem


@pytest.mark.parametrize("recipes, on, overrides, says", [
    (["delayed"], ["++debug.interval=0"], [], r"^--on \+\+debug.interval=0: the runs measured against debug off "
                                              r"record no statistics, not every 2 steps from step 1 \(--interval 2\); "
                                              r"give --on \+\+debug.interval=2, or leave --on out$"),
    (["delayed"], ["autopilot=on"], [], r"^--on autopilot=on: .* record statistics at steps 1, \.\.\., .*; give "
                                        r"--interval 10$"),
    (["delayed"], None, ["++debug.interval=3"], r"^the overrides after --: .* statistics at steps 1, 4, 7, \.\.\."),
    (["delayed", "bf16"], None, [], r"^--recipes bf16: runs nothing in FP8, so it records no numerics statistics"),
])
def test_bench_stats_refuses_runs_that_record_nothing_to_measure(recipes, on, overrides, says):
    """Up front, before minutes of training that then failed with KeyError: 'numerics_s' (--on
    ++debug.interval=0) or with no plain steps in a deleted temporary run directory (bf16)."""
    from fp8_recipes.bench.observe import check_runs
    from fp8_recipes.checks import ConfigError

    with pytest.raises(ConfigError, match=says):
        check_runs(recipes, interval=2, steps=8, overrides=overrides, on=on)
    check_runs(["delayed"], interval=3, steps=12, on=["autopilot=on", "++autopilot.interval=3"])  # its own steps
    check_runs(["tensorwise", "hybrid"], interval=10, steps=40)


@pytest.mark.parametrize("argv, says", [
    (["--steps", "2", "--interval", "1"], "error: bench_stats.py: --interval 1 records statistics at every step"),
    (["--steps", "2", "--interval", "2"], "error: bench_stats.py: --steps 2: the in-run measure leaves out the first "
                                          "5 steps"),
    (["--steps", "8", "--interval", "2", "--on", "++debug.interval=0"], "error: --on ++debug.interval=0: the runs "),
    (["--steps", "8", "--interval", "2", "--recipes", "bf16"], "error: --recipes bf16: runs nothing in FP8"),
])
def test_bench_stats_refuses_before_training(tmp_path, argv, says):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_stats.py"), "--recipes", "delayed",
                           "--repeats", "1", "--no-warmup", *argv], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600)
    assert one_error_line(proc).startswith(says)  # (bf16: no WARNING:fp8_recipes:debug line either)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("argv", [
    ["bench_stats", "--recipes", "delayd"], ["bench_emulated", "--recipes", "delayd"],
    ["bench_parallel", "--recipes", "delayd"], ["compare_recipes", "--recipes", "delayd", "--out", "out"],
])
def test_recipes_of_the_pack_are_named_by_the_option(tmp_path, argv):
    """--recipes takes names of the pack (each run is +recipe=NAME, named by it): a name that is none is refused
    naming --recipes, not Hydra's `recipe` group (nor suggesting a YAML file, which these scripts do not run)."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / f"{argv[0]}.py"), *argv[1:]], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert one_error_line(proc).startswith("error: --recipes: 'delayd' is not a recipe of the pack (did you mean "
                                           "'delayed'?); choose from bf16, ")
    assert not list(tmp_path.iterdir())
