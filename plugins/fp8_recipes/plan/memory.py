"""Memory per GPU of a Megatron-Core GPT at a parallel layout: weights, gradients, optimizer state, FP8 weight copies,
activations and the LM head's logits, per pipeline stage, and the stage that needs the most.

    estimate = estimate_memory(model_cfg, ParallelLayout(tp=8, pp=8, dp=16), micro_batch_size=1, seq_length=8192,
                               fp8=True, distributed_optimizer=True)
    estimate.total_gib, estimate.rows()
    [s.total_gib for s in estimate_stages(model_cfg, ParallelLayout(tp=8, pp=8, dp=16), ...)]

Pure arithmetic (no torch), in bytes, what this project's engine allocates (training/engine.py, Megatron-Core 0.19
with Transformer Engine's layers; the optimizer keys are the trainer's, `OptimizerPrecision`):
- weights: BF16, 2 bytes per parameter of the stage's shard (TP splits the linears, the embedding and the LM head);
  with ``fp8_param`` (recipe key) the FP8 layers' linear weights are stored as FP8 and have no BF16 copy;
- gradients: DDP's buffer, 4 bytes per parameter with ``grad_reduce_in_fp32`` (the default), else 2 (BF16); the
  distributed optimizer's main grads are views of it;
- optimizer: main params + Adam's two moments per parameter, divided over the data x context parallel ranks by the
  distributed optimizer: 4 + 4 + 4 bytes by default; with the precision-aware optimizer the moments take their
  dtypes' bytes and fp32 main params of BF16 weights keep only their 16 low bits (Megatron-Core's
  ``store_param_remainders``: 2 bytes), fp16 main params 2 bytes; with ``fp8_param`` fp32 main params take 4 bytes;
- FP8 weight copies: Transformer Engine keeps each FP8 linear's weight quantized, rowwise and columnwise: 2 bytes
  per linear parameter, plus block or MXFP8 scales (with ``fp8_param`` these are the weights themselves); NVFP4
  weights 2 x (0.5 + 1/16) bytes (E2M1 codes two a byte, an E4M3 scale per 16 values, in each copy);
- activations: what the backward pass keeps per token and layer (Transformer Engine's fused attention keeps no
  s x s scores): the residual and norm inputs and outputs (h each), q/k/v (h + 2 x groups x head dim), the
  attention output (h), the MLP's fc1 output (2 x ffn for SwiGLU, ffn otherwise) and fc2's input (ffn), in BF16;
  under FP8 the norm outputs and fc2's input are kept as FP8 (1 byte) and the attention output gets an FP8 copy;
  under NVFP4 activations those copies are TE's columnwise NVFP4 ones (0.5 + 1/16 byte per element).
  Tensor parallelism divides the sharded ones, sequence parallelism the rest, context parallelism all. Each stage
  holds the activations of the micro-batches in flight at its peak (`microbatches_in_flight`, from Megatron-Core's
  schedules); full recompute keeps only each layer's input, plus one layer's activations while it is recomputed;
- logits: the last stage's [s, b, vocab / tp] logits in BF16, their fp32 copy in the fused cross-entropy and their
  BF16 gradient: 8 bytes per element (one micro-batch: the last stage runs each backward right after its forward).

Mixture-of-Experts layers (``num_moe_experts``; ``moe_layer_freq`` says which layers): attention, norms, a router
([experts, hidden], whole on every TP rank, BF16, never FP8) and an optional shared expert are counted like the
dense parts; the routed experts are Megatron-Core's expert-parallel parameters: each rank holds experts / EP of
them, each split over expert TP (``ParallelLayout.ep`` / ``etp``), with gradients in DDP's expert buffer and optimizer
state sharded over the expert-data-parallel ranks (tp x cp x dp / (expert TP x EP), Megatron-Core's world /
(expert TP x EP x PP)) instead of dp x cp. FP8 weight copies cover the experts and the shared expert. Activations
per MoE layer: what :func:`_moe_layer_bytes` lists (the routed rows top-k x tokens, FP8 padding, router scores, the
dispatch buffers of the one layer running), with balanced routing (a skewed step puts more rows on some ranks).
``fp8_modules`` / ``storage`` take the linears a recipe's plan quantizes the weights of and what its run keeps of
the quantized operands, per role (:func:`fp8_modules_of`, :func:`operand_storage_of`; `fp8-recipes memory --recipe`):
FP8 copies only for those (bf16_modules, per-module policies and fp8_output_layer as the plan applies them), their
bytes the weights role's, the saved activations' the activations role's (a mix such as NVFP4 weights with FP8
activations is counted role by role). ``storage`` says which runtime it counts: Transformer Engine's (NVFP4 packed,
as TE stores it on sm_100 and newer; the scale tensors' padding to multiples of 128 x 4 and the fp32 amaxes left
out) or, with ``emulated`` (`--emulated`), what the emulated backend holds, as NVFP4 runs on Hopper: no cached
weight copies; each forward saves its input in BF16 and, where the backward reuses fprop's dequantized copy (a
per-tensor scale or a square block: 16x16 NVFP4 or 128x128 weights), that BF16 copy too, per
micro-batch in flight (counted in fp8_weights for weights); the rest of the layer as with TE's layers (the emulated
backend's local attention on the CPU or for ``attention: fp8``, which keeps s x s scores, is not modelled; on a
GPU with TE its BF16 attention is TE's fused one).

The first stage holds the embedding, the last the LM head (with tied embeddings and pp > 1, its own copy of the
embedding) and the final norm, every stage num_layers / pp layers
(the trainer splits layers evenly: it has no uneven-split keys). Checked against peaks measured on one H200
(docs/scale.md, tests/unit/test_memory.py).
"""

from __future__ import annotations

import dataclasses

import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from fp8_recipes.plan.precision import (
    Hardware, ModelLayout, MoEShape, ParallelLayout, PrecisionPlan, expert_ffn_size, moe_layer_pattern,
)
from fp8_recipes.recipe.schema import ROLES, Backend, Recipe, Role, Scaling, TensorPolicy

