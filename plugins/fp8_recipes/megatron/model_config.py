"""The ``model`` config group checked before anything is built: keys, types, ranges, and the shapes Megatron-Core
would assert on, each a one-line ValueError naming ``model.<key>`` (checks.py's style).

    check_model_cfg(cfg.model, tensor_parallel=2)

It sits beside the model builder (megatron/model.py calls it first) and imports neither torch nor megatron, so the
run-config checks (training/config.py) use it before any process group exists.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from fp8_recipes.checks import ConfigError, check_keys, choice_error, is_int, is_number
from fp8_recipes.plan.precision import ModelLayout, MoEShape, expert_ffn_size, moe_layer_pattern
from fp8_recipes.recipe.pack import conf_dir

__all__ = ["GRAPH_KEYS", "GRAPH_MODULES", "MODEL_CHOICES", "MODEL_MAX", "MODEL_OPTIONAL", "MODEL_REQUIRED",
           "MOE_KEYS", "VOCAB_MULTIPLE", "LinearShape", "check_model_cfg", "check_model_device", "config_layout",
           "graph_config_fields", "graph_modules", "graphs_on", "layout_of", "linear_shapes", "model_notices",
           "moe_config_fields", "moe_layer_pattern", "pad_vocab_size", "read_model_conf", "run_model_cfg"]

VOCAB_MULTIPLE = 128  # Megatron's make_vocab_size_divisible_by default; times TP so each shard is aligned

MODEL_REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size")
MODEL_OPTIONAL = ("ffn_hidden_size", "num_query_groups", "normalization", "activation", "position_embedding_type",
                  "rotary_base", "share_embeddings_and_output_weights", "init_method_std", "add_bias_linear",
                  "hidden_dropout", "attention_dropout", "layernorm_epsilon", "init_from")
MOE_KEYS = ("num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
            "moe_layer_freq", "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_z_loss_coeff",
            "moe_router_dtype", "moe_token_dispatcher_type", "moe_grouped_gemm", "moe_permute_fusion",
            "moe_router_padding_for_quantization", "moe_router_fusion", "moe_expert_capacity_factor",
            "moe_pad_expert_input_to_capacity")
"""Mixture-of-Experts keys, named and meant as Megatron-Core's TransformerConfig fields (num_moe_experts null: a
dense model, and the other keys do nothing)."""
GRAPH_KEYS = ("cuda_graph_impl", "cuda_graph_modules", "cuda_graph_warmup_steps")
"""Megatron-Core's per-layer CUDA graphs through Transformer Engine, as TransformerConfig names them (Megatron-LM's
--cuda-graph-impl transformer_engine --cuda-graph-modules ... --cuda-graph-warmup-steps N): the training loop captures
each layer's graphs after that many eager steps (megatron/graphs.py) and replays them from then on."""
GRAPH_MODULES = ("attn", "mlp", "moe", "moe_router", "moe_preprocess")
"""The scopes cuda_graph_modules may list (Megatron-Core's CudaGraphModule names this plugin captures)."""
MODEL_CHOICES = {"normalization": ("LayerNorm", "RMSNorm"), "activation": ("gelu", "swiglu"),
                 "position_embedding_type": ("rope", "learned_absolute"),
                 "moe_router_load_balancing_type": ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"),
                 "moe_router_dtype": (None, "fp32", "fp64"),
                 "moe_token_dispatcher_type": ("allgather", "alltoall", "flex")}
_MODEL_POSITIVE_INTS = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size",
                        "ffn_hidden_size", "num_query_groups", "num_moe_experts", "moe_router_topk",
                        "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size")
