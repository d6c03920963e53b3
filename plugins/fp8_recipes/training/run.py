"""One training run from a composed config: recipe -> plan -> model + backend -> data -> loop -> outputs.

    scripts/train.py (Hydra) -> run_training(cfg) -> summary dict

Every user error (bad recipe, impossible backend, missing data) surfaces as a ValueError with one line that
names the key; scripts/train.py prints it and exits 2.

This module imports torch and Megatron-Core only inside the functions that build (the model, the backends, the
engine, the loop): run_training checks the whole config before they load, so a typo costs a second, and the Slurm
launcher (launch/job.py) and the CLI import resolve_recipe / quiet_third_party_logs from here on hosts that never
train.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fp8_recipes.checks import ConfigError
from fp8_recipes.launcher import launch_rank
from fp8_recipes.megatron.data import (build_gpt_datasets, data_parallel_batches, fixed_batches, prepare_dataset,
                                       split_samples)
from fp8_recipes.megatron.model_config import (check_model_device, graph_config_fields, graphs_on, layout_of,
                                               linear_shapes, model_notices, run_model_cfg)
from fp8_recipes.observe.autopilot_config import autopilot_config
from fp8_recipes.observe.config import debug_config
from fp8_recipes.plan.precision import Execution, Hardware, ModelLayout, ParallelLayout, PrecisionPlan
from fp8_recipes.plan.format import format_plan
from fp8_recipes.plan.te import TE_FP8_ALIGN, te_fp8_shape_problem
from fp8_recipes.recipe.pack import EMPTY_RECIPE, load_recipe
from fp8_recipes.rundir import PLAN, RECIPE, check_run_dir, claim, drop_rows_after, release, write_text
from fp8_recipes.recipe.schema import AmaxReduction, Attention, Backend, RecipeError, Role, Scaling
from fp8_recipes.training.autopilot import AutopilotPrecision, autopilot_notices, check_autopilot, statistics_for
from fp8_recipes.training.config import check_compile_caches, check_run_config, check_writable_dir
from fp8_recipes.training.errors import CheckpointWriteError, NonFiniteStop
from fp8_recipes.training.notices import run_notices

__all__ = ["check_plan", "resolve_autopilot", "resolve_debug", "resolve_recipe", "run_training"]

logger = logging.getLogger("fp8_recipes")


def resolve_recipe(cfg) -> Any:
    """The run's Recipe: `cfg.recipe` as composed by Hydra (+recipe=NAME and overrides), BF16 when absent."""
    from omegaconf import OmegaConf

    node = cfg.get("recipe") if hasattr(cfg, "get") else None
    if node is None:
        return load_recipe("bf16")
    data = OmegaConf.to_container(node, resolve=True) if not isinstance(node, dict) else node
    if not data:
        raise ConfigError(f"recipe: {EMPTY_RECIPE}")
    with _recipe_keys():
        return load_recipe(data)


def _plain(node):
    """A config section as plain data (resolved), or the value itself when it is none."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node


def resolve_debug(cfg):
    """The run's DebugConfig (numerics statistics, dumps): the recipe's `debug` section under the run config's."""
    recipe = cfg.get("recipe") if hasattr(cfg, "get") else None
    recipe_debug = recipe.get("debug") if hasattr(recipe, "get") else None
    return debug_config(_plain(recipe_debug), _plain(cfg.get("debug") if hasattr(cfg, "get") else None))


def resolve_autopilot(cfg):
    """The run's AutopilotConfig: the run config's ``autopilot`` section (absent or ``enabled: false``: off)."""
    return autopilot_config(_plain(cfg.get("autopilot") if hasattr(cfg, "get") else None))


def _observe(precision, debug, run_dir: Path, rank: int, backend, sequence_parallel: bool = False):
    """Attach the numerics recorder when the run's `debug` section asks: (precision to train with, recorder).
    The emulated backend's per-module states carry the observer slot; on TE, hooks on each TE linear do
    (backends/te_observe.py)."""
    if not debug.enabled:
        return precision, None
    from fp8_recipes.observe.recorder import NumericsRecorder, ObservedPrecision, ShardGroups  # torch (docstring)

    if str(backend) == "te":
        from fp8_recipes.backends.te_observe import te_observer_states  # torch (module docstring)

        states = te_observer_states(precision)
    else:
        states = precision.states
    from megatron.core import parallel_state as ps

    # the first rank of each pipeline stage writes that stage's rows (its modules): each operand's statistics merged
    # over the tensor- and context-parallel ranks that hold its other parts, of the first data-parallel rank's share
    # of the batch
    shards = ShardGroups(
        tensor=ps.get_tensor_model_parallel_group() if ps.get_tensor_model_parallel_world_size() > 1 else None,
        context=ps.get_context_parallel_group() if ps.get_context_parallel_world_size() > 1 else None,
        sequence_parallel=sequence_parallel,
        expert_tensor=ps.get_expert_tensor_parallel_group() if ps.get_expert_tensor_parallel_world_size() > 1 else None,
        experts=ps.get_expert_model_parallel_group() if ps.get_expert_model_parallel_world_size() > 1 else None)
    pp = ps.get_pipeline_model_parallel_world_size()
    recorder = NumericsRecorder(debug, run_dir, write=_first_of_stage(),
                                stage=ps.get_pipeline_model_parallel_rank() if pp > 1 else None, shards=shards)
    recorder.attach(states)
    return ObservedPrecision(precision, recorder), recorder


def _first_of_stage() -> bool:
    """Whether this rank writes its pipeline stage's statistics: the first data-, tensor- and context-parallel one."""
    from megatron.core import parallel_state as ps

    return (ps.get_data_parallel_rank() == 0 and ps.get_tensor_model_parallel_rank() == 0
            and ps.get_context_parallel_rank() == 0)


def _route(precision, chunks, run_dir: Path):
    """An MoE model's routing statistics (observe/routing.py), written by the first data-, tensor- and
    context-parallel rank of each pipeline stage, its counts summed over the expert-parallel group at EP > 1:
    (precision to train with, recorder or None)."""
    from megatron.core import parallel_state as ps

    from fp8_recipes.megatron.model import transformer_layers  # torch and Megatron-Core (module docstring)
    from fp8_recipes.observe.recorder import ObservedPrecision
    from fp8_recipes.observe.routing import RoutingRecorder

    group = ps.get_expert_model_parallel_group() if ps.get_expert_model_parallel_world_size() > 1 else None
    routing = RoutingRecorder.attach(transformer_layers(chunks), run_dir, write=_first_of_stage(), group=group)
    return (precision, None) if routing is None else (ObservedPrecision(precision, routing), routing)


