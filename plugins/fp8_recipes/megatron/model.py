"""Process groups and a Megatron-Core GPTModel, on the CPU (gloo, local spec) or on GPUs (NCCL, TE spec).

    rank, world_size, device = init_distributed(tensor_model_parallel_size=1, pipeline_model_parallel_size=2)
    chunks = build_model_chunks(cfg.model, column_linear=MyColumn, row_linear=MyRow, device=device)
    names = linear_module_names(chunks)     # ["decoder.layers.2.self_attention.linear_qkv", ...] (global numbers)
    ...
    destroy_distributed()

Linear substitution. The local layer spec names its four linear classes (attention ``linear_qkv`` /
``linear_proj``, MLP ``linear_fc1`` / ``linear_fc2``), so subclasses of Megatron-Core's
``ColumnParallelLinear`` / ``RowParallelLinear`` are put into the spec and built in their place (and a subclass
of its ``DotProductAttention`` as the attention's ``core_attention``). The LM
head (``output_layer``) is not in the spec: ``GPTModel.__init__`` builds it as
``tensor_parallel.ColumnParallelLinear`` directly (gpt_model.py, "Output"). :func:`replace_output_layer_class`
re-classes that one instance after construction (``module.__class__ = cls``): parameters, buffers,
hooks and the tied-embedding wiring stay as they are, but the subclass's ``__init__`` does not run, so a
substitute class must keep its extra state lazy (or set it in an optional ``_after_class_swap()``,
called here). Patching ``tensor_parallel.ColumnParallelLinear`` during construction would also work but
changes a global other code may read; subclassing GPTModel would duplicate its constructor.

Where the GEMM happens (megatron-core 0.19.2, tensor_parallel/layers.py). Both classes call
``self._forward_impl(input=, weight=, bias=, gradient_accumulation_fusion=, allreduce_dgrad=,
sequence_parallel=, grad_output_buffer=, [wgrad_deferral_limit=,] tp_group=, gtp_remat_size=)``, which
dispatches to ``linear_with_frozen_weight`` (weight without grad) or
``linear_with_grad_accumulation_and_async_allreduce`` -> ``LinearWithGradAccumulationAndAsyncCommunication``
(forward: ``torch.matmul(total_input, weight.t()) + bias``; backward: dgrad ``grad_output @ weight``,
wgrad ``grad_output.t() @ total_input``). Overriding ``_forward_impl`` swaps exactly that call.
- Column (qkv, fc1, LM head): with TP>1 and no sequence parallelism ``allreduce_dgrad=True`` and ``forward``
  does NOT wrap the input in ``copy_to_tensor_model_parallel_region``: the dgrad all-reduce over
  ``tp_group`` happens inside the Function's backward. A replacement Function must do that all-reduce
  itself when ``allreduce_dgrad`` is true (or apply ``copy_to_tensor_model_parallel_region(input,
  group=tp_group)`` before a plain GEMM); with sequence parallelism it must also all-gather the input in
  forward and reduce-scatter dgrad. Output gather (``gather_output``) stays in ``forward``.
- Row (proj, fc2): ``_forward_impl`` gets ``bias=None, allreduce_dgrad=False, sequence_parallel=False,
  tp_group=None``; the output all-reduce (``reduce_from_tensor_model_parallel_region``) and the bias add
  stay in ``forward``, so a replacement Function is a plain local GEMM.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import re
from datetime import timedelta
from typing import Any, Callable, Mapping

import torch

from fp8_recipes.launcher import launch_env, local_world_size
from fp8_recipes.megatron.cpu_shim import cuda_as_cpu, install_cpu_shim
from fp8_recipes.megatron.model_config import (VOCAB_MULTIPLE, check_model_cfg, config_layout, graph_config_fields,
                                               moe_config_fields, pad_vocab_size)

__all__ = [
    "init_distributed",
    "destroy_distributed",
    "build_gpt_model",
    "build_model_chunks",
    "pad_vocab_size",
    "unwrap_model",
    "replace_output_layer_class",
    "global_name",
    "named_linear_modules",
    "grouped_expert_rows",
    "transformer_layers",
    "linear_module_names",
    "model_layout",
]

logger = logging.getLogger(__name__)

# ----------------------------------------------------------------------------------------------------------
# Process groups


def _share_cpu_threads(world_size: int) -> None:
    """Give each rank on this node its share of the cores, unless OMP_NUM_THREADS says otherwise.

    Several ranks each running torch's default (all cores) oversubscribe the CPU, and OpenMP's spinning
    threads then slow every step by an order of magnitude (seen here: 0.15 s -> 4.5 s per step).
    """
    local = local_world_size(world_size)
    if local > 1 and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // local))


def init_distributed(backend: str | None = None, *, tensor_model_parallel_size: int = 1,
                     pipeline_model_parallel_size: int = 1, virtual_pipeline_model_parallel_size: int | None = None,
                     context_parallel_size: int = 1, expert_model_parallel_size: int = 1,
                     expert_tensor_parallel_size: int | None = None, seed: int = 1234,
                     timeout_minutes: int = 30, cuda_graphs: bool = False) -> tuple[int, int, torch.device]:
    """Start torch.distributed and Megatron-Core's model-parallel groups; seed every RNG.

    Works under torchrun (RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT), under srun without torchrun
    (SLURM_PROCID/SLURM_STEP_NUM_TASKS/SLURM_LOCALID; MASTER_ADDR defaults to the step's first node,
    MASTER_PORT to one derived from the job id) and as a plain single process (world 1, a free port).
    ``backend`` defaults to NCCL when CUDA is available, else gloo (with the CPU shim installed).
    ``expert_model_parallel_size`` / ``expert_tensor_parallel_size`` (MoE): Megatron-Core's expert grid, expert TP x
    EP x expert DP x PP over the same ranks (expert TP null = the TP size). ``cuda_graphs`` (model
    cuda_graph_impl=transformer_engine): TE's RNG tracker and a side stream, as Megatron-LM's initialize sets them up
    for those graphs (megatron/graphs.py).
    Returns (rank, world_size, device).
    """
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    rank, world_size, local_rank, addr, port, launcher = dataclasses.astuple(launch_env())
    use_cuda = torch.cuda.is_available()
    backend = backend or ("nccl" if use_cuda else "gloo")
    if backend == "nccl" and not use_cuda:
        raise ValueError("init_distributed: backend 'nccl' needs CUDA; use backend='gloo' (or None) on the CPU")
    if use_cuda:
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        install_cpu_shim()
        _share_cpu_threads(world_size)
    model_parallel = tensor_model_parallel_size * pipeline_model_parallel_size * context_parallel_size
    if world_size % model_parallel:
        raise ValueError(f"tensor x pipeline x context parallel = {tensor_model_parallel_size} x "
                         f"{pipeline_model_parallel_size} x {context_parallel_size} does not divide "
                         f"world_size={world_size}")

    if not dist.is_initialized():
        timeout = timedelta(minutes=timeout_minutes)
        if world_size == 1 and launcher == "single process":
            # Nothing to rendezvous with: an in-process store, no port (a free port picked and then bound by
            # the TCP store can be taken in between: EADDRINUSE, seen once in a test run on the H200).
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        else:
            # torchrun: env:// (joins torchrun's agent store); srun: rank 0 hosts a TCP store.
            init_method = "env://" if launcher == "torchrun" else f"tcp://{addr}:{port}"
            if rank == 0:  # (a run that seems to hang here waits for ranks a leftover environment promised)
                logger.info("distributed: rank 0 of %d (%s) waits for the other ranks at %s:%s (up to %d min; "
                            "none coming? a leftover RANK / WORLD_SIZE / SLURM_* environment)", world_size, launcher,
                            addr, port, timeout_minutes)
            dist.init_process_group(backend=backend, init_method=init_method, rank=rank, world_size=world_size,
                                    timeout=timeout)
    elif dist.get_world_size() != world_size:
        raise RuntimeError(f"torch.distributed is already initialised with world {dist.get_world_size()}, "
                           f"launch environment says {world_size}")
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
        context_parallel_size=context_parallel_size, expert_model_parallel_size=expert_model_parallel_size,
        expert_tensor_parallel_size=expert_tensor_parallel_size, distributed_timeout_minutes=timeout_minutes)
    # Same seed on every data-parallel rank: weights are initialised identically there without a broadcast;
    # tensor-parallel ranks get their own stream through the tracker (seed + 2718 + tp_rank).
    torch.manual_seed(seed)
    if cuda_graphs:
        from fp8_recipes.megatron.graphs import graph_side_stream

        graph_side_stream()
    # (the CPU shim's version when there is no CUDA; for graphs TE's tracker, whose states a graph can register;
    # a fresh tracker each time, as in a fresh process, also after another run's in this one)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, te_rng_tracker=cuda_graphs, force_reset_rng=True)
    if rank == 0:
        expert_tp = parallel_state.get_expert_tensor_parallel_world_size()
        experts = (f", EP {expert_model_parallel_size} x expert TP {expert_tp}"
                   if expert_model_parallel_size > 1 or expert_tp != tensor_model_parallel_size else "")
        logger.info("distributed: %s, backend %s, world %d, TP %d, PP %d%s, CP %d%s, device %s", launcher, backend,
                    world_size, tensor_model_parallel_size, pipeline_model_parallel_size,
                    f" x VPP {virtual_pipeline_model_parallel_size}" if virtual_pipeline_model_parallel_size else "",
                    context_parallel_size, experts, device)
    return rank, world_size, device


def destroy_distributed() -> None:
    """Tear down Megatron-Core's groups and the default process group (safe to call twice), and its MoE metrics
    tracker: a process-wide record of the router's losses per layer, sized by the first MoE model's layer count, so a
    later run in the same process with more layers (a test chain, compare_recipes) would index past it."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

    destroy_moe_metrics_tracker()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------------------
