"""Slurm (issue 6, items 1 and 4) on a real Slurm: Debian's munged, MariaDB + slurmdbd, slurmctld and slurmd,
started for this module under one temporary directory (slurm_cluster.py) and stopped by their pid files.

Four 2-task CPU (gloo) training jobs run side by side, so that their start-up and requeue waits overlap:

- ``sbatch``: the script of scripts/slurm/make_sbatch.py, submitted with ``--submit``, completes;
- ``sbatch_preempted``: the same, sent ``scancel --signal=USR1`` mid-run: every rank checkpoints, train.py exits 4,
  the script requeues the job, the second run resumes and completes (Restarts=1, every step exactly once);
- ``submitit``: ``scripts/train.py -m hydra/launcher=slurm`` through hydra-submitit-launcher completes;
- ``submitit_preempted``: the same with USR1 mid-run: requeued by the launcher's task, resumed, completed.

Jobs that sbatch refuses (a partition the cluster lacks, more nodes than it has) need the cluster but no training.

Without Slurm (not installable or not startable) the Slurm tests skip with the reason, except under CI (the
environment variable CI set), where they fail: CI must not silently skip them. The generator's unit tests below
need no Slurm: script content from a config, the script's requeue logic run with stand-in srun/scontrol, and bad
launcher values ending in one ``error:`` line.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from fp8_recipes.rundir import RunFileError, read_metrics
from fp8_recipes.training.errors import PREEMPTED_EXIT, USER_ERROR_EXIT
from slurm_cluster import SlurmCluster, SlurmUnavailable
from test_train_cpu import ROOT, assert_learns, dataset, small_run  # noqa: F401  (dataset: the shared fixture)

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

STEPS = 12            # a run that completes
PREEMPT_STEPS = 40    # a run that is signalled after SIGNAL_AFTER steps (far fewer than 40 are done by then)
SIGNAL_AFTER = 3
MAKE_SBATCH = ROOT / "scripts" / "slurm" / "make_sbatch.py"
TRAIN = ROOT / "scripts" / "train.py"
TWO_TASKS = ["launcher.tasks_per_node=2", 'launcher.setup=["export OMP_NUM_THREADS=1"]', "launcher.time_min=10"]
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


# ---------------------------------------------------------------------------------------------------------------
# The cluster and the four jobs


@pytest.fixture(scope="module")
def slurm(tmp_path_factory, free_port):
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"), free_port)
    try:
        cluster.start()
    except (SlurmUnavailable, OSError, subprocess.SubprocessError) as e:
        if os.environ.get("CI"):
            pytest.fail(f"CI needs a real Slurm and could not start one: {e}")
        pytest.skip(f"no real Slurm here: {e}")
    yield cluster
    cluster.stop()


def job_env(cluster: SlurmCluster) -> dict[str, str]:
    """The test's environment for Slurm clients: this cluster's SLURM_CONF, no launcher variables of an outer run."""
    return {k: v for k, v in cluster.env.items()
            if k not in LAUNCH_VARS and not (k.startswith("SLURM_") and k != "SLURM_CONF")}


def train_overrides(run_dir: Path, dataset: list[str], steps: int, checkpoints: bool) -> list[str]:
    """A tiny 2-rank run: global batch 8 = micro 4 x data parallel 2; a metrics row every step."""
    overrides = [o for o in small_run(run_dir, steps=steps)
                 if not (checkpoints and o.startswith("trainer.save_checkpoints="))]
    return ["+recipe=delayed", *dataset, *overrides, "trainer.global_batch_size=8", "trainer.log_interval=1"]


def train_rows(run_dir: Path) -> list[dict]:
    try:
        return read_metrics(run_dir, "train")
    except (FileNotFoundError, RunFileError):  # not there yet, or a row half-written
        return []


def _submit_sbatch(name: str, run_dir: Path, overrides: list[str], env: dict[str, str]) -> dict:
    proc = subprocess.run([sys.executable, str(MAKE_SBATCH), *overrides, *TWO_TASKS, f"launcher.job_name=t-{name}",
                           "--submit"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    job = re.search(r"submitted job (\d+)", proc.stderr)
    assert job and proc.stdout.strip() == str(run_dir / "job.sbatch"), (proc.stdout, proc.stderr)
    return {"run_dir": run_dir, "job": job.group(1), "script": Path(proc.stdout.strip())}


def _start_submitit(name: str, base: Path, overrides: list[str], env: dict[str, str]) -> dict:
    sweep = base / f"{name}_sweep"  # a fresh submitit folder per run: job ids restart with a fresh Slurm
    log = open(base / f"{name}.log", "w+")
    proc = subprocess.Popen([sys.executable, str(TRAIN), "-m", "hydra/launcher=slurm", *overrides, *TWO_TASKS,
                             f"launcher.job_name=t-{name}", f"hydra.sweep.dir={sweep}"], cwd=ROOT, env=env,
                            stdout=log, stderr=subprocess.STDOUT, text=True)
    return {"run_dir": base / name, "proc": proc, "log": log, "sweep": sweep, "job": None}


def _job_by_name(cluster: SlurmCluster, name: str) -> str | None:
    out = subprocess.run(["squeue", "-h", "-n", f"t-{name}", "-o", "%i"], env=cluster.env, capture_output=True,
                         text=True, timeout=30).stdout.split()
    return out[0] if out else None


def _signal_when_training(cluster: SlurmCluster, runs: dict[str, dict], names: tuple[str, ...]) -> None:
    """``scancel --signal=USR1 JOB`` (to the job steps, as ``--signal=USR1@N`` would) once SIGNAL_AFTER steps ran."""
    deadline = time.monotonic() + 300
    waiting = set(names)
    while waiting and time.monotonic() < deadline:
        for name in sorted(waiting):
            r = runs[name]
            r["job"] = r["job"] or _job_by_name(cluster, name)
            rows = len(train_rows(r["run_dir"]))
            if r["job"] and rows >= SIGNAL_AFTER:
                cluster.scancel("--signal=USR1", r["job"])
                r["signalled_after"] = rows
                waiting.discard(name)
        time.sleep(0.2)
    assert not waiting, f"never reached {SIGNAL_AFTER} steps: {waiting}"


@pytest.fixture(scope="module")
def jobs(slurm, dataset, tmp_path_factory) -> dict[str, dict]:
    """name -> {run_dir, job, info (scontrol show job at the end), output | rc, log, sweep} of the four jobs."""
    base = tmp_path_factory.mktemp("slurm_runs")
    env = job_env(slurm)
    runs = {
        "sbatch": _submit_sbatch("sbatch", base / "sbatch",
                                 train_overrides(base / "sbatch", dataset, STEPS, checkpoints=False), env),
        "sbatch_preempted": _submit_sbatch("sbatch_preempted", base / "sbatch_preempted", train_overrides(
            base / "sbatch_preempted", dataset, PREEMPT_STEPS, checkpoints=True), env),
        "submitit": _start_submitit("submitit", base, train_overrides(base / "submitit", dataset, STEPS, False), env),
        "submitit_preempted": _start_submitit("submitit_preempted", base, train_overrides(
            base / "submitit_preempted", dataset, PREEMPT_STEPS, checkpoints=True), env),
    }
    try:
        _signal_when_training(slurm, runs, ("sbatch_preempted", "submitit_preempted"))
        for name, r in runs.items():
            if "proc" in r:
                r["rc"] = r.pop("proc").wait(timeout=400)
                r["log"].seek(0)
                r["output"] = r.pop("log").read()
                r["job"] = r["job"] or next(p.name for p in (r["sweep"] / ".submitit").iterdir() if p.is_dir())
            r["info"] = slurm.wait_until_done(r["job"], timeout=400)
            if "script" in r:
                r["output"] = (r["run_dir"] / f"slurm-{r['job']}.out").read_text()
    finally:
        for r in runs.values():
            if "proc" in r:
                r["proc"].kill()
    return runs


def _submitit_log(r: dict, task: int) -> str:
    folder = r["sweep"] / ".submitit" / r["job"]
    return "".join(p.read_text() for p in sorted(folder.glob(f"{r['job']}_{task}_log.*")))


def _assert_steps_once(run_dir: Path, steps: int) -> list[dict]:
    rows = read_metrics(run_dir, "train")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))  # none lost, none repeated
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == steps and summary["preempted"] is None
    return rows


def _assert_preempted_once(run_dir: Path, signalled_after: int) -> int:
    rows = _assert_steps_once(run_dir, PREEMPT_STEPS)
    marked = [r["step"] for r in rows if r.get("preempted")]
    assert len(marked) == 1 and rows[marked[0] - 1]["preempted"] == "SIGUSR1", marked
    n = marked[0]  # the step every rank finished after the signal; the requeued run starts at n + 1
    assert signalled_after <= n < PREEMPT_STEPS, (signalled_after, n)
    return n


# ---------------------------------------------------------------------------------------------------------------
# a) the generated sbatch script, b) preemption and requeue, c) hydra-submitit-launcher


@pytest.mark.slow
def test_sbatch_script_trains_two_ranks(jobs):
    r = jobs["sbatch"]
    out = r["output"]
    assert (r["info"]["JobState"], r["info"]["ExitCode"], r["info"]["Restarts"]) == ("COMPLETED", "0:0", "0"), out
    assert_learns([row["loss"] for row in _assert_steps_once(r["run_dir"], STEPS)])
    assert "distributed: srun, backend gloo, world 2" in out  # both tasks joined one process group
    assert "global batch 8 = micro 4 x data parallel 2" in out
    assert "fp8-recipes: train.py exited with 0" in out and "Traceback" not in out


@pytest.mark.slow
def test_sbatch_preemption_checkpoints_requeues_and_resumes(jobs):
    r = jobs["sbatch_preempted"]
    out = r["output"]
    assert (r["info"]["JobState"], r["info"]["ExitCode"], r["info"]["Restarts"]) == ("COMPLETED", "0:0", "1"), out
    n = _assert_preempted_once(r["run_dir"], r["signalled_after"])
    job = r["job"]
    assert f"preempted: SIGUSR1 signal, stopped after step {n}" in out
    assert f"fp8-recipes: preempted (exit {PREEMPTED_EXIT}); requeueing job {job} (restart 1 of at most 3)" in out
    assert f"fp8-recipes: job {job} run 2 on" in out  # the same output file, appended (--open-mode=append)
    assert f"resume: from {r['run_dir'] / 'checkpoints' / f'step_{n}'} (step {n}" in out
    assert out.count("distributed: srun, backend gloo, world 2") == 2


@pytest.mark.slow
def test_submitit_launcher_trains_two_ranks(jobs):
    r = jobs["submitit"]
    assert r["rc"] == 0, r["output"][-3000:]
    assert r["info"]["JobState"] == "COMPLETED" and r["info"]["Restarts"] == "0"
    assert f"job 0: run_dir {r['run_dir']}" in r["output"]
    assert_learns([row["loss"] for row in _assert_steps_once(r["run_dir"], STEPS)])
    rank0, rank1 = _submitit_log(r, 0), _submitit_log(r, 1)
    assert "distributed: srun, backend gloo, world 2" in rank0
    for log in (rank0, rank1):
        assert "Job completed successfully" in log and "Traceback" not in log
    script = (r["sweep"] / ".submitit" / r["job"] / f"{r['job']}_submission.sh").read_text()
    for line in ("#SBATCH --ntasks-per-node=2", "#SBATCH --signal=USR1@120", "#SBATCH --requeue",
                 "export SUBMITIT_PREEMPT_SIGNAL=USR1", "export OMP_NUM_THREADS=1"):
        assert line in script, script


@pytest.mark.slow
def test_submitit_preemption_requeues_and_resumes(jobs):
    r = jobs["submitit_preempted"]
    assert r["rc"] == 0, r["output"][-3000:]
    assert r["info"]["JobState"] == "COMPLETED" and r["info"]["Restarts"] == "1", r["info"]
    n = _assert_preempted_once(r["run_dir"], r["signalled_after"])
    rank0 = _submitit_log(r, 0)
    assert f"requeueing job {r['job']} (restart 1 of at most 3)" in rank0
    assert f"resume: from {r['run_dir'] / 'checkpoints' / f'step_{n}'} (step {n}" in rank0
    assert "Job completed successfully" in rank0 and "Job completed successfully" in _submitit_log(r, 1)


# ---------------------------------------------------------------------------------------------------------------
# d) the generator, without Slurm


def make_sbatch_main(argv: list[str], monkeypatch) -> int:
    """scripts/slurm/make_sbatch.py's main in this process (a SystemExit from Hydra's error handler is its code)."""
    import importlib.util

    monkeypatch.setenv("HYDRA_FULL_ERROR", "0")  # (main sets it to 1 for itself; monkeypatch restores it)
    spec = importlib.util.spec_from_file_location("make_sbatch", MAKE_SBATCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    try:
        return module.main(argv)
    except SystemExit as e:
        return int(e.code)


def sbatch_options(text: str) -> dict[str, str | bool]:
    lines = [line.removeprefix("#SBATCH --") for line in text.splitlines() if line.startswith("#SBATCH ")]
    return {k: (shlex.split(v)[0] if v else True) for k, _, v in (line.partition("=") for line in lines)}


def test_sbatch_script_from_the_launcher_config(tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    argv = ["+recipe=hybrid", "model=gpt_125m", "trainer.max_steps=50", "trainer.global_batch_size=128",
            "launcher.nodes=2",
            "launcher.tasks_per_node=4", "launcher.gpus_per_node=4", "launcher.cpus_per_task=8", "launcher.mem_gb=200",
            "launcher.time_min=90", "launcher.partition=h200", "launcher.account=proj-1", "launcher.qos=high",
            "launcher.signal_lead_s=300", "launcher.max_requeues=2", "launcher.sbatch_args={constraint: h200}",
            'launcher.srun_args=["--cpu-bind=none"]', 'launcher.setup=["module load cuda", "export A=1"]',
            f"run_dir={run_dir}"]
    assert make_sbatch_main(argv, monkeypatch) == 0
    script = run_dir / "job.sbatch"
    assert capsys.readouterr().out.strip() == str(script) and os.access(script, os.X_OK)
    text = script.read_text()
    assert sbatch_options(text) == {
        "job-name": "fp8-hybrid", "nodes": "2", "ntasks-per-node": "4", "gpus-per-node": "4", "cpus-per-task": "8",
        "mem": "200G", "partition": "h200", "account": "proj-1", "qos": "high", "time": "90",
        "signal": "USR1@300", "requeue": True, "constraint": "h200", "output": str(run_dir / "slurm-%j.out"),
        "open-mode": "append"}
    srun = next(shlex.split(line) for line in text.splitlines() if line.startswith("srun "))
    assert srun == ["srun", "--cpu-bind=none", sys.executable, str(TRAIN), "+recipe=hybrid", "model=gpt_125m",
                    "trainer.max_steps=50", "trainer.global_batch_size=128", "trainer.resume=auto", f"run_dir={run_dir}",
                    "${resume[@]}"]
    body = text.split("#SBATCH --open-mode=append\n", 1)[1]
    assert body.index("module load cuda\nexport A=1\n") < body.index("srun ")
    assert 'if [ "${SLURM_RESTART_COUNT:-0}" -lt 2 ]; then' in text
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0


def test_gpu_trainer_requests_a_gpu_per_task_for_a_pipeline_layout(tmp_path, monkeypatch):
    """trainer=gpu (trainer.device: gpu) asks for a GPU per task when launcher.gpus_per_node is null; the parallel
    layout is checked at the job's nodes x tasks per node (2 x 2: TP=2 x PP=2 fits), not at the submitting host's one
    process; a layout that does not fit the job is refused in one line, nothing written."""
    run_dir = tmp_path / "run"
    argv = ["+recipe=safe", "trainer=gpu", "model=llama3_8b_8l", "launcher.nodes=2", "launcher.tasks_per_node=2",
            "trainer.tensor_model_parallel_size=2", "trainer.pipeline_model_parallel_size=2", f"run_dir={run_dir}"]
    assert make_sbatch_main(argv, monkeypatch) == 0
    options = sbatch_options((run_dir / "job.sbatch").read_text())
    assert (options["nodes"], options["ntasks-per-node"], options["gpus-per-node"]) == ("2", "2", "2")
    cpu_dir = tmp_path / "cpu"
    assert make_sbatch_main([f"run_dir={cpu_dir}", "launcher.tasks_per_node=2", "trainer.global_batch_size=32"],
                            monkeypatch) == 0
    assert "gpus-per-node" not in sbatch_options((cpu_dir / "job.sbatch").read_text())  # a CPU trainer: none
    bad = tmp_path / "bad"
    assert make_sbatch_main([*argv[:-1], "trainer.pipeline_model_parallel_size=3", f"run_dir={bad}"], monkeypatch) == 2
    assert not bad.exists()


def test_requeue_without_signal_or_requeue(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    assert make_sbatch_main(["launcher.signal=null", "launcher.requeue=false", f"run_dir={run_dir}"],
                            monkeypatch) == 0
    text = (run_dir / "job.sbatch").read_text()
    options = sbatch_options(text)
    assert "signal" not in options and options["no-requeue"] is True and "requeue" not in options
    assert "scontrol requeue" not in text


STUBS = {"srun": 'echo "srun $*" >> "$CALLS"; exit "$SRUN_RC"\n', "scontrol": 'echo "scontrol $*" >> "$CALLS"\n'}


@pytest.mark.parametrize("srun_rc, restarts, terminated, requeued, rc", [
    (PREEMPTED_EXIT, 0, False, True, 0),    # preempted by USR1: requeued
    (PREEMPTED_EXIT, 3, False, False, 4),   # launcher.max_requeues (3) reached: the exit code stays
    (PREEMPTED_EXIT, 0, True, False, 4),    # SIGTERM to the batch shell: Slurm is ending the job, no requeue
    (0, 0, False, False, 0),                # finished
    (1, 0, False, False, 1),                # failed
])
def test_the_scripts_requeue_logic(srun_rc, restarts, terminated, requeued, rc, tmp_path, monkeypatch):
    """The generated script run by bash with stand-ins for srun and scontrol (what they were called with)."""
    assert make_sbatch_main([f"run_dir={tmp_path / 'run'}"], monkeypatch) == 0
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in STUBS.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + (("kill -TERM $PPID; sleep 0.5\n" if terminated else "")
                                                        if name == "srun" else "") + body)
        (bin_dir / name).chmod(0o755)
    calls = tmp_path / "calls.txt"
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "CALLS": str(calls), "SRUN_RC": str(srun_rc),
           "SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": str(restarts), "SLURM_JOB_NODELIST": "n1"}
    proc = subprocess.run(["bash", str(tmp_path / "run" / "job.sbatch")], env=env, capture_output=True, text=True,
                          timeout=30)
    lines = calls.read_text().splitlines()
    assert proc.returncode == rc, (proc.stdout, proc.stderr)
    assert lines[0].startswith("srun ") and lines[0].endswith(" trainer.resume=auto" if restarts else f"run_dir="
                                                                   f"{tmp_path / 'run'}")
    assert lines[1:] == (["scontrol requeue 77"] if requeued else [])


def test_a_gpu_job_transformer_engine_cannot_run_is_refused_before_it_is_submitted(tmp_path, monkeypatch, capsys):
    """A GPU job's plan is checked on the submitting host against its model and layout, for an FP8 GPU with TE: an
    FP8 shape TE cannot run, or sequence parallelism without a TP amax group under delayed scaling, is refused in
    one line before a queue wait (nothing written); a CPU job with the same model is not (its node warns); a recipe
    whose plan depends on which GPU (backend: te with MXFP8) is left to the job's GPU."""
    gpu = ["+recipe=delayed", "trainer=gpu", "launcher.tasks_per_node=2"]
    odd = "model.ffn_hidden_size=504"  # linear_fc2's in_features: not a multiple of 16
    for argv, message in [
        ([*gpu, odd], "error: model: Transformer Engine runs decoder.layers.0.mlp.linear_fc2 in FP8 only with GEMM "
                      "dimensions that are multiples of 8 or 16: in_features 504 is not a multiple of 16"),
        ([*gpu, "trainer.tensor_model_parallel_size=2", "trainer.sequence_parallel=true",
          "++recipe.amax_reduction=data"], "error: recipe.amax_reduction: data with delayed scaling and "
                                           "trainer.sequence_parallel=true")]:
        run_dir = tmp_path / f"run{len(argv)}"
        assert make_sbatch_main([*argv, f"run_dir={run_dir}"], monkeypatch) == USER_ERROR_EXIT
        err = capsys.readouterr().err.strip()
        assert err.startswith(message) and len(err.splitlines()) == 1, err
        assert not run_dir.exists()
    assert make_sbatch_main(["+recipe=delayed", odd, f"run_dir={tmp_path / 'cpu'}"], monkeypatch) == 0
    assert make_sbatch_main(["+recipe=mxfp8", "++recipe.backend=te", *gpu[1:], odd, f"run_dir={tmp_path / 'mx'}"],
                            monkeypatch) == 0


