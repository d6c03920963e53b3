"""The training loop's pieces without a model: config validation (the parallel layout and the engine keys too), LR
schedule and scaling, the Precision protocol, metrics files."""

import json
import math
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from fp8_recipes.rundir import read_metrics, write_summary
from fp8_recipes.training.config import TrainerConfig
from fp8_recipes.training.lr_schedule import lr_at, scaled_lr
from fp8_recipes.training.metrics import MetricsWriter, plot_loss
from fp8_recipes.training.precision import NoPrecision, Precision

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["cpu", "gpu"])
def test_trainer_configs_validate(name):
    cfg = TrainerConfig.from_cfg(OmegaConf.load(ROOT / "conf" / "trainer" / f"{name}.yaml"))
    assert cfg.gradient_accumulation_steps(1) * cfg.micro_batch_size == cfg.global_batch_size
    assert cfg.lr_scaling.enabled is False


def test_trainer_config_errors_name_the_key():
    with pytest.raises(ValueError, match=r"trainer\.max_stpes: unknown key"):
        TrainerConfig.from_cfg({"max_stpes": 3})
    with pytest.raises(ValueError, match=r"trainer\.lr_scaling\.base_global_batch_size"):
        TrainerConfig.from_cfg({"lr_scaling": {"enabled": True}})
    with pytest.raises(ValueError, match=r"trainer\.min_lr"):
        TrainerConfig.from_cfg({"lr": 1e-3, "min_lr": 1e-2})
    cfg = TrainerConfig.from_cfg({"micro_batch_size": 4, "global_batch_size": 12})
    assert cfg.gradient_accumulation_steps(3) == 1
    with pytest.raises(ValueError, match=r"trainer\.global_batch_size=12 is not a multiple of .* 4 x 2 = 8; set "
                                         r"trainer\.global_batch_size=8 \(or a multiple\) or trainer\.micro_batch_size=2$"):
        cfg.gradient_accumulation_steps(2)


def test_a_run_shorter_than_the_lr_warmup_warms_up_over_a_tenth_of_it():
    assert TrainerConfig.from_cfg({"max_steps": 200, "warmup_steps": 20}).lr_warmup_steps == 20
    assert TrainerConfig.from_cfg({"max_steps": 20, "warmup_steps": 20}).lr_warmup_steps == 20
    short = TrainerConfig.from_cfg({"max_steps": 15, "warmup_steps": 20})  # was refused: any max_steps runs
    assert short.warmup_steps == 20 and short.lr_warmup_steps == 1
    assert TrainerConfig.from_cfg({"max_steps": 5, "warmup_steps": 20}).lr_warmup_steps == 0
    no_warmup = [lr_at(s, lr=1e-3, min_lr=1e-4, warmup_steps=0, max_steps=5) for s in range(5)]
    assert 0.9e-3 < no_warmup[0] <= 1e-3 and no_warmup[-1] == pytest.approx(1e-4)  # the cosine from the first step


def test_lr_schedule_values():
    kw = dict(lr=1e-3, min_lr=1e-4, warmup_steps=10, max_steps=110)
    assert lr_at(0, **kw) == pytest.approx(1e-4)           # n = 1 of 10 warmup steps
    assert lr_at(4, **kw) == pytest.approx(5e-4)
    assert lr_at(9, **kw) == pytest.approx(1e-3)           # end of warmup: the peak
    assert lr_at(59, **kw) == pytest.approx(5.5e-4)        # halfway through the cosine: (lr + min_lr) / 2
    assert lr_at(34, **kw) == pytest.approx(1e-4 + 0.5 * (1 + math.cos(math.pi * 0.25)) * 9e-4)
    assert lr_at(109, **kw) == pytest.approx(1e-4)         # last step: min_lr
    lrs = [lr_at(s, **kw) for s in range(110)]
    assert all(a <= b for a, b in zip(lrs[:10], lrs[1:10])) and all(a >= b for a, b in zip(lrs[9:], lrs[10:]))


