"""Checkpoints: ``run_dir/checkpoints/step_N/``, a torch.distributed.checkpoint (DCP) directory written atomically,
plus a ``latest`` pointer file.

Every rank takes part in the save (``dcp.save`` is collective). Each rank offers its tensor-parallel rank's payload
under the key ``tpRR``: the data-parallel replicas of a TP rank offer the same keys and DCP's save planner keeps
one copy of each, written by the lowest rank that holds it (data-parallel rank 0 of that TP rank, as before), so a
checkpoint is as large at DP=8 as at DP=1. The step dir holds DCP's ``.metadata`` and ``__R_0.distcp`` files.
A payload holds: model state (of the GPTModel, without the Float16Module wrapper, so it loads into either),
optimizer, LR scheduler, fp32 master weights (when the model is bf16), the precision backend's state (e.g. amax
histories), the step and the RNG states (CPU, CUDA, Megatron's model-parallel tracker, Python's ``random``).
Its tensors go through DCP one by one (``tpRR.tensors.<key path>``); the rest of it, the exact Python structure
with a marker where each tensor was, is one pickled bytes entry (``tpRR.skeleton``): DCP's own flattening of
nested dicts would turn the optimizer state's int keys into strings and drop empty dicts.
:func:`read_checkpoint` gives one TP rank's payload back, in one process, without a process group.

Atomicity: every rank writes into ``checkpoints/.step_N.tmp``; after a barrier rank 0 renames it to
``step_N`` and then replaces ``latest``. A crash leaves either the old checkpoint or the new one, never half:
a run dir is resumed from what ``latest`` names only, and a ``.tmp`` directory is never loaded.

``meta.json`` (rank 0, inside the step dir, so atomic with it) says how the checkpoint was made: step, samples
consumed, global and micro batch size, data- and tensor-parallel size. It is read before any process group or
model exists (:func:`resume_skip`), so a resume that cannot work is refused in one line.

Resuming (``trainer.resume``, see :func:`find_resume`): the data position is the samples consumed (step x global
batch; training/run.py starts the global micro-batch stream there, megatron/data.py:data_parallel_batches), so a
run resumes exactly at another data-parallel size with the same global batch size: every rank reads its TP rank's
payload (the optimizer state is not sharded over DP). A different tensor-parallel size or global batch size is
refused. The recipe's schedule stage follows from the step. A checkpoint of another recipe (its precision state's
``recipe`` differs) restores model, optimizer, schedule and step but not the scaling state, and says so in one log
line. A format-1 checkpoint (``step_N/tp_RR.pt`` torch.save files, before DCP) is refused in one line.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import logging
import os
import random
import re
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from fp8_recipes.megatron.model import unwrap_model as _unwrap

__all__ = ["barrier", "save_checkpoint", "load_checkpoint", "read_checkpoint", "resolve_checkpoint", "find_resume",
           "checkpoint_step", "checkpoint_meta", "resume_skip"]

logger = logging.getLogger("fp8_recipes")

FORMAT_VERSION = 2
"""1: ``step_N/tp_RR.pt``, one torch.save file per TP rank (refused now); 2: a torch.distributed.checkpoint dir."""
_METADATA = ".metadata"  # DCP's index of a checkpoint dir (FileSystemWriter writes it last, via a rename)
_TENSOR = "__fp8_recipes_tensor__"  # in a payload's skeleton: (_TENSOR, name) stands where tensor ``name`` was


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


def _tp_key(tp_rank: int) -> str:
    """The top-level DCP key of one tensor-parallel rank's payload."""
    return f"tp{tp_rank:02d}"


def _split_tensors(obj: Any, path: tuple[str, ...], tensors: dict[str, torch.Tensor]) -> Any:
    """``obj`` with each tensor moved into ``tensors`` (named by its key path) and a ``(_TENSOR, name)`` marker left.

    Dicts are copied with their type and attributes (``OrderedDict._metadata``, the module versions that
    ``load_state_dict`` reads) and their keys as they are; plain lists and tuples are walked, anything else is kept.
    """
    if isinstance(obj, torch.Tensor):
        name = "/".join(path)
        if name in tensors:  # keys that print alike (0 and "0"): still one name per tensor
            name = f"{name}#{len(tensors)}"
        tensors[name] = obj
        return (_TENSOR, name)
    if isinstance(obj, dict):
        out = copy.copy(obj)
        for key, value in obj.items():
            out[key] = _split_tensors(value, (*path, str(key)), tensors)
        return out
    if type(obj) in (list, tuple):
        return type(obj)(_split_tensors(v, (*path, str(i)), tensors) for i, v in enumerate(obj))
    return obj


