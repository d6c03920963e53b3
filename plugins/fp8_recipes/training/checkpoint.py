"""Checkpoints: ``run_dir/checkpoints/step_N/``, a torch.distributed.checkpoint (DCP) directory written atomically,
plus a ``latest`` pointer file.

Every rank takes part in the save (``dcp.save`` is collective). Each rank offers the payload of its model shard,
its (pipeline, tensor)-parallel rank, under the key ``ppPPtpRR`` (``ppPPtpRRepEE`` at expert parallelism > 1: each
EP rank holds other experts; :func:`_shard_key`): the data- (and context-) parallel replicas of a
shard offer the same keys and DCP's save planner keeps one copy of each, written by the lowest rank that holds it
(data-parallel rank 0 of that shard), so a checkpoint is as large at DP=8 as at DP=1. The step dir holds DCP's
``.metadata`` and ``__R_0.distcp`` files. A payload holds: the model state of each of the rank's model chunks (the
GPTModel, without the DDP and Float16Module wrappers), Megatron-Core's optimizer state (training/engine.py:
``state_dict()`` and, with the distributed optimizer, the parameter state gathered onto data-parallel rank 0, which
does not depend on the data-parallel size), the LR schedule's position, the precision backend's state (e.g. amax
histories), the step and the RNG states (CPU, CUDA, Megatron's model-parallel tracker, Python's ``random``).
Its tensors go through DCP one by one (``ppPPtpRR.tensors.<key path>``); the rest of it, the exact Python structure
with a marker where each tensor was, is one pickled bytes entry (``ppPPtpRR.skeleton``): DCP's own flattening of
nested dicts would turn the optimizer state's int keys into strings and drop empty dicts.
:func:`read_checkpoint` gives one shard's payload back, in one process, without a process group.

Atomicity: every rank writes into ``checkpoints/.step_N.tmp``; after a barrier rank 0 renames it to
``step_N`` and then replaces ``latest``. A crash leaves either the old checkpoint or the new one, never half:
a run dir is resumed from what ``latest`` names only, and a ``.tmp`` directory is never loaded. A write that
fails (a full disk, a file size limit) on any rank is agreed on at the next barrier: every rank raises
CheckpointWriteError (training/errors.py) together, and rank 0 removes the ``.tmp`` directory.

Integrity: ``checksums.json`` (inside the step dir) records each file's size and CRC-32, each rank digesting the
files it wrote. Resuming verifies them (and that ``meta.json`` reads), as the HF export and an evaluation do
(:func:`intact_checkpoint`): ``trainer.resume=auto`` falls back from a damaged latest checkpoint (a truncated or
flipped shard, a missing ``.metadata``, a ``latest`` that names nothing) to the newest intact ``step_N`` with one
warning naming both; a named checkpoint that is damaged is refused in one line.
Checkpoints written before the record existed are checked for their files only. Before any process group exists,
every rank checks what is cheap (the index, the JSON files, each file's presence and size); once the group exists,
each rank digests only its share of the files (every world-size-th one) and all ranks agree on what any found
(:func:`shared_damage`), so a resume reads the checkpoint once in all, not once per process.

``meta.json`` (rank 0, inside the step dir, so atomic with it) says how the checkpoint was made: step, samples
consumed, global and micro batch size, the parallel layout (data, tensor, pipeline, virtual pipeline, context) and
whether the optimizer was distributed, the model's config keys and params dtype (:func:`check_model_matches` names
the key that changed). It is read before any process group or
model exists (:func:`resume_skip`), so a resume that cannot work is refused in one line.

Resuming (``trainer.resume``, see :func:`find_resume`): the data position is the samples consumed (step x global
batch; training/run.py starts the global micro-batch stream there, megatron/data.py:data_parallel_batches), so a
run resumes exactly at another data-parallel size with the same global batch size: every rank reads its shard's
payload, and the distributed optimizer scatters the parameter state from data-parallel rank 0 to the new
data-parallel ranks. At another tensor-parallel, pipeline, virtual-pipeline or expert-parallel layout every rank
reads the payloads of the saved pipeline stages that hold its layers (all of them at PP=1; each of their EP ranks'),
joins their tensors whole and loads its part (training/reshard.py; the optimizer state through the ``param_index``
each payload records); experts split over an expert TP other than TP resume only at their own layout. Another global
batch size or a switch between the plain and the distributed optimizer is refused in one line, as is another layout
from a checkpoint without that index. The recipe's schedule stage follows from the step. A checkpoint of another
recipe (its precision state's
``recipe`` differs) restores model, optimizer, schedule and step but not the scaling state, and says so in one log
line. Checkpoints of earlier formats (1: ``step_N/tp_RR.pt`` files; 2: the engine before Megatron-Core's, with a
torch AdamW state) are refused in one line.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import io
import json
import logging
import os
import random
import re
import shutil
import warnings
import zlib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from fp8_recipes.checks import ConfigError
from fp8_recipes.launcher import launch_rank
from fp8_recipes.megatron.model import VOCAB_MULTIPLE
from fp8_recipes.megatron.model_config import pad_vocab_size
from fp8_recipes.megatron.model import unwrap_model as _unwrap
from fp8_recipes.training.errors import CheckpointWriteError
from fp8_recipes.training.reshard import (
    join_shards,
    live_global_name,
    load_optimizer_resharded,
    optimizer_param_index,
    rank_slice,
    saved_ep_ranks,
    saved_optimizer_step,
    stages_holding,
)

__all__ = ["barrier", "save_checkpoint", "load_checkpoint", "read_checkpoint", "resolve_checkpoint", "find_resume",
           "intact_checkpoint",
           "checkpoint_step", "checkpoint_meta", "resume_skip", "checkpoint_damage", "quick_damage", "shared_damage",
           "check_config_matches", "check_model_matches"]

logger = logging.getLogger("fp8_recipes")

FORMAT_VERSION = 3
"""1: ``step_N/tp_RR.pt``, one torch.save file per TP rank; 2: a torch.distributed.checkpoint dir of the engine
before Megatron-Core's (torch AdamW, ``tpRR`` keys); 3: that dir with Megatron-Core's optimizer state, one payload per
(pipeline, tensor) rank. Only 3 is read."""
_METADATA = ".metadata"  # DCP's index of a checkpoint dir (FileSystemWriter writes it last, via a rename)
_CHECKSUMS = "checksums.json"  # {file name: {"bytes": size, "crc32": hex}} of the step dir's DCP files
_TENSOR = "__fp8_recipes_tensor__"  # in a payload's skeleton: (_TENSOR, name) stands where tensor ``name`` was


def _dist():
    import torch.distributed as dist
    return dist if dist.is_available() and dist.is_initialized() else None


def barrier() -> None:
    dist = _dist()
    if dist is not None and dist.get_world_size() > 1:
        dist.barrier()


def _ranks() -> tuple[int, int, int]:
    """(global rank, tensor-parallel rank, pipeline rank), all 0 without Megatron's groups."""
    dist = _dist()
    rank = dist.get_rank() if dist else 0
    try:
        from megatron.core import parallel_state
        if parallel_state.model_parallel_is_initialized():
            return (rank, parallel_state.get_tensor_model_parallel_rank(),
                    parallel_state.get_pipeline_model_parallel_rank())
    except ImportError:
        pass
    return rank, 0, 0


def _expert_ranks() -> dict[str, int | None]:
    """This rank's ``ep_rank`` at EP > 1 and ``etp_rank`` where expert TP differs from TP, else None: the ranks that
    set which experts, and which shard of them, its payload holds (:func:`_shard_key`)."""
    try:
        from megatron.core import parallel_state as ps
        if ps.model_parallel_is_initialized():
            ep = ps.get_expert_model_parallel_world_size() > 1
            etp = ps.get_expert_tensor_parallel_world_size() != ps.get_tensor_model_parallel_world_size()
            return {"ep_rank": ps.get_expert_model_parallel_rank() if ep else None,
                    "etp_rank": ps.get_expert_tensor_parallel_rank() if etp else None}
    except ImportError:
        pass
    return {"ep_rank": None, "etp_rank": None}


def _parallel_sizes() -> dict[str, Any]:
    """This run's parallel layout (data parallel = world, the rest 1, without Megatron's groups)."""
    dist = _dist()
    world = dist.get_world_size() if dist else 1
    try:
        from megatron.core import parallel_state as ps
        if ps.model_parallel_is_initialized():
            return {"data_parallel_size": ps.get_data_parallel_world_size(),
                    "tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
                    "pipeline_model_parallel_size": ps.get_pipeline_model_parallel_world_size(),
                    "virtual_pipeline_model_parallel_size": ps.get_virtual_pipeline_model_parallel_world_size(),
                    "context_parallel_size": ps.get_context_parallel_world_size(),
                    "expert_model_parallel_size": ps.get_expert_model_parallel_world_size(),
                    "expert_tensor_parallel_size": ps.get_expert_tensor_parallel_world_size()}
    except ImportError:
        pass
    return {"data_parallel_size": world, "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
            "virtual_pipeline_model_parallel_size": None, "context_parallel_size": 1, "expert_model_parallel_size": 1,
            "expert_tensor_parallel_size": 1}