# Model


def _as_dict(model_cfg: Any) -> dict:
    if isinstance(model_cfg, Mapping):
        return dict(model_cfg)
    try:  # an OmegaConf DictConfig; imported lazily so plain dicts need no omegaconf
        from omegaconf import OmegaConf
        return OmegaConf.to_container(model_cfg, resolve=True)  # type: ignore[return-value]
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"model config must be a mapping or DictConfig, got {type(model_cfg).__name__}") from e


def _check_linear_class(cls: type | None, base: type, what: str) -> None:
    if cls is not None and not (isinstance(cls, type) and issubclass(cls, base)):
        raise ValueError(f"{what}={cls!r} must be a subclass of megatron.core.tensor_parallel.{base.__name__}")


def _substitute_linears(spec, column_linear: type | None, row_linear: type | None,
                        core_attention: type | None = None):
    """Return a copy of a local GPT layer spec with linear_qkv/fc1 -> column_linear, linear_proj/fc2 -> row_linear
    (and the attention's core_attention -> core_attention). An MoE layer's routed experts (SequentialMLP's MLPs) and
    shared experts get the same classes; its router is left as it is (the plan keeps it BF16)."""
    layer = spec.submodules
    attn = layer.self_attention
    attn_sub = attn.submodules
    attn_sub = dataclasses.replace(attn_sub, linear_qkv=column_linear or attn_sub.linear_qkv,
                                   linear_proj=row_linear or attn_sub.linear_proj,
                                   core_attention=core_attention or attn_sub.core_attention)
    attn = dataclasses.replace(attn, submodules=attn_sub)
    layer = dataclasses.replace(layer, self_attention=attn, mlp=_substitute_mlp(layer.mlp, column_linear, row_linear))
    return dataclasses.replace(spec, submodules=layer)


