"""Checkpoints: ``run_dir/checkpoints/step_N/tp_RR.pt`` written atomically, plus a ``latest`` pointer file.

One file per tensor-parallel rank (its weight shards), written by data-parallel rank 0 of that TP rank
(the other DP ranks hold identical copies). Each file holds: model state (of the GPTModel, without the
Float16Module wrapper, so it loads into either), optimizer, LR scheduler, fp32 master weights (when the
model is bf16), the precision backend's state (e.g. amax histories), the step and the RNG states (CPU,
CUDA, Megatron's model-parallel tracker, Python's ``random``).

Atomicity: every rank writes into ``checkpoints/.step_N.tmp``; after a barrier rank 0 renames it to
``step_N`` and then replaces ``latest``. A crash leaves either the old checkpoint or the new one, never half:
a run dir is resumed from what ``latest`` names only, and a ``.tmp`` directory is never loaded.

``meta.json`` (rank 0, inside the step dir, so atomic with it) says how the checkpoint was made: step, samples
consumed, global and micro batch size, data- and tensor-parallel size. It is read before any process group or
model exists (:func:`resume_skip`), so a resume that cannot work is refused in one line.

Resuming (``trainer.resume``, see :func:`find_resume`): the data position is the samples consumed (step x global
batch; training/run.py starts the global micro-batch stream there, megatron/data.py:data_parallel_batches), so a
run resumes exactly at another data-parallel size with the same global batch size: every rank reads the one
checkpoint file of its TP rank (the optimizer state is not sharded over DP). A different tensor-parallel size or
global batch size is refused. The recipe's schedule stage follows from the step. A checkpoint of another recipe
(its precision state's ``recipe`` differs) restores model, optimizer, schedule and step but not the scaling state,
and says so in one log line.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from fp8_recipes.megatron.model import unwrap_model as _unwrap

__all__ = ["barrier", "save_checkpoint", "load_checkpoint", "resolve_checkpoint", "find_resume", "checkpoint_step",
           "checkpoint_meta", "resume_skip"]

logger = logging.getLogger("fp8_recipes")

FORMAT_VERSION = 1


def _dist():
    import torch.distributed as dist
    return dist if dist.is_available() and dist.is_initialized() else None


def barrier() -> None:
    dist = _dist()
    if dist is not None and dist.get_world_size() > 1:
        dist.barrier()


def _ranks() -> tuple[int, int, int]:
    """(global rank, tensor-parallel rank, data-parallel rank), all 0 without Megatron's groups."""
    dist = _dist()
    rank = dist.get_rank() if dist else 0
    try:
        from megatron.core import parallel_state
        if parallel_state.model_parallel_is_initialized():
            return (rank, parallel_state.get_tensor_model_parallel_rank(),
                    parallel_state.get_data_parallel_rank())
    except ImportError:
        pass
    return rank, 0, rank


def _parallel_sizes() -> dict[str, int]:
    """This run's data- and tensor-parallel sizes (1 and 1 without Megatron's groups)."""
    dist = _dist()
    world = dist.get_world_size() if dist else 1
    try:
        from megatron.core import parallel_state
        if parallel_state.model_parallel_is_initialized():
            return {"data_parallel_size": parallel_state.get_data_parallel_world_size(),
                    "tensor_model_parallel_size": parallel_state.get_tensor_model_parallel_world_size()}
    except ImportError:
        pass
    return {"data_parallel_size": world, "tensor_model_parallel_size": 1}


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        from megatron.core.tensor_parallel import get_cuda_rng_tracker
        state["tracker"] = get_cuda_rng_tracker().get_states()
    except ImportError:
        pass
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "tracker" in state:
        from megatron.core.tensor_parallel import get_cuda_rng_tracker
        get_cuda_rng_tracker().set_states(state["tracker"])


