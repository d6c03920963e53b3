"""Training end to end on the CPU: every shipped recipe through ``run_training`` with a Hydra-composed config,
staged enablement visible in metrics.jsonl, 2-rank gloo data parallelism through torchrun and scripts/train.py,
the README's first command, and user errors that end in one line.

All runs share one small dataset (20 standard-library modules, byte tokenizer) built once per session.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir

from fp8_recipes.plan.precision import ModelLayout, PrecisionPlan
from fp8_recipes.plan.format import format_plan
from fp8_recipes.recipe.pack import conf_dir, load_recipe, recipe_names
from fp8_recipes.rundir import read_metrics
from fp8_recipes.recipe.schema import Recipe
from fp8_recipes.training.checkpoint import read_checkpoint

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

ROOT = Path(__file__).resolve().parents[2]
STEPS = 12
CORPUS_MODULES = ("abc", "base64", "bisect", "calendar", "colorsys", "copy", "csv", "difflib", "fnmatch",
                  "fractions", "functools", "gettext", "glob", "heapq", "keyword", "numbers", "operator", "shlex",
                  "string", "textwrap")
# safe, rescheduled to fit a short run: BF16 warmup for steps 0-1, then weights from 2, activations from 5,
# gradients from 8 (0-based optimizer steps; metrics rows count steps completed, so row N is step N - 1).
SAFE_SCHEDULE = {"bf16_warmup_steps": 2, "weights": 2, "activations": 5, "gradients": 8}
SAFE_OVERRIDES = [f"recipe.schedule.bf16_warmup_steps={SAFE_SCHEDULE['bf16_warmup_steps']}"] + [
    f"recipe.schedule.enable.{role}={SAFE_SCHEDULE[role]}" for role in ("weights", "activations", "gradients")]


@pytest.fixture(scope="session")
def dataset(tmp_path_factory) -> list[str]:
    """Hydra overrides of the `data` group for a ~200 kB byte-tokenized corpus (prepared once here, reused by
    every run: prepare_dataset's fast path only rehashes the inputs)."""
    from fp8_recipes.megatron.data import prepare_dataset

    root = tmp_path_factory.mktemp("data")
    corpus = root / "corpus"
    corpus.mkdir()
    stdlib = Path(sysconfig.get_path("stdlib"))
    for name in CORPUS_MODULES:
        shutil.copy(stdlib / f"{name}.py", corpus / f"{name}.py")
    prepare_dataset(str(corpus), root / "bytes", tokenizer_kind="bytes")
    # 20 documents: the default split (98,1,1) would leave validation without a document
    return [f"data.path={root / 'bytes'}", f"data.inputs={corpus}", "data.tokenizer=bytes", "data.split='80,10,10'"]


def processes_at_once() -> int:
    """How many processes a test runs at a time: the cores this pytest process has to itself (its share of them
    under pytest-xdist, whose PYTEST_XDIST_WORKER_COUNT workers run side by side), at least 1. More processes than
    cores cost time of their own (docs/facts.md, "The CPU suite's time")."""
    return max(1, len(os.sched_getaffinity(0)) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))


def small_run(run_dir: Path, num_layers: int = 2, steps: int = STEPS) -> list[str]:
    return [f"trainer.max_steps={steps}", "trainer.warmup_steps=2", "trainer.eval_interval=0", "trainer.eval_iters=1",
            "trainer.micro_batch_size=4", "trainer.global_batch_size=4", "trainer.save_checkpoints=false",
            f"model.num_layers={num_layers}", "model.vocab_size=null", f"run_dir={run_dir}"]


def compose_train(overrides: list[str]):
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        return compose("train", overrides=overrides)


def train_losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir, "train")]


def assert_learns(losses: list[float]) -> None:
    assert all(math.isfinite(x) for x in losses), losses
    assert sum(losses[-3:]) / 3 < losses[0], losses


# ---------------------------------------------------------------------------------------------------------------
# Every recipe, in process


