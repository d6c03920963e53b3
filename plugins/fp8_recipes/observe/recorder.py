"""Records numerics statistics and tensor dumps from a precision backend's quantized GEMM operands.

    recorder = NumericsRecorder(debug_config, run_dir, write=rank == 0)
    recorder.attach(precision.states)            # the emulated backend's EmulatedLinearState per module, or
                                                  # backends.te_observe.te_observer_states(te_precision)
    precision = ObservedPrecision(precision, recorder)   # tells the recorder each step; the loop is unchanged
    ... train ...
    recorder.close()                              # last rows, the heat map

Outputs in the run directory: ``numerics.jsonl`` (one row per step, module, GEMM and operand role, keys of
:data:`~fp8_recipes.observe.stats.STAT_KEYS`), TensorBoard scalars ``numerics/<module>/<gemm>/<role>/<stat>`` in
``tb/`` (a few stats: underflow_pct, saturation_pct, cosine, scale_ratio, NVFP4's block_underflow_pct and
block_saturation_pct; each role as its first GEMM reads it),
``numerics_underflow.png`` (modules x steps, underflow % of the fprop activations), and ``dumps/step_N/<module>.<gemm>.<role>.<k>.pt``
(read them with :func:`load_dump`). NVFP4 operands have the same rows, measured on the copy the GEMM reads, with
two more keys (their block scales: ``observe/stats_nvfp4.py``), and dumps of their E2M1 codes and scales.

Cost: nothing when the run has no ``debug`` section (no recorder exists); with one, an observer is set only on the
modules a due step watches and cleared otherwise, so steps between intervals run the backend's plain path. Within a
due step only the first ``debug.micro_batches`` micro-batches (default 1) are measured: once a module has handed
every operand it will get this step (the (GEMM, role) pairs its plan runs in FP8 and the config asks for) that many
times, its observer is cleared until the next due step. Operands that never arrive (not FP8 on that path) leave it
set; later arrivals are then skipped by a per-operand count. The rows are copied to the host once per step.
Evaluation forwards (modules in eval mode: ``state.record_amax`` is False) are never recorded, nor empty operands
(an MoE expert the router gave no token in that micro-batch: its activations and gradients have no element, and it
gets no activation or gradient row that step; its weights' rows stay, as the weights are quantized). Each routed
expert's linears are modules of their own (``decoder.layers.L.mlp.experts.local_experts.E.linear_fcK``), so every
statistic, ``scale_ratio`` (delayed vs current scale) included, is per expert GEMM. Statistics are
computed on every rank (a tensorwise amax reduction is a collective) and, under tensor or context parallelism,
merged over the ranks that hold the other parts of the same tensor (:class:`ShardGroups`: one all-gather of the
step's numbers per group; a routed expert's over its expert tensor-parallel ranks), so a row describes the whole
operand; at expert parallelism every rank then gathers the other expert-parallel ranks' experts. The first rank of
each pipeline stage writes them. Data-parallel ranks see other samples: a row is the first data-parallel rank's share
of the batch (an expert's: the first expert-data-parallel rank's).

The observer protocol is the emulated backend's: ``observer(state, gemm, role, hp_tensor, fake_quant_tensor[,
quantized])``, where a backend that keeps its FP8 copies to itself passes ``None`` as the fake-quantized tensor
and the recorder quantizes (the Transformer Engine backend; on the GPU one Triton kernel per operand measures)
with ``state.plan`` (the module's plan this step), ``state.scalers`` and ``state.amax_reducers`` (per role, the
current-scaling amax reduction the backend applied, if any); the Transformer
Engine backend plugs in with hooks on its linears that call it the same way (``backends/te_observe.py``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
import weakref
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fp8_recipes.observe.config import DebugConfig
from fp8_recipes.observe.heatmap import plot_heatmap
from fp8_recipes.numerics import NVFP4Quantized, Quantized, block_for, dequantize, quantize
from fp8_recipes.numerics.nvfp4 import stochastic_rounding_seed
from fp8_recipes.observe.stats import COLUMNWISE, OperandStats, measure, rows as stats_rows
from fp8_recipes.plan.precision import ROW_PARALLEL, Gemm, ModelLayout
from fp8_recipes.rundir import TENSORBOARD, jsonable, numerics_name
from fp8_recipes.recipe.schema import Format, Role, Scaling

__all__ = ["NumericsRecorder", "ObservedPrecision", "ShardGroups", "load_dump"]

logger = logging.getLogger(__name__)

TB_STATS = ("underflow_pct", "saturation_pct", "cosine", "scale_ratio", "block_underflow_pct", "block_saturation_pct")
"""The statistics also written to TensorBoard (all of them are in numerics.jsonl), one event per step."""
TB_OPERANDS = frozenset({("fprop", "activations"), ("fprop", "weights"), ("dgrad", "gradients")})
"""Each role once in TensorBoard, as its first GEMM reads it (the other GEMM's copy is the same tensor along the
other dimension: same numbers for per-tensor scales; numerics.jsonl has both)."""


@dataclass(frozen=True)
class ShardGroups:
    """The process groups over which an operand's statistics are merged: the ranks of this pipeline stage that hold
    the other parts of the same tensor (None: a group of one, nothing to merge)."""

    tensor: Any = None
    """Tensor parallelism: every weight is split over these ranks. Without sequence parallelism so is a
    row-parallel linear's input (by features) and a column-parallel one's output gradient (by features); the
    other activations and gradients are the same tensor on every TP rank. With it every operand is split (the
    sequence, where it was replicated)."""
    context: Any = None
    """Context parallelism: activations and gradients split by tokens; weights the same on every CP rank."""
    sequence_parallel: bool = False
    expert_tensor: Any = None
    """Expert tensor parallelism: a routed expert's weights are split over these ranks, as a dense linear's over
    ``tensor``; its tokens are the same on each (the dispatcher gathers them), so sequence parallelism splits none."""
    experts: Any = None
    """Expert parallelism: each rank of this group holds other routed experts (and the same dense modules): their
    rows are gathered here, so that each rank has every expert's (:meth:`NumericsRecorder._merge_shards`)."""

    def groups(self, module: str, role: str) -> tuple[Any, ...]:
        """The groups `module`'s `role` operand is split over, tensor-parallel first."""
        out = []
        expert = ModelLayout.expert_of(module) is not None
        tensor, sp = (self.expert_tensor, False) if expert else (self.tensor, self.sequence_parallel)
        if tensor is not None and (role == "weights" or sp
                                   or (role == "activations") == module.endswith(ROW_PARALLEL)):
            out.append(tensor)
        if self.context is not None and role != "weights":
            out.append(self.context)
        return tuple(out)

    def gathered(self, module: str) -> Any:
        """The group over which `module`'s rows are gathered after merging: the expert-parallel one for a routed
        expert at EP > 1, else None."""
        return self.experts if self.experts is not None and ModelLayout.expert_of(module) is not None else None


