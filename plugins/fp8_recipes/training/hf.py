"""From and to Hugging Face: export a checkpoint of ours as a HF Llama checkpoint, start a run from one.

    export_hf("runs/hybrid-x", "hf/hybrid-x", dtype="fp8", block=(128, 128))    # fp8-recipes export ... --to hf
    check_hf_init("hf/llama", model_cfg)          # model.init_from=hf:PATH: vocabulary and shape, one line each
    load_hf_weights(chunks, "hf/llama", model_cfg)  # into this rank's model chunks, before the optimizer exists

Export reads the checkpoint through the one checkpoint reader (training/checkpoint.py: read_checkpoint, model
entries only), payload by payload over the layout meta.json records, and joins the shards into whole tensors under
canonical global names (training/reshard.py, which a resume at another layout uses too). The model config, data directory and
tokenizer come from what the run recorded (``.hydra/config.yaml``, as training/evaluate.py reads it).

Import copies each whole HF tensor's slice into the parameter that holds it, for any tensor/pipeline layout and
either layer spec (the TE spec fuses the layer norms into ``linear_qkv`` / ``linear_fc1`` as ``layer_norm_weight``).
Rows of the padded vocabulary keep their initial values. FP8 checkpoints are dequantized with our numerics core.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Callable

import torch

from fp8_recipes.checks import ConfigError
from fp8_recipes.integrations.hf_llama import (
    HFTensors, LlamaShape, dequantize_hf_weights, hf_config, hf_to_megatron, megatron_to_hf, quantize_hf_weights,
    read_hf_config, require_safetensors, write_hf_checkpoint,
)
from fp8_recipes.megatron.data import EOD_TEXT, prepared_meta
from fp8_recipes.megatron.model import unwrap_model
from fp8_recipes.megatron.model_config import run_model_cfg
from fp8_recipes.rundir import HYDRA, load_run_config
from fp8_recipes.training.checkpoint import (check_config_matches, checkpoint_meta, intact_checkpoint,
                                             read_checkpoint)
from fp8_recipes.training.config import check_writable_dir
from fp8_recipes.training.reshard import COLUMN, join_shards, live_global_name, rank_slice

__all__ = ["export_hf", "check_hf_init", "load_hf_weights", "hf_init_path", "parse_block"]

logger = logging.getLogger("fp8_recipes")

def parse_block(text: str) -> tuple[int, int] | None:
    """``--block``: ``tensor`` (one scale per tensor) or ``RxC`` (e.g. 128x128)."""
    if text == "tensor":
        return None
    try:
        rows, cols = (int(x) for x in text.lower().split("x"))
    except ValueError:
        rows = cols = 0
    if rows < 1 or cols < 1:
        raise ConfigError(f"--block: {text!r} is not 'tensor' or ROWSxCOLS (e.g. 128x128)")
    return rows, cols


# ----------------------------------------------------------------------------------------------------------
# Export


def _whole_model_state(step_dir: Path, num_layers: int, progress: Callable[[str], None]) -> dict[str, torch.Tensor]:
    """Every model tensor of a checkpoint, joined over its shards, under canonical global names."""
    meta = checkpoint_meta(step_dir)
    layout = (int(meta.get("tensor_model_parallel_size", 1)), int(meta.get("pipeline_model_parallel_size") or 1),
              meta.get("virtual_pipeline_model_parallel_size"))
    state, _ = join_shards(lambda t, p, _ep: read_checkpoint(step_dir, t, pp_rank=p, skip_optimizer=True), layout,
                           num_layers, progress=lambda line: progress(f"export: {step_dir.name}: {line}"))
    return state


def _run_config(step_dir: Path):
    """(the run's composed config, its run dir) for a step dir under ``<run>/checkpoints/``."""
    run_dir = step_dir.parent.parent
    if not (run_dir / HYDRA / "config.yaml").is_file():
        raise ConfigError(f"SOURCE: {step_dir} is not inside a run directory written by scripts/train.py (no "
                          f"{run_dir / HYDRA / 'config.yaml'}); export from the run dir or its step_N dir")
    return load_run_config(run_dir, "SOURCE"), run_dir  # (a damaged one: a line naming it)


def _bytes_tokenizer_json() -> str:
    """Our ``bytes`` tokenizer (UTF-8 bytes are ids 0-255, EOD 256) as a HF ``tokenizers`` file: byte-level BPE
    without merges over GPT-2's byte-to-character table, ``<|endoftext|>`` = 256."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    chars = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):  # GPT-2's bytes_to_unicode: printable bytes map to themselves, the rest to 256+
        if b in chars:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    tok = Tokenizer(models.BPE(vocab={table[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    return tok.to_str()


def _tokenizer_files(data_dir: Path, seq_length: int) -> dict[str, bytes]:
    """The HF tokenizer files of a run's (intact) dataset."""
    text = (data_dir / "tokenizer.json").read_text(encoding="utf-8")
    if json.loads(text).get("fp8_recipes_tokenizer") == "bytes":
        text = _bytes_tokenizer_json()
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOD_TEXT, "eos_token": EOD_TEXT,
              "model_max_length": seq_length, "clean_up_tokenization_spaces": False}
    return {"tokenizer.json": text.encode("utf-8"),
            "tokenizer_config.json": (json.dumps(config, indent=2) + "\n").encode("utf-8")}


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def export_hf(source: str | os.PathLike, out: str | os.PathLike, *, dtype: str = "bf16",
              block: tuple[int, int] | None = (128, 128), progress: Callable[[str], None] = _progress) -> Path:
    """Write the checkpoint ``source`` (a run dir: its latest; or a step_N dir) as a HF Llama checkpoint in ``out``:
    config.json, the run's tokenizer, safetensors shards and their index. ``dtype``: bf16 | fp8 (E4M3 projections
    with their scales, per tensor when ``block`` is None). User errors are one-line ValueErrors."""
    if dtype not in ("bf16", "fp8"):
        raise ConfigError(f"--dtype: {dtype!r} is not bf16 or fp8")
    require_safetensors("--to hf")  # before minutes of reading shards
    step_dir = intact_checkpoint(source, "SOURCE")
    out = Path(out)
    if out.resolve() == Path(source).resolve() or Path(source).resolve() in out.resolve().parents:
        raise ConfigError(f"OUT: {out} is inside the run {source}; write the export somewhere else")
    if out.exists() and not (out / "config.json").is_file():
        raise ConfigError(f"OUT: {out} exists and is not a HF checkpoint (no config.json); give a new directory")
    check_writable_dir("OUT", str(out))  # before minutes of reading shards
    cfg, run_dir = _run_config(step_dir)
    data_dir = Path(cfg.data.path)
    if not (data_dir / "meta.json").is_file():
        raise ConfigError(f"data.path: the run's dataset {data_dir} is gone (its tokenizer goes into the export); "
                         f"rebuild it with python scripts/prepare_data.py --out {data_dir} and the run's data settings")
    meta = prepared_meta(data_dir)  # (damaged: a line naming data.path and the command that prepares it again)
    model_cfg = run_model_cfg(cfg, meta, data_dir)
    check_config_matches(step_dir, model_cfg, run_dir / HYDRA / "config.yaml", "SOURCE")  # config.json comes from it
    shape = LlamaShape.from_model_cfg(model_cfg)
    state = _whole_model_state(step_dir, shape.num_layers, progress)
    if shape.tied:
        state.setdefault("output_layer.weight", state["embedding.word_embeddings.weight"])

    def get(name: str) -> torch.Tensor:
        if name not in state:
            raise ConfigError(f"SOURCE: {step_dir} holds no {name}; was it written by another model config?")
        return state[name].to(torch.bfloat16)

    tensors = megatron_to_hf(get, shape)
    quant = None
    if dtype == "fp8":
        progress(f"export: quantizing {shape.num_layers * 7} projections to FP8 E4M3 "
                 f"({'per tensor' if block is None else f'{block[0]}x{block[1]} blocks'})")
        tensors, quant = quantize_hf_weights(tensors, block)
    files, eod = _tokenizer_files(data_dir, shape.seq_length), int(meta["eod"])  # (the EOD is BOS and EOS)
    config = hf_config(shape, bos_token_id=eod, eos_token_id=eod, quant=quant)
    written = write_hf_checkpoint(out, config, tensors, files, progress=progress)
    progress(f"export: {step_dir} -> {written} ({dtype}, {len(tensors)} tensors)")
    return written


