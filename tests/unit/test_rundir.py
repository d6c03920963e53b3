"""The run directory has one home and one owner (fp8_recipes/rundir.py, issue 19): unique default names that every
rank of a job agrees on, sanitized recipe names, the lock, the refusal of another run's directory, and one metrics
row per step across kill -9 and resume."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from fp8_recipes import rundir
from fp8_recipes.rundir import (
    LOCK, METRICS, NUMERICS, ROUTING, RunDirError, RunFileError, check_run_dir, claim, default_run_name,
    drop_rows_after, read_metrics, read_numerics, read_routing, release, safe_name,
)

SINGLE: dict[str, str] = {}  # no launcher variables: one process
TORCHRUN = {"TORCHELASTIC_RUN_ID": "abc", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
            "GROUP_WORLD_SIZE": "1"}


@pytest.mark.parametrize("name, expected", [("hybrid", "hybrid"), ("../../x", "x"), ("/etc/passwd", "etc-passwd"),
                                            ("a b:c", "a-b-c"), ("..", "run"), ("", "run"),
                                            # the recipe's own letters in any script; only the dangerous go
                                            ("mine_中文", "mine_中文"), ("名前", "名前"), ("café", "café"),
                                            ("cafe\u0301", "café"), ("नमस्ते", "नमस्ते"), ("🚀fast", "🚀fast"),
                                            ("evil\u202etxt.exe", "evil-txt-exe"), ("a\u2066b\u2069", "a-b"),
                                            ("a\\b\x00c\td\x1b", "a-b-c-d"), ("x\u200by", "x-y"),
                                            ("z\udcff", "z"), ("中" * 60, "中" * 32)])
def test_recipe_names_stay_one_path_component(name, expected):
    assert safe_name(name) == expected
    assert "/" not in default_run_name(name, SINGLE) and not default_run_name(name, SINGLE).startswith(".")


@pytest.mark.parametrize("stem, name, expected", [("mine_中文", None, "mine_中文"), ("名前", None, "名前"),
                                                   ("x", "évite \u202e中/文", "évite-中-文"), ("it's 🚀", None, "it-s-🚀")])
def test_a_recipe_file_in_another_script_names_its_run_dir(tmp_path, stem, name, expected):
    """+recipe=FILE.yaml through scripts/train.py: the default run_dir keeps the file's (or its name:'s) letters
    (was ASCII fragments; a stem outside ASCII was an override parse error)."""
    recipe = tmp_path / f"{stem}.yaml"
    recipe.write_text("weights: tensorwise\n" + (f"name: {json.dumps(name)}\n" if name else ""), encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "SLURM_", "MASTER_", "RANK"))}
    proc = subprocess.run([sys.executable, "scripts/train.py", f"+recipe={recipe}", "--cfg", "job", "--resolve"],
                          cwd=Path(__file__).resolve().parents[2], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    run_dir = next(line for line in proc.stdout.splitlines() if line.startswith("run_dir: "))
    assert run_dir.startswith(f"run_dir: runs/{expected}-"), run_dir


def _name_in_child(env: dict[str, str]) -> str:
    code = "from fp8_recipes.rundir import default_run_name; print(default_run_name('r'))"
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "SLURM_", "MASTER_", "GROUP_"))}
    return subprocess.run([sys.executable, "-c", code], env=keep | env, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_default_names_differ_between_processes_started_in_one_second():
    names = {_name_in_child({}) for _ in range(3)}
    assert len(names) == 3


def test_ranks_of_one_job_agree_on_the_name_and_jobs_differ():
    # torchrun's workers share its agent (their parent here) and the rendezvous; another rendezvous is another job
    assert _name_in_child(TORCHRUN) == _name_in_child(TORCHRUN)
    assert _name_in_child(TORCHRUN) != _name_in_child(TORCHRUN | {"MASTER_PORT": "29501"})
    slurm = {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0"}
    assert _name_in_child(slurm) == _name_in_child(slurm) != _name_in_child(slurm | {"SLURM_JOB_ID": "78"})


def test_ranks_started_with_torchruns_variables_by_another_launcher_agree(tmp_path):
    """Ranks given RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT without torchrun's agent (a script, an MPI wrapper,
    tests/integration/test_parallel_cpu.py) share one job: rank 1 does not take rank 0's lock for another run's."""
    plain = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29600"}
    assert _name_in_child(plain) == _name_in_child(plain | {"RANK": "1"})
    assert _name_in_child(plain) != _name_in_child(plain | {"MASTER_PORT": "29601"})
    token = rundir.job_identity(plain)[0]
    _lock(tmp_path, os.getppid(), job=token)  # rank 0 (a live process) holds the lock
    check_run_dir(tmp_path, fresh=False, env=plain | {"RANK": "1"})
    with pytest.raises(RunDirError, match="in use by another run"):
        check_run_dir(tmp_path, fresh=False, env=plain | {"MASTER_PORT": "29601"})


def test_a_fresh_start_is_refused_in_another_runs_directory(tmp_path):
    check_run_dir(tmp_path, fresh=True)  # Hydra's own files do not count
    (tmp_path / ".hydra").mkdir()
    (tmp_path / "train.log").write_text("x\n")
    check_run_dir(tmp_path, fresh=True)
    (tmp_path / METRICS).write_text('{"kind": "train", "step": 1}\n')
    with pytest.raises(RunDirError) as e:
        check_run_dir(tmp_path, fresh=True)
    assert len(str(e.value).splitlines()) == 1
    assert str(e.value).startswith(f"run_dir: '{tmp_path}'") and "trainer.resume=auto" in str(e.value)
    check_run_dir(tmp_path, fresh=False)  # a resume continues it


def _lock(tmp_path, pid: int, host: str | None = None, job: str = "other") -> None:
    (tmp_path / LOCK).write_text(json.dumps({"pid": pid, "host": host or socket.gethostname(), "job": job}))


def test_a_live_runs_lock_refuses_and_a_dead_ones_is_taken_over(tmp_path, caplog):
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _lock(tmp_path, live.pid)
        with pytest.raises(RunDirError, match="in use by another run"):
            check_run_dir(tmp_path, fresh=False)
        with pytest.raises(RunDirError, match="in use by another run"):
            claim(tmp_path)
    finally:
        live.kill()
        live.wait()
    with caplog.at_level("WARNING", logger="fp8_recipes"):
        claim(tmp_path)  # the same pid, now dead: stale
    assert "stale lock" in caplog.text
    holder = json.loads((tmp_path / LOCK).read_text())
    assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
    claim(tmp_path)  # this process again: fine
    check_run_dir(tmp_path, fresh=False)
    release(tmp_path)
    assert not (tmp_path / LOCK).exists()


def test_another_hosts_lock_refuses(tmp_path):
    _lock(tmp_path, 1, host="elsewhere.invalid")
    with pytest.raises(RunDirError, match="elsewhere.invalid"):
        claim(tmp_path)


def test_the_same_jobs_lock_is_taken_over(tmp_path):
    _lock(tmp_path, 1, host="elsewhere.invalid", job=rundir.job_identity({"SLURM_JOB_ID": "5", "SLURM_STEP_ID": "0"})[0])
    claim(tmp_path, env={"SLURM_JOB_ID": "5", "SLURM_STEP_ID": "0"})  # a requeued Slurm job on another node
    assert json.loads((tmp_path / LOCK).read_text())["pid"] == os.getpid()
    release(tmp_path)


def test_a_lock_being_written_is_waited_for_not_taken_for_another_jobs(tmp_path):
    """A rank checks the lock while rank 0 of its job takes it (a CI run's rank 1 read the lock empty, between its
    creation and its record, and refused its own job): the reader waits for the record."""
    token = rundir.job_identity({"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0"})[0]
    (tmp_path / LOCK).write_text("")
    writer = threading.Timer(0.3, _lock, (tmp_path, 1, "elsewhere.invalid", token))
    writer.start()
    try:
        check_run_dir(tmp_path, fresh=False, env={"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0"})  # its own job's
    finally:
        writer.join()
    (tmp_path / LOCK).write_text("{not json")  # garbage for good: nobody to name, refused after the wait
    with pytest.raises(RunDirError, match="an unreadable lock"):
        check_run_dir(tmp_path, fresh=False)


@pytest.mark.parametrize("links", [True, False], ids=["hard link", "no hard links"])
def test_claim_writes_the_lock_whole_and_leaves_nothing_else(tmp_path, monkeypatch, links):
    seen = []
    real_link = os.link

    def link(src, dst):
        if not links:
            raise OSError(1, "Operation not permitted")
        real_link(src, dst)
        seen.append(json.loads(Path(dst).read_text()))  # the lock as any reader first finds it

    monkeypatch.setattr(rundir.os, "link", link)
    claim(tmp_path)
    holder = json.loads((tmp_path / LOCK).read_text())
    assert holder["pid"] == os.getpid() and seen == ([holder] if links else [])
    assert [p.name for p in tmp_path.iterdir()] == [LOCK]
    _lock(tmp_path, 1, host="elsewhere.invalid")
    with pytest.raises(RunDirError, match="elsewhere.invalid"):
        claim(tmp_path)  # another host's lock: the create found it, nothing overwritten
    assert json.loads((tmp_path / LOCK).read_text())["host"] == "elsewhere.invalid"
    assert [p.name for p in tmp_path.iterdir()] == [LOCK]


def test_rows_past_the_checkpoint_are_dropped_atomically(tmp_path):
    rows = [{"kind": "train", "step": s} for s in range(1, 9)] + [{"kind": "eval", "step": 5}]
    (tmp_path / METRICS).write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"kind": "tr')  # cut by kill -9
    (tmp_path / "numerics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (2, 4, 6, 8)))
    (tmp_path / "numerics.stage1.jsonl").write_text(json.dumps({"step": 8}) + "\n")
    assert drop_rows_after(tmp_path, 6) == 5
    assert [(r["kind"], r["step"]) for r in read_metrics(tmp_path)] == \
        [("train", s) for s in range(1, 7)] + [("eval", 5)]
    assert (tmp_path / "numerics.jsonl").read_text().count("\n") == 3
    assert (tmp_path / "numerics.stage1.jsonl").read_text() == ""
    assert drop_rows_after(tmp_path, 6) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [METRICS, "numerics.jsonl", "numerics.stage1.jsonl"]


def test_overwrite_problem_guards_a_runs_own_files_and_devices(tmp_path):
    from fp8_recipes.rundir import overwrite_problem

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("{}\n")
    (run / "parity.json").write_text("{}\n")
    assert "metrics.jsonl of the run in" in overwrite_problem(run / "metrics.jsonl")
    assert overwrite_problem(run / "checkpoints" / "latest") is None  # (absent: nothing to overwrite)
    (run / "checkpoints" / "latest").write_text("step_2\n")
    assert "checkpoints/latest of the run" in overwrite_problem(run / "checkpoints" / "latest")
    assert overwrite_problem(run / "parity.json") is None and overwrite_problem(run / "fixed.yaml") is None
    assert overwrite_problem("/dev/null") == "exists and is not a regular file"
    assert overwrite_problem(tmp_path / "elsewhere.json") is None


ROUTED = {"step": 1, "layer": 0, "tokens": [3, 0, 2, 1], "imbalance": 2.0, "idle": 1, "weight": [0.5, None, 0.4, 0.3],
          "z_loss": 2.5}


@pytest.mark.parametrize("change, says", [
    ({"tokens": [{"a": 1}, 2, 3, 4]}, "'tokens' is [{'a': 1}, 2, 3, 4], not a list of token counts (0 to 2**53)"),
    ({"tokens": "many"}, "'tokens' is 'many', not a list of token counts (0 to 2**53)"),
    ({"tokens": [10**400, 0, 0, 0]}, f"'tokens' is [1{'0' * 58}, not a list of token counts (0 to 2**53)"),
    ({"step": "x"}, "'step' is 'x', not an integer >= 1"),
    ({"step": 1.5}, "'step' is 1.5, not an integer >= 1"),
    ({"step": 1e9}, "'step' is 1000000000.0, not an integer >= 1"),  # (JSON's 1e9 is a float)
    ({"step": 10**13}, "'step' is 10000000000000, more than any run takes (at most 1,000,000,000,000)"),
    ({"layer": -7}, "'layer' is -7, not an integer >= 0"),
    ({"tokens": [5, 6]}, "'tokens' has 2 entries, not one per expert (4, as in the first row)"),
    ({"weight": [0.5]}, "'weight' is [0.5], not a list of 4 numbers or nulls"),
    ({"z_loss": "high"}, "'z_loss' is 'high', not a number"),
])
def test_a_damaged_routing_row_is_refused_naming_the_file_line_and_key(tmp_path, change, says):
    """The heat map drew such rows, or died in float() / int() without naming the file; the doctor read them."""
    (tmp_path / ROUTING).write_text(json.dumps(ROUTED) + "\n\n" + json.dumps({**ROUTED, **change}) + "\n")
    with pytest.raises(RunFileError) as e:
        read_routing(tmp_path)
    assert str(e.value) == f"{tmp_path / ROUTING} line 3 is not a row of statistics ({says})"


def test_routing_rows_are_one_per_expert_of_the_runs_model(tmp_path):
    (tmp_path / ROUTING).write_text(json.dumps(ROUTED) + "\n" + json.dumps({**ROUTED, "step": 2}) + "\n")
    assert [r["step"] for r in read_routing(tmp_path)] == [1, 2] and read_routing(tmp_path / "dense") == []
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "config.yaml").write_text("model:\n  num_moe_experts: 8\n")
    with pytest.raises(RunFileError, match=r"line 1 .*'tokens' has 4 entries, not one per expert \(8, as "
                                           r"model.num_moe_experts\)"):
        read_routing(tmp_path)
    (tmp_path / "dir" / ROUTING).mkdir(parents=True)  # was "has no routing.jsonl" in the heat map
    with pytest.raises(RunFileError, match=r"routing.jsonl is not a readable file \(it is a directory\)$"):
        read_routing(tmp_path / "dir")


STATS_ROW = {"step": 3, "module": "decoder.layers.0.mlp.linear_fc1", "gemm": "fprop", "role": "activations",
             "policy": "delayed e4m3 hist 16 max", "numel": 4096, "amax": 2.5, "min_nonzero": 1e-6,
             "underflow_pct": 0.0, "saturation_pct": 100.0, "mse": 1e-5, "cosine": 0.99, "scale": 179.2,
             "scale_ratio": 1.0}


@pytest.mark.parametrize("change", [
    {}, {"amax": "inf", "mse": "nan", "cosine": "nan"},  # an inf or NaN in the tensor: what the recorder writes
    {"cosine": 1.0000003, "min_nonzero": None, "scale_ratio": None}, {"cosine": -1.0, "amax": 0},
    {"policy": "nvfp4 e2m1 1x16", "block_underflow_pct": 5.0, "block_saturation_pct": 0.0},
])
def test_statistics_the_recorder_writes_are_read(tmp_path, change):
    (tmp_path / NUMERICS).write_text(json.dumps({**STATS_ROW, **change}) + "\n")
    assert read_numerics(tmp_path) == [{**STATS_ROW, **change}]


@pytest.mark.parametrize("text, says", [
    ('"underflow_pct": 1e308', "'underflow_pct' is 1e+308, not a number from 0 to 100"),
    ('"underflow_pct": Infinity', "'underflow_pct' is inf, not a number from 0 to 100"),
    ('"underflow_pct": "nan"', "'underflow_pct' is 'nan', not a number from 0 to 100"),
    ('"saturation_pct": -0.5', "'saturation_pct' is -0.5, not a number from 0 to 100"),
    ('"block_underflow_pct": 100.5', "'block_underflow_pct' is 100.5, not a number from 0 to 100"),
    ('"cosine": 2.0', "'cosine' is 2.0, not a number from -1 to 1 (or nan)"),
    ('"cosine": "-inf"', "'cosine' is '-inf', not a number from -1 to 1 (or nan)"),
    ('"cosine": "NaN"', "'cosine' is 'NaN', not a number"),
    ('"amax": -1.0', "'amax' is -1.0, not a number >= 0 (or inf)"),
    ('"amax": NaN', "'amax' is nan, not a number >= 0 (or inf)"),
    ('"mse": -1e-9', "'mse' is -1e-09, not a number >= 0 (or nan / inf)"),
    ('"numel": ' + "9" * 400, "'numel' is 9999"),
    ('"step": 1e9', "'step' is 1000000000.0, not an integer >= 0"),
    ('"step": 1000000000001', "'step' is 1000000000001, more than any run takes (at most 1,000,000,000,000)"),
    ('"role": "bias"', "'role' is 'bias', not one of weights | activations | gradients"),
])
def test_an_impossible_statistic_is_refused_naming_the_file_line_and_key(tmp_path, text, says):
    """The doctor read an underflow of 1e308 % (and said "healthy"), a cosine of 2, a negative amax or MSE, a role
    "bias"; the heat map drew them, or died in matplotlib."""
    key = text.split(":")[0].strip('"')
    bad = json.dumps({k: v for k, v in STATS_ROW.items() if k != key})[:-1] + f", {text}}}"
    (tmp_path / NUMERICS).write_text(json.dumps(STATS_ROW) + "\n" + bad + "\n")
    with pytest.raises(RunFileError) as e:
        read_numerics(tmp_path)
    assert str(e.value).startswith(f"{tmp_path / NUMERICS} line 2 is not a row of statistics ({says}"), str(e.value)


@pytest.mark.parametrize("text, says", [(": : :\n", "line 1: YAML syntax error: "), ("- a\n", "has no model group"),
                                        ("model: {}\ndata: {}\ntrainer: 3\n", "has no trainer group"),
                                        ("a: &a [*a]\n", "line 1: an alias refers to a value that contains it"),
                                        ("model: {}\ndata: {}\ntrainer: {}\nlr: ${foo\n", "at input '${foo'")])
def test_a_damaged_run_config_is_one_line_naming_it(tmp_path, text, says):
    """export and eval_checkpoint read a run's .hydra/config.yaml: damaged or edited into another shape, it was a
    YAML traceback (or a later AttributeError); now one ConfigError naming the caller's key and the file."""
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "config.yaml").write_text(text)
    with pytest.raises(ValueError) as e:
        rundir.load_run_config(tmp_path, "SOURCE")
    assert str(e.value).startswith(f"SOURCE: {tmp_path / '.hydra' / 'config.yaml'}") and says in str(e.value)
    assert "\n" not in str(e.value) and str(e.value).endswith("restore it from a copy of the run (scripts/train.py "
                                                              "wrote it), or give another run directory")