def _on_host(stats: list[OperandStats]) -> list[OperandStats]:
    """Copies of `stats` on the CPU, to travel to other ranks, in three device->host transfers: the sums, the
    extremes, and the scales :func:`~fp8_recipes.observe.stats.rows` will read (none where a histogram of block
    scales stands for them). Packed buffers stay behind (merge() drops them)."""
    if not stats:
        return []
    sums = torch.cat([s.sums.reshape(-1).double() for s in stats]).cpu().split([s.sums.numel() for s in stats])
    extremes = torch.stack([torch.stack([s.amax.reshape(()).float(), s.min_nonzero.reshape(()).float()])
                            for s in stats]).cpu()
    kept = [[] if s.scale_hist is not None else s.scales for s in stats]
    flat = [t.reshape(-1).float() for scales in kept for t in scales]
    pooled = torch.cat(flat).cpu().split([t.numel() for t in flat]) if flat else ()
    out, i = [], 0
    for k, s in enumerate(stats):
        scales = list(pooled[i:i + len(kept[k])])
        i += len(kept[k])
        out.append(OperandStats(s.policy, sums[k], extremes[k, 0], extremes[k, 1], scales,
                                None if s.scale_hist is None else s.scale_hist.cpu()))
    return out


class NumericsRecorder:
    """Aggregates operand statistics per step and writes them; saves the dumps a step asks for."""

    def __init__(self, config: DebugConfig, run_dir: str | os.PathLike, *, write: bool = True,
                 tensorboard: bool = True, stage: int | None = None, shards: ShardGroups | None = None):
        self.config = config
        self.shards = shards or ShardGroups()
        self.run_dir = Path(run_dir)
        self.write = write
        self.stage = stage
        """The pipeline stage whose modules this rank observes (None: one stage). Each stage's first rank writes
        its own rows: stage 0 (or the only one) to numerics.jsonl, stage N to numerics.stageN.jsonl (one writer per
        file; module names are global, so the files read as one: :func:`fp8_recipes.rundir.numerics_files`)."""
        self.tensorboard = tensorboard
        self.states: dict[str, Any] = {}
        self.step: int | None = None
        """The step being recorded, counted as metrics.jsonl does (optimizer steps completed after it)."""
        self._stats_due = self._dump_due = False
        self._pending: dict[tuple[str, str, str], OperandStats] = {}
        self._count: dict[tuple[str, str, str], int] = defaultdict(int)  # operand -> quantizations observed
        self._expected: dict[str, tuple[tuple[str, str, str], ...]] = {}  # module -> its operands due this step
        self._last: dict[tuple[str, str], tuple] = {}  # (module, role) -> the last measured copy (see _measure)
        self._heat: dict[str, dict[int, float]] = {}  # module -> step -> underflow % (fprop activations)
        self._rows: list[dict[str, Any]] = []  # the last written step's rows, until take_rows()
        self._file = None
        self._tb = None
        self.seconds = 0.0
        """Wall time spent measuring, dumping and writing (on a GPU, the host's share): the benchmark's numerator."""
        self.write_seconds = 0.0
        """The part of `seconds` spent writing a finished step's rows (in the next step's begin_step)."""

    # -- wiring ---------------------------------------------------------------------------------------------------
    def attach(self, states: dict[str, Any]) -> None:
        """Observe these modules (name -> backend state with an ``observer`` slot)."""
        self.states = dict(states)

    def begin_step(self, step: int) -> None:
        """Called before optimizer step `step` (0-based, the loop's index): finish the previous step's rows and
        set the observer on the modules this step watches."""
        self.flush()
        self.step = step + 1
        self._stats_due = self.config.stats_due(self.step)
        self._dump_due = self.config.dump_due(self.step)
        self._count.clear()
        self._expected.clear()
        self._last.clear()
        for name, state in self.states.items():
            watched = ((self._stats_due and self.config.stats_module(name))
                       or (self._dump_due and self.config.dump_module(name)))
            state.observer = self.observe if watched else None

    # -- the observer ---------------------------------------------------------------------------------------------
    def observe(self, state, gemm, role, hp_x: torch.Tensor, fq_x: torch.Tensor | None, quantized=None) -> None:
        """`quantized`: the Quantized `fq_x` came from, when the backend has it (its scales are then reused).
        `fq_x` None: the backend did not quantize; the recorder does, with ``state.scalers`` (see measure())."""
        if not state.record_amax:  # an evaluation forward: the model is in eval mode
            return
        if hp_x.numel() == 0:  # an expert the router gave no token: nothing quantized, so no row (not one of NaNs)
            return
        t0 = time.perf_counter()
        try:
            self._observe(state, gemm, Role(role), hp_x, fq_x, quantized)
        finally:
            self.seconds += time.perf_counter() - t0

    def _observe(self, state, gemm, role: Role, hp_x: torch.Tensor, fq_x: torch.Tensor, quantized=None) -> None:
        name, gemm_s = state.name, str(gemm)
        policy = state.plan.gemms[gemm].policy(role)
        if policy is None:
            return
        columnwise = COLUMNWISE[(gemm_s, str(role))]
        scaler = state.scalers.get(role)
        reduce = state.amax_reducers.get(role) if policy.scaling is Scaling.TENSORWISE else None
        key = (name, gemm_s, str(role))
        stats, dump = self._wants(name, role)
        if not (stats or dump):
            return
        limit = self.config.micro_batches
        if limit and self._count[key] >= limit:  # a later micro-batch (the module still waits for another operand)
            return
        self._count[key] += 1
        if stats:
            s = self._measure(key, hp_x, fq_x, policy, columnwise, scaler, reduce, quantized)
            if key in self._pending:
                self._pending[key].merge(s)
            else:
                self._pending[key] = s
        if dump:
            self._dump(key, hp_x, policy, columnwise, scaler, reduce, quantized)
        if limit:
            expected = self._expected.get(name)
            if expected is None:
                expected = self._expected[name] = self._due_operands(state)
            if all(self._count[k] >= limit for k in expected):
                state.observer = None  # done for this step: the backend skips the other micro-batches' work

    def _wants(self, name: str, role: Role) -> tuple[bool, bool]:
        """Whether this step's statistics / dumps take this module's `role` operands."""
        return (self._stats_due and role in self.config.tensors and self.config.stats_module(name),
                self._dump_due and role in self.config.dump.tensors and self.config.dump_module(name))

    def _due_operands(self, state) -> tuple[tuple[str, str, str], ...]:
        """The operands `state` will hand over this step (FP8 in its plan) that statistics or dumps take."""
        out = []
        for gemm_s, role_s in COLUMNWISE:
            role = Role(role_s)
            gemm_plan = state.plan.gemms.get(Gemm(gemm_s))
            if gemm_plan is None or gemm_plan.policy(role) is None or not any(self._wants(state.name, role)):
                continue
            out.append((state.name, gemm_s, role_s))
        return tuple(out)

    def _measure(self, key, hp_x, fq_x, policy, columnwise, scaler, reduce, quantized=None) -> OperandStats:
        """measure(), or the statistics of the same copy when an earlier GEMM's quantization is reused (fprop's
        activations for wgrad, ...): the same FP8 values of the same tensor, so the same numbers, at no cost. A
        copy is the backend's FP8 tensor `fq_x`, or, when the backend hands over none (the recorder quantizes),
        the operand `hp_x` with its policy and block. The earlier tensor is held by a weak reference: while it
        lives its memory cannot hold another tensor, so the same address and size mean the same values."""
        slot = (key[0], key[2])
        held = fq_x if fq_x is not None else hp_x
        copy = (fq_x is None, held.data_ptr(), hp_x.data_ptr(), held.numel(), policy,
                block_for(policy, hp_x.shape, columnwise) if fq_x is None else None)
        last = self._last.get(slot)
        if last is not None and last[0]() is not None and last[1] == copy:
            return last[2].copy()
        stats = measure(hp_x, fq_x, policy, columnwise=columnwise, scaler=scaler, amax_reduce=reduce,
                        quantized=quantized, seed=self._draws(key))
        self._last[slot] = (weakref.ref(held), copy, stats.copy())
        return stats

    def _draws(self, key) -> int:
        """The seed of the stochastic rounding the recorder does itself (NVFP4 copies a backend kept, e.g. TE's):
        its own numbers, not the backend's, but one per step, operand and micro-batch (not the same draws at every
        statistics step), the same for an operand's statistics and its dump."""
        return stochastic_rounding_seed("recorder", self.step, *key, self._count[key] - 1)

    # -- writing --------------------------------------------------------------------------------------------------
    def flush(self) -> None:
        """Write the finished step's rows (numerics.jsonl, TensorBoard) and keep the heat map's column."""
        if not self._pending:
            return
        t0 = time.perf_counter()
        try:
            self._write(self._pending)
        finally:
            self._pending = {}
            spent = time.perf_counter() - t0
            self.seconds += spent
            self.write_seconds += spent

    def take_rows(self) -> list[dict[str, Any]]:
        """The rows of the last step written (flush), on every rank, once: then [] until the next step's."""
        rows, self._rows = self._rows, []
        return rows

    def _merge_shards(self, pending: dict[tuple[str, str, str], OperandStats]) -> None:
        """Fold the other ranks' parts of each split operand into its statistics, group by group, as micro-batches
        of a step are folded (sums added, amax the max, scales pooled); then gather the routed experts' rows of the
        other expert-parallel ranks. Every rank of a group has the same dense operands pending (the same modules,
        plan and micro-batches), so each takes part in the same all-gathers; a routed expert's may be missing on a
        rank (no token there this step): those are folded from the ranks that have them."""
        import torch.distributed as dist

        for group in (self.shards.tensor, self.shards.expert_tensor, self.shards.context):  # (one order on all ranks)
            keys = [k for k in pending if group is not None and group in self.shards.groups(k[0], k[2])]
            if not keys:
                continue
            everyone: list[Any] = [None] * dist.get_world_size(group)
            dist.all_gather_object(everyone, (keys, _on_host([pending[k] for k in keys])), group=group)
            dense = [k for k in keys if ModelLayout.expert_of(k[0]) is None]
            for theirs, _ in everyone:
                other = [k for k in theirs if ModelLayout.expert_of(k[0]) is None]
                if other != dense:
                    raise RuntimeError(f"numerics: step {self.step}: the ranks of a shard group observed different "
                                       f"operands ({len(dense)} here, {len(other)} there; first differing: "
                                       f"{next((a, b) for a, b in zip(dense + [None], other + [None]) if a != b)})")
            merged: dict[tuple[str, str, str], OperandStats] = {}
            for theirs, stats in everyone:
                for key, st in zip(theirs, stats):
                    if key in merged:
                        merged[key].merge(st)
                    else:
                        merged[key] = st
            pending.update(merged)
        self._gather_experts(pending)

    def _gather_experts(self, pending: dict[tuple[str, str, str], OperandStats]) -> None:
        """The routed experts' merged rows of every expert-parallel rank (each holds its own experts), on every rank,
        in expert order after the dense ones."""
        import torch.distributed as dist

        group = self.shards.experts
        if group is None:
            return
        keys = [k for k in pending if self.shards.gathered(k[0]) is not None]
        everyone: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, (keys, _on_host([pending[k] for k in keys])), group=group)
        for key in keys:
            del pending[key]
        theirs = {key: st for ks, stats in everyone for key, st in zip(ks, stats)}
        for key in sorted(theirs, key=lambda k: (ModelLayout.layer_of(k[0]) or 0, ModelLayout.expert_of(k[0]))):
            pending[key] = theirs[key]

    def _write(self, pending: dict[tuple[str, str, str], OperandStats]) -> None:
        self._merge_shards(pending)
        rows = []
        values = stats_rows(list(pending.values()))  # one device->host transfer for the whole step
        for ((module, gemm, role), s), v in zip(pending.items(), values):
            row = {"step": self.step, "module": module, "gemm": gemm, "role": role, "policy": s.policy.describe(),
                   **v}
            rows.append(row)
            if gemm == "fprop" and role == "activations":
                self._heat.setdefault(module, {})[self.step] = row["underflow_pct"]
        self._rows = rows  # (every rank's: the autopilot reads them, take_rows)
        if not self.write:
            return
        self._open()
        self._file.write("".join(json.dumps({k: jsonable(v) for k, v in row.items()}) + "\n" for row in rows))
        self._file.flush()
        if self._tb is not None:
            scalars = {f"numerics/{row['module']}/{row['gemm']}/{row['role']}/{stat}": row[stat]
                       for row in rows if (row["gemm"], row["role"]) in TB_OPERANDS
                       for stat in TB_STATS if isinstance(row.get(stat), (int, float)) and math.isfinite(row[stat])}
            _add_scalars(self._tb, scalars, self.step)

    def _open(self) -> None:
        if self._file is not None:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(self.run_dir / numerics_name(self.stage), "a", encoding="utf-8")
        if self.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self._tb = SummaryWriter(log_dir=str(self.run_dir / TENSORBOARD))
            except Exception as e:  # noqa: BLE001 - statistics go to numerics.jsonl either way
                logger.warning("numerics: TensorBoard disabled (%s: %s)", type(e).__name__, e)

    def close(self, merge: bool = True) -> None:
        """Write the last step's rows and the heat map; detach from the modules. ``merge=False`` (the run ended in
        an error that may be this rank's alone, whose peers may never join another collective): the rows that
        would need other ranks' parts are dropped, the others written."""
        if not merge:
            self._pending = {k: v for k, v in self._pending.items()
                             if not self.shards.groups(k[0], k[2]) and self.shards.gathered(k[0]) is None}
        self.flush()
        for state in self.states.values():
            state.observer = None
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self.write and self._heat:
            try:
                suffix = f".stage{self.stage}" if self.stage else ""
                plot_heatmap(self._heat, self.run_dir / f"numerics_underflow{suffix}.png")
            except Exception as e:  # noqa: BLE001 - a plot must never fail a finished run
                logger.warning("numerics heat map failed: %s: %s", type(e).__name__, e)

    def _dump(self, key, hp_x, policy, columnwise, scaler, reduce, quantized=None) -> None:
        if isinstance(quantized, NVFP4Quantized):  # the copy the GEMM read (its stochastic rounding's codes)
            q = quantized
        else:  # the quantization the GEMM used, again: delayed reads the same scale and records nothing (NVFP4:
            # a reused copy, never stochastically rounded; a backend that keeps its copies: the statistics' draws)
            seed = self._draws(key) if policy.stochastic_rounding else None
            q = quantize(hp_x, policy, columnwise=columnwise, scaler=scaler, amax_reduce=reduce, record_amax=False,
                         seed=seed)
        index = self._count[key] - 1  # this quantization's number in the step (counted in _observe)
        if not self.write:
            return
        module, gemm, role = key
        out_dir = self.config.dump.path(self.run_dir) / f"step_{self.step}"
        out_dir.mkdir(parents=True, exist_ok=True)
        torch.save({
            "step": self.step, "module": module, "gemm": gemm, "role": role, "micro_batch": index,
            "columnwise": columnwise, "policy": policy.to_dict(),
            "hp": hp_x.detach().cpu().clone(), **(_nvfp4_fields(q) if isinstance(q, NVFP4Quantized) else {
                "fp8_codes": q.codes.view(torch.uint8).cpu().clone(),
                "fp8_dtype": str(q.codes.dtype).removeprefix("torch."),
                "scale": q.scale.cpu(), "scale_inv": q.scale_inv.cpu(), "block": list(q.block),
                "amax": q.amax.cpu(), "e8m0": q.e8m0.cpu() if q.e8m0 is not None else None}),
        }, out_dir / f"{module}.{gemm}.{role}.{index}.pt")