# ----------------------------------------------------------------------------------------------------------
# Import (model.init_from=hf:PATH)


def hf_init_path(init_from: str) -> Path:
    """The directory of ``model.init_from=hf:PATH``."""
    return Path(init_from[len("hf:"):])


def check_hf_init(path: str | os.PathLike, model_cfg: dict) -> LlamaShape:
    """The HF checkpoint at ``path`` fits the model config: the vocabulary and the shape, one line each."""
    where = "model.init_from"
    config = read_hf_config(path, where)
    theirs = LlamaShape.from_hf_config(config, where)
    ours = LlamaShape.from_model_cfg(model_cfg)
    if theirs.vocab_size != ours.vocab_size:
        raise ConfigError(f"{where}: {path} has vocab_size {theirs.vocab_size}, the model {ours.vocab_size} (the data's "
                         f"tokenizer when model.vocab_size is null); set model.vocab_size={theirs.vocab_size} and "
                         f"train on data tokenized with that checkpoint's tokenizer")
    diff = ours.differences(theirs)
    if diff:
        raise ConfigError(f"{where}: {path} has another shape than the model config: "
                         f"{', '.join(f'model.{k}={a} vs {b}' for k, a, b in diff)}; set "
                         f"{' '.join(f'model.{k}={str(b).lower() if isinstance(b, bool) else b}' for k, _, b in diff)}")
    return theirs


