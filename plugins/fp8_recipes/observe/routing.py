"""Routing statistics of a Mixture-of-Experts model: the tokens each expert receives per step, and the imbalance.

    routing = RoutingRecorder.attach(transformer_layers(chunks), run_dir, write=rank_writes)  # None: a dense model
    precision = ObservedPrecision(precision, routing)  # observe/recorder.py's: tells it each step begins
    ... train ...
    routing.close()

``routing.jsonl`` in the run directory: one row per training step and MoE layer,
``{"step": N, "layer": L, "tokens": [t_0, ..., t_E-1], "imbalance": max / mean, "idle": experts with no token,
"weight": [w_0, ..., w_E-1], "z_loss": z}``, experts by global number. ``weight`` is the mean routing probability of
the tokens each expert received (null for an idle one): Megatron-Core multiplies an expert's SwiGLU output by it, so
it sets the scale of the expert's fc2 input and of its fc1 gradients, and a change in it is a routing shift the
delayed scales of those operands must follow. ``z_loss`` is Megatron-Core's router z-loss before its coefficient,
mean over the step's tokens of logsumexp(logits)^2 (``z_loss_func``), from the logits the router hands its routing
(the router's ``routing`` is wrapped on the instance, so the logits are not computed twice).

Counted from what Megatron-Core hands each MoE layer's experts module (its
``tokens_per_expert`` argument: SequentialMLP's and TE's grouped experts' alike), summed over the step's
micro-batches; training forwards only (evaluation runs without gradients) and once under activation recompute
(Megatron-Core's first, gradient-free pass is not counted, its replay is). The counts are this rank's experts': on
several data-parallel ranks the first one's share of the batch, as for the numerics rows. Under expert parallelism
(EP > 1) each rank holds 1/EP of the experts, which receive the tokens of the EP group's ranks (Megatron-Core's
dispatcher), so the counts, the summed weights and the z-loss sums are summed over the expert-parallel group once
per step (``group``) and a row covers every expert: the tokens of that group's micro-batches. Cost: one small integer
tensor per MoE layer and micro-batch (copied to the host as Megatron-Core hands it); the weights and the z-loss are
summed on the device and copied once per step (with one all-reduce of [layers x (2 experts + 2)] numbers at EP > 1).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from fp8_recipes.rundir import ROUTING, jsonable

__all__ = ["RoutingRecorder", "routing_row"]


def routing_row(step: int, layer: int, tokens: list[int], weights: list[float] | None = None,
                z_loss: float | None = None) -> dict[str, Any]:
    """One row: the counts, their max over their mean (1.0 = perfectly balanced), the experts without a token;
    with `weights` (each expert's summed routing probabilities) their mean per token, and the router z-loss."""
    mean = sum(tokens) / len(tokens)
    row = {"step": step, "layer": layer, "tokens": tokens, "imbalance": max(tokens) / mean if mean else 0.0,
           "idle": sum(1 for t in tokens if t == 0)}
    if weights is not None:
        row["weight"] = [w / t if t else None for w, t in zip(weights, tokens)]
    if z_loss is not None:
        row["z_loss"] = z_loss
    return row


def _real_tokens(moe, tokens: torch.Tensor, probs: Any, routed: int) -> torch.Tensor:
    """The tokens each local expert really got: ``tokens``, less the rows the dispatcher padded the routing map with
    (model ``moe_router_padding_for_quantization``: tokens routed to an expert with probability 0, to reach FP8's
    multiple of 16), which are not the router's choice. Counted on the probabilities' device, so the step's hot path
    waits for no copy to the host (the rows read them once per step)."""
    config = getattr(getattr(moe, "token_dispatcher", None), "config", None)
    if not getattr(config, "moe_router_padding_for_quantization", False) or not torch.is_tensor(probs) \
            or probs.numel() != routed:
        return tokens
    owner = torch.arange(len(tokens), device=probs.device).repeat_interleave(tokens.to(probs.device),
                                                                             output_size=routed)
    chosen = (probs.detach().reshape(-1) > 0).long()
    return torch.zeros(len(tokens), dtype=torch.long, device=probs.device).index_add_(0, owner, chosen)


class RoutingRecorder:
    """Counts the tokens per expert of this rank's MoE layers (forward pre-hooks on their experts modules)."""

    def __init__(self, layers: dict[int, Any], experts: int, run_dir: str | Path, *, write: bool = True,
                 group: Any = None):
        self.experts, self.write, self.group = experts, write, group
        self.path = Path(run_dir) / ROUTING
        self._counts: dict[int, torch.Tensor] = {}
        self._weights: dict[int, torch.Tensor] = {}  # layer -> per expert, the summed routing probabilities
        self._z: dict[int, tuple[Any, int]] = {}  # layer -> (sum over tokens of logsumexp(logits)^2, tokens)
        self._step: int | None = None
        self._hooks = [moe.experts.register_forward_pre_hook(self._hook(layer, moe)) for layer, moe in layers.items()]
        self._routers = [moe.router for moe in layers.values() if hasattr(moe, "router")]
        for layer, moe in layers.items():
            if hasattr(moe, "router"):
                moe.router.routing = self._z_loss(layer, moe.router.routing)

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
            probs = args[2] if len(args) > 2 else None  # permuted_probs: one per routed token, expert by expert
            routed = int(tokens.sum())  # (host counts: the output size below needs no device sync)
            real = _real_tokens(moe, tokens, probs, routed)  # (on the probabilities' device when it is computed)
            counts = self._counts.setdefault(layer, torch.zeros(self.experts, dtype=torch.long, device=real.device))
            counts.index_add_(0, indices.to(real.device), real)
            if torch.is_tensor(probs) and probs.numel() == routed:  # summed on its device
                owner = indices.to(probs.device).repeat_interleave(tokens.to(probs.device), output_size=routed)
                weights = self._weights.get(layer)
                if weights is None:
                    weights = self._weights[layer] = torch.zeros(self.experts, dtype=torch.float64, device=probs.device)
                weights.index_add_(0, owner, probs.detach().reshape(-1).double())
        return count

    def _z_loss(self, layer: int, routing):
        """The router's bound ``routing(logits, ...)``, also summing logsumexp(logits)^2 over the tokens (training
        forwards with gradients only, as the token counts)."""

        def wrapped(logits, *args, **kwargs):
            if routing.__self__.training and torch.is_grad_enabled():
                flat = logits.detach().reshape(-1, logits.shape[-1]).float()
                z = torch.logsumexp(flat, dim=-1).square().sum()  # on the logits' device: read at flush
                total, n = self._z.get(layer, (0.0, 0))
                self._z[layer] = (total + z, n + flat.shape[0])
            return routing(logits, *args, **kwargs)
        return wrapped

    def begin_step(self, step: int) -> None:
        """Write the finished step's rows (0-based ``step`` starts; rows count steps from 1, as metrics.jsonl)."""
        self.flush()
        self._step = step

    def _summed_over_group(self, counts: torch.Tensor, weights: list, z: list) -> tuple:
        """Counts, weights and z-loss sums summed over the expert-parallel group, in one all-reduce (every rank of it
        flushes the same layers; float64 holds the counts exactly). A layer without weights here has none anywhere."""
        import torch.distributed as dist

        nccl = dist.get_backend(self.group) == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        e = self.experts
        w = torch.stack([torch.zeros(e, dtype=torch.float64, device=device) if x is None else x.to(device)
                         for x in weights])
        zs = torch.stack([torch.zeros(2, dtype=torch.float64, device=device) if x is None else
                          torch.stack([torch.as_tensor(x[0], dtype=torch.float64).to(device),
                                       torch.tensor(float(x[1]), dtype=torch.float64, device=device)]) for x in z])
        packed = torch.cat([counts.to(device, torch.float64), w, zs], dim=1)
        dist.all_reduce(packed, group=self.group)
        packed = packed.cpu()
        return (packed[:, :e].round().long(), [None if x is None else packed[i, e:2 * e] for i, x in enumerate(weights)],
                [None if x is None else (packed[i, 2 * e], int(packed[i, 2 * e + 1])) for i, x in enumerate(z)])

    def flush(self) -> None:
        if self._step is None or not self._counts:
            return
        layers = sorted(self._counts)
        counts = torch.stack([self._counts[layer] for layer in layers])
        weights = [self._weights.get(layer) for layer in layers]
        z = [self._z.get(layer) for layer in layers]
        if self.group is not None:  # each EP rank counted its own experts (zeros elsewhere): one sum covers them all
            counts, weights, z = self._summed_over_group(counts, weights, z)
        rows = [routing_row(self._step + 1, layer, row.tolist(), None if w is None else w.tolist(),
                            None if zl is None or not zl[1] else float(zl[0]) / zl[1])
                for layer, row, w, zl in zip(layers, counts, weights, z)]
        self._counts, self._weights, self._z = {}, {}, {}
        if self.write:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as f:  # append: a resumed run continues
                f.writelines(json.dumps({k: jsonable(v) for k, v in r.items()}) + "\n" for r in rows)

    def close(self) -> None:
        self.flush()
        for hook in self._hooks:
            hook.remove()
        for router in self._routers:
            router.__dict__.pop("routing", None)  # the class's own method again
        self._hooks, self._routers = [], []