def _nvfp4_fields(q: NVFP4Quantized) -> dict[str, Any]:
    """An NVFP4 copy in a dump: packed E2M1 codes, E4M3 block scales as bytes, the global amax and scale."""
    return {"nvfp4_codes": q.codes.cpu().clone(), "block_scales": q.block_scales.view(torch.uint8).cpu().clone(),
            "global_amax": q.global_amax.cpu(), "global_scale": q.global_scale.cpu(), "block": list(q.block),
            "rht": q.rht}


class ObservedPrecision:
    """A precision controller that also tells a recorder each step begins: everything else is the wrapped one. The
    recorder is anything with ``begin_step(step)``: the numerics recorder, or observe/routing.py's."""

    def __init__(self, inner, recorder: NumericsRecorder | Any):
        self._inner = inner
        self.recorder = recorder
        self.full_precision_eval_interval = inner.full_precision_eval_interval

    def begin_step(self, step: int) -> str:
        stage = self._inner.begin_step(step)
        self.recorder.begin_step(step)
        return stage

    def high_precision(self):
        return self._inner.high_precision()

    def after_optimizer_step(self, step: int) -> None:
        self._inner.after_optimizer_step(step)

    def state_dict(self) -> dict:
        return self._inner.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self._inner.load_state_dict(state_dict)

    def __getattr__(self, name: str):  # scales(), plan, states, execution_summary() ...
        if name == "_inner":  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self._inner, name)


