"""Training throughput of a Megatron-Core GPT (TE layer spec) per recipe against BF16, and this project's TE
backend against Megatron-Core's own FP8 path at the same recipe, measured side by side in one process.

Per model, configs run one after another on a freshly built model (same seed, same random tokens):
  bf16         the TE-spec model without any FP8 autocast
  NAME         this project's TE backend: the plan of recipe NAME (attach_te_backend, counters off); a plan
               on the emulated backend (nvfp4 on Hopper) runs it as scripts/train.py does (attach_emulated:
               Megatron-Core's local spec, fake-quantized GEMMs, TE's fused attention; not with --engine)
  NAME:raw     Megatron-Core's own path: TransformerConfig(fp8=..., fp8_recipe=...) with the TE recipe the plan
               chose (delayed: the same margin / history / algorithm), Megatron's get_fp8_context per layer,
               set_is_first_microbatch() each step as its schedules do
  NAME+LEVER   recipe NAME with a speed lever on (levers combine: NAME+head+...):
               head  layers.fp8_output_layer: true (the LM head's GEMMs in FP8; Megatron-Core has no FP8 head on
                     Hopper, so its ours / raw column compares with NAME:raw, the best Megatron-Core does there)
               attn  attention: fp8 (TE's FP8 attention); NAME+attn:raw is Megatron-Core's
                     fp8_dot_product_attention=True
               fp8param  fp8_param: true (the FP8 layers' weights stored in FP8, megatron/te_layers.py); FP8
                     weights need fp32 master weights, so its step runs TE's FusedAdam(master_weights=True);
                     NAME+fp8param:raw is Megatron-Core's fp8_param=True with that optimizer
               masters  the optimizer of fp8param (fp32 master weights) on BF16-stored weights: NAME+masters is
                     the baseline NAME+fp8param differs from by the FP8 storage alone
               moments16  with fp8param or masters: that optimizer's Adam moments in BF16 (not fp32); with
                     --engine (on bf16 too): the distributed optimizer's (trainer use_precision_aware_optimizer:
                     true, exp_avg_dtype and exp_avg_sq_dtype: bf16, Megatron-LM's --use-precision-aware-optimizer
                     --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16; fp32 master weights kept)
  MoE models' levers (model keys; on bf16 too, e.g. bf16+nofuse):
               pad   model moe_router_padding_for_quantization: true (the alltoall dispatcher pads each expert's
                     tokens to FP8's multiple, so the experts skip their own padding copies)
               nofuse  model moe_permute_fusion: false (Megatron-Core's unfused token permutation)
               router  model moe_router_fusion: true (TE's fused top-k and softmax in the router)
               capacity  model moe_expert_capacity_factor: 1.0, moe_pad_expert_input_to_capacity: true (tokens
                     past an expert's balanced share dropped, every expert padded to it: static shapes, so the
                     alltoall dispatcher copies no token count to the host per MoE layer; it changes what trains)
  emulated     (on bf16 too) the emulated backend: recipe backend: emulated, as nvfp4 runs on Hopper; bf16+emulated
               is Megatron-Core's local spec without quantization, so bf16 / bf16+emulated / NAME+emulated / nvfp4
               split an emulated step into the local spec's cost and the fake quantization's
  With --engine (on bf16 too):
               nogaf  trainer.gradient_accumulation_fusion: false (each micro-batch's weight gradient computed
                     apart and added to the fp32 buffer by DDP's hook, as Megatron-LM without APEX runs)
               graphs Megatron-Core's per-layer CUDA graphs through TE (model cuda_graph_impl: transformer_engine,
                     Megatron-LM's --cuda-graph-impl transformer_engine, as scripts/train.py runs them; the
                     model's own scopes, megatron/model_config.graph_modules): the attention, and in MoE layers
                     the router and the dispatcher's
                     preprocessing (where it copies nothing to the host), captured after the first warmup step
                     and replayed per micro-batch, so the host launches far fewer kernels before each MoE layer's
                     token-count sync; with lever capacity (static shapes) the whole layer, experts included,
                     so no token count reaches the host. NAME:raw captures under Megatron-Core's FP8 config;
                     NAME (this project's TE backend) under the plan's recipe, whose FP8 layers must share one
                     TE recipe with no linear of its own inside (else the config is skipped, saying why)
               attngraphs  the same, of the attention alone (model cuda_graph_modules: [attn]): on a MoE
                     model it tells the attention's share of graphs from the router's and the dispatcher's
Recipes with BF16 warmup or staged enablement are timed in their final stage (all roles FP8), the steady state.
A step is ``accum`` micro-batches, each forward (per-token loss, mean) + backward, as a training step accumulates
them (weights quantized once per step: TE's is_first_microbatch), then plain fused torch AdamW on the BF16 params
(its moments BF16 like the params; no master weights, no DDP: the GEMMs dominate; levers fp8param and masters: TE's
FusedAdam with fp32 master weights); tokens/s over ``steps`` timed steps after ``warmup``, peak memory from
torch.cuda.max_memory_allocated. With ``engine`` (``--engine``) a step is instead scripts/train.py's: this project's
engine (training/engine.py) at the GPU trainer's defaults: Megatron-Core's DDP (fp32 gradient buffers, the TE
layers' weight-gradient GEMMs accumulating into them: gradient_accumulation_fusion), its distributed optimizer
(fp32 master weights and moments, overlapped gradient reduction and parameter gather) and its schedule.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fp8_recipes.bench.output import bar_chart, markdown_table, save_json, stacked_bars, unmeasured
from fp8_recipes.bench.profile import format_profile, profile_parts, profile_steps
from fp8_recipes.integrations.common import named_recipe_gaps, te_recipe_fields
from fp8_recipes.megatron.model_config import layout_of
from fp8_recipes.plan.precision import Hardware, PrecisionPlan
from fp8_recipes.recipe.pack import conf_dir, load_recipe, recipe_names
from fp8_recipes.recipe.schema import ROLES, Backend, Recipe

__all__ = ["bench_train", "check_configs", "load_model_cfg", "summarize", "with_levers"]


def load_model_cfg(name: str, layers: int | None = None) -> dict:
    """conf/model/NAME.yaml as a plain dict; ``layers``: with that many layers instead of its own (--layers)."""
    from omegaconf import OmegaConf

    path = conf_dir() / "model" / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"--models {name}: no {path}; choose from "
                         f"{sorted(p.stem for p in path.parent.glob('*.yaml'))}")
    cfg = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    return cfg if layers is None else {**cfg, "num_layers": layers}


def model_label(name: str, layers: int | None = None) -> str:
    """A result row's model: NAME, or NAME@Nl where --layers N replaced its layer count (``mixtral_8x7b_4l@2l``:
    two layers of that shape)."""
    return name if layers is None else f"{name}@{layers}l"


def raw_megatron_fp8(choice: Any, recipe: Any) -> dict | None:
    """TransformerConfig fields giving Megatron-Core's own path the plan's TE recipe (the adapters' mapping,
    integrations/common.py), or None if no named Megatron-Core recipe is that one."""
    if choice is None or choice.forward_only or named_recipe_gaps(choice, recipe):
        return None
    if recipe.layers.bf16_first or recipe.layers.bf16_last or recipe.layers.bf16_modules or recipe.modules:
        return None  # Megatron's first_last_layers_bf16 differs (and refuses delayed), it has no per-module policies
    return te_recipe_fields(choice)


LEVERS = ("head", "attn", "fp8param", "masters", "moments16")
MODEL_LEVERS = {"pad": {"moe_router_padding_for_quantization": True}, "nofuse": {"moe_permute_fusion": False},
                "router": {"moe_router_fusion": True},
                "capacity": {"moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True}}
"""Levers that are MoE model keys (bench config ``NAME+pad``, ``bf16+nofuse``)."""
GRAPH_LEVERS = {"graphs": {}, "attngraphs": {"cuda_graph_modules": ["attn"]}}
"""Levers that capture Megatron-Core's TE CUDA graphs: model keys cuda_graph_impl: transformer_engine and these (graphs:
the model's own scopes, megatron/model_config.graph_modules; attngraphs: the attention's alone)."""
ENGINE_LEVERS = ("nogaf", *GRAPH_LEVERS, "grads16")
"""Levers of the engine's step (``--engine``; on bf16 too)."""
EMULATED = "emulated"
"""The lever that runs a config on the emulated backend (recipe ``backend: emulated``; on bf16 too: the bf16 recipe
there, Megatron-Core's local spec without quantization), what an NVFP4 step on Hopper is made of."""
OWN_OPTIMIZER = ("fp8param", "masters", "moments16")
"""Levers that choose the benchmark's optimizer (the engine has its own, whose moments moments16 sets)."""
ENGINE_MOMENTS16 = {"use_precision_aware_optimizer": True, "exp_avg_dtype": "bf16", "exp_avg_sq_dtype": "bf16"}
"""Lever moments16 with --engine: the trainer keys that keep the distributed optimizer's Adam moments in BF16."""
ENGINE_TRAINER = {"moments16": ENGINE_MOMENTS16, "grads16": {"grad_reduce_in_fp32": False}}
"""The engine's levers that are trainer keys (grads16: DDP's gradient buffer, which the wgrad GEMMs accumulate the
micro-batches into, in BF16: Megatron-LM without --accumulate-allreduce-grads-in-fp32)."""