__all__ = ["GIB", "LLAMA3", "MIXTRAL", "MemoryEstimate", "OperandStorage", "OptimizerPrecision", "estimate_memory",
           "estimate_stages", "format_estimate", "fp8_layers_of", "fp8_modules_of", "fp8_weight_copy_bytes",
           "linear_parameters", "microbatches_in_flight", "operand_storage_of", "parameter_counts"]

GIB = 2**30
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}

_LLAMA = {"normalization": "RMSNorm", "activation": "swiglu", "num_query_groups": 8, "vocab_size": 128256,
          "share_embeddings_and_output_weights": False}
LLAMA3: dict[str, dict[str, Any]] = {
    "llama3-8b": {**_LLAMA, "num_layers": 32, "hidden_size": 4096, "ffn_hidden_size": 14336, "num_attention_heads": 32},
    "llama3-70b": {**_LLAMA, "num_layers": 80, "hidden_size": 8192, "ffn_hidden_size": 28672,
                   "num_attention_heads": 64},
    "llama3-405b": {**_LLAMA, "num_layers": 126, "hidden_size": 16384, "ffn_hidden_size": 53248,
                    "num_attention_heads": 128},
}
"""The published Llama 3 shapes (for `fp8-recipes memory` and docs/scale.md)."""
MIXTRAL: dict[str, dict[str, Any]] = {
    "mixtral-8x7b": {"normalization": "RMSNorm", "activation": "swiglu", "num_layers": 32, "hidden_size": 4096,
                     "ffn_hidden_size": 14336, "num_attention_heads": 32, "num_query_groups": 8, "vocab_size": 32000,
                     "share_embeddings_and_output_weights": False, "num_moe_experts": 8, "moe_router_topk": 2,
                     "moe_ffn_hidden_size": 14336, "moe_layer_freq": 1},
}
"""The published Mixtral-8x7B shape (46.7 B parameters, 12.9 B active per token; docs/scale.md's MoE table)."""


@dataclass(frozen=True)
class OptimizerPrecision:
    """The trainer's optimizer keys the estimate follows (training/config.py: same names, same values).

    ``main_grads_dtype`` is not among them: in Megatron-Core 0.19 the distributed optimizer's main grads are views
    of DDP's gradient buffer, whose dtype ``grad_reduce_in_fp32`` sets (docs/scale.md)."""

    use_precision_aware_optimizer: bool = False
    """Optimizer state in the dtypes below (Transformer Engine's FusedAdam; needs the distributed optimizer)."""
    exp_avg_dtype: str = "fp32"
    """Adam's first moment: fp32 | bf16 | fp16."""
    exp_avg_sq_dtype: str = "fp32"
    """Adam's second moment: fp32 | bf16 | fp16."""
    main_params_dtype: str = "fp32"
    """Main params: fp32 | fp16."""
    grad_reduce_in_fp32: bool = True
    """DDP's gradient buffer (the main grads) in fp32; false: BF16."""

    def __post_init__(self) -> None:
        allowed = {"exp_avg_dtype": ("fp32", "bf16", "fp16"), "exp_avg_sq_dtype": ("fp32", "bf16", "fp16"),
                   "main_params_dtype": ("fp32", "fp16")}
        for key, choices in allowed.items():
            value = getattr(self, key)
            if value not in choices:
                raise ValueError(f"trainer.{key}={value!r}: not one of {' | '.join(choices)}")
            if value != "fp32" and not self.use_precision_aware_optimizer:
                raise ValueError(f"trainer.{key}={value}: needs trainer.use_precision_aware_optimizer=true")

    @classmethod
    def from_trainer(cls, trainer: Mapping[str, Any]) -> OptimizerPrecision:
        """From a `trainer` group (conf/trainer/*.yaml); absent keys take the trainer's defaults."""
        return cls(**{key: trainer[key] for key in cls.__dataclass_fields__ if key in trainer})

    @property
    def moment_bytes(self) -> int:
        """Adam's two moments, bytes per parameter."""
        return DTYPE_BYTES[self.exp_avg_dtype] + DTYPE_BYTES[self.exp_avg_sq_dtype]

    def main_param_bytes(self, *, fp8_param: bool) -> int:
        """Bytes per parameter of the main params. With the precision-aware optimizer, fp32 main params of BF16
        weights are stored as the 16 bits the BF16 weight lacks (``store_param_remainders``, Megatron-Core's default,
        Transformer Engine's FusedAdam); with FP8-stored weights (per-tensor and blockwise recipes) Megatron-Core
        keeps the fp32 main params itself, whole."""
        if not self.use_precision_aware_optimizer:
            return 4
        if self.main_params_dtype == "fp16":
            return 2
        return 4 if fp8_param else 2

    @property
    def grad_bytes(self) -> int:
        return 4 if self.grad_reduce_in_fp32 else 2

    def describe(self) -> str:
        if not self.use_precision_aware_optimizer:
            text = "fp32 state"
        else:
            text = (f"precision-aware: moments {self.exp_avg_dtype}/{self.exp_avg_sq_dtype}, main params "
                    f"{self.main_params_dtype}")
        return text + ("" if self.grad_reduce_in_fp32 else ", BF16 grads")


