"""The recipe shoot-out end to end on the CPU: scripts/compare_recipes.py trains BF16 and two recipes (tiny model,
emulated FP8), writes its PNG, table and JSON with numbers recomputed here from each run's own metrics.jsonl, and
evaluates each FP8 checkpoint with FP8 and BF16 GEMMs (inference parity); the same on the tiny MoE with the MoE
presets (about 55 s on 2 cores); bad input ends in one line, exit 2."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from test_train_cpu import ROOT, dataset, small_run  # noqa: F401  (dataset: the shared session fixture)

from fp8_recipes.rundir import read_jsonl, read_metrics

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

STEPS = 16
RECIPES = ["tensorwise", "blockwise"]
SCRIPT = str(ROOT / "scripts" / "compare_recipes.py")


def _overrides(tmp_path) -> list[str]:
    """small_run's quick settings, with an evaluation at the end and checkpoints kept (the parity step loads them);
    the run dirs are the shoot-out's own."""
    own = ("run_dir=", "trainer.save_checkpoints=", "trainer.eval_interval=", "trainer.eval_iters=")
    return [o for o in small_run(tmp_path, steps=STEPS) if not o.startswith(own)] + [
        f"trainer.eval_interval={STEPS}", "trainer.eval_iters=2", "model.seq_length=64"]