def _rank_slice(name: str, whole: torch.Tensor, param: torch.Tensor, tp: int, tp_rank: int) -> torch.Tensor:
    """This tensor-parallel rank's part of the whole Megatron tensor ``whole`` (canonical ``name``); rows of the
    padded vocabulary past the HF one keep their initial values."""
    if name.endswith(COLUMN[:2]):  # the embedding and the LM head
        rows = param.shape[0]
        part = param.detach().clone()
        lo = tp_rank * rows
        n = max(0, min(rows, whole.shape[0] - lo))
        part[:n] = whole[lo:lo + n]
        return part
    if whole.shape == param.shape:
        return whole
    return rank_slice(name, whole, tp, tp_rank)


def load_hf_weights(chunks: list, path: str | os.PathLike, model_cfg: dict) -> int:
    """Copy the HF checkpoint at ``path`` into this rank's model chunks (call before the optimizer copies the
    parameters); returns the number of tensors set."""
    from megatron.core import parallel_state as ps

    shape = check_hf_init(path, model_cfg)
    config = read_hf_config(path, "model.init_from")
    hf = HFTensors(path, "model.init_from")
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()

    def get(name: str) -> torch.Tensor:
        return dequantize_hf_weights(hf, name, config)

    done = 0
    with torch.no_grad():
        for chunk in chunks:
            gpt = unwrap_model(chunk)
            for local, param in gpt.named_parameters():
                name = live_global_name(gpt, local)
                whole = hf_to_megatron(name, get, shape)
                part = _rank_slice(name, whole, param, tp, tp_rank)
                if part.shape != param.shape:
                    raise ConfigError(f"model.init_from: {path}: {name} is {tuple(part.shape)} on this rank, the model "
                                     f"holds {tuple(param.shape)}")
                param.copy_(part)
                done += 1
    return done