def test_linear_lr_scaling():
    assert scaled_lr(3e-4, 64, 16) == pytest.approx(1.2e-3)
    assert scaled_lr(3e-4, 8, 16) == pytest.approx(1.5e-4)


@pytest.mark.parametrize("keys, match", [
    ({"virtual_pipeline_model_parallel_size": 2}, r"trainer\.virtual_pipeline_model_parallel_size=2: needs .* >= 2"),
    ({"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 1},
     r"trainer\.virtual_pipeline_model_parallel_size=1"),
    ({"sequence_parallel": True}, r"trainer\.sequence_parallel=true needs trainer\.tensor_model_parallel_size >= 2"),
    ({"overlap_param_gather": True}, r"trainer\.overlap_param_gather=true needs .*use_distributed_optimizer"),
    ({"recompute_granularity": "ful"}, r"trainer\.recompute_granularity='ful'.*did you mean 'full'"),
    ({"recompute_granularity": "full"}, r"trainer\.recompute_method=None: full recompute needs uniform"),
    ({"recompute_granularity": "full", "recompute_method": "block"}, r"trainer\.recompute_num_layers=None"),
    ({"recompute_method": "block"}, r"apply to trainer\.recompute_granularity=full only"),
    ({"context_parallel_size": 0}, r"trainer\.context_parallel_size=0: must be an integer >= 1"),
    ({"exp_avg_dtype": "bf16"}, r"trainer\.exp_avg_dtype=bf16: needs trainer\.use_precision_aware_optimizer=true"),
    ({"use_precision_aware_optimizer": True, "exp_avg_dtype": "fp8"}, r"trainer\.exp_avg_dtype='fp8': choose one of fp32"),
    ({"use_precision_aware_optimizer": True}, r"needs trainer\.use_distributed_optimizer=true"),
])
def test_engine_keys_refused_in_one_line(keys, match):
    with pytest.raises(ValueError, match=match) as e:
        TrainerConfig.from_cfg(keys)
    assert "\n" not in str(e.value)


def test_layout_checks():
    cfg = TrainerConfig.from_cfg({"micro_batch_size": 2, "global_batch_size": 8, "tensor_model_parallel_size": 2,
                                  "pipeline_model_parallel_size": 2})
    assert cfg.model_parallel_size == 4 and cfg.check_layout(8, 4) == 2
    with pytest.raises(ValueError, match=r"^trainer\.tensor_model_parallel_size x pipeline_model_parallel_size x "
                                         r"context_parallel_size = 2 x 2 x 1 = 4 does not divide the 6 launched"):
        cfg.check_layout(6, 4)
    with pytest.raises(ValueError, match=r"model\.num_layers=3 is not divisible by pipeline x virtual pipeline = 2"):
        cfg.check_layout(4, 3)
    vpp = TrainerConfig.from_cfg({"micro_batch_size": 2, "global_batch_size": 6, "pipeline_model_parallel_size": 2,
                                  "virtual_pipeline_model_parallel_size": 2, "eval_iters": 4})
    with pytest.raises(ValueError, match=r"trainer\.global_batch_size: the interleaved schedule needs a multiple of "
                                         r"pipeline_model_parallel_size=2 micro-batches; 3 micro-batches"):
        vpp.check_layout(2, 4)
    odd_eval = TrainerConfig.from_cfg({"micro_batch_size": 2, "global_batch_size": 8, "pipeline_model_parallel_size": 2,
                                       "virtual_pipeline_model_parallel_size": 2, "eval_iters": 3})
    with pytest.raises(ValueError, match=r"trainer\.eval_iters: .*trainer\.eval_iters=3 is not"):
        odd_eval.check_layout(2, 4)


def test_sequence_checks_context_and_sequence_parallel():
    """model.seq_length against the sequence splits, before anything is built (else the first micro-batch fails inside
    Megatron-Core's get_batch_on_this_cp_rank or its sequence-parallel scatter), and CP's BF16-only attention."""
    TrainerConfig.from_cfg({}).check_sequence(127)  # no split: any length
    cp2 = TrainerConfig.from_cfg({"context_parallel_size": 2})
    cp2.check_sequence(1024)
    with pytest.raises(ValueError, match=r"^model\.seq_length=1022 does not split into 2 x trainer\.context_parallel_"
                                         r"size = 4 equal chunks; set model\.seq_length to a multiple of 4$"):
        cp2.check_sequence(1022)
    sp = TrainerConfig.from_cfg({"tensor_model_parallel_size": 4, "sequence_parallel": True})
    sp.check_sequence(128)
    with pytest.raises(ValueError, match=r"^model\.seq_length=130 does not split into trainer\.tensor_model_parallel_"
                                         r"size=4 sequence-parallel parts; set model\.seq_length to a multiple of 4$"):
        sp.check_sequence(130)
    both = TrainerConfig.from_cfg({"tensor_model_parallel_size": 4, "sequence_parallel": True,
                                   "context_parallel_size": 2})
    both.check_sequence(1024)
    with pytest.raises(ValueError, match=r"4 equal chunks and each context-parallel rank's 1/2 into trainer\.tensor_"
                                         r"model_parallel_size=4 sequence-parallel parts; .* a multiple of 8$"):
        both.check_sequence(4)  # 4 splits into CP's chunks, but each CP rank's 2 tokens not over 4 TP ranks
    with pytest.raises(ValueError, match=r"^trainer\.context_parallel_size=2 needs trainer\.params_dtype=bf16"):
        TrainerConfig.from_cfg({"context_parallel_size": 2, "params_dtype": "fp32"})


def test_run_config_checks_the_sequence_split(tmp_path):
    from fp8_recipes.training.config import check_run_config

    def conf(group: str, name: str) -> dict:
        return OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / group / f"{name}.yaml"))

    model = {**conf("model", "tiny"), "vocab_size": 4096, "seq_length": 126}
    trainer = {**conf("trainer", "gpu"), "context_parallel_size": 2, "global_batch_size": 2}
    cfg = {"trainer": trainer, "model": model, "data": {**conf("data", "stdlib"), "path": str(tmp_path / "data")},
           "run_dir": str(tmp_path / "run")}
    with pytest.raises(ValueError, match=r"^model\.seq_length=126 does not split into 2 x trainer\.context_parallel"):
        check_run_config(cfg, world_size=2)
    check_run_config({**cfg, "model": {**model, "seq_length": 128}}, world_size=2)


