"""The shoot-out's arithmetic on constructed metrics: final loss over the last 5% of steps, steady-state tokens/s,
gaps against BF16, the table and the plot from run directories written here (no training), the overrides each run
gets, and the parity evaluation's choice of step."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fp8_recipes.bench.compare import (
    REFERENCE, add_gaps, autopilot_summary, check_reference, check_runs, collect, final_loss, routing_summary,
    run_entries, run_overrides, save, steady_tokens_per_s, summarize, summarize_run,
)
from fp8_recipes.recipe.pack import load_recipe
from fp8_recipes.recipe.schema import ROLES
from fp8_recipes.training.evaluate import eval_step_all_on, gap_pct


def _rows(losses, stages=None, rates=None, skipped=()):
    stages = stages or ["fp8 w+a+g"] * len(losses)
    rates = rates or [1000.0] * len(losses)
    return [{"kind": "train", "step": i + 1, "loss": x, "stage": s, "tokens_per_s": t, "skipped": i + 1 in skipped}
            for i, (x, s, t) in enumerate(zip(losses, stages, rates))]


def test_final_loss_is_the_mean_of_the_last_five_percent():
    losses = [float(100 - i) for i in range(100)]  # 100, 99, ..., 1
    value, k = final_loss(_rows(losses))
    assert k == 5 and value == pytest.approx((5 + 4 + 3 + 2 + 1) / 5)
    value, k = final_loss(_rows([3.0, 2.0, 1.0]))  # 5% of 3 rounds to 0: at least the last one
    assert (value, k) == (1.0, 1)


def test_final_loss_leaves_out_skipped_and_non_finite_steps():
    rows = _rows([4.0] * 38 + ["nan", 2.0], skipped={39})  # metrics.jsonl writes NaN as the string "nan"
    value, k = final_loss(rows)
    assert k == 2 and value == pytest.approx((4.0 + 2.0) / 2)  # 39 finite losses, k = round(1.95) = 2
    assert math.isnan(final_loss([])[0])


def test_steady_tokens_per_s_drops_the_start_and_earlier_stages():
    stages = ["bf16 warmup"] * 4 + ["fp8 w+a+g"] * 16
    rates = [10.0] * 4 + [50.0, 60.0] + [100.0 + i for i in range(14)]
    # the first 10% of 20 rows (2) are dropped, then every row not in the last stage: left are 50, 60, 100..113,
    # 16 values whose middle two are 105 and 106
    assert steady_tokens_per_s(_rows([1.0] * 20, stages, rates)) == 105.5
    assert steady_tokens_per_s(_rows([1.0], rates=[7.0])) == 7.0  # a single row is its own steady state
    assert math.isnan(steady_tokens_per_s([]))


def test_gaps_against_bf16():
    rows = [{"name": "tensorwise", "status": "ok", "final_loss": 3.03, "val_loss": 2.97, "tokens_per_s": 150.0},
            {"name": REFERENCE, "status": "ok", "final_loss": 3.0, "val_loss": 3.0, "tokens_per_s": 100.0},
            {"name": "blockwise", "status": "failed", "final_loss": math.nan, "val_loss": None,
             "tokens_per_s": math.nan}]
    add_gaps(rows)
    assert rows[0]["loss_gap_pct"] == pytest.approx(1.0) and rows[0]["val_gap_pct"] == pytest.approx(-1.0)
    assert rows[0]["tokens_vs_bf16"] == pytest.approx(1.5) and rows[1]["loss_gap_pct"] == 0.0
    assert rows[2]["loss_gap_pct"] is None and rows[2]["val_gap_pct"] is None and rows[2]["tokens_vs_bf16"] is None
    assert gap_pct(1.01, 1.0) == pytest.approx(1.0) and math.isnan(gap_pct(1.0, 0.0))


def _write_run(run_dir: Path, losses: list[float], val: float, parity: dict | None = None) -> None:
    run_dir.mkdir(parents=True)
    rows = _rows(losses) + [{"kind": "eval", "step": len(losses), "val_loss": val, "stage": "fp8 w+a+g"}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "summary.json").write_text(json.dumps({"steps": len(losses), "stopped": None, "preempted": None,
                                                      "backend": "emulated", "device": "CPU",
                                                      "peak_memory_bytes": 2**30}))
    if parity:
        (run_dir / "parity.json").write_text(json.dumps(parity))


def test_collect_and_save_from_run_dirs(tmp_path):
    n = 40
    _write_run(tmp_path / "bf16", [5.0 - 0.05 * i for i in range(n)], 3.1)
    _write_run(tmp_path / "tensorwise", [5.0 - 0.049 * i for i in range(n)], 3.2,
               {"fp8_loss": 3.2, "bf16_loss": 3.19, "gap_pct": gap_pct(3.2, 3.19), "fp8_ppl": math.exp(3.2),
                "bf16_ppl": math.exp(3.19)})
    (tmp_path / "blockwise").mkdir()  # a run that failed before writing anything
    result = collect(tmp_path, ["bf16", "tensorwise", "blockwise"])
    bf16, tw, bw = result["runs"]
    ref_final = statistics_mean([5.0 - 0.05 * i for i in range(n)][-2:])
    assert bf16["final_loss"] == pytest.approx(ref_final) and bf16["final_k"] == 2
    assert tw["loss_gap_pct"] == pytest.approx(100 * (statistics_mean([5.0 - 0.049 * i for i in range(n)][-2:])
                                                      - ref_final) / ref_final)
    assert tw["val_gap_pct"] == pytest.approx(100 * (3.2 - 3.1) / 3.1)
    assert tw["parity"]["gap_pct"] == pytest.approx(100 * 0.01 / 3.19) and bf16["parity"] is None
    assert (bf16["backend"], bf16["peak_memory_gib"], bf16["peak_memory_kind"]) == ("emulated", 1.0, "cpu peak rss")
    assert bw["status"] == "failed" and bw["steps"] == 0 and bw["loss_gap_pct"] is None

    table = save(result, tmp_path)
    lines = (tmp_path / "compare.md").read_text().splitlines()
    assert [ln.split("|")[1].strip() for ln in lines[2:5]] == ["bf16", "tensorwise", "blockwise"]
    assert f"{tw['loss_gap_pct']:+.2f}%" in lines[3] and "+0.313%" in lines[3] and "failed" in lines[4]
    assert table.splitlines()[0] == lines[0]
    assert (tmp_path / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "compare.json").read_text())["runs"][1]["name"] == "tensorwise"
    # --plot-only reads the run list back from compare.json
    assert [r["name"] for r in collect(tmp_path)["runs"]] == ["bf16", "tensorwise", "blockwise"]


def statistics_mean(values: list[float]) -> float:
    return sum(values) / len(values)


def test_an_moe_runs_routing_is_summarized_and_tabulated(tmp_path):
    from fp8_recipes.observe.routing import routing_row

    rows = [routing_row(1, 0, [4, 4, 4, 4]), routing_row(1, 2, [10, 6, 0, 0]), routing_row(2, 0, [8, 0, 4, 4])]
    summary = routing_summary(rows)
    assert summary["imbalance"] == pytest.approx((1.0 + 2.5 + 2.0) / 3) and summary["idle_pct"] == 100 * 3 / 12
    assert routing_summary([]) is None
    n = 20
    _write_run(tmp_path / "bf16", [5.0 - 0.05 * i for i in range(n)], 3.1)
    _write_run(tmp_path / "moe_delayed", [5.0 - 0.05 * i for i in range(n)], 3.1)
    (tmp_path / "moe_delayed" / "routing.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = collect(tmp_path, ["bf16", "moe_delayed"])
    assert result["runs"][0]["routing"] is None and result["runs"][1]["routing"] == summary
    lines = summarize(result).splitlines()
    assert "| routing imbalance | idle experts | status |" in lines[0]
    assert lines[3].endswith(f"| {summary['imbalance']:.3f} | 25.0% | ok |") and lines[2].endswith("| - | - | ok |")
    dense = collect(tmp_path, ["bf16"])  # a dense shoot-out's table has no routing columns
    assert "routing" not in summarize(dense)


def test_the_autopilots_actions_are_counted_and_tabulated_when_it_was_on(tmp_path):
    n = 20
    for name in ("bf16", "delayed", "tensorwise"):
        _write_run(tmp_path / name, [5.0 - 0.05 * i for i in range(n)], 3.1)
    groups = "model: {num_layers: 2}\ndata: {seq_length: 64}\ntrainer: {max_steps: 20}\n"  # (a run's config has them)
    (tmp_path / "delayed" / ".hydra").mkdir()
    (tmp_path / "delayed" / ".hydra" / "config.yaml").write_text(groups + "autopilot:\n  enabled: true\n  "
                                                                  "dry_run: false\n")
    (tmp_path / "tensorwise" / ".hydra").mkdir()
    (tmp_path / "tensorwise" / ".hydra" / "config.yaml").write_text(groups + "autopilot:\n  enabled: true\n  "
                                                                     "dry_run: true\n")
    (tmp_path / "bf16" / ".hydra").mkdir()  # damaged: read as no autopilot, as the table reads a run without one
    (tmp_path / "bf16" / ".hydra" / "config.yaml").write_text("autopilot: {enabled: true}\n")
    actions = [{"kind": "autopilot", "step": 11, "action": "to_current", "dry": True},
               {"kind": "autopilot", "step": 31, "action": "shorten_history", "dry": True},
               {"kind": "autopilot", "step": 41, "action": "cap_reached"}]
    with open(tmp_path / "tensorwise" / "metrics.jsonl", "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in actions))
    result = collect(tmp_path, ["bf16", "delayed", "tensorwise"])
    assert [r["autopilot"] for r in result["runs"]] == [None, {"actions": 0, "dry_run": False},
                                                        {"actions": 2, "dry_run": True}]
    lines = summarize(result).splitlines()
    assert "| autopilot actions | status |" in lines[0]
    assert lines[2].endswith("| - | ok |") and lines[3].endswith("| 0 | ok |")
    assert lines[4].endswith("| 2 (dry run) | ok |")
    assert "autopilot" not in summarize(collect(tmp_path, ["bf16"]))  # off everywhere: no column
    assert autopilot_summary({"autopilot": {"enabled": "yes"}}, []) is None  # (only a real true means on)


def test_summarize_run_of_a_missing_dir_is_a_not_run_row(tmp_path):
    row = summarize_run(tmp_path / "nothing", "delayed")
    assert row["status"] == "not run" and row["steps"] == 0 and row["parity"] is None


def test_run_overrides_keep_recipe_edits_off_the_bf16_reference(tmp_path):
    overrides = ["trainer.max_steps=10", "recipe.schedule.bf16_warmup_steps=2", "++recipe.backend=emulated"]
    assert run_overrides("bf16", overrides, tmp_path / "bf16") == [
        "+recipe=bf16", "trainer.max_steps=10", f"run_dir={tmp_path / 'bf16'}"]
    assert run_overrides("safe", overrides, tmp_path / "safe") == [
        "+recipe=safe", *overrides, f"run_dir={tmp_path / 'safe'}"]


@pytest.mark.parametrize("names, overrides, expected", [
    (["bf16", "tensorwize"], [], "--recipes: 'tensorwize' is not a recipe of the pack (did you mean 'tensorwise'?); "
                                 "choose from bf16, blockwise, delayed,"),
    (["bf16", "r/nv7.yaml"], [], "--recipes: file 'r/nv7.yaml' does not exist; give a recipe name (bf16,"),
    (["bf16", "tests"], [], "--recipes: 'tests' is not a recipe of the pack; choose from bf16,"),
    (["bf16", "tests/gpu"], [], "--recipes: 'tests/gpu' is a directory, not a YAML file"),
    (["bf16"], ["+recipe=delayed"], "recipe: chosen by --recipes"),
    (["bf16"], ["run_dir=/tmp/x"], "run_dir: each run's directory is OUT/NAME"),
    (["bf16"], ["trainer.max_stepz=3"], "trainer.max_stepz: not in the config (did you mean 'max_steps'?)"),
    (["bf16"], ["trainer.save_checkpoints=false"], "trainer.save_checkpoints: false leaves no checkpoint"),
])
def test_check_runs_refuses_with_one_line(names, overrides, expected, tmp_path):
    with pytest.raises(ValueError) as e:
        check_runs(names, overrides, tmp_path / "out", parity=True)
    assert str(e.value).startswith(expected) and "\n" not in str(e.value)


ABLATIONS = sorted(str(p) for p in (Path(__file__).resolve().parents[1] / "gpu" / "nvfp4_ablations").glob("*.yaml"))


def test_recipe_files_run_under_their_stems_and_compose_as_train_py_takes_them(tmp_path):
    """--recipes takes recipe files beside the pack's names (nvfp4's ablations: `defaults: [nvfp4, _self_]` and
    one key changed); each run is named by the file's stem, its +recipe= the file's absolute path."""
    entries = run_entries(["nvfp4", *ABLATIONS])
    assert list(entries) == ["bf16", "nvfp4", "mxfp8_emulated", "nvfp4_1d_weights", "nvfp4_no_rht", "nvfp4_no_sr"]
    no_rht = next(a for a in ABLATIONS if a.endswith("nvfp4_no_rht.yaml"))
    assert entries["nvfp4_no_rht"] == str(Path(no_rht).resolve()) and entries["nvfp4"] == "nvfp4"
    assert run_overrides("nvfp4_no_rht", ["trainer.max_steps=3"], tmp_path / "x", entries["nvfp4_no_rht"])[0] == (
        f"+recipe={entries['nvfp4_no_rht']}")
    cfg = check_runs(entries, ["trainer.max_steps=3"], tmp_path / "out", parity=False)
    assert cfg.trainer.max_steps == 3  # (the BF16 reference's config; every run composed and checked)
    (tmp_path / "bf16.yaml").write_text("defaults: [tensorwise, _self_]\nname: mine\n")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "nvfp4_no_rht.yaml").write_text("defaults: [nvfp4, _self_]\n")
    for clash in ([str(tmp_path / "bf16.yaml")], [no_rht, str(tmp_path / "b" / "nvfp4_no_rht.yaml")]):
        with pytest.raises(ValueError, match=r"^--recipes: two runs would be named '(bf16|nvfp4_no_rht)' .*rename"):
            run_entries(clash)


def test_check_runs_refuses_an_existing_run_dir(tmp_path):
    (tmp_path / "bf16").mkdir()
    with pytest.raises(ValueError, match=r"^--out: .*bf16' already exists"):
        check_runs(["bf16"], [], tmp_path, parity=False)


def test_parity_evaluates_with_every_stage_on():
    safe = load_recipe("safe")  # BF16 warmup, then weights at 100, activations at 200, gradients at 300
    starts = [safe.schedule.role_start(r) for r in ROLES]
    assert eval_step_all_on(safe, trained_steps=50) == max(starts) == 300
    assert eval_step_all_on(safe, trained_steps=400) == 399  # the checkpoint's own last step
    assert eval_step_all_on(load_recipe("tensorwise"), trained_steps=1) == 0


def test_check_reference_takes_a_finished_bf16_run_of_the_same_config_only(tmp_path):
    from omegaconf import OmegaConf

    cfg = check_runs(["bf16"], ["trainer.max_steps=3"], tmp_path / "out", parity=False)
    ref = tmp_path / "ref"
    (ref / ".hydra").mkdir(parents=True)
    saved = OmegaConf.to_container(cfg, resolve=False)
    saved["run_dir"] = "/elsewhere/bf16"  # (its own run dir: not a difference)
    (ref / ".hydra" / "config.yaml").write_text(yaml.safe_dump(saved))
    (ref / "summary.json").write_text(json.dumps({"recipe": "bf16", "stopped": None, "preempted": None}))
    check_reference(ref, cfg)
    saved["trainer"]["lr"] = 1.0
    (ref / ".hydra" / "config.yaml").write_text(yaml.safe_dump(saved))
    with pytest.raises(ValueError, match=r"^--reference: .* ran trainer\.lr=1\.0, this shoot-out runs trainer\.lr="):
        check_reference(ref, cfg)
    (ref / "summary.json").write_text(json.dumps({"recipe": "bf16", "stopped": "max_time"}))
    with pytest.raises(ValueError, match=r"^--reference: .* holds no finished BF16 run"):
        check_reference(ref, cfg)
    (ref / "summary.json").write_text(json.dumps({"recipe": "delayed"}))
    with pytest.raises(ValueError, match=r"summary\.json: recipe delayed\)"):
        check_reference(ref, cfg)
    (ref / "summary.json").write_text(json.dumps({"recipe": "bf16"}))
    (ref / ".hydra" / "config.yaml").unlink()
    with pytest.raises(ValueError, match=r"^--reference: .* has no \.hydra/config\.yaml; give a directory written by"):
        check_reference(ref, cfg)


def test_reference_and_recipe_file_edges_are_one_line_errors(tmp_path):
    """The review's cases: a stem a run dir override cannot hold, a reference that overlaps --out, a dangling link
    at OUT/bf16, a resumed reference (trainer.resume differs: same training), the reference kept in compare.json,
    and '=' in a recipe file's or a reference's path (a path, not a Hydra override)."""
    from omegaconf import OmegaConf

    odd = tmp_path / "x(1).yaml"
    odd.write_text("defaults: [tensorwise, _self_]\n")
    with pytest.raises(ValueError, match=r"^--recipes: .*'x\(1\)'.*rename the file$"):
        run_entries([str(odd)])
    cfg = check_runs(["bf16"], ["trainer.max_steps=3"], tmp_path / "out", parity=False)
    ref = tmp_path / "ref"
    (ref / ".hydra").mkdir(parents=True)
    saved = {**OmegaConf.to_container(cfg, resolve=False), "run_dir": str(ref)}
    saved["trainer"] = {**saved["trainer"], "resume": "auto"}  # (preempted, then resumed)
    (ref / ".hydra" / "config.yaml").write_text(yaml.safe_dump(saved))
    (ref / "summary.json").write_text(json.dumps({"recipe": "bf16"}))
    check_reference(ref, cfg, tmp_path / "out")
    for out in (ref, ref / "cmp", tmp_path):
        with pytest.raises(ValueError, match=r"^--reference: .* overlap"):
            check_reference(ref, cfg, out)
    saved["trainer"]["seed"] = None
    (ref / ".hydra" / "config.yaml").write_text(yaml.safe_dump(saved))
    with pytest.raises(ValueError, match=r"ran trainer\.seed=null, this shoot-out runs trainer\.seed=1234;"):
        check_reference(ref, cfg)
    (tmp_path / "dangling").mkdir()
    (tmp_path / "dangling" / "bf16").symlink_to(tmp_path / "gone")
    with pytest.raises(ValueError, match=r"^--out: .*bf16' already exists"):
        check_runs(["bf16"], [], tmp_path / "dangling", parity=False)
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "compare.json").write_text(json.dumps({"reference": str(ref), "runs": []}))
    _write_run(tmp_path / "kept" / "bf16", [5.0, 4.0], 3.0)
    assert collect(tmp_path / "kept", ["bf16"])["reference"] == str(ref)
    script = Path(__file__).resolve().parents[2] / "scripts" / "compare_recipes.py"
    eq_file, eq_ref = tmp_path / "e=f.yaml", tmp_path / "lr=3e-4"
    eq_file.write_text("defaults: [tensorwise, _self_]\n")
    eq_ref.mkdir()
    for args, said in (([str(eq_file)], "--recipes: "), (["tensorwise", "--reference", str(eq_ref)], "--reference: ")):
        proc = subprocess.run([sys.executable, str(script), "--recipes", *args, "--out", str(tmp_path / "o")],
                              capture_output=True, text=True, timeout=300)
        err = proc.stderr.strip()
        assert proc.returncode == 2 and err.startswith(f"error: {said}") and len(err.splitlines()) == 1, err


def test_run_states_for_resume(tmp_path):
    """--resume: no run dir = new, a summary of a run that ended on its own = done (a stopped one too), a preempted
    run or one without a summary (killed) = resume; OUT/bf16 must be the --reference run, linked."""
    from fp8_recipes.bench.compare import run_states

    for name, summary in (("a", {"recipe": "a"}), ("b", {"stopped": "non-finite loss"}),
                          ("c", {"preempted": {"signal": "SIGTERM", "step": 3}}), ("d", None)):
        (tmp_path / name).mkdir()
        if summary is not None:
            (tmp_path / name / "summary.json").write_text(json.dumps(summary))
    assert run_states(tmp_path, ["a", "b", "c", "d", "e"]) == dict(a="done", b="done", c="resume", d="resume",
                                                                    e="new")
    ref = tmp_path / "ref"
    ref.mkdir()
    (tmp_path / "bf16").symlink_to(ref, target_is_directory=True)
    assert run_states(tmp_path, ["bf16"], ref) == {"bf16": "resume"}  # (its summary decides, as for any run)
    with pytest.raises(ValueError, match=r"^--reference: .*bf16' holds another BF16 run than .*/a'; drop"):
        run_states(tmp_path, ["bf16"], tmp_path / "a")