def _graphs_route(model) -> bool:
    """Whether CUDA graphs capture the router (model cuda_graph_modules moe or moe_router): then no routing statistics
    are recorded (their hook copies each step's token counts to the host, which a capture cannot hold)."""
    if not graphs_on(model) or not model.get("num_moe_experts"):
        return False
    return bool({"moe", "moe_router"} & set(graph_config_fields(model)["cuda_graph_modules"]))


@contextlib.contextmanager
def _recipe_keys():
    """Recipe problems name their keys as Hydra's command line does: `recipe.<key>`."""
    try:
        yield
    except RecipeError as e:
        raise RecipeError([f"recipe.{p}" for p in e.problems]) from None


def torch_dtype(name: str) -> "torch.dtype":
    import torch

    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if name not in table:
        raise ConfigError(f"trainer.params_dtype: {name!r} is not one of float32 | bfloat16")
    return table[name]


def quiet_third_party_logs() -> None:
    """Keep the console for our plan, progress and results: Megatron-Core's dataset chatter, its GPTModel
    deprecation notice and experimental-API notices, "Apex is not installed", torch's "No CUDA runtime is found"
    on a CPU machine, matplotlib's font cache and the CPU shim's list of patches say nothing a user of this tool
    can act on."""
    import warnings

    logging.getLogger("megatron").setLevel(logging.ERROR)
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    logging.getLogger("fp8_recipes.megatron.cpu_shim").setLevel(logging.WARNING)
    for msg in ("Apex is not installed", "Transformer Engine and Apex are not installed", "full scope is deprecated",
                "is experimental and still under active development"):
        warnings.filterwarnings("ignore", message=f".*{msg}.*")


ENGINE_CONFIG_KEYS = ("sequence_parallel", "recompute_granularity", "recompute_method", "recompute_num_layers")
"""Trainer keys that go into Megatron-Core's TransformerConfig under the same names (the parallel sizes come from
parallel_state, set by init_distributed)."""


def engine_config_overrides(trainer, te: bool = False) -> dict:
    """The TransformerConfig fields of a TrainerConfig (ENGINE_CONFIG_KEYS); on the TE backend (``te``) also
    ``gradient_accumulation_fusion`` (on unless the trainer sets it false: the engine's DDP gives every weight its
    ``main_grad``)."""
    fields = {key: getattr(trainer, key) for key in ENGINE_CONFIG_KEYS}
    if te:
        fields["gradient_accumulation_fusion"] = trainer.gradient_accumulation_fusion is not False
    return fields


def attach_emulated(model_cfg: dict, recipe, hardware, params_dtype: torch.dtype, device: torch.device,
                    config_overrides: dict | None = None, init_seed: int | None = None):
    """Megatron-Core's local spec with plan-driven fake-quantized linears and core attention (any device, any
    recipe): this rank's model chunks, the whole model's plan, and the backend driving this rank's part of it."""
    # torch and Megatron-Core (module docstring)
    from fp8_recipes.megatron.emulated_layers import (
        EmulatedColumnParallelLinear, EmulatedDotProductAttention, EmulatedRowParallelLinear, attach_emulated_backend,
    )
    from fp8_recipes.megatron.model import build_model_chunks, model_layout

    chunks = build_model_chunks(model_cfg, params_dtype=params_dtype, device=device,
                                column_linear=EmulatedColumnParallelLinear, row_linear=EmulatedRowParallelLinear,
                                core_attention=_core_attention(recipe, device, EmulatedDotProductAttention),
                                config_overrides=config_overrides, init_seed=init_seed)
    plan = PrecisionPlan(recipe, model_layout(chunks), hardware)
    return chunks, plan, attach_emulated_backend(chunks, plan, seed=init_seed or 0)


def _core_attention(recipe, device: torch.device, emulated: type) -> type:
    """The emulated backend's core attention: `emulated` (Megatron-Core's local, unfused softmax(Q K^T) V, with
    FP8 attention's quantization points) on the CPU, without TE, or when the recipe runs attention in FP8; else
    TE's fused attention (TEDotProductAttention: flash or cuDNN kernels, BF16, as the TE backend's runs use)."""
    import torch

    from fp8_recipes.backends.te import te_available

    if recipe.attention is Attention.FP8 or torch.device(device).type != "cuda" or not te_available():
        return emulated
    from megatron.core.extensions.transformer_engine import TEDotProductAttention

    return TEDotProductAttention


def attach_te(model_cfg: dict, recipe, hardware, params_dtype: torch.dtype, device: torch.device,
              config_overrides: dict | None = None, init_seed: int | None = None):
    """Megatron-Core's TE layer spec (no fp8 in its config) under per-layer te.autocast from the plan; with recipe
    ``fp8_param: true`` the plan's FP8 layers built with FP8-stored weights."""
    # torch and Megatron-Core (module docstring)
    from fp8_recipes.megatron.model import build_model_chunks
    from fp8_recipes.megatron.te_layers import FP8ParamInit, attach_te_backend

    plan = PrecisionPlan(recipe, layout_of(model_cfg), hardware)
    fp8_param = FP8ParamInit(plan) if recipe.fp8_param else None
    chunks = build_model_chunks(model_cfg, use_te_spec=True, params_dtype=params_dtype, device=device,
                                config_overrides=config_overrides, init_seed=init_seed, layer_init=fp8_param)
    return chunks, plan, attach_te_backend(chunks, plan, recipes=fp8_param.recipes if fp8_param else None,
                                           router_padding=bool(model_cfg.get("moe_router_padding_for_quantization")))


VALID_SEED_OFFSET = 1000
"""The validation stream's seed is the trainer's seed + this (its own order, the same at every evaluation)."""


def valid_seed(trainer) -> int:
    return int(trainer.seed) + VALID_SEED_OFFSET


