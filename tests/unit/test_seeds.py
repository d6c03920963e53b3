"""One shoot-out under several seeds (bench/seeds.py, `compare_recipes.py --over-seeds`): the per-seed gaps and
their means from constructed compare.json files, and one `error:` line for inputs that are not one experiment."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fp8_recipes.bench.seeds import load_shootout, merge_seeds, plot_seeds, save_seeds, summarize_seeds

ROOT = Path(__file__).resolve().parents[2]
BASE = ["model=gpt_125m", "trainer.max_steps=1000"]


def _run(name, final, val, status="ok"):
    return {"name": name, "status": status, "final_loss": final, "val_loss": val,
            "loss_gap_pct": None if name == "bf16" else 100 * (final - 2.0) / 2.0,
            "val_gap_pct": None if name == "bf16" else 100 * (val - 3.0) / 3.0}


def _shootout(tmp_path: Path, seed: int | None, runs: list[dict], overrides=BASE) -> Path:
    out = tmp_path / f"cmp{seed}"
    out.mkdir()
    extra = [] if seed is None else [f"trainer.seed={seed}"]
    (out / "compare.json").write_text(json.dumps({"kind": "compare", "device": "cpu", "overrides": [*overrides, *extra],
                                                  "runs": runs}))
    return out


def test_the_gaps_per_seed_and_their_mean(tmp_path):
    a = _shootout(tmp_path, 1, [_run("bf16", 2.0, 3.0), _run("nvfp4", 2.04, 3.03), _run("mxfp8", 2.0, 3.0)])
    b = _shootout(tmp_path, 2, [_run("bf16", 2.0, 3.0), _run("nvfp4", 2.02, 3.0), _run("mxfp8", 2.0, 3.0, "failed")])
    merged = merge_seeds([load_shootout(a), load_shootout(b / "compare.json")])  # a directory or its compare.json
    assert merged["seeds"] == ["1", "2"] and merged["overrides"] == sorted(BASE)
    rows = {r["name"]: r for r in merged["rows"]}
    assert [s["final"] for s in rows["nvfp4"]["seeds"]] == pytest.approx([2.0, 1.0])
    assert rows["nvfp4"]["mean"] == pytest.approx({"final": 1.5, "eval": 0.5})
    assert rows["mxfp8"]["seeds"][1] is None and rows["mxfp8"]["mean"] == {"final": None, "eval": None}
    table = summarize_seeds(merged)
    assert "| nvfp4 | +2.00 | +1.00 | +1.50 | +1.00 | +0.00 | +0.50 |" in table
    assert "| mxfp8 | +0.00 | - | - | +0.00 | - | - |" in table  # a failed run: no gap, no mean
    assert "| bf16 | 2.0000 | 2.0000 | - | 3.0000 | 3.0000 | - |" in table
    save_seeds(merged, tmp_path / "seeds")
    assert json.loads((tmp_path / "seeds" / "seeds.json").read_text())["rows"][1]["name"] == "nvfp4"
    assert (tmp_path / "seeds" / "seeds.md").read_text().startswith("| recipe |")
    pytest.importorskip("matplotlib")
    assert (tmp_path / "seeds" / "seeds.png").stat().st_size > 1000


def test_a_shootout_without_a_seed_override_ran_the_trainer_configs_seed(tmp_path):
    """No trainer.seed override: conf/trainer's seed (1234), so it cannot be merged with trainer.seed=1234 as another
    seed; a prefixed override (++trainer.seed=N) is the seed too, not another experiment."""
    runs = [_run("bf16", 2.0, 3.0), _run("nvfp4", 2.04, 3.03)]
    plain = _shootout(tmp_path, None, runs, [*BASE, "trainer=gpu"])
    (tmp_path / "pp").mkdir()
    (tmp_path / "pp" / "compare.json").write_text(json.dumps(
        {"kind": "compare", "overrides": [*BASE, "trainer=gpu", "++trainer.seed=4321"], "runs": runs}))
    assert merge_seeds([load_shootout(plain), load_shootout(tmp_path / "pp")])["seeds"] == ["1234", "4321"]
    twice = _shootout(tmp_path, 1234, runs, [*BASE, "trainer=gpu"])
    with pytest.raises(ValueError, match="seed 1234 comes more than once"):
        merge_seeds([load_shootout(plain), load_shootout(twice)])


def _plot_labels(merged, tmp_path, monkeypatch):
    """The legend labels plot_seeds draws (matplotlib's Axes.legend recorded)."""
    from matplotlib.axes import Axes

    seen = []
    real = Axes.legend
    monkeypatch.setattr(Axes, "legend", lambda ax, *a, **k: seen.append(ax.get_legend_handles_labels()[1])
                        or real(ax, *a, **k))
    plot_seeds(merged, tmp_path / "p.png")
    return seen


def test_the_plot_names_every_seed_once_even_where_the_first_recipe_lacks_one(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    a = _shootout(tmp_path, 1, [_run("bf16", 2.0, 3.0), _run("x", 2.0, 3.0), _run("y", 2.04, 3.03)])
    b = _shootout(tmp_path, 2, [_run("bf16", 2.0, 3.0), _run("x", 2.0, 3.0, "failed"), _run("y", 2.02, 3.0)])
    merged = merge_seeds([load_shootout(a), load_shootout(b)])
    assert [sorted(labels) for labels in _plot_labels(merged, tmp_path, monkeypatch)] == [["mean", "seed 1", "seed 2"]]


@pytest.mark.parametrize("case, message", [
    ("one", "give two shoot-outs or more"),
    ("same seed", "seed 1 comes more than once"),
    ("other experiment", "it has trainer.max_steps=200 where the first has trainer.max_steps=1000"),
    ("not a shoot-out", "is not a shoot-out's compare.json"),
    ("unnamed runs", "is not a shoot-out's compare.json"),
    ("unfinished", "is an unfinished shoot-out's; finish it with --resume"),
    ("missing", "holds no compare.json"),
])
def test_inputs_that_are_not_one_experiment_are_refused(tmp_path, case, message):
    runs = [_run("bf16", 2.0, 3.0), _run("nvfp4", 2.04, 3.03)]
    a = _shootout(tmp_path, 1, runs)
    b = {"one": None, "same seed": a,
         "other experiment": _shootout(tmp_path, 2, runs, ["model=gpt_125m", "trainer.max_steps=200"]),
         "not a shoot-out": tmp_path / "x.json", "unnamed runs": tmp_path / "u.json",
         "unfinished": tmp_path / "f.json", "missing": tmp_path / "nowhere"}[case]
    (tmp_path / "x.json").write_text(json.dumps({"kind": "bench_train", "rows": []}))
    (tmp_path / "u.json").write_text(json.dumps({"kind": "compare", "runs": [{"status": "ok"}]}))
    (tmp_path / "f.json").write_text(json.dumps({"runs": [{"name": "bf16"}, {"name": "nvfp4"}]}))  # (compare.py's
    # first write: the run list, before any run ended)
    with pytest.raises(ValueError, match="^--over-seeds: .*" + message.replace("(", r"\(")):
        merge_seeds([load_shootout(p) for p in ([a] if b is None else [a, b])])


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "compare_recipes.py"), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def test_the_command_writes_the_table_or_one_error_line(tmp_path):
    a = _shootout(tmp_path, 1, [_run("bf16", 2.0, 3.0), _run("nvfp4", 2.04, 3.03)])
    b = _shootout(tmp_path, 2, [_run("bf16", 2.0, 3.0), _run("nvfp4", 2.02, 3.0)])
    proc = _cli("--over-seeds", str(a), "--over-seeds", str(b), "--out", "seeds", cwd=tmp_path)  # (repeatable)
    assert proc.returncode == 0, proc.stderr
    assert "| nvfp4 | +2.00 | +1.00 | +1.50 |" in proc.stdout
    assert (tmp_path / "seeds" / "seeds.md").read_text().strip() in proc.stdout
    for argv, key in ([[str(a), str(a), "--out", "again"], "seed 1 comes more than once"],
                      [[str(a), str(b), "trainer.seed=3", "--out", "again"], "drop overrides"],
                      [[str(a), str(b), "--resume", "--out", "again"], "drop --resume"],
                      [[str(a), str(b), "--recipes", "delayed", "--out", "again"], "drop --recipes"],
                      [[str(a), "--parallel", "2", "--over-seeds", str(b), "--out", "again"], "drop --parallel"],
                      [[str(a), str(b), "--out", str(tmp_path / "seeds" / "seeds.md")], "--out: "]):
        proc = _cli("--over-seeds", *argv, cwd=tmp_path)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and key in lines[0], proc
        assert not (tmp_path / "again").exists()  # nothing written