def engine_trainer(levers: list[str]) -> dict[str, Any]:
    """The trainer keys a config's levers set on the engine's step (:data:`ENGINE_TRAINER`)."""
    return {k: v for lever in levers for k, v in ENGINE_TRAINER.get(lever, {}).items()}


def bf16_levers(engine: bool) -> tuple[str, ...]:
    """The levers bf16 takes as the recipes do: the model's, the engine step's, emulated and, with --engine,
    moments16 (the trainer's optimizer; without --engine it is the FP8 weights' optimizer's, a recipe's)."""
    return (*MODEL_LEVERS, *ENGINE_LEVERS, EMULATED, *(("moments16",) if engine else ()))


def split_label(label: str) -> tuple[str, list[str], str]:
    """A config label ``NAME[+LEVER...][:MODE]`` as (NAME, its levers, MODE: "" or "raw")."""
    name, _, mode = label.partition(":")
    name, *levers = name.split("+")
    return name, levers, mode


def _bf16_lever_set(label: str) -> frozenset[str] | None:
    """The levers of a bf16 config (``bf16+capacity+graphs`` -> {capacity, graphs}); None for any other label."""
    name, levers, mode = split_label(label)
    return frozenset(levers) if name == "bf16" and not mode else None


USABLE_MEMORY = 0.95
"""check_fits: the share of a GPU's memory a model's estimate may fill (the rest: CUDA's context, NCCL's buffers,
fragmentation)."""
GRAPH_CAPTURE_STEP = 1
"""Lever graphs: the step before which the graphs are captured (after one eager warmup step; --warmup must be more)."""