def run_datasets(cfg, data_dir: Path, data_parallel_size: int):
    """(train, valid) datasets of a run as training builds them: the sample counts its steps, evaluations and
    data-parallel size ask for (training/evaluate.py rebuilds a run's validation batches with it)."""
    trainer = cfg.trainer
    n_train = int(trainer.max_steps) * int(trainer.global_batch_size)
    n_valid = (int(trainer.max_steps) // max(int(trainer.eval_interval), 1) + 1) * int(trainer.eval_iters) * \
        int(trainer.micro_batch_size) * data_parallel_size
    train_ds, valid_ds, _ = build_gpt_datasets(data_dir, int(cfg.model.seq_length), int(trainer.seed),
                                               (n_train, n_valid, None), split=cfg.data.split)
    return train_ds, valid_ds


MAX_VALID_PASSES = 10
"""Validation micro-batches past this many passes over the valid split are refused: after one pass each further one
evaluates the same samples again (``trainer.eval_iters=100000`` over a split of 16 micro-batches is a mistake, and
would take 6,000 passes at every evaluation)."""


def validation_batches(cfg, valid_ds, count: int, dp_rank: int, dp_size: int, *, key: str, per_rank: bool,
                       warn: bool):
    """This rank's share of the first ``count`` micro-batches of the run's validation stream (dealt out round robin
    over ``dp_size`` data-parallel ranks), the same at every evaluation, loaded when read. ``key``: the setting that
    said how many, per data-parallel rank with ``per_rank`` (trainer.eval_iters) or in all (eval_checkpoint's
    --eval-iters). More than one pass over the valid split is a warning (with ``warn``: say it once), more than
    MAX_VALID_PASSES a one-line ConfigError naming ``key`` and the split's size."""
    mbs, ranks = int(cfg.trainer.micro_batch_size), dp_size if per_rank else 1
    samples = split_samples(valid_ds) if count else 0
    holds = max(samples // mbs, 1)  # (a split of less than one micro-batch: Megatron-Core repeats it to make one)
    split = (f"the valid split of {cfg.data.path} (data.split={cfg.data.split}) holds {samples:,} samples of "
             f"{cfg.model.seq_length} tokens, {holds:,} micro-batches of {mbs}")
    asked = f"{count // ranks:,}" + ("" if ranks == 1 else f" x {ranks} data-parallel ranks")
    if count > MAX_VALID_PASSES * holds:
        raise ConfigError(f"{key}: {asked} micro-batches is more than {MAX_VALID_PASSES} passes over the validation "
                          f"data: {split}; set {key}={max(MAX_VALID_PASSES * holds // ranks, 1)} or less, or give the "
                          f"valid split a larger share of data.split")
    if count > holds and warn:
        logger.warning("%s: %s micro-batches re-use the validation data (each sample up to %d times): %s; %s=%d "
                       "evaluates each once", key, asked, -(-count // holds), split, key, max(holds // ranks, 1))
    return fixed_batches(valid_ds, mbs, valid_seed(cfg.trainer), count, dp_rank, dp_size)


def check_engine_backend(trainer, backend) -> None:
    """Sequence and context parallelism need Transformer Engine's layers: Megatron-Core's local spec builds torch
    norms, which refuse sequence parallelism, and its attention has no context parallelism; the precision-aware
    optimizer needs Transformer Engine's FusedAdam."""
    if backend is Backend.TE:
        return
    for key, on in (("sequence_parallel", trainer.sequence_parallel),
                    ("context_parallel_size", trainer.context_parallel_size > 1),
                    ("use_precision_aware_optimizer", trainer.use_precision_aware_optimizer)):
        if on:
            value = "true" if isinstance(getattr(trainer, key), bool) else getattr(trainer, key)
            raise ConfigError(f"trainer.{key}={value} needs Transformer Engine (the te backend, on an FP8 GPU); the "
                             f"{backend} backend builds Megatron-Core's local layers and torch's AdamW: unset it here")


def _runs_on_te(plan) -> bool:
    return plan.backend is Backend.TE and plan.te is not None and not plan.te.unsupported


def _delayed_on_te(plan) -> bool:
    """Whether Transformer Engine runs delayed scaling for some role of the plan."""
    return _runs_on_te(plan) and any(p.scaling is Scaling.DELAYED for res in plan.te_resolutions
                                     for p in res.policies.values())


def check_sequence_parallel_amax(trainer, plan) -> None:
    """Sequence parallelism with delayed scaling on TE: the recipe's ``amax_reduction`` must span the tensor-parallel
    ranks. TE all-gathers a sequence-parallel input (and a row-parallel layer's output gradient) as FP8 bytes quantized
    on each rank with its own delayed scale and dequantizes them all with the local one ("Assume scaling factors are
    identical across ranks", TE's ``_all_gather_fp8``). ``none`` fails TE's assertion at the first FP8 forward
    ("Amax reduction across tensor parallel group is necessary when using sequence parallelism with FP8"; not raised
    for a CustomRecipe, which then runs wrong silently), ``data`` passes it and runs wrong silently."""
    if not getattr(trainer, "sequence_parallel", False) or not _delayed_on_te(plan) \
            or plan.recipe.amax_reduction in (AmaxReduction.DATA_TENSOR, AmaxReduction.TENSOR):
        return
    raise RecipeError([(f"recipe.amax_reduction: {plan.recipe.amax_reduction!s} with delayed scaling and "
                       f"trainer.sequence_parallel=true: Transformer Engine all-gathers sequence-parallel FP8 tensors "
                       f"assuming one scale on every tensor-parallel rank; set recipe.amax_reduction: data_tensor (or "
                       f"tensor), or trainer.sequence_parallel=false")])


def check_recompute(trainer, plan) -> None:
    """Activation recompute on TE where its recompute would not replay the forward's FP8. The model is built without
    ``fp8`` in its config, so Megatron-Core recomputes through ``tensor_parallel.checkpoint``, not TE's
    ``te_checkpoint`` (recompute.py / transformer_layer.py pick it only under ``config.fp8``): no FP8 recompute phase.
    Full recompute with delayed scaling: each recomputed layer's autocast is the outermost one in the backward, so its
    exit reduces and rolls every forward amax history again, the replay records its amaxes a second time and quantizes
    with the scales updated since the forward. Selective recompute (core attention) with FP8 attention: the recompute
    runs outside every autocast, so the attention is recomputed in BF16 under an FP8 forward."""
    granularity = getattr(trainer, "recompute_granularity", None)
    if granularity is None or not _runs_on_te(plan):
        return
    if granularity == "full" and _delayed_on_te(plan):
        raise RecipeError([("trainer.recompute_granularity=full with delayed scaling on Transformer Engine: the "
                           "recomputed layers would reduce and roll the amax histories again and quantize with other "
                           "scales than their forward; use tensorwise or blockwise scaling, or "
                           "trainer.recompute_granularity=null")])
    if granularity == "selective" and plan.recipe.attention is Attention.FP8:
        raise RecipeError([("trainer.recompute_granularity=selective with recipe attention: fp8 on Transformer Engine: "
                           "the core attention would be recomputed in BF16 under an FP8 forward; set "
                           "trainer.recompute_granularity=null (or full), or recipe attention: bf16")])


def check_graphs(trainer, model, plan) -> None:
    """Model ``cuda_graph_impl: transformer_engine`` (megatron/graphs.py): what the graphs cannot hold, refused in one
    line before anything is built. They capture TE-spec layers under one TE recipe (the plan's last stage: no
    ``modules:`` policy or BF16 pattern inside a layer), replay it as captured (no BF16 fallback), and capture no
    recompute, FP8-stored weights, FP8 experts at EP > 1 (their amaxes reduce over a group of their own), or other
    activations than BF16 (the static inputs Megatron-Core builds)."""
    if not graphs_on(model):
        return
    off = "or set model.cuda_graph_impl=none"
    if plan.backend is not Backend.TE:
        raise ConfigError(f"model.cuda_graph_impl=transformer_engine: the graphs capture Transformer Engine's layers "
                          f"and this run is on the {plan.backend} backend ({plan.backend_reason}); train on TE, {off}")
    fp8 = _runs_on_te(plan) and any(plan.recipe.policy(r).is_fp8 for r in Role)
    problem = plan.at(plan.stages()[-1][0]).graph_problem(range(plan.layout.num_layers)) if fp8 else None
    for bad, line in (
            (problem, f"{problem}; give the graphed layers one recipe, {off}"),
            (fp8 and trainer.on_nonfinite == "skip_then_bf16",
             "trainer.on_nonfinite=skip_then_bf16: the BF16 fallback cannot run under CUDA graphs, which replay the "
             f"FP8 layers as captured; set trainer.on_nonfinite=stop, {off}"),
            (trainer.recompute_granularity is not None,
             f"trainer.recompute_granularity={trainer.recompute_granularity}: activation recompute under CUDA graphs "
             f"is not supported here; set trainer.recompute_granularity=null, {off}"),
            (fp8 and plan.recipe.fp8_param,
             f"recipe fp8_param: true: FP8-stored weights under CUDA graphs are not supported here; set recipe "
             f"fp8_param: false, {off}"),
            (trainer.expert_model_parallel_size > 1 and fp8,
             f"trainer.expert_model_parallel_size={trainer.expert_model_parallel_size} with an FP8 recipe: the "
             f"experts run under an autocast of their own (their amaxes reduce over the ranks holding them), which a "
             f"layer's graph cannot hold; set trainer.expert_model_parallel_size=1, {off}"),
            (str(trainer.params_dtype) not in ("bf16", "bfloat16"),
             f"trainer.params_dtype={trainer.params_dtype}: Megatron-Core's graphs take BF16 activations (their "
             f"static inputs are BF16); set trainer.params_dtype=bf16, {off}"),
            ("expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
             and os.environ.get("NCCL_GRAPH_REGISTER") != "0",
             f"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True needs NCCL_GRAPH_REGISTER=0 with CUDA graphs "
             f"(Megatron-Core: illegal memory accesses otherwise); export NCCL_GRAPH_REGISTER=0, {off}")):
        if bad:
            raise ConfigError(f"model.cuda_graph_impl=transformer_engine: {line}")


def check_graph_observers(model, debug, autopilot) -> None:
    """Statistics and the autopilot read the linears' forwards through hooks, which a CUDA graph's replay does not
    call (and a capture cannot hold their host copies): refused in one line with model cuda_graph_impl."""
    if not graphs_on(model):
        return
    if autopilot is not None and autopilot.enabled:
        raise ConfigError("autopilot: it reads and changes the linears' numerics, which CUDA graphs replay as "
                          "captured; set autopilot=off or model.cuda_graph_impl=none")
    if debug is not None and debug.enabled:
        raise ConfigError("debug: numerics statistics read each linear's forward, which a CUDA graph replays without "
                          "calling it; set debug.interval=0 (and no dump steps) or model.cuda_graph_impl=none")


def check_moe_statistics(trainer, model, debug) -> None:
    """Numerics statistics (``debug``) of an MoE model under context parallelism: each context-parallel rank's experts
    see its own tokens, so the recorder would fold them as it folds expert-parallel ranks' (an expert without a
    token on one rank), but context parallelism needs Transformer Engine's layers and no run has shown it: refused in
    one line. Expert parallelism and expert tensor parallelism are merged (observe/recorder.ShardGroups)."""
    if debug is None or not debug.enabled or model.get("num_moe_experts") is None:
        return
    if trainer.context_parallel_size > 1:
        raise ConfigError(f"debug: numerics statistics of an MoE model at trainer.context_parallel_size="
                          f"{trainer.context_parallel_size} are not measured yet; set debug.interval=0 (and "
                          f"autopilot=off, which records them), or train at trainer.context_parallel_size=1")


def check_grouped_experts(model, plan) -> None:
    """Model ``moe_grouped_gemm: true`` on the te backend: a layer's experts share one TE recipe at every stage (one
    GroupedLinear runs them), refused in one line before anything is built where the plan splits them."""
    problem = plan.grouped_experts_problem() if model.get("moe_grouped_gemm") else None
    if problem is not None:
        raise ConfigError(f"recipe: {problem}")


def check_fp8_param(trainer, plan) -> None:
    """Recipe ``fp8_param: true``: refused in one line, before anything is built, where the plan cannot store the
    weights in FP8 (the emulated backend, ...: ``PrecisionPlan.fp8_param_problem``) or the trainer lacks what
    Megatron-Core's FP8 weights need (its distributed optimizer, BF16 params)."""
    if not plan.recipe.fp8_param:
        return
    problem = plan.fp8_param_problem()
    if problem is not None:
        raise RecipeError([f"recipe.{problem}"])
    if not plan.fp8_param_layers():
        return
    if not trainer.use_distributed_optimizer:
        raise ConfigError("trainer.use_distributed_optimizer=false: recipe fp8_param: true needs Megatron-Core's "
                         "distributed optimizer (it re-quantizes the FP8 weights from its fp32 main params); set "
                         "trainer.use_distributed_optimizer=true")
    if str(trainer.params_dtype) not in ("bf16", "bfloat16"):
        raise ConfigError(f"trainer.params_dtype={trainer.params_dtype}: recipe fp8_param: true stores the FP8 layers' "
                         f"weights as FP8 tensors standing for BF16 ones; set trainer.params_dtype=bf16")


_FEATURE_KEYS = {"self_attention.linear_qkv": "model.hidden_size, num_attention_heads and num_query_groups",
                 "self_attention.linear_proj": "model.hidden_size",
                 "mlp.linear_fc1": "model.hidden_size and ffn_hidden_size",
                 "mlp.linear_fc2": "model.hidden_size and ffn_hidden_size", "output_layer": "model.hidden_size",
                 "mlp.experts.linear_fc1": "model.hidden_size and moe_ffn_hidden_size",
                 "mlp.experts.linear_fc2": "model.hidden_size and moe_ffn_hidden_size",
                 "mlp.shared_experts.linear_fc1": "model.hidden_size and moe_shared_expert_intermediate_size",
                 "mlp.shared_experts.linear_fc2": "model.hidden_size and moe_shared_expert_intermediate_size"}


def _te_gemms(plan, step_plan, module) -> frozenset[str]:
    """The GEMMs Transformer Engine runs in FP8 for `module` in this stage: the plan's, on TE; on the emulated backend
    (which fake-quantizes any GEMM with an FP8 operand) what TE would run of the same stage: FP8 once weights and
    activations both are, the backward GEMMs once gradients are too (plan.te.te_recipe_for)."""
    if _runs_on_te(plan):
        return frozenset(str(g) for g, p in module.gemms.items() if p.execution is not Execution.BF16)
    if module.bf16_reason is not None or not {Role.WEIGHTS, Role.ACTIVATIONS} <= step_plan.roles_fp8:
        return frozenset()
    return frozenset({"fprop", "dgrad", "wgrad"} if Role.GRADIENTS in step_plan.roles_fp8 else {"fprop"})


def check_fp8_shapes(trainer, model, plan) -> str | None:
    """The plan's FP8 linear layers whose shapes Transformer Engine's FP8 GEMMs refuse (plan.te.TE_FP8_ALIGN), in
    the stages the run reaches, found before anything is built: TE and cuBLAS fail on them only at the first FP8
    forward or backward, which a BF16 warmup can put hours into the run. Refused on TE. The emulated backend has no
    such limit, so there the same line comes back as a warning to print (the run would stop on TE); None when
    every FP8 layer fits."""
    tp, sp = trainer.tensor_model_parallel_size, bool(getattr(trainer, "sequence_parallel", False))
    shapes = linear_shapes(model, micro_batch=trainer.micro_batch_size, tensor_parallel=tp,
                           context_parallel=trainer.context_parallel_size, sequence_parallel=sp)
    gemms: dict[str, frozenset[str]] = {}
    for first, _, _ in plan.stages(int(trainer.max_steps)):  # only the stages that start within max_steps
        step_plan = plan.at(first)
        for name, module in step_plan.modules.items():
            gemms[name] = gemms.get(name, frozenset()) | _te_gemms(plan, step_plan, module)
    for name, fp8 in gemms.items():
        kind = name if ModelLayout.layer_of(name) is None else re.sub(r"local_experts\.\d+\.", "",
                                                                       name.split(".", 3)[3])
        shape = shapes[kind]
        problem = te_fp8_shape_problem(shape.rows, shape.in_features, shape.out_features, fp8,
                                       gemm_rows=shape.gemm_rows) if fp8 else None
        if problem is None:
            continue
        rows = "trainer.micro_batch_size x model.seq_length"
        if trainer.context_parallel_size > 1:
            rows += " / trainer.context_parallel_size"
        if shape.rows != shape.gemm_rows:  # a column-parallel layer's slice of the sequence
            rows += " / trainer.tensor_model_parallel_size"
        at_tp = f" at trainer.tensor_model_parallel_size={tp}" if tp > 1 else ""
        line = (f"model: Transformer Engine runs {name} in FP8 only with GEMM dimensions that are multiples of "
                f"{TE_FP8_ALIGN[0]} or {TE_FP8_ALIGN[1]}: {problem} (tokens: {rows}; features: "
                f"{_FEATURE_KEYS[kind]}{at_tp}); change them, or keep the module BF16 with recipe "
                f"layers.bf16_modules: ['*{kind}']")
        if _runs_on_te(plan):
            raise ConfigError(line)
        return f"on Transformer Engine this run would stop at its first FP8 step: {line}"
    return None


def check_plan(trainer, model, plan) -> str | None:
    """The plan against the run's layout and model, before anything is built: the checks that do not depend on
    which FP8 GPU runs it, so the Slurm launchers run them too, on the submitting host, for a GPU job
    (launch/job.py). Raises the one-line error; returns the shape warning of the emulated backend, or None."""
    check_engine_backend(trainer, plan.backend)
    check_grouped_experts(model, plan)
    check_sequence_parallel_amax(trainer, plan)
    check_recompute(trainer, plan)
    check_graphs(trainer, model, plan)
    return check_fp8_shapes(trainer, model, plan)


def one_cuda_connection(trainer, environ=os.environ) -> None:
    """Tensor or context parallelism: ``CUDA_DEVICE_MAX_CONNECTIONS=1`` unless the environment sets it, before CUDA
    starts (it is read when the context is created). One hardware queue keeps the order in which Megatron-Core and
    TE launch a layer's all-gather / reduce-scatter and its GEMM, which their overlap of the two relies on
    (Megatron-LM requires it for sequence parallelism before Blackwell; Megatron-Core warns without it)."""
    if trainer.tensor_model_parallel_size > 1 or trainer.context_parallel_size > 1:
        environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")


@contextlib.contextmanager
def same_on_every_rank():
    """Errors raised inside come from the config and the files every rank reads alike: every rank of a launched
    job raises the same one, so scripts/train.py prints it once (rank 0)."""
    try:
        yield
    except Exception as e:
        e.same_on_every_rank = True
        raise


@dataclasses.dataclass
class _Run:
    """What run_training's phases hand on: the checked config and first plan, the resume decision, this rank."""

    cfg: Any
    tcfg: Any
    """The checked TrainerConfig (training/config.py)."""
    recipe: Any
    debug: Any
    hardware: Hardware
    first_plan: PrecisionPlan
    """The plan on the whole model's layout, made before anything is built (its checks refuse early)."""
    shape_warning: str | None
    autopilot: Any = None
    """The typed ``autopilot:`` section (training/autopilot.py)."""
    resume_from: Path | None = None
    skip: int = 0
    """Micro-batches of the training stream the checkpoint consumed (checkpoint.resume_skip)."""
    saved: dict | None = None
    """The checkpoint's meta.json, read once."""
    rank: int = 0
    world_size: int = 1
    device: Any = None

    @property
    def trainer(self):
        return self.cfg.trainer

    @property
    def run_dir(self) -> Path:
        return Path(self.cfg.run_dir)

    @property
    def layout(self) -> dict:
        """The model-parallel sizes, as init_distributed and checkpoint.resume_skip take them."""
        return {"tensor_model_parallel_size": self.tcfg.tensor_model_parallel_size,
                "pipeline_model_parallel_size": self.tcfg.pipeline_model_parallel_size,
                "virtual_pipeline_model_parallel_size": self.tcfg.virtual_pipeline_model_parallel_size,
                "expert_model_parallel_size": self.tcfg.expert_model_parallel_size,
                "expert_tensor_parallel_size": self.tcfg.expert_tensor_parallel_size}


@dataclasses.dataclass
class _RunData:
    """This rank's batches and the dataset they come from."""

    train_iters: list
    """One iterator per model chunk, each the same stream (the first stage reads its tokens, the last its labels)."""
    valid: Any
    """This rank's validation batches (run.validation_batches), the same at every evaluation."""
    meta: dict
    """The dataset's meta.json (tokenizer, vocabulary)."""
    data_dir: Path
    data_parallel_size: int


def run_training(cfg) -> dict:
    quiet_third_party_logs()
    run = _checked_run(cfg)
    # torch and Megatron-Core from here on, once the config is known to be good (module docstring)
    from fp8_recipes.megatron.model import destroy_distributed, init_distributed

    _decide_resume(run)
    if launch_rank() == 0:
        claim(run.run_dir)  # the lock, released when the run ends (at exit, if it ends in an exception before `try`)
    run.rank, run.world_size, run.device = init_distributed(**run.layout,
                                                            context_parallel_size=run.tcfg.context_parallel_size,
                                                            seed=run.tcfg.seed, cuda_graphs=graphs_on(cfg.model))
    try:
        _verify_resume(run)
        if run.saved is not None and (done := int(run.saved["step"])) >= run.tcfg.max_steps:
            # A finished run resumed (a requeued or resubmitted job): nothing to train, nothing of the run rewritten.
            # Decided on the verified checkpoint: a damaged final one is refused, or with auto trained again. The
            # model is built and checked as for a resume with steps left: under another model config or params
            # dtype the run is not "done", and saying so would hide the mismatch until max_steps is raised.
            _model(run, *_dataset(run))
            return {"finished": {"steps": done, "checkpoint": str(run.resume_from), "max_steps": run.tcfg.max_steps},
                    "steps": done, "rank": run.rank}
        if run.rank == 0:
            _warn_notices(run)
        data = _run_data(run)
        engine, plan, precision = _model_and_engine(run, data)
        write_run_files = _run_files(run, plan, data.data_parallel_size)
        return _train(run, engine, plan, precision, data, on_ready=write_run_files)
    finally:
        release(run.run_dir)
        destroy_distributed()


def _checked_run(cfg) -> _Run:
    """The config, recipe and debug section checked, and the first plan with its checks: every error here comes
    before any process group, data or model exists (and before torch loads)."""
    with same_on_every_rank():
        tcfg = check_run_config(cfg)  # trainer, model, data, run_dir: before anything is built (and torch loads)
        recipe = resolve_recipe(cfg)
        autopilot = resolve_autopilot(cfg)
        debug = statistics_for(autopilot, resolve_debug(cfg))  # (the autopilot reads the statistics steps)
        if debug is not None and debug.dump.steps:  # written at the first dump step, hours in: checked now
            check_writable_dir("debug.dump.dir", str(debug.dump.path(cfg.run_dir)))
        check_moe_statistics(tcfg, cfg.model, debug)
        check_graph_observers(cfg.model, debug, autopilot)
    one_cuda_connection(tcfg)
    import torch  # (CUDA starts at is_available() below on a GPU machine)

    # before Hardware.detect: importing Transformer Engine creates TORCHINDUCTOR_CACHE_DIR (a failure reads "no TE")
    with same_on_every_rank():
        check_compile_caches(gpu=torch.cuda.is_available())
    hardware = Hardware.detect()
    with same_on_every_rank():
        if tcfg.device == "gpu" and hardware.device != "cuda":  # (before the model's GPU-only keys are refused)
            raise ConfigError("trainer.device=gpu: this machine has no CUDA GPU; train on the CPU with trainer=cpu (or "
                             "trainer.device=auto)")
        check_model_device(cfg.model, hardware.device)
        # Fail on the recipe/hardware combination before any process group, data or model exists.
        with _recipe_keys():
            first_plan = PrecisionPlan(recipe, layout_of(cfg.model), hardware)
        check_fp8_param(tcfg, first_plan)
        check_autopilot(autopilot, first_plan, tcfg)
        shape_warning = check_plan(tcfg, cfg.model, first_plan)
    return _Run(cfg, tcfg, recipe, debug, hardware, first_plan, shape_warning, autopilot=autopilot)


def _resume_skip(run: _Run, step_dir: Path | None) -> int:
    from fp8_recipes.training.checkpoint import resume_skip  # torch (module docstring)

    return resume_skip(step_dir, global_batch_size=run.tcfg.global_batch_size,
                       micro_batch_size=run.tcfg.micro_batch_size, **run.layout,
                       use_distributed_optimizer=run.tcfg.use_distributed_optimizer) if step_dir is not None else 0


def _decide_resume(run: _Run) -> None:
    """Where the run starts, before any process group exists: the checkpoint to resume (its files checked quickly),
    the samples it consumed, and the run directory's owner check."""
    from fp8_recipes.training.checkpoint import checkpoint_meta, find_resume, quick_damage  # torch (docstring)

    with same_on_every_rank():
        # A resume that cannot continue the run (another layout or global batch) is refused before anything is built.
        # Its files' contents are verified once the process group exists (each rank a share: _verify_resume).
        run.resume_from = find_resume(run.trainer.get("resume"), run.run_dir, damage=quick_damage, warn=False)
        run.skip = _resume_skip(run, run.resume_from)
        # One owner (rundir.py): no other running job, and a fresh start only into a directory holding no other run.
        check_run_dir(run.run_dir, fresh=run.resume_from is None and run.trainer.get("resume") != "auto")
    run.saved = checkpoint_meta(run.resume_from) if run.resume_from is not None else None  # read once, used below


def _verify_resume(run: _Run) -> None:
    """The checkpoint's contents, read once between the ranks (the process group exists now); auto may fall back
    to an earlier checkpoint, or to a fresh start."""
    if run.resume_from is None:
        return
    from fp8_recipes.training.checkpoint import checkpoint_meta, find_resume, shared_damage  # torch (docstring)

    with same_on_every_rank():
        verified = find_resume(run.trainer.get("resume"), run.run_dir, damage=shared_damage)
        if verified != run.resume_from:
            run.resume_from, run.skip, run.saved = verified, _resume_skip(run, verified), checkpoint_meta(verified)


def _warn_notices(run: _Run) -> None:
    """Settings that do nothing in this run, and the emulated backend's shape warning: said once (rank 0)."""
    plan = run.first_plan
    fp8_modules = {name for first, _, _ in plan.stages(run.tcfg.max_steps)
                   for name, module in plan.at(first).modules.items() if module.any_fp8}
    start = int(run.saved["step"]) if run.saved is not None else 0
    for line in [*model_notices(run.cfg.model, device=run.hardware.device),
                 _router_padding_notice(run.cfg.model, plan, fp8_modules),
                 _wgrad_fusion_notice(run.tcfg, plan),
                 "model.cuda_graph_modules: the router runs inside CUDA graphs, so routing.jsonl is not written; set "
                 "model.cuda_graph_modules=[attn] to keep it" if _graphs_route(run.cfg.model) else None,
                 _graphs_notice(run.cfg.model, plan, start, int(run.tcfg.max_steps)),
                 *run_notices(run.tcfg, run.recipe, run.debug, start, fp8_modules,
                              debug_set=resolve_debug(run.cfg).enabled), run.shape_warning,
                 *autopilot_notices(_plain(run.cfg.get("autopilot")), run.autopilot, plan, run.tcfg.max_steps)]:
        if line:
            logger.warning(line)


def _graphs_notice(model, plan, start: int, max_steps: int) -> str | None:
    """Graphs asked for where the run ends before their capture (training/loop.py's step: after the warmup steps, in
    the recipe's last stage)."""
    if not graphs_on(model):
        return None
    from fp8_recipes.training.loop import graphs_capture_step  # (torch: loaded by now, after init_distributed)

    at = graphs_capture_step(start, graph_config_fields(model)["cuda_graph_warmup_steps"], plan.stages()[-1][0])
    if at < max_steps:
        return None
    return (f"model.cuda_graph_impl=transformer_engine does nothing: the graphs would be captured before step "
            f"{at + 1} (after model.cuda_graph_warmup_steps eager steps, in the recipe's last stage) and the run "
            f"ends at trainer.max_steps={max_steps}")


def _router_padding_notice(model, plan, fp8_modules: set[str]) -> str | None:
    """model.moe_router_padding_for_quantization where nothing pads: the emulated backend, or no expert in FP8."""
    if not model.get("moe_router_padding_for_quantization"):
        return None
    if plan.te is None:
        return ("model.moe_router_padding_for_quantization=true does nothing on the emulated backend (its GEMMs take "
                "any token count); it pads for Transformer Engine's FP8 GEMMs")
    if not any(".local_experts." in name for name in fp8_modules):
        return ("model.moe_router_padding_for_quantization=true does nothing: no expert runs FP8 in this run (the "
                "dispatchers of FP8 experts' layers pad); set it false")
    return None


def _wgrad_fusion_notice(trainer, plan) -> str | None:
    """trainer.gradient_accumulation_fusion=true where nothing fuses: the emulated backend."""
    if trainer.gradient_accumulation_fusion and plan.backend is not Backend.TE:
        return ("trainer.gradient_accumulation_fusion=true does nothing on the emulated backend (its linears compute "
                "their own weight gradients); it fuses Transformer Engine's wgrad GEMMs; set it to null")
    return None


def _dataset(run: _Run) -> tuple[dict, Path]:
    """The dataset's meta.json and directory: built or reused by rank 0, the others wait and read it."""
    import torch.distributed as dist

    data = run.cfg.data
    if run.rank == 0:
        prepare_dataset(data.inputs, data.path, tokenizer_kind=data.tokenizer, vocab_size=int(data.vocab_size),
                        json_key=data.json_key)
    if run.world_size > 1:
        dist.barrier()
    return json.loads((Path(data.path) / "meta.json").read_text()), Path(data.path)


def _run_data(run: _Run) -> _RunData:
    """The dataset (built or reused by rank 0, the others wait) and this rank's training and validation batches."""
    from megatron.core import parallel_state as ps

    trainer, mbs = run.trainer, run.tcfg.micro_batch_size
    t0 = time.perf_counter()
    meta, data_dir = _dataset(run)
    dp = ps.get_data_parallel_world_size()
    train_ds, valid_ds = run_datasets(run.cfg, data_dir, dp)
    # One global stream of micro-batches dealt out round robin to the data-parallel ranks: a step trains on the
    # same samples at any DP size, and a resumed run starts after the samples its checkpoint consumed.
    dp_rank = ps.get_data_parallel_rank()
    # every pipeline stage and model chunk reads the same stream (the first stage its tokens, the last its labels)
    train_iters = [data_parallel_batches(train_ds, mbs, int(trainer.seed), dp_rank, dp, skip=run.skip)
                   for _ in range(run.tcfg.virtual_pipeline_model_parallel_size or 1)]
    valid = validation_batches(run.cfg, valid_ds, run.tcfg.eval_iters * dp, dp_rank, dp, key="trainer.eval_iters",
                               per_rank=True, warn=run.rank == 0)
    if run.rank == 0 and run.saved is not None:
        saved_dp = run.saved.get("data_parallel_size", dp)
        logger.info("resume: from %s (step %d, %d samples consumed%s)", run.resume_from, run.saved["step"],
                    run.skip * mbs, f"; data parallel {saved_dp} -> {dp}, the same global batches"
                    if saved_dp != dp else "")
    elif run.rank == 0 and trainer.get("resume") == "auto":
        logger.info("resume: auto: no checkpoint in %s, starting fresh", run.run_dir)
    if run.rank == 0:
        logger.info("data: %s (%d tokens, vocab %d) ready in %.1fs", data_dir, meta.get("num_tokens", -1),
                    meta["vocab_size"], time.perf_counter() - t0)
    return _RunData(train_iters, valid, meta, data_dir, dp)


def _model(run: _Run, meta: dict, data_dir: Path):
    """This rank's model chunks with the precision backend attached (initial weights from model.init_from, checked
    against a resumed checkpoint), for the dataset ``meta`` of ``data_dir``: (chunks, the model's plan, precision,
    the model config)."""
    from fp8_recipes.training.checkpoint import check_model_matches  # torch (module docstring)

    model_cfg = run_model_cfg(run.cfg, meta, data_dir)
    init_from = model_cfg.get("init_from") if run.resume_from is None else None  # a resumed run has its weights
    if init_from:
        # (torch and safetensors: this module loads without them, for the config checks and the Slurm launcher)
        from fp8_recipes.training.hf import check_hf_init, hf_init_path, load_hf_weights

        with same_on_every_rank():
            check_hf_init(hf_init_path(init_from), model_cfg)  # vocabulary and shape, before the model is built
    params_dtype = torch_dtype(str(run.trainer.params_dtype))
    te = run.first_plan.backend is Backend.TE
    attach = attach_te if te else attach_emulated
    # the same initial weights at any pipeline layout (megatron/model.py: build_gpt_model's init_seed)
    chunks, plan, precision = attach(model_cfg, run.recipe, run.hardware, params_dtype, run.device,
                                     engine_config_overrides(run.tcfg, te), init_seed=run.tcfg.seed)
    if init_from:  # before the optimizer copies the parameters into its main params
        with same_on_every_rank():
            count = load_hf_weights(chunks, hf_init_path(init_from), model_cfg)
        if run.rank == 0:
            logger.info("model.init_from: %s (%d tensors on rank 0)", init_from, count)
    if run.resume_from is not None:  # another model config: refused before the run's files are rewritten
        with same_on_every_rank():
            check_model_matches(run.resume_from, chunks)
    return chunks, plan, precision, model_cfg


def _model_and_engine(run: _Run, data: _RunData):
    """This rank's model (:func:`_model`) and the engine around it: (engine, the model's plan, precision)."""
    from fp8_recipes.training.engine import build_engine  # torch and Megatron-Core (module docstring)

    chunks, plan, precision, model_cfg = _model(run, data.meta, data.data_dir)
    fp8_param = None
    if plan.backend is Backend.TE:
        from fp8_recipes.megatron.te_layers import fp8_param_recipe  # Megatron-Core (module docstring)

        fp8_param = fp8_param_recipe(plan)
    engine = build_engine(chunks, run.tcfg, seq_length=int(model_cfg["seq_length"]), lr=run.tcfg.lr,
                          device=run.device, fp8_param=fp8_param)
    return engine, plan, precision


def _run_files(run: _Run, plan, data_parallel_size: int) -> Callable[[], None]:
    """The plan printed now (rank 0); the function that writes the run's plan and recipe files, for the loop's
    on_ready."""
    tcfg = run.tcfg
    explained = format_plan(plan, max_steps=int(run.trainer.max_steps), parallel=ParallelLayout(
        tcfg.tensor_model_parallel_size, tcfg.pipeline_model_parallel_size,
        tcfg.virtual_pipeline_model_parallel_size, tcfg.context_parallel_size, data_parallel_size))
    if run.rank == 0:
        run.run_dir.mkdir(parents=True, exist_ok=True)
        print(explained, flush=True)

    def write_run_files() -> None:
        """Called by the loop once the checkpoint is loaded: a resume refused while loading (e.g. the scaling
        state of another recipe) leaves the run's plan, recipe and metrics as they were."""
        if run.rank != 0:
            return
        if run.resume_from is not None or run.trainer.get("resume") == "auto":
            # the rows a killed run wrote past its checkpoint
            drop_rows_after(run.run_dir, int(run.saved["step"]) if run.saved is not None else 0)
        write_text(run.run_dir / PLAN, explained + "\n")
        import yaml

        write_text(run.run_dir / RECIPE, yaml.safe_dump(run.recipe.to_dict(), sort_keys=False))
    return write_run_files


def _train(run: _Run, engine, plan, precision, data: _RunData, on_ready: Callable[[], None]) -> dict:
    """The loop, with the numerics recorder when `debug` asks (closed however the loop ends); the summary with
    this rank, the recorder's time and what the TE linears really ran."""
    # imported here, not at the top: the loop module is torch's (and a test's hook patches its `train`)
    from fp8_recipes.training.loop import train

    recipe = run.recipe
    precision, recorder = _observe(precision, run.debug, run.run_dir, run.rank, plan.backend,
                                   run.tcfg.sequence_parallel)
    if run.autopilot is not None and run.autopilot.enabled:  # (statistics_for made sure the recorder exists)
        precision = AutopilotPrecision(precision, recorder, plan, run.autopilot, run.run_dir, rank=run.rank,
                                       max_steps=int(run.trainer.max_steps),
                                       check=lambda new: check_plan(run.tcfg, run.cfg.model, new))
    routing = None
    if not _graphs_route(run.cfg.model):
        precision, routing = _route(precision, engine.chunks, run.run_dir)
    failed = True
    try:
        summary = train(engine, data.train_iters, data.valid, run.trainer, precision, run.run_dir, rank=run.rank,
                        world_size=run.world_size, resume_from=run.resume_from, on_ready=on_ready,
                        steady_from=plan.stages()[-1][0],
                        summary_extra={"recipe": recipe.name, "backend": str(plan.backend),
                                       "fp8": any(str(recipe.policy(r).scaling) != "none"
                                                  for r in ("weights", "activations", "gradients")),
                                       "device": run.hardware.describe()})
        failed = False
    except (NonFiniteStop, CheckpointWriteError):
        failed = False  # every rank stops together, after a barrier: the last rows merge as usual
        raise
    finally:
        if recorder is not None:  # the last step's rows and the heat map, also after a failed step (then
            recorder.close(merge=not failed)  # unmerged: a rank that failed alone must not wait on its peers)
        if routing is not None:
            routing.close()
    summary["rank"] = run.rank
    if recorder is not None:
        summary["numerics_s"] = recorder.seconds  # time spent on statistics and dumps (bench_stats.py)
        summary["numerics_write_s"] = recorder.write_seconds  # of which writing rows, between steps
    if hasattr(precision, "execution_summary"):  # what the TE linears really ran, against the plan
        summary["te_execution"] = precision.execution_summary()
        if summary.get("cuda_graphs"):  # (a replay calls no forward, so no counting hook)
            summary["te_execution"]["counted"] = "eager forwards only: the CUDA-graphed layers' replays are not"
    return summary