def _substitute_mlp(mlp, column_linear: type | None, row_linear: type | None):
    """An MLP builder with its two linears replaced: a dense MLP, or each MLP inside an MoE layer's experts and
    shared experts. 0.19 builds them as functools.partial(builder, submodules=...); earlier versions use a
    ModuleSpec with .submodules. Handle both."""
    from megatron.core.transformer.mlp import MLPSubmodules

    def linears(sub):
        return dataclasses.replace(sub, linear_fc1=column_linear or sub.linear_fc1,
                                   linear_fc2=row_linear or sub.linear_fc2)

    sub = mlp.keywords["submodules"] if isinstance(mlp, functools.partial) else mlp.submodules
    if isinstance(sub, MLPSubmodules):
        sub = linears(sub)
    else:  # MoESubmodules: experts (SequentialMLP) and shared experts, each a partial over MLPSubmodules
        sub = dataclasses.replace(sub, **{k: _substitute_mlp(getattr(sub, k), column_linear, row_linear)
                                          for k in ("experts", "shared_experts") if getattr(sub, k) is not None})
    if isinstance(mlp, functools.partial):
        return functools.partial(mlp.func, *mlp.args, **{**mlp.keywords, "submodules": sub})
    return dataclasses.replace(mlp, submodules=sub)


