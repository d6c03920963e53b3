"""Megatron-Core GPTModel on the CPU (gloo, one process): the shim, model building, linear substitution,
and ~20 steps of the real training loop on Megatron-Core's engine with metrics, LR schedule, checkpoint save and
restore."""

import json
import math

import pytest
import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.module import Float16Module

from fp8_recipes.megatron.cpu_shim import install_cpu_shim
from fp8_recipes.megatron.data import repeated_batch
from fp8_recipes.megatron.model import (
    build_gpt_model, linear_module_names, named_linear_modules, pad_vocab_size, unwrap_model,
)
from fp8_recipes.rundir import read_metrics
from fp8_recipes.training.checkpoint import load_checkpoint, read_checkpoint, resolve_checkpoint
from fp8_recipes.training.config import TrainerConfig
from fp8_recipes.training.engine import build_engine
from fp8_recipes.training.loop import train
from fp8_recipes.training.lr_schedule import lr_at
from fp8_recipes.training.precision import NoPrecision

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.filterwarnings("ignore::DeprecationWarning")]

SEQ = 64


class CountingColumn(tensor_parallel.ColumnParallelLinear):
    calls = 0

    def _forward_impl(self, input, weight, *args, **kwargs):
        CountingColumn.calls += 1
        return super()._forward_impl(input, weight, *args, **kwargs)


class CountingRow(tensor_parallel.RowParallelLinear):
    calls = 0

    def _forward_impl(self, input, weight, *args, **kwargs):
        CountingRow.calls += 1
        return super()._forward_impl(input, weight, *args, **kwargs)


def engine_of(model, trainer: dict, device):
    cfg = TrainerConfig.from_cfg(trainer)
    return build_engine([model], cfg, seq_length=SEQ, lr=cfg.lr, device=device)


def fixed_batches(batch_size=4, seq=SEQ, vocab=4096, seed=0):
    """The same batch forever: the model can memorise it, so the loss must fall."""
    return repeated_batch(batch_size, seq, vocab, seed)


def test_cpu_shim_is_idempotent(megatron_cpu):
    assert install_cpu_shim() is True and install_cpu_shim() is True
    assert torch.cuda.current_device() == "cpu"
    tracker = tensor_parallel.get_cuda_rng_tracker()
    with tracker.fork():  # the model-parallel stream: its own CPU generator state, restored afterwards
        a = torch.rand(3)
    b = torch.rand(3)
    assert not torch.equal(a, b)


def test_linear_module_names_tiny(megatron_cpu, tiny_model_cfg):
    model = build_gpt_model(tiny_model_cfg, device=megatron_cpu[2])
    per_layer = ["self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2"]
    assert linear_module_names(model) == [f"decoder.layers.{i}.{n}" for i in range(4) for n in per_layer] + [
        "output_layer"]
    assert unwrap_model(model).vocab_size == pad_vocab_size(4096) == 4096
    assert pad_vocab_size(50257) == 50304 and pad_vocab_size(4097, 2) == 4352


def test_substituted_classes_and_bf16_wrapper(megatron_cpu, tiny_model_cfg):
    torch.manual_seed(0)
    plain = build_gpt_model(tiny_model_cfg, params_dtype=torch.bfloat16, device=megatron_cpu[2])
    torch.manual_seed(0)
    model = build_gpt_model(tiny_model_cfg, column_linear=CountingColumn, row_linear=CountingRow,
                            params_dtype=torch.bfloat16, device=megatron_cpu[2])
    assert isinstance(model, Float16Module) and {p.dtype for p in model.parameters()} == {torch.bfloat16}
    kinds = {name.rsplit(".", 1)[-1]: type(m) for name, m in named_linear_modules(model)}
    assert kinds == {"linear_qkv": CountingColumn, "linear_fc1": CountingColumn, "output_layer": CountingColumn,
                     "linear_proj": CountingRow, "linear_fc2": CountingRow}
    batch = next(fixed_batches())
    CountingColumn.calls = CountingRow.calls = 0
    args = (batch["tokens"], batch["position_ids"], None)
    out = model(*args, labels=batch["labels"])
    assert (CountingColumn.calls, CountingRow.calls) == (4 * 2 + 1, 4 * 2)  # per layer qkv+fc1, proj+fc2; + head
    assert out.dtype == torch.float32 and out.shape == (4, SEQ)
    assert torch.equal(out, plain(*args, labels=batch["labels"]))  # same init, same GEMMs: identical losses
    with pytest.raises(ValueError, match="column_linear"):
        build_gpt_model(tiny_model_cfg, column_linear=CountingRow)
    with pytest.raises(ValueError, match="model.normalisation: unknown key"):
        build_gpt_model({**tiny_model_cfg, "normalisation": "RMSNorm"})