def _join_tensors(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Undo :func:`_split_tensors`: put each tensor back where its marker stands."""
    if type(obj) is tuple and len(obj) == 2 and isinstance(obj[0], str) and obj[0] == _TENSOR:
        return tensors[obj[1]]
    if isinstance(obj, dict):
        for key, value in obj.items():
            obj[key] = _join_tensors(value, tensors)
        return obj
    if type(obj) in (list, tuple):
        return type(obj)(_join_tensors(v, tensors) for v in obj)
    return obj


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns on every save/load without a process group; single-process use is intended here (tests, tools)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _write_payload(step_dir: Path, tp_rank: int, payload: dict[str, Any]) -> None:
    """Save ``payload`` as ``tpRR`` into the DCP dir ``step_dir``. Collective over all ranks (when a group exists):
    replicas of the same key (data-parallel ranks) are written once, by the lowest rank holding it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    tensors: dict[str, torch.Tensor] = {}
    skeleton = io.BytesIO()
    torch.save(_split_tensors(payload, (), tensors), skeleton)
    state = {_tp_key(tp_rank): {"skeleton": skeleton.getvalue(), "tensors": tensors}}
    with _single_process_quiet():
        dcp.save(state, storage_writer=dcp.FileSystemWriter(step_dir),
                 planner=DefaultSavePlanner(dedup_save_to_lowest_rank=True), no_dist=_dist() is None)


def _saved_payloads(step_dir: Path) -> dict[str, list[tuple[tuple, Any]]]:
    """Per ``tpRR`` key in the DCP dir ``step_dir``, its entries as (key path below ``tpRR``, storage metadata),
    read from ``.metadata`` only (``planner_data`` maps each flattened key to its path)."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(step_dir).read_metadata()
    per_tp: dict[str, list[tuple[tuple, Any]]] = {}
    for fqn, storage in metadata.state_dict_metadata.items():
        path = (metadata.planner_data or {}).get(fqn)
        if path:
            per_tp.setdefault(str(path[0]), []).append((tuple(path[1:]), storage))
    return per_tp


def read_checkpoint(step_dir: str | os.PathLike, tp_rank: int = 0,
                    map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """The payload :func:`save_checkpoint` wrote for ``tp_rank`` in ``step_dir`` (a finished ``step_N`` dir):
    ``{"format_version", "step", "model", "optimizer", "scheduler", "master_params", "precision", "rng", "extra"}``.

    Reads in this process only (no process group needed, none used: each rank reads its own TP rank's payload).
    The template DCP loads into is built from the checkpoint's own metadata, since a fresh optimizer has no state.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    step_dir = Path(step_dir)
    per_tp = _saved_payloads(step_dir)
    key = _tp_key(tp_rank)
    if key not in per_tp:
        raise FileNotFoundError(f"{step_dir} holds no state of tensor-parallel rank {tp_rank} (it holds "
                                f"{', '.join(sorted(per_tp)) or 'none'}): was it written at another "
                                "tensor-parallel size?")
    template: dict[str, Any] = {"skeleton": None, "tensors": {}}  # None: replaced by the loaded bytes
    for path, storage in per_tp[key]:
        if path[0] == "tensors" and isinstance(storage, TensorStorageMetadata):
            template["tensors"][path[1]] = torch.empty(storage.size, dtype=storage.properties.dtype,
                                                       device=map_location)
    with _single_process_quiet():
        dcp.load({key: template}, storage_reader=dcp.FileSystemReader(step_dir), no_dist=True)
    skeleton = torch.load(io.BytesIO(template["skeleton"]), map_location=map_location, weights_only=True)
    return _join_tensors(skeleton, template["tensors"])


def save_checkpoint(run_dir: str | os.PathLike, step: int, *, model: torch.nn.Module, optimizer=None,
                    scheduler=None, precision=None, master_params=None, extra: dict | None = None,
                    meta: dict | None = None) -> Path:
    """Save everything needed to continue from ``step`` (optimizer steps completed). Collective: call on all ranks.

    ``precision`` and ``master_params`` are anything with ``state_dict()``; ``extra`` is a small plain dict
    (e.g. the trainer config); ``meta`` (JSON-able: the data position, batch sizes) goes into ``meta.json`` with
    the step and the parallel sizes. Returns the final ``step_N`` directory.
    """
    rank, tp_rank, _ = _ranks()
    root = Path(run_dir) / "checkpoints"
    final, tmp = root / f"step_{step}", root / f".step_{step}.tmp"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left over by a crash during an earlier save
        tmp.mkdir()
    barrier()
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
    _write_payload(tmp, tp_rank, payload)
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
            return _current_format(root / (root / "latest").read_text(encoding="utf-8").strip())
    if path.name.endswith(".tmp"):
        raise FileNotFoundError(f"{path} is a checkpoint still being written (or left by a crash); resume from "
                                "its run dir or a finished step_N dir")
    if path.is_dir() and ((path / _METADATA).is_file() or any(path.glob("tp_*.pt"))):
        return _current_format(path)
    raise FileNotFoundError(f"no checkpoint at {path} (expected a run dir with checkpoints/latest, "
                            f"a checkpoints dir with latest, or a step_N dir with a {_METADATA} file)")


def _current_format(step_dir: Path) -> Path:
    """``step_dir``, unless it is a format-1 checkpoint (``tp_RR.pt`` files, no DCP metadata): a one-line
    ValueError then, before any process group or model is built."""
    if not (step_dir / _METADATA).is_file() and any(step_dir.glob("tp_*.pt")):
        raise ValueError(f"{step_dir} is a format-1 checkpoint (tp_RR.pt files), which this version cannot read "
                         f"(format {FORMAT_VERSION}: a torch.distributed.checkpoint dir); continue it with the "
                         "fp8-recipes version that wrote it, or start a fresh run")
    return step_dir


def find_resume(resume: str | None, run_dir: str | os.PathLike) -> Path | None:
    """The step dir that ``trainer.resume`` names: None (or "auto" without a checkpoint in ``run_dir``) = start
    fresh; "auto" = ``run_dir``'s latest; else a run dir, checkpoints dir or step dir (ValueError if none)."""
    if resume is None or (resume == "auto" and not (Path(run_dir) / "checkpoints" / "latest").is_file()):
        return None
    try:
        return resolve_checkpoint(run_dir if resume == "auto" else resume)
    except FileNotFoundError as e:
        raise ValueError(f"trainer.resume: {e}; or set trainer.resume=auto") from None
    except ValueError as e:  # a format-1 checkpoint
        raise ValueError(f"trainer.resume: {e}") from None


def checkpoint_step(step_dir: str | os.PathLike) -> int:
    """The step a ``step_N`` dir holds (save_checkpoint's naming), without loading it."""
    match = re.fullmatch(r"step_(\d+)", Path(step_dir).name)
    if match is None:
        raise ValueError(f"trainer.resume: {step_dir} is not a step_N checkpoint dir")
    return int(match.group(1))


def checkpoint_meta(step_dir: str | os.PathLike) -> dict[str, Any]:
    """What ``meta.json`` says about a ``step_N`` dir; without one (save_checkpoint always writes it), the step and
    the tensor-parallel size (the ``tpRR`` payloads in its DCP metadata) only."""
    step_dir = Path(step_dir)
    if (step_dir / "meta.json").is_file():
        return json.loads((step_dir / "meta.json").read_text(encoding="utf-8"))
    return {"step": checkpoint_step(step_dir), "tensor_model_parallel_size": len(_saved_payloads(step_dir))}


def resume_skip(step_dir: str | os.PathLike, *, global_batch_size: int, micro_batch_size: int,
                tensor_model_parallel_size: int) -> int:
    """The global micro-batches a run resumed from ``step_dir`` skips (samples consumed / micro_batch_size), after
    refusing, as a one-line ValueError naming the key, what cannot continue that run: another tensor-parallel size
    (a payload per TP rank, each holding its shards) or another global batch size (a different sample count per step
    breaks the data position and the LR schedule's meaning). The data-parallel size may change."""
    meta = checkpoint_meta(step_dir)
    tp = meta.get("tensor_model_parallel_size")
    if tp != tensor_model_parallel_size:
        raise ValueError(f"trainer.tensor_model_parallel_size: {tensor_model_parallel_size} differs from the "
                         f"checkpoint's {tp} ({step_dir} holds the shards of {tp} tensor-parallel ranks; resume with "
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

    Every rank reads its tensor-parallel rank's payload (:func:`read_checkpoint`, no collective: ranks may load
    at different times). Objects passed as None are skipped.
    """
    rank, tp_rank, _ = _ranks()
    step_dir = resolve_checkpoint(path)
    payload = read_checkpoint(step_dir, tp_rank, map_location)
    if payload.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{step_dir}: format_version {payload.get('format_version')}, expected {FORMAT_VERSION}")
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
                raise ValueError(f"{step_dir} has no {name} state to restore")
            obj.load_state_dict(payload[name])
    if restore_rng:
        _set_rng_state(payload["rng"])
    return int(payload["step"])