def build_gpt_model(model_cfg: Any, *, column_linear: type | None = None, row_linear: type | None = None,
                    output_linear: type | None = None, core_attention: type | None = None, use_te_spec: bool = False,
                    params_dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                    config_overrides: Mapping[str, Any] | None = None, pre_process: bool = True,
                    post_process: bool = True, vp_stage: int | None = None,
                    init_seed: int | None = None,
                    layer_init: Callable[[int], contextlib.AbstractContextManager] | None = None) -> torch.nn.Module:
    """Build a Megatron-Core ``GPTModel`` from a ``model`` config group (dict or DictConfig).

    ``init_distributed`` must have run (the model reads TP size and groups from parallel_state).
    ``column_linear`` / ``row_linear`` replace ColumnParallelLinear (linear_qkv, linear_fc1) and
    RowParallelLinear (linear_proj, linear_fc2) in the local spec; ``output_linear`` re-classes the LM head
    and defaults to ``column_linear`` (pass ``ColumnParallelLinear`` itself to keep the head plain).
    ``core_attention`` replaces the local spec's DotProductAttention (the attention's ``core_attention``).
    ``model_cfg.vocab_size`` is padded up to a multiple of 128 × TP (logged when it changes).

    Returns the GPTModel for float32 params; for bfloat16 params a ``Float16Module`` wrapping it (``.module``
    is the GPTModel): its forward casts float inputs to bf16 and upcasts the per-token loss to fp32, and it
    is the only way all params (norms, embeddings) end up bf16 (docs/facts.md, "Megatron-Core on the CPU"). Use
    :func:`unwrap_model` to reach the GPTModel either way.

    ``use_te_spec=True`` (GPUs with Transformer Engine): linear_qkv / linear_fc1 become
    TELayerNormColumnParallelLinear (the input norm fused in, so the layer's own norms are IdentityOp) and
    linear_proj / linear_fc2 TERowParallelLinear, under the same names, so :func:`linear_module_names` and the
    plan's layout are those of the local spec; the LM head stays a ColumnParallelLinear. With
    ``gradient_accumulation_fusion: True`` among the overrides (TE spec only; the model must be wrapped in
    Megatron-Core's DDP, which gives each weight its ``main_grad``) the TE modules' weight-gradient GEMMs accumulate
    into ``main_grad``; without APEX Megatron-Core's own linears keep the plain wgrad. ``config_overrides``
    go into the TransformerConfig as they are (e.g. ``{"fp8": "hybrid", "fp8_recipe": "tensorwise"}`` for
    Megatron-Core's own FP8 path, which the benchmarks compare against, or the parallel layout:
    ``pipeline_model_parallel_size``, ``sequence_parallel``, ``recompute_granularity``, ...). ``pre_process`` /
    ``post_process`` / ``vp_stage``: which part of a pipeline-parallel model this is (:func:`build_model_chunks`).
    ``init_seed``: initialise independently of the pipeline layout (:func:`_layout_seeded`): the embedding from
    ``init_seed`` itself, each transformer layer from its own stream (by its global number), the LM head after the
    last layer, so a model has the same initial weights at any pipeline and virtual-pipeline size.
    ``layer_init``: a context per global (0-based) layer number, each TransformerLayer built inside its own (the TE
    backend's ``quantized_model_init`` for layers whose weights are stored in FP8: megatron/te_layers.py).
    """
    from megatron.core.transformer.module import Float16Module

    cfg = _as_dict(model_cfg)
    check_model_cfg(cfg)
    _check_build_args(column_linear, row_linear, output_linear, core_attention, use_te_spec, params_dtype)
    device = torch.device(device) if device is not None else (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
    vocab = _padded_vocab(cfg)
    config = _transformer_config(cfg, params_dtype, device, use_te_spec, config_overrides)
    if config.gradient_accumulation_fusion and not use_te_spec:
        raise ValueError("gradient_accumulation_fusion=True needs use_te_spec=True: the local spec's linears compute "
                         "their own weight gradients")
    spec = _layer_spec(config, use_te_spec, column_linear, row_linear, core_attention, vp_stage)
    with _megatron_linears_without_apex(config) as built:
        model = _seeded_gpt_model(config, spec, cfg, vocab, init_seed, layer_init, pre_process=pre_process,
                                  post_process=post_process, vp_stage=vp_stage)
        built.append(model)
    output_linear = output_linear or column_linear
    if output_linear is not None and post_process:
        replace_output_layer_class(model, output_linear)
    model.to(device)
    if params_dtype == torch.bfloat16:
        model = Float16Module(config, model)
    return model


@contextlib.contextmanager
def _megatron_linears_without_apex(config):
    """Build a model whose config has ``gradient_accumulation_fusion`` without APEX: the TE modules fuse (TE's wgrad
    GEMM accumulates into the weight's ``main_grad``), Megatron-Core's own linears (the plain LM head) cannot, as
    their fused wgrad is APEX's ``fused_weight_gradient_mlp_cuda``, which pip installs lack. Megatron-Core refuses
    such a linear at construction (megatron-core 0.19.2: ``ColumnParallelLinear.__init__`` raises; its forward
    reads ``self.gradient_accumulation_fusion``): it is built here, then set to the plain wgrad, which DDP's hook
    adds to ``main_grad``. Yields the list the built model is to be appended to."""
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import layers

    if not config.gradient_accumulation_fusion or layers._grad_accum_fusion_available:
        yield []
        return
    built: list[torch.nn.Module] = []
    layers._grad_accum_fusion_available = True
    try:
        yield built
    finally:
        layers._grad_accum_fusion_available = False
    plain = (tensor_parallel.ColumnParallelLinear, tensor_parallel.RowParallelLinear)
    for linear in (m for model in built for m in model.modules() if isinstance(m, plain)):
        linear.gradient_accumulation_fusion = False


def _check_build_args(column_linear: type | None, row_linear: type | None, output_linear: type | None,
                      core_attention: type | None, use_te_spec: bool, params_dtype: torch.dtype) -> None:
    """build_gpt_model's substitute classes (subclasses of the classes they replace, on the local spec only) and
    its params dtype."""
    from megatron.core import tensor_parallel

    _check_linear_class(column_linear, tensor_parallel.ColumnParallelLinear, "column_linear")
    _check_linear_class(row_linear, tensor_parallel.RowParallelLinear, "row_linear")
    _check_linear_class(output_linear, tensor_parallel.ColumnParallelLinear, "output_linear")
    if core_attention is not None:
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        allowed = (DotProductAttention, *_te_core_attention())
        if not (isinstance(core_attention, type) and issubclass(core_attention, allowed)):
            raise ValueError(f"core_attention={core_attention!r} must be a subclass of "
                             f"megatron.core.transformer.dot_product_attention.DotProductAttention (or, with "
                             f"Transformer Engine, megatron.core.extensions.transformer_engine.TEDotProductAttention)")
    if params_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"params_dtype={params_dtype}: use torch.float32 or torch.bfloat16")
    if use_te_spec and (column_linear or row_linear or core_attention):
        raise ValueError("column_linear/row_linear/core_attention apply to the local spec only: the TE spec fuses "
                         "the norm into linear_qkv/linear_fc1 (TELayerNormColumnParallelLinear) and builds TE's "
                         "attention; set use_te_spec=False")


def _te_core_attention() -> tuple[type, ...]:
    """(TEDotProductAttention,) where Transformer Engine imports, else ()."""
    from fp8_recipes.backends.te import te_available

    if not te_available():
        return ()
    from megatron.core.extensions.transformer_engine import TEDotProductAttention

    return (TEDotProductAttention,)