def linear_parameters(model: Mapping[str, Any]) -> dict[str, int]:
    """Parameters of each linear of a transformer layer, whole (before tensor parallelism), by its name inside the
    layer as Megatron-Core (and ModelLayout.gpt) names it; a routed expert's two as ``mlp.experts.linear_fc1`` /
    ``linear_fc2`` (one expert's), a shared expert's (when the model has one) as ``mlp.shared_experts.*``."""
    h = int(model["hidden_size"])
    heads = int(model["num_attention_heads"])
    groups = int(model.get("num_query_groups") or heads)
    ffn = int(model.get("ffn_hidden_size") or 4 * h)
    gated = 2 if model.get("activation", "gelu") == "swiglu" else 1
    widths = {"mlp": ffn}
    if model.get("num_moe_experts") is not None:
        widths["mlp.experts"] = expert_ffn_size(model)
        if int(model.get("moe_shared_expert_intermediate_size") or 0):
            widths["mlp.shared_experts"] = int(model["moe_shared_expert_intermediate_size"])
    out = {"self_attention.linear_qkv": h * (h + 2 * groups * (h // heads)), "self_attention.linear_proj": h * h}
    for mlp, width in widths.items():
        out[f"{mlp}.linear_fc1"], out[f"{mlp}.linear_fc2"] = h * width * gated, width * h
    return out


def parameter_counts(model: Mapping[str, Any]) -> dict[str, int]:
    """Parameters of the embedding, the LM head (0 when tied), one dense transformer layer (of which in linears), the
    final norm: for a Llama-style (RMSNorm, no biases) or GPT-style config of the `model` group. An MoE model also
    has ``moe_layers`` (how many), ``experts`` (routed, per MoE layer), ``expert`` (one routed expert's two
    linears), ``router`` (its [experts, hidden] weight), ``shared_expert`` (0 without one) and ``moe_layer`` (an MoE
    layer without its routed experts: attention, norms, router, shared expert; ``moe_layer_linears`` of it in the
    tensor-parallel linears)."""
    h, layers = int(model["hidden_size"]), int(model["num_layers"])
    vocab = int(model["vocab_size"])
    lin = linear_parameters(model)
    attention = lin["self_attention.linear_qkv"] + lin["self_attention.linear_proj"]
    linears = attention + lin["mlp.linear_fc1"] + lin["mlp.linear_fc2"]
    norms = 2 * h * (1 if model.get("normalization", "LayerNorm") == "RMSNorm" else 2)
    tied = bool(model.get("share_embeddings_and_output_weights", False))
    counts = {"embedding": vocab * h, "output_layer": 0 if tied else vocab * h, "layer": linears + norms,
              "layer_linears": linears, "final_norm": norms // 2, "layers": layers}
    if model.get("num_moe_experts") is not None:  # an MoE layer: attention, norms, router, experts (no dense MLP)
        shared = lin.get("mlp.shared_experts.linear_fc1", 0) + lin.get("mlp.shared_experts.linear_fc2", 0)
        experts = int(model["num_moe_experts"])
        counts.update(moe_layers=len(moe_layer_pattern(model)), experts=experts, router=experts * h,
                      expert=lin["mlp.experts.linear_fc1"] + lin["mlp.experts.linear_fc2"], shared_expert=shared,
                      moe_layer_linears=attention + shared)
        counts["moe_layer"] = counts["moe_layer_linears"] + norms + counts["router"]
    return counts


PARTS = ("weights", "grads", "optimizer", "fp8_weights", "activations", "logits")


@dataclass(frozen=True)
class MemoryEstimate:
    weights: float
    grads: float
    optimizer: float
    fp8_weights: float
    activations: float
    logits: float
    stage: int
    """The pipeline stage this estimate is for (`estimate_memory`: the one that needs the most)."""
    layers: int = 0
    """Transformer layers on this stage (all its virtual chunks)."""
    in_flight: float = 1.0
    """Micro-batches whose activations the stage holds at its peak, in whole-stage micro-batches."""
    experts: tuple[tuple[str, float], ...] = ()
    """MoE: the routed experts' share of each part, (part, bytes), and the dispatch buffers (in activations)."""

    @property
    def total(self) -> float:
        return sum(getattr(self, name) for name in PARTS)

    @property
    def total_gib(self) -> float:
        return self.total / GIB

    def rows(self) -> list[tuple[str, float]]:
        """(part, GiB) for a table."""
        return [(name, getattr(self, name) / GIB) for name in PARTS] + [("total", self.total_gib)]


def microbatches_in_flight(layout: ParallelLayout, stage: int, num_microbatches: int | None = None) -> float:
    """Micro-batches whose activations `stage` holds at its peak, in whole-stage micro-batches: the warm-up forwards
    plus the one of the first 1F1B step, as Megatron-Core's ``get_pp_rank_microbatches`` counts them (capped by the
    micro-batches of a step, None = enough to fill the pipeline). 1F1B: pp - stage. Interleaved (vpp chunks, groups of
    pp micro-batches per chunk): (2 x (pp - stage - 1) + (vpp - 1) x pp + 1) chunk-micro-batches, each holding 1/vpp
    of the stage's layers; the first stage's pp + (pp - 1) / vpp."""
    if layout.pp == 1:
        return 1.0
    vpp = layout.vpp or 1
    warmup = layout.pp - stage - 1 if layout.vpp is None else 2 * (layout.pp - stage - 1) + (vpp - 1) * layout.pp
    chunk_microbatches = warmup + 1
    if num_microbatches is not None:
        chunk_microbatches = min(chunk_microbatches, num_microbatches * vpp)
    return chunk_microbatches / vpp


def _input_delta(storage: OperandStorage | None) -> tuple[float, float]:
    """What a quantized layer keeps of a linear's input beyond the BF16 estimate, bytes per element: (for an input
    the BF16 estimate counts once, the norm outputs and fc2's, fc1's of the routed rows; for one kept in BF16
    anyway, the attention output). TE keeps only the quantized copy (FP8 1 byte, NVFP4 0.5 + 1/16); the emulated
    backend the input in the layer's dtype and, where wgrad reuses fprop's copy, that copy too. None: a BF16 layer."""
    if storage is None:
        return 0.0, 0.0
    copy = storage.saved_inputs
    return copy - (0 if storage.keeps_inputs else 2), copy


def _attention_bytes_per_token(model: Mapping[str, Any], layout: ParallelLayout, *, storage: OperandStorage | None,
                               sequence_parallel: bool) -> float:
    """A layer's attention half per token: both residuals, the input norm's output, q/k/v, the attention output
    (``storage``: what the quantized layer keeps of its linears' inputs, None: BF16)."""
    h = int(model["hidden_size"])
    heads = int(model["num_attention_heads"])
    groups = int(model.get("num_query_groups") or heads)
    t = layout.tp
    replicated = t if sequence_parallel else 1  # norm inputs/outputs: split over TP only with sequence parallelism
    bf16 = 2 * (2 * h / replicated + h / replicated + (h + 2 * groups * (h // heads)) / t + h / t)
    # quantized (TE FP8): the norm output kept as FP8 (1 byte instead of 2), an FP8 copy of the attention output
    once, kept = _input_delta(storage)
    return bf16 + once * h / replicated + kept * h / t


def _activation_bytes_per_token_layer(model: Mapping[str, Any], layout: ParallelLayout, *,
                                      storage: OperandStorage | None, sequence_parallel: bool) -> float:
    """A dense layer per token: the attention half, the MLP's norm output, fc1's output and fc2's input."""
    h = int(model["hidden_size"])
    ffn = int(model.get("ffn_hidden_size") or 4 * h)
    gated = model.get("activation", "gelu") == "swiglu"
    t = layout.tp
    replicated = t if sequence_parallel else 1
    mlp = 2 * (h / replicated + (2 if gated else 1) * ffn / t + ffn / t)
    mlp += _input_delta(storage)[0] * (h / replicated + ffn / t)  # the norm output and fc2's input (TE FP8: 1 B)
    return _attention_bytes_per_token(model, layout, storage=storage, sequence_parallel=sequence_parallel) + mlp


FP8_ROWS_ALIGN = 16
"""Rows per expert GEMM that TE's FP8 GEMMs need a multiple of (Megatron-Core's get_fp8_align_size; 32 under MXFP8,
Blackwell only, not told apart here: a few rows per expert)."""


@dataclass(frozen=True)
class _MoELayerBytes:
    saved: float
    """What one MoE layer keeps for the backward pass of one micro-batch."""
    experts: float
    """Of which the routed experts' rows."""
    dispatch: float
    """Transient: one MoE layer's dispatch buffers."""


def _moe_layer_bytes(model: Mapping[str, Any], layout: ParallelLayout, *, storage: OperandStorage | None,
                     sequence_parallel: bool, tokens: float) -> _MoELayerBytes:
    """One MoE layer, one micro-batch of ``tokens`` tokens on this rank (after CP). The experts multiply the routed
    copies of the tokens: each token goes to top-k experts; with balanced routing a rank's experts get top-k x its
    tokens, all-gathered over the expert-TP ranks (each holding 1/TP of the sequence under sequence parallelism,
    which Megatron-Core requires for MoE with TP). Per routed row the experts keep fc1's input (h), fc1's output
    (2 x FFN for SwiGLU) and fc2's input (the router's probability applied in the activation), FP8 for the two
    inputs under FP8 (``storage``: what a quantized layer keeps of its linears' inputs; None: BF16). TE's FP8 GEMMs
    need each expert's rows padded to a multiple of 16 (NVFP4's 32): up to that many rows per local expert
    (with moe_router_padding_for_quantization the router pads each expert's share of every sending rank, and the
    padding rides through the dispatch). The router keeps its fp32 scores and probabilities (2 x 4 B per expert)
    and the norm output (BF16, its input). A shared expert keeps what a dense MLP of its width keeps. Dispatch:
    the permuted tokens sent and the experts' output before it is combined (two [rows, h] BF16 buffers; one
    without EP or expert TP, where no all-to-all copies them). Padded to capacity (moe_pad_expert_input_to_capacity),
    every expert holds moe_expert_capacity_factor x its balanced share of rows, padding included."""
    h = int(model["hidden_size"])
    gated = 2 if model.get("activation", "gelu") == "swiglu" else 1
    ffn = expert_ffn_size(model)
    shared = int(model.get("moe_shared_expert_intermediate_size") or 0)
    experts, topk = int(model["num_moe_experts"]), int(model.get("moe_router_topk", 2))
    t, etp = layout.tp, layout.expert_tp
    replicated = t if sequence_parallel else 1
    tokens_in = tokens / replicated  # the MoE layer's input on this rank
    rows = tokens_in * topk * etp
    capacity = model.get("moe_expert_capacity_factor")
    if capacity is not None and model.get("moe_pad_expert_input_to_capacity"):
        rows *= float(capacity)  # every expert padded to its capacity: factor x its balanced share
    align = storage.rows_align if storage is not None else 0
    router_pads = bool(model.get("moe_router_padding_for_quantization")) and align > 0
    pad = align * (experts * etp if router_pads else experts // layout.ep)
    once, kept = _input_delta(storage)  # (TE FP8: fc1's and fc2's inputs in 1 B, the shared fc1's an FP8 copy)
    row = 2 * (h + gated * ffn / etp + ffn / etp) + once * (h + ffn / etp)
    routed = (rows + pad) * row
    per_token = 2 * h / replicated + 8 * experts / replicated  # the norm output (router input), router scores
    if shared:
        per_token += 2 * (gated * shared / t + shared / t) + once * shared / t + kept * h / replicated
    saved = _attention_bytes_per_token(model, layout, storage=storage, sequence_parallel=sequence_parallel) \
        * tokens + per_token * tokens + routed
    buffers = 2 if layout.ep * etp > 1 else 1
    dispatch = buffers * (rows + (align * experts if router_pads else 0)) * h * 2
    return _MoELayerBytes(saved=saved, experts=routed, dispatch=dispatch)


def fp8_layers_of(recipe: Recipe, num_layers: int) -> frozenset[int]:
    """The transformer layers whose linears a recipe runs in FP8 (its layers.bf16_first / bf16_last left out)."""
    rules = recipe.layers
    return frozenset(range(rules.bf16_first, num_layers - rules.bf16_last))


def fp8_weight_copy_bytes(recipe: Recipe) -> float:
    """Bytes per linear parameter of Transformer Engine's quantized weight copies (rowwise + columnwise) under a
    recipe's weight scaling, with their scales: per-tensor 2; 128x128 blocks + 2 fp32 scales per block; MXFP8 + 2
    E8M0 scales per 32 elements; NVFP4 2 x (0.5 + 1 / 16): two E2M1 codes a byte and one E4M3 scale per 16 values in
    each copy, 16x16 weight blocks too (TE's scale tensor has the 1x16 shape: a 16x16 block's scale repeated over
    its 16 rows). The per-tensor fp32 amaxes and the scale tensors' padding to 128 x 4 are left out."""
    scaling = recipe.weights.scaling
    if scaling is Scaling.NVFP4:
        return 2 * NVFP4_BYTES
    if scaling is Scaling.MXFP8:
        return 2 + 2 / 32
    if scaling is Scaling.BLOCKWISE:
        rows, cols = recipe.weights.block
        return 2 + 2 * 4 / (rows * cols)
    return 2.0


NVFP4_BYTES = 0.5 + 1 / 16
"""One NVFP4 copy, bytes per element: E2M1 codes two a byte, one E4M3 block scale per 16 values."""
NVFP4_ROWS_ALIGN = 32
"""Rows per expert GEMM that TE's NVFP4 GEMMs need a multiple of (Megatron-Core's get_fp4_align_size)."""


@dataclass(frozen=True)
class OperandStorage:
    """What a run keeps of its quantized GEMM operands, per role (:func:`operand_storage_of`). The default is
    Transformer Engine under per-tensor FP8 (``--fp8``). Gradients add nothing that lasts: each backward GEMM
    quantizes them and frees the copies."""

    weight_copies: float = 2.0
    """Bytes per parameter of each quantized linear's persistent weight copies (:func:`fp8_weight_copy_bytes`;
    with ``fp8_param`` the weights themselves); 0 on the emulated backend, which caches none."""
    saved_weights: float = 0.0
    """Bytes per parameter that each forward saves for its backward, per micro-batch in flight: the emulated
    backend's dequantized weight, where dgrad reuses fprop's copy."""
    saved_inputs: float = 1.0
    """Bytes per element of the copy of each quantized linear's input kept for the wgrad GEMM: TE's FP8 copy 1,
    its NVFP4 columnwise copy 0.5 + 1/16; the emulated backend's dequantized copy (2) where wgrad reuses fprop's,
    else 0; 0 with BF16 activations."""
    keeps_inputs: bool = False
    """Whether the input itself stays too, in the layer's dtype (the emulated backend, or BF16 activations)."""
    rows_align: int = FP8_ROWS_ALIGN
    """Rows each routed expert's GEMM is padded to a multiple of (0: no padding, the emulated backend)."""
    weight_format: str = "fp8"
    """fp8 | nvfp4 | none: the weights role (``fp8_param`` stores FP8 weights only)."""
    backend: str = "te"
    """te: Transformer Engine's storage (NVFP4 packed: sm_100 and newer); emulated: what the emulated backend
    (any device, Hopper's NVFP4) holds."""
    label: str = "FP8"
    """The quantized formats, for the printout: FP8 | NVFP4 | NVFP4 + FP8."""
    note: str = ""
    """One line for the printout: a caveat (e.g. a per-role mix that Transformer Engine cannot run)."""

    def describe(self) -> str:
        """Which storage the estimate counts ('' for TE's FP8, the estimator's default)."""
        if self.backend == "emulated":
            return "as the emulated backend holds it: dequantized BF16 copies, no cached weight copies"
        if "NVFP4" in self.label:
            return "NVFP4 as Transformer Engine stores it on sm_100+: packed E2M1 + E4M3 scales per 16"
        return ""


TE_FP8 = OperandStorage()


def operand_storage_of(recipe: Recipe, *, emulated: bool = False) -> OperandStorage:
    """What a recipe's run keeps of its quantized operands, per role: Transformer Engine's storage (FP8 and NVFP4
    copies as TE lays them out; NVFP4 needs sm_100) or, ``emulated``, what the emulated backend holds. A recipe
    mixing NVFP4 with FP8 roles gets TE's per-role bytes and a note: TE runs no such mix, the emulated backend does."""
    weights, activations = recipe.policy(Role.WEIGHTS), recipe.policy(Role.ACTIVATIONS)
    fmt = "none" if not weights.is_fp8 else "nvfp4" if weights.scaling is Scaling.NVFP4 else "fp8"
    kinds = {recipe.policy(r).scaling is Scaling.NVFP4 for r in ROLES if recipe.policy(r).is_fp8}
    label = {frozenset({True}): "NVFP4", frozenset({True, False}): "NVFP4 + FP8"}.get(frozenset(kinds), "FP8")
    if emulated:
        return OperandStorage(weight_copies=0.0, saved_weights=2.0 if weights.one_copy_both_ways else 0.0,
                              saved_inputs=2.0 if activations.one_copy_both_ways else 0.0, keeps_inputs=True, rows_align=0,
                              weight_format=fmt, backend="emulated", label=label)
    nvfp4 = True in kinds
    note = ""
    if label == "NVFP4 + FP8":
        note = ("Transformer Engine runs no recipe mixing NVFP4 with FP8 roles (the emulated backend runs it: "
                "--emulated estimates what that holds); these are TE's bytes per role")
    x_bytes = 0.0 if not activations.is_fp8 else NVFP4_BYTES if activations.scaling is Scaling.NVFP4 else 1.0
    return OperandStorage(weight_copies=fp8_weight_copy_bytes(recipe), saved_inputs=x_bytes,
                          keeps_inputs=not activations.is_fp8, rows_align=NVFP4_ROWS_ALIGN if nvfp4 else FP8_ROWS_ALIGN,
                          weight_format=fmt, label=label, note=note)


def fp8_modules_of(recipe: Recipe, model: Mapping[str, Any]) -> frozenset[str]:
    """The linears (ModelLayout.gpt's names, every routed expert's own) that Transformer Engine keeps an FP8 weight
    copy of under a recipe: those whose weights the plan quantizes at its final stage (every FP8 role on), on the
    H200 the estimate is checked on. The plan applies the recipe's bf16_first / bf16_last, its bf16_modules patterns
    (e.g. '*experts*' keeps the experts BF16), its per-module policies (``modules:``) and fp8_output_layer (the LM
    head), so the estimate charges FP8 copies where the run makes them."""
    # (backend auto: a recipe asking for TE on a newer GPU is estimated as the H200 would run it, not refused)
    plan = PrecisionPlan(dataclasses.replace(recipe, backend=Backend.AUTO), _model_layout(model),
                         Hardware.target((9, 0)))
    final = plan.at(plan.final_step())
    return frozenset(name for name, module in final.modules.items()
                     if any(role is Role.WEIGHTS and policy is not None
                            for gemm in module.gemms.values() for role, policy in gemm.operands))


@dataclass(frozen=True)
class _Run:
    """What every pipeline stage's estimate shares (`estimate_stages`' inputs, checked, and what follows from them)."""

    model: Mapping[str, Any]
    layout: ParallelLayout
    counts: dict[str, int]
    opt: OptimizerPrecision
    fp8_param: bool
    storage: OperandStorage
    recompute: str | None
    num_microbatches: int | None
    sequence_parallel: bool
    tokens: float
    """Tokens of one micro-batch on this rank (after CP)."""
    moe_layers: frozenset[int]
    fp8_on: frozenset[int]
    """The layers that run FP8: their activations kept as FP8 keeps them (the norm outputs, fc2's input, ...)."""
    fp8_linears: tuple[tuple[int | None, int | None, int], ...]
    """Each linear with a quantized weight: (its layer, None for the LM head; the EP rank holding it, None for a
    linear every EP rank has; its parameters before tensor parallelism)."""
    per_layer: dict[bool, float]
    """A dense layer's activations of one micro-batch, BF16 / FP8 (key: FP8)."""
    per_moe_layer: dict[bool, _MoELayerBytes]
    shards: int
    """Ranks the distributed optimizer shards the dense parameters' state over."""
    expert_shards: int

    def state_bytes(self, params: float, fp8_stored: float) -> float:
        """Optimizer state (main params and moments) of ``params``, ``fp8_stored`` of them stored as FP8."""
        opt = self.opt
        return ((params - fp8_stored) * (opt.moment_bytes + opt.main_param_bytes(fp8_param=self.fp8_param))
                + fp8_stored * (opt.moment_bytes + opt.main_param_bytes(fp8_param=True)))


def _check_estimate(model: Mapping[str, Any], layout: ParallelLayout, *, fp8: bool, fp8_param: bool,
                    opt: OptimizerPrecision, distributed_optimizer: bool, sequence_parallel: bool,
                    storage: OperandStorage) -> None:
    """ValueError naming the key unless the engine trains this model at this layout and precision."""
    if fp8_param and not fp8:
        raise ValueError("fp8_param: FP8-stored weights need an FP8 recipe (--fp8)")
    if fp8_param and storage.backend == "emulated":  # the plan's fp8_param_problem, in the estimator's words
        raise ValueError("fp8_param: true needs the te backend (Transformer Engine keeps the weights as FP8 "
                         "tensors), and this estimates the emulated one; set fp8_param: false or drop --emulated")
    if fp8_param and storage.weight_format == "nvfp4":
        raise ValueError("fp8_param: true with weights.scaling: nvfp4: Transformer Engine 2.20 stores FP8 weights "
                         "only (delayed, tensorwise, blockwise, mxfp8), not NVFP4 ones; set fp8_param: false")
    if (fp8_param or opt.use_precision_aware_optimizer) and not distributed_optimizer:
        what = "fp8_param" if fp8_param else "trainer.use_precision_aware_optimizer"
        raise ValueError(f"{what}: needs the distributed optimizer (trainer.use_distributed_optimizer=true)")
    layout.check(int(model["num_layers"]))
    if model.get("num_moe_experts") is None:
        layout.check_experts(None)  # no ep / etp without routed experts
    else:  # the trainer's rules, worded for --layout
        layout.check_experts(int(model["num_moe_experts"]), expert_ffn_size(model))
        if layout.tp > 1 and not sequence_parallel:  # MoELayer.forward raises it in training
            raise ValueError("sequence_parallel: Megatron-Core trains MoE layers with TP > 1 only with sequence "
                             "parallelism (trainer.sequence_parallel=true)")


def _fp8_linears(model: Mapping[str, Any], layout: ParallelLayout, fp8_modules: Collection[str]
                 ) -> tuple[tuple[int | None, int | None, int], ...]:
    """`_Run.fp8_linears` of the named linears (ModelLayout.gpt's names)."""
    sizes = linear_parameters(model)
    experts = int(model.get("num_moe_experts") or 0)
    out = []
    for name in fp8_modules:
        layer, expert = ModelLayout.layer_of(name), ModelLayout.expert_of(name)
        if layer is None:  # the LM head (fp8_output_layer): its [vocab, hidden] weight
            out.append((None, None, int(model["vocab_size"]) * int(model["hidden_size"])))
            continue
        local = re.sub(r"^.*?\.layers\.\d+\.", "", re.sub(r"\.local_experts\.\d+", "", name))
        rank = None if expert is None else expert // (experts // layout.ep)  # Megatron-Core's contiguous split
        out.append((layer, rank, sizes[local]))
    return tuple(out)


def _model_layout(model: Mapping[str, Any]) -> ModelLayout:
    """The plan's view of a model config, as megatron/model_config.py's layout_of (a floor above this one) gives it."""
    layers = moe_layer_pattern(model)
    shared = model.get("moe_shared_expert_intermediate_size") is not None
    return ModelLayout.gpt(int(model["num_layers"]),
                           moe=MoEShape(int(model["num_moe_experts"]), layers, shared) if layers else None)


def _layer_modules(model: Mapping[str, Any], layers: Collection[int]) -> frozenset[str]:
    """Every linear of ``layers`` (ModelLayout.gpt's names; no LM head)."""
    return frozenset(n for n in _model_layout(model).module_names if ModelLayout.layer_of(n) in layers)


def _run_of(model: Mapping[str, Any], layout: ParallelLayout, *, micro_batch_size: int, seq_length: int, fp8: bool,
            distributed_optimizer: bool, sequence_parallel: bool | None, recompute: str | None,
            num_microbatches: int | None, optimizer: OptimizerPrecision | None, fp8_param: bool,
            fp8_layers: Collection[int] | None, fp8_modules: Collection[str] | None,
            storage: OperandStorage | None) -> _Run:
    """`estimate_stages`' inputs, checked, with what every stage shares."""
    opt = optimizer or OptimizerPrecision()
    storage = storage or TE_FP8
    sp = layout.tp > 1 if sequence_parallel is None else sequence_parallel
    _check_estimate(model, layout, fp8=fp8, fp8_param=fp8_param, opt=opt, distributed_optimizer=distributed_optimizer,
                    sequence_parallel=sp, storage=storage)
    counts = parameter_counts(model)
    moe_layers = frozenset(moe_layer_pattern(model))
    if not fp8:
        fp8_on, fp8_modules = frozenset(), frozenset()
    elif fp8_layers is None and fp8_modules is not None:  # a layer runs FP8 when a linear of it does
        fp8_on = frozenset(ModelLayout.layer_of(n) for n in fp8_modules) - {None}
    else:
        fp8_on = frozenset(range(counts["layers"]) if fp8_layers is None else fp8_layers)
    if fp8_modules is None:
        fp8_modules = _layer_modules(model, fp8_on)
    tokens = micro_batch_size * seq_length / layout.cp
    kept = {False: None, True: storage}  # what a BF16 / a quantized layer keeps of its linears' inputs
    per_layer = {on: _activation_bytes_per_token_layer(model, layout, storage=kept[on], sequence_parallel=sp) * tokens
                 for on in (False, True)}
    per_moe_layer = {on: _moe_layer_bytes(model, layout, storage=kept[on], sequence_parallel=sp, tokens=tokens)
                     for on in (False, True)} if moe_layers else {}
    return _Run(model, layout, counts, opt, fp8_param, storage, recompute, num_microbatches, sp, tokens,
                moe_layers, fp8_on, _fp8_linears(model, layout, fp8_modules), per_layer, per_moe_layer,
                shards=layout.dp * layout.cp if distributed_optimizer else 1,
                expert_shards=layout.expert_dp if distributed_optimizer else 1)


def estimate_stages(model: Mapping[str, Any], layout: ParallelLayout, *, micro_batch_size: int, seq_length: int,
                    fp8: bool, distributed_optimizer: bool = True, sequence_parallel: bool | None = None,
                    recompute: str | None = None, num_microbatches: int | None = None,
                    optimizer: OptimizerPrecision | None = None, fp8_param: bool = False,
                    fp8_layers: Collection[int] | None = None, fp8_modules: Collection[str] | None = None,
                    storage: OperandStorage | None = None) -> list[MemoryEstimate]:
    """Bytes per GPU on each pipeline stage, first to last (see the module docstring). ``fp8_layers``: the layers
    whose activations run FP8 (None: those of ``fp8_modules``, else all, with ``fp8``); ``fp8_modules``: the linears
    with FP8 weight copies (ModelLayout.gpt's names, :func:`fp8_modules_of`; None: every linear of the FP8 layers);
    ``storage``: what the run keeps of the quantized operands, per role (:func:`operand_storage_of`; None:
    Transformer Engine's per-tensor FP8)."""
    run = _run_of(model, layout, micro_batch_size=micro_batch_size, seq_length=seq_length, fp8=fp8,
                  distributed_optimizer=distributed_optimizer, sequence_parallel=sequence_parallel,
                  recompute=recompute, num_microbatches=num_microbatches, optimizer=optimizer, fp8_param=fp8_param,
                  fp8_layers=fp8_layers, fp8_modules=fp8_modules, storage=storage)
    stage_layers: dict[int, list[int]] = {s: [] for s in range(layout.pp)}
    for (stage, _), chunk in sorted(layout.chunk_layers(run.counts["layers"]).items()):
        stage_layers[stage] += list(chunk)
    return [_stage_estimate(run, stage, stage_layers[stage]) for stage in range(layout.pp)]


def _stage_fp8_copies(run: _Run, here: Collection[int], last: bool, *, saved: bool = False
                      ) -> tuple[float, float, float]:
    """This rank's parameters with FP8 weight copies on a stage: (its layers' linears, the LM head's, its routed
    experts' on the EP rank that holds the most of them), each over its tensor-parallel ranks. ``saved``: only
    those whose forward saves a dequantized copy for the backward (the emulated backend's)."""
    layers = head = 0
    experts: dict[int, int] = {}
    if saved and not run.storage.saved_weights:
        return 0.0, 0.0, 0.0
    for layer, rank, params in run.fp8_linears:
        if layer is None:
            head += params if last else 0
        elif layer in here and rank is None:
            layers += params
        elif layer in here:
            experts[rank] = experts.get(rank, 0) + params
    tp = run.layout.tp
    return layers / tp, head / tp, max(experts.values(), default=0) / run.layout.expert_tp


def _saved_weight_copies(run: _Run, here: list[int], last: bool, flight: float) -> tuple[float, float]:
    """Bytes of the dequantized weights the stage's forwards save for their backward (the emulated backend), all
    and the routed experts': per micro-batch in flight; with full recompute, those of the one layer recomputed (the
    largest; the LM head's beside it)."""
    if not run.storage.saved_weights:
        return 0.0, 0.0
    per_byte = run.storage.saved_weights
    if run.recompute == "full":
        one = [_stage_fp8_copies(run, [i], False, saved=True) for i in here]
        dense, experts = max(((d + e, e) for d, _, e in one), default=(0.0, 0.0))
        head = _stage_fp8_copies(run, (), last, saved=True)[1]
        return per_byte * (dense + head), per_byte * experts
    layers, head, experts = _stage_fp8_copies(run, here, last, saved=True)
    return per_byte * flight * (layers + head + experts), per_byte * flight * experts


def _stage_activations(run: _Run, here: list[int], flight: float) -> tuple[float, float, float]:
    """A stage's activations at its peak: (all, the routed experts' rows, the dispatch buffers), the buffers
    included in all."""
    n = {(moe, on): sum(1 for i in here if (i in run.moe_layers) == moe and (i in run.fp8_on) == on)
         for moe in (False, True) for on in (False, True)}
    per_layer, per_moe = run.per_layer, run.per_moe_layer
    if run.recompute == "full":  # each layer's input kept, one layer's activations while it is recomputed
        largest = max([per_layer[on] for on in (False, True) if n[False, on]]
                      + [per_moe[on].saved for on in (False, True) if n[True, on]], default=0.0)
        h = int(run.model["hidden_size"])
        acts = flight * len(here) * run.tokens * 2 * h / (run.layout.tp if run.sequence_parallel else 1) + largest
    else:
        moe_acts = sum(n[True, on] * per_moe[on].saved for on in (False, True)) if per_moe else 0.0
        acts = flight * (n[False, False] * per_layer[False] + n[False, True] * per_layer[True] + moe_acts)
    dispatch = max((per_moe[on].dispatch for on in (False, True) if n[True, on]), default=0.0)
    experts = flight * sum(n[True, on] * per_moe[on].experts for on in (False, True) if n[True, on])
    return acts + dispatch, experts, dispatch


def _stage_estimate(run: _Run, stage: int, here: list[int]) -> MemoryEstimate:
    """One pipeline stage holding layers ``here``."""
    counts, layout, grad_bytes = run.counts, run.layout, run.opt.grad_bytes
    first, last = stage == 0, stage == layout.pp - 1
    moe = sum(1 for i in here if i in run.moe_layers)
    # tied embeddings: a last stage that is not the first keeps its own copy of the embedding for the LM head
    # (Megatron-Core's GPTModel allocates output_layer's weight there, synchronised with the first stage's)
    head = counts["output_layer"] if counts["output_layer"] or first else counts["embedding"]
    params = ((len(here) - moe) * counts["layer"] + moe * (counts.get("moe_layer", 0) - counts.get("router", 0))
              + (counts["embedding"] if first else 0) + ((head + counts["final_norm"]) if last else 0)) / layout.tp
    params += moe * counts.get("router", 0)  # the router's weight is whole on every tensor-parallel rank
    # this rank's routed experts (1/EP of them, each 1/expert-TP)
    experts = moe * (counts.get("expert", 0) * counts.get("experts", 0) // layout.ep / layout.expert_tp)
    fp8_linears, fp8_head, fp8_experts = _stage_fp8_copies(run, here, last)
    copy_bytes = run.storage.weight_copies
    # fp8_param: the FP8 layers' linear weights stored as FP8; norms, router, embedding, head stay BF16
    stored, stored_experts = (fp8_linears, fp8_experts) if run.fp8_param else (0.0, 0.0)
    flight = microbatches_in_flight(layout, stage, run.num_microbatches)
    activations, expert_acts, dispatch = _stage_activations(run, here, flight)
    saved_copies, saved_expert_copies = _saved_weight_copies(run, here, last, flight)
    expert_state = run.state_bytes(experts, stored_experts) / run.expert_shards
    expert_parts = () if not run.moe_layers else (
        ("weights", 2 * (experts - stored_experts)), ("grads", grad_bytes * experts), ("optimizer", expert_state),
        ("fp8_weights", copy_bytes * fp8_experts + saved_expert_copies), ("activations", expert_acts),
        ("dispatch", dispatch))
    logits = 8 * run.tokens * int(run.model["vocab_size"]) / layout.tp if last else 0.0
    return MemoryEstimate(weights=2 * (params - stored) + 2 * (experts - stored_experts),
                          grads=grad_bytes * params + grad_bytes * experts,
                          optimizer=run.state_bytes(params, stored) / run.shards + expert_state,
                          fp8_weights=copy_bytes * (fp8_linears + fp8_head + fp8_experts) + saved_copies,
                          activations=activations, logits=logits, stage=stage, layers=len(here), in_flight=flight,
                          experts=expert_parts)


def estimate_memory(model: Mapping[str, Any], layout: ParallelLayout, **kwargs: Any) -> MemoryEstimate:
    """Bytes per GPU on the pipeline stage that needs the most (the first of equals); the keywords of
    `estimate_stages`."""
    return max(estimate_stages(model, layout, **kwargs), key=lambda s: s.total)


def format_estimate(name: str, layout: ParallelLayout, estimate: MemoryEstimate, *, micro_batch_size: int,
                    seq_length: int, fp8: bool, distributed_optimizer: bool, fp8_param: bool = False,
                    optimizer: OptimizerPrecision | None = None, stages: list[MemoryEstimate] | None = None,
                    recipe: str | None = None, storage: OperandStorage | None = None) -> str:
    """The estimate as the lines `fp8-recipes memory` prints: the peak stage's parts, then one row per stage."""
    opt = optimizer or OptimizerPrecision()
    storage = storage or TE_FP8
    scaling = f"recipe {recipe}" if recipe else "per-tensor scaling"
    scaling += f"; {storage.describe()}" if storage.describe() else ""
    precision = "BF16" if not fp8 else f"{storage.label} ({scaling}" + (", FP8-stored weights)" if fp8_param else ")")
    if recipe and not fp8:
        precision = f"BF16 (recipe {recipe})"
    lines = [(f"{name}: {layout.describe()}, micro-batch {micro_batch_size}, seq {seq_length}, {precision}, "
              f"{'distributed' if distributed_optimizer else 'replicated'} optimizer ({opt.describe()}); "
              f"pipeline stage {estimate.stage}")]
    lines += [f"  note: {storage.note}"] if fp8 and storage.note else []
    lines += [f"  {part:<12} {gib:8.1f} GiB" for part, gib in estimate.rows()]
    if estimate.experts:
        shares = dict(estimate.experts)
        lines.append(f"  of which the routed experts (ep={layout.ep}, expert TP {layout.expert_tp}, optimizer "
                     f"state sharded over expert DP {layout.expert_dp if distributed_optimizer else 1}): "
                     + ", ".join(f"{part} {shares[part] / GIB:.1f}" for part in PARTS if part in shares)
                     + f" GiB; activations include {shares['dispatch'] / GIB:.2f} GiB of dispatch buffers")
    if stages and len(stages) > 1:
        lines.append(f"  per stage, GiB ({len(stages)} stages; peak: stage {estimate.stage}):")
        lines.append(f"  {'stage':>5} {'layers':>6} {'in flight':>9} " + " ".join(f"{p:>11}" for p in PARTS)
                     + f" {'total':>7}")
        for s in stages:
            lines.append(f"  {s.stage:>5} {s.layers:>6} {s.in_flight:>9.2f} "
                         + " ".join(f"{getattr(s, p) / GIB:>11.1f}" for p in PARTS) + f" {s.total_gib:>7.1f}")
    return "\n".join(lines)