def test_train_tiny_checkpoint_and_restore(megatron_cpu, tiny_model_cfg, tmp_path):
    rank, world, device = megatron_cpu
    model = build_gpt_model(tiny_model_cfg, params_dtype=torch.bfloat16, device=device)
    trainer = dict(max_steps=20, micro_batch_size=2, global_batch_size=4, lr=2e-3, min_lr=2e-4, warmup_steps=4,
                   eval_interval=10, eval_iters=2, save_interval=10, log_interval=1,
                   lr_scaling={"enabled": True, "base_global_batch_size": 2})  # lr x 4/2
    summary = train(engine_of(model, trainer, device), fixed_batches(), fixed_batches(seed=1), trainer, NoPrecision(),
                    tmp_path, rank=rank, world_size=world)

    rows = read_metrics(tmp_path, "train")
    assert [r["step"] for r in rows] == list(range(1, 21))
    assert set(rows[0]) >= {"loss", "lr", "grad_norm", "tokens_per_s", "stage", "step_time"}
    assert rows[-1]["loss"] < rows[0]["loss"] - 2.0, [r["loss"] for r in rows]  # memorising one batch
    for r in rows:  # accumulation 2; the schedule with the scaled peak (4e-3) and min_lr (4e-4)
        assert r["lr"] == pytest.approx(lr_at(r["step"] - 1, lr=4e-3, min_lr=4e-4, warmup_steps=4, max_steps=20))
    assert [r["step"] for r in read_metrics(tmp_path, "eval")] == [10, 20]
    assert summary["steps"] == 20 and math.isfinite(summary["val_loss"]) and summary["tokens_per_s_median"] > 0
    assert json.loads((tmp_path / "summary.json").read_text())["final_loss"] == pytest.approx(rows[-1]["loss"])
    assert (tmp_path / "loss.png").is_file()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_10", "step_20"]
    assert resolve_checkpoint(tmp_path).name == "step_20"

    # A freshly initialised model (different weights) restores the trained parameters, fp32 main params and Adam.
    fresh = build_gpt_model(tiny_model_cfg, params_dtype=torch.bfloat16, device=device)
    assert not all(torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters()))
    fresh_engine = engine_of(fresh, trainer, device)
    step = load_checkpoint(tmp_path, engine=fresh_engine, precision=NoPrecision())
    assert step == 20
    for (name, a), b in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(a, b), name
    state = fresh_engine.optimizer.state_dict()
    assert state["optimizer"]["state"][0]["step"].item() == 20
    main = state["fp32_from_fp16_params"][0][0]  # the fp32 main copy of the first bf16 param: not a bf16 round trip
    assert main.dtype == torch.float32 and not torch.equal(main, main.bfloat16().float())
    assert read_checkpoint(tmp_path / "checkpoints" / "step_20")["scheduler"] == {"last_epoch": 20}


def test_gradient_accumulation_matches_one_big_batch(megatron_cpu, tiny_model_cfg, tmp_path):
    """2 micro-batches of 2 and 1 micro-batch of 4 (same 4 sequences) give the same update (fp32)."""
    data = next(fixed_batches(batch_size=4))
    halves = [{k: v[i:i + 2] for k, v in data.items()} for i in (0, 2)]

    def one_step(batches, micro, run):
        torch.manual_seed(5)
        model = build_gpt_model(tiny_model_cfg, params_dtype=torch.float32, device=megatron_cpu[2])
        before = [p.detach().clone() for p in model.parameters()]
        # With eps = 1 Adam's first update g / (|g| + 1) is ~linear in the gradient (no sign-like amplification
        # of rounding noise in near-zero gradients), so the parameter change measures the accumulated gradient.
        cfg = dict(max_steps=1, micro_batch_size=micro, global_batch_size=4, warmup_steps=0, eval_iters=0,
                   clip_grad=0.0, lr=1.0, min_lr=1.0, adam_eps=1.0, weight_decay=0.0, save_checkpoints=False)
        train(engine_of(model, cfg, megatron_cpu[2]), iter(batches), None, cfg, NoPrecision("fp32"), tmp_path / run)
        return [p.detach() - b for p, b in zip(model.parameters(), before)]

    accumulated = one_step(halves, 2, "a")
    whole = one_step([data], 4, "b")
    assert max(d.abs().max().item() for d in whole) > 1e-3  # the step did change the weights
    # a few fp32 ulps of values near 1 (2^-23 = 1.2e-7: the schedule divides each micro-batch's loss by 2 before its
    # backward, one big batch averages 4 sequences); a wrong accumulation moves weights by ~1e-3
    assert max((a - b).abs().max().item() for a, b in zip(accumulated, whole)) < 5e-7


