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
- FP8 weight copies (per-tensor FP8 recipes): Transformer Engine keeps each FP8 linear's weight quantized, rowwise
  and columnwise: 2 bytes per linear parameter (with ``fp8_param`` these are the weights themselves);
- activations: what the backward pass keeps per token and layer (Transformer Engine's fused attention keeps no
  s x s scores): the residual and norm inputs and outputs (h each), q/k/v (h + 2 x groups x head dim), the
  attention output (h), the MLP's fc1 output (2 x ffn for SwiGLU, ffn otherwise) and fc2's input (ffn), in BF16;
  under FP8 the norm outputs and fc2's input are kept as FP8 (1 byte) and the attention output gets an FP8 copy.
  Tensor parallelism divides the sharded ones, sequence parallelism the rest, context parallelism all. Each stage
  holds the activations of the micro-batches in flight at its peak (`microbatches_in_flight`, from Megatron-Core's
  schedules); full recompute keeps only each layer's input, plus one layer's activations while it is recomputed;
- logits: the last stage's [s, b, vocab / tp] logits in BF16, their fp32 copy in the fused cross-entropy and their
  BF16 gradient: 8 bytes per element (one micro-batch: the last stage runs each backward right after its forward).

The first stage holds the embedding, the last the LM head (with tied embeddings and pp > 1, its own copy of the
embedding) and the final norm, every stage num_layers / pp layers
(the trainer splits layers evenly: it has no uneven-split keys). Checked against peaks measured on one H200
(docs/scale.md, tests/unit/test_memory.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Mapping
from typing import Any

from fp8_recipes.plan.precision import ParallelLayout

__all__ = ["GIB", "LLAMA3", "MemoryEstimate", "OptimizerPrecision", "estimate_memory", "estimate_stages",
           "format_estimate", "microbatches_in_flight", "parameter_counts"]

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


def parameter_counts(model: Mapping[str, Any]) -> dict[str, int]:
    """Parameters of the embedding, the LM head (0 when tied), one transformer layer (of which in linears), the final
    norm: for a Llama-style (RMSNorm, no biases) or GPT-style config of the `model` group."""
    h, layers = int(model["hidden_size"]), int(model["num_layers"])
    heads = int(model["num_attention_heads"])
    groups = int(model.get("num_query_groups") or heads)
    ffn = int(model.get("ffn_hidden_size") or 4 * h)
    vocab = int(model["vocab_size"])
    head_dim = h // heads
    gated = model.get("activation", "gelu") == "swiglu"
    qkv = h * (h + 2 * groups * head_dim)
    linears = qkv + h * h + h * ffn * (2 if gated else 1) + ffn * h
    norms = 2 * h * (1 if model.get("normalization", "LayerNorm") == "RMSNorm" else 2)
    tied = bool(model.get("share_embeddings_and_output_weights", False))
    return {"embedding": vocab * h, "output_layer": 0 if tied else vocab * h, "layer": linears + norms,
            "layer_linears": linears, "final_norm": norms // 2, "layers": layers}


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


def _activation_bytes_per_token_layer(model: Mapping[str, Any], layout: ParallelLayout, *, fp8: bool,
                                      sequence_parallel: bool) -> float:
    h = int(model["hidden_size"])
    heads = int(model["num_attention_heads"])
    groups = int(model.get("num_query_groups") or heads)
    ffn = int(model.get("ffn_hidden_size") or 4 * h)
    gated = model.get("activation", "gelu") == "swiglu"
    t = layout.tp
    replicated = t if sequence_parallel else 1  # norm inputs/outputs: split over TP only with sequence parallelism
    residual, norm_out = 2 * h / replicated, 2 * h / replicated  # two norms per layer: input and output of each
    sharded = (h + 2 * groups * (h // heads)) / t + h / t + (2 if gated else 1) * ffn / t + ffn / t
    bf16 = 2 * (residual + norm_out + sharded)
    if not fp8:
        return bf16
    # FP8: the two norm outputs and fc2's input kept as FP8 (1 byte instead of 2), an FP8 copy of the attention output
    return bf16 - norm_out - ffn / t + h / t


def estimate_stages(model: Mapping[str, Any], layout: ParallelLayout, *, micro_batch_size: int, seq_length: int,
                    fp8: bool, distributed_optimizer: bool = True, sequence_parallel: bool | None = None,
                    recompute: str | None = None, num_microbatches: int | None = None,
                    optimizer: OptimizerPrecision | None = None, fp8_param: bool = False) -> list[MemoryEstimate]:
    """Bytes per GPU on each pipeline stage, first to last (see the module docstring)."""
    opt = optimizer or OptimizerPrecision()
    if fp8_param and not fp8:
        raise ValueError("fp8_param: FP8-stored weights need an FP8 recipe (--fp8)")
    if (fp8_param or opt.use_precision_aware_optimizer) and not distributed_optimizer:
        what = "fp8_param" if fp8_param else "trainer.use_precision_aware_optimizer"
        raise ValueError(f"{what}: needs the distributed optimizer (trainer.use_distributed_optimizer=true)")
    counts = parameter_counts(model)
    layout.check(counts["layers"])
    sp = layout.tp > 1 if sequence_parallel is None else sequence_parallel
    per_stage_layers = counts["layers"] // layout.pp
    tokens = micro_batch_size * seq_length / layout.cp  # per micro-batch, on this rank
    per_layer = _activation_bytes_per_token_layer(model, layout, fp8=fp8, sequence_parallel=sp) * tokens
    h = int(model["hidden_size"])
    shards = layout.dp * layout.cp if distributed_optimizer else 1
    stages = []
    for stage in range(layout.pp):
        first, last = stage == 0, stage == layout.pp - 1
        # tied embeddings: a last stage that is not the first keeps its own copy of the embedding for the LM head
        # (Megatron-Core's GPTModel allocates output_layer's weight there, synchronised with the first stage's)
        head = counts["output_layer"] if counts["output_layer"] or first else counts["embedding"]
        params = (per_stage_layers * counts["layer"] + (counts["embedding"] if first else 0)
                  + ((head + counts["final_norm"]) if last else 0)) / layout.tp
        linears = per_stage_layers * counts["layer_linears"] / layout.tp
        fp8_stored = linears if fp8_param else 0.0  # the FP8 layers' linear weights; norms, embedding, head stay BF16
        state = ((params - fp8_stored) * (opt.moment_bytes + opt.main_param_bytes(fp8_param=fp8_param))
                 + fp8_stored * (opt.moment_bytes + opt.main_param_bytes(fp8_param=True)))
        flight = microbatches_in_flight(layout, stage, num_microbatches)
        if recompute == "full":
            acts = flight * per_stage_layers * tokens * 2 * h / (layout.tp if sp else 1) + per_layer
        else:
            acts = flight * per_stage_layers * per_layer
        logits = 8 * tokens * int(model["vocab_size"]) / layout.tp if last else 0.0
        stages.append(MemoryEstimate(weights=2 * (params - fp8_stored), grads=opt.grad_bytes * params,
                                     optimizer=state / shards, fp8_weights=2 * linears if fp8 else 0.0,
                                     activations=acts, logits=logits, stage=stage, layers=per_stage_layers,
                                     in_flight=flight))
    return stages


def estimate_memory(model: Mapping[str, Any], layout: ParallelLayout, **kwargs: Any) -> MemoryEstimate:
    """Bytes per GPU on the pipeline stage that needs the most (the first of equals); the keywords of
    `estimate_stages`."""
    return max(estimate_stages(model, layout, **kwargs), key=lambda s: s.total)


def format_estimate(name: str, layout: ParallelLayout, estimate: MemoryEstimate, *, micro_batch_size: int,
                    seq_length: int, fp8: bool, distributed_optimizer: bool, fp8_param: bool = False,
                    optimizer: OptimizerPrecision | None = None,
                    stages: list[MemoryEstimate] | None = None) -> str:
    """The estimate as the lines `fp8-recipes memory` prints: the peak stage's parts, then one row per stage."""
    opt = optimizer or OptimizerPrecision()
    precision = "BF16" if not fp8 else "FP8 (per-tensor scaling" + (", FP8-stored weights)" if fp8_param else ")")
    lines = [(f"{name}: {layout.describe()}, micro-batch {micro_batch_size}, seq {seq_length}, {precision}, "
              f"{'distributed' if distributed_optimizer else 'replicated'} optimizer ({opt.describe()}); "
              f"pipeline stage {estimate.stage}")]
    lines += [f"  {part:<12} {gib:8.1f} GiB" for part, gib in estimate.rows()]
    if stages and len(stages) > 1:
        lines.append(f"  per stage, GiB ({len(stages)} stages; peak: stage {estimate.stage}):")
        lines.append(f"  {'stage':>5} {'layers':>6} {'in flight':>9} " + " ".join(f"{p:>11}" for p in PARTS)
                     + f" {'total':>7}")
        for s in stages:
            lines.append(f"  {s.stage:>5} {s.layers:>6} {s.in_flight:>9.2f} "
                         + " ".join(f"{getattr(s, p) / GIB:>11.1f}" for p in PARTS) + f" {s.total_gib:>7.1f}")
    return "\n".join(lines)