def check_configs(configs: list[str], engine: bool = False, warmup: int | None = None) -> None:
    """ValueError (one line, naming the config) for a config label bench_train cannot run, before anything runs
    (``warmup``: the untimed steps, which lever graphs needs more than GRAPH_CAPTURE_STEP of)."""
    for label in configs:
        name, levers, mode = split_label(label)
        if name != "bf16" and name not in recipe_names():
            raise ValueError(f"--configs {label}: no recipe {name!r}; choose from {', '.join(recipe_names())}")
        if mode not in ("", "raw"):
            raise ValueError(f"--configs {label}: unknown mode {mode!r}; write NAME or NAME:raw")
        bad = [lever for lever in levers if lever not in (*LEVERS, *MODEL_LEVERS, *ENGINE_LEVERS, EMULATED)]
        recipe_levers = [lever for lever in levers if lever in LEVERS and lever not in bf16_levers(engine)]
        if not bad and name == "bf16" and recipe_levers == ["moments16"]:
            raise ValueError(f"--configs {label}: moments16 on bf16 is the trainer's optimizer's: add --engine "
                             f"(without it, moments16 is the fp8param / masters optimizer's, on a recipe)")
        if not bad and name == "bf16" and recipe_levers:  # (a known lever, of the FP8 recipes)
            lever = recipe_levers[0]
            raise ValueError(f"--configs {label}: {lever} is a lever of a recipe, not of bf16; put it on a recipe, "
                             f"e.g. delayed+{lever}; bf16 takes the model levers "
                             f"({', '.join(MODEL_LEVERS)}), {EMULATED} and, with --engine, "
                             f"{', '.join(ENGINE_LEVERS)}, moments16")
        if bad:
            raise ValueError(f"--configs {label}: unknown lever {bad[0]!r}; levers (on a recipe): {', '.join(LEVERS)}; "
                             f"model levers (MoE, on bf16 too): {', '.join(MODEL_LEVERS)}; with --engine (on bf16 "
                             f"too): {', '.join(ENGINE_LEVERS)}, moments16")
        if engine and {"fp8param", "masters"} & set(levers):
            raise ValueError(f"--configs {label}: --engine runs the trainer's optimizer; drop the fp8param/masters "
                             f"levers or --engine (moments16 alone sets its moments in BF16)")
        if not engine and set(ENGINE_LEVERS) & set(levers):
            used = [lever for lever in levers if lever in ENGINE_LEVERS]
            raise ValueError(f"--configs {label}: {'/'.join(used)}: a lever of the engine's step; add --engine")
        graphs = [lever for lever in levers if lever in GRAPH_LEVERS]
        if len(graphs) > 1:
            raise ValueError(f"--configs {label}: {' and '.join(graphs)} choose the graphs' scopes both; keep one")
        if graphs and EMULATED in levers:
            raise ValueError(f"--configs {label}: {graphs[0]}: Megatron-Core's CUDA graphs capture TE-spec layers; "
                             f"the emulated backend runs the local spec; drop +{EMULATED} or +{graphs[0]}")
        if graphs and warmup is not None and warmup <= GRAPH_CAPTURE_STEP:
            raise ValueError(f"--configs {label}: graphs are captured before step {GRAPH_CAPTURE_STEP}, which "
                             f"--warmup {warmup} times; give --warmup {GRAPH_CAPTURE_STEP + 1} or more")
        if EMULATED in levers and (engine or mode == "raw" or set(OWN_OPTIMIZER) & set(levers)):
            raise ValueError(f"--configs {label}: {EMULATED} runs the emulated backend's local-spec model: not with "
                             f"--engine, :raw, {'/'.join(OWN_OPTIMIZER)}")
        if "moments16" in levers and not engine and not {"fp8param", "masters"} & set(levers):
            raise ValueError(f"--configs {label}: moments16 is the fp8param / masters optimizer's; add +fp8param or "
                             f"+masters, or --engine (the trainer's distributed optimizer)")


def with_levers(recipe: Any, levers: list[str]) -> Any:
    """``recipe`` with the named speed levers on (bench config ``NAME+LEVER``)."""
    levers = [lever for lever in levers if lever not in (*ENGINE_LEVERS, "moments16")]  # (the step's, the optimizer's)
    check_configs([f"{recipe.name}+{'+'.join(levers)}"] if levers else [])
    if "head" in levers:
        recipe = dataclasses.replace(recipe, layers=dataclasses.replace(recipe.layers, fp8_output_layer=True))
    if "attn" in levers:  # through the schema: its checks apply (per-tensor activations and gradients)
        recipe = Recipe.from_dict({**recipe.to_dict(), "attention": "fp8"})
    if "fp8param" in levers:  # through the schema: its checks apply (FP8 weights, no BF16 stage)
        recipe = Recipe.from_dict({**recipe.to_dict(), "fp8_param": True})
    if EMULATED in levers:
        recipe = Recipe.from_dict({**recipe.to_dict(), "backend": EMULATED})
    return recipe