def save_checkpoint(run_dir: str | os.PathLike, step: int, *, model: torch.nn.Module, optimizer=None,
                    scheduler=None, precision=None, master_params=None, extra: dict | None = None,
                    meta: dict | None = None) -> Path:
    """Save everything needed to continue from ``step`` (optimizer steps completed). Collective: call on all ranks.

    ``precision`` and ``master_params`` are anything with ``state_dict()``; ``extra`` is a small plain dict
    (e.g. the trainer config); ``meta`` (JSON-able: the data position, batch sizes) goes into ``meta.json`` with
    the step and the parallel sizes. Returns the final ``step_N`` directory.
    """
    rank, tp_rank, dp_rank = _ranks()
    root = Path(run_dir) / "checkpoints"
    final, tmp = root / f"step_{step}", root / f".step_{step}.tmp"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left over by a crash during an earlier save
        tmp.mkdir()
    barrier()
    if dp_rank == 0:
        payload = {
            "format_version": FORMAT_VERSION,
            "step": step,
            "model": _unwrap(model).state_dict(),
            "optimizer": optimizer.state_dict() if optimizer is not None else None,
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "master_params": master_params.state_dict() if master_params is not None else None,
            "precision": precision.state_dict() if precision is not None else None,
            "rng": _rng_state(),
            "extra": extra or {},
        }
        torch.save(payload, tmp / f"tp_{tp_rank:02d}.pt")
    barrier()
    if rank == 0:
        (tmp / "meta.json").write_text(json.dumps({"step": step, **_parallel_sizes(), **(meta or {})}, indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        pointer = root / ".latest.tmp"
        pointer.write_text(final.name + "\n", encoding="utf-8")
        os.replace(pointer, root / "latest")
    barrier()
    return final


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A ``step_N`` directory from a run dir, its ``checkpoints`` dir (both via ``latest``) or the step dir itself."""
    path = Path(path)
    for root in (path / "checkpoints", path):
        if (root / "latest").is_file():
            return root / (root / "latest").read_text(encoding="utf-8").strip()
    if path.name.endswith(".tmp"):
        raise FileNotFoundError(f"{path} is a checkpoint still being written (or left by a crash); resume from "
                                "its run dir or a finished step_N dir")
    if path.is_dir() and any(path.glob("tp_*.pt")):
        return path
    raise FileNotFoundError(f"no checkpoint at {path} (expected a run dir with checkpoints/latest, "
                            "a checkpoints dir with latest, or a step_N dir with tp_*.pt files)")


def find_resume(resume: str | None, run_dir: str | os.PathLike) -> Path | None:
    """The step dir that ``trainer.resume`` names: None (or "auto" without a checkpoint in ``run_dir``) = start
    fresh; "auto" = ``run_dir``'s latest; else a run dir, checkpoints dir or step dir (ValueError if none)."""
    if resume is None:
        return None
    if resume == "auto":
        return resolve_checkpoint(run_dir) if (Path(run_dir) / "checkpoints" / "latest").is_file() else None
    try:
        return resolve_checkpoint(resume)
    except FileNotFoundError as e:
        raise ValueError(f"trainer.resume: {e}; or set trainer.resume=auto") from None


def checkpoint_step(step_dir: str | os.PathLike) -> int:
    """The step a ``step_N`` dir holds (save_checkpoint's naming), without loading it."""
    match = re.fullmatch(r"step_(\d+)", Path(step_dir).name)
    if match is None:
        raise ValueError(f"trainer.resume: {step_dir} is not a step_N checkpoint dir")
    return int(match.group(1))


def checkpoint_meta(step_dir: str | os.PathLike) -> dict[str, Any]:
    """What ``meta.json`` says about a ``step_N`` dir; for a checkpoint written before it existed, the step and
    the tensor-parallel size (its number of ``tp_*.pt`` files) only."""
    step_dir = Path(step_dir)
    if (step_dir / "meta.json").is_file():
        return json.loads((step_dir / "meta.json").read_text(encoding="utf-8"))
    return {"step": checkpoint_step(step_dir), "tensor_model_parallel_size": len(list(step_dir.glob("tp_*.pt")))}


def resume_skip(step_dir: str | os.PathLike, *, global_batch_size: int, micro_batch_size: int,
                tensor_model_parallel_size: int) -> int:
    """The global micro-batches a run resumed from ``step_dir`` skips (samples consumed / micro_batch_size), after
    refusing, as a one-line ValueError naming the key, what cannot continue that run: another tensor-parallel size
    (a file per TP rank, each holding its shards) or another global batch size (a different sample count per step
    breaks the data position and the LR schedule's meaning). The data-parallel size may change."""
    meta = checkpoint_meta(step_dir)
    tp = meta.get("tensor_model_parallel_size")
    if tp != tensor_model_parallel_size:
        raise ValueError(f"trainer.tensor_model_parallel_size: {tensor_model_parallel_size} differs from the "
                         f"checkpoint's {tp} ({step_dir} holds one file per tensor-parallel rank; resume with "
                         f"trainer.tensor_model_parallel_size={tp})")
    gbs = meta.get("global_batch_size", global_batch_size)
    if gbs != global_batch_size:
        raise ValueError(f"trainer.global_batch_size: {global_batch_size} differs from the checkpoint's {gbs} "
                         f"({step_dir}; resume with trainer.global_batch_size={gbs}, or start a fresh run)")
    consumed = meta.get("consumed_samples", meta["step"] * global_batch_size)
    mbs = meta.get("micro_batch_size", micro_batch_size)
    if mbs != micro_batch_size:
        logger.warning("resume: trainer.micro_batch_size %d -> %d: the same samples in the same order until the end "
                       "of this epoch; after it the order differs (each epoch drops its last partial micro-batch)",
                       mbs, micro_batch_size)
    return consumed // micro_batch_size


def load_checkpoint(path: str | os.PathLike, *, model: torch.nn.Module, optimizer=None, scheduler=None,
                    precision=None, master_params=None, restore_rng: bool = True,
                    map_location: str | torch.device = "cpu") -> int:
    """Restore what :func:`save_checkpoint` wrote into the given objects; returns the step saved.

    Every rank reads its tensor-parallel rank's file. Objects passed as None are skipped.
    """
    rank, tp_rank, _ = _ranks()
    step_dir = resolve_checkpoint(path)
    file = step_dir / f"tp_{tp_rank:02d}.pt"
    if not file.is_file():
        raise FileNotFoundError(f"{file} missing: was the checkpoint written with a different tensor-parallel size?")
    payload = torch.load(file, map_location=map_location, weights_only=True)
    if payload.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{file}: format_version {payload.get('format_version')}, expected {FORMAT_VERSION}")
    _unwrap(model).load_state_dict(payload["model"])
    if precision is not None:  # another recipe's scaling state means nothing here: start it afresh
        saved, current = (payload["precision"] or {}).get("recipe"), precision.state_dict().get("recipe")
        if saved != current:
            precision = None
            if rank == 0:
                logger.warning("resume: %s was written by recipe %r, this run uses %r: scaling state reset "
                               "(model, optimizer, LR schedule, step and RNG restored)", step_dir, saved, current)
    for name, obj in (("optimizer", optimizer), ("scheduler", scheduler), ("master_params", master_params),
                      ("precision", precision)):
        if obj is not None:
            if payload[name] is None:
                raise ValueError(f"{file} has no {name} state to restore")
            obj.load_state_dict(payload[name])
    if restore_rng:
        _set_rng_state(payload["rng"])
    return int(payload["step"])
