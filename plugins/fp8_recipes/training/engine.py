"""Megatron-Core's own training engine under this project's loop: DistributedDataParallel, its optimizer (the
distributed optimizer when asked) and the pipeline schedules, wired as Megatron-LM's ``pretrain`` wires them.

    engine = build_engine(chunks, trainer_cfg, seq_length=..., lr=...)   # chunks: megatron/model.build_model_chunks
    result = engine.train_step(batches, preempt_requested=False)        # one optimizer step, or a skipped one
    val = engine.evaluate(valid_batches)

What is Megatron-Core's, used as it is (megatron-core 0.19):
- ``DistributedDataParallel`` per model chunk (bucketed gradient buffers, ``overlap_grad_reduce``,
  ``overlap_param_gather``; only the first chunk is bucketed, as Megatron-LM's ``get_model`` does);
- ``get_megatron_optimizer`` (fp32 main params for BF16 models, the distributed optimizer, AdamW with weight decay
  on matrices only);
- ``get_forward_backward_func()``: no pipelining, 1F1B, or interleaved 1F1B with virtual stages; the schedule runs
  ``finalize_model_grads`` (DP/CP gradient reduction, sequence-parallel norm grads over TP, tied embeddings over the
  first and last stage) and the ``no_sync`` / ``start_grad_sync`` / ``start_param_sync`` hooks of the config.

What stays ours (the loop's duties): the LR schedule (training/lr_schedule.py, written into every param group
each step, scaled by the group's ``lr_mult``), and the skip of a non-finite step: Megatron-Core's ``optimizer.step()``
skips only on a loss scaler's found-inf (FP16), so :meth:`Engine.train_step` runs its parts
(``prepare_grads``, ``get_grad_norm``, clipping by that norm, ``step_with_ready_grads``) and leaves out the update
when the loss or the gradient norm is not finite on any rank: weights and optimizer state stay as they were.

Losses: a micro-batch's loss is its masked mean; the schedule divides by the micro-batches and DDP averages over the
data-parallel ranks, so a step's loss is the mean of its micro-batches' means, at any layout. Under context
parallelism each rank's token sum is divided by the whole sequence's token count (Megatron-LM's rule), which the
schedule's x CP and DDP's average over DP x CP turn back into that mean.

On the CPU (gloo) the engine's calls run inside megatron/cpu_shim.py's ``cuda_as_cpu()``: Megatron-Core names the
CUDA device in a few tensor factories and type checks (see that module).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence
from functools import partial
from typing import Any

import torch

from fp8_recipes.checks import ConfigError
from fp8_recipes.megatron.cpu_shim import cuda_as_cpu
from fp8_recipes.megatron.model import unwrap_model
from fp8_recipes.training.config import TrainerConfig

__all__ = ["Engine", "StepResult", "build_engine", "untie_step_tensors"]


@dataclasses.dataclass
class StepResult:
    loss: float
    """Mean micro-batch loss of the step over all data-parallel ranks (NaN/inf when some rank's was)."""
    grad_norm: float
    """Global gradient norm before clipping (Megatron-Core's, over every rank that holds a shard)."""
    skipped: bool
    """The update was left out: a non-finite loss or gradient norm on some rank."""
    preempted: bool
    """Some rank asked to stop after this step (its flag rode in the step's one all-reduce)."""


def _to_device(batch: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


def _chained(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


class Engine:
    """This rank's model chunks (each in Megatron-Core's DDP), the optimizer, and the schedule that runs them.
    Without an optimizer (``None``) and with plain chunks it only evaluates (training/evaluate.py)."""

    def __init__(self, chunks: list[torch.nn.Module], optimizer: Any, cfg: TrainerConfig, *, seq_length: int,
                 num_microbatches: int, device: torch.device):
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self.chunks, self.optimizer, self.cfg = chunks, optimizer, cfg
        self.seq_length, self.num_microbatches, self.device = seq_length, num_microbatches, device
        self.config = unwrap_model(chunks[0]).config
        self._forward_backward = get_forward_backward_func()
        self.is_last_stage = ps.is_pipeline_last_stage(ignore_virtual=True)
        self.cp_size = ps.get_context_parallel_world_size()
        self._cp_group = ps.get_context_parallel_group() if self.cp_size > 1 else None
        # The ranks whose losses count: evaluation sums every CP rank's tokens on the last stage's first TP rank;
        # a training step's mean is the same on every CP rank, so one of them reports it.
        self._sums_eval = self.is_last_stage and ps.get_tensor_model_parallel_rank() == 0
        self._reports_loss = self._sums_eval and ps.get_context_parallel_rank() == 0
        self.dp_size = ps.get_data_parallel_world_size()
        self.graphs = None
        """The layers' CUDA graphs (megatron/graphs.py's LayerGraphs) when the model config asks for them."""

    # -- the model as one module, for code that reads it (checkpoints, statistics) --------------------------------
    @property
    def models(self) -> list[torch.nn.Module]:
        """This rank's GPTModel chunks, unwrapped (DDP and Float16Module removed)."""
        return [unwrap_model(c) for c in self.chunks]

    # -- forward steps ----------------------------------------------------------------------------------------------
    def _batch(self, data_iterator: Iterator) -> dict[str, Any]:
        batch = _to_device(next(data_iterator), self.device)
        if self.cp_size > 1:  # each CP rank keeps its two (load-balanced) slices of every sequence
            from megatron.core.utils import get_batch_on_this_cp_rank

            batch = get_batch_on_this_cp_rank({**batch, "cu_seqlens": None}, is_hybrid_cp=False,
                                              cp_group=self._cp_group)
        return batch

    def _forward(self, data_iterator: Iterator, model: torch.nn.Module, *, train: bool):
        batch = self._batch(data_iterator)
        losses = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        return losses, partial(self._train_loss if train else self._eval_loss, batch["loss_mask"])

    def _train_loss(self, loss_mask: torch.Tensor, losses: torch.Tensor):
        mask = loss_mask.float()
        local = (losses.float() * mask).sum()
        count = mask.sum()
        if self.cp_size > 1:  # the whole sequence's token count (a value: no gradient flows through it)
            count = count.detach().clone()
            torch.distributed.all_reduce(count, group=self._cp_group)
        loss = local / count.clamp(min=1)
        reported = loss.detach().clone()
        if self.cp_size > 1:
            torch.distributed.all_reduce(reported, group=self._cp_group)
        # (the schedule multiplies a 2-tuple loss by the CP size and DDP averages over DP x CP: the sum over the CP
        # ranks of their token sums over the whole sequence's count, i.e. the sequence's mean, per replica)
        return loss, {"loss": reported}

    def _eval_loss(self, loss_mask: torch.Tensor, losses: torch.Tensor):
        mask = loss_mask.float()
        sums = torch.stack([(losses.float() * mask).sum().double(), mask.sum().double()])
        return sums[0].float(), {"sums": sums}

    def _run_schedule(self, batches: Sequence[Iterator] | Iterator, num_microbatches: int, *, train: bool):
        iterators = list(batches) if isinstance(batches, (list, tuple)) else [batches]
        return self._forward_backward(
            forward_step_func=partial(self._forward_step, train=train),
            data_iterator=iterators if len(self.chunks) > 1 else iterators[0],
            model=self.chunks if len(self.chunks) > 1 else self.chunks[0],
            num_microbatches=num_microbatches, seq_length=self.seq_length,
            micro_batch_size=self.cfg.micro_batch_size, forward_only=not train)

    def _forward_step(self, data_iterator: Iterator, model: torch.nn.Module, *, train: bool):
        return self._forward(data_iterator, model, train=train)

    # -- one optimizer step -----------------------------------------------------------------------------------------
    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)

    def train_step(self, batches: Sequence[Iterator] | Iterator, preempt_requested: bool = False) -> StepResult:
        """Forward and backward of ``num_microbatches`` micro-batches through the schedule, then the optimizer step
        unless the loss or the gradient norm is not finite on some rank (the decision and the preemption flag ride in
        one all-reduce over every rank, so every rank decides the same). ``batches``: one iterator per model chunk
        (each yields the same micro-batches: pipeline stages and chunks each read the stream)."""
        with cuda_as_cpu():
            for chunk in self.chunks:
                chunk.zero_grad_buffer()
            self.optimizer.zero_grad()
            reported = self._run_schedule(batches, self.num_microbatches, train=True)
            self.optimizer.prepare_grads()
            grad_norm = float(self.optimizer.get_grad_norm())
            local = torch.zeros((), dtype=torch.float64, device=self.device)
            if self._reports_loss:
                local = torch.stack([r["loss"].double() for r in reported]).mean()
            bad = (~torch.isfinite(local)).double()
            flags = torch.stack([local, bad, torch.tensor(float(preempt_requested), dtype=torch.float64,
                                                          device=self.device)])
            loss_sum, bad_ranks, preempting = self._reduce_flags(flags).tolist()
            skipped = bad_ranks > 0 or not math.isfinite(grad_norm)
            if not skipped:
                self._clip(grad_norm)
                self.optimizer.step_with_ready_grads()
        return StepResult(loss_sum / self.dp_size, grad_norm, skipped, preempting > 0)

    @staticmethod
    def _reduce_flags(flags: torch.Tensor) -> torch.Tensor:
        """[loss of this replica (its reporting rank only), non-finite loss, preemption asked]: summed over every
        rank, one small all-reduce per step (a CPU-GPU sync point)."""
        torch.distributed.all_reduce(flags)
        return flags

    def _clip(self, grad_norm: float) -> None:
        """Clip every main grad by the global norm already computed (ChainedOptimizer.step's clipping, without
        a second norm computation)."""
        if self.cfg.clip_grad <= 0:
            return
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        for opt in _chained(self.optimizer):
            if getattr(opt, "is_stub_optimizer", False):
                continue
            params = opt.get_parameters()
            if params:
                clip_grad_by_total_norm_fp32(params, self.cfg.clip_grad, grad_norm,
                                             use_decoupled_grad=opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)

    # -- evaluation ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, batches: list[Mapping[str, Any]]) -> float:
        """Token-weighted mean loss over ``batches`` (this data-parallel rank's) and all data-parallel ranks."""
        was_training = [c.training for c in self.chunks]
        for c in self.chunks:
            c.eval()
        overlap = self.cfg.overlap_param_gather and all(hasattr(c, "disable_forward_pre_hook") for c in self.chunks)
        with cuda_as_cpu():
            if overlap:  # Megatron-LM's evaluate: the params must be gathered before a forward without hooks
                for c in self.chunks:
                    c.disable_forward_pre_hook()
            try:
                reported = self._run_schedule([iter(batches) for _ in self.chunks], len(batches), train=False)
            finally:
                if overlap:
                    for c in self.chunks:
                        c.enable_forward_pre_hook()
            totals = torch.zeros(2, dtype=torch.float64, device=self.device)
            if self._sums_eval:
                for r in reported:
                    totals += r["sums"]
            torch.distributed.all_reduce(totals)
        for c, mode in zip(self.chunks, was_training):
            c.train(mode)
        return (totals[0] / totals[1].clamp(min=1)).item()

    # -- state -----------------------------------------------------------------------------------------------------
    def optimizer_state_dict(self) -> dict[str, Any]:
        """The optimizer's state, independent of the data-parallel size: Megatron-Core's ``state_dict()`` and, with
        the distributed optimizer, the parameter state gathered onto data-parallel rank 0 (``None`` elsewhere;
        collective over the data-parallel group)."""
        with cuda_as_cpu():
            state = {"distributed": self.cfg.use_distributed_optimizer, "state_dict": self.optimizer.state_dict()}
            if self.cfg.use_distributed_optimizer:
                state["param_state"] = [opt.get_parameter_state_dp_zero() for opt in _chained(self.optimizer)]
        return state

    def load_optimizer_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`optimizer_state_dict` (collective over the data-parallel group with the distributed
        optimizer: data-parallel rank 0 scatters the parameter state)."""
        if bool(state.get("distributed")) != self.cfg.use_distributed_optimizer:
            raise ConfigError(f"trainer.use_distributed_optimizer: {self.cfg.use_distributed_optimizer} differs from "
                             f"the checkpoint's {bool(state.get('distributed'))}; resume with "
                             f"trainer.use_distributed_optimizer={str(bool(state.get('distributed'))).lower()}")
        current = self.optimizer.param_groups[0] if self.optimizer.param_groups else {}
        _set_lr_bounds(state["state_dict"], current.get("max_lr"), current.get("min_lr"))
        with cuda_as_cpu():
            self.optimizer.load_state_dict(state["state_dict"])
            if self.cfg.use_distributed_optimizer:
                for opt, param_state in zip(_chained(self.optimizer), state["param_state"]):
                    untie_step_tensors(opt)
                    with _step_tensors_aside(opt):
                        opt.load_parameter_state_from_dp_zero(param_state)


def untie_step_tensors(optimizer: Any) -> None:
    """Give each parameter's optimizer state its own ``step`` tensor. Megatron-Core 0.19's distributed optimizer,
    loading its state without Transformer Engine or Apex (torch's AdamW: the CPU), gives every parameter one shared
    ``step`` tensor, and torch's AdamW adds 1 to each parameter's step in place: the shared one would advance once per
    parameter per step (at step 4 the last parameter's bias correction would be that of step 3 + its count). Call
    it after ``load_state_dict`` of one (not chained) Megatron-Core optimizer."""
    for state in getattr(getattr(optimizer, "optimizer", None), "state", {}).values():
        if isinstance(state, dict) and isinstance(state.get("step"), torch.Tensor):
            state["step"] = state["step"].clone()


@contextlib.contextmanager
def _step_tensors_aside(optimizer: Any) -> Iterator[None]:
    """Megatron-Core 0.19's ``load_parameter_state_from_dp_zero`` copies every tensor of a param's optimizer state
    from the gathered state, which holds ``param``, ``exp_avg`` and ``exp_avg_sq`` only; torch's AdamW (the
    optimizer where neither Transformer Engine nor Apex is installed: the CPU) also keeps a ``step`` tensor per param,
    which ``load_state_dict`` has already restored from the param groups (KeyError: 'step' otherwise). TE's
    FusedAdam keeps ``step`` in the param groups: nothing is set aside there."""
    inner = getattr(optimizer, "optimizer", None)
    aside = {}
    for param, state in (getattr(inner, "state", {}) or {}).items():
        if isinstance(state, dict) and isinstance(state.get("step"), torch.Tensor):
            aside[param] = state.pop("step")
    try:
        yield
    finally:
        for param, step in aside.items():
            inner.state[param]["step"] = step


def _set_lr_bounds(state: Any, max_lr: float | None, min_lr: float | None) -> None:
    """Give every saved param group this run's ``max_lr`` / ``min_lr``: Megatron-Core matches saved groups to its own
    by them, and the LR schedule is the configured one (a run may resume under another ``trainer.lr``)."""
    if isinstance(state, dict):
        for key, value in state.items():
            if key == "param_groups" and isinstance(value, list):
                for group in value:
                    if isinstance(group, dict) and "max_lr" in group:
                        group["max_lr"], group["min_lr"] = max_lr, min_lr
            else:
                _set_lr_bounds(value, max_lr, min_lr)
    elif isinstance(state, (list, tuple)):
        for value in state:
            _set_lr_bounds(value, max_lr, min_lr)


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def build_engine(chunks: list[torch.nn.Module], cfg: TrainerConfig, *, seq_length: int, lr: float,
                 device: torch.device, fp8_param: str | None = None) -> Engine:
    """Wrap ``chunks`` (this rank's GPTModel chunks, Float16Module-wrapped for BF16) in Megatron-Core's DDP, build
    its optimizer and hook both into the model config the schedules read, as Megatron-LM's ``pretrain`` does.

    ``fp8_param``: Megatron-Core's recipe name (delayed | tensorwise | blockwise | mxfp8) when some weights are stored
    in FP8 (recipe ``fp8_param: true``, megatron/te_layers.py), else None. Then, as Megatron-LM's --fp8-param-gather
    sets up: DDP's ``fp8_param_gather`` (the FP8 weights' buffer is gathered in FP8) and the optimizer's
    ``fp8_recipe``; the distributed optimizer keeps fp32 main params and re-quantizes the FP8 weights from them after
    each update (``quantize_param_shard``), which the plain optimizer cannot."""
    if fp8_param is None and any(callable(getattr(p, "_get_quantizer", None)) for c in chunks for p in c.parameters()):
        raise ValueError("build_engine: the model holds FP8-stored weights (TE QuantizedTensors); pass "
                         "fp8_param=fp8_param_recipe(plan) (megatron/te_layers.py), or its weights are never updated")
    if fp8_param is not None and not cfg.use_distributed_optimizer:
        raise ConfigError("trainer.use_distributed_optimizer=false: FP8-stored weights (recipe fp8_param: true) are "
                         "re-quantized from the fp32 main params by Megatron-Core's distributed optimizer; set "
                         "trainer.use_distributed_optimizer=true")
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = unwrap_model(chunks[0]).config
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=cfg.grad_reduce_in_fp32, overlap_grad_reduce=cfg.overlap_grad_reduce,
        overlap_param_gather=cfg.overlap_param_gather, use_distributed_optimizer=cfg.use_distributed_optimizer,
        fp8_param_gather=fp8_param is not None)
    bf16 = config.params_dtype == torch.bfloat16
    with cuda_as_cpu():
        wrapped = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk,
                                           disable_bucketing=i > 0) for i, chunk in enumerate(chunks)]
        optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=lr, min_lr=cfg.min_lr, weight_decay=cfg.weight_decay, adam_beta1=cfg.adam_beta1,
            adam_beta2=cfg.adam_beta2, adam_eps=cfg.adam_eps, clip_grad=cfg.clip_grad, bf16=bf16,
            params_dtype=config.params_dtype, use_distributed_optimizer=cfg.use_distributed_optimizer,
            overlap_param_gather=cfg.overlap_param_gather, fp8_recipe=fp8_param,
            use_precision_aware_optimizer=cfg.use_precision_aware_optimizer,
            **{key: _DTYPES[getattr(cfg, key)] for key in ("exp_avg_dtype", "exp_avg_sq_dtype", "main_params_dtype",
                                                            "main_grads_dtype")}), wrapped)

    def one_or_list(fns: list) -> Any:
        return fns[0] if len(fns) == 1 else fns

    config.finalize_model_grads_func = finalize_model_grads
    if cfg.overlap_grad_reduce:
        config.no_sync_func = one_or_list([c.no_sync for c in wrapped])
        config.grad_sync_func = one_or_list([c.start_grad_sync for c in wrapped])
    if cfg.overlap_param_gather and ps.get_pipeline_model_parallel_world_size() > 1:
        config.param_sync_func = one_or_list([c.start_param_sync for c in wrapped])
    dp = ps.get_data_parallel_world_size()
    engine = Engine(wrapped, optimizer, cfg, seq_length=seq_length,
                    num_microbatches=cfg.gradient_accumulation_steps(dp), device=device)
    if config.cuda_graph_impl == "transformer_engine":  # (model cuda_graph_impl: captured by the training loop)
        from fp8_recipes.megatron.graphs import LayerGraphs

        engine.graphs = LayerGraphs(engine, seq_length=seq_length, micro_batch_size=cfg.micro_batch_size,
                                    global_batch_size=cfg.global_batch_size)
    return engine