MOE_KEYS = ["model=tiny_moe", "model.moe_router_topk=3", "model.moe_shared_expert_intermediate_size=128",
            "model.moe_layer_freq=[1,0,1,1]", "model.moe_aux_loss_coeff=0.02"]


def test_an_moe_job_carries_its_model_keys_and_is_checked_before_it_is_submitted(tmp_path, monkeypatch, capsys):
    """MoE model keys pass through to every task's train.py as given (the srun line), after the submitting host
    checked them with the rest of the config: a bad one is refused in one line, nothing written; a GPU job of an MoE
    model has its plan checked for TE (one TE recipe per grouped experts' layer: a pattern splitting them is
    refused)."""
    run_dir = tmp_path / "run"
    argv = ["+recipe=moe_delayed", *MOE_KEYS, "launcher.tasks_per_node=2", "trainer.global_batch_size=32",
            f"run_dir={run_dir}"]
    assert make_sbatch_main(argv, monkeypatch) == 0
    srun = next(shlex.split(line) for line in (run_dir / "job.sbatch").read_text().splitlines()
                if line.startswith("srun "))
    assert srun[3:3 + 1 + len(MOE_KEYS)] == ["+recipe=moe_delayed", *MOE_KEYS]
    capsys.readouterr()
    for override, message in [("model.moe_router_topk=5", "error: model.moe_router_topk=5 is more than "
                                                         "model.num_moe_experts=4"),
                              ("model.moe_token_dispatcher_type=alltoal", "error: model.moe_token_dispatcher_type")]:
        bad = tmp_path / "bad"
        assert make_sbatch_main([*argv[:-1], override, f"run_dir={bad}"], monkeypatch) == USER_ERROR_EXIT
        err = capsys.readouterr().err.strip()
        assert err.startswith(message) and len(err.splitlines()) == 1, err
        assert not bad.exists()
    gpu = tmp_path / "gpu"
    job = ["+recipe=moe_blockwise", "trainer=gpu", "model=mixtral_8x7b_4l", "launcher.tasks_per_node=1"]
    assert make_sbatch_main([*job, f"run_dir={gpu}"], monkeypatch) == 0
    assert sbatch_options((gpu / "job.sbatch").read_text())["gpus-per-node"] == "1"
    split = tmp_path / "split"
    assert make_sbatch_main([*job, "++recipe.layers.bf16_modules=[*local_experts.3.*]", f"run_dir={split}"],
                            monkeypatch) == USER_ERROR_EXIT
    err = capsys.readouterr().err.strip()
    assert "model.moe_grouped_gemm=false" in err and len(err.splitlines()) == 1 and not split.exists(), err