@pytest.fixture(scope="module")
def shootout(dataset, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("compare") / "out"
    cmd = [sys.executable, SCRIPT, "--recipes", *RECIPES, "--parallel", "2", "--out", str(out), *dataset,
           *_overrides(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc.stdout


def _recomputed_final(run_dir) -> float:
    losses = [float(r["loss"]) for r in read_metrics(run_dir, "train")]
    k = max(1, round(0.05 * len(losses)))
    return sum(losses[-k:]) / k


def test_shootout_writes_png_table_and_json(shootout):
    out, stdout = shootout
    assert (out / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = json.loads((out / "compare.json").read_text())
    names = ["bf16", *RECIPES]
    assert [r["name"] for r in result["runs"]] == names
    table = (out / "compare.md").read_text()
    assert table.strip() in stdout  # the table is also what the script printed
    for name in names:
        assert sum(line.startswith(f"| {name} |") for line in table.splitlines()) == 1, table
    for r in result["runs"]:
        assert r["status"] == "ok" and r["steps"] == STEPS and r["backend"] == "emulated"
        for key in ("final_loss", "val_loss", "tokens_per_s", "peak_memory_gib", "loss_gap_pct", "val_gap_pct"):
            assert isinstance(r[key], float) and math.isfinite(r[key]), (r["name"], key, r[key])
        assert r["peak_memory_gib"] > 0.05 and r["peak_memory_kind"] == "cpu peak rss"


def test_gaps_match_each_runs_own_metrics(shootout):
    out, _ = shootout
    runs = {r["name"]: r for r in json.loads((out / "compare.json").read_text())["runs"]}
    ref = _recomputed_final(out / "bf16")
    ref_val = read_metrics(out / "bf16", "eval")[-1]["val_loss"]
    for name, r in runs.items():
        final = _recomputed_final(out / name)
        val = read_metrics(out / name, "eval")[-1]["val_loss"]
        assert r["final_loss"] == pytest.approx(final, rel=1e-12)
        assert r["loss_gap_pct"] == pytest.approx(100 * (final - ref) / ref, rel=1e-9, abs=1e-12)
        assert r["val_gap_pct"] == pytest.approx(100 * (val - ref_val) / ref_val, rel=1e-9, abs=1e-12)
    assert any(runs[n]["loss_gap_pct"] != 0.0 for n in RECIPES)  # emulated FP8 changes the numbers at all


def test_parity_of_each_fp8_checkpoint(shootout):
    out, _ = shootout
    runs = {r["name"]: r for r in json.loads((out / "compare.json").read_text())["runs"]}
    assert runs["bf16"]["parity"] is None and not (out / "bf16" / "parity.json").exists()
    for name in RECIPES:
        p = runs[name]["parity"]
        assert all(math.isfinite(p[k]) for k in ("fp8_loss", "bf16_loss", "fp8_ppl", "bf16_ppl", "gap_pct")), p
        # The checkpoint, the rebuilt model and the rebuilt validation batches are the run's own: its FP8
        # evaluation reproduces the val_loss the run logged at its last step (same batches, same plan).
        assert p["fp8_loss"] == pytest.approx(read_metrics(out / name, "eval")[-1]["val_loss"], rel=1e-6)
        assert p["fp8_loss"] != p["bf16_loss"]  # BF16 really switched the quantization off
        assert p["gap_pct"] == pytest.approx(100 * (p["fp8_loss"] - p["bf16_loss"]) / p["bf16_loss"])
        assert p["fp8_ppl"] == pytest.approx(math.exp(p["fp8_loss"]))
        assert p["eval_step"] == STEPS and p["stage"] == "fp8 w+a+g"


def test_evaluate_a_bf16_checkpoint_with_another_recipe(shootout, monkeypatch):
    """evaluate_checkpoint (scripts/eval_checkpoint.py's function) on the BF16 run's checkpoint with tensorwise FP8."""
    from fp8_recipes.training.evaluate import evaluate_checkpoint

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(var, raising=False)
    out, _ = shootout
    monkeypatch.chdir(ROOT)  # the run's data.path is as the shoot-out gave it (absolute here)
    result = evaluate_checkpoint(out / "bf16", recipe="tensorwise")
    assert result["recipe"] == "tensorwise" and result["trained_steps"] == STEPS and result["eval_iters"] == 2
    # BF16 GEMMs on the BF16-trained checkpoint: exactly the BF16 run's own last evaluation
    assert result["bf16_loss"] == pytest.approx(read_metrics(out / "bf16", "eval")[-1]["val_loss"], rel=1e-6)
    assert math.isfinite(result["gap_pct"]) and result["fp8_loss"] != result["bf16_loss"]


MOE_RECIPES = ["moe_delayed", "moe_blockwise", "tensorwise"]


@pytest.mark.slow
def test_moe_shootout_on_tiny_moe_keeps_each_recipe_near_bf16(dataset, tmp_path):  # noqa: F811
    """The CI part of issue 28's loss item: the shoot-out on the tiny MoE (2 layers: one MoE, one dense), BF16 against
    the two MoE presets and tensorwise, a few steps each, parity included (a checkpoint of experts evaluates)."""
    out = tmp_path / "moe"
    steps = 8
    overrides = [o for o in _overrides(out) if not o.startswith(("trainer.max_steps=", "trainer.eval_interval="))]
    cmd = [sys.executable, SCRIPT, "--recipes", *MOE_RECIPES, "--parallel", "2", "--out", str(out), *dataset,
           "model=tiny_moe", *overrides, f"trainer.max_steps={steps}", f"trainer.eval_interval={steps}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "compare.json").read_text())
    assert [r["name"] for r in result["runs"]] == ["bf16", *MOE_RECIPES]
    table = (out / "compare.md").read_text()
    for r in result["runs"]:
        assert r["status"] == "ok" and r["steps"] == steps and r["backend"] == "emulated", r
        for key in ("loss_gap_pct", "val_gap_pct"):
            # emulated FP8 a few steps from one init stays close to BF16 (measured: within 0.05%); BF16 is the 0
            assert isinstance(r[key], float) and abs(r[key]) < 1.0, (r["name"], key, r[key])
            assert r["name"] != "bf16" or r[key] == 0.0, (key, r[key])
        assert sum(line.startswith(f"| {r['name']} |") for line in table.splitlines()) == 1, table
        # an MoE run: its routing, summarized from routing.jsonl (the router's tokens per expert: 4 experts, top-2)
        rows = read_jsonl(out / r["name"] / "routing.jsonl")
        assert len(rows) == steps and len({sum(row["tokens"]) for row in rows}) == 1, rows  # one MoE layer
        assert r["routing"]["imbalance"] == pytest.approx(sum(row["imbalance"] for row in rows) / steps), r
        assert 1.0 <= r["routing"]["imbalance"] < 4.0 and 0.0 <= r["routing"]["idle_pct"] < 100.0, r["routing"]
        if r["name"] != "bf16":
            assert abs(r["parity"]["gap_pct"]) < 5.0, r["parity"]  # the FP8 eval of the same weights
    assert "| routing imbalance | idle experts |" in table


def test_plot_only_redraws_from_the_run_dirs(shootout):
    out, _ = shootout
    (out / "compare.png").unlink()
    table = (out / "compare.md").read_text()
    proc = subprocess.run([sys.executable, SCRIPT, "--plot-only", str(out)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the same rows (the shoot-out's note on --parallel comes back from compare.json too)
    assert (out / "compare.md").read_text() == table


@pytest.mark.parametrize("args, expected", [
    (["--recipes", "tensorwize"], "error: --recipes: 'tensorwize' is not a recipe of the pack (did you mean "
                                  "'tensorwise'?); choose from bf16,"),
    (["--recipes", "tensorwise", "trainer.max_stepz=3"], "error: trainer.max_stepz: not in the config"),
    (["--plot-only", "no/such/shootout"], "error: --plot-only: 'no/such/shootout' is not a directory"),
    (["--parity-iters", "0"], "error: --parity-iters: 0 must be >= 1"),
    (["--recipes", "bf16"], "error: --recipes: bf16 alone compares nothing"),  # (it ran 200 steps of BF16 alone)
])
def test_bad_input_is_one_line_exit_2(args, expected, tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, SCRIPT, *args, "--out", str(out)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and not _is_import_noise(ln)]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(expected), proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()


def test_eval_checkpoint_of_a_non_run_is_one_line_exit_2(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "eval_checkpoint.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith(
        f"error: run_dir: '{tmp_path}' has no .hydra/config.yaml"), proc.stderr
    assert "Traceback" not in proc.stderr


def test_eval_checkpoint_of_another_models_checkpoint_is_one_line(dataset, tmp_path):  # noqa: F811
    """--checkpoint of another model's run (a tiny_moe checkpoint for a dense run) is refused before loading, as a
    resume is (it was a load_state_dict traceback); --out onto the run's own metrics.jsonl is refused too, and so is
    an --eval-iters of many passes over the validation split."""
    runs = {}
    for name, model in (("dense", "model=tiny"), ("moe", "model=tiny_moe")):
        runs[name] = tmp_path / name
        args = [model, *dataset, *small_run(runs[name], steps=2), "trainer.save_checkpoints=true"]
        proc = subprocess.run([sys.executable, "scripts/train.py", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
    for extra, says in ((["--checkpoint", str(runs["moe"] / "checkpoints" / "step_2"), "--out",
                          str(tmp_path / "p.json")], "error: --checkpoint: not a checkpoint of this run's model: "),
                        (["--out", str(runs["dense"] / "metrics.jsonl")], "error: --out: "),
                        # (its batches were all held in memory: RSS grew by ~80 MB/s until killed)
                        (["--eval-iters", "100000", "--out", str(tmp_path / "p.json")],
                         "error: --eval-iters: 100,000 micro-batches is more than 10 passes over the validation data")):
        proc = subprocess.run([sys.executable, "scripts/eval_checkpoint.py", str(runs["dense"]), *extra], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)
        lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(says), proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr and not (tmp_path / "p.json").exists()
    assert read_metrics(runs["dense"])  # (its metrics.jsonl untouched)


@pytest.mark.parametrize("value, says", [("0", "0 must be >= 1"), ("-3", "-3 must be >= 1"),
                                         ("x", "'x' is not an integer")])
def test_eval_checkpoint_names_eval_iters_as_its_option(value, says, tmp_path):
    """--eval-iters 0 was refused as `error: eval_iters: ...`, a name the command line does not have."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "eval_checkpoint.py"), str(tmp_path),
                           "--eval-iters", value], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"error: eval_checkpoint.py: argument --eval-iters: {says}; see eval_checkpoint.py --help"], proc.stderr


def test_eval_checkpoint_refuses_an_out_that_is_a_directory_before_evaluating(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "eval_checkpoint.py"), str(tmp_path), "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == (
        f"error: --out: '{tmp_path}' is a directory; give a file path, e.g. parity.json"), proc.stderr


def _is_import_noise(line: str) -> bool:
    """torch's and Megatron-Core's import-time warnings on a machine without CUDA or Transformer Engine."""
    return "No CUDA runtime is found" in line or "Warning" in line or line.strip().startswith("warnings.warn")


def test_a_later_shootout_reuses_the_bf16_run_and_a_recipe_file(shootout, dataset, tmp_path):  # noqa: F811
    """--reference: the first shoot-out's BF16 run stands in for this one's (linked, not trained again: its rows
    are the same file), a recipe file runs under its stem, and its gap is measured against that BF16 run. Another
    config is refused in one line naming the key."""
    first, _ = shootout
    recipe = tmp_path / "tensorwise_e5m2.yaml"
    recipe.write_text("defaults: [tensorwise, _self_]\nname: tensorwise_e5m2\ngradients: {scaling: tensorwise, "
                      "format: e5m2}\nactivations: {scaling: tensorwise, format: e5m2}\n")
    out = tmp_path / "second"
    base = [sys.executable, SCRIPT, "--recipes", str(recipe), "--no-parity", "--reference", str(first / "bf16"),
            *dataset]
    proc = subprocess.run([*base, "--out", str(out), *_overrides(first)], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (out / "bf16").is_symlink() and (out / "bf16").resolve() == (first / "bf16").resolve()
    assert not (out / "logs" / "bf16.log").exists()  # (not trained again)
    runs = {r["name"]: r for r in json.loads((out / "compare.json").read_text())["runs"]}
    assert list(runs) == ["bf16", "tensorwise_e5m2"] and runs["tensorwise_e5m2"]["status"] == "ok"
    first_bf16 = json.loads((first / "compare.json").read_text())["runs"][0]
    assert runs["bf16"]["final_loss"] == first_bf16["final_loss"]
    gap = 100 * (runs["tensorwise_e5m2"]["final_loss"] - first_bf16["final_loss"]) / first_bf16["final_loss"]
    assert runs["tensorwise_e5m2"]["loss_gap_pct"] == pytest.approx(gap)
    assert "e5m2" in (out / "tensorwise_e5m2" / "plan.txt").read_text()
    other = subprocess.run([*base, "--out", str(tmp_path / "third"), *_overrides(first), "trainer.seed=7"],
                           capture_output=True, text=True, timeout=600, cwd=ROOT)
    err = other.stderr.strip()
    assert other.returncode == 2 and err.startswith("error: --reference: ") and "trainer.seed=7" in err, err
    assert len(err.splitlines()) == 1 and not (tmp_path / "third").exists()


def test_an_interrupted_shootout_checkpoints_and_resumes(dataset, tmp_path):  # noqa: F811
    """Ctrl-C at a terminal, or `timeout -s INT` as the GPU script caps a call, signals the whole process group: the
    runs have sessions of their own, so only the shoot-out gets it, and it stops them with SIGTERM: each checkpoints
    and ends preempted (exit 130 for the shoot-out). --resume with the same arguments then finishes them from their
    checkpoints (one row per step, the first attempt's log kept), and a finished FP8 run whose parity.json is
    missing is evaluated again without training. Another config, a trainer.resume override or an --out without a
    shoot-out: one line, exit 2. (The shoot-out is started with SIGINT ignored, as a script's `cmd &` starts it.)"""
    import os
    import signal
    import time

    from test_preemption_cpu import train_rows  # (rows so far: none while the file is missing or a row half-written)

    from fp8_recipes.rundir import read_summary

    # (a step takes ~0.05 s: the signal must come after both runs logged 3 steps and before either ends, and the
    # runs start seconds apart: 400 steps leave a wide window)
    steps, out = 400, tmp_path / "cmp"
    overrides = [o for o in _overrides(out) if not o.startswith(("trainer.max_steps=", "trainer.eval_interval="))]
    base = [sys.executable, SCRIPT, "--recipes", "tensorwise", "--parallel", "2", "--out", str(out), *dataset,
            *overrides, f"trainer.max_steps={steps}", f"trainer.eval_interval={steps}"]
    # started with SIGINT ignored, as a shell starts `cmd &` in a script (run_gpu.sh's parts do): Python keeps it
    # ignored unless the shoot-out handles it itself
    proc = subprocess.Popen(base, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    deadline = time.time() + 300
    while time.time() < deadline and not all(len(train_rows(out / n)) >= 3 for n in ("bf16", "tensorwise")):
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGINT)  # the group, as a terminal's Ctrl-C
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130 and "--resume" in err, err[-2000:]
    for name in ("bf16", "tensorwise"):
        summary = read_summary(out / name)
        assert summary.get("preempted") and (out / name / "checkpoints" / "latest").is_file(), (name, summary)
        assert len(read_metrics(out / name, "train")) < steps

    done = subprocess.run([*base, "--resume"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for name in ("bf16", "tensorwise"):
        assert [r["step"] for r in read_metrics(out / name, "train")] == list(range(1, steps + 1)), name
        assert "preempted" in (out / "logs" / f"{name}.log").read_text()  # (the first attempt's log kept)
    rows = read_metrics(out / "tensorwise", "train")
    (out / "tensorwise" / "parity.json").unlink()
    again = subprocess.run([*base, "--resume"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert (out / "tensorwise" / "parity.json").is_file() and read_metrics(out / "tensorwise", "train") == rows
    runs = {r["name"]: r for r in json.loads((out / "compare.json").read_text())["runs"]}
    assert runs["tensorwise"]["status"] == "ok" and runs["tensorwise"]["parity"]["gap_pct"] is not None, runs

    for extra, said in ((["trainer.seed=7"], "trainer.seed=7"), (["trainer.resume=auto"], "trainer.resume")):
        proc = subprocess.run([*base, "--resume", *extra], capture_output=True, text=True, timeout=300, cwd=ROOT)
        err = proc.stderr.strip()
        assert proc.returncode == 2 and err.startswith("error: ") and said in err and len(err.splitlines()) == 1, err
    proc = subprocess.run([*base[:base.index("--out") + 1], str(tmp_path / "none"), "--resume"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 2 and proc.stderr.startswith("error: --resume: ") and "no compare.json" in proc.stderr
