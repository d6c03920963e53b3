"""What the launcher told this process, before any process group exists: torchrun (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT, LOCAL_WORLD_SIZE), srun without torchrun (SLURM_PROCID, SLURM_STEP_NUM_TASKS,
SLURM_LOCALID, SLURM_STEP_TASKS_PER_NODE; MASTER_ADDR defaults to the step's first node, MASTER_PORT to one derived
from the job and step ids) or nothing (one process). Standard library only: the config checks (training/config.py),
the run directory's cleanup and the process-group start (megatron/model.py) all read it here."""

from __future__ import annotations

import os
import sys
import socket
import subprocess
from dataclasses import dataclass

from fp8_recipes.checks import ConfigError

__all__ = ["Launch", "LaunchError", "check_launch_env", "launch_env", "launch_rank", "launch_world_size",
           "local_world_size"]


class LaunchError(ConfigError):
    """The launcher's variables do not describe a launch (one line naming them and the fix)."""


@dataclass(frozen=True)
class Launch:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun" | "srun" | "single process"


def _torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ  # torchrun, or anything that speaks its protocol


def _srun() -> bool:
    # srun sets SLURM_STEP_NUM_TASKS for a job step; a batch script's own shell has SLURM_PROCID=0 and
    # SLURM_NTASKS=N too, but is one process: treating it as rank 0 of N would hang in init.
    return "SLURM_PROCID" in os.environ and "SLURM_STEP_NUM_TASKS" in os.environ


def check_launch_env() -> None:
    """A LaunchError when RANK and WORLD_SIZE say torchrun but are not torchrun's: not integers, a rank outside the
    world, or without MASTER_ADDR / MASTER_PORT (torchrun always sets them; left over from another launch, e.g.
    exported in a shell, the rendezvous would fail deep in torch.distributed); likewise srun's SLURM_PROCID /
    SLURM_STEP_NUM_TASKS. One of torchrun's pair alone is a warning. Before anything reads them."""
    if not _torchrun():
        if _srun():
            _check_ranks("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "srun", "the step's tasks",
                         "unset SLURM_PROCID SLURM_STEP_NUM_TASKS to run one process, or launch with srun")
        half = [k for k in ("RANK", "WORLD_SIZE") if k in os.environ]
        if half and launch_rank() == 0:  # (one of torchrun's pair: not a launch, and said so)
            print(f"warning: {half[0]}={os.environ[half[0]]} is set without "
                  f"{'WORLD_SIZE' if half[0] == 'RANK' else 'RANK'}: not torchrun's, so this runs one process; "
                  f"unset it, or launch with torchrun", file=sys.stderr)
        return
    fix = "unset RANK WORLD_SIZE to run one process, or launch with torchrun (torchrun --nproc-per-node N ...)"
    shown = _check_ranks("RANK", "WORLD_SIZE", "torchrun", "the world (0..WORLD_SIZE-1)", fix)
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(k)]
    if missing:
        raise LaunchError(f"{shown}: set without {' and '.join(missing)}, so not by torchrun (left over from "
                          f"another launch?); {fix}")


def _check_ranks(rank_key: str, world_key: str, launcher: str, world: str, fix: str) -> str:
    """The launcher's rank and world variables are integers with the rank inside the world (a LaunchError naming
    them otherwise); returns them as shown in a message."""
    env = os.environ
    shown = f"{rank_key}={env[rank_key]} {world_key}={env[world_key]}"
    try:
        rank, size = int(env[rank_key]), int(env[world_key])
    except ValueError:
        raise LaunchError(f"{shown}: not integers, so not {launcher}'s; {fix}") from None
    if not 0 <= rank < size:
        raise LaunchError(f"{shown}: the rank is outside {world}; {fix}")
    return shown


def launch_rank() -> int:
    """This process's global rank as the launcher set it; 0 without a launcher."""
    if _torchrun():
        return int(os.environ["RANK"])
    return int(os.environ["SLURM_PROCID"]) if _srun() else 0


def launch_world_size() -> int:
    """The number of processes the launcher started; 1 without a launcher."""
    if _torchrun():
        return int(os.environ["WORLD_SIZE"])
    return int(os.environ["SLURM_STEP_NUM_TASKS"]) if _srun() else 1


def local_world_size(world_size: int) -> int:
    """The processes on this node (``world_size`` when the launcher does not say)."""
    if "LOCAL_WORLD_SIZE" in os.environ:  # torchrun
        return int(os.environ["LOCAL_WORLD_SIZE"])
    per_node = os.environ.get("SLURM_STEP_TASKS_PER_NODE")  # srun: "2" or "2(x3)" or "2,1"
    if per_node and "SLURM_PROCID" in os.environ:
        return int(per_node.split("(")[0].split(",")[0])
    return world_size


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _first_slurm_host() -> str:
    nodelist = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST", "")
    if int(os.environ.get("SLURM_STEP_NUM_NODES", os.environ.get("SLURM_NNODES", "1"))) == 1:
        return "127.0.0.1"
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                             check=True, timeout=30).stdout.split()
        return out[0]
    except (OSError, subprocess.SubprocessError, IndexError) as e:
        raise RuntimeError(f"cannot resolve the first host of SLURM nodelist {nodelist!r} ({e}); "
                           "export MASTER_ADDR in the job script") from e


def launch_env() -> Launch:
    """Rank, world size, local rank and the rendezvous address of this process, from torchrun, srun or nothing."""
    env = os.environ
    if _torchrun():
        check_launch_env()
        return Launch(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)),
                      env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", 29500)), "torchrun")
    if _srun():
        addr = env.get("MASTER_ADDR") or _first_slurm_host()
        # Every task must agree on the port without talking: derive it from the job and step ids,
        # below the kernel's ephemeral range (32768+): a port the kernel hands to some socket can't be taken here.
        default_port = 15000 + (int(env.get("SLURM_JOB_ID", 0)) * 16 + int(env.get("SLURM_STEP_ID", 0) or 0)) % 17000
        return Launch(int(env["SLURM_PROCID"]), int(env["SLURM_STEP_NUM_TASKS"]), int(env.get("SLURM_LOCALID", 0)),
                      addr, int(env.get("MASTER_PORT", default_port)), "srun")
    return Launch(0, 1, 0, "127.0.0.1", _free_port(), "single process")
