"""Shared fixtures. Megatron-Core's parallel state is process-global: tests that build a model take
`megatron_cpu`, which initialises a one-process gloo world and tears it down afterwards."""

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


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
