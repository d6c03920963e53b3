"""The bad-input corpus (bad_input/cases.yaml) through scripts/train.py: every case exits 2 with exactly one
``error:`` line naming the key (the last line of stderr), no traceback, and no run directory left behind.

The cases run as subprocesses a few at a time (each is mostly interpreter start-up; those that need torch, ~2 s).
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from test_train_cpu import dataset, processes_at_once, small_run  # noqa: F401  (the shared tiny dataset fixture)

ROOT = Path(__file__).resolve().parents[2]
CASES = yaml.safe_load((Path(__file__).parent / "bad_input" / "cases.yaml").read_text())
IDS = [c["id"] for c in CASES]
BOMB = "".join(f"{c}: &{c} [{', '.join([f'*{p}'] * 9) if p else ', '.join(['x'] * 9)}]\n"
               for p, c in zip([None, "a", "b", "c", "d", "e", "f", "g"], "abcdefgh"))  # 9^8 values in ~300 bytes
SEARCH_PATH_RECIPES = {  # {tmp}/group/recipe/NAME.yaml, for the cases `+recipe=NAME` found on Hydra's search path
    "bomb": BOMB.encode(),
    "pyobject": b"name: x\nweights: !!python/object/apply:os.system [echo hi]\n",
    "dupkey": b"name: x\nweights: tensorwise\nweights: delayed\n",
    "twodocs": b"name: x\n---\nname: y\n",
    "nul": b"name: x\x00\n",
    "notutf8": b"name: \xff\xfe\n",
    "deep": ("name: x\nweights: " + "[" * 40 + "]" * 40 + "\n").encode(),
    "mine": b"defaults: [base, _self_]\nname: mine\n",  # its defaults list names a bad recipe of the same group
    "base": b"weights: {scaling: tensorwise}\nweights: {scaling: delayed}\n",
}


def test_corpus_is_well_formed():
    assert len(CASES) >= 40 and len(set(IDS)) == len(IDS)
    for case in CASES:
        assert set(case) <= {"id", "args", "env", "key", "phrase"} and (case["args"] or case.get("env")), case
        assert case["key"] and all(isinstance(a, str) for a in case["args"]), case  # (flow lists split at commas)
        assert all(isinstance(v, str) for v in case.get("env", {}).values()), case


@pytest.fixture(scope="module")
def outcomes(request, tmp_path_factory, dataset):  # noqa: F811
    """{case id: (returncode, stdout, stderr, run_dir)} for the selected cases (-k), two per core at a time."""
    tmp = tmp_path_factory.mktemp("bad_input")
    (tmp / "empty.yaml").write_text("# a recipe of comments only\n")
    (tmp / "badmodules.yaml").write_text('defaults: [delayed, _self_]\nname: m\nmodules:\n  "*.experts.*":\n'
                                         '    grads: {scaling: tensorwise}\n')
    group = tmp / "group" / "recipe"  # a user's own recipe group: hydra.searchpath=[file://{tmp}/group]
    group.mkdir(parents=True)
    for name, raw in SEARCH_PATH_RECIPES.items():
        (group / f"{name}.yaml").write_bytes(raw)
    for other in ("model", "autopilot"):  # the other groups' files Hydra loads itself: binary, a scalar
        (tmp / "group" / other).mkdir()
        (tmp / "group" / other / "binary.yaml").write_bytes(b"\x87\xb3\x00\xff" * 100)
        (tmp / "group" / other / "scalar.yaml").write_text("42\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "HYDRA_FULL_ERROR")}

    def run(case):
        run_dir = tmp / "runs" / case["id"]
        args = [*dataset, *small_run(run_dir, num_layers=1, steps=2), "trainer.eval_iters=1",
                *(a.replace("{tmp}", str(tmp)) for a in case["args"])]
        proc = subprocess.run([sys.executable, "scripts/train.py", *args], cwd=ROOT, env={**env, **case.get("env", {})},
                              capture_output=True, text=True, timeout=120)
        return case["id"], (proc.returncode, proc.stdout, proc.stderr, run_dir)

    selected = {item.callspec.params["case"]["id"] for item in request.session.items
                if item.module is request.module and "case" in getattr(getattr(item, "callspec", None), "params", {})}
    with ThreadPoolExecutor(max_workers=2 * processes_at_once()) as pool:  # (mostly interpreter start-up)
        return dict(pool.map(run, [c for c in CASES if c["id"] in selected]))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_bad_input(case, outcomes):
    rc, stdout, stderr, run_dir = outcomes[case["id"]]
    out = stdout + stderr
    assert "Traceback" not in out, out[-3000:]
    assert rc == 2, out[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    last = [line for line in stderr.splitlines() if line.strip()][-1]
    assert len(errors) == 1 and last == errors[0], stderr[-3000:]
    line = errors[0]
    assert case["key"] in line, line
    assert case.get("phrase", "") in line, line
    assert not run_dir.exists(), sorted(p.name for p in run_dir.iterdir())  # not even Hydra's .hydra
    assert "recipe    " not in stdout  # failed before the plan was printed


@pytest.mark.parametrize("stale, says", [
    ({"RANK": "0", "WORLD_SIZE": "2"}, "RANK=0 WORLD_SIZE=2: set without MASTER_ADDR and MASTER_PORT"),
    ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "29500"}, "RANK=1 WORLD_SIZE=2: set without MASTER_ADDR,"),
    ({"RANK": "x", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "RANK=x WORLD_SIZE=2: not integers"),
    ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "RANK=2 WORLD_SIZE=2: the rank is outside the world"),
    ({"SLURM_PROCID": "abc", "SLURM_STEP_NUM_TASKS": "1"}, "SLURM_PROCID=abc SLURM_STEP_NUM_TASKS=1: not integers"),
    ({"SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "2"}, "SLURM_PROCID=3 SLURM_STEP_NUM_TASKS=2: the rank is outside"),
])
def test_stale_launcher_variables_are_one_line(tmp_path, stale, says):
    """RANK / WORLD_SIZE left in the environment without torchrun's rendezvous (was an internal error from
    torch.distributed's env:// or int()): one line naming them and the fix, exit 2, nothing written."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                                             "HYDRA_FULL_ERROR", "SLURM_PROCID",
                                                             "SLURM_STEP_NUM_TASKS")}
    proc = subprocess.run([sys.executable, "scripts/train.py", f"run_dir={tmp_path / 'run'}", "trainer.max_steps=1"],
                          cwd=ROOT, env={**env, **stale}, capture_output=True, text=True, timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    fix = "launch with srun" if "SLURM" in says else \
        "unset RANK WORLD_SIZE to run one process, or launch with torchrun (torchrun --nproc-per-node N ...)"
    assert lines[0].startswith(f"error: {says}") and lines[0].endswith(fix), lines
    assert not (tmp_path / "run").exists()


RANKS_SCRIPT = """
import os, sys, time
sys.path.insert(0, {plugins!r})
import torch.distributed as dist
from fp8_recipes.training.errors import print_error_once
dist.init_process_group("gloo")
rank = dist.get_rank()
if {every_rank}:
    print_error_once(["the config is wrong"])
    if rank == 0:
        time.sleep(15)  # (rank 1 reaches the store's counter before torchrun stops it)
    sys.exit(2)
if rank == 1:
    print_error_once(["checkpoint: rank 1's shard is damaged"])
    sys.exit(2)
dist.barrier()  # rank 0 waits in a collective until torchrun stops it
"""


@pytest.mark.parametrize("every_rank", [True, False], ids=["every-rank", "one-rank"])
def test_a_user_error_under_torchrun_reads_once_and_one_ranks_own_is_not_lost(tmp_path, every_rank, free_port):
    """Two gloo ranks under torchrun: an error both raise prints once (rank 0's; rank 1 finds the store's counter
    taken); one that rank 1 alone raises while rank 0 waits in a barrier prints too, with its rank (it was lost when
    rank 0 alone printed)."""
    script = tmp_path / "ranks.py"
    script.write_text(RANKS_SCRIPT.format(plugins=str(ROOT / "plugins"), every_rank=every_rank))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                           f"--master-port={free_port()}", str(script)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error:")]
    want = "error: the config is wrong" if every_rank else "error: checkpoint: rank 1's shard is damaged (rank 1)"
    assert proc.returncode != 0 and errors == [want], proc.stderr[-3000:]
