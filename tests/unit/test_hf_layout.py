"""The HF Llama layout without transformers (integrations/hf_llama.py, training/hf.py): Megatron's fused qkv and
[gate; up] split and fused back, tensor-parallel shards joined and sliced, Megatron-Core's layer offsets, FP8 scale
shapes, and a core that imports neither transformers nor safetensors."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from fp8_recipes.integrations.hf_llama import LlamaShape, hf_to_megatron, megatron_layer_to_hf, quantize_hf_weights
from fp8_recipes.training.hf import _rank_slice
from fp8_recipes.training.reshard import layer_offset

SHAPE = LlamaShape(num_layers=1, hidden_size=64, ffn_hidden_size=96, num_attention_heads=8, num_query_groups=2,
                   vocab_size=100, seq_length=32, rotary_base=10000.0, layernorm_epsilon=1e-5, tied=False)


def test_fused_qkv_and_fc1_split_into_hf_projections_and_back():
    hd, per_group = SHAPE.head_dim, 4
    # row r of the fused qkv holds (group, slot, dim) = divmod: slots 0-3 queries, 4 key, 5 value
    qkv = torch.arange(2 * 6 * hd, dtype=torch.float32)[:, None].expand(-1, 64).clone()
    state = {"decoder.layers.0.self_attention.linear_qkv.weight": qkv,
             "decoder.layers.0.mlp.linear_fc1.weight": torch.randn(2 * 96, 64),
             **{f"decoder.layers.0.{k}": torch.randn(3) for k in ("input_layernorm.weight", "pre_mlp_layernorm.weight",
                                                                   "self_attention.linear_proj.weight",
                                                                   "mlp.linear_fc2.weight")}}
    hf = megatron_layer_to_hf(state.__getitem__, 0, SHAPE)
    rows = lambda name: hf[f"model.layers.0.self_attn.{name}_proj.weight"][:, 0].long().tolist()  # noqa: E731
    group_rows = lambda g, slot: list(range((g * 6 + slot) * hd, (g * 6 + slot + 1) * hd))  # noqa: E731
    assert rows("q") == [r for g in range(2) for s in range(per_group) for r in group_rows(g, s)]
    assert rows("k") == group_rows(0, 4) + group_rows(1, 4) and rows("v") == group_rows(0, 5) + group_rows(1, 5)
    assert torch.equal(hf["model.layers.0.mlp.gate_proj.weight"], state["decoder.layers.0.mlp.linear_fc1.weight"][:96])
    for name, tensor in state.items():
        assert torch.equal(hf_to_megatron(name, hf.__getitem__, SHAPE), tensor), name


def test_tensor_parallel_slices_are_megatrons_shards():
    fc1 = torch.arange(8.0)[:, None]  # [gate 0-3; up 4-7]
    param = torch.empty(4, 1)
    assert _rank_slice("decoder.layers.0.mlp.linear_fc1.weight", fc1, param, 2, 1)[:, 0].tolist() == [2, 3, 6, 7]
    proj = torch.arange(8.0)[None, :]
    assert _rank_slice("x.self_attention.linear_proj.weight", proj, torch.empty(1, 4), 2, 1).tolist() == [[4, 5, 6, 7]]
    # the padded vocabulary: rows past the checkpoint's keep what the parameter held
    emb = _rank_slice("embedding.word_embeddings.weight", torch.ones(5, 1), torch.zeros(4, 1), 2, 1)
    assert emb[:, 0].tolist() == [1, 0, 0, 0]


@pytest.mark.parametrize("pp, vpp", [(2, None), (2, 2), (4, 2)])
def test_layer_offsets_are_megatron_cores(pp, vpp):
    from types import SimpleNamespace

    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    config = SimpleNamespace(pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
                             num_layers=16, pipeline_model_parallel_layout=None, num_layers_in_first_pipeline_stage=None,
                             num_layers_in_last_pipeline_stage=None, account_for_embedding_in_pipeline_split=False,
                             account_for_loss_in_pipeline_split=False)
    for p in range(pp):
        for v in range(vpp or 1):
            stage = v if vpp else None
            assert layer_offset(p, v, 16, pp, vpp) == get_transformer_layer_offset(config, stage, p), (p, v)


def test_fp8_scales_per_block_and_per_tensor():
    tensors = {"model.layers.0.self_attn.q_proj.weight": torch.randn(256, 384, dtype=torch.bfloat16),
               "model.norm.weight": torch.ones(4, dtype=torch.bfloat16)}
    out, quant = quantize_hf_weights(tensors, (128, 128))
    assert out["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    assert out["model.layers.0.self_attn.q_proj.weight_scale_inv"].shape == (2, 3)
    assert out["model.norm.weight"] is tensors["model.norm.weight"] and quant["weight_block_size"] == [128, 128]
    out, quant = quantize_hf_weights(tensors, None)
    assert out["model.layers.0.self_attn.q_proj.weight_scale_inv"].shape == () and quant["weight_block_size"] is None
    with pytest.raises(ValueError, match=r"^--block 128x128: model.layers.0.self_attn.q_proj.weight is \(192, 384\)"):
        quantize_hf_weights({"model.layers.0.self_attn.q_proj.weight": torch.randn(192, 384)}, (128, 128))


def test_not_llama_shaped_is_one_line():
    with pytest.raises(ValueError) as e:
        LlamaShape.from_model_cfg({"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 8,
                                   "vocab_size": 10, "normalization": "LayerNorm", "activation": "gelu"})
    assert "\n" not in str(e.value) and str(e.value).startswith(
        "the model is not Llama-shaped (model.normalization=LayerNorm, model.activation=gelu, "
        "model.position_embedding_type=learned_absolute)")
    moe = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 8, "vocab_size": 10,
           "normalization": "RMSNorm", "activation": "swiglu", "position_embedding_type": "rope",
           "num_moe_experts": 4}
    with pytest.raises(ValueError, match=r"^the model is not Llama-shaped \(model\.num_moe_experts=4\); .*dense MLPs"):
        LlamaShape.from_model_cfg(moe)


def test_the_core_imports_neither_transformers_nor_safetensors():
    code = ("import sys; import fp8_recipes.cli, fp8_recipes.training.run, fp8_recipes.training.hf; "
            "bad = [m for m in ('transformers', 'safetensors', 'accelerate') if m in sys.modules]; "
            "assert not bad, bad; sys.modules['safetensors'] = None; "  # the hf extra missing
            "from fp8_recipes.integrations.hf_llama import HFTensors\n"
            "try: HFTensors('.', 'model.init_from')\n"
            "except ValueError as e: print(e)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout == 'model.init_from: HF checkpoints need the hf extra: pip install -e ".[hf]" ' \
                          '(transformers, safetensors, accelerate)\n'


def test_an_export_that_fails_while_writing_leaves_nothing(tmp_path):
    """write_hf_checkpoint writes into OUT.tmp: a failure there (here a tokenizer file it cannot create; a full
    disk in real life) removes it, and OUT is never created."""
    from fp8_recipes.integrations.hf_llama import write_hf_checkpoint

    out = tmp_path / "hf"
    with pytest.raises(FileNotFoundError):
        write_hf_checkpoint(out, {"model_type": "llama"}, {"w": torch.zeros(2, 2)}, {"no/such/dir.json": b"{}"})
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    assert write_hf_checkpoint(out, {"model_type": "llama"}, {"w": torch.zeros(2, 2)}, {"a.json": b"{}"}) == out
    assert sorted(p.name for p in out.iterdir()) == ["a.json", "config.json", "model-00001-of-00001.safetensors",
                                                      "model.safetensors.index.json"]