def _optimizer(model: torch.nn.Module, levers: list[str]) -> torch.optim.Optimizer:
    """Plain fused AdamW on the BF16 params; with FP8-stored weights (and their baseline, lever masters) TE's
    FusedAdam keeping fp32 master weights (an FP8 weight cannot take the update itself)."""
    if "fp8param" in levers or "masters" in levers:
        from transformer_engine.pytorch.optimizers import FusedAdam

        moments = torch.bfloat16 if "moments16" in levers else torch.float32
        return FusedAdam(model.parameters(), lr=1e-5, master_weights=True, exp_avg_dtype=moments,
                         exp_avg_sq_dtype=moments)
    return torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)


@dataclasses.dataclass
class _BenchConfig:
    """A config label decided: the recipe and plan it runs, Megatron-Core's own FP8 fields (NAME:raw), the plan
    stage it is timed in; or why it is skipped."""

    label: str
    name: str
    mode: str
    levers: list[str]
    recipe: Any = None
    plan: Any = None
    overrides: dict | None = None
    describe: str = "BF16"
    steady: int = 0
    skipped: str | None = None
    emulated: bool = False
    """The plan runs on the emulated backend (Megatron-Core's local spec, fake-quantized GEMMs, TE's attention)."""

    @property
    def ours(self) -> bool:
        """This project's backend drives the model (a recipe, not NAME:raw)."""
        return (self.name != "bf16" or EMULATED in self.levers) and self.mode != "raw"

    @property
    def graphs(self) -> str | None:
        """The config's graph lever (GRAPH_LEVERS; check_configs allows one), or None."""
        return next((lever for lever in self.levers if lever in GRAPH_LEVERS), None)


def _decide(model_cfg: dict, label: str, engine: bool = False) -> _BenchConfig:
    """What a config label runs, decided on the plan before any model is built."""
    name, levers, mode = split_label(label)
    run = _BenchConfig(label, name, mode, levers)
    if name == "bf16" and EMULATED not in levers:
        return run
    run.recipe = recipe = with_levers(load_recipe(name), levers)  # (bf16+emulated: the bf16 recipe)
    if mode == "raw" and "head" in levers:
        run.skipped = (f"Megatron-Core has no FP8 LM head on this GPU; {name}+{'+'.join(levers)} is compared with "
                       f"{name}:raw")
        return run
    run.plan = plan = PrecisionPlan(recipe, layout_of(model_cfg), Hardware.detect())
    # Timed in the recipe's final stage (after any BF16 warmup and staged enablement): its steady state.
    run.steady = max((recipe.schedule.role_start(r) for r in ROLES if recipe.policy(r).is_fp8), default=0)
    if plan.te is None:  # the emulated backend (e.g. nvfp4 on Hopper): what scripts/train.py runs there
        run.emulated = plan.backend is Backend.EMULATED
        run.describe = f"emulated ({plan.backend_reason})"
        if not run.emulated or mode == "raw" or engine or recipe.fp8_param:
            run.skipped = (f"no TE plan ({plan.backend_reason})" if not run.emulated else
                           "Megatron-Core has no emulated path" if mode == "raw" else
                           "--engine times TE-spec models only; the emulated backend runs the local spec" if engine
                           else "fp8_param keeps TE's FP8 weights: the emulated backend has none")
        return run
    # the recipe's own TE recipe in its first FP8 layer (the layer's autocast; modules: overrides run their own)
    steady = plan.at(run.steady)
    choice = next((te for te in steady.layers_te.values() if te is not None), None)
    run.describe = choice.describe() if choice is not None else "BF16"
    if run.graphs and mode != "raw":
        run.skipped = steady.graph_problem(range(plan.layout.num_layers))
        if run.skipped:
            return run
    if mode == "raw":
        run.overrides = raw_megatron_fp8(choice, recipe)
        if run.overrides is None:
            run.skipped = f"Megatron-Core has no plain recipe for {run.describe}"
        elif "attn" in levers and not choice.fp8_dpa:
            run.skipped = f"TE runs no FP8 attention under {run.describe} here"
        elif "fp8param" in levers:
            run.overrides = {**run.overrides, "fp8_param": True}  # Megatron-Core's own FP8 weights
    elif recipe.fp8_param and plan.fp8_param_problem():
        run.skipped = plan.fp8_param_problem()
    return run


