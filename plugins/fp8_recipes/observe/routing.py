"""Routing statistics of a Mixture-of-Experts model: the tokens each expert receives per step, and the imbalance.

    routing = RoutingRecorder.attach(transformer_layers(chunks), run_dir, write=rank_writes)  # None: a dense model
    precision = ObservedPrecision(precision, routing)  # observe/recorder.py's: tells it each step begins
    ... train ...
    routing.close()

``routing.jsonl`` in the run directory: one row per training step and MoE layer,
``{"step": N, "layer": L, "tokens": [t_0, ..., t_E-1], "imbalance": max / mean, "idle": experts with no token}``,
experts by global number. Counted from what Megatron-Core hands each MoE layer's experts module (its
``tokens_per_expert`` argument: SequentialMLP's and TE's grouped experts' alike), summed over the step's
micro-batches; training forwards only (evaluation runs without gradients) and once under activation recompute
(Megatron-Core's first, gradient-free pass is not counted, its replay is). The counts are this rank's experts': on
several data-parallel ranks the first one's share of the batch, as for the numerics rows. Under expert parallelism
(EP > 1) each rank holds 1/EP of the experts, which receive the tokens of the EP group's ranks (Megatron-Core's
dispatcher), so the counts are summed over the expert-parallel group once per step (``group``) and a row covers every
expert: the tokens of that group's micro-batches. Cost: one small integer tensor per MoE layer and micro-batch,
copied to the host once per step (and one all-reduce of [layers x experts] integers at EP > 1).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from fp8_recipes.rundir import ROUTING, jsonable

__all__ = ["RoutingRecorder", "routing_row"]


def routing_row(step: int, layer: int, tokens: list[int]) -> dict[str, Any]:
    """One row: the counts, their max over their mean (1.0 = perfectly balanced), the experts without a token."""
    mean = sum(tokens) / len(tokens)
    return {"step": step, "layer": layer, "tokens": tokens, "imbalance": max(tokens) / mean if mean else 0.0,
            "idle": sum(1 for t in tokens if t == 0)}


class RoutingRecorder:
    """Counts the tokens per expert of this rank's MoE layers (forward pre-hooks on their experts modules)."""

    def __init__(self, layers: dict[int, Any], experts: int, run_dir: str | Path, *, write: bool = True,
                 group: Any = None):
        self.experts, self.write, self.group = experts, write, group
        self.path = Path(run_dir) / ROUTING
        self._counts: dict[int, torch.Tensor] = {}
        self._step: int | None = None
        self._hooks = [moe.experts.register_forward_pre_hook(self._hook(layer, moe)) for layer, moe in layers.items()]

    @classmethod
    def attach(cls, layers: dict[int, torch.nn.Module], run_dir: str | Path, *, write: bool = True,
               group: Any = None) -> RoutingRecorder | None:
        """A recorder on every MoE layer among ``layers`` (this rank's TransformerLayers by global number:
        megatron/model.py's transformer_layers), or None when none is an MoE layer. ``group``: the expert-parallel
        group to sum the counts over at EP > 1 (every rank of it records and flushes; ``write`` picks the writer)."""
        moe = {n: layer.mlp for n, layer in layers.items() if hasattr(layer.mlp, "local_expert_indices")}
        if not moe:
            return None
        return cls(moe, next(iter(moe.values())).config.num_moe_experts, run_dir, write=write, group=group)

    def _hook(self, layer: int, moe):
        indices = torch.tensor(list(moe.local_expert_indices), dtype=torch.long)

        def count(module, args):
            if not (module.training and torch.is_grad_enabled()):
                return
            tokens = args[1]  # forward(permuted_hidden_states, tokens_per_expert, permuted_probs)
            tokens = torch.as_tensor(tokens).detach().to("cpu", torch.long)  # (a list on some dispatchers)
            counts = self._counts.setdefault(layer, torch.zeros(self.experts, dtype=torch.long))
            counts.index_add_(0, indices, tokens)
        return count

    def begin_step(self, step: int) -> None:
        """Write the finished step's rows (0-based ``step`` starts; rows count steps from 1, as metrics.jsonl)."""
        self.flush()
        self._step = step

    def flush(self) -> None:
        if self._step is None or not self._counts:
            return
        layers = sorted(self._counts)
        counts = torch.stack([self._counts[layer] for layer in layers])
        if self.group is not None:  # each EP rank counted its own experts (zeros elsewhere): one sum covers them all
            torch.distributed.all_reduce(counts, group=self.group)
        rows = [routing_row(self._step + 1, layer, row.tolist()) for layer, row in zip(layers, counts)]
        self._counts = {}
        if self.write:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as f:  # append: a resumed run continues
                f.writelines(json.dumps({k: jsonable(v) for k, v in r.items()}) + "\n" for r in rows)

    def close(self) -> None:
        self.flush()
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