@pytest.mark.parametrize("name", [*recipe_names(), None], ids=[*recipe_names(), "no-recipe"])
def test_train_each_recipe(name, dataset, tmp_path, monkeypatch):
    from fp8_recipes.training.run import run_training

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(var, raising=False)
    # safe keeps the first and the last layer BF16, nvfp4 the last two: leave one in FP8
    num_layers = 3 if name in ("safe", "nvfp4") else 2
    overrides = [f"+recipe={name}"] if name else []
    overrides += (SAFE_OVERRIDES if name == "safe" else []) + dataset + small_run(tmp_path, num_layers)
    cfg = compose_train(overrides)
    summary = run_training(cfg)

    recipe = load_recipe(cfg.recipe) if name else load_recipe("bf16")
    plan = PrecisionPlan(recipe, ModelLayout.gpt(num_layers))
    for f in ("plan.txt", "recipe.yaml", "metrics.jsonl", "summary.json", "loss.png"):
        assert (tmp_path / f).is_file(), f
    assert (tmp_path / "plan.txt").read_text() == format_plan(plan, max_steps=STEPS) + "\n"
    assert Recipe.from_dict(yaml.safe_load((tmp_path / "recipe.yaml").read_text())) == recipe
    assert not (tmp_path / "checkpoints").exists()

    rows = read_metrics(tmp_path, "train")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["stage"] for r in rows] == [plan.at(r["step"] - 1).stage for r in rows]
    assert_learns([r["loss"] for r in rows])
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk["steps"] == summary["steps"] == STEPS and on_disk["nonfinite_loss_steps"] == 0
    assert on_disk["final_stage"] == plan.at(STEPS - 1).stage
    assert summary["recipe"] == (name or "bf16") and summary["backend"] == "emulated"
    if name in (None, "bf16"):
        assert {r["stage"] for r in rows} == {"bf16"}
    elif name == "safe":  # the stage column switches exactly at the overridden steps
        w, a, g = (SAFE_SCHEDULE[r] for r in ("weights", "activations", "gradients"))
        expected = ["bf16 warmup"] * w + ["fp8 w"] * (a - w) + ["fp8 w+a"] * (g - a) + ["fp8 w+a+g"] * (STEPS - g)
        assert [r["stage"] for r in rows] == expected
        assert "bf16_first: 1" in (tmp_path / "plan.txt").read_text()
    else:
        assert {r["stage"] for r in rows} == {"fp8 w+a+g"}


# ---------------------------------------------------------------------------------------------------------------
# Two data-parallel ranks through torchrun and scripts/train.py

# Test-only hook, loaded by each rank's interpreter (sitecustomize on PYTHONPATH): after training, dump what the
# rank ends with. run_training imports `train` from the loop module when it runs, so patching the module suffices.
DUMP_HOOK = r'''
import os
if os.environ.get("FP8_TEST_DUMP") and os.environ.get("RANK") is not None:
    import hashlib, inspect, json
    from fp8_recipes.megatron.model import unwrap_model
    from fp8_recipes.training import loop

    _train = loop.train

    def _tensor_sha(t):
        return hashlib.sha256(t.detach().float().contiguous().numpy().tobytes()).hexdigest()

    def train(*args, **kwargs):
        bound = inspect.signature(_train).bind(*args, **kwargs).arguments
        first = {}

        def spy(it):  # the first batch this rank trains on
            for i, b in enumerate(it):
                if i == 0:
                    first["tokens"] = _tensor_sha(b["tokens"])
                yield b

        streams = bound["batches_train"]  # one per model chunk (one here)
        bound["batches_train"] = [spy(streams[0]), *streams[1:]]
        summary = _train(**bound)
        precision = bound["precision"]
        state = precision.state_dict()
        out = {"rank": bound["rank"], "first_batch": first["tokens"], "scales": precision.scales(),
               "histories": {n: {r: _tensor_sha(s["history"]) for r, s in per.items()}
                             for n, per in state.get("scalers", {}).items()},
               "params": {k: _tensor_sha(v) for k, v in unwrap_model(bound["engine"].models[0]).state_dict().items()
                          if hasattr(v, "numpy")}}
        with open(os.path.join(os.environ["FP8_TEST_DUMP"], f"rank{out['rank']}.json"), "w") as f:
            json.dump(out, f)
        return summary

    loop.train = train
'''


