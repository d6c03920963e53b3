"""Resharding: a model's tensors and its optimizer state across tensor / pipeline / virtual-pipeline / expert-parallel
layouts.

A checkpoint holds one payload per (pipeline, tensor) shard, and per EP rank at expert parallelism > 1
(training/checkpoint.py). Here every shard's tensors are
named as in a one-rank model (canonical names: the local layer spec's, with global layer numbers) and joined into
whole tensors; a rank of any other layout then cuts its part out of them, reading only the saved stages that hold
its tensors:

    stages = stages_holding(held, layout, num_layers, wanted)         # from the checkpoint's index alone
    whole = join_shards(read_shard, layout, num_layers, gated=True, stages=stages)  # {canonical name: tensor}, states
    part = rank_slice(name, whole[name], tp, tp_rank, gated=True)

How Megatron-Core splits a tensor over the tensor-parallel ranks: column-parallel weights (qkv, the LM head, the
embedding) and their biases along rows, ``linear_fc1`` of a gated MLP per rank as ``[gate_r; up_r]``, row-parallel
weights (proj, fc2) along columns, norms and row-parallel biases replicated. An MoE layer's shared experts and routed
experts are MLPs split alike (the routed ones over expert TP, resharded where it equals TP), its router replicated.
A chunk's layers are numbered from Megatron-Core's layer offset (even split, the only one trainer configs make).

Expert parallelism: at EP > 1 each (pipeline, tensor) shard has one payload per EP rank, which holds the routed
experts ``ep_rank * E / EP ...`` of every MoE layer under local numbers (``local_experts.<i>.``, or TE's grouped
``linear_fc1.weight<i>``) and the same dense tensors as the others. Joined, the experts get global numbers
(:func:`expert_global`) and the dense tensors are taken from EP rank 0's payload; a rank of another EP size takes
its own experts by :func:`live_global_name`.

The optimizer state is mapped to parameters with an index the checkpoint records at save time
(:func:`optimizer_param_index`): with the distributed optimizer, where each parameter starts in the gathered
(``get_parameter_state_dp_zero``) buffer; with the plain one, which parameter each param-group slot holds. So the fp32
main params and Adam's moments become whole tensors too (:func:`saved_param_states`), and
:func:`load_optimizer_resharded` writes this rank's part of them into a freshly built optimizer.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

import torch

from fp8_recipes.megatron.cpu_shim import cuda_as_cpu
from fp8_recipes.megatron.model import expert_number, global_name, renumber_expert
from fp8_recipes.training.engine import untie_step_tensors

__all__ = [
    "canonical_name",
    "expert_global",
    "expert_number",
    "join_shards",
    "join_tp",
    "layer_offset",
    "live_global_name",
    "load_optimizer_resharded",
    "optimizer_param_index",
    "rank_slice",
    "saved_optimizer_step",
    "saved_ep_ranks",
    "saved_param_states",
    "stages_holding",
]

_TE_NORMS = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
             "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight"}
COLUMN = ("embedding.word_embeddings.weight", "output_layer.weight", "self_attention.linear_qkv.weight",
          "self_attention.linear_qkv.bias")
ROW = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")
FC1 = ("mlp.linear_fc1.weight", "mlp.linear_fc1.bias")  # column-parallel; [gate_r; up_r] per rank when gated
# any MLP's fc1 / fc2: the dense one, an MoE layer's shared experts, each routed expert (``local_experts.<i>.``) and
# TE's grouped experts (``linear_fc1.weight<i>``)
_FC1 = re.compile(r"\.mlp\.(?:shared_experts\.|experts\.(?:local_experts\.\d+\.)?)?linear_fc1\.(?:weight|bias)\d*$")
_FC2 = re.compile(r"\.mlp\.(?:shared_experts\.|experts\.(?:local_experts\.\d+\.)?)?linear_fc2\.weight\d*$")


def canonical_name(local_name: str) -> str:
    """A state-dict name of either layer spec as the local spec's (TE fuses the norms into qkv / fc1)."""
    for te, local in _TE_NORMS.items():
        if local_name.endswith(te):
            return local_name[: -len(te)] + local
    return local_name