def _padded_vocab(cfg: dict) -> int:
    """model.vocab_size padded for the tensor-parallel size (logged once, by the first data-parallel rank)."""
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    vocab = pad_vocab_size(int(cfg["vocab_size"]), tp)
    if vocab != cfg["vocab_size"] and parallel_state.get_data_parallel_rank() == 0:
        logger.info("model.vocab_size %d -> %d (padded to a multiple of %d x TP %d)", cfg["vocab_size"], vocab,
                    VOCAB_MULTIPLE, tp)
    return vocab


def _transformer_config(cfg: dict, params_dtype: torch.dtype, device: torch.device, use_te_spec: bool,
                        config_overrides: Mapping[str, Any] | None):
    """Megatron-Core's TransformerConfig of a model config group, at parallel_state's layout, with the overrides."""
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer import TransformerConfig

    swiglu = cfg.get("activation", "gelu") == "swiglu"
    hidden = int(cfg["hidden_size"])
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    fields = dict(
        num_layers=int(cfg["num_layers"]),
        hidden_size=hidden,
        ffn_hidden_size=int(cfg.get("ffn_hidden_size") or 4 * hidden),
        num_attention_heads=int(cfg["num_attention_heads"]),
        num_query_groups=cfg.get("num_query_groups"),
        normalization=cfg.get("normalization", "LayerNorm"),
        gated_linear_unit=swiglu,
        activation_func=F.silu if swiglu else F.gelu,
        add_bias_linear=bool(cfg.get("add_bias_linear", False)),
        hidden_dropout=float(cfg.get("hidden_dropout", 0.0)),
        attention_dropout=float(cfg.get("attention_dropout", 0.0)),
        init_method_std=float(cfg.get("init_method_std", 0.02)),
        layernorm_epsilon=float(cfg.get("layernorm_epsilon", 1e-5)),
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        virtual_pipeline_model_parallel_size=vpp,
        # the interleaved schedule's p2p as Megatron-LM wires it (--overlap-p2p-communication, its default: overlap
        # on, batching off). Megatron-Core's own defaults batch both directions to PP=2's one peer on one
        # communicator, where an activation and a gradient sent together can cross once a step holds more
        # micro-batches than stages (gloo: PP=2 x VPP=2 at 4 micro-batches left PP=1's losses from step 1 on)
        overlap_p2p_comm=bool(vpp),
        batch_p2p_comm=not vpp,
        context_parallel_size=parallel_state.get_context_parallel_world_size(),
        expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
        expert_tensor_parallel_size=parallel_state.get_expert_tensor_parallel_world_size(),
        pipeline_dtype=params_dtype,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        # CPU: weights are created on the CPU (the GPU init path calls torch.cuda). On GPUs the CPU path would
        # also work (and makes init independent of TP) but takes minutes for an 8B-shaped model.
        use_cpu_initialization=device.type == "cpu",
        # Megatron-Core's fused kernels are CUDA (jit) or TE kernels: on the GPU they are what Megatron-LM runs by
        # default, and they matter for FP8's speed-up (unfused SwiGLU / residual adds cost 73 of 405 ms per step
        # of the 16-layer Llama-3-8B shape on an H200, the same in BF16 and FP8); on the CPU the plain paths.
        bias_activation_fusion=device.type == "cuda",
        masked_softmax_fusion=False,  # the local spec's softmax only; TE's attention is fused anyway
        bias_dropout_fusion=device.type == "cuda",
        # TE's fused RoPE, in the local spec too (the emulated backend's) wherever Megatron-Core imported it: unfused,
        # its muls, negation and cat took 7 of an emulated step's 11 ms above the TE spec's on 8 Llama-3-8B layers
        # (the H100, 2026-12-06)
        apply_rope_fusion=device.type == "cuda" and (
            use_te_spec or rope_utils.fused_apply_rotary_pos_emb is not None),
        cross_entropy_loss_fusion=device.type == "cuda",
        # TE's wgrad GEMMs into DDP's main_grad: the trainer's key (training/run.py) turns it on for the TE spec
        gradient_accumulation_fusion=False,
    )
    fields.update(moe_config_fields(cfg))
    fields.update(graph_config_fields(cfg))
    fields.update(config_overrides or {})
    if not (fields.get("fp8") or fields.get("fp4")):
        # Megatron-Core pads the routing map only under its own FP8 path (and refuses the key without it); under
        # ours the TE backend gives the dispatchers of FP8 experts that padding (megatron/te_layers.py)
        fields.pop("moe_router_padding_for_quantization", None)
    return TransformerConfig(**fields)


def _layer_spec(config, use_te_spec: bool, column_linear: type | None, row_linear: type | None,
                core_attention: type | None, vp_stage: int | None = None):
    """The transformer layer spec: Megatron-Core's TE spec, or its local spec with the substitute classes. An MoE model
    gets Megatron-Core's block spec (a layer spec per layer: MoE where ``moe_layer_freq`` puts experts, else dense)."""
    if config.num_moe_experts is not None:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        block = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te_spec,
                                           normalization=config.normalization,
                                           vp_stage=vp_stage)
        if column_linear or row_linear or core_attention:
            block = dataclasses.replace(block, layer_specs=[
                _substitute_linears(s, column_linear, row_linear, core_attention) for s in block.layer_specs])
        return block
    if use_te_spec:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
        return get_gpt_layer_with_transformer_engine_spec()
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    spec = get_gpt_layer_local_spec(normalization=config.normalization)
    if column_linear or row_linear or core_attention:
        spec = _substitute_linears(spec, column_linear, row_linear, core_attention)
    return spec