# Upper bounds far above any model this plugin trains (Llama-3 405B: 126 layers, 16384 hidden, 53248 ffn, 128 heads,
# 128256 vocab); past them a typo (an extra zero, a million tokens) would die in an allocation traceback instead.
MODEL_MAX = {"num_layers": 1024, "hidden_size": 65536, "ffn_hidden_size": 262144, "num_attention_heads": 1024,
             "num_query_groups": 1024, "seq_length": 131072, "vocab_size": 1048576,
             # DeepSeek-V3: 256 routed experts of FFN 2048, top-8, one shared expert
             "num_moe_experts": 1024, "moe_router_topk": 1024, "moe_ffn_hidden_size": 262144,
             "moe_shared_expert_intermediate_size": 262144}


def check_model_cfg(cfg: Mapping[str, Any], *, vocab_may_be_unset: bool = False, tensor_parallel: int = 1,
                    tp_key: str = "trainer.tensor_model_parallel_size", device: str | None = "cuda") -> None:
    """The `model` group: known keys, types, ranges, and the shapes Megatron-Core would assert on; ``tp_key``: how the
    user gave ``tensor_parallel`` (``--layout tp`` in the CLI), named with the widths it does not divide. ``device``:
    the machine it will run on ('cpu', 'cuda'); None while not yet known (training, before torch loads), the keys
    whose fix depends on it then left to :func:`check_model_device`."""
    known = MODEL_REQUIRED + MODEL_OPTIONAL + MOE_KEYS + GRAPH_KEYS
    check_keys("model", cfg, known)
    for key in MODEL_REQUIRED:
        if cfg.get(key) is None and not (key == "vocab_size" and vocab_may_be_unset):
            raise ConfigError(f"model.{key} is required (got no value); set model.{key}=<integer>")
    for key in _MODEL_POSITIVE_INTS:
        v = cfg.get(key)
        if v is not None and (not is_int(v) or v < 1):
            raise ConfigError(f"model.{key}={v!r}: must be an integer >= 1")
        if v is not None and v > MODEL_MAX[key]:
            raise ConfigError(f"model.{key}={v}: larger than this plugin supports (at most {MODEL_MAX[key]:,}); "
                             f"lower model.{key}")
    for key, choices in MODEL_CHOICES.items():
        if key in cfg and cfg[key] not in choices:
            raise choice_error(f"model.{key}", cfg[key], choices)
    for key in ("share_embeddings_and_output_weights", "add_bias_linear", "moe_grouped_gemm", "moe_permute_fusion",
                "moe_router_padding_for_quantization", "moe_router_fusion", "moe_pad_expert_input_to_capacity"):
        if key in cfg and not isinstance(cfg[key], bool):
            raise ConfigError(f"model.{key}={cfg[key]!r}: must be true or false")
    for key in ("hidden_dropout", "attention_dropout"):
        v = cfg.get(key)
        if v is not None and not (is_number(v) and 0 <= v < 1):
            raise ConfigError(f"model.{key}={v!r}: must lie in [0, 1)")
    for key in ("init_method_std", "rotary_base", "layernorm_epsilon"):
        v = cfg.get(key)
        if v is not None and not (is_number(v) and v > 0):
            raise ConfigError(f"model.{key}={v!r}: must be a number > 0")
    _check_moe(cfg)
    _check_graphs(cfg)
    if device is not None:
        check_model_device(cfg, device)
    init_from = cfg.get("init_from")
    if init_from is not None:  # training/hf.py checks the vocabulary and the shape once the model config is final
        if not (isinstance(init_from, str) and init_from.startswith("hf:") and len(init_from) > 3):
            raise ConfigError(f"model.init_from={init_from!r}: give hf:PATH (a Hugging Face Llama checkpoint "
                             f"directory) or null")
        if not (Path(init_from[3:]) / "config.json").is_file():
            raise ConfigError(f"model.init_from: {init_from[3:]} has no config.json; give hf:PATH of a Hugging Face "
                             f"checkpoint directory (fp8-recipes export RUN --to hf PATH writes one)")
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    if hidden % heads:
        raise ConfigError(f"model.hidden_size={hidden} is not divisible by model.num_attention_heads={heads}; "
                         f"pick heads that divide it")
    head_dim = hidden // heads
    rope = cfg.get("position_embedding_type", "learned_absolute") == "rope"  # (GPTModel's default, as model.py builds)
    if head_dim < 2 or (rope and head_dim % 2):
        need = "an even number (rotary embeddings rotate pairs)" if rope else "at least 2"
        raise ConfigError(f"model.num_attention_heads={heads}: the head dimension model.hidden_size / "
                         f"model.num_attention_heads = {head_dim} must be {need}; use fewer heads")
    groups = cfg.get("num_query_groups")
    if groups is not None and heads % groups:
        raise ConfigError(f"model.num_query_groups={groups} does not divide model.num_attention_heads={heads}")
    # Megatron-Core's divide() asserts on each: the experts' and the MLP's row-parallel linear_fc2, the heads and
    # query groups per rank
    moe = ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size") if cfg.get("num_moe_experts") else ()
    widths = {**{key: cfg.get(key) for key in moe}, "ffn_hidden_size": cfg.get("ffn_hidden_size") or 4 * hidden,
              "num_attention_heads": heads, "num_query_groups": groups}
    for key, v in widths.items():
        if v is not None and v % tensor_parallel:
            raise ConfigError(f"model.{key}={v} is not divisible by {tp_key}={tensor_parallel}; set {tp_key} to a "
                             f"divisor of {v}")