def test_an_moe_model_under_tensor_parallelism_needs_sequence_parallelism():
    """Megatron-Core's MoELayer raises at the first training forward pass under TP without sequence parallelism
    (it was an internal error with a traceback, after the data and the model were built): one line before."""
    moe = {"num_moe_experts": 4, "moe_ffn_hidden_size": 256, "hidden_size": 128}
    tp2 = TrainerConfig.from_cfg({"tensor_model_parallel_size": 2})
    with pytest.raises(ValueError, match=r"^trainer\.tensor_model_parallel_size=2 with an MoE model needs trainer\."
                                         r"sequence_parallel=true .* at tensor_model_parallel_size=1$"):
        tp2.check_experts(moe, 2)
    tp2.check_experts({"hidden_size": 128}, 2)  # a dense model: TP alone
    TrainerConfig.from_cfg({"tensor_model_parallel_size": 2, "sequence_parallel": True}).check_experts(moe, 2)
    TrainerConfig.from_cfg({"expert_tensor_parallel_size": 2}).check_experts(moe, 2)  # experts split, TP 1


def test_run_config_refuses_a_split_without_the_share_the_run_reads(tmp_path):
    """A zero train share, or a zero valid share while trainer.eval_iters > 0: Megatron-Core builds no dataset for
    that split, which failed later as an internal error with a half-written run directory."""
    from fp8_recipes.training.config import check_run_config

    def conf(group: str, name: str) -> dict:
        return OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / group / f"{name}.yaml"))

    data = {**conf("data", "stdlib"), "path": str(tmp_path / "data")}
    cfg = {"trainer": conf("trainer", "cpu"), "model": {**conf("model", "tiny"), "vocab_size": 4096},
           "run_dir": str(tmp_path / "run")}
    with pytest.raises(ValueError, match=r"^data\.split='0,50,50' gives the train split no share; give it one"):
        check_run_config({**cfg, "data": {**data, "split": "0,50,50"}}, world_size=1)
    with pytest.raises(ValueError, match=r"^data\.split='100,0,0' gives the valid split no share, but trainer\."
                                         r"eval_iters=\d+ reads validation batches; .* or set trainer\.eval_iters=0 "
                                         r"trainer\.eval_interval=0"):
        check_run_config({**cfg, "data": {**data, "split": "100,0,0"}}, world_size=1)
    check_run_config({**cfg, "data": {**data, "split": "100,0,0"}, "trainer": {**cfg["trainer"], "eval_iters": 0}},
                     world_size=1)