def _seeded_gpt_model(config, spec, cfg: dict, vocab: int, init_seed: int | None, layer_init: Callable | None, *,
                      pre_process: bool, post_process: bool, vp_stage: int | None) -> torch.nn.Module:
    """The GPTModel, its layers built from their own streams (init_seed) and in their layer_init contexts."""
    from megatron.core.models.gpt import GPTModel

    if init_seed is not None or layer_init is not None:
        if hasattr(spec, "layer_specs"):  # an MoE model's block spec: one spec per layer of this stage
            spec = dataclasses.replace(spec, layer_specs=[dataclasses.replace(
                s, module=_layout_seeded(s.module), submodules=_layout_seeded_experts(s.submodules))
                for s in spec.layer_specs])
        else:
            spec = dataclasses.replace(spec, module=_layout_seeded(spec.module))
    if init_seed is not None:
        _reseed(init_seed)
    # cuda_as_cpu: a tied LM head on the last of several stages is copied from the first with
    # `weight.data.cuda()` and an all-reduce (LanguageModule.setup_embeddings_and_output_layer); on the CPU the
    # copy stays where it is (a no-op context with CUDA)
    with _init_seed_for_layers(init_seed, layer_init), cuda_as_cpu():
        model = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=vocab,
            max_sequence_length=int(cfg["seq_length"]),
            pre_process=pre_process,
            post_process=post_process,
            vp_stage=vp_stage,
            parallel_output=True,  # the loss is computed on vocab shards (vocab_parallel_cross_entropy)
            share_embeddings_and_output_weights=bool(cfg.get("share_embeddings_and_output_weights", False)),
            position_embedding_type=cfg.get("position_embedding_type", "learned_absolute"),
            rotary_base=int(cfg.get("rotary_base", 10000)),
        )
    if init_seed is not None:  # the streams after the build as init_distributed left them (dropout, data order)
        _reseed(init_seed)
    return model


_LAYER_INIT_SEED: list[int | None] = [None]  # set while build_gpt_model(init_seed=...) builds a GPTModel
_LAYER_INIT_CONTEXT: list[Callable | None] = [None]  # set while build_gpt_model(layer_init=...) builds a GPTModel


@contextlib.contextmanager
def _init_seed_for_layers(seed: int | None, layer_init: Callable | None = None):
    _LAYER_INIT_SEED[0], _LAYER_INIT_CONTEXT[0] = seed, layer_init
    try:
        yield
    finally:
        _LAYER_INIT_SEED[0] = _LAYER_INIT_CONTEXT[0] = None


def _reseed(seed: int) -> None:
    """The default generators and Megatron's model-parallel RNG tracker, as init_distributed seeds them."""
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)  # the CPU shim's version when there is no CUDA