def _check_moe(cfg: Mapping[str, Any]) -> None:
    """The MoE keys Megatron-Core would assert on (or misread) at build time, each named."""
    for key in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
        v = cfg.get(key)
        if v is not None and not (is_number(v) and v >= 0):
            raise ConfigError(f"model.{key}={v!r}: must be a number >= 0 (or null)")
    experts = cfg.get("num_moe_experts")
    if experts is None:
        return
    if "moe_router_topk" in cfg and cfg["moe_router_topk"] is None:
        raise ConfigError("model.moe_router_topk=null on an MoE model: set the experts each token picks, an integer "
                         ">= 1 (Megatron-Core's default: 2)")
    topk = cfg.get("moe_router_topk", 2)
    if topk > experts:
        raise ConfigError(f"model.moe_router_topk={topk} is more than model.num_moe_experts={experts}; each token "
                         f"picks at most every expert")
    if topk == 1 and cfg.get("moe_router_load_balancing_type", "aux_loss") != "sinkhorn":
        raise ConfigError("model.moe_router_topk=1: Megatron-Core's softmax over one selected expert has a zero "
                         "gradient; use model.moe_router_topk >= 2 (or moe_router_load_balancing_type=sinkhorn with "
                         "moe_aux_loss_coeff=0)")
    if cfg.get("moe_router_load_balancing_type") == "sinkhorn" and cfg.get("moe_aux_loss_coeff"):
        raise ConfigError(f"model.moe_aux_loss_coeff={cfg['moe_aux_loss_coeff']} with "
                         f"model.moe_router_load_balancing_type=sinkhorn: Megatron-Core's sinkhorn router takes no "
                         f"auxiliary loss (it balances by itself); set model.moe_aux_loss_coeff=0")
    moe_layer_pattern(cfg)  # moe_layer_freq's form and length
    _check_capacity(cfg)
    if cfg.get("moe_router_padding_for_quantization") and cfg.get("moe_router_fusion"):
        raise ConfigError("model.moe_router_fusion=true with model.moe_router_padding_for_quantization=true: "
                         "Megatron-Core 0.19.2 pads the routing map the fused router saved for its backward in place "
                         "(the backward then fails, measured on the H200); set one of them false")