TWO_RANK_WORKER = r'''
import json, sys, warnings
warnings.filterwarnings("ignore")
import torch, torch.distributed as dist
import fp8_recipes  # its CPU start-up hook first (megatron/cpu_start.py)
from megatron.core import parallel_state as ps, tensor_parallel
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from fp8_recipes.megatron.model import build_gpt_model, build_model_chunks, destroy_distributed, init_distributed
from fp8_recipes.training.config import TrainerConfig
from fp8_recipes.training.engine import build_engine
from fp8_recipes.training.loop import train
from fp8_recipes.training.precision import NoPrecision

cfg = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
           seq_length=32, vocab_size=1000, normalization="RMSNorm", activation="swiglu",
           position_embedding_type="rope", add_bias_linear=True)


class PlainGemm(torch.autograd.Function):  # what a backend's custom GEMM looks like: no communication at all
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w, g.reshape(-1, g.shape[-1]).t() @ x.reshape(-1, x.shape[-1])


def _forward_impl(self, input, weight, bias=None, allreduce_dgrad=False, tp_group=None, **kwargs):
    if allreduce_dgrad:  # Megatron's own Function all-reduces dgrad inside; a replacement must do it here
        input = copy_to_tensor_model_parallel_region(input, group=tp_group)
    out = PlainGemm.apply(input, weight)
    return out + bias if bias is not None else out


class Column(tensor_parallel.ColumnParallelLinear):
    _forward_impl = _forward_impl


class Row(tensor_parallel.RowParallelLinear):
    _forward_impl = _forward_impl


tok = torch.randint(0, 1000, (2, 32), generator=torch.Generator().manual_seed(0))
pos = torch.arange(32).expand(2, 32)
out = {}
rank, world, device = init_distributed(tensor_model_parallel_size=2, seed=7)
for name, kw in (("stock", {}), ("custom", dict(column_linear=Column, row_linear=Row))):
    torch.manual_seed(7)
    model = build_gpt_model(cfg, device=device, **kw)
    loss = model(tok, pos, None, labels=tok).mean()
    loss.backward()
    out[name] = (loss.item(), [p.grad.clone() for p in model.parameters()])
result = {"tp2_loss": out["stock"][0], "custom_loss": out["custom"][0],
          "grad_diff": max((a - b).abs().max().item() for a, b in zip(out["stock"][1], out["custom"][1]))}

init_distributed(tensor_model_parallel_size=1, seed=7)  # now data parallel 2: different data per rank
model = build_gpt_model(cfg, params_dtype=torch.bfloat16, device=device)
g = torch.Generator().manual_seed(100 + ps.get_data_parallel_rank())
def batches():
    while True:
        t = torch.randint(0, 1000, (2, 33), generator=g)
        yield dict(tokens=t[:, :-1], labels=t[:, 1:], loss_mask=torch.ones(2, 32), position_ids=pos)
trainer = dict(max_steps=3, micro_batch_size=2, global_batch_size=4, warmup_steps=1, eval_iters=0,
               save_checkpoints=False)
engine = build_engine([model], TrainerConfig.from_cfg(trainer), seq_length=32, lr=1e-3, device=device)
train(engine, batches(), None, trainer, NoPrecision(), sys.argv[1] + f"/dp{rank}", rank=rank, world_size=world)
flat = torch.cat([p.detach().float().flatten() for p in model.parameters()])
other = [torch.zeros_like(flat) for _ in range(world)]
dist.all_gather(other, flat)
result["dp_replicas_equal"] = torch.equal(other[0], other[1])

# PP=2 with tied embeddings: the last stage's LM head starts as a copy of the first stage's embedding (Megatron-Core
# all-reduces a zeroed copy with `weight.data.cuda()` at the build: an internal error on the CPU before the shim)
init_distributed(pipeline_model_parallel_size=2, seed=7)
tied = build_model_chunks({**cfg, "share_embeddings_and_output_weights": True}, device=device)[0]
head = tied.shared_embedding_or_output_weight().detach().clone()  # stage 0: the embedding; stage 1: the LM head
heads = [torch.zeros_like(head) for _ in range(world)]
dist.all_gather(heads, head)
result["tied_head_is_the_embedding"] = torch.equal(heads[0], heads[1]) and bool(heads[0].abs().sum() > 0)
# PP=2 x VPP=2: the interleaved schedule's p2p as Megatron-LM wires it (unbatched, overlapped); batched, an activation
# and a gradient to PP=2's one peer crossed once a step held more micro-batches than stages
init_distributed(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, seed=7)
configs = [chunk.config for chunk in build_model_chunks({**cfg, "num_layers": 4}, device=device)]
result["interleaved_p2p_unbatched"] = all(c.overlap_p2p_comm and not c.batch_p2p_comm for c in configs)
if rank == 0:
    json.dump(result, open(sys.argv[1] + "/result.json", "w"))
destroy_distributed()
'''