@functools.lru_cache(maxsize=None)
def _layout_seeded(layer_class: type) -> type:
    """``layer_class`` (Megatron-Core's TransformerLayer) initialising from a stream of its own: seeded by the build's
    seed and the layer's global number (local number + Megatron's layer offset for this stage and chunk), so its
    weights do not depend on which stage builds it or what was built before it. Megatron-Core draws a pipeline
    stage's weights in construction order (with CPU initialisation from the default generator, on GPUs from the
    model-parallel tracker), so without this PP=2 starts from other weights than PP=1. The layer is built inside
    ``build_gpt_model``'s ``layer_init`` context for its global number, when one is given."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    class LayoutSeededLayer(layer_class):
        def __init__(self, config, *args, **kwargs):
            seed, layer_init = _LAYER_INIT_SEED[0], _LAYER_INIT_CONTEXT[0]
            local = kwargs.get("layer_number", args[1] if len(args) > 1 else 1)
            offset = get_transformer_layer_offset(config, kwargs.get("vp_stage"),
                                                  ps.get_pipeline_model_parallel_rank())
            if seed is not None:
                _reseed(seed + 7919 * (local + offset))  # (a prime apart: no two layers share a stream)
            with layer_init(local + offset - 1) if layer_init is not None else contextlib.nullcontext():
                super().__init__(config, *args, **kwargs)

    LayoutSeededLayer.__name__ = LayoutSeededLayer.__qualname__ = layer_class.__name__
    return LayoutSeededLayer


def _layout_seeded_experts(layer_submodules):
    """A layer spec's submodules with an MoE layer's SequentialMLP experts drawn as at EP = 1
    (:func:`_layout_seeded_sequential_mlp`); anything else as it is."""
    mlp = layer_submodules.mlp
    moe = mlp.keywords.get("submodules") if isinstance(mlp, functools.partial) else getattr(mlp, "submodules", None)
    experts = getattr(moe, "experts", None)
    from megatron.core.transformer.moe.experts import SequentialMLP

    if not (isinstance(experts, functools.partial) and experts.func is SequentialMLP):
        return layer_submodules
    seeded = dataclasses.replace(moe, experts=functools.partial(_layout_seeded_sequential_mlp(), *experts.args,
                                                                **experts.keywords))
    mlp = (functools.partial(mlp.func, *mlp.args, **{**mlp.keywords, "submodules": seeded})
           if isinstance(mlp, functools.partial) else dataclasses.replace(mlp, submodules=seeded))
    return dataclasses.replace(layer_submodules, mlp=mlp)


@functools.lru_cache(maxsize=None)
def _layout_seeded_sequential_mlp() -> type:
    """Megatron-Core's SequentialMLP whose experts get the weights they get at EP = 1. With CPU initialisation every
    expert draws from the layer's stream in construction order, so at EP > 1 each EP rank's first local expert would
    draw what expert 0 draws: EP rank 1's experts would start as copies of EP rank 0's (seen at EP=2: experts 2 and 3
    equal to 0 and 1), and the shared expert after them from another place in the stream. The other EP ranks'
    experts are drawn here too and dropped (the init's cost of EP = 1, one expert's memory at a time). On GPUs
    Megatron-Core draws the experts from its expert-parallel RNG stream (seed + 1024 + 100 x EP rank): untouched."""
    import copy

    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.experts import SequentialMLP

    class LayoutSeededSequentialMLP(SequentialMLP):
        def __init__(self, num_local_experts, config, submodules, pg_collection=None, name=None):
            ep = getattr(pg_collection, "ep", None)
            size, rank = (ep.size(), ep.rank()) if ep is not None else (1, 0)
            drop = config.use_cpu_initialization and size > 1

            def draw(experts: int) -> None:
                mlp_config = copy.deepcopy(config)  # as SequentialMLP builds its experts
                mlp_config.ffn_hidden_size = config.moe_ffn_hidden_size
                for _ in range(experts):
                    MLP(mlp_config, submodules, ffn_hidden_size=config.moe_ffn_hidden_size, is_expert=True,
                        tp_group=pg_collection.expt_tp)

            if drop:
                draw(rank * num_local_experts)  # the lower EP ranks' experts
            super().__init__(num_local_experts, config, submodules, pg_collection=pg_collection, name=name)
            if drop:
                draw((size - rank - 1) * num_local_experts)  # the higher ones'

    LayoutSeededSequentialMLP.__name__ = LayoutSeededSequentialMLP.__qualname__ = SequentialMLP.__name__
    return LayoutSeededSequentialMLP


def build_model_chunks(model_cfg: Any, **kwargs: Any) -> list[torch.nn.Module]:
    """This rank's model chunks: one :func:`build_gpt_model` per virtual pipeline stage (one without interleaving),
    each with Megatron-Core's ``pre_process`` (embedding: the first stage's first chunk) and ``post_process`` (LM
    head and loss: the last stage's last chunk); GPTModel places each chunk's layers at Megatron's layer offset.
    ``kwargs`` go to :func:`build_gpt_model`."""
    from megatron.core import parallel_state as ps

    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        chunks.append(build_gpt_model(model_cfg, pre_process=ps.is_pipeline_first_stage(ignore_virtual=False,
                                                                                          vp_stage=stage),
                                      post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
                                      vp_stage=stage, **kwargs))
    return chunks


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside Float16Module / DDP-style wrappers (anything with a ``.module`` chain)."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def replace_output_layer_class(model: torch.nn.Module, cls: type) -> torch.nn.Module:
    """Re-class the GPTModel's LM head (``output_layer``, a ColumnParallelLinear) as ``cls`` in place.

    ``cls`` must subclass ColumnParallelLinear and be a subclass of the head's current class (so every
    attribute the parent's ``__init__`` set is there). ``cls.__init__`` is not run; if ``cls`` defines
    ``_after_class_swap(self)`` it is called. Returns the re-classed module.
    """
    from megatron.core import tensor_parallel

    gpt = unwrap_model(model)
    head = getattr(gpt, "output_layer", None)
    if head is None:
        raise ValueError("model has no output_layer (not the last pipeline stage?)")
    _check_linear_class(cls, tensor_parallel.ColumnParallelLinear, "output layer class")
    if not issubclass(cls, type(head)):
        raise ValueError(f"cannot re-class output_layer of type {type(head).__name__} as {cls.__name__}: "
                         f"{cls.__name__} must subclass {type(head).__name__}")
    head.__class__ = cls
    hook = getattr(head, "_after_class_swap", None)
    if callable(hook):
        hook()
    return head


_LINEAR_SUFFIXES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "output_layer")
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"(\.mlp\.experts\.local_experts\.)(\d+)(\.)"
                     r"|(\.mlp\.experts\.linear_fc[12]\.(?:weight|bias))(\d+)$")
"""A routed expert's number in a module or parameter name: SequentialMLP's ``.mlp.experts.local_experts.<i>.``, or
TE GroupedLinear's ``.mlp.experts.linear_fc1.weight<i>`` (its GEMM i); a shared expert's names have none."""


def expert_number(name: str) -> int | None:
    """The routed expert's number in ``name`` (local or global, as the name has it); None for any other name."""
    m = _EXPERT.search(name)
    return None if m is None else int(m.group(2) if m.group(1) else m.group(5))


def renumber_expert(name: str, new: Callable[[int], object]) -> str:
    """``name`` with its routed expert's number i replaced by ``new(i)`` (e.g. local -> global, or "*"); any other
    name as it is."""
    def sub(m: re.Match) -> str:
        if m.group(1):
            return f"{m.group(1)}{new(int(m.group(2)))}{m.group(3)}"
        return f"{m.group(4)}{new(int(m.group(5)))}"
    return _EXPERT.sub(sub, name, count=1)


def global_name(gpt: torch.nn.Module, name: str) -> str:
    """A (pipeline-stage, expert-parallel) GPTModel's module or parameter name with global numbers:
    ``decoder.layers.<local>.`` -> ``decoder.layers.<global>.`` (each TransformerLayer's ``layer_number`` is
    Megatron-Core's global 1-based number: local index + layer offset), and a routed expert's number (see
    :data:`_EXPERT`) local -> global (MoELayer's ``local_expert_indices``: the experts this expert-parallel rank
    holds)."""
    m = _LAYER.match(name)
    if m is None:
        return name
    layer = gpt.decoder.layers[int(m.group(1))]
    out = f"decoder.layers.{layer.layer_number - 1}.{name[m.end():]}"
    return renumber_expert(out, lambda i: layer.mlp.local_expert_indices[i])


def named_linear_modules(model: torch.nn.Module | list[torch.nn.Module]) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) for every GEMM-bearing linear (attention qkv/proj, MLP fc1/fc2, each expert's and shared
    expert's fc1/fc2, LM head), in execution order. An MoE router is not one of them (the plan keeps it BF16).

    ``model``: a GPTModel (any wrappers) or this rank's list of model chunks. Names are relative to the GPTModel
    (any Float16Module / DDP ``module.`` prefix dropped) with **global** layer and expert numbers, e.g.
    ``decoder.layers.5.self_attention.linear_qkv`` on a pipeline stage whose first layer is 4, ``output_layer``.
    (``named_modules`` alone lists ``linear_proj`` before ``linear_qkv``: the attention base class registers it
    first.)
    """
    if isinstance(model, (list, tuple)):
        return [item for chunk in model for item in named_linear_modules(chunk)]
    gpt = unwrap_model(model)
    found = [(global_name(gpt, name), mod) for name, mod in gpt.named_modules()
             if name.rsplit(".", 1)[-1] in _LINEAR_SUFFIXES]
    # in the plan's order (ModelLayout.gpt: the order they run; a grouped expert linear where its first expert's
    # row is); a name the plan lacks sorts last, for the backends' attach check to name it
    order = {name: i for i, name in enumerate(model_layout(gpt).module_names)}
    first_row = {name: rows[0] for name, rows in grouped_expert_rows(gpt).items()}
    return sorted(found, key=lambda item: order.get(first_row.get(item[0], item[0]), len(order)))


def grouped_expert_rows(model: torch.nn.Module | list[torch.nn.Module]) -> dict[str, tuple[str, ...]]:
    """The plan rows of each grouped expert linear (Megatron-Core's TEGroupedMLP with ``moe_grouped_gemm: true``:
    one TE GroupedLinear per MoE layer and fc, ``decoder.layers.<L>.mlp.experts.linear_fc1``, running one GEMM per
    local expert): its name -> the rows of the experts it runs, ``...mlp.experts.local_experts.<E>.linear_fc1``
    with global expert numbers (MoELayer's ``local_expert_indices``), in GEMM order. Empty for SequentialMLP
    experts, whose linears are plan rows themselves."""
    if isinstance(model, (list, tuple)):
        return {k: v for chunk in model for k, v in grouped_expert_rows(chunk).items()}
    gpt, out = unwrap_model(model), {}
    for layer in gpt.decoder.layers:
        experts = getattr(getattr(layer, "mlp", None), "experts", None)
        if experts is None or hasattr(experts, "local_experts"):
            continue
        prefix = f"decoder.layers.{layer.layer_number - 1}.mlp.experts"
        for fc in ("linear_fc1", "linear_fc2"):
            if getattr(experts, fc, None) is not None:
                out[f"{prefix}.{fc}"] = tuple(f"{prefix}.local_experts.{e}.{fc}"
                                              for e in layer.mlp.local_expert_indices)
    return out


def transformer_layers(model: torch.nn.Module | list[torch.nn.Module]) -> dict[int, torch.nn.Module]:
    """This rank's TransformerLayers by global 0-based layer number (all chunks)."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    return {layer.layer_number - 1: layer for chunk in chunks for layer in unwrap_model(chunk).decoder.layers}


def linear_module_names(model: torch.nn.Module | list[torch.nn.Module]) -> list[str]:
    """Names of the linear modules a precision plan decides on (see :func:`named_linear_modules`)."""
    return [name for name, _ in named_linear_modules(model)]


def model_layout(model: torch.nn.Module | list[torch.nn.Module]):
    """The plan's view of a built GPTModel (local or TE spec): the whole model's transformer layers, linear names and
    MoE experts, whichever pipeline stage or expert-parallel rank ``model`` is (the plan spans them: its names are
    global)."""
    first = model[0] if isinstance(model, (list, tuple)) else model
    return config_layout(unwrap_model(first).config)