def _bench_model(model_cfg: dict, run: _BenchConfig, seed: int, engine: bool = False) -> tuple[torch.nn.Module, Any]:
    """The TE-spec model, freshly seeded, and this project's backend on it (None for bf16 and NAME:raw); for the
    engine's step with the trainer's gradient_accumulation_fusion (lever nogaf: off)."""
    # Megatron-Core here and in bench_train, not at import: --help, --plot-only and the config checks run without it
    from megatron.core import tensor_parallel

    from fp8_recipes.megatron.model import build_gpt_model, model_layout
    from fp8_recipes.megatron.te_layers import FP8ParamInit, attach_te_backend

    torch.manual_seed(seed)
    # (CUDA graphs need TE's RNG tracker, whose states TE can register with a graph: Megatron-LM switches it on
    # for them; engine configs run in a process each, so the switch does not outlive the config)
    graphs = engine and run.graphs is not None
    if engine:  # (every engine config, so that graphed and eager steps compare on the same kind of stream)
        from fp8_recipes.megatron.graphs import graph_side_stream

        graph_side_stream()
    tensor_parallel.model_parallel_cuda_manual_seed(seed, te_rng_tracker=graphs, force_reset_rng=graphs)
    torch.cuda.reset_peak_memory_stats()
    if run.emulated:
        from fp8_recipes.training.run import attach_emulated

        chunks, _, precision = attach_emulated(model_cfg, run.recipe, Hardware.detect(), torch.bfloat16,
                                               torch.device("cuda"), config_overrides=run.overrides)
        return chunks[0], precision
    fp8_param = FP8ParamInit(run.plan) if run.ours and run.recipe.fp8_param else None
    overrides = {**(run.overrides or {}), "gradient_accumulation_fusion": "nogaf" not in run.levers} \
        if engine else run.overrides
    model = build_gpt_model(model_cfg, use_te_spec=True, params_dtype=torch.bfloat16, device="cuda",
                            config_overrides=overrides, layer_init=fp8_param)
    precision = None
    if run.ours:
        precision = attach_te_backend(model, PrecisionPlan(run.recipe, model_layout(model), Hardware.detect()),
                                      count=False, recipes=fp8_param.recipes if fp8_param else None,
                                      router_padding=bool(model_cfg.get("moe_router_padding_for_quantization")))
    return model, precision


def _step_function(model: torch.nn.Module, precision: Any, optimizer: torch.optim.Optimizer, run: _BenchConfig,
                   model_cfg: dict, *, seq: int, mbs: int, seed: int, accum: int = 1) -> Callable[[int], torch.Tensor]:
    """One training step of ``accum`` micro-batches on the same random tokens each time, numbered from the recipe's
    steady stage."""
    vocab = int(model_cfg["vocab_size"])
    g = torch.Generator(device="cuda").manual_seed(seed)
    tokens = torch.randint(0, vocab, (mbs, seq), device="cuda", generator=g)
    labels = torch.randint(0, vocab, (mbs, seq), device="cuda", generator=g)
    position_ids = torch.arange(seq, device="cuda").expand(mbs, seq)
    steady, overrides = run.steady, run.overrides

    def one_step(i: int) -> torch.Tensor:
        if precision is not None:
            precision.begin_step(steady + i)
        elif overrides is not None:
            model.set_is_first_microbatch()  # Megatron's schedules: requantize the weights once per step
        for _ in range(accum):
            loss = model(tokens, position_ids, None, labels=labels).float().mean()
            (loss / accum).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if precision is not None:
            precision.after_optimizer_step(steady + i)
        return loss.detach()
    return one_step


def _engine_step_function(model: torch.nn.Module, precision: Any, run: _BenchConfig, model_cfg: dict, *, seq: int,
                          mbs: int, seed: int, accum: int) -> Callable[[int], torch.Tensor]:
    """One training step of scripts/train.py's engine (training/engine.py at the GPU trainer's defaults) on
    ``accum`` micro-batches of the same random tokens, numbered from the recipe's steady stage."""
    import itertools

    from fp8_recipes.training.config import TrainerConfig
    from fp8_recipes.training.engine import build_engine

    trainer = TrainerConfig.from_cfg({"micro_batch_size": mbs, "global_batch_size": mbs * accum, "lr": 1e-5,
                                      "min_lr": 0.0, "use_distributed_optimizer": True, "overlap_grad_reduce": True,
                                      "overlap_param_gather": True,
                                      **engine_trainer(run.levers)})
    engine = build_engine([model], trainer, seq_length=seq, lr=trainer.lr, device=torch.device("cuda"))
    vocab = int(model_cfg["vocab_size"])
    g = torch.Generator(device="cuda").manual_seed(seed)
    batch = {"tokens": torch.randint(0, vocab, (mbs, seq), device="cuda", generator=g),
             "labels": torch.randint(0, vocab, (mbs, seq), device="cuda", generator=g),
             "loss_mask": torch.ones(mbs, seq, device="cuda"),
             "position_ids": torch.arange(seq, device="cuda").expand(mbs, seq)}
    steady = run.steady

    def one_step(i: int) -> torch.Tensor:
        if precision is not None:
            precision.begin_step(steady + i)
        if engine.graphs is not None and i == GRAPH_CAPTURE_STEP:  # (the model's graph keys: lever graphs)
            engine.graphs.capture(precision, clone_param_grads=run.mode == "raw")  # (raw: Megatron-Core's as is)
        result = engine.train_step(itertools.repeat(batch))  # (Megatron's schedule: set_is_first_microbatch)
        if result.skipped:
            raise RuntimeError(f"{run.label}: the engine skipped step {i} (loss {result.loss}, grad norm "
                               f"{result.grad_norm})")
        if precision is not None:
            precision.after_optimizer_step(steady + i)
        return torch.tensor(result.loss)
    return one_step


def _timed(one_step: Callable[[int], torch.Tensor], warmup: int, steps: int) -> tuple[float, torch.Tensor]:
    """Seconds of ``steps`` steps after ``warmup`` untimed ones (CUDA events), and the last step's loss."""
    for i in range(warmup):
        one_step(i)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for i in range(warmup, warmup + steps):
        loss = one_step(i)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000, loss