def test_two_ranks_tensor_and_data_parallel(megatron_cpu, tiny_model_cfg, tmp_path, free_port):
    """torchrun, 2 gloo ranks: TP=2 matches TP=1; a communication-free GEMM behind `_forward_impl` gives
    Megatron's gradients once the column layer's dgrad all-reduce is restored; DP=2 replicas stay identical; PP=2
    with tied embeddings builds, the LM head a copy of the embedding; PP=2 x VPP=2 sends unbatched."""
    import os
    import subprocess
    import sys

    # The TP=1 reference, in this process (same config and seed as the worker's).
    cfg = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
               seq_length=32, vocab_size=1000, normalization="RMSNorm", activation="swiglu",
               position_embedding_type="rope", add_bias_linear=True)
    torch.manual_seed(7)
    tok = torch.randint(0, 1000, (2, 32), generator=torch.Generator().manual_seed(0))
    reference = build_gpt_model(cfg)(tok, torch.arange(32).expand(2, 32), None, labels=tok).mean().item()

    (tmp_path / "worker.py").write_text(TWO_RANK_WORKER)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(free_port()), str(tmp_path / "worker.py"), str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["tp2_loss"] == pytest.approx(reference, abs=1e-5)
    assert result["custom_loss"] == result["tp2_loss"] and result["grad_diff"] == 0.0
    assert result["dp_replicas_equal"]
    assert result["tied_head_is_the_embedding"]
    assert result["interleaved_p2p_unbatched"]



def test_layer_init_context_wraps_each_layer_by_global_number(megatron_cpu, tiny_model_cfg):
    # (the TE backend's quantized_model_init for FP8-stored weights: recipe fp8_param, megatron/te_layers.py)
    import contextlib

    built = []

    @contextlib.contextmanager
    def layer_init(layer):
        before = len(built)
        yield
        built.append((layer, before))

    seeded = build_gpt_model(tiny_model_cfg, device=megatron_cpu[2], init_seed=7)
    model = build_gpt_model(tiny_model_cfg, device=megatron_cpu[2], init_seed=7, layer_init=layer_init)
    assert built == [(i, i) for i in range(int(tiny_model_cfg["num_layers"]))]
    # the weights are those of the same build without it: the context adds, it draws nothing
    assert all(torch.equal(a, b) for a, b in zip(seeded.state_dict().values(), model.state_dict().values())
               if isinstance(a, torch.Tensor))
    build_gpt_model(tiny_model_cfg, device=megatron_cpu[2], layer_init=lambda layer: built.append(layer) or
                    contextlib.nullcontext())
    assert built[-int(tiny_model_cfg["num_layers"]):] == list(range(int(tiny_model_cfg["num_layers"])))


def test_gradient_accumulation_fusion_keeps_megatron_linears_plain_without_apex(megatron_cpu, tiny_model_cfg):
    # The TE backend's gradient_accumulation_fusion: TE modules fuse; Megatron-Core's own linears (the plain LM head)
    # need APEX's kernel, which pip installs lack: they are built anyway and keep the plain wgrad.
    import dataclasses

    from megatron.core.tensor_parallel import layers

    from fp8_recipes.megatron.model import _megatron_linears_without_apex

    assert not layers._grad_accum_fusion_available  # (this venv has no APEX)
    plain_model = build_gpt_model(tiny_model_cfg, device=megatron_cpu[2])
    config = dataclasses.replace(unwrap_model(plain_model).config, gradient_accumulation_fusion=True)
    with pytest.raises(RuntimeError, match="fused_weight_gradient_mlp_cuda"):  # Megatron-Core's own refusal
        tensor_parallel.ColumnParallelLinear(8, 8, config=config, init_method=torch.nn.init.zeros_)
    with _megatron_linears_without_apex(config) as built:
        head = tensor_parallel.ColumnParallelLinear(8, 8, config=config, init_method=torch.nn.init.zeros_)
        built.append(head)
        assert head.gradient_accumulation_fusion
    assert head.gradient_accumulation_fusion is False and not layers._grad_accum_fusion_available
    with pytest.raises(ValueError, match="gradient_accumulation_fusion=True needs use_te_spec=True"):
        build_gpt_model(tiny_model_cfg, device=megatron_cpu[2], config_overrides={"gradient_accumulation_fusion": True})