def layer_offset(pp_rank: int, vp_stage: int, num_layers: int, pp: int, vpp: int | None) -> int:
    """Megatron-Core's get_transformer_layer_offset for an even split (the only one trainer configs make)."""
    if vpp:
        return vp_stage * (num_layers // vpp) + pp_rank * (num_layers // (pp * vpp))
    return pp_rank * (num_layers // pp)


def _global(name: str, offset: int) -> str:
    """A chunk's canonical name with its layer number made global."""
    name = canonical_name(name)
    if name.startswith("decoder.layers."):
        local, _, rest = name[len("decoder.layers."):].partition(".")
        return f"decoder.layers.{int(local) + offset}.{rest}"
    return name


def expert_global(name: str, ep_rank: int, per_rank: int) -> str:
    """A routed expert's tensor name in EP rank ``ep_rank``'s payload (``per_rank`` experts each) with its global
    expert number; any other name as it is."""
    return renumber_expert(name, lambda i: i + ep_rank * per_rank)


def saved_ep_ranks(wanted: Iterable[str], experts: tuple[int, int]) -> list[int]:
    """The saved EP ranks whose payloads hold any of ``wanted`` (canonical global names): EP rank 0 (the dense
    tensors) and those holding a wanted expert. ``experts``: the checkpoint's (EP size, experts per MoE layer)."""
    ep, num_experts = experts
    per_rank = max(num_experts // ep, 1)
    numbers = (expert_number(name) for name in wanted)
    return sorted({0} | {n // per_rank for n in numbers if n is not None and n // per_rank < ep})


def is_routed_expert(name: str) -> bool:
    """Whether ``name`` is a routed expert's tensor (held by one EP rank), not a dense one (held by every EP rank)."""
    return expert_number(name) is not None


def _fc1(name: str) -> bool:
    return name.endswith(FC1) or _FC1.search(name) is not None


def _split_dim(name: str) -> int | None:
    """The dimension ``name`` is split along over the tensor-parallel ranks; None: replicated."""
    if name.endswith(COLUMN) or _fc1(name):
        return 0
    if name.endswith(ROW) or _FC2.search(name):
        return 1
    return None


def join_tp(name: str, parts: list[torch.Tensor], gated: bool = True) -> torch.Tensor:
    """The whole tensor ``name`` (canonical) from its tensor-parallel parts, in rank order."""
    dim = _split_dim(name)
    if len(parts) == 1 or dim is None:
        return parts[0]  # replicated (norms, row-parallel biases)
    if gated and _fc1(name):
        halves = [part.chunk(2, dim=0) for part in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(parts, dim=dim)


def rank_slice(name: str, whole: torch.Tensor, tp: int, tp_rank: int, gated: bool = True) -> torch.Tensor:
    """Tensor-parallel rank ``tp_rank``'s part of the whole tensor ``name`` (canonical); the inverse of join_tp."""
    dim = _split_dim(name)
    if tp == 1 or dim is None:
        return whole
    if gated and _fc1(name):
        gate, up = whole.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[tp_rank], up.chunk(tp, dim=0)[tp_rank]], dim=0)
    return whole.chunk(tp, dim=dim)[tp_rank]


def join_shards(read_shard: Callable[[int, int, int | None], Mapping[str, Any]],
                layout: tuple[int, int, int | None], num_layers: int, *, gated: bool = True, optimizer: bool = False,
                progress: Callable[[str], None] | None = None, stages: Iterable[int] | None = None,
                experts: tuple[int, int] = (1, 0),
                ep_ranks: Iterable[int] | None = None) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """(model, optimizer) of a checkpoint as whole tensors under canonical global names: every model tensor, and with
    ``optimizer`` every parameter's optimizer state ({"param": fp32 main, "exp_avg": ..., "exp_avg_sq": ...}).
    ``read_shard(tp_rank, pp_rank, ep_rank)`` gives a payload (``ep_rank`` None at EP 1); ``layout`` = the
    checkpoint's (tp, pp, vpp); ``experts`` = its (EP size, routed experts per MoE layer); ``stages`` and
    ``ep_ranks``: the saved pipeline and EP ranks to read (:func:`stages_holding`, :func:`saved_ep_ranks`), all by
    default."""
    tp, pp, vpp = layout
    ep, num_experts = experts
    stages = range(pp) if stages is None else sorted(stages)
    model: dict[str, list[torch.Tensor]] = {}
    states: dict[str, dict[str, list[torch.Tensor]]] = {}
    eps = range(ep) if ep_ranks is None else sorted(ep_ranks)
    shards = [(p, t, e) for p in stages for t in range(tp) for e in eps]
    for i, (p, t, e) in enumerate(shards):
        if progress is not None:
            progress(f"reading shard pp{p:02d}tp{t:02d}{f'ep{e:02d}' if ep > 1 else ''} ({i + 1}/{len(shards)})")
        payload = read_shard(t, p, e if ep > 1 else None)
        offsets = [layer_offset(p, v, num_layers, pp, vpp) for v in range(len(payload["model"]))]
        for v, chunk in enumerate(payload["model"]):
            for name, tensor in chunk.items():
                joined = _joined_name(name, offsets[v], e, num_experts // ep)
                if isinstance(tensor, torch.Tensor) and not name.endswith("_extra_state") and joined:
                    model.setdefault(joined, []).append(tensor)
        if optimizer:
            for (v, name), state in saved_param_states(payload["optimizer"]).items():
                joined = _joined_name(name, offsets[v], e, num_experts // ep)
                for key, tensor in state.items() if joined else ():
                    states.setdefault(joined, {}).setdefault(key, []).append(tensor)
    whole_model = {name: join_tp(name, parts, gated) for name, parts in model.items()}
    whole_states = {name: {key: join_tp(name, parts, gated) for key, parts in per_key.items()}
                    for name, per_key in states.items()}
    return whole_model, whole_states


def _joined_name(name: str, offset: int, ep_rank: int, per_rank: int) -> str | None:
    """The canonical global name of a tensor in EP rank ``ep_rank``'s payload (its chunk's layers from ``offset``);
    None for a dense tensor in EP rank > 0's (EP rank 0's payload holds the same)."""
    if ep_rank and not is_routed_expert(name):
        return None
    return _global(expert_global(name, ep_rank, per_rank) if ep_rank else name, offset)


def _any_expert(name: str) -> str:
    """``name`` with a routed expert's number blanked: the layer a stage holds, whichever EP rank's experts."""
    return renumber_expert(name, lambda i: "*")


def stages_holding(held: Mapping[int, Iterable[tuple[int, str]]], layout: tuple[int, int, int | None],
                   num_layers: int, wanted: Collection[str]) -> list[int]:
    """The saved pipeline ranks whose shards hold any of ``wanted`` (canonical global names): the ones a rank of
    another layout reads for its own tensors. ``held``: per saved pipeline rank, its (model chunk, state-dict name)s
    (from the checkpoint's index; every tensor-parallel rank of a stage holds the same names, every EP rank the same
    layers)."""
    _, pp, vpp = layout
    names = {p: {_any_expert(_global(name, layer_offset(p, v, num_layers, pp, vpp))) for v, name in held.get(p, ())}
             for p in range(pp)}
    wanted = {_any_expert(name) for name in wanted}
    if "output_layer.weight" in wanted and not any("output_layer.weight" in n for n in names.values()):
        wanted.add("embedding.word_embeddings.weight")  # a tied head saved at one stage: the embedding is its state
    return [p for p in range(pp) if names[p] & wanted]


def live_global_name(model: torch.nn.Module, name: str) -> str:
    """The canonical global name of ``name`` in a built model chunk (its layers know their global numbers, an MoE
    layer its experts')."""
    return global_name(model, canonical_name(name))


# ----------------------------------------------------------------------------------------------------------
# The optimizer state per parameter


def _chained(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _names(models: list[torch.nn.Module]) -> dict[torch.nn.Parameter, tuple[int, str]]:
    return {param: (i, name) for i, model in enumerate(models) for name, param in model.named_parameters()}


def optimizer_param_index(models: list[torch.nn.Module], optimizer: Any) -> list[dict[str, Any]]:
    """Per chained optimizer, which parameter (model chunk, state-dict name, shape) each piece of its saved state
    belongs to. Distributed optimizer: ``{"buffers": {buffer: [(chunk, name, start, numel, shape)]}}``, ``start`` in
    the gathered buffer of ``get_parameter_state_dp_zero`` (buckets back to back, their padding dropped). Plain:
    ``{"groups": [[(chunk, name, fp32 copy index or -1, shape)] per param-group slot]}``."""
    names = _names(models)
    index = []
    for opt in _chained(optimizer):
        if hasattr(opt, "gbuf_ranges"):
            buffers = {}
            for b, buffer in enumerate(opt.buffers):
                bases = list(itertools.accumulate((bucket.numel_unpadded for bucket in buffer.buckets), initial=0))
                buffers[b] = [(*names[param], start - buffer.buckets[bucket].offset + bases[bucket], end - start,
                               tuple(param.shape))
                              for param, (start, end, bucket) in buffer.param_index_map.items()]
            index.append({"buffers": buffers})
            continue
        model_of = {main: (model, j) for models_g, mains_g in zip(getattr(opt, "float16_groups", []),
                                                                   getattr(opt, "fp32_from_float16_groups", []))
                    for j, (model, main) in enumerate(zip(models_g, mains_g))}
        groups = []
        for group in getattr(opt, "optimizer", opt).param_groups:  # (a Megatron-Core optimizer wraps torch's)
            slots = []
            for param in group["params"]:
                model, j = model_of.get(param, (param, -1))
                slots.append((*names[model], j, tuple(model.shape)))
            groups.append(slots)
        index.append({"groups": groups})
    return index


def saved_param_states(optimizer: Mapping[str, Any]) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """{(chunk, name): {"param": fp32 main (when the optimizer keeps one), "exp_avg", "exp_avg_sq"}} of one saved
    shard's optimizer state (engine.optimizer_state_dict plus its ``param_index``), each shaped as the parameter."""
    saved = optimizer["state_dict"]
    saved = saved if isinstance(saved, list) else [saved]
    out: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for k, entry in enumerate(optimizer["param_index"]):
        if "buffers" in entry:
            gathered = optimizer["param_state"][k]
            if gathered is None:  # gathered at another rank: EP rank > 0's payload has its experts' state only
                continue
            for b, rows in entry["buffers"].items():
                (world,) = gathered[b].values()  # {dtype: {key: the buffer's gathered state}}
                for chunk, name, start, numel, shape in rows:
                    out[(chunk, name)] = {key: t[start:start + numel].view(shape) for key, t in world.items()
                                          if isinstance(t, torch.Tensor)}
            continue
        inner = saved[k].get("optimizer", saved[k])
        fp32 = saved[k].get("fp32_from_fp16_params")
        for g, slots in enumerate(entry["groups"]):
            for i, (chunk, name, j, shape) in enumerate(slots):
                state = inner["state"].get(inner["param_groups"][g]["params"][i], {})
                tensors = {key: t for key, t in state.items()
                           if isinstance(t, torch.Tensor) and tuple(t.shape) == tuple(shape)}
                if j >= 0:
                    tensors["param"] = fp32[g][j]
                out[(chunk, name)] = tensors
    return out


def saved_optimizer_step(optimizer: Mapping[str, Any]) -> int | None:
    """The optimizer's own step count in a saved shard (steps it applied; skipped steps do not count)."""
    saved = optimizer["state_dict"]
    for sd in saved if isinstance(saved, list) else [saved]:
        inner = sd.get("optimizer", sd)
        for group in inner.get("param_groups", []):
            if group.get("step") is not None:
                return int(group["step"])
        for state in inner.get("state", {}).values():
            if isinstance(state, dict) and isinstance(state.get("step"), torch.Tensor):
                return int(state["step"].item())
    return None


def load_optimizer_resharded(models: list[torch.nn.Module], optimizer: Any, whole: Mapping[str, Mapping[str, Any]],
                             step: int | None, tp: int, tp_rank: int, gated: bool = True) -> int:
    """Write this rank's part of the whole optimizer state ``whole`` ({canonical global name: {key: tensor}}) into
    ``optimizer``, built for this layout and not stepped yet; ``step``: the optimizer's step count. With the
    distributed optimizer each data-parallel rank writes the range of each parameter it owns (no communication).
    Returns the parameters set."""
    names = _names(models)
    global_of = {key: live_global_name(models[key[0]], key[1]) for key in names.values()}

    def part(param: torch.nn.Parameter, key: str) -> torch.Tensor | None:
        name = global_of[names[param]]
        state = whole.get(name) or (whole.get("embedding.word_embeddings.weight")
                                    if name == "output_layer.weight" else None)  # a tied head: the embedding's
        if state is None:
            raise ValueError(f"resharding: the checkpoint holds no optimizer state of {name}")
        if key not in state:
            return None
        return rank_slice(name, state[key], tp, tp_rank, gated)

    done = 0
    with cuda_as_cpu(), torch.no_grad():
        for opt in _chained(optimizer):
            if hasattr(opt, "gbuf_ranges"):
                groups = []
                for group in opt.optimizer.param_groups:
                    groups.append({k: v for k, v in group.items() if k != "params"})
                    if step is not None:
                        groups[-1]["step"] = step
                opt.load_state_dict({"optimizer": {"param_groups": groups}})  # allocates the state, sets the step
                untie_step_tensors(opt)
                for param in opt.model_param_group_index_map:
                    span = opt._get_model_param_range_map(param)["param"]
                    current = opt._get_main_param_and_optimizer_states(param)
                    new = {}
                    for key, value in current.items():
                        cut = part(param, key)
                        new[key] = value if cut is None else cut.reshape(-1)[span.start:span.end].to(value.dtype)
                    opt._set_main_param_and_optimizer_states(param, new)
                    done += 1
                continue
            opt.init_state_fn(opt.optimizer, opt.config)
            model_of = {main: model for models_g, mains_g in zip(getattr(opt, "float16_groups", []),
                                                                  getattr(opt, "fp32_from_float16_groups", []))
                        for model, main in zip(models_g, mains_g)}
            for group in opt.optimizer.param_groups:
                if step is not None and "step" in group:
                    group["step"] = step
                for main in group["params"]:
                    param = model_of.get(main, main)
                    state = opt.optimizer.state[main]
                    if step is not None and "step" not in group:  # torch's AdamW: a step tensor per parameter
                        state.setdefault("step", torch.tensor(float(step)))
                    for key, target in [("param", main), *state.items()]:
                        if key == "step" and isinstance(target, torch.Tensor) and step is not None:
                            target.fill_(step)
                        elif isinstance(target, torch.Tensor) and (key != "param" or main is not param):
                            cut = part(param, key)
                            if cut is not None:
                                target.copy_(cut.reshape(target.shape))
                    done += 1
    return done