def _check_capacity(cfg: Mapping[str, Any]) -> None:
    """Token dropping (moe_expert_capacity_factor) and padding every expert to its capacity, as Megatron-Core reads
    them: a factor > 0 (Megatron-Core takes a negative one as none), the balancing types it drops under, and the
    padding only with a factor."""
    factor = cfg.get("moe_expert_capacity_factor")
    if factor is not None and not (is_number(factor) and factor > 0):
        raise ConfigError(f"model.moe_expert_capacity_factor={factor!r}: must be a number > 0 (each expert takes at "
                         f"most that many times its balanced share of tokens), or null (dropless)")
    balancing = cfg.get("moe_router_load_balancing_type", "aux_loss")
    if factor is not None and balancing not in ("aux_loss", "seq_aux_loss", "global_aux_loss", "none"):
        raise ConfigError(f"model.moe_expert_capacity_factor={factor}: Megatron-Core drops tokens only under "
                         f"moe_router_load_balancing_type aux_loss, seq_aux_loss, global_aux_loss or none (not "
                         f"{balancing}); change one of the two")
    if cfg.get("moe_pad_expert_input_to_capacity") and factor is None:
        raise ConfigError("model.moe_pad_expert_input_to_capacity=true pads each expert to its capacity, which "
                         "model.moe_expert_capacity_factor sets; set it (e.g. 1.0), or the padding false")
    if cfg.get("moe_pad_expert_input_to_capacity") and cfg.get("moe_router_padding_for_quantization"):
        raise ConfigError("model.moe_router_padding_for_quantization=true with "
                         "model.moe_pad_expert_input_to_capacity=true: every expert already gets its capacity, and "
                         "Megatron-Core 0.19.2 pads the filled routing map again, past a capacity that is no "
                         "multiple of 16, which its permutation does not expect; set the router padding false")


def graphs_on(cfg: Mapping[str, Any]) -> bool:
    """Whether the model config asks for Megatron-Core's per-layer CUDA graphs through TE."""
    return cfg.get("cuda_graph_impl") == "transformer_engine"


def _static_moe(cfg: Mapping[str, Any]) -> bool:
    """The MoE layer's shapes are static and no token count reaches the host: tokens dropped at a capacity and every
    expert padded to it, with the alltoall dispatcher (the allgather one copies its counts to the host even then)."""
    return (cfg.get("moe_expert_capacity_factor") is not None and bool(cfg.get("moe_pad_expert_input_to_capacity"))
            and cfg.get("moe_token_dispatcher_type") == "alltoall")


def _host_copy(cfg: Mapping[str, Any]) -> bool:
    """The alltoall dispatcher's preprocessing copies the token counts to the host (a capacity, or router padding;
    not with static shapes, where it returns before any copy)."""
    return cfg.get("moe_token_dispatcher_type") == "alltoall" and not _static_moe(cfg) and (
        cfg.get("moe_expert_capacity_factor") is not None or bool(cfg.get("moe_router_padding_for_quantization")))


def _routed(cfg: Mapping[str, Any]) -> bool:
    """Whether the model has MoE layers Megatron-Core graphs as such (more than one expert)."""
    return (cfg.get("num_moe_experts") or 0) > 1


def graph_modules(cfg: Mapping[str, Any], attn_only: bool = False) -> list[str]:
    """The scopes graphed when model.cuda_graph_modules is not given: the attention and, in MoE layers, what
    Megatron-Core allows that MoE. Dropless: the router and the dispatcher's preprocessing (the preprocessing only
    where it copies nothing to the host). Static shapes (:func:`_static_moe`): the whole MoE block, experts and
    dispatch included, so each layer is one graph and FP8's per-expert quantizers are inside it. ``attn_only``: the
    attention's alone."""
    if not _routed(cfg) or attn_only:
        return ["attn"]
    if _static_moe(cfg):
        return ["attn", "moe"]
    return ["attn", "moe_router"] + ([] if _host_copy(cfg) else ["moe_preprocess"])