# -- reading ------------------------------------------------------------------------------------------------------


def load_dump(path: str | os.PathLike) -> dict[str, Any]:
    """A dump as a dict: ``hp`` (the operand in its dtype), ``fp8_codes`` (uint8), ``fp8`` (the same bits as the
    FP8 dtype), ``scale``/``scale_inv`` per block, ``block``, ``policy`` (dict), ``step``/``module``/``gemm``/
    ``role``/``micro_batch``/``columnwise``, and ``dequantized``: codes x scale_inv, what the GEMM read. An NVFP4
    operand's dump holds its E2M1 codes and two-level scales instead (:func:`_load_nvfp4`)."""
    d = torch.load(path, map_location="cpu", weights_only=True)
    if "nvfp4_codes" in d:
        return _load_nvfp4(d)
    fp8_dtype = getattr(torch, d["fp8_dtype"])
    d["fp8"] = d["fp8_codes"].view(fp8_dtype)
    hp = d["hp"]
    q = Quantized(codes=d["fp8"], scale=d["scale"], scale_inv=d["scale_inv"], block=tuple(d["block"]),
                  format=Format(d["policy"]["format"]), shape=hp.shape, dtype=hp.dtype, amax=d["amax"],
                  e8m0=d["e8m0"])
    d["dequantized"] = dequantize(q)
    return d


