"""The Hugging Face Llama checkpoint layout: config.json, tensor names, FP8 weights with their scales.

    shape = LlamaShape.from_model_cfg(model_cfg)              # refuses a model that is not Llama-shaped
    hf = megatron_to_hf(full_state, shape)                    # Megatron-Core names (whole model) -> HF tensors
    hf, quant = quantize_hf_weights(hf, block=(128, 128))     # FP8 E4M3 codes + weight_scale_inv, as TE makes them
    write_hf_checkpoint(out, hf_config(shape, quant=quant), hf, tokenizer_files)

Megatron-Core's Llama (GPTModel, RMSNorm, SwiGLU, RoPE, grouped-query attention, no biases) holds two fused
weights per layer (megatron-core 0.19.2, docs/facts.md): ``linear_qkv`` is ``[per query group: its query heads,
one key head, one value head] x head_dim`` rows, and ``linear_fc1`` is ``[gate; up]``. HF keeps q/k/v and
gate/up apart. Megatron's rotary embedding rotates halves (``rotary_interleaved=False``), as HF's Llama does, so
q and k need no permutation. The vocabulary is padded in Megatron (megatron/model.py: pad_vocab_size) and trimmed
to ``model.vocab_size`` here.

FP8 export ("fp8" ``quantization_config``, as DeepSeek-V3 and Qwen3-FP8 ship): each q/k/v/o/gate/up/down
projection is quantized as one tensor by our numerics core under Transformer Engine's weight rules (per tensor:
Float8CurrentScaling, ``scale = 448 / amax``; 128x128 blocks: Float8BlockScaling, power-of-two scales), stored as
``float8_e4m3fn`` with a float32 ``weight_scale_inv`` (0-dim per tensor, ``[ceil(rows/128), ceil(cols/128)]`` per
block) that dequantization multiplies by. Embeddings, norms and the LM head stay BF16.

Pure torch and json; ``safetensors`` (the ``hf`` extra) is imported only to read and write files.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from fp8_recipes.numerics import Quantized, dequantize, quantize
from fp8_recipes.recipe.schema import Format, Scaling, TensorPolicy

__all__ = ["LlamaShape", "HF_EXTRA", "require_safetensors", "hf_config", "megatron_to_hf", "hf_to_megatron",
           "quantize_hf_weights", "dequantize_hf_weights", "write_hf_checkpoint", "read_hf_config", "HFTensors",
           "FP8_PROJECTIONS"]

HF_EXTRA = 'the hf extra: pip install -e ".[hf]" (transformers, safetensors, accelerate)'
FP8_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SHARD_BYTES = 5 * 1024**3  # transformers' default max_shard_size ("5GB")
INDEX_FILE = "model.safetensors.index.json"


@dataclasses.dataclass(frozen=True)
class LlamaShape:
    """What a Llama checkpoint's config says, in Megatron's terms (model config keys in the comments)."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int  # model.num_query_groups, or the head count when null (multi-head attention)
    vocab_size: int  # the tokenizer's (unpadded)
    seq_length: int  # HF's max_position_embeddings
    rotary_base: float
    layernorm_epsilon: float
    tied: bool  # model.share_embeddings_and_output_weights

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_model_cfg(cls, cfg: Mapping[str, Any]) -> LlamaShape:
        """The shape of a model config; a ValueError of one line when the model is not Llama-shaped."""
        wanted = {"normalization": "RMSNorm", "activation": "swiglu", "position_embedding_type": "rope",
                  "add_bias_linear": False}
        defaults = {"normalization": "LayerNorm", "activation": "gelu", "position_embedding_type": "learned_absolute",
                    "add_bias_linear": False}
        off = [f"model.{k}={cfg.get(k, defaults[k])}" for k, v in wanted.items() if cfg.get(k, defaults[k]) != v]
        if cfg.get("num_moe_experts") is not None:  # (a Mixture-of-Experts model: routers and experts, no dense MLP)
            off.append(f"model.num_moe_experts={cfg['num_moe_experts']}")
        if off:
            raise ValueError(f"the model is not Llama-shaped ({', '.join(off)}); a HF Llama checkpoint needs "
                             f"RMSNorm, SwiGLU, RoPE, no linear biases and dense MLPs (e.g. model=llama3_8b_8l or "
                             f"model=tiny)")
        heads = int(cfg["num_attention_heads"])
        return cls(num_layers=int(cfg["num_layers"]), hidden_size=int(cfg["hidden_size"]),
                   ffn_hidden_size=int(cfg.get("ffn_hidden_size") or 4 * int(cfg["hidden_size"])),
                   num_attention_heads=heads, num_query_groups=int(cfg.get("num_query_groups") or heads),
                   vocab_size=int(cfg["vocab_size"]), seq_length=int(cfg["seq_length"]),
                   rotary_base=float(cfg.get("rotary_base", 10000)),
                   layernorm_epsilon=float(cfg.get("layernorm_epsilon", 1e-5)),
                   tied=bool(cfg.get("share_embeddings_and_output_weights", False)))

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], where: str) -> LlamaShape:
        """The shape a HF ``config.json`` describes; a one-line ValueError (prefixed ``where``) for anything our
        Megatron-Core Llama cannot hold."""
        if config.get("model_type") != "llama":
            raise ValueError(f"{where}: model_type {config.get('model_type')!r} is not 'llama'; give a HF Llama "
                             f"checkpoint")
        rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        off = [f"{k}={config.get(k)}" for k, v in (("hidden_act", "silu"), ("attention_bias", False),
                                                   ("mlp_bias", False)) if config.get(k, v) != v]
        if rope_type != "default":
            off.append(f"rope_type={rope_type}")
        heads = int(config["num_attention_heads"])
        if config.get("head_dim") not in (None, int(config["hidden_size"]) // heads):
            off.append(f"head_dim={config['head_dim']} (hidden_size / num_attention_heads is the only one here)")
        if off:
            raise ValueError(f"{where}: {', '.join(off)} cannot be built here (SiLU, no biases, plain RoPE only)")
        return cls(num_layers=int(config["num_hidden_layers"]), hidden_size=int(config["hidden_size"]),
                   ffn_hidden_size=int(config["intermediate_size"]), num_attention_heads=heads,
                   num_query_groups=int(config.get("num_key_value_heads") or heads),
                   vocab_size=int(config["vocab_size"]), seq_length=int(config.get("max_position_embeddings", 0)),
                   rotary_base=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
                   layernorm_epsilon=float(config.get("rms_norm_eps", 1e-6)),
                   tied=bool(config.get("tie_word_embeddings", False)))

    def differences(self, other: LlamaShape) -> list[tuple[str, Any, Any]]:
        """(model config key, this value, other value) for each architectural field that differs (not the
        vocabulary, not the context length: a model may train at another sequence length than it was made for)."""
        keys = {"num_layers": "num_layers", "hidden_size": "hidden_size", "ffn_hidden_size": "ffn_hidden_size",
                "num_attention_heads": "num_attention_heads", "num_query_groups": "num_query_groups",
                "rotary_base": "rotary_base", "layernorm_epsilon": "layernorm_epsilon",
                "tied": "share_embeddings_and_output_weights"}
        return [(key, getattr(self, f), getattr(other, f)) for f, key in keys.items()
                if getattr(self, f) != getattr(other, f)]


def hf_config(shape: LlamaShape, *, bos_token_id: int | None, eos_token_id: int | None,
              quant: dict | None = None) -> dict[str, Any]:
    """config.json of a ``LlamaForCausalLM`` with this shape (BF16; ``quant``: its quantization_config)."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.ffn_hidden_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_query_groups,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": shape.seq_length,
        "rms_norm_eps": shape.layernorm_epsilon,
        # transformers 5 reads rope_parameters; older readers (and vLLM's) rope_theta
        "rope_parameters": {"rope_type": "default", "rope_theta": shape.rotary_base},
        "rope_theta": shape.rotary_base,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": shape.tied,
        "vocab_size": shape.vocab_size,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "dtype": "bfloat16",
    }
    if quant is not None:
        config["quantization_config"] = quant
    return config


def read_hf_config(path: str | os.PathLike, where: str) -> dict[str, Any]:
    config = Path(path) / "config.json"
    if not config.is_file():
        raise ValueError(f"{where}: {path} has no config.json; give a HF checkpoint directory")
    return json.loads(config.read_text(encoding="utf-8"))


# ----------------------------------------------------------------------------------------------------------
# Tensor names. Megatron-Core names here are the local spec's with global layer numbers ("canonical"):
# decoder.layers.<i>.{input_layernorm,self_attention.linear_qkv,self_attention.linear_proj,pre_mlp_layernorm,
# mlp.linear_fc1,mlp.linear_fc2}.weight, embedding.word_embeddings.weight, decoder.final_layernorm.weight,
# output_layer.weight. The TE spec's fused norms are renamed to these by training/hf.py.

_LAYER_PLAIN = {"input_layernorm.weight": "input_layernorm.weight",
                "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
                "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
                "mlp.linear_fc2.weight": "mlp.down_proj.weight"}


def _split_qkv(qkv: torch.Tensor, shape: LlamaShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    per_group = shape.num_attention_heads // shape.num_query_groups
    view = qkv.reshape(shape.num_query_groups, per_group + 2, shape.head_dim, -1)
    cols = view.shape[-1]
    return (view[:, :per_group].reshape(-1, cols), view[:, per_group].reshape(-1, cols),
            view[:, per_group + 1].reshape(-1, cols))


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: LlamaShape) -> torch.Tensor:
    per_group, hd, cols = shape.num_attention_heads // shape.num_query_groups, shape.head_dim, q.shape[-1]
    groups = shape.num_query_groups
    return torch.cat([q.reshape(groups, per_group, hd, cols), k.reshape(groups, 1, hd, cols),
                      v.reshape(groups, 1, hd, cols)], dim=1).reshape(-1, cols)


def megatron_layer_to_hf(get: Callable[[str], torch.Tensor], i: int, shape: LlamaShape) -> dict[str, torch.Tensor]:
    """Layer ``i``'s HF tensors from its whole (unsharded) Megatron tensors (``get(name)``, canonical names)."""
    src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
    out = {dst + hf: get(src + mc) for mc, hf in _LAYER_PLAIN.items()}
    q, k, v = _split_qkv(get(src + "self_attention.linear_qkv.weight"), shape)
    gate, up = get(src + "mlp.linear_fc1.weight").chunk(2, dim=0)
    out.update({dst + "self_attn.q_proj.weight": q, dst + "self_attn.k_proj.weight": k,
                dst + "self_attn.v_proj.weight": v, dst + "mlp.gate_proj.weight": gate,
                dst + "mlp.up_proj.weight": up})
    return {name: t.contiguous() for name, t in out.items()}


def megatron_to_hf(get: Callable[[str], torch.Tensor], shape: LlamaShape) -> dict[str, torch.Tensor]:
    """Every HF tensor, in HF's order, from the whole model's Megatron tensors; the vocabulary trimmed."""
    out = {"model.embed_tokens.weight": get("embedding.word_embeddings.weight")[:shape.vocab_size].contiguous()}
    for i in range(shape.num_layers):
        out.update(megatron_layer_to_hf(get, i, shape))
    out["model.norm.weight"] = get("decoder.final_layernorm.weight")
    if not shape.tied:
        out["lm_head.weight"] = get("output_layer.weight")[:shape.vocab_size].contiguous()
    return out


def hf_to_megatron(name: str, get: Callable[[str], torch.Tensor], shape: LlamaShape) -> torch.Tensor:
    """The whole (unsharded, vocabulary unpadded) Megatron tensor ``name`` (canonical) from HF tensors."""
    if name == "embedding.word_embeddings.weight":
        return get("model.embed_tokens.weight")
    if name == "output_layer.weight":
        return get("model.embed_tokens.weight" if shape.tied else "lm_head.weight")
    if name == "decoder.final_layernorm.weight":
        return get("model.norm.weight")
    prefix, _, rest = name.partition(".layers.")
    i, _, suffix = rest.partition(".")
    dst = f"model.layers.{i}."
    if prefix == "decoder" and suffix in _LAYER_PLAIN:
        return get(dst + _LAYER_PLAIN[suffix])
    if suffix == "self_attention.linear_qkv.weight":
        return _fuse_qkv(*(get(dst + f"self_attn.{p}_proj.weight") for p in "qkv"), shape)
    if suffix == "mlp.linear_fc1.weight":
        return torch.cat([get(dst + "mlp.gate_proj.weight"), get(dst + "mlp.up_proj.weight")], dim=0)
    raise KeyError(f"{name}: no HF Llama tensor maps to it")


# ----------------------------------------------------------------------------------------------------------
# FP8


def _fp8_policy(block: tuple[int, int] | None):
    if block is None:  # Transformer Engine's Float8CurrentScaling weights
        return TensorPolicy(scaling=Scaling.TENSORWISE, format=Format.E4M3)
    # Transformer Engine's Float8BlockScaling weights: power-of-two scales
    return TensorPolicy(scaling=Scaling.BLOCKWISE, format=Format.E4M3, block=block, pow2_scales=True)


def _is_projection(name: str) -> bool:
    return name.endswith(".weight") and name.rsplit(".", 2)[-2] in FP8_PROJECTIONS


def quantize_hf_weights(tensors: Mapping[str, torch.Tensor], block: tuple[int, int] | None
                        ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The projections as FP8 E4M3 codes plus ``<name>_scale_inv`` (per tensor, or per ``block``), everything
    else as it is; and the ``quantization_config`` that describes them. transformers' dequantizer reads the block
    from the scale grid, so a dimension larger than the block must be a multiple of it (ValueError otherwise)."""
    policy = _fp8_policy(block)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if not _is_projection(name):
            out[name] = tensor
            continue
        if block is not None:
            bad = [d for d, b in zip(tensor.shape, block) if d > b and d % b]
            if bad:
                raise ValueError(f"--block {block[0]}x{block[1]}: {name} is {tuple(tensor.shape)}, not whole blocks "
                                 f"(readers take the block size from the scale grid); use --block tensor")
        q = quantize(tensor, policy)
        out[name] = q.codes.reshape(tensor.shape)
        out[name + "_scale_inv"] = q.scale_inv.reshape(()) if block is None else q.scale_inv.contiguous()
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
             "weight_block_size": list(block) if block is not None else None, "modules_to_not_convert": ["lm_head"]}
    return out, quant


def dequantize_hf_weights(get: Callable[[str], torch.Tensor], name: str, config: Mapping[str, Any]) -> torch.Tensor:
    """Tensor ``name`` of a checkpoint, FP8 projections dequantized (codes x weight_scale_inv per block, float32)."""
    tensor = get(name)
    if tensor.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        return tensor
    scale_inv = get(name + "_scale_inv").float()
    block = (config.get("quantization_config") or {}).get("weight_block_size")
    grid = scale_inv.reshape(1, 1) if scale_inv.numel() == 1 and not block else scale_inv
    q = Quantized(codes=tensor, scale=torch.reciprocal(grid), scale_inv=grid,
                  block=tuple(block) if block else tuple(tensor.shape), shape=tensor.shape, dtype=torch.float32,
                  format=Format.E4M3 if tensor.dtype == torch.float8_e4m3fn else Format.E5M2, amax=grid)
    return dequantize(q)


# ----------------------------------------------------------------------------------------------------------
# Files


def require_safetensors(where: str):
    try:
        import safetensors.torch
    except ImportError:
        raise ValueError(f"{where}: HF checkpoints need {HF_EXTRA}") from None
    return safetensors.torch


def write_hf_checkpoint(out: str | os.PathLike, config: dict, tensors: Mapping[str, torch.Tensor],
                        extra_files: Mapping[str, bytes], *, shard_bytes: int = SHARD_BYTES,
                        progress: Callable[[str], None] = lambda line: None) -> Path:
    """Write config.json, ``extra_files`` (tokenizer) and the tensors as safetensors shards with an index into
    ``out`` atomically: everything goes into ``out.tmp`` first, which then replaces ``out``."""
    st = require_safetensors("--to hf")
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        _write_shards(st, tmp, config, tensors, extra_files, shard_bytes, progress)
    except BaseException:  # a full disk, an interrupt: no half-written export is left behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        old = out.with_name(out.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(out, old)
        os.rename(tmp, out)
        shutil.rmtree(old)
    else:
        os.rename(tmp, out)
    return out


def _write_shards(st: Any, tmp: Path, config: dict, tensors: Mapping[str, torch.Tensor],
                  extra_files: Mapping[str, bytes], shard_bytes: int, progress: Callable[[str], None]) -> None:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    weight_map, total = {}, 0
    for n, shard in enumerate(shards, 1):
        file = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        st.save_file(shard, str(tmp / file), metadata={"format": "pt"})
        os.chmod(tmp / file, 0o644)  # safetensors creates it private; the rest of the export is world-readable
        weight_map.update({name: file for name in shard})
        total += sum(t.numel() * t.element_size() for t in shard.values())
        progress(f"export: wrote {file} ({len(shard)} tensors)")
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    for name, data in extra_files.items():
        (tmp / name).write_bytes(data)


class HFTensors:
    """The tensors of a HF checkpoint directory (an index with shards, or one model.safetensors), each read from
    its file when asked for (memory-mapped: a rank reads only the tensors of the layers it holds)."""

    def __init__(self, path: str | os.PathLike, where: str):
        self.path, self.where = Path(path), where
        require_safetensors(where)
        index = self.path / INDEX_FILE
        if index.is_file():
            self.files = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        elif (self.path / "model.safetensors").is_file():
            from safetensors import safe_open

            with safe_open(str(self.path / "model.safetensors"), framework="pt") as f:
                self.files = {name: "model.safetensors" for name in f.keys()}
        else:
            raise ValueError(f"{where}: {path} has neither {INDEX_FILE} nor model.safetensors; give a HF checkpoint "
                             f"directory saved with safetensors")
        self._open: dict[str, Any] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def __call__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        if name not in self.files:
            raise ValueError(f"{self.where}: {self.path} has no tensor {name}; is it a complete Llama checkpoint?")
        file = self.files[name]
        if file not in self._open:
            self._open[file] = safe_open(str(self.path / file), framework="pt")
        return self._open[file].get_tensor(name)
