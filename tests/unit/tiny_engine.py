"""A one-layer Megatron-Core GPT on Megatron-Core's engine, in this process (one rank, gloo, the CPU shim), for the
loop's unit tests: non-finite steps (test_faults.py) and preemption (test_preemption.py).

``poison`` = {training forward index: "loss" | "grad"}: that forward's per-token losses are NaN, or (a finite loss)
the LM head's weight gradient of that backward is inf."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from fp8_recipes.megatron.model import build_model_chunks, destroy_distributed, init_distributed, unwrap_model
from fp8_recipes.training.config import TrainerConfig
from fp8_recipes.training.engine import Engine, build_engine

VOCAB, SEQ, BATCH = 16, 8, 4
MODEL = {"num_layers": 1, "hidden_size": 32, "ffn_hidden_size": 64, "num_attention_heads": 2, "seq_length": SEQ,
         "vocab_size": VOCAB, "normalization": "RMSNorm", "activation": "swiglu", "position_embedding_type": "rope"}


def batches() -> Iterator[dict]:
    gen = torch.Generator().manual_seed(1)
    while True:
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        yield {"tokens": tokens, "labels": torch.roll(tokens, -1, 1), "loss_mask": torch.ones(BATCH, SEQ),
               "position_ids": torch.arange(SEQ).expand(BATCH, SEQ)}


def _poisoner(poison: dict[int, str]):
    calls = [0]

    def hook(module, args, output):
        if not module.training:
            return None
        kind = poison.get(calls[0])
        calls[0] += 1
        if kind == "loss":  # the loss itself is NaN
            return output * float("nan")
        if kind == "grad":  # a finite loss, but the LM head's weight gradient is inf (this backward only)
            def corrupt(g):
                handle.remove()
                return torch.full_like(g, float("inf"))
            handle = module.output_layer.weight.register_hook(corrupt)
        return None

    return hook


@contextlib.contextmanager
def tiny_engine(trainer: dict, poison: dict[int, str] | None = None) -> Iterator[Engine]:
    """The engine of a one-layer BF16 GPT for ``trainer`` (a trainer group dict), inside a one-rank process group."""
    _, _, device = init_distributed(seed=0)
    try:
        cfg = TrainerConfig.from_cfg(trainer)
        chunks = build_model_chunks(MODEL, params_dtype=torch.bfloat16, device=device)
        unwrap_model(chunks[0]).register_forward_hook(_poisoner(poison or {}))
        yield build_engine(chunks, cfg, seq_length=SEQ, lr=cfg.lr, device=device)
    finally:
        destroy_distributed()


def tensors(obj) -> list[torch.Tensor]:
    """Every tensor in a nested state (dicts, lists, tuples), in a fixed order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for k in obj for t in tensors(obj[k])]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors(v)]
    return []
