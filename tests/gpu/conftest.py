"""GPU tests: run on the GPU machine (tests/gpu/run_gpu.sh); every module here skips without CUDA and TE."""

from __future__ import annotations

import pytest


@pytest.fixture
def megatron_gpu(monkeypatch):
    """(rank, world_size, device) of a fresh one-process NCCL world (TP 1, seed 1234); destroyed afterwards."""
    from fp8_recipes.megatron.model import destroy_distributed, init_distributed

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(var, raising=False)
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    destroy_distributed()
    FP8GlobalStateManager.reset()  # (an earlier test without this fixture may have left its modules' buffers)
    yield init_distributed(seed=1234)
    destroy_distributed()
    FP8GlobalStateManager.reset()  # drop the amax buffers that still point at this test's modules
