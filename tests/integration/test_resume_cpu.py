"""Checkpoint / resume on the CPU (issue 6 item 3): ``trainer.resume=auto|<dir>`` continues a run bit-exactly.

The reference is one uninterrupted 10-step run that checkpoints at step 6 (``save_interval=6``). That step_6
directory is exactly what a run killed after step 6 leaves behind; it is copied into a fresh run dir next to a
half-written checkpoint (``.step_8.tmp``) and a ``step_8`` that ``latest`` does not name yet (a crash between
the rename and the pointer update), and ``trainer.resume=auto`` must pick step 6 and reproduce steps 7-10:
losses and gradient norms equal, final weights and FP8 scaling state equal.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fp8_recipes.rundir import read_metrics
from fp8_recipes.training.checkpoint import checkpoint_damage, find_resume, read_checkpoint
from test_train_cpu import ROOT, compose_train, dataset, small_run  # noqa: F401  (dataset: the shared fixture)

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

STEPS, SAVED = 10, 6
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS")


def train_run(recipe: str, run_dir: Path, dataset: list[str], *extra: str, steps: int = STEPS) -> dict:
    from fp8_recipes.training.run import run_training

    overrides = [o for o in small_run(run_dir, steps=steps) if not o.startswith("trainer.save_checkpoints=")]
    overrides += [f"+recipe={recipe}", f"trainer.save_interval={SAVED}", *dataset, *extra]
    with pytest.MonkeyPatch.context() as mp:
        for var in LAUNCH_VARS:
            mp.delenv(var, raising=False)
        return run_training(compose_train(overrides))


def rows(run_dir: Path) -> dict[int, tuple[float, float]]:
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in read_metrics(run_dir, "train")}


def payload(step_dir: Path) -> dict:
    return read_checkpoint(step_dir)


def assert_same(a, b) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif torch.is_tensor(a):
        assert torch.equal(a, b)
    else:
        assert a == b


@pytest.fixture(scope="module")
def reference(dataset, tmp_path_factory) -> dict[str, Path]:
    """recipe -> the run dir of an uninterrupted 10-step run with checkpoints step_6 and step_10 (made on demand)."""
    runs: dict[str, Path] = {}

    def get(recipe: str) -> Path:
        if recipe not in runs:
            runs[recipe] = tmp_path_factory.mktemp(f"full_{recipe}")
            train_run(recipe, runs[recipe], dataset)
        return runs[recipe]

    return get


@pytest.mark.parametrize("recipe", ["delayed", "bf16"])
def test_resume_is_bit_exact_and_skips_unfinished_checkpoints(recipe, reference, dataset, tmp_path):
    full = reference(recipe)
    assert (full / "checkpoints" / "latest").read_text().strip() == f"step_{STEPS}"
    if recipe == "delayed":  # the scaling state carries real amax histories and scales into the resumed run
        scalers = payload(full / "checkpoints" / f"step_{SAVED}")["precision"]["scalers"]
        assert scalers and any(float(sd["history"].abs().sum()) > 0 for r in scalers.values() for sd in r.values())

    # What a run killed after step 8's save began (but before `latest` moved) leaves: resume must use step 6.
    ckpts = tmp_path / "checkpoints"
    shutil.copytree(full / "checkpoints" / f"step_{SAVED}", ckpts / f"step_{SAVED}")
    (ckpts / "latest").write_text(f"step_{SAVED}\n")
    for unfinished in (".step_8.tmp", "step_8"):
        (ckpts / unfinished).mkdir()
        for name in (".metadata", "__0_0.distcp"):
            (ckpts / unfinished / name).write_bytes(b"half-written")
    summary = train_run(recipe, tmp_path, dataset, "trainer.resume=auto")

    assert summary["steps"] == STEPS
    resumed, reference_rows = rows(tmp_path), rows(full)
    assert sorted(resumed) == list(range(SAVED + 1, STEPS + 1))
    assert resumed == {s: reference_rows[s] for s in resumed}  # loss and grad norm, bit for bit
    a, b = payload(full / "checkpoints" / f"step_{STEPS}"), payload(ckpts / f"step_{STEPS}")
    for key in ("model", "optimizer", "precision", "scheduler"):
        assert_same(a[key], b[key])


@pytest.mark.parametrize("recipe", ["tensorwise", "bf16"])
def test_resume_under_another_recipe_resets_scaling_state(recipe, reference, dataset, tmp_path, caplog):
    step_dir = reference("delayed") / "checkpoints" / f"step_{SAVED}"
    with caplog.at_level(logging.INFO, logger="fp8_recipes"):
        summary = train_run(recipe, tmp_path, dataset, f"trainer.resume={step_dir}")
    said = [r.getMessage() for r in caplog.records if "scaling state reset" in r.getMessage()]
    assert len(said) == 1 and f"'delayed', this run uses '{recipe}'" in said[0], said
    assert summary["steps"] == STEPS and sorted(rows(tmp_path)) == list(range(SAVED + 1, STEPS + 1))
    assert all(torch.isfinite(torch.tensor(v)).all() for v in rows(tmp_path).values())


def test_reset_scaling_state_resumes_under_a_changed_recipe(reference, dataset, tmp_path, caplog):
    """Issue 19: the same recipe with another amax history is refused in one line naming the way out;
    trainer.reset_scaling_state=true then resumes weights, optimizer and step with a fresh scaling state."""
    from fp8_recipes.checks import ConfigError

    step_dir = reference("delayed") / "checkpoints" / f"step_{SAVED}"
    shorter = ["+recipe.weights.amax_history_len=16", f"trainer.resume={step_dir}"]
    with pytest.raises(ConfigError, match=r"amax_history_len.*set trainer.reset_scaling_state=true") as e:
        train_run("delayed", tmp_path / "refused", dataset, *shorter)
    assert "\n" not in str(e.value)
    assert not any((tmp_path / "refused" / name).exists() for name in ("plan.txt", "recipe.yaml", "metrics.jsonl"))
    with caplog.at_level(logging.INFO, logger="fp8_recipes"):
        summary = train_run("delayed", tmp_path / "reset", dataset, *shorter, "trainer.reset_scaling_state=true")
    said = [r.getMessage() for r in caplog.records if "reset_scaling_state" in r.getMessage()]
    assert len(said) == 1 and "starts fresh" in said[0], said
    assert summary["steps"] == STEPS and sorted(rows(tmp_path / "reset")) == list(range(SAVED + 1, STEPS + 1))
    saved = payload(tmp_path / "reset" / "checkpoints" / f"step_{STEPS}")["precision"]["scalers"]
    assert {r["weights"]["history"].numel() for r in saved.values() if "weights" in r} == {16}


def test_resume_auto_without_checkpoint_starts_fresh(dataset, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="fp8_recipes"):
        summary = train_run("bf16", tmp_path, dataset, "trainer.resume=auto", steps=2)
    assert summary["steps"] == 2 and sorted(rows(tmp_path)) == [1, 2]
    assert any("no checkpoint" in r.getMessage() and "starting fresh" in r.getMessage() for r in caplog.records)


def test_resuming_a_finished_run_is_a_no_op(reference, dataset, tmp_path):
    """A requeued or resubmitted job resumes a run that already reached max_steps (issue 19): nothing is trained and
    nothing of the run is rewritten, in-process and through scripts/train.py (one line, exit 0); a larger max_steps
    continues it."""
    run = tmp_path / "run"
    shutil.copytree(reference("bf16"), run)
    outputs = ("summary.json", "plan.txt", "recipe.yaml", "metrics.jsonl")
    before = {f: (run / f).read_bytes() for f in outputs}
    for steps in (STEPS, STEPS - 4):
        summary = train_run("bf16", run, dataset, "trainer.resume=auto", steps=steps)
        assert summary["finished"] == {"steps": STEPS, "checkpoint": str(run / "checkpoints" / f"step_{STEPS}"),
                                       "max_steps": steps}
    overrides = [o for o in small_run(run, steps=STEPS) if not o.startswith("trainer.save_checkpoints=")]
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), "+recipe=bf16", "trainer.resume=auto",
                        f"trainer.save_interval={SAVED}", *overrides, *dataset], capture_output=True, text=True,
                       env=env, cwd=ROOT, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip().splitlines()[-1].startswith(f"nothing to do: {run} already trained {STEPS} steps")
    assert "Traceback" not in p.stderr
    assert {f: (run / f).read_bytes() for f in outputs} == before
    elsewhere = [o.replace(f"run_dir={run}", f"run_dir={tmp_path / 'new'}") for o in overrides]  # another run_dir
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), "+recipe=bf16", f"trainer.resume={run}",
                        *elsewhere, *dataset], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert p.returncode == 0 and p.stdout.strip().splitlines()[-1].startswith(f"nothing to do: {run} already")
    assert not (tmp_path / "new").exists()  # (was left holding its .hydra and train.log)
    summary = train_run("bf16", run, dataset, "trainer.resume=auto", steps=STEPS + 1)  # grown: it continues
    assert summary["steps"] == STEPS + 1 and max(rows(run)) == STEPS + 1


@pytest.mark.parametrize("steps", [STEPS + 2, STEPS], ids=["steps-left", "finished"])
@pytest.mark.parametrize("override, saved", [
    ("model.ffn_hidden_size=96", "512"), ("model.hidden_size=64", "128"),
    ("trainer.params_dtype=fp32", "bf16"),  # was a KeyError deep in Megatron-Core's optimizer load
])
def test_resume_under_another_model_is_refused_before_anything_is_written(reference, dataset, tmp_path, override,
                                                                          saved, steps):
    """The key that changed and both values (meta.json records the model's config keys and the params dtype); the
    same for a finished run (all its steps done), which once said "nothing to do" before any model check."""
    run = tmp_path / "run"
    shutil.copytree(reference("bf16"), run)
    before = {f: (run / f).read_bytes() for f in ("summary.json", "plan.txt", "recipe.yaml", "metrics.jsonl")}
    with pytest.raises(ValueError) as e:
        train_run("bf16", run, dataset, "trainer.resume=auto", override, steps=steps)
    message = str(e.value)
    key, _, value = override.partition("=")
    assert message.startswith(f"{key}: the checkpoint has {saved}, this run {value} (") and "\n" not in message
    assert message.endswith(f"was saved with it; resume with {key}={saved}, or start a fresh run)"), message
    assert {f: (run / f).read_bytes() for f in before} == before


def test_a_finished_run_resumed_under_another_model_is_refused_as_with_steps_left(reference, dataset, tmp_path):
    """A hostile-input sweep: trainer.resume= of a finished run under model=tiny_moe said "nothing to do", exit 0.
    Now the line a resume with steps left gives (meta.json records num_moe_experts: the key, both values), through
    scripts/train.py too: exit 2, and the new run_dir given beside the resume is not left behind."""
    run = reference("bf16")
    lines = []
    for steps in (STEPS + 2, STEPS):
        with pytest.raises(ValueError) as e:
            train_run("bf16", tmp_path / "in-process", dataset, f"trainer.resume={run}", "model=tiny_moe", steps=steps)
        lines.append(str(e.value))
    assert lines[0] == lines[1] and lines[0].startswith("model.num_moe_experts: the checkpoint has null, this run 4 ("), \
        lines
    # (a sweep: "resume with model.num_moe_experts=4" on a dense config is a key it does not have; the group is)
    assert lines[0].endswith("resume with the model group it was saved with (a dense model: its run dir's "
                             ".hydra/config.yaml names it), or start a fresh run)"), lines
    overrides = [o for o in small_run(tmp_path / "new", steps=STEPS) if not o.startswith("trainer.save_checkpoints=")]
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), "+recipe=bf16", f"trainer.resume={run}",
                        "model=tiny_moe", *overrides, *dataset], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=600)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stdout[-2000:] + p.stderr[-2000:]
    assert [line for line in p.stderr.splitlines() if line.startswith("error:")] == [f"error: {lines[0]}"]
    assert "nothing to do" not in p.stdout and not (tmp_path / "new").exists()


def test_resume_of_a_checkpoint_without_the_model_record_names_the_tensor(reference, dataset, tmp_path):
    """A checkpoint written before meta.json recorded the model: the first tensor whose shape differs."""
    run = tmp_path / "run"
    shutil.copytree(reference("bf16"), run)
    for meta in (run / "checkpoints").glob("step_*/meta.json"):  # as written before (checksums.json omits it)
        data = json.loads(meta.read_text())
        del data["model"], data["params_dtype"]
        meta.write_text(json.dumps(data))
    with pytest.raises(ValueError) as e:
        train_run("bf16", run, dataset, "trainer.resume=auto", "model.ffn_hidden_size=96", steps=STEPS + 2)
    message = str(e.value)
    assert message.startswith("model: decoder.layers.0.mlp.linear_fc1.weight is (") and "\n" not in message
    assert "was saved with another model config); resume with the model it was saved with" in message
    with pytest.raises(ValueError, match=r"^trainer.params_dtype: the checkpoint has bf16, this run fp32 \("):
        train_run("bf16", run, dataset, "trainer.resume=auto", "trainer.params_dtype=fp32", steps=STEPS + 2)


def test_a_flipped_bit_in_the_latest_checkpoint_is_found_once_the_ranks_share_the_reading(reference, dataset,  # noqa: F811
                                                                                             tmp_path, caplog):
    """The contents are verified after the process group exists (training/checkpoint.py: shared_damage): auto falls
    back to the newest intact checkpoint with one warning and continues from it; named, the damaged one is refused
    in one line and nothing of the run is rewritten. The damaged one is the run's last (step == max_steps): the run
    is not taken for finished on its word, and auto trains the last steps again into an intact checkpoint."""
    import logging

    run = tmp_path / "run"
    shutil.copytree(reference("bf16"), run)
    damaged = run / "checkpoints" / f"step_{STEPS}"
    shard = next(damaged.glob("__0_*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10  # one flipped bit: the size still matches, only the contents' CRC-32 tells
    shard.write_bytes(bytes(data))
    outputs = ("summary.json", "plan.txt", "recipe.yaml", "metrics.jsonl")
    before = {f: (run / f).read_bytes() for f in outputs}
    with pytest.raises(ValueError) as e:
        train_run("bf16", run, dataset, f"trainer.resume={damaged}", steps=STEPS)
    assert str(e.value).startswith(f"trainer.resume: {damaged} is damaged: __0_") and "\n" not in str(e.value)
    assert "does not match its checksum" in str(e.value)
    assert {f: (run / f).read_bytes() for f in outputs} == before
    with caplog.at_level(logging.WARNING, logger="fp8_recipes"):
        summary = train_run("bf16", run, dataset, "trainer.resume=auto", steps=STEPS)
    warnings = [r.getMessage() for r in caplog.records if "newest intact" in r.getMessage()]
    assert warnings == [(f"resume: step_{STEPS} is damaged (__0_0.distcp does not match its checksum, so it changed "
                         f"on disk after it was written); resuming from step_{SAVED}, the newest intact checkpoint")]
    assert "finished" not in summary and summary["steps"] == STEPS and sorted(rows(run)) == list(range(1, STEPS + 1))
    assert checkpoint_damage(damaged) is None  # written again, intact


def test_resume_refuses_unfinished_or_missing_checkpoints(tmp_path):
    from fp8_recipes.training.config import TrainerConfig

    tmp = tmp_path / "checkpoints" / ".step_8.tmp"
    tmp.mkdir(parents=True)
    (tmp / ".metadata").write_bytes(b"half-written")
    for where in (tmp, tmp_path, tmp_path / "checkpoints"):  # no `latest`: nothing finished to resume from
        with pytest.raises(ValueError, match=r"^trainer\.resume: "):
            find_resume(str(where), tmp_path)
    assert find_resume("auto", tmp_path) is None and find_resume(None, tmp_path) is None
    with pytest.raises(ValueError, match=r"^trainer\.resume='/no/such/run': no such directory"):
        TrainerConfig.from_cfg({"resume": "/no/such/run"})
    with pytest.raises(ValueError, match=r"^trainer\.resume: 3 is not a string"):
        TrainerConfig.from_cfg({"resume": 3})


def test_batches_start_at_an_offset_exactly():
    from fp8_recipes.megatron.data import batches

    dataset = [{k: torch.full((3,), i) for k in ("tokens", "labels", "loss_mask", "position_ids")} for i in range(10)]
    full = batches(dataset, 3, seed=7)  # 3 batches per epoch (one sample dropped): skips cross epochs
    stream = [next(full)["tokens"] for _ in range(12)]
    for skip in (0, 2, 3, 7):
        it = batches(dataset, 3, seed=7, skip=skip)
        assert all(torch.equal(next(it)["tokens"], want) for want in stream[skip:])


def test_data_parallel_batches_deal_one_global_stream():
    """Each step's global batch holds the same samples at any data-parallel size (with the same global and micro
    batch sizes), from the start and from a skip: what makes a resume at another DP size exact in its data."""
    from fp8_recipes.megatron.data import batches, data_parallel_batches

    dataset = [{k: torch.full((3,), i) for k in ("tokens", "labels", "loss_mask", "position_ids")} for i in range(11)]
    mbs, gbs, steps = 2, 4, 9  # 5 micro-batches per epoch: global batches straddle epochs
    stream = batches(dataset, mbs, seed=5)
    want = [sorted(torch.cat([next(stream)["tokens"][:, 0] for _ in range(gbs // mbs)]).tolist())
            for _ in range(steps)]
    for dp in (1, 2):
        for start in (0, 3):
            ranks = [data_parallel_batches(dataset, mbs, 5, r, dp, skip=start * gbs // mbs) for r in range(dp)]
            got = [sorted(torch.cat([next(it)["tokens"][:, 0] for it in ranks for _ in range(gbs // (mbs * dp))])
                          .tolist()) for _ in range(steps - start)]
            assert got == want[start:], (dp, start)
    r0, r1 = (data_parallel_batches(dataset, mbs, 5, r, 2) for r in (0, 1))
    assert not set(next(r0)["tokens"][:, 0].tolist()) & set(next(r1)["tokens"][:, 0].tolist())  # disjoint shares
    with pytest.raises(ValueError, match=r"^dp_rank: 2 must be in 0\.\.1"):
        next(data_parallel_batches(dataset, mbs, 5, 2, 2))


# ---------------------------------------------------------------------------------------------------------------
# Resuming at another data-parallel size (the same global batch): DP=2 -> DP=1 and DP=1 -> DP=2

DP_STEPS, DP_SAVED = 8, 4
# Relative loss agreement of runs at different DP sizes on the same global batches (delayed scaling): they differ
# in summation order only (gradients all-reduced instead of accumulated; amaxes MAX-reduced, exact), a few
# roundings that compound over steps: observed <= 4.1e-4 over 8 steps; 5e-3 leaves >10x headroom and still catches
# a wrong batch (a step moves the loss by ~5%). The first step after a resume has not compounded anything yet:
# the same weights, scales and samples as the saving run's step (observed equal; FIRST_STEP_TOL allows for GEMMs
# blocked differently at another thread count).
DP_LOSS_TOL, FIRST_STEP_TOL = 5e-3, 1e-5


def dp_overrides(run_dir: Path, dataset: list[str], *extra: str) -> list[str]:
    return ["+recipe=delayed", *dataset,
            *(o for o in small_run(run_dir, steps=DP_STEPS) if not o.startswith("trainer.save_checkpoints=")),
            "trainer.micro_batch_size=2", "trainer.global_batch_size=4", f"trainer.save_interval={DP_SAVED}", *extra]


def torchrun(run_dir: Path, dataset: list[str], port: int, *extra: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in (*LAUNCH_VARS, "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                             "--master-addr", "127.0.0.1", "--master-port", str(port), "scripts/train.py",
                             *dp_overrides(run_dir, dataset, *extra)], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def in_process(run_dir: Path, dataset: list[str], *extra: str) -> dict:
    from fp8_recipes.training.run import run_training

    with pytest.MonkeyPatch.context() as mp:
        for var in LAUNCH_VARS:
            mp.delenv(var, raising=False)
        return run_training(compose_train(dp_overrides(run_dir, dataset, *extra)))


@pytest.fixture(scope="module")
def dp_runs(dataset, tmp_path_factory, free_port) -> dict[str, Path]:
    """Run dirs: dp1 (8 steps, one rank), dp2 (8 steps, two ranks), dp2_to_1 (dp2's step_4 resumed by one rank),
    dp1_to_2 (dp1's step_4 resumed by two ranks). The torchrun runs overlap the in-process ones."""
    dirs = {name: tmp_path_factory.mktemp(name) for name in ("dp1", "dp2", "dp2_to_1", "dp1_to_2")}
    procs = {"dp2": torchrun(dirs["dp2"], dataset, free_port())}
    try:
        in_process(dirs["dp1"], dataset)
        procs["dp1_to_2"] = torchrun(dirs["dp1_to_2"], dataset, free_port(),
                                     f"trainer.resume={dirs['dp1'] / 'checkpoints' / f'step_{DP_SAVED}'}")
        for name, proc in procs.items():
            _, stderr = proc.communicate(timeout=300)
            errors = "\n".join(line for line in stderr.splitlines() if "error" in line.lower())
            assert proc.returncode == 0 and "Traceback" not in stderr, f"{name}: {errors}\n...\n{stderr[-3000:]}"
            if name == "dp2":
                in_process(dirs["dp2_to_1"], dataset,
                           f"trainer.resume={dirs['dp2'] / 'checkpoints' / f'step_{DP_SAVED}'}")
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    return dirs


def losses(run_dir: Path) -> dict[int, float]:
    return {step: loss for step, (loss, _) in rows(run_dir).items()}


def rel(a: dict[int, float], b: dict[int, float]) -> float:
    assert a.keys() <= b.keys() and a
    return max(abs(a[s] - b[s]) / abs(b[s]) for s in a)


@pytest.mark.slow
def test_two_ranks_train_on_the_one_rank_batches(dp_runs):
    dp1, dp2 = losses(dp_runs["dp1"]), losses(dp_runs["dp2"])
    assert sorted(dp2) == list(range(1, DP_STEPS + 1)) and rel(dp2, dp1) < DP_LOSS_TOL, (dp2, dp1)
    meta = json.loads((dp_runs["dp2"] / "checkpoints" / f"step_{DP_SAVED}" / "meta.json").read_text())
    model = meta.pop("model")  # what a resume checks the model keys against
    assert (model["num_layers"], model["hidden_size"], meta.pop("params_dtype")) == (2, 128, "bf16"), model
    assert meta == {"step": DP_SAVED, "data_parallel_size": 2, "tensor_model_parallel_size": 1,
                    "pipeline_model_parallel_size": 1, "virtual_pipeline_model_parallel_size": None,
                    "context_parallel_size": 1, "expert_model_parallel_size": 1, "expert_tensor_parallel_size": 1,
                    "use_distributed_optimizer": False, "reshardable": True,
                    "consumed_samples": DP_SAVED * 4, "global_batch_size": 4, "micro_batch_size": 2}


@pytest.mark.slow
@pytest.mark.parametrize("name,saved_by", [("dp2_to_1", "dp2"), ("dp1_to_2", "dp1")])
def test_resume_at_another_data_parallel_size(name, saved_by, dp_runs):
    resumed, reference = losses(dp_runs[name]), losses(dp_runs["dp1"])
    assert sorted(resumed) == list(range(DP_SAVED + 1, DP_STEPS + 1))
    assert rel(resumed, reference) < DP_LOSS_TOL, (resumed, reference)
    saver = losses(dp_runs[saved_by])  # the run it continues: its next step, on the same global batch
    assert rel({DP_SAVED + 1: resumed[DP_SAVED + 1]}, saver) < FIRST_STEP_TOL, (resumed, saver)
    assert rel(resumed, saver) < DP_LOSS_TOL
    summary = json.loads((dp_runs[name] / "summary.json").read_text())
    assert summary["steps"] == DP_STEPS and summary["final_stage"] == "fp8 w+a+g"


def test_resume_refuses_another_global_batch_size(dp_runs, dataset, tmp_path):
    # (another tensor-parallel size: test_parallel_cpu.py, which has a TP=2 checkpoint)
    step_dir = dp_runs["dp1"] / "checkpoints" / f"step_{DP_SAVED}"
    with pytest.raises(ValueError, match=r"^trainer\.global_batch_size: 8 differs from the checkpoint's 4 \(.*; resume "
                                         r"with trainer\.global_batch_size=4, or start a fresh run\)$"):
        in_process(tmp_path, dataset, f"trainer.resume={step_dir}", "trainer.global_batch_size=8")
    assert not (tmp_path / "checkpoints").exists()  # refused before anything ran