def test_no_precision_satisfies_protocol():
    p = NoPrecision("bf16")
    assert isinstance(p, Precision)
    assert p.begin_step(0) == "bf16" and p.full_precision_eval_interval == 0
    with p.high_precision():
        pass
    assert p.state_dict() == {}


def test_metrics_files(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=True) as w:
        for step in range(1, 6):
            w.log({"kind": "train", "step": step, "loss": 5.0 - step, "stage": "bf16"})
        w.log({"kind": "eval", "step": 5, "val_loss": 0.5})
        w.log({"kind": "train", "step": 6, "loss": float("nan")})
    assert [r["step"] for r in read_metrics(tmp_path, "train")] == [1, 2, 3, 4, 5, 6]
    assert read_metrics(tmp_path, "eval") == [{"kind": "eval", "step": 5, "val_loss": 0.5}]
    assert read_metrics(tmp_path, "train")[-1]["loss"] == "nan"  # valid JSON, still visible
    assert any((tmp_path / "tb").iterdir())
    assert plot_loss(tmp_path).stat().st_size > 1000
    write_summary(tmp_path, {"final_loss": 0.1, "steps": 6})
    assert json.loads((tmp_path / "summary.json").read_text()) == {"final_loss": 0.1, "steps": 6}


def test_tensorboard_holds_the_precision_stage_where_it_changes(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsWriter(tmp_path) as w:
        for step, stage in enumerate(["bf16 warmup", "bf16 warmup", "fp8 w", "fp8 w+a+g", "fp8 w+a+g"], start=1):
            w.log({"kind": "train", "step": step, "loss": 1.0, "stage": stage})
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"tensors": 0}).Reload()
    texts = [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors("train/stage/text_summary")]
    assert texts == [(1, "bf16 warmup"), (3, "fp8 w"), (4, "fp8 w+a+g")]


def test_tensor_or_context_parallel_runs_on_one_cuda_connection():
    """TP or CP > 1: CUDA_DEVICE_MAX_CONNECTIONS=1 (what Megatron-LM requires for sequence parallelism), unless the
    environment already chose; DP and PP alone leave the environment as it is."""
    from types import SimpleNamespace

    from fp8_recipes.training.run import one_cuda_connection

    def env_after(tp, cp, environ):
        one_cuda_connection(SimpleNamespace(tensor_model_parallel_size=tp, context_parallel_size=cp), environ)
        return environ

    assert env_after(2, 1, {}) == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    assert env_after(1, 2, {}) == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    assert env_after(1, 1, {}) == {}
    assert env_after(2, 2, {"CUDA_DEVICE_MAX_CONNECTIONS": "8"}) == {"CUDA_DEVICE_MAX_CONNECTIONS": "8"}