def _rng_state() -> dict[str, Any]:
    """Every RNG's state, as tensors: the model-parallel tracker's too, whose graph-safe states (TE's tracker, under
    model cuda_graph_impl) are torch Generators, which a checkpoint cannot load (weights_only) and another run's
    tracker kind cannot take: saved as state tensors, as Megatron-LM saves them."""
    state: dict[str, Any] = {"cpu": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        from megatron.core.tensor_parallel import get_cuda_rng_tracker
        from megatron.core.tensor_parallel.random import convert_cuda_rng_state
        state["tracker"] = {name: convert_cuda_rng_state(value, to_graphable=False)  # (a tensor stays itself)
                            for name, value in get_cuda_rng_tracker().get_states().items()}
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
        from megatron.core.tensor_parallel.random import convert_cuda_rng_state, is_graph_safe_cuda_rng_tracker

        tracker = get_cuda_rng_tracker()
        graph_safe = is_graph_safe_cuda_rng_tracker(tracker)  # (the states this run's tracker takes: Generators)
        tracker.set_states({name: convert_cuda_rng_state(value, to_graphable=True) if graph_safe else value
                            for name, value in state["tracker"].items()})


def _shard_key(tp_rank: int, pp_rank: int = 0, ep_rank: int | None = None, etp_rank: int | None = None) -> str:
    """The top-level DCP key of one model shard's payload: its pipeline and tensor-parallel rank, and at EP > 1 its
    expert-parallel rank (``ppPPtpRRepEE``; ``etTT``, its expert TP rank, too where expert TP differs from TP): the
    ranks of one ``ppPPtpRR`` shard hold other experts there, so each offers its own key, and DCP has the lowest rank
    holding a key write it. That rank is data-parallel rank 0 of its dense shard (the lowest rank of its (PP, TP)) and
    expert-data-parallel rank 0 of its expert shard (the lowest of its (PP, EP, expert TP)): where the distributed
    optimizer gathers each part's parameter state (EP rank 1 of an EP=2 x DP=2 run writes the experts' and leaves the
    dense part's to EP rank 0's payload)."""
    return (f"pp{pp_rank:02d}tp{tp_rank:02d}" + (f"ep{ep_rank:02d}" if ep_rank is not None else "")
            + (f"et{etp_rank:02d}" if etp_rank is not None else ""))


_SHARD_KEY = re.compile(r"pp(\d+)tp(\d+)(?:ep(\d+))?(?:et(\d+))?$")
"""A :func:`_shard_key` read back: pipeline, tensor-parallel, and (when there) expert-parallel and expert TP rank."""


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


def _join_tensors(obj: Any, tensors: dict[str, torch.Tensor], missing_ok: bool = False) -> Any:
    """Undo :func:`_split_tensors`: put each tensor back where its marker stands (None for a tensor not read,
    with ``missing_ok``)."""
    if type(obj) is tuple and len(obj) == 2 and isinstance(obj[0], str) and obj[0] == _TENSOR:
        return tensors.get(obj[1]) if missing_ok else tensors[obj[1]]
    if isinstance(obj, dict):
        for key, value in obj.items():
            obj[key] = _join_tensors(value, tensors, missing_ok)
        return obj
    if type(obj) in (list, tuple):
        return type(obj)(_join_tensors(v, tensors, missing_ok) for v in obj)
    return obj


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns on every save/load without a process group; single-process use is intended here (tests, tools)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _write_payload(step_dir: Path, key: str, payload: dict[str, Any]) -> None:
    """Save ``payload`` as ``key`` (:func:`_shard_key`) into the DCP dir ``step_dir``. Collective over all ranks (when
    a group exists): replicas of the same key (data-parallel ranks) are written once, by the lowest rank holding
    it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    tensors: dict[str, torch.Tensor] = {}
    skeleton = io.BytesIO()
    torch.save(_split_tensors(payload, (), tensors), skeleton)
    state = {key: {"skeleton": skeleton.getvalue(), "tensors": tensors}}
    with _single_process_quiet():
        dcp.save(state, storage_writer=dcp.FileSystemWriter(step_dir),
                 planner=DefaultSavePlanner(dedup_save_to_lowest_rank=True), no_dist=_dist() is None)


def _saved_payloads(step_dir: Path) -> dict[str, list[tuple[tuple, Any]]]:
    """Per shard key in the DCP dir ``step_dir``, its entries as (key path below the key, storage metadata),
    read from ``.metadata`` only."""
    from torch.distributed.checkpoint import FileSystemReader

    return _payloads_in(FileSystemReader(step_dir).read_metadata())


def _payloads_in(metadata: Any) -> dict[str, list[tuple[tuple, Any]]]:
    """:func:`_saved_payloads` of DCP's index once read (``planner_data`` maps each flattened key to its path)."""
    per_tp: dict[str, list[tuple[tuple, Any]]] = {}
    for fqn, storage in metadata.state_dict_metadata.items():
        path = (metadata.planner_data or {}).get(fqn)
        if path:
            per_tp.setdefault(str(path[0]), []).append((tuple(path[1:]), storage))
    return per_tp


def read_checkpoint(step_dir: str | os.PathLike, tp_rank: int = 0,
                    map_location: str | torch.device = "cpu", pp_rank: int = 0,
                    skip_optimizer: bool = False, ep_rank: int | None = None,
                    etp_rank: int | None = None) -> dict[str, Any]:
    """The payload :func:`save_checkpoint` wrote for the shard (``tp_rank``, ``pp_rank``; ``ep_rank`` for a checkpoint
    written at EP > 1, ``etp_rank`` at an expert TP other than TP: :func:`_shard_key`) in ``step_dir`` (a finished
    ``step_N`` dir): ``{"format_version", "step", "model" (a state dict per model chunk), "optimizer", "scheduler",
    "precision", "rng", "extra"}``.

    Reads in this process only (no process group needed, none used: each rank reads its own shard's payload).
    The template DCP loads into is built from the checkpoint's own metadata, since a fresh optimizer has no state.
    ``skip_optimizer``: leave the optimizer's tensors unread (None): an exporter or an evaluation needs the weights
    (and the scaling state), not the optimizer state that is three times their size.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    step_dir = Path(step_dir)
    per_tp = _saved_payloads(step_dir)
    key = _shard_key(tp_rank, pp_rank, ep_rank, etp_rank)
    if key not in per_tp:
        if any(k.startswith("tp") for k in per_tp):
            raise ConfigError(f"{step_dir} is a format-2 checkpoint (the engine before Megatron-Core's), which this "
                             f"version cannot read; continue it with the fp8-recipes version that wrote it, or start "
                             f"a fresh run")
        expert = (f", expert-parallel rank {ep_rank}" if ep_rank is not None else "") + (
            f", expert tensor-parallel rank {etp_rank}" if etp_rank is not None else "")
        raise FileNotFoundError(f"{step_dir} holds no state of pipeline rank {pp_rank}, tensor-parallel rank "
                                f"{tp_rank}{expert} (it holds {', '.join(sorted(per_tp)) or 'none'}): was it written "
                                "at another layout?")
    template: dict[str, Any] = {"skeleton": None, "tensors": {}}  # None: replaced by the loaded bytes
    for path, storage in per_tp[key]:
        if path[0] == "tensors" and isinstance(storage, TensorStorageMetadata) and (
                not skip_optimizer or not path[1].startswith("optimizer/")):
            template["tensors"][path[1]] = torch.empty(storage.size, dtype=storage.properties.dtype,
                                                       device=map_location)
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with _single_process_quiet():
            dcp.load({key: template}, storage_reader=dcp.FileSystemReader(step_dir), no_dist=True)
    except (CheckpointException, OSError, RuntimeError) as e:  # (DCP's is a BaseException: a file gone or cut short)
        failures = getattr(e, "failures", None)
        cause = next(iter(failures.values()))[0] if failures else e
        raise ConfigError(f"{step_dir} is damaged: its shard {key} does not read ({_first_line(cause)}); resume "
                          f"from an intact step_N dir (trainer.resume=auto takes the newest intact one)") from None
    skeleton = torch.load(io.BytesIO(template["skeleton"]), map_location=map_location, weights_only=True)
    return _join_tensors(skeleton, template["tensors"], missing_ok=skip_optimizer)


def save_checkpoint(run_dir: str | os.PathLike, step: int, *, engine=None, models=None, precision=None,
                    scheduler=None, extra: dict | None = None, meta: dict | None = None) -> Path:
    """Save everything needed to continue from ``step`` (optimizer steps completed). Collective: call on all ranks.

    ``engine`` (training/engine.py): its model chunks and optimizer state; or ``models`` alone (a model or a list of
    chunks: weights only). ``precision`` and ``scheduler`` are anything with ``state_dict()``; ``extra`` is a small
    plain dict (e.g. the trainer config); ``meta`` (JSON-able: the data position, batch sizes) goes into
    ``meta.json`` with the step and the parallel layout. Returns the final ``step_N`` directory.

    An OS error while writing (a full disk, a file size limit) on any rank: every rank raises CheckpointWriteError
    together, the temporary directory removed and ``latest`` left on the previous checkpoint (:func:`_agree`).
    """
    rank, tp_rank, pp_rank = _ranks()
    root = Path(run_dir) / "checkpoints"
    final, tmp = root / f"step_{step}", root / f".step_{step}.tmp"
    previous = _latest(root)[0] if (root / "latest").is_file() else None
    if rank == 0:
        _agree(_attempt(_fresh_tmp, root, tmp), final, tmp, previous)
    else:
        _agree(None, final, tmp, previous)
    chunks = engine.models if engine is not None else (models if isinstance(models, (list, tuple)) else [models])
    payload = {
        "format_version": FORMAT_VERSION,
        "step": step,
        "model": [_plain_weights(_unwrap(c).state_dict()) for c in chunks],
        "optimizer": _optimizer_state(engine) if engine is not None else None,  # collective (DP)
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "precision": precision.state_dict() if precision is not None else None,
        "rng": _rng_state(),
        "extra": extra or {},
    }
    _agree(_attempt(_write_payload, tmp, _shard_key(tp_rank, pp_rank, **_expert_ranks()), payload, where=tmp),
           final, tmp, previous)
    digests = _gather({name: _digest(tmp / name) for name in _own_files(tmp, rank)})  # each rank its own files
    failed = None
    if rank == 0:
        digests[_METADATA] = _digest(tmp / _METADATA)
        distributed = {"use_distributed_optimizer": engine.cfg.use_distributed_optimizer,
                       "reshardable": True} if engine else {}
        failed = _attempt(_finish, root, tmp, final, digests, {"step": step, **_parallel_sizes(), **distributed,
                                                              **_model_fields(chunks), **(meta or {})}, where=tmp)
    _agree(failed, final, tmp, previous)
    return final


def _fresh_tmp(root: Path, tmp: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)  # left over by a crash during an earlier save
    tmp.mkdir()


def _finish(root: Path, tmp: Path, final: Path, digests: dict[str, Any], meta: dict[str, Any]) -> None:
    """Rank 0: the records, then ``tmp`` renamed to ``final`` and ``latest`` pointed at it. Everything that takes
    space (the records, the pointer's temporary file) is written before the renames, which take none: a full disk
    fails before ``final`` exists."""
    (tmp / _CHECKSUMS).write_text(json.dumps(dict(sorted(digests.items())), indent=1))
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    pointer = root / ".latest.tmp"
    pointer.write_text(final.name + "\n", encoding="utf-8")
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    os.replace(pointer, root / "latest")


def _attempt(fn: Callable[..., Any], *args: Any, where: Path | None = None) -> str | None:
    """Run ``fn``; the OS error it ends in as ``[Errno N] text`` (DCP wraps a writer's in its CheckpointException,
    a BaseException), or None. torch's zip writer reports a full disk as a RuntimeError ("unexpected pos"): one
    that leaves ``where``'s file system (nearly) full is taken for that. Any other exception is a bug and
    propagates."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        fn(*args)
    except OSError as e:
        return _os_error_text(e)
    except (CheckpointException, RuntimeError) as e:
        failures = e.failures.values() if isinstance(e, CheckpointException) else [(e, None)]
        errors = [exc for exc, _ in failures if isinstance(exc, OSError)]
        if errors:
            return _os_error_text(errors[0])
        if where is not None and _nearly_full(where):
            return f"[Errno {errno.ENOSPC}] {os.strerror(errno.ENOSPC)} ({_first_line(e)})"
        raise
    return None


def _nearly_full(path: Path) -> bool:
    """Whether the file system holding ``path`` (or its nearest existing parent) has under 1 MiB free."""
    for p in (path, *path.parents):
        if p.exists():
            try:
                return shutil.disk_usage(p).free < (1 << 20)
            except OSError:
                return False
    return False


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[-1].strip()[:200] if text else type(e).__name__


def _os_error_text(e: OSError) -> str:
    return f"[Errno {e.errno}] {e.strerror}" if e.errno else f"{type(e).__name__}: {e}"


def _agree(error: str | None, final: Path, tmp: Path, previous: str | None) -> None:
    """A barrier that also tells every rank whether any rank's write failed (a plain barrier would leave the others
    waiting on a rank that raised): then rank 0 removes the temporary directory and every rank raises
    CheckpointWriteError with the first failing rank's error."""
    dist = _dist()
    errors = [error]
    if dist is not None and dist.get_world_size() > 1:
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
    failed = next(((r, e) for r, e in enumerate(errors) if e is not None), None)
    if failed is None:
        return
    if _ranks()[0] == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        (final.parent / ".latest.tmp").unlink(missing_ok=True)
    rank, reason = failed
    raise CheckpointWriteError(final, reason + (f" (rank {rank})" if len(errors) > 1 else ""), previous)


def _optimizer_state(engine) -> dict[str, Any]:
    """Megatron-Core's optimizer state and the index that maps it to parameters (training/reshard.py), so that
    another tensor / pipeline layout can read it."""
    state = engine.optimizer_state_dict()
    state["param_index"] = optimizer_param_index(engine.models, engine.optimizer)
    return state


def _plain_weights(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with FP8-stored weights (recipe ``fp8_param: true``: Transformer Engine QuantizedTensors) as their BF16
    values: what DCP writes and an export reads. Loading copies them back into the FP8 parameters (TE quantizes), and
    the precision state then puts back their exact FP8 bytes (backends/te.py)."""
    for key, value in state.items():
        if callable(getattr(value, "_get_quantizer", None)):  # TE's QuantizedTensor (torch's own have no quantizer)
            state[key] = value.dequantize()
    return state


def _digest(path: Path) -> dict[str, Any]:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return {"bytes": path.stat().st_size, "crc32": f"{crc:08x}"}


def _own_files(step_dir: Path, rank: int) -> list[str]:
    """The data files DCP's FileSystemWriter wrote for ``rank`` (``__<rank>_<n>.distcp``)."""
    return sorted(p.name for p in step_dir.glob(f"__{rank}_*.distcp"))


def _gather(part: dict[str, Any]) -> dict[str, Any]:
    """Every rank's ``part`` merged (rank 0 uses the result); ``part`` itself without a process group."""
    dist = _dist()
    if dist is None:
        return dict(part)
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, part)
    return {k: v for p in parts for k, v in p.items()}


def checkpoint_damage(step_dir: str | os.PathLike, *, contents: bool = True,
                      share: tuple[int, int] = (0, 1)) -> str | None:
    """What is wrong with a finished ``step_N`` dir, or None when it is intact: its ``meta.json`` and DCP index
    read, and every file ``checksums.json`` records is there with its size and, with ``contents``, its CRC-32: of
    every file, or with ``share=(i, n)`` of every n-th from the i-th (by name), so n ranks read the checkpoint once
    between them (:func:`shared_damage`)."""
    step_dir = Path(step_dir)
    if not step_dir.is_dir():
        return "does not exist"
    if not (step_dir / _METADATA).is_file():
        return f"its {_METADATA} (the index of its shards) is missing"
    problem = _records_damage(step_dir) or _index_damage(step_dir)
    if problem:
        return problem
    record = step_dir / _CHECKSUMS
    if not record.is_file():  # written before the record existed: the files DCP indexed are there
        return None
    recorded = sorted(json.loads(record.read_text(encoding="utf-8")).items())
    for name, want in recorded:
        path = step_dir / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != want["bytes"]:
            return f"{name} has {path.stat().st_size:,} bytes, {want['bytes']:,} when written"
    for name, want in recorded[share[0]::share[1]] if contents else []:
        if _digest(step_dir / name)["crc32"] != want["crc32"]:
            return f"{name} does not match its checksum, so it changed on disk after it was written"
    return None


def _records_damage(step_dir: Path) -> str | None:
    """What is wrong with a step dir's ``meta.json`` and ``checksums.json`` as save_checkpoint writes them (JSON
    objects; meta with the integer step and tensor-parallel size every reader of it needs), or None. A ``{}`` meta
    would otherwise read as a checkpoint of another layout, and a record of the wrong shape end in a traceback."""
    for name in ("meta.json", _CHECKSUMS):
        if not (step_dir / name).is_file():
            continue
        try:
            data = json.loads((step_dir / name).read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError):
            return f"its {name} is not valid JSON"
        if not isinstance(data, dict):
            return f"its {name} is not a JSON object"
        if name == "meta.json":
            missing = [k for k in ("step", "tensor_model_parallel_size")
                       if not isinstance(data.get(k), int) or isinstance(data.get(k), bool)]
            if missing:
                return f"its meta.json has no integer {' or '.join(repr(k) for k in missing)}"
            if problem := _meta_values_damage(data):
                return problem
        elif not all(isinstance(v, dict) and isinstance(v.get("bytes"), int) and isinstance(v.get("crc32"), str)
                     for v in data.values()):
            return f"its {name} is not a record of file sizes and checksums"
    return None


_META_SIZES = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
               "data_parallel_size", "context_parallel_size", "expert_model_parallel_size",
               "expert_tensor_parallel_size", "global_batch_size", "micro_batch_size")
_META_NULLABLE = frozenset({"virtual_pipeline_model_parallel_size", "data_parallel_size", "context_parallel_size",
                            "expert_tensor_parallel_size", "global_batch_size", "micro_batch_size"})
"""The sizes a meta.json may hold as null (readers take a default for them)."""
_META_COUNTS = ("step", "consumed_samples")


def _meta_values_damage(meta: dict[str, Any]) -> str | None:
    """What is wrong with the values save_checkpoint writes in meta.json (sizes: integers >= 1, or null where a size
    may be unset; the step and samples: integers >= 0; the model record: a mapping), or None. A hand-edited value
    would otherwise end deep in a resume, or be read as another layout."""
    def whole(v: Any, low: int) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= low

    for key in (*_META_SIZES, *_META_COUNTS):
        value, low = meta.get(key), 0 if key in _META_COUNTS else 1
        if key in meta and not whole(value, low) and not (value is None and key in _META_NULLABLE):
            return f"its meta.json's {key!r} is {json.dumps(value)[:40]}, not an integer >= {low}"
    model = meta.get("model")
    if "model" in meta and not isinstance(model, dict):
        return f"its meta.json's 'model' is a {type(model).__name__}, not a mapping of model config keys"
    experts = (model or {}).get("num_moe_experts")
    if experts is not None and not whole(experts, 1):
        return f"its meta.json's model 'num_moe_experts' is {json.dumps(experts)[:40]}, not an integer >= 1 or null"
    return None


def _index_damage(step_dir: Path) -> str | None:
    """What DCP's index says is wrong, or None: a data file it names that is not there (checksums.json may be gone or
    empty: its list is not the only one), or a meta.json whose expert-parallel size is not the one the payloads were
    written at (``ppPPtpRRepEE`` keys: one per EP rank). An index that does not read is left to the checks that name
    it."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(step_dir).read_metadata()
    except Exception:  # noqa: BLE001 - an unreadable index is damage reported where the payloads are read
        return None
    names = {getattr(info, "relative_path", None) for info in (metadata.storage_data or {}).values()} - {None}
    missing = sorted(name for name in names if not (step_dir / name).is_file())
    if missing:
        return f"{missing[0]} (named by its {_METADATA}) is missing"
    keys = _payloads_in(metadata)
    if not keys or not (step_dir / "meta.json").is_file():
        return None
    ranks = {int(m.group(3)) for m in map(_SHARD_KEY.match, keys) if m and m.group(3) is not None}
    written, saved = max(ranks, default=0) + 1, checkpoint_meta(step_dir).get("expert_model_parallel_size") or 1
    if written != saved:
        return (f"its meta.json says expert_model_parallel_size {saved}, its payloads were written at "
                f"{written} ({', '.join(sorted(keys)[:4])})")
    return None


def quick_damage(step_dir: str | os.PathLike) -> str | None:
    """:func:`checkpoint_damage` without reading the files' contents: what each rank checks before any process
    group exists (the contents follow in :func:`shared_damage`)."""
    return checkpoint_damage(step_dir, contents=False)


def shared_damage(step_dir: str | os.PathLike) -> str | None:
    """:func:`checkpoint_damage` over the process group: each rank digests its share of the files, and every rank
    returns the same answer (the lowest rank's finding). Collective; without a group, the whole check here."""
    dist = _dist()
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist else (0, 1)
    found = _gather({rank: checkpoint_damage(step_dir, share=(rank, world))})
    return next((found[r] for r in sorted(found) if found[r]), None)


def _step_dirs(root: Path) -> list[Path]:
    """The ``step_N`` dirs under a ``checkpoints`` dir, newest first."""
    steps = [p for p in root.glob("step_*") if p.is_dir() and re.fullmatch(r"step_\d+", p.name)]
    return sorted(steps, key=lambda p: int(p.name[5:]), reverse=True)


def _latest(root: Path) -> tuple[str | None, str | None]:
    """(the step dir name ``root/latest`` holds, None) or (None, what is wrong with it): missing, not UTF-8 text,
    or not a ``step_N`` name (save_checkpoint writes nothing else; a path there would lead outside ``root``)."""
    try:
        name = (root / "latest").read_bytes().decode("utf-8").strip()
    except FileNotFoundError:
        return None, "checkpoints/latest is missing"
    except UnicodeDecodeError:
        return None, "checkpoints/latest is not UTF-8 text (it holds a step_N name)"
    except OSError as e:
        return None, f"checkpoints/latest cannot be read ({e.strerror or e})"
    if not re.fullmatch(r"step_\d+", name):
        return None, f"checkpoints/latest holds {name[:40]!r}, not a step_N name"
    return name, None


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A ``step_N`` directory from a run dir, its ``checkpoints`` dir (both via ``latest``) or the step dir itself.
    A damaged ``latest`` is a one-line ConfigError (a ValueError) naming it and the way round it."""
    path = Path(path)
    for root in (path / "checkpoints", path):
        if (root / "latest").is_file():
            name, problem = _latest(root)
            if problem:
                raise ConfigError(f"{root}: {problem}; name one of its step_N dirs instead")
            return _current_format(root / name)
    if path.name.endswith(".tmp"):
        raise FileNotFoundError(f"{path} is a checkpoint still being written (or left by a crash); resume from "
                                "its run dir or a finished step_N dir")
    if path.is_dir() and ((path / _METADATA).is_file() or any(path.glob("tp_*.pt"))):
        return _current_format(path)
    raise FileNotFoundError(f"no checkpoint at {path} (expected a run dir with checkpoints/latest, "
                            f"a checkpoints dir with latest, or a step_N dir with a {_METADATA} file)")


def _current_format(step_dir: Path) -> Path:
    """``step_dir``, unless it is a checkpoint of an earlier format (1: ``tp_RR.pt`` files, no DCP metadata; 2: DCP
    payloads under ``tpRR`` keys, the engine before Megatron-Core's): a one-line ValueError then, before any process
    group or model is built."""
    if not (step_dir / _METADATA).is_file() and any(step_dir.glob("tp_*.pt")):
        version = 1
    elif (step_dir / _METADATA).is_file() and any(k.startswith("tp") for k in _readable_payloads(step_dir)):
        version = 2
    else:
        return step_dir
    raise ConfigError(f"{step_dir} is a format-{version} checkpoint, which this version cannot read (format "
                     f"{FORMAT_VERSION}: Megatron-Core's optimizer state in a torch.distributed.checkpoint dir); "
                     "continue it with the fp8-recipes version that wrote it, or start a fresh run")


def _readable_payloads(step_dir: Path) -> dict[str, list[tuple[tuple, Any]]]:
    """:func:`_saved_payloads`, or none where ``.metadata`` cannot be read (truncated, garbage): the damage checks
    then name the file, rather than the unpickler failing first."""
    try:
        return _saved_payloads(step_dir)
    except Exception:  # noqa: BLE001 - any unreadable metadata is damage, reported by checkpoint_damage
        return {}


def intact_checkpoint(path: str | os.PathLike, key: str) -> Path:
    """:func:`resolve_checkpoint` for a command that reads one checkpoint (the HF export, an evaluation): a one-line
    ConfigError naming ``key`` when there is none, it is of an earlier format, :func:`checkpoint_damage` finds it
    damaged (a missing shard or index, a file that no longer matches its checksum: the check a resume makes, so
    that what a resume refuses is not exported or evaluated either), or its experts were split over an expert
    tensor-parallel size other than TP (which the readers do not join; at any EP size they are joined as a resume
    at another one joins them), before any of it is loaded. The files are digested here, in each process (an
    evaluation under torchrun reads them once per rank)."""
    try:
        step_dir = resolve_checkpoint(path)
    except FileNotFoundError as e:
        raise ConfigError(f"{key}: {e}; train with trainer.save_checkpoints=true") from None
    except ValueError as e:  # a checkpoint of a format this version cannot read
        raise ConfigError(f"{key}: {e}") from None
    problem = checkpoint_damage(step_dir)
    if problem:
        raise ConfigError(f"{key}: {step_dir} is damaged: {problem}; name an intact step_N dir")
    meta = checkpoint_meta(step_dir)
    etp, tp = meta.get("expert_tensor_parallel_size"), int(meta.get("tensor_model_parallel_size") or 1)
    if etp is not None and int(etp) != tp:
        raise ConfigError(f"{key}: {step_dir} was written at trainer.expert_tensor_parallel_size={etp} (tensor "
                          f"parallel {tp}): its experts are split otherwise than the dense layers, which this reader "
                          f"does not join yet; read a checkpoint trained with expert_tensor_parallel_size=null")
    return step_dir


def find_resume(resume: str | None, run_dir: str | os.PathLike, *,
                damage: Callable[[Path], str | None] = checkpoint_damage, warn: bool = True) -> Path | None:
    """The step dir that ``trainer.resume`` names: None (or "auto" without a checkpoint in ``run_dir``) = start
    fresh; "auto" = ``run_dir``'s latest, or the newest intact one (a warning with ``warn``); else a run dir,
    checkpoints dir or step dir (ValueError if none, or if ``damage`` finds it damaged). ``damage``: the whole check
    by default; training checks :func:`quick_damage` on every rank first, then :func:`shared_damage` in the group."""
    root = Path(run_dir) / "checkpoints"
    if resume is None or (resume == "auto" and not (root / "latest").is_file() and not _step_dirs(root)):
        return None
    if resume == "auto":
        return _newest_intact(root, damage, warn)
    try:
        step_dir = resolve_checkpoint(resume)
    except FileNotFoundError as e:
        raise ConfigError(f"trainer.resume: {e}; or set trainer.resume=auto") from None
    except ValueError as e:  # a format-1 checkpoint
        raise ConfigError(f"trainer.resume: {e}") from None
    problem = damage(step_dir)
    if problem:
        raise ConfigError(f"trainer.resume: {step_dir} is damaged: {problem}; name an intact step_N dir, or set "
                         f"trainer.resume=auto (the newest intact one)")
    return step_dir


def _newest_intact(root: Path, damage: Callable[[Path], str | None], warn: bool) -> Path:
    """``trainer.resume=auto``: what ``latest`` names when intact, else the newest intact ``step_N`` (one warning
    naming both), else a one-line ValueError."""
    named, pointer_problem = _latest(root)
    first = root / named if named else None
    if first is not None and first.is_dir():
        try:
            _current_format(first)  # an earlier format: refused as such, not taken for damage
        except ValueError as e:
            raise ConfigError(f"trainer.resume: {e}") from None
    problem = damage(first) if first is not None else pointer_problem
    if problem is None:
        return first
    for step_dir in _step_dirs(root):
        if step_dir != first and damage(step_dir) is None:
            if warn and launch_rank() == 0:
                logger.warning("resume: %s is damaged (%s); resuming from %s, the newest intact checkpoint",
                               first.name if first is not None else "latest", problem, step_dir.name)
            return _current_format(step_dir)
    raise ConfigError(f"trainer.resume=auto: no intact checkpoint in {root} ({first.name if first else 'latest'}: "
                     f"{problem}); start fresh in a new run_dir, or set trainer.resume=null")


def checkpoint_step(step_dir: str | os.PathLike) -> int:
    """The step a ``step_N`` dir holds (save_checkpoint's naming), without loading it."""
    match = re.fullmatch(r"step_(\d+)", Path(step_dir).name)
    if match is None:
        raise ConfigError(f"trainer.resume: {step_dir} is not a step_N checkpoint dir")
    return int(match.group(1))


def checkpoint_meta(step_dir: str | os.PathLike) -> dict[str, Any]:
    """What ``meta.json`` says about a ``step_N`` dir; without one (save_checkpoint always writes it), the step and
    the tensor-parallel size (the ``tpRR`` payloads in its DCP metadata) only."""
    step_dir = Path(step_dir)
    if (step_dir / "meta.json").is_file():
        return json.loads((step_dir / "meta.json").read_text(encoding="utf-8"))
    shards = _saved_payloads(step_dir)
    tp_ranks = {m.group(2) for m in map(_SHARD_KEY.match, shards) if m and int(m.group(1)) == 0}
    return {"step": checkpoint_step(step_dir), "tensor_model_parallel_size": len(tp_ranks) or len(shards)}


def resume_skip(step_dir: str | os.PathLike, *, global_batch_size: int, micro_batch_size: int,
                tensor_model_parallel_size: int, pipeline_model_parallel_size: int = 1,
                virtual_pipeline_model_parallel_size: int | None = None,
                use_distributed_optimizer: bool | None = None, expert_model_parallel_size: int = 1,
                expert_tensor_parallel_size: int | None = None) -> int:
    """The global micro-batches a run resumed from ``step_dir`` skips (samples consumed / micro_batch_size), after
    refusing, as a one-line ValueError naming the key, what cannot continue that run: another tensor-parallel,
    pipeline or virtual-pipeline size of a checkpoint that cannot be resharded, another global batch size (a
    different sample count per step breaks the data position and the LR schedule's meaning), or a switch between
    the plain and the distributed optimizer (their states differ). The
    data-parallel and context-parallel sizes may change, and so may the tensor, pipeline and virtual-pipeline sizes
    of a checkpoint that records its optimizer index (``reshardable`` in meta.json: :func:`load_checkpoint` reshards
    it; check_model_matches refuses what cannot be), and so may the expert-parallel size where the experts are split
    over the tensor-parallel ranks before and after (expert TP = TP, Megatron-Core's default); a layout with another
    expert tensor-parallel size is resumed as it was written or refused."""
    meta = checkpoint_meta(step_dir)
    _check_expert_layout(step_dir, meta, tensor_model_parallel_size, pipeline_model_parallel_size,
                         virtual_pipeline_model_parallel_size, expert_model_parallel_size,
                         expert_tensor_parallel_size or tensor_model_parallel_size)
    wanted = {"tensor_model_parallel_size": tensor_model_parallel_size,
              "pipeline_model_parallel_size": pipeline_model_parallel_size,
              "virtual_pipeline_model_parallel_size": virtual_pipeline_model_parallel_size}
    defaults = {"pipeline_model_parallel_size": 1, "virtual_pipeline_model_parallel_size": None}
    for key, value in wanted.items():
        saved = meta.get(key, defaults.get(key))
        if saved != value and not meta.get("reshardable"):
            shown = "null" if saved is None else saved
            raise ConfigError(f"trainer.{key}: {'null' if value is None else value} differs from the checkpoint's "
                             f"{shown} ({step_dir} was written before checkpoints could be resharded; resume with "
                             f"trainer.{key}={shown})")
    saved_dist = meta.get("use_distributed_optimizer")
    if use_distributed_optimizer is not None and saved_dist is not None and saved_dist != use_distributed_optimizer:
        raise ConfigError(f"trainer.use_distributed_optimizer: {str(use_distributed_optimizer).lower()} differs from "
                         f"the checkpoint's {str(saved_dist).lower()} ({step_dir}; resume with "
                         f"trainer.use_distributed_optimizer={str(saved_dist).lower()})")
    gbs = meta.get("global_batch_size", global_batch_size)
    if gbs != global_batch_size:
        raise ConfigError(f"trainer.global_batch_size: {global_batch_size} differs from the checkpoint's {gbs} "
                         f"({step_dir}; resume with trainer.global_batch_size={gbs}, or start a fresh run)")
    consumed = meta.get("consumed_samples", meta["step"] * global_batch_size)
    mbs = meta.get("micro_batch_size", micro_batch_size)
    if mbs != micro_batch_size:
        logger.warning("resume: trainer.micro_batch_size %d -> %d: the same samples in the same order until the end "
                       "of this epoch; after it the order differs (each epoch drops its last partial micro-batch)",
                       mbs, micro_batch_size)
    return consumed // micro_batch_size


def _check_expert_layout(step_dir: str | os.PathLike, meta: dict[str, Any], tp: int, pp: int, vpp: int | None,
                         ep: int, etp: int) -> None:
    """resume_skip's refusals for the experts' layout. Experts split over the tensor-parallel ranks before and after
    (expert TP = TP) are resharded over any EP / TP / PP layout (training/reshard.py); an expert TP other than TP
    (its experts cut otherwise than the dense layers) resumes only at the layout it was written with, and a
    checkpoint written before resharding only at its EP size."""
    saved_tp = int(meta.get("tensor_model_parallel_size") or 1)
    saved_ep = int(meta.get("expert_model_parallel_size") or 1)
    saved_etp = int(meta.get("expert_tensor_parallel_size") or saved_tp)
    if saved_etp == saved_tp and etp == tp and (meta.get("reshardable") or saved_ep == ep):
        return
    refusal = ("experts are resharded only where expert TP equals TP" if saved_etp != saved_tp or etp != tp
               else "it was written before checkpoints could be resharded")
    if saved_etp != saved_tp or etp != tp:
        for key, value in (("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp),
                           ("virtual_pipeline_model_parallel_size", vpp)):
            saved = meta.get(key, {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1}.get(key))
            if saved != value:
                shown = "null" if saved is None else saved
                raise ConfigError(f"trainer.{key}: {'null' if value is None else value} differs from the "
                                  f"checkpoint's {shown} ({step_dir}: expert TP {saved_etp} at TP {saved_tp} there, "
                                  f"{etp} at {tp} here; {refusal}; resume with trainer.{key}={shown})")
    for key, value, saved in (("expert_tensor_parallel_size", etp, saved_etp),  # (what cannot reshard, first)
                              ("expert_model_parallel_size", ep, saved_ep)):
        if value != saved:
            raise ConfigError(f"trainer.{key}: {value} differs from the checkpoint's {saved} ({step_dir}; {refusal}; "
                              f"resume with trainer.{key}={saved})")


_DTYPES = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}  # trainer.params_dtype's names


def _model_fields(chunks: list[torch.nn.Module]) -> dict[str, Any]:
    """What meta.json records of the model, by the config keys a user sets (``model.<key>``, and
    ``trainer.params_dtype``), so that a resume under another config names the key, not a tensor's shape.
    ``vocab_size`` is Megatron-Core's padded one (the unpadded size is not in the model). Nothing for modules that
    are not a Megatron-Core model (no ``config``: the engine's tests checkpoint plain torch modules)."""
    gpt = _unwrap(chunks[0])
    c = getattr(gpt, "config", None)
    if c is None:
        return {}
    model = {"num_layers": c.num_layers, "hidden_size": c.hidden_size, "ffn_hidden_size": c.ffn_hidden_size,
             "num_attention_heads": c.num_attention_heads,
             "num_query_groups": c.num_query_groups or c.num_attention_heads, "normalization": c.normalization,
             "activation": "swiglu" if c.gated_linear_unit else "gelu", "add_bias_linear": c.add_bias_linear,
             "share_embeddings_and_output_weights": bool(getattr(gpt, "share_embeddings_and_output_weights", False)),
             "vocab_size": getattr(gpt, "vocab_size", None), **_moe_fields(c)}
    return {"model": model, "params_dtype": _DTYPES.get(c.params_dtype, str(c.params_dtype))}


def _cfg_model_fields(model_cfg: dict[str, Any], tensor_parallel: int) -> dict[str, Any]:
    """:func:`_model_fields`' ``model`` record of the model a model config group describes, as build_gpt_model
    builds it at ``tensor_parallel`` (its defaults: megatron/model.py), without building it."""
    hidden, heads = int(model_cfg["hidden_size"]), int(model_cfg["num_attention_heads"])
    return {"num_layers": int(model_cfg["num_layers"]), "hidden_size": hidden,
            "ffn_hidden_size": int(model_cfg.get("ffn_hidden_size") or 4 * hidden), "num_attention_heads": heads,
            "num_query_groups": int(model_cfg.get("num_query_groups") or heads),
            "normalization": model_cfg.get("normalization", "LayerNorm"),
            "activation": "swiglu" if model_cfg.get("activation", "gelu") == "swiglu" else "gelu",
            "add_bias_linear": bool(model_cfg.get("add_bias_linear", False)),
            "share_embeddings_and_output_weights": bool(model_cfg.get("share_embeddings_and_output_weights", False)),
            "vocab_size": pad_vocab_size(int(model_cfg["vocab_size"]), tensor_parallel), **_moe_fields(model_cfg)}


def _moe_fields(c: Any) -> dict[str, Any]:
    """The MoE part of the model record, from a built model's TransformerConfig or a model config group alike: the
    routed experts' count and FFN width and the shared experts' width (all null for a dense model, whatever MoE keys
    its config holds: they do nothing there)."""
    get = c.get if isinstance(c, Mapping) else lambda key: getattr(c, key, None)
    if get("num_moe_experts") is None:
        return {"num_moe_experts": None, "moe_ffn_hidden_size": None, "moe_shared_expert_intermediate_size": None}
    shared = get("moe_shared_expert_intermediate_size")
    return {"num_moe_experts": int(get("num_moe_experts")),
            "moe_ffn_hidden_size": int(get("moe_ffn_hidden_size") or get("ffn_hidden_size")
                                       or 4 * int(get("hidden_size"))),  # (plan/precision.py's expert_ffn_size)
            "moe_shared_expert_intermediate_size": None if shared is None else int(shared)}


def _model_difference(meta: dict[str, Any], here: dict[str, Any], same_tp: bool) -> tuple[str, str, str] | None:
    """(key, the checkpoint's value, ``here``'s, both as JSON) of the first model config key whose value in
    meta.json's record differs from ``here`` (a ``model`` record); the padded vocabulary only at the same TP size.
    None when they agree, or for a checkpoint written before meta.json recorded the model."""
    saved = meta.get("model") if isinstance(meta.get("model"), dict) else {}
    for key, value in here.items():
        if key in saved and saved[key] != value and (key != "vocab_size" or same_tp):
            return key, json.dumps(saved[key]), json.dumps(value)
    return None


def check_config_matches(step_dir: str | os.PathLike, model_cfg: dict[str, Any], config: str | os.PathLike,
                         key: str) -> None:
    """A one-line ConfigError naming ``key`` when ``step_dir`` holds another model than ``model_cfg`` (the model
    group of the run config ``config``, its vocabulary filled in) describes, by the keys meta.json records: for the
    readers that take the model from a run's config rather than build it first (the HF export, an evaluation), so
    that a config edited after the run cannot describe weights it does not hold (the export wrote its config.json
    from the config and the tensors from the checkpoint)."""
    meta = checkpoint_meta(step_dir)
    diff = _model_difference(meta, _cfg_model_fields(model_cfg, _layout(meta)[0]), same_tp=True)
    if diff:
        name, saved, here = diff
        raise ConfigError(f"{key}: not a checkpoint of this run's model: model.{name} is {saved} in {step_dir}, "
                          f"{here} in {config}; restore model.{name}: {saved} in that config if it was edited after "
                          f"the run, or name a checkpoint of this run's model")


def _check_model_fields(step_dir: Path, models: list[torch.nn.Module]) -> None:
    """check_model_matches by the keys meta.json records (checkpoints written before it recorded them: nothing
    here; the shapes are compared after). Another params dtype would fail deep in Megatron-Core's optimizer load
    (its state of BF16 params holds FP32 main copies, of FP32 params none)."""
    meta, here = checkpoint_meta(step_dir), _model_fields(models)
    if not here:
        return
    where = f"({step_dir} was saved with it; resume with"
    dtype = meta.get("params_dtype") or _saved_params_dtype(step_dir)
    if dtype not in (None, here["params_dtype"]):
        raise ConfigError(f"trainer.params_dtype: the checkpoint has {dtype}, this run {here['params_dtype']} "
                          f"{where} trainer.params_dtype={dtype}, or start a fresh run)")
    same_tp = _layout(meta)[0] == _layout(_parallel_sizes())[0]  # the vocabulary is padded per TP size
    diff = _model_difference(meta, here["model"], same_tp)
    if diff:
        key, shown, value = diff
        note = f" (padded to a multiple of {VOCAB_MULTIPLE} x TP; set by model.vocab_size or the tokenizer)" \
            if key == "vocab_size" else ""
        fix = f"model.{key}={shown}"
        if key.startswith("num_moe_experts") and "null" in (shown, value):  # (a dense model vs an MoE one: a group)
            kind = "a dense model" if shown == "null" else "a Mixture-of-Experts model"
            fix = f"the model group it was saved with ({kind}: its run dir's .hydra/config.yaml names it)"
        raise ConfigError(f"model.{key}: the checkpoint has {shown}, this run {value}{note} {where} {fix}, or start "
                          f"a fresh run)")


def _saved_params_dtype(step_dir: Path) -> str | None:
    """The params dtype of a checkpoint whose meta.json does not record it: its model tensors' dtype in DCP's
    index (BF16 params are saved as BF16; a BF16 tensor among them means a BF16 run)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    dtypes = {storage.properties.dtype for entries in _saved_payloads(step_dir).values() for path, storage in entries
              if path[0] == "tensors" and str(path[1]).startswith("model/")
              and isinstance(storage, TensorStorageMetadata)}
    return "bf16" if torch.bfloat16 in dtypes else "fp32" if torch.float32 in dtypes else None


def check_model_matches(step_dir: str | os.PathLike, models: list[torch.nn.Module]) -> None:
    """A one-line ValueError when this rank's model is not the one in ``step_dir``: naming the config key that
    differs (meta.json's record), else the first parameter whose shape differs. Reads meta.json and DCP's index
    only; called before a resumed run writes anything, so a refused resume leaves the run as it was."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    _check_model_fields(Path(step_dir), models)
    if _resharding(step_dir):
        _check_whole_shapes(step_dir, models)
        return
    _, tp_rank, pp_rank = _ranks()
    saved = {path[1]: tuple(storage.size) for path, storage in _saved_payloads(Path(step_dir)).get(
        _shard_key(tp_rank, pp_rank, **_expert_ranks()), []) if path[0] == "tensors"
        and isinstance(storage, TensorStorageMetadata)}
    for i, chunk in enumerate(models):
        here = {f"model/{i}/{k}": tuple(v.shape) for k, v in _unwrap(chunk).state_dict().items()
                if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}
        for name, shape in here.items():
            got = saved.get(name)
            if got != shape:
                what = f"is {shape} here and {got} in the checkpoint" if got else "is not in the checkpoint"
                raise ConfigError(f"model: {name.split('/', 2)[2]} {what} ({step_dir} was saved with another model "
                                 f"config); resume with the model it was saved with (its run dir's "
                                 f".hydra/config.yaml), or start a fresh run")


def _layout(meta: dict[str, Any]) -> tuple[int, int, int | None]:
    """(tensor, pipeline, virtual pipeline) sizes of a layout as meta.json / _parallel_sizes name them."""
    return (int(meta.get("tensor_model_parallel_size") or 1), int(meta.get("pipeline_model_parallel_size") or 1),
            meta.get("virtual_pipeline_model_parallel_size"))


def _ep(meta: dict[str, Any]) -> int:
    """The expert-parallel size of a layout as meta.json / _parallel_sizes name it."""
    return int(meta.get("expert_model_parallel_size") or 1)


def _experts(meta: dict[str, Any], gpt: torch.nn.Module) -> tuple[int, int]:
    """(the checkpoint's expert-parallel size, routed experts per MoE layer) for join_shards: meta.json's record, or
    for a checkpoint written before it held the count, the model's (check_model_matches refuses another model)."""
    record = meta.get("model") if isinstance(meta.get("model"), dict) else {}
    count = record["num_moe_experts"] if "num_moe_experts" in record else getattr(gpt.config, "num_moe_experts", None)
    return _ep(meta), int(count or 0)


def _resharding(step_dir: str | os.PathLike) -> bool:
    """Whether this run's tensor / pipeline / expert-parallel layout differs from the checkpoint's. An expert layout
    that cannot be resharded is refused here too, in resume_skip's line, for callers that load without it (tools,
    tests)."""
    meta, here = checkpoint_meta(step_dir), _parallel_sizes()
    _check_expert_layout(step_dir, meta, *_layout(here), here["expert_model_parallel_size"],
                         here["expert_tensor_parallel_size"])
    return _layout(meta) != _layout(here) or _ep(meta) != _ep(here)


def _saved_model_shapes(per_shard: dict[str, list[tuple[tuple, Any]]], tp_rank: int, pp_rank: int,
                        ep_rank: int | None = None) -> list[dict[str, torch.Size]]:
    """Per model chunk of the saved shard (``tp_rank``, ``pp_rank``, ``ep_rank`` at EP > 1), its tensors' shapes by
    state-dict name, from DCP's index (``per_shard``: :func:`_saved_payloads`)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    chunks: dict[int, dict[str, torch.Size]] = {}
    for path, storage in per_shard.get(_shard_key(tp_rank, pp_rank, ep_rank), []):
        if path[0] == "tensors" and isinstance(storage, TensorStorageMetadata) and path[1].startswith("model/"):
            _, chunk, name = path[1].split("/", 2)
            chunks.setdefault(int(chunk), {})[name] = storage.size
    return [chunks[i] for i in sorted(chunks)]


def _check_whole_shapes(step_dir: str | os.PathLike, models: list[torch.nn.Module]) -> None:
    """check_model_matches across layouts: each of this rank's tensors is the part of the checkpoint's whole tensor
    that resharding would cut for it (shapes from DCP's index only). A vocabulary padded otherwise at this tensor-
    parallel size (Megatron-Core pads it to a multiple of VOCAB_MULTIPLE x TP) is refused."""
    step_dir = Path(step_dir)
    per_shard = _saved_payloads(step_dir)
    meta = checkpoint_meta(step_dir)
    saved, here = _layout(meta), _layout(_parallel_sizes())

    def shapes(tp_rank: int, pp_rank: int, ep_rank: int | None) -> dict[str, Any]:
        return {"model": [{name: torch.empty(size, device="meta") for name, size in chunk.items()}
                          for chunk in _saved_model_shapes(per_shard, tp_rank, pp_rank, ep_rank)]}

    gpts = [_unwrap(m) for m in models]
    gated = bool(gpts[0].config.gated_linear_unit)
    whole, _ = join_shards(shapes, saved, gpts[0].config.num_layers, gated=gated, experts=_experts(meta, gpts[0]))
    _, tp_rank, _ = _ranks()
    for gpt in gpts:
        for name, value in gpt.state_dict().items():
            if not isinstance(value, torch.Tensor) or name.endswith("_extra_state"):
                continue
            key = live_global_name(gpt, name)
            full = _whole_of(whole, key)
            got = tuple(rank_slice(key, full, here[0], tp_rank, gated).shape) if full is not None else None
            if got == tuple(value.shape):
                continue
            if got is not None and key.endswith(("word_embeddings.weight", "output_layer.weight")) and \
                    _one_vocabulary(value.shape[0] * here[0], here[0], full.shape[0], saved[0]):
                raise ConfigError(f"trainer.tensor_model_parallel_size: {here[0]} pads the vocabulary to "
                                  f"{value.shape[0] * here[0]} rows, the checkpoint's {saved[0]} to {full.shape[0]} "
                                  f"({step_dir}); resume with trainer.tensor_model_parallel_size={saved[0]}, or a size "
                                  f"that pads it alike (to a multiple of {VOCAB_MULTIPLE} x TP)")
            what = f"is {tuple(value.shape)} here and {got} cut from the checkpoint" if got else \
                "is not in the checkpoint"
            raise ConfigError(f"model: {key} {what} ({step_dir} was saved with another model config); resume with "
                              f"the model it was saved with (its run dir's .hydra/config.yaml), or start a fresh run")


def _one_vocabulary(rows: int, tp: int, saved_rows: int, saved_tp: int) -> bool:
    """Whether one vocabulary size pads to ``rows`` at tensor-parallel size ``tp`` and to ``saved_rows`` at
    ``saved_tp`` (Megatron-Core pads to a multiple of VOCAB_MULTIPLE x TP): then only the TP size makes the rows
    differ; otherwise the vocabulary itself (model.vocab_size, the tokenizer) does."""
    return max(rows - VOCAB_MULTIPLE * tp, saved_rows - VOCAB_MULTIPLE * saved_tp) < min(rows, saved_rows)


def _whole_of(whole: dict[str, Any], name: str) -> Any:
    """``whole[name]``; a tied LM head (none saved on a one-stage layout) is the embedding."""
    if name not in whole and name == "output_layer.weight":
        return whole.get("embedding.word_embeddings.weight")
    return whole.get(name)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


_GROUPED_EXPERTS = re.compile(r"\.mlp\.experts\.linear_fc[12]$")
"""A TE grouped experts linear's state entry: one per MoE layer and fc, its delayed state for this EP rank's experts."""


def _scaling_state(shards: dict[tuple[int, int, int], Any], tp: int, tp_rank: int,
                   ep_rank: int | None) -> tuple[dict[str, Any] | None, int]:
    """(the precision state for tensor-parallel rank ``tp_rank`` of this layout, the grouped experts' entries left
    out) from every saved shard's (tp_rank, pp_rank, ep_rank): its entries are named by global module (backends/),
    so the stages' and EP ranks' states are joined. At the saved tensor-parallel size the rank takes its own; at
    another one the saved ranks' states must agree (an amax reduction over TP makes them), else None (start fresh).
    TE's grouped experts hold their EP rank's experts under one name: taken from EP rank ``ep_rank``'s shard, left
    out (reset) where the EP size changed (``ep_rank`` None). FP8 weight bytes (fp8_params) are per shard: dropped."""
    saved_tp = 1 + max(t for t, _, _ in shards)
    dropped: set[str] = set()

    def joined(t: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for (tt, _, e), state in sorted(shards.items()):
            for key, value in (state or {}).items() if tt == t else ():
                if key == "fp8_params":
                    continue
                if not isinstance(value, dict):
                    out[key] = value if e == 0 else out.get(key, value)
                    continue
                for name, entry in value.items():
                    if _GROUPED_EXPERTS.search(str(name)):
                        if e != ep_rank:  # another EP rank's experts under the same name
                            if ep_rank is None:
                                dropped.add(name)
                            continue
                    elif e and ".mlp.experts." not in str(name):
                        continue  # a dense module: EP rank 0's, as the weights are (amaxes may differ per DP rank)
                    out.setdefault(key, {})[name] = entry
        return out

    if tp == saved_tp:
        return joined(tp_rank), len(dropped)
    states = [joined(t) for t in range(saved_tp)]
    return (states[0] if all(_same(states[0], s) for s in states[1:]) else None), len(dropped)


def _read_joined(step_dir: Path, gpts: list, optimizer: bool, map_location: str | torch.device):
    """(whole tensors, whole optimizer states, {(tp, pp, ep) of each shard read: its step, scheduler, precision and
    optimizer step}, the saved stages read) of the checkpoint's shards that hold this rank's tensors."""
    meta = checkpoint_meta(step_dir)
    saved, experts = _layout(meta), _experts(meta, gpts[0])
    num_layers = gpts[0].config.num_layers
    wanted = {live_global_name(gpt, name) for gpt in gpts for name, value in gpt.state_dict().items()
              if isinstance(value, torch.Tensor) and not name.endswith("_extra_state")}
    per_shard = _saved_payloads(step_dir)
    first_ep = 0 if experts[0] > 1 else None
    held = {p: [(v, name) for v, chunk in enumerate(_saved_model_shapes(per_shard, 0, p, first_ep)) for name in chunk]
            for p in range(saved[1])}
    stages = stages_holding(held, saved, num_layers, wanted)
    kept: dict[tuple[int, int, int], dict[str, Any]] = {}

    def read_shard(tp_rank: int, pp_rank: int, ep_rank: int | None) -> dict[str, Any]:
        payload = read_checkpoint(step_dir, tp_rank, map_location, pp_rank=pp_rank, skip_optimizer=not optimizer,
                                  ep_rank=ep_rank)
        if payload.get("format_version") != FORMAT_VERSION:
            raise ConfigError(f"{step_dir}: format_version {payload.get('format_version')}, expected {FORMAT_VERSION}")
        shard = kept[(tp_rank, pp_rank, ep_rank or 0)] = {k: payload[k] for k in ("step", "scheduler", "precision")}
        if optimizer:
            shard["optimizer_step"] = saved_optimizer_step(payload["optimizer"])
        return payload

    whole, states = join_shards(read_shard, saved, num_layers, gated=bool(gpts[0].config.gated_linear_unit),
                                optimizer=optimizer, stages=stages, experts=experts,
                                ep_ranks=saved_ep_ranks(wanted, experts))  # (a rank of EP 8: its experts' only)
    return whole, states, kept, stages


def _load_resharded(step_dir: Path, chunks: list, engine, precision, scheduler,
                    map_location: str | torch.device) -> int:
    """load_checkpoint at another tensor / pipeline / virtual-pipeline / expert-parallel layout than the
    checkpoint's: the shards of the saved stages that hold this rank's layers are read and joined into whole tensors
    (training/reshard.py), then this rank's part of them is loaded: the weights, the optimizer's fp32 main params,
    moments and step, the LR schedule; the scaling state by global module where it carries over. The RNG streams
    restart from trainer.seed."""
    rank, tp_rank, _ = _ranks()
    meta, sizes = checkpoint_meta(step_dir), _parallel_sizes()
    saved, here = _layout(meta), _layout(sizes)
    gpts = [_unwrap(c) for c in chunks]
    gated = bool(gpts[0].config.gated_linear_unit)
    whole, states, kept, stages = _read_joined(step_dir, gpts, engine is not None, map_location)
    with torch.no_grad():
        for gpt in gpts:
            state = gpt.state_dict()
            for name, value in state.items():
                if isinstance(value, torch.Tensor) and not name.endswith("_extra_state"):
                    key = live_global_name(gpt, name)
                    state[name] = rank_slice(key, _whole_of(whole, key), here[0], tp_rank, gated)
            gpt.load_state_dict(state)
    del whole
    first = kept[min(kept)]  # the step, LR schedule and optimizer step: alike in every shard
    if engine is not None:
        load_optimizer_resharded(engine.models, engine.optimizer, states, first["optimizer_step"], here[0], tp_rank,
                                 gated)
    if scheduler is not None:
        scheduler.load_state_dict(first["scheduler"])
    if precision is not None:
        same_ep = _ep(meta) == _ep(sizes)
        _load_scaling(step_dir, precision, kept, here[0], (_expert_ranks()["ep_rank"] or 0) if same_ep else None)
    if rank == 0:
        logger.info("resume: resharded %s from tp=%d pp=%d vpp=%s ep=%d to tp=%d pp=%d vpp=%s ep=%d (weights, fp32 "
                    "main params, Adam moments, step; the RNG streams restart from trainer.seed); rank 0 read saved "
                    "stages %s", step_dir, *saved, _ep(meta), *here, _ep(sizes), ",".join(map(str, stages)))
    return int(first["step"])


def _load_scaling(step_dir: Path, precision, kept: dict[tuple[int, int, int], dict[str, Any]], tp: int,
                  ep_rank: int | None) -> None:
    """A resharded resume's scaling state (:func:`_scaling_state`), or a warning on rank 0 saying why it was reset
    (or what of it was)."""
    rank, tp_rank, _ = _ranks()
    scaling, dropped = _scaling_state({k: v["precision"] for k, v in kept.items()}, tp, tp_rank, ep_rank)
    current = precision.state_dict().get("recipe")
    if scaling is not None and scaling.get("recipe") == current:
        precision.load_state_dict(scaling)
        if dropped and rank == 0:
            logger.warning("resume: %s: the delayed scaling state of %d grouped expert linear(s) reset: TE's grouped "
                           "experts keep one state for an EP rank's experts, and the expert-parallel size changed",
                           step_dir, dropped)
    elif rank == 0:
        saved_tp = 1 + max(t for t, _, _ in kept)
        why = (f"was written by recipe {scaling.get('recipe')!r}, this run uses {current!r}" if scaling is not None
               else f"holds a different scaling state on each of its {saved_tp} tensor-parallel ranks")
        logger.warning("resume: %s %s: scaling state reset (the weights and the rest resharded)",
                       step_dir, why)


ATTENTION_EXTRA_STATE = "core_attention._extra_state"
"""TE's core attention (TEDotProductAttention) keeps an extra state entry, Megatron-Core's local one none: emulated
runs build TE's on a GPU with TE and the local one elsewhere (training/run.py), so their checkpoints differ by it."""


def _load_model_state(model, state: dict) -> None:
    """``model.load_state_dict(state)``, strict but for the core attentions' extra state (an emulated run's
    checkpoint resumed on another device kind, or one written before its GPU runs took TE's attention)."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    if any(not k.endswith(ATTENTION_EXTRA_STATE) for k in (*missing, *unexpected)):
        model.load_state_dict(state)  # (strict: Megatron-Core's own error for any other difference)


def load_checkpoint(path: str | os.PathLike, *, engine=None, models=None, precision=None, scheduler=None,
                    restore_rng: bool = True, map_location: str | torch.device = "cpu") -> int:
    """Restore what :func:`save_checkpoint` wrote into the given objects; returns the step saved.

    Every rank reads its shard's payload (:func:`read_checkpoint`); with the distributed optimizer the optimizer's
    load is collective over the data-parallel group (rank 0 of it scatters the parameter state). Objects passed as
    None are skipped; ``models`` (a model or a list of chunks) when there is no ``engine``.
    """
    rank, tp_rank, pp_rank = _ranks()
    step_dir = resolve_checkpoint(path)
    chunks = engine.models if engine is not None else (models if isinstance(models, (list, tuple)) else [models])
    if _resharding(step_dir):
        return _load_resharded(step_dir, chunks, engine, precision, scheduler, map_location)
    payload = read_checkpoint(step_dir, tp_rank, map_location, pp_rank=pp_rank, **_expert_ranks())
    if payload.get("format_version") != FORMAT_VERSION:
        raise ConfigError(f"{step_dir}: format_version {payload.get('format_version')}, expected {FORMAT_VERSION}")
    if len(chunks) != len(payload["model"]):
        raise ConfigError(f"{step_dir} holds {len(payload['model'])} model chunks per rank, this run builds "
                         f"{len(chunks)}; resume with the checkpoint's trainer.virtual_pipeline_model_parallel_size")
    for chunk, state in zip(chunks, payload["model"]):
        _load_model_state(_unwrap(chunk), state)
    if precision is not None:  # another recipe's scaling state means nothing here: start it afresh
        saved, current = (payload["precision"] or {}).get("recipe"), precision.state_dict().get("recipe")
        if saved != current:
            precision = None
            actions = len(((payload["precision"] or {}).get("autopilot") or {}).get("applied") or ())
            if rank == 0:
                logger.warning("resume: %s was written by recipe %r, this run uses %r: scaling state reset "
                               "(model, optimizer, LR schedule, step and RNG restored)%s", step_dir, saved, current,
                               f"; the autopilot's {actions} recorded action(s) on {saved!r} are dropped with it"
                               if actions else "")
    for name, obj in (("scheduler", scheduler), ("precision", precision)):
        if obj is not None:
            if payload[name] is None:
                raise ConfigError(f"{step_dir} has no {name} state to restore")
            obj.load_state_dict(payload[name])
    if engine is not None:
        if payload["optimizer"] is None:
            raise ConfigError(f"{step_dir} has no optimizer state to restore")
        engine.load_optimizer_state_dict(payload["optimizer"])
    if restore_rng:
        _set_rng_state(payload["rng"])
    return int(payload["step"])