def _load_nvfp4(d: dict[str, Any]) -> dict[str, Any]:
    """load_dump of an NVFP4 operand: ``nvfp4_codes`` (uint8, two E2M1 codes a byte, element 2j in the low nibble,
    the copy's 2-D layout: x^T for a columnwise copy), ``block_scales`` (uint8 bytes of the E4M3 scales; ``fp8``:
    the same as float8_e4m3fn), ``global_amax``, ``global_scale``, ``rht`` and ``dequantized`` (x's shape; an RHT
    copy's values stay rotated, as the wgrad GEMM reads them)."""
    hp = d["hp"]
    d["fp8"] = d["block_scales"].view(torch.float8_e4m3fn)
    q = NVFP4Quantized(codes=d["nvfp4_codes"], block_scales=d["fp8"], global_amax=d["global_amax"],
                       global_scale=d["global_scale"], shape=hp.shape, dtype=hp.dtype, block=tuple(d["block"]),
                       columnwise=d["columnwise"], rht=d["rht"])
    d["dequantized"] = dequantize(q)
    return d


def _add_scalars(writer, scalars: dict[str, float], step: int) -> None:
    """`add_scalar` for each, as one TensorBoard event (one Summary of many values: the same scalars in
    TensorBoard, at a fraction of the cost of an event per value)."""
    from tensorboard.compat.proto.summary_pb2 import Summary

    if scalars:
        writer._get_file_writer().add_summary(
            Summary(value=[Summary.Value(tag=tag, simple_value=float(v)) for tag, v in scalars.items()]), step)