def _run_config(model_cfg: dict, label: str, *, seq: int, mbs: int, warmup: int, steps: int, seed: int,
                profile: bool = False, accum: int = 1, engine: bool = False) -> dict[str, Any]:
    levers = split_label(label)[1]
    model_cfg = {**model_cfg, **{k: v for lever in levers for k, v in MODEL_LEVERS.get(lever, {}).items()}}
    for lever in set(levers) & set(GRAPH_LEVERS):  # (check_configs: with --engine, one of them)
        model_cfg.update(cuda_graph_impl="transformer_engine", cuda_graph_warmup_steps=GRAPH_CAPTURE_STEP,
                         **GRAPH_LEVERS[lever])
    run = _decide(model_cfg, label, engine)
    if run.skipped is not None:
        return {"config": label, "skipped": run.skipped}
    model, precision = _bench_model(model_cfg, run, seed, engine)
    model.train()
    if engine:
        optimizer = None
        one_step = _engine_step_function(model, precision, run, model_cfg, seq=seq, mbs=mbs, seed=seed, accum=accum)
    else:
        optimizer = _optimizer(model, run.levers)
        one_step = _step_function(model, precision, optimizer, run, model_cfg, seq=seq, mbs=mbs, seed=seed,
                                  accum=accum)
    seconds, loss = _timed(one_step, warmup, steps)
    out = {"config": label, "te_recipe": run.describe, "megatron_fp8": run.overrides,
           "step_ms": 1000 * seconds / steps, "tokens_per_s": steps * accum * mbs * seq / seconds,
           "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30, "loss": loss.item()}
    if profile:  # after the timing, so the profiler costs the timed steps nothing
        out["profile"] = profile_steps(one_step, warmup + steps)
        print(format_profile(f"{model_cfg.get('num_layers')}-layer {label}", out["profile"]), flush=True)
    model = optimizer = precision = one_step = loss = None  # the step function holds them too; then the memory
    _free()
    return out


def _run_config_apart(model_cfg: dict, label: str, **kwargs: Any) -> dict[str, Any]:
    """:func:`_run_config` in a fresh process (spawn). The engine's step needs it: Megatron-Core's DDP hangs its
    gradient buffers on hooks of autograd nodes, which Python's gc does not reach, so an engine's ~100 GiB outlive
    its config in this process (measured on the H200: the next 4-layer Mixtral config ran out of memory)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_config_process, args=(send, model_cfg, label, kwargs))
    proc.start()
    send.close()
    try:
        row = receive.recv()
    except EOFError:
        row = f"{label}: its benchmark process ended without a result"
    proc.join()
    if isinstance(row, str):
        raise RuntimeError(f"{row} (exit code {proc.exitcode})")
    return row


def _run_apart_or_failed(model_cfg: dict, label: str, **kwargs: Any) -> dict[str, Any]:
    """:func:`_run_config_apart`, or a ``failed`` row naming the error (its traceback printed) when the config's
    process ended in one: its process is gone, so the next configs run on (a GPU burst keeps what they measure)."""
    import sys

    try:
        return _run_config_apart(model_cfg, label, **kwargs)
    except RuntimeError as e:
        print(e, file=sys.stderr, flush=True)
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        return {"config": label, "failed": lines[-1] if lines else "its process ended in an error"}


def _config_process(send: Any, model_cfg: dict, label: str, kwargs: dict) -> None:
    import traceback

    from fp8_recipes.megatron.model import destroy_distributed, init_distributed
    from fp8_recipes.training.run import quiet_third_party_logs

    quiet_third_party_logs()
    init_distributed(seed=kwargs["seed"])
    try:
        send.send(_run_config(model_cfg, label, **kwargs))
    except BaseException:  # noqa: BLE001  (the parent raises it, with the child's traceback)
        send.send(traceback.format_exc())
    finally:
        destroy_distributed()


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()
    try:
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager

        FP8GlobalStateManager.reset()  # its amax buffers hold the freed model's delayed-scaling tensors
    except Exception:  # noqa: BLE001
        pass


def check_models(models: list[str]) -> None:
    """ValueError (one line naming the model) for a model bench_train cannot build: not in conf/model/, or its
    vocab_size taken from the data (``${data.vocab_size}``: the benchmark's random tokens have no tokenizer)."""
    for name in models:
        vocab = load_model_cfg(name).get("vocab_size")
        if not isinstance(vocab, int):
            own = sorted(p.stem for p in (conf_dir() / "model").glob("*.yaml")
                         if isinstance(load_model_cfg(p.stem).get("vocab_size"), int))
            raise ValueError(f"--models {name}: its vocab_size is {vocab!r}, the data's tokenizer's; the benchmark "
                             f"feeds random tokens: choose a model with its own vocab_size ({', '.join(own)})")


def check_fits(models: list[str], configs: list[str], *, seq: int, mbs: int, engine: bool, gpu_bytes: int,
               layers: int | None = None) -> dict[str, str]:
    """ValueError (one line naming the config) where the engine's step of a listed config cannot fit one GPU of
    ``gpu_bytes``: BF16 weights, per-tensor FP8 copies of them (a recipe), DDP's gradients and the distributed
    optimizer's state on one rank in the dtypes the config's levers set (fp32, or BF16 with grads16 / moments16),
    activations of one micro-batch (plan/memory.py, `fp8-recipes memory`), against 95% of the GPU's memory (CUDA's
    context, NCCL's buffers and fragmentation take the rest). Returns, per model, why the plain ``bf16`` baseline
    cannot fit where it is not listed (:func:`bench_train` skips it; the rows read x BF16 at the same levers). Without
    --engine the plain AdamW on BF16 parameters holds much less, and is not checked."""
    if not engine:
        return {}
    usable = USABLE_MEMORY * gpu_bytes / 2**30
    at = f" at --layers {layers}" if layers is not None else ""
    skip = {}
    for name in models:
        for label in ["bf16", *configs]:
            recipe, levers, _ = split_label(label)
            need, command = _engine_gib(name, recipe, levers, seq=seq, mbs=mbs, layers=layers)
            if need <= usable:
                continue
            if label == "bf16" and label not in configs:
                skip[name] = (f"the plain BF16 step{at} needs about {need:.0f} GiB ({usable:.0f} usable): read x BF16 "
                              f"same levers")
                continue
            missing = [lever for lever in ("grads16", "moments16") if lever not in levers]
            small, _ = _engine_gib(name, recipe, [*levers, *missing], seq=seq, mbs=mbs, layers=layers)
            hint = (f"add +{'+'.join(missing)} (BF16 gradients / Adam moments: about {small:.0f} GiB), "
                    if missing and small <= usable else "")
            where = f"`{command}`" if layers is None else "its estimate"
            raise ValueError(f"--configs {label}: --engine's step of {name}{at} needs about {need:.0f} GiB on one GPU "
                             f"({where}), this one has {gpu_bytes / 2**30:.0f} GiB ({usable:.0f} usable); {hint}run "
                             f"it on a larger GPU, with fewer --layers, or without --engine")
    if skip:
        _check_twins_listed(configs)
    return skip


def _check_twins_listed(configs: list[str]) -> None:
    """ValueError (one line) where the plain bf16 baseline is skipped and a config's BF16 at the same levers is not
    among ``configs`` either: nothing would be measured to read it against."""
    listed = {_bf16_lever_set(c) for c in configs} - {None}
    for label in configs:
        name, levers, _ = split_label(label)
        twin = _twin_levers(label, engine=True)
        if name != "bf16" and twin not in listed:
            add = "+".join(["bf16", *(lever for lever in levers if lever in twin)]) if twin else "bf16 at its levers"
            raise ValueError(f"--configs {label}: the plain bf16 baseline cannot fit this GPU, and nothing else "
                             f"measures BF16 at this config's levers; add {add} to --configs")


def _engine_gib(name: str, recipe: str, levers: list[str], *, seq: int, mbs: int,
                layers: int | None) -> tuple[float, str]:
    """GiB the engine's step of model ``name`` holds at least under ``recipe`` with ``levers`` (a recipe: per-tensor
    FP8 weight copies), and the `fp8-recipes memory` command that says so."""
    from fp8_recipes.plan.memory import OptimizerPrecision, estimate_memory
    from fp8_recipes.plan.precision import ParallelLayout

    trainer = engine_trainer(levers)
    fp8 = recipe != "bf16"
    gib = estimate_memory({**load_model_cfg(name, layers), "seq_length": seq}, ParallelLayout(), micro_batch_size=mbs,
                          seq_length=seq, fp8=fp8, distributed_optimizer=True,
                          optimizer=OptimizerPrecision.from_trainer(trainer)).total_gib
    flags = [*(["--fp8"] if fp8 else []), *(["--grad-reduce-in-bf16"] if "grads16" in levers else []),
             *(["--exp-avg-dtype bf16 --exp-avg-sq-dtype bf16"] if "moments16" in levers else [])]
    return gib, " ".join(["fp8-recipes memory", name, f"--mbs {mbs} --seq {seq}", *flags])


def bench_train(models: list[str], configs: list[str], *, seq: int = 4096, mbs: int = 2, warmup: int = 3,
                steps: int = 8, seed: int = 1234, out_dir: Path | None = None, profile: bool = False,
                accum: int = 1, engine: bool = False, layers: int | None = None,
                skip_baseline: dict[str, str] | None = None) -> dict[str, Any]:
    """Every config of every model (``layers``: with that many layers each, rows named by :func:`model_label`);
    with ``out_dir`` the results so far are saved after each config (a run cut short by a time limit keeps what it
    measured). ``skip_baseline``: models whose plain bf16 row is skipped, and why (:func:`check_fits`)."""
    from fp8_recipes.megatron.model import destroy_distributed, init_distributed  # (see _run_config)

    if not engine:  # (the engine's configs run each in its own process: _run_config_apart)
        init_distributed(seed=seed)
    t0 = time.perf_counter()
    results: list[dict] = []
    result = {"kind": "train", "device": torch.cuda.get_device_name(), "torch": torch.__version__, "seq": seq,
              "mbs": mbs, "accum": accum, "engine": engine, "warmup": warmup, "steps": steps, "seconds": 0.0,
              "rows": results}
    try:
        for name in models:
            cfg, model_name = {**load_model_cfg(name, layers), "seq_length": seq}, model_label(name, layers)
            for label in ["bf16"] + [c for c in configs if c != "bf16"]:
                t = time.perf_counter()
                kwargs = dict(seq=seq, mbs=mbs, warmup=warmup, steps=steps, seed=seed, profile=profile, accum=accum,
                              engine=engine)
                if label == "bf16" and name in (skip_baseline or {}):
                    row = {"model": model_name, "config": label, "skipped": skip_baseline[name]}
                else:
                    row = {"model": model_name, **(_run_apart_or_failed(cfg, label, **kwargs) if engine else
                                                   _run_config(cfg, label, **kwargs))}
                row["wall_s"] = time.perf_counter() - t
                results.append(row)
                done = unmeasured(row) or (f"{row['tokens_per_s']:,.0f} tok/s, {row['peak_mem_gib']:.1f} GiB, "
                                           f"loss {row['loss']:.3f}")
                print(f"  {model_name} {label}: {done} ({row['wall_s']:.0f}s)", flush=True)
                result["seconds"] = time.perf_counter() - t0
                if out_dir is not None:
                    save(result, out_dir)
    finally:
        if not engine:
            destroy_distributed()
    return result


def _twin_levers(label: str, engine: bool) -> frozenset[str] | None:
    """The levers of ``label`` that BF16 runs too (model, engine step, emulated; with --engine moments16): the bf16
    config with just those, in any order, is its twin (``delayed+capacity+graphs+head`` -> ``bf16+capacity+graphs``);
    None for a bf16 config or one with none of them."""
    name, levers, _ = split_label(label)
    shared = frozenset(lever for lever in levers if lever in bf16_levers(engine))
    return shared if shared and name != "bf16" else None


def _plain_baselines(result: dict[str, Any]) -> bool:
    """Every model's plain bf16 row measured: the plot reads x BF16; else (a baseline skipped) x BF16 same levers."""
    return all(not unmeasured(r) for r in result["rows"] if r["config"] == "bf16")


def _raw_tokens_per_s(label: str, cfgs: dict[str, dict]) -> float | None:
    """tokens/s of the Megatron-Core config ``label`` is compared with: ``label:raw``; else, the same without the
    levers Megatron-Core has no equivalent of here (head); else ``NAME:raw``, the best Megatron-Core runs there."""
    name, *levers = label.split("+")
    for twin in (label, "+".join([name, *(lever for lever in levers if lever != "head")]), name):
        if tokens := cfgs.get(f"{twin}:raw", {}).get("tokens_per_s"):
            return tokens
    return None


def summarize(result: dict[str, Any]) -> tuple[str, list[str], dict[str, list[float]]]:
    """(Markdown table: tokens/s, x BF16, x BF16 at the same levers, x raw Megatron-Core, memory; x labels; series
    x BF16 per model, or x BF16 at the same levers for every model where a plain bf16 row was not measured)."""
    rows, groups, plotted = [], [], {}
    by_model: dict[str, dict[str, dict]] = {}
    for r in result["rows"]:
        by_model.setdefault(r["model"], {})[r["config"]] = r
    plain = _plain_baselines(result)
    for model, cfgs in by_model.items():
        base = cfgs.get("bf16", {}).get("tokens_per_s")
        twins = {_bf16_lever_set(label): r["tokens_per_s"] for label, r in cfgs.items()
                 if _bf16_lever_set(label) is not None and not unmeasured(r)}
        for label, r in cfgs.items():
            if unmeasured(r):
                rows.append([model, label, unmeasured(r), None, None, None, None, None])
                continue
            raw = _raw_tokens_per_s(label, cfgs) if ":" not in label and label != "bf16" else None
            twin = twins.get(_twin_levers(label, bool(result.get("engine"))))
            vs_bf16 = r["tokens_per_s"] / base if base else float("nan")
            vs_twin = r["tokens_per_s"] / twin if twin else None
            rows.append([model, label, r["te_recipe"], r["tokens_per_s"], vs_bf16, vs_twin,
                         r["tokens_per_s"] / raw if raw else None, r["peak_mem_gib"]])
            same = 1.0 if label.startswith("bf16") else (vs_twin or float("nan"))  # (bf16+...: its own twin)
            plotted.setdefault(label, {})[model] = vs_bf16 if plain else same  # (one kind of ratio per plot)
        groups.append(model)
    series = {label: [values.get(model, float("nan")) for model in by_model] for label, values in plotted.items()}
    header = ["model", "config", "TE recipe", "tok/s", "x BF16", "x BF16 same levers", "ours / raw Megatron",
              "peak GiB"]
    return markdown_table(header, rows), groups, series


def save(result: dict[str, Any], out_dir: Path) -> None:
    save_json(out_dir / "bench_train.json", result)
    plot(result, out_dir / "bench_train.png")


def plot(result: dict[str, Any], png: Path) -> None:
    """The configs' tokens/s relative to BF16, per model, as bars; with --profile, beside it (NAME_profile.png)
    each profiled config's step as its kernel categories' ms, stacked."""
    _, groups, series = summarize(result)
    plain = _plain_baselines(result)
    title = f"Megatron-Core GPT, seq {result['seq']}, mbs {result['mbs']}, {result['device']}"
    bar_chart(png, groups, series, ylabel="tokens/s relative to BF16" + ("" if plain else " (at the same levers)"),
              title=title)
    profiled, parts = profile_parts(result["rows"])
    if profiled:
        many = len({r["model"] for r in profiled}) > 1
        stacked_bars(png.with_name(f"{png.stem}_profile.png"),
                     [f"{r['model']} {r['config']}" if many else r["config"] for r in profiled], parts,
                     xlabel="GPU kernel time per training step (ms)", title=title)