def graph_config_fields(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The graph keys as TransformerConfig fields (none unless model.cuda_graph_impl=transformer_engine)."""
    if not graphs_on(cfg):
        return {}
    modules = cfg.get("cuda_graph_modules")
    return {"cuda_graph_impl": "transformer_engine",
            "cuda_graph_modules": list(modules) if modules is not None else graph_modules(cfg),
            "cuda_graph_warmup_steps": int(cfg.get("cuda_graph_warmup_steps", 3))}


def _check_graphs(cfg: Mapping[str, Any]) -> None:
    """The graph keys, and the scopes Megatron-Core would assert on (or capture and fail in) for this model."""
    impl = cfg.get("cuda_graph_impl", "none")
    if impl not in (None, "none", "transformer_engine"):
        raise ConfigError(f"model.cuda_graph_impl={impl!r}: this plugin captures Megatron-Core's per-layer graphs "
                         f"through Transformer Engine only; set model.cuda_graph_impl=transformer_engine or none")
    steps = cfg.get("cuda_graph_warmup_steps")
    if steps is not None and (not is_int(steps) or steps < 1):
        raise ConfigError(f"model.cuda_graph_warmup_steps={steps!r}: the eager steps before the capture, an integer "
                         f">= 1 (Megatron-LM's default: 3)")
    modules = cfg.get("cuda_graph_modules")
    if modules is None:
        return
    if (not isinstance(modules, (list, tuple)) or not modules or any(m not in GRAPH_MODULES for m in modules)
            or len(set(modules)) != len(modules)):
        raise ConfigError(f"model.cuda_graph_modules={modules!r}: a list of distinct scopes from "
                         f"{', '.join(GRAPH_MODULES)} (e.g. [attn, moe_router]), or null for the model's own")
    problem = _graph_scope_problem(cfg, set(modules))
    if problem:
        raise ConfigError(f"model.cuda_graph_modules={list(modules)}: {problem}")


def _graph_scope_problem(cfg: Mapping[str, Any], modules: set[str]) -> str | None:
    """Why Megatron-Core cannot graph these scopes of this model (its TransformerConfig checks, and the host copies a
    capture cannot hold), or None."""
    moe_scopes = modules & {"moe", "moe_router", "moe_preprocess"}
    if not _routed(cfg):
        return (f"{sorted(moe_scopes)[0]} is an MoE scope and Megatron-Core graphs it only with more than one "
                f"expert; drop it") if moe_scopes else None
    if {"moe", "moe_router"} <= modules:
        return "moe graphs the router too; keep one of moe and moe_router"
    if "moe_preprocess" in modules and "moe_router" not in modules:
        return "Megatron-Core graphs moe_preprocess only with moe_router; add moe_router"
    if "mlp" in modules and len(moe_layer_pattern(cfg)) == int(cfg["num_layers"]):
        return "mlp graphs a dense layer's MLP and every layer of this model is an MoE layer; drop mlp"
    if "moe" in modules and not _static_moe(cfg):
        return ("a whole MoE layer is graphed only with static shapes: set model.moe_expert_capacity_factor (e.g. 1.0), "
                "model.moe_pad_expert_input_to_capacity=true and the alltoall dispatcher, or graph moe_router")
    if "moe_preprocess" in modules and _host_copy(cfg):
        return ("the alltoall dispatcher's preprocessing copies the token counts to the host here (a capacity or "
                "router padding), which a graph cannot hold; drop moe_preprocess")
    return None


def layout_of(cfg: Mapping[str, Any]) -> ModelLayout:
    """The plan's view of a (checked) model config: its layers, and the experts of its MoE layers."""
    layers = moe_layer_pattern(cfg)
    moe = MoEShape(int(cfg["num_moe_experts"]), layers, cfg.get("moe_shared_expert_intermediate_size") is not None) \
        if layers else None
    return ModelLayout.gpt(int(cfg["num_layers"]), moe=moe)


def moe_config_fields(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The model group's MoE keys as Megatron-Core TransformerConfig fields (they share its names; Megatron-Bridge's
    GPTModelProvider and NeMo's GPTConfig are TransformerConfig subclasses, so theirs too); none for a dense model.
    Unset (or null) keys keep Megatron-Core's defaults (top-2, aux-loss balancing with coefficient 0, the
    allgather dispatcher); the experts' FFN width is written out when ``cfg`` has the dense shape."""
    if cfg.get("num_moe_experts") is None:
        return {}
    fields = {key: cfg[key] for key in MOE_KEYS if cfg.get(key) is not None}
    if "moe_ffn_hidden_size" not in fields and "hidden_size" in cfg:
        # Megatron-Core's own default (the dense FFN width), set here: it would warn in two raw lines on stderr;
        # model_notices says it in one
        fields["moe_ffn_hidden_size"] = expert_ffn_size(cfg)
    if isinstance(fields.get("moe_layer_freq"), (list, tuple)):
        fields["moe_layer_freq"] = [int(f) for f in fields["moe_layer_freq"]]
    return fields


def config_layout(config: Any) -> ModelLayout:
    """The plan's view of a Megatron-Core TransformerConfig (or a framework's subclass of it: Megatron-Bridge's model
    provider, NeMo's GPTConfig): its layers and the experts of its MoE layers."""
    # (getattr with a default: a framework's own config, e.g. a stand-in for a dense TransformerConfig, may lack them)
    moe = {key: getattr(config, key, default) for key, default in (
        ("num_moe_experts", None), ("moe_layer_freq", 1), ("moe_shared_expert_intermediate_size", None))}
    return layout_of({"num_layers": config.num_layers, **moe})


def check_model_device(cfg: Mapping[str, Any], device: str) -> None:
    """The keys that need a GPU (Transformer Engine, CUDA streams, CUDA graphs), refused on the CPU before anything is
    built, and router padding, whose fix depends on the machine (``device``: 'cpu' or 'cuda')."""
    if graphs_on(cfg) and device != "cuda":
        raise ConfigError("model.cuda_graph_impl=transformer_engine: CUDA graphs need a GPU; on the CPU set "
                         "model.cuda_graph_impl=none")
    if cfg.get("num_moe_experts") is None:
        return
    dispatcher = cfg.get("moe_token_dispatcher_type", "allgather")
    if cfg.get("moe_router_padding_for_quantization") and (device != "cuda" or dispatcher == "allgather"):
        # The dispatchers that pad need a GPU: on the CPU no setting pads (checked first, so that the CPU's
        # allgather-only refusal below never sends the user back here)
        raise ConfigError("model.moe_router_padding_for_quantization=true: Megatron-Core's allgather dispatcher does "
                         "not pad; set model.moe_token_dispatcher_type=alltoall, or the padding false"
                         if device == "cuda" else
                         "model.moe_router_padding_for_quantization=true: router padding cannot run on the CPU "
                         "(Megatron-Core's allgather dispatcher, the only one the CPU runs, does not pad); drop "
                         "model.moe_router_padding_for_quantization (or set it false)")
    if device == "cuda":
        return
    if dispatcher != "allgather":
        raise ConfigError(f"model.moe_token_dispatcher_type={dispatcher}: Megatron-Core's {dispatcher} dispatcher "
                         f"needs a GPU (it creates CUDA streams); on the CPU set model.moe_token_dispatcher_type="
                         f"allgather")
    for key, what in (("moe_permute_fusion", "permutation"), ("moe_router_fusion", "router top-k")):
        if cfg.get(key):
            raise ConfigError(f"model.{key}=true: the fused {what} is Transformer Engine's (GPU only); on the CPU set "
                             f"model.{key}=false")


def model_notices(cfg: Mapping[str, Any], *, device: str) -> list[str]:
    """One-line warnings for model keys that do nothing here (``device``: 'cpu' or 'cuda')."""
    idle_graphs = [k for k in GRAPH_KEYS[1:] if cfg.get(k) is not None] if not graphs_on(cfg) else []
    graphs = [f"model.{idle_graphs[0]}={cfg[idle_graphs[0]]!r} does nothing: model.cuda_graph_impl is none; set "
              f"model.cuda_graph_impl=transformer_engine to capture graphs"] if idle_graphs else []
    return graphs + _moe_notices(cfg, device=device)


def _moe_notices(cfg: Mapping[str, Any], *, device: str) -> list[str]:
    if cfg.get("num_moe_experts") is None:
        idle = [k for k in MOE_KEYS if k != "num_moe_experts" and cfg.get(k) not in (None, False)]
        more = f" (and {', '.join(idle[1:])})" if idle[1:] else ""
        return [f"model.{idle[0]}={cfg[idle[0]]!r}{more} does nothing: model.num_moe_experts is null (a dense "
                f"model); set model.num_moe_experts, or drop the MoE keys"] if idle else []
    out = []
    if cfg.get("moe_ffn_hidden_size") is None:  # (moe_config_fields sets it so: Megatron-Core's default)
        out.append(f"model.moe_ffn_hidden_size is not set: each expert's FFN takes the dense width, "
                   f"{expert_ffn_size(cfg)} (Megatron-Core's default); set model.moe_ffn_hidden_size to choose")
    if device == "cpu" and cfg.get("moe_grouped_gemm"):
        out.append("model.moe_grouped_gemm=true does nothing on the CPU: Megatron-Core's local layers run the experts "
                   "one after another (SequentialMLP); the grouped GEMM is Transformer Engine's, on the GPU")
    if cfg.get("moe_pad_expert_input_to_capacity") and cfg.get("moe_token_dispatcher_type",
                                                                 "allgather") == "allgather":
        out.append("model.moe_pad_expert_input_to_capacity=true does nothing with the allgather dispatcher: it drops "
                   "tokens past the capacity but pads none; the alltoall dispatcher (GPU) pads every expert to it")
    if cfg.get("moe_router_load_balancing_type") == "none" and cfg.get("moe_aux_loss_coeff"):
        out.append(f"model.moe_aux_loss_coeff={cfg['moe_aux_loss_coeff']} does nothing with "
                   f"model.moe_router_load_balancing_type=none (Megatron-Core adds no load-balancing loss); set a "
                   f"balancing type (e.g. aux_loss), or moe_aux_loss_coeff=0")
    return out


def read_model_conf(name: str, command: str, also: Iterable[str] = ()) -> dict:
    """conf/model/NAME.yaml as a dict (its interpolations unresolved: the vocabulary comes from the data); an unknown
    name is refused in one line with the choices (``also``: the command's own models first)."""
    from omegaconf import OmegaConf

    models = conf_dir() / "model"
    path = models / f"{name}.yaml"
    if "/" in name or "\\" in name or not path.is_file():  # (a name, not a path: the group's files are the models)
        choices = sorted(also) + sorted(p.stem for p in models.glob("*.yaml"))
        raise ValueError(f"{command}: {name!r} is not a model; give one of {', '.join(choices)}")
    return OmegaConf.to_container(OmegaConf.load(path), resolve=False)


def pad_vocab_size(vocab_size: int, tensor_model_parallel_size: int = 1, multiple: int = VOCAB_MULTIPLE) -> int:
    """Round the vocabulary up so each tensor-parallel shard of the embedding/LM head is a multiple of 128."""
    step = multiple * tensor_model_parallel_size
    return -(-vocab_size // step) * step


class LinearShape(NamedTuple):
    """What one rank's linear layer multiplies."""

    rows: int
    """The tokens of the input as the layer receives it (under sequence parallelism a column-parallel layer's
    slice of the sequence)."""
    gemm_rows: int
    """The tokens its GEMMs multiply: the slices all-gathered, under sequence parallelism (the input of a
    column-parallel layer, the output gradient of a row-parallel one)."""
    in_features: int
    out_features: int


def linear_shapes(cfg: Mapping[str, Any], *, micro_batch: int, tensor_parallel: int = 1, context_parallel: int = 1,
                  sequence_parallel: bool = False) -> dict[str, LinearShape]:
    """What one rank's linear layers multiply, per module (named as the plan's ModelLayout names them, the layer
    prefix and an expert's number left out). Megatron-Core's layout: column-parallel linear_qkv / linear_fc1 / the LM
    head split their outputs over the tensor-parallel ranks, row-parallel linear_proj / linear_fc2 their inputs;
    context parallelism splits the sequence; sequence parallelism hands the column-parallel layers each rank's slice
    of it (all-gathered inside the layer). A checked config (:func:`check_model_cfg`); its vocabulary may be unset."""
    hidden, heads, tp = int(cfg["hidden_size"]), int(cfg["num_attention_heads"]), tensor_parallel
    head_dim, groups = hidden // heads, int(cfg.get("num_query_groups") or heads)
    ffn = int(cfg.get("ffn_hidden_size") or 4 * hidden)
    gated = 2 if cfg.get("activation", "gelu") == "swiglu" else 1
    tokens = micro_batch * int(cfg["seq_length"]) // context_parallel
    sliced = tokens // tp if sequence_parallel else tokens
    return {"self_attention.linear_qkv": LinearShape(sliced, tokens, hidden, (heads + 2 * groups) * head_dim // tp),
            "self_attention.linear_proj": LinearShape(tokens, tokens, heads * head_dim // tp, hidden),
            "mlp.linear_fc1": LinearShape(sliced, tokens, hidden, gated * ffn // tp),
            "mlp.linear_fc2": LinearShape(tokens, tokens, ffn // tp, hidden),
            # a multiple of VOCAB_MULTIPLE per rank whatever the vocabulary (unset until the tokenizer is read)
            "output_layer": LinearShape(sliced, tokens, hidden,
                                        pad_vocab_size(int(cfg.get("vocab_size") or 1), tp) // tp),
            **_moe_shapes(cfg, tokens, sliced, tp, gated)}


def _moe_shapes(cfg: Mapping[str, Any], tokens: int, sliced: int, tp: int, gated: int) -> dict[str, LinearShape]:
    """An MoE layer's linears (``mlp.experts.*``: every routed expert's, named without the expert number). A routed
    expert multiplies its share of the layer's tokens, which the router changes every step: its rows are the layer's
    tokens here, and TE's grouped GEMM pads each share (model.moe_router_padding_for_quantization)."""
    if cfg.get("num_moe_experts") is None:
        return {}
    hidden = int(cfg["hidden_size"])
    ffn = expert_ffn_size(cfg)
    out = {"mlp.experts.linear_fc1": LinearShape(tokens, tokens, hidden, gated * ffn // tp),
           "mlp.experts.linear_fc2": LinearShape(tokens, tokens, ffn // tp, hidden)}
    shared = cfg.get("moe_shared_expert_intermediate_size")
    if shared is not None:
        out["mlp.shared_experts.linear_fc1"] = LinearShape(sliced, tokens, hidden, gated * int(shared) // tp)
        out["mlp.shared_experts.linear_fc2"] = LinearShape(tokens, tokens, int(shared) // tp, hidden)
    return out


def run_model_cfg(cfg, meta: dict, data_dir: Path) -> dict:
    """The model group as a dict, its vocabulary filled in from the tokenizer's (``meta``: the dataset's
    meta.json) when the config says null. A larger one (llama3's 128256) is kept as configured, so speed and
    memory match the model's name; a smaller one cannot hold every token id and is refused."""
    from omegaconf import OmegaConf

    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    if model_cfg.get("vocab_size") is None:
        model_cfg["vocab_size"] = int(meta["vocab_size"])
    elif int(model_cfg["vocab_size"]) < int(meta["vocab_size"]):
        raise ConfigError(f"model.vocab_size: {model_cfg['vocab_size']} is smaller than the tokenizer's "
                         f"{meta['vocab_size']} ({data_dir}); set model.vocab_size=${{data.vocab_size}} or larger")
    return model_cfg
