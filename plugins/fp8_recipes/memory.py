"""Memory per GPU of a Megatron-Core GPT at a parallel layout: weights, gradients, optimizer state, FP8 weight copies,
activations and the LM head's logits, for the GPU whose pipeline stage needs the most.

    estimate = estimate_memory(model_cfg, ParallelLayout(tp=8, pp=8, dp=16), micro_batch_size=1, seq_length=8192,
                               fp8=True, distributed_optimizer=True)
    estimate.total_gib, estimate.rows()

Pure arithmetic (no torch), in bytes, what this project's engine allocates (training/engine.py, Megatron-Core 0.19
with Transformer Engine's layers):
- weights: BF16, 2 bytes per parameter of the stage's shard (TP splits the linears, the embedding and the LM head);
- gradients: DDP's fp32 buffer (``grad_reduce_in_fp32``), 4 bytes per parameter;
- optimizer: fp32 main params + Adam's two moments, 12 bytes per parameter, divided over the data x context
  parallel ranks with the distributed optimizer;
- FP8 weight copies (per-tensor FP8 recipes): Transformer Engine keeps each FP8 linear's weight quantized, rowwise
  and columnwise: 2 bytes per linear parameter;
- activations: what the backward pass keeps per token and layer (Transformer Engine's fused attention keeps no
  s x s scores): the residual and norm inputs and outputs (h each), q/k/v (h + 2 x groups x head dim), the
  attention output (h), the MLP's fc1 output (2 x ffn for SwiGLU, ffn otherwise) and fc2's input (ffn), in BF16;
  under FP8 the norm outputs and fc2's input are kept as FP8 (1 byte) and the attention output gets an FP8 copy.
  Tensor parallelism divides the sharded ones, sequence parallelism the rest, context parallelism all. 1F1B keeps
  ``pp`` micro-batches in flight on the first stage (``pp + (pp - 1) / vpp`` interleaved); full recompute keeps
  only each layer's input, plus one layer's activations while it is recomputed;
- logits: the last stage's [s, b, vocab / tp] logits in BF16, their fp32 copy in the fused cross-entropy and their
  BF16 gradient: 8 bytes per element.

Checked against peaks measured on one H200 (docs/scale.md, tests/unit/test_memory.py): llama3_8b_8l, micro-batch 2,
seq 4096, BF16 65.4 GiB measured / 63.2 estimated, delayed 67.5 / 65.3.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from fp8_recipes.plan import ParallelLayout

__all__ = ["MemoryEstimate", "estimate_memory", "parameter_counts", "GIB", "LLAMA3", "format_estimate"]

GIB = 2**30

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


@dataclass(frozen=True)
class MemoryEstimate:
    weights: float
    grads: float
    optimizer: float
    fp8_weights: float
    activations: float
    logits: float
    stage: int
    """The pipeline stage this estimate is for (the one that needs the most)."""

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.fp8_weights + self.activations + self.logits

    @property
    def total_gib(self) -> float:
        return self.total / GIB

    def rows(self) -> list[tuple[str, float]]:
        """(part, GiB) for a table."""
        return [(name, getattr(self, name) / GIB) for name in
                ("weights", "grads", "optimizer", "fp8_weights", "activations", "logits")] + [("total", self.total_gib)]


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


def estimate_memory(model: Mapping[str, Any], layout: ParallelLayout, *, micro_batch_size: int, seq_length: int,
                    fp8: bool, distributed_optimizer: bool = True, sequence_parallel: bool | None = None,
                    recompute: str | None = None, num_microbatches: int | None = None) -> MemoryEstimate:
    """Bytes per GPU on the pipeline stage that needs the most (see the module docstring)."""
    counts = parameter_counts(model)
    layout.check(counts["layers"])
    sp = layout.tp > 1 if sequence_parallel is None else sequence_parallel
    per_stage_layers = counts["layers"] // layout.pp
    tokens = micro_batch_size * seq_length / layout.cp  # per micro-batch, on this rank
    in_flight = layout.pp if layout.vpp is None else layout.pp + (layout.pp - 1) / layout.vpp
    if num_microbatches is not None:
        in_flight = min(in_flight, num_microbatches)
    per_layer = _activation_bytes_per_token_layer(model, layout, fp8=fp8, sequence_parallel=sp) * tokens
    h = int(model["hidden_size"])
    best: MemoryEstimate | None = None
    for stage in range(layout.pp):
        first, last = stage == 0, stage == layout.pp - 1
        params = (per_stage_layers * counts["layer"] + (counts["embedding"] if first else 0)
                  + ((counts["output_layer"] + counts["final_norm"]) if last else 0)) / layout.tp
        linears = per_stage_layers * counts["layer_linears"] / layout.tp
        shards = layout.dp * layout.cp if distributed_optimizer else 1
        # micro-batches in flight on this stage: pp - stage under 1F1B (the first stage holds the most)
        flight = max(1.0, in_flight - stage)
        if recompute == "full":
            acts = flight * per_stage_layers * tokens * 2 * h / (layout.tp if sp else 1) + per_layer
        else:
            acts = flight * per_stage_layers * per_layer
        logits = 8 * tokens * int(model["vocab_size"]) / layout.tp if last else 0.0
        estimate = MemoryEstimate(weights=2 * params, grads=4 * params, optimizer=12 * params / shards,
                                  fp8_weights=2 * linears if fp8 else 0.0, activations=acts, logits=logits,
                                  stage=stage)
        if best is None or estimate.total > best.total:
            best = estimate
    assert best is not None
    return best


def format_estimate(name: str, layout: ParallelLayout, estimate: MemoryEstimate, *, micro_batch_size: int,
                    seq_length: int, fp8: bool, distributed_optimizer: bool) -> str:
    """The estimate as the lines `fp8-recipes memory` prints."""
    lines = [f"{name}: {layout.describe()}, micro-batch {micro_batch_size}, seq {seq_length}, "
             f"{'FP8 (per-tensor scaling)' if fp8 else 'BF16'}, "
             f"{'distributed' if distributed_optimizer else 'replicated'} optimizer; pipeline stage {estimate.stage}"]
    lines += [f"  {part:<12} {gib:8.1f} GiB" for part, gib in estimate.rows()]
    return "\n".join(lines)
