"""Shared fixtures. Megatron-Core's parallel state is process-global: tests that build a model take
`megatron_cpu`, which initialises a one-process gloo world and tears it down afterwards."""

import os
import random
import socket
from pathlib import Path

import pytest

import fp8_recipes  # noqa: F401  (first: its CPU start-up hook, megatron/cpu_start.py, precedes any Megatron-Core import)

ROOT = Path(__file__).resolve().parents[1]


@pytest.hookimpl(optionalhook=True)  # (pytest-xdist's hook: `-n auto`; without xdist, never called)
def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto`: one worker per core this process may use (xdist's own count is physical cores, one on a VM whose
    two cores are hyperthreads), at most one per 6 GB of memory (a worker and the runs it starts), and none beside
    a GPU: tests/gpu's tests share the one card, so they run in this process, one at a time."""
    import torch

    if torch.cuda.is_available():
        return 0
    memory_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    return max(1, min(len(os.sched_getaffinity(0)), int(memory_gb // 6)))


@pytest.fixture
def megatron_cpu(monkeypatch):
    """(rank, world_size, device) of a fresh single-process world (TP 1, seed 1234); destroyed after the test."""
    from fp8_recipes.megatron.model import destroy_distributed, init_distributed

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(var, raising=False)  # never join a launcher's world from inside pytest
    destroy_distributed()  # a test that failed half-way must not leak its groups into the next one
    yield init_distributed(seed=1234)
    destroy_distributed()


@pytest.fixture
def tiny_model_cfg() -> dict:
    """conf/model/tiny.yaml with the data group's vocabulary (4096) filled in."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(ROOT / "conf" / "model" / "tiny.yaml")
    cfg.vocab_size = 4096
    return OmegaConf.to_container(cfg, resolve=True)


def _unused_port() -> int:
    """A free TCP port below the kernel's ephemeral range. A port the kernel hands out (bind to 0) and a rank binds
    seconds later can be taken in between by the ephemeral sockets of any other gloo world running alongside
    (EADDRINUSE, seen in CI with three 2-rank runs at once); ports below that range are only ever taken on request."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0]) \
        if Path("/proc/sys/net/ipv4/ip_local_port_range").exists() else 32768
    for port in random.sample(range(max(1024, low - 12000), low), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free TCP port below the ephemeral range")


@pytest.fixture(scope="session")
def free_port():
    """A callable returning a free port outside the ephemeral range, for MASTER_PORT / --master-port."""
    return _unused_port