@pytest.mark.slow
@pytest.mark.parametrize("name", ["delayed", "tensorwise"])
def test_two_rank_data_parallel(name, dataset, tmp_path):
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(DUMP_HOOK)
    dump = tmp_path / "dump"
    dump.mkdir()
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "OMP_NUM_THREADS")}
    env.update(PYTHONPATH=os.pathsep.join([str(hook), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               FP8_TEST_DUMP=str(dump))
    overrides = [f"+recipe={name}", *dataset, *small_run(run_dir, steps=10), "trainer.micro_batch_size=2",
                 "trainer.save_checkpoints=true", "trainer.eval_interval=10"]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "scripts/train.py", *overrides], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr
    r0, r1 = (json.loads((dump / f"rank{i}.json").read_text()) for i in (0, 1))
    assert r0["first_batch"] != r1["first_batch"]  # each rank trains on its own data...
    assert r0["params"] == r1["params"]  # ...and the replicas stay bit-identical
    # Delayed scaling: the same scales and the same whole amax histories on both ranks (the final evaluation
    # reads the scales without recording its amaxes, so slot 0 is empty after the last update on every rank).
    assert r0["scales"] == r1["scales"] and r0["histories"] == r1["histories"]
    # the checkpoint (each entry written once, by data-parallel rank 0) holds the same state
    ckpt = read_checkpoint(run_dir / "checkpoints" / "step_10")
    assert {k: hashlib.sha256(v.float().numpy().tobytes()).hexdigest() for k, v in ckpt["model"][0].items()
            if torch.is_tensor(v)} == r1["params"]
    saved = ckpt["precision"]["scalers"]
    if name == "delayed":  # amaxes are MAX-reduced over the data-parallel group: one set of scales everywhere
        assert len(saved) == 2 * 4 + 1 and all(set(per) == {"weights", "activations", "gradients"}
                                               for per in saved.values())
        assert {n: {r: float(s["scale"]) for r, s in per.items()} for n, per in saved.items()} == r1["scales"]
        assert {n: {r: hashlib.sha256(s["history"].numpy().tobytes()).hexdigest() for r, s in per.items()}
                for n, per in saved.items()} == r1["histories"]
        fp8 = [s for n, per in r1["scales"].items() if n != "output_layer" for s in per.values()]
        assert fp8 and all(s != 1.0 for s in fp8)
    else:
        assert saved == {}
    assert_learns(train_losses(run_dir))
    assert json.loads((run_dir / "summary.json").read_text())["final_stage"] == "fp8 w+a+g"


# ---------------------------------------------------------------------------------------------------------------
# The README's first command


def readme_first_command() -> str:
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", readme, re.S).group(1)
    return next(line for line in block.splitlines() if line.strip())


def test_readme_first_command(dataset, tmp_path):
    setup, _, command = readme_first_command().partition(" && ")
    assert setup == "bash scripts/setup.sh"  # already done: this suite runs in that .venv
    argv = shlex.split(command)
    assert argv[0] == ".venv/bin/python" and argv[1] == "scripts/train.py", command
    recipe = next(a.split("=", 1)[1] for a in argv if a.startswith("+recipe="))
    shortened = [*argv[1:], "trainer.max_steps=10", "trainer.warmup_steps=2", "trainer.eval_interval=5",
                 "trainer.eval_iters=2", "trainer.micro_batch_size=4", "trainer.global_batch_size=4",
                 "model.num_layers=2", "model.vocab_size=null", f"run_dir={tmp_path}", *dataset]
    proc = subprocess.run([sys.executable, *shortened], cwd=ROOT, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "Traceback" not in out
    plan_text = (tmp_path / "plan.txt").read_text()
    assert plan_text in proc.stdout and plan_text.startswith(f"recipe    {recipe}")
    stage = PrecisionPlan(load_recipe(recipe), ModelLayout.gpt(2)).at(9).stage
    assert "step 10: val_loss" in proc.stdout and f"({stage})" in proc.stdout
    assert re.search(rf"done: 10 steps of {recipe} \(emulated\), loss \d", proc.stdout)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 10 and summary["final_stage"] == stage and math.isfinite(summary["val_loss"])
    assert_learns(train_losses(tmp_path))
    assert [r["step"] for r in read_metrics(tmp_path, "eval")] == [5, 10]


# ---------------------------------------------------------------------------------------------------------------
# User errors through scripts/train.py: one line naming the key, no traceback, no run directory left behind

USER_ERRORS = {
    "bad-override": (["+recipe=hybrid", "recipe.weights.scaling=mxfp9"], "recipe.weights.scaling"),
    "unknown-recipe": (["+recipe=hybird"], None),  # Hydra's own message
    "missing-data": (["+recipe=hybrid", "data.path={tmp}/nodata", "data.inputs={tmp}/missing.txt"], "data.inputs"),
    "te-on-cpu": (["+recipe=hybrid", "+recipe.backend=te"], "backend"),
    # hybrid does not state `backend`: Hydra wants `+recipe.backend=te`, and its message says so
    "te-on-cpu-unstated-key": (["+recipe=hybrid", "recipe.backend=te"], None),
}


@pytest.fixture(scope="module")
def user_error_runs(tmp_path_factory, dataset):
    """Run every case at once (each is mostly interpreter start-up): {case: (CompletedProcess-like, run_dir)}."""
    tmp = tmp_path_factory.mktemp("user_errors")
    procs = {}
    for case, (overrides, _) in USER_ERRORS.items():
        run_dir = tmp / case
        data = [] if case == "missing-data" else dataset
        args = [o.format(tmp=tmp) for o in overrides] + data + [f"run_dir={run_dir}", "model.num_layers=2"]
        procs[case] = (subprocess.Popen([sys.executable, "scripts/train.py", *args], cwd=ROOT, text=True,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE), run_dir)
    out = {}
    for case, (p, run_dir) in procs.items():
        stdout, stderr = p.communicate(timeout=300)
        out[case] = (p.returncode, stdout, stderr, run_dir)
    return out


@pytest.mark.parametrize("case", USER_ERRORS)
def test_user_errors_through_train_script(case, user_error_runs):
    rc, stdout, stderr, run_dir = user_error_runs[case]
    key = USER_ERRORS[case][1]
    assert rc != 0
    assert "Traceback" not in stdout + stderr
    assert not run_dir.exists()
    assert rc == 2
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stderr[-3000:]
    if key is None:  # Hydra's own composition errors, as one line too (more in bad_input/cases.yaml)
        assert ("'hybird'" in errors[0]) if case == "unknown-recipe" else ("+recipe.backend=te" in errors[0])
        return
    assert key in errors[0], stderr[-3000:]
    assert "recipe    " not in stdout  # failed before the plan was printed


def test_a_training_start_prepares_a_damaged_dataset_again(dataset, tmp_path):
    """A hand-damaged meta.json in the prepared dataset (the sweep's `{"format": 1, "vocab_size": "big"}`) ended in
    `internal error: KeyError: 'data_hash'` and left the run dir; the training start now prepares the dataset
    again from data.inputs with one warning naming data.path, as it does for a truncated corpus, and trains."""
    data = Path(next(o for o in dataset if o.startswith("data.path=")).split("=", 1)[1])
    copy = tmp_path / "data"
    shutil.copytree(data, copy, ignore=shutil.ignore_patterns("cache"))
    (copy / "meta.json").write_text('{"format": 1, "vocab_size": "big"}\n')
    overrides = [o for o in dataset if not o.startswith("data.path=")] + [f"data.path={copy}"]
    proc = subprocess.run([sys.executable, "scripts/train.py", *overrides, *small_run(tmp_path / "run", steps=1)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    warned = [line for line in (proc.stdout + proc.stderr).splitlines() if "is damaged" in line]
    assert warned == [f"warning: data.path: {copy} is damaged (meta.json has no 'data_hash' of type str); preparing "
                      f"it again from its inputs"], proc.stdout[-3000:]
    assert json.loads((copy / "meta.json").read_text()) | {"build_seconds": 0} == \
        json.loads((data / "meta.json").read_text()) | {"build_seconds": 0}