def test_expert_parallelism_is_checked_at_the_jobs_world_size(tmp_path, monkeypatch, capsys):
    """trainer.expert_model_parallel_size goes to the job like any trainer key, and the launchers check it at the
    job's nodes x tasks per node (training/config.py's rules), not at the submitting host's one process."""
    base = ["+recipe=moe_delayed", "model=tiny_moe", "trainer.global_batch_size=32"]
    ok = tmp_path / "ok"
    assert make_sbatch_main([*base, "trainer.expert_model_parallel_size=2", "launcher.tasks_per_node=2",
                             f"run_dir={ok}"], monkeypatch) == 0
    assert "trainer.expert_model_parallel_size=2" in (ok / "job.sbatch").read_text()
    capsys.readouterr()
    bad = tmp_path / "bad"
    assert make_sbatch_main([*base, "trainer.expert_model_parallel_size=4", "launcher.tasks_per_node=2",
                             f"run_dir={bad}"], monkeypatch) == USER_ERROR_EXIT  # 4 EP ranks in a 2-rank job
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: trainer.expert_model_parallel_size") and len(err.splitlines()) == 1, err
    assert not bad.exists()


@pytest.mark.parametrize("override, message", [
    ("launcher.nodes=0", "error: launcher.nodes: 0 is not an integer >= 1"),
    ("launcher.signal=TERM", "error: launcher.signal: 'TERM' is not one of USR1 | null"),
    ("launcher.signal_lead_s=3600", "error: launcher.signal_lead_s: 3600 s is not shorter than launcher.time_min=60"),
    ("launcher.sbatch_args={time: 5}", "error: launcher.sbatch_args.time: set by launcher.time_min"),
    ("launcher.sbatch_args={exclusive: false}", "error: launcher.sbatch_args.exclusive: False is not one sbatch value"),
    ("launcher.partition='a b'", "error: launcher.partition: 'a b' is not a Slurm name"),
    ("launcher.max_requeues=-1", "error: launcher.max_requeues: -1 is not an integer >= 0"),
    ("launcher.requeue=maybe", "error: launcher.requeue: 'maybe' is not true or false"),
    ("launcher.srun_args=--x", "error: launcher.srun_args: '--x' is not a list of strings"),
    ("launcher.nodez=2", "error: launcher.nodez: not in the config (did you mean 'nodes'?)"),
    ("launcher=nocluster", "error: launcher: 'nocluster' is not an option of the launcher group"),
    ("trainer.max_steps=0", "error: trainer.max_steps=0: must be an integer >= 1"),
])
def test_bad_launcher_values_end_in_one_line(override, message, tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    assert make_sbatch_main([override, f"run_dir={run_dir}"], monkeypatch) == USER_ERROR_EXIT
    err = capsys.readouterr().err.strip()
    assert err.startswith(message) and len(err.splitlines()) == 1, err
    assert not run_dir.exists()  # nothing written


def test_an_output_that_is_a_directory_is_refused_before_anything_is_written(tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    args = ["+recipe=delayed", f"run_dir={run_dir}", "--output", str(tmp_path)]
    assert make_sbatch_main(args, monkeypatch) == USER_ERROR_EXIT
    err = capsys.readouterr().err.strip()
    assert err == f"error: --output: '{tmp_path}' is a directory; give a file path, e.g. jobs/tw.sbatch", err
    assert not run_dir.exists() and sorted(p.name for p in tmp_path.iterdir()) == []


def test_cli_error_is_one_line_and_exit_2(tmp_path):
    """The real command line: exit code 2, one line on stderr, no traceback, for the generator and for
    ``train.py -m hydra/launcher=slurm`` (checked before anything is submitted: no Slurm needed)."""
    for cmd in ([str(MAKE_SBATCH), "launcher.nodes=0"],
                [str(TRAIN), "-m", "hydra/launcher=slurm", "launcher.time_min=0", f"hydra.sweep.dir={tmp_path}/a"],
                [str(TRAIN), "-m", "hydra/launcher=slurm", "+recipe=hybrd", f"hydra.sweep.dir={tmp_path}/b"],
                [str(TRAIN), "-m", "hydra/launcher=slurm", "trainer.lr=-1", f"hydra.sweep.dir={tmp_path}/c"]):
        env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
        proc = subprocess.run([sys.executable, *cmd], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=120)
        err = [line for line in proc.stderr.splitlines() if not line.startswith("W1")]  # (torch's CUDA notice)
        assert proc.returncode == USER_ERROR_EXIT and len(err) == 1 and err[0].startswith("error: "), proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no sweep dir: neither multirun.yaml nor .submitit/


SUBMITIT_KEYS = [  # (override, the line's start): the key as the user wrote it
    ("hydra.launcher.nodes=0", "error: hydra.launcher.nodes: 0 is not an integer >= 1 (set hydra.launcher.nodes="),
    ("hydra.launcher.timeout_min=-5", "error: hydra.launcher.timeout_min: -5 is not an integer >= 1"),
    ("hydra.launcher.gpus_per_node=0", "error: hydra.launcher.gpus_per_node: 0 is not an integer >= 1"),
    ("launcher.time_min=abc", "error: launcher.time_min: 'abc' is not an integer >= 1 (set launcher.time_min="),
    ("launcher.time_min=null", "error: launcher.time_min: None is not an integer >= 1"),
    ("hydra.launcher.nodes=2", "error: trainer.global_batch_size=16 is not a multiple of micro_batch_size x data "
                               "parallel = 16 x 2"),  # the job's world size counts hydra.launcher.nodes
    # MoE keys, checked with the job's config on the submitting host (several overrides: split at spaces)
    ("model=tiny_moe model.moe_router_topk=5", "error: model.moe_router_topk=5 is more than model.num_moe_experts=4"),
    ("+recipe=moe_delayed model=tiny_moe trainer.expert_model_parallel_size=4 launcher.tasks_per_node=2 "
     "trainer.global_batch_size=32", "error: trainer.expert_model_parallel_size: expert tensor parallel x EP x "
                                     "pipeline = 1 x 4 x 1 = 4 does not divide the 2 launched processes"),
]


def test_submitit_launcher_values_are_checked_under_the_key_given(tmp_path):
    """hydra.launcher.* sizes given in place of their launcher.* interpolation win (docs/slurm.md) and are checked as
    launcher.* are (was: nodes=0 reached submitit), named as written; a bad launcher.* value is named itself (was:
    Hydra's line for the hydra.launcher.* key it feeds, e.g. hydra.launcher.timeout_min). One line, exit 2, nothing
    written (no sweep dir); no Slurm needed. The runs go 3 at a time (each is mostly interpreter start-up)."""
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}

    def run(i: int) -> subprocess.CompletedProcess:
        (tmp_path / str(i)).mkdir()
        overrides = SUBMITIT_KEYS[i][0].split()
        return subprocess.run([sys.executable, str(TRAIN), "-m", "hydra/launcher=slurm", *overrides],
                              cwd=tmp_path / str(i), env=env, capture_output=True, text=True, timeout=120)

    with ThreadPoolExecutor(max_workers=3) as pool:
        procs = list(pool.map(run, range(len(SUBMITIT_KEYS))))
    for (override, message), proc in zip(SUBMITIT_KEYS, procs):
        err = [line for line in proc.stderr.splitlines() if not line.startswith("W1")]  # (torch's CUDA notice)
        assert proc.returncode == USER_ERROR_EXIT and len(err) == 1 and err[0].startswith(message), \
            (override, proc.stderr)
    assert [p for p in tmp_path.rglob("*") if not p.is_dir()] == []


def test_hydra_launcher_takes_its_values_from_the_launcher_group():
    from hydra import compose, initialize_config_dir

    from fp8_recipes.launch.settings import LauncherSettings
    from fp8_recipes.launch.submitit_slurm import submitit_parameters
    from fp8_recipes.recipe.pack import conf_dir

    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = compose("train", overrides=["hydra/launcher=slurm", "launcher.nodes=3", "launcher.tasks_per_node=8",
                                          "launcher.gpus_per_node=8", "launcher.time_min=240", "launcher.partition=p",
                                          "launcher.account=a", "launcher.signal_lead_s=90",
                                          "launcher.sbatch_args={exclusive: true}"], return_hydra_config=True)
    hl = cfg.hydra.launcher
    assert (hl.nodes, hl.tasks_per_node, hl.gpus_per_node, hl.timeout_min, hl.partition, hl.account,
            hl.signal_delay_s) == (3, 8, 8, 240, "p", "a", 90)
    assert hl._target_ == "hydra_plugins.fp8_recipes_slurm.SlurmLauncher"
    settings = LauncherSettings.from_cfg(cfg.launcher)
    params = submitit_parameters({"setup": None, "name": "train"}, settings, "fp8-bf16")
    assert params["additional_parameters"] == {"signal": "USR1@90", "requeue": True, "exclusive": True}
    assert params["setup"] == ["export SUBMITIT_PREEMPT_SIGNAL=USR1"] and params["name"] == "fp8-bf16"


def test_a_hydra_launcher_interpolation_is_resolved_before_the_checks(monkeypatch):
    """hydra.launcher.nodes=${oc.env:NN} (a value from the environment, as cluster wrappers give them) is checked
    and counted as the number it resolves to, under its own key (was: refused as the string '${oc.env:NN}')."""
    from hydra import compose, initialize_config_dir

    from fp8_recipes.launch.submitit_slurm import launcher_settings
    from fp8_recipes.recipe.pack import conf_dir

    monkeypatch.setenv("NN", "2")
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = compose("train", overrides=["hydra/launcher=slurm", "hydra.launcher.nodes=${oc.env:NN}"],
                      return_hydra_config=True)
    settings, keys = launcher_settings(cfg)
    assert settings.nodes == 2 and keys == {"nodes": "hydra.launcher.nodes"}


@pytest.mark.parametrize("procid, restarts, code, signal, requeued, outcome", [
    ("0", "0", PREEMPTED_EXIT, "SIGUSR1", True, SystemExit),   # rank 0, preempted by the configured signal: requeue
    ("0", "3", PREEMPTED_EXIT, "SIGUSR1", False, SystemExit),  # launcher.max_requeues (3) reached
    ("1", "0", PREEMPTED_EXIT, "SIGUSR1", False, SystemExit),  # other ranks only exit
    ("0", "0", PREEMPTED_EXIT, "SIGTERM", False, SystemExit),  # SIGTERM: Slurm is ending the job
    ("0", "0", USER_ERROR_EXIT, None, False, RuntimeError),    # reported to the submitting process, not waited for
    ("0", "0", 0, None, False, None),
])
def test_submitit_task_exit_codes(procid, restarts, code, signal, requeued, outcome, tmp_path, monkeypatch):
    """The launcher's task wrapper around train.py's main: which exit requeues (stand-in scontrol on PATH)."""
    from omegaconf import OmegaConf

    from fp8_recipes.launch.settings import LauncherSettings
    from fp8_recipes.launch.submitit_slurm import TrainTask

    bin_dir, calls = tmp_path / "bin", tmp_path / "calls.txt"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/bash\necho "scontrol $*" >> {calls}\n')
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    for k, v in {"SLURM_PROCID": procid, "SLURM_JOB_ID": "9", "SLURM_RESTART_COUNT": restarts}.items():
        monkeypatch.setenv(k, v)
    (tmp_path / "summary.json").write_text(json.dumps({"preempted": {"signal": signal, "step": 3} if signal else None}))
    seen = {}

    def main(cfg):
        seen["keys"] = set(cfg)
        sys.exit(code)

    cfg = OmegaConf.create({"run_dir": str(tmp_path), "trainer": {"resume": "auto"}, "launcher": {"nodes": 1}})
    task = TrainTask(main, LauncherSettings())
    if outcome is None:
        assert task(cfg) is None
    else:
        with pytest.raises(outcome):
            task(cfg)
    assert seen["keys"] == {"run_dir", "trainer"}  # train.py never sees the launcher node
    assert (calls.read_text().splitlines() if calls.exists() else []) == (["scontrol requeue 9"] if requeued else [])


# ---------------------------------------------------------------------------------------------------------------
# e) jobs the real Slurm refuses (nothing trains: seconds)


REFUSED = [  # (overrides, the line's start): a partition the cluster lacks; more nodes than it has (EnforcePartLimits)
    (["launcher.partition=nosuch"],
     "error: launcher.partition: sbatch refused the job: invalid partition specified: nosuch"),
    (["launcher.nodes=2", "trainer.global_batch_size=32"],
     "error: launcher.nodes: sbatch refused the job: Node count specification invalid"),
]


@pytest.mark.parametrize("overrides, message", REFUSED, ids=["partition", "nodes"])
def test_make_sbatch_submit_refused_by_sbatch_leaves_nothing(overrides, message, slurm, tmp_path, monkeypatch,
                                                             capsys):
    """make_sbatch.py --submit of a job sbatch refuses: one line naming the launcher key and what sbatch said, exit
    2, and neither the script nor the run_dir it made stays (nor the folders it made for an --output); nothing
    printed on stdout. A folder that was there before, empty, stays."""
    monkeypatch.setenv("SLURM_CONF", slurm.env["SLURM_CONF"])
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine").mkdir()
    for output in ([], ["--output", "jobs/deep/x.sbatch"], ["--output", "mine/x.sbatch"]):
        argv = [*overrides, f"run_dir={tmp_path / 'runs' / 'r'}", *output, "--submit"]
        assert make_sbatch_main(argv, monkeypatch) == USER_ERROR_EXIT
        out, err = capsys.readouterr()
        assert err.startswith(message) and len(err.strip().splitlines()) == 1 and not out, (out, err)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"] and not any((tmp_path / "mine").iterdir())


@pytest.mark.parametrize("overrides, message", REFUSED, ids=["partition", "nodes"])
def test_submitit_refused_by_sbatch_leaves_nothing(overrides, message, slurm, tmp_path):
    """train.py -m hydra/launcher=slurm of a job sbatch refuses: one line naming the launcher key (was sbatch's own
    lines and submitit's FailedJobError traceback), exit 2, and neither .submitit/ nor the sweep dir with its
    multirun.yaml (the default multirun/<date>/<time>) stays."""
    env = {k: v for k, v in job_env(slurm).items() if k != "HYDRA_FULL_ERROR"}
    proc = subprocess.run([sys.executable, str(TRAIN), "-m", "hydra/launcher=slurm", *overrides], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    err = [line for line in proc.stderr.splitlines() if not line.startswith("W1")]  # (torch's CUDA notice)
    assert proc.returncode == USER_ERROR_EXIT and len(err) == 1 and err[0].startswith(message), proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []
