"""Megatron-Core's per-layer CUDA graphs through TE in scripts/train.py (model keys cuda_graph_impl, cuda_graph_modules,
cuda_graph_warmup_steps): the scopes a model gets, what Megatron-Core's TransformerConfig accepts, the one-line
refusals before anything is built, and the step the training loop captures before. The capture and replay themselves
need a GPU: tests/gpu/test_te_moe.py (-k graphs) compares the graphed step with the eager one on TE."""

from __future__ import annotations

import dataclasses

import pytest

from fp8_recipes.checks import ConfigError
from fp8_recipes.megatron.model_config import (check_model_cfg, check_model_device, graph_config_fields,
                                               graph_modules, model_notices)
from fp8_recipes.plan.precision import Hardware, PrecisionPlan
from fp8_recipes.recipe.pack import load_recipe

H200 = Hardware("cuda", (9, 0), "2.20.2", "NVIDIA H200")
TINY = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32, "vocab_size": 256}
MOE = {**TINY, "num_moe_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 64}
ALLTOALL = {**MOE, "moe_token_dispatcher_type": "alltoall"}
PADDED = {**ALLTOALL, "moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True}
GRAPHS = {"cuda_graph_impl": "transformer_engine"}


def test_each_model_gets_the_scopes_megatron_core_allows_it():
    """Dense: the attention. A dropless MoE: the router and the dispatcher's preprocessing, the preprocessing only
    where it copies nothing to the host (the alltoall dispatcher with a capacity or router padding does). Dropped and
    padded to capacity with the alltoall dispatcher (static shapes): the whole MoE block. The allgather dispatcher
    copies its counts to the host even padded: the router's scopes."""
    assert graph_modules(TINY) == ["attn"]
    assert graph_modules(MOE) == ["attn", "moe_router", "moe_preprocess"]
    assert graph_modules(MOE, attn_only=True) == ["attn"]
    for host_copy in ({"moe_expert_capacity_factor": 1.0}, {"moe_router_padding_for_quantization": True}):
        assert graph_modules({**ALLTOALL, **host_copy}) == ["attn", "moe_router"]
    assert graph_modules(PADDED) == ["attn", "moe"]
    assert graph_modules({**MOE, "num_moe_experts": 1, "moe_router_topk": 1}) == ["attn"]  # (Megatron-Core: dense)
    assert graph_modules({**MOE, "moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True}) == \
        ["attn", "moe_router", "moe_preprocess"]
    assert graph_config_fields(MOE) == {}
    assert graph_config_fields({**PADDED, **GRAPHS}) == {"cuda_graph_impl": "transformer_engine",
                                                         "cuda_graph_modules": ["attn", "moe"],
                                                         "cuda_graph_warmup_steps": 3}  # Megatron-LM's default
    assert graph_config_fields({**MOE, **GRAPHS, "cuda_graph_modules": ["moe_router"],
                                "cuda_graph_warmup_steps": 1})["cuda_graph_modules"] == ["moe_router"]


def test_megatron_cores_transformer_config_takes_the_scopes(megatron_cpu):
    """The fields as Megatron-Core's own TransformerConfig checks them (the model built on the CPU through
    config_overrides: the model keys themselves are refused there, graphs need a GPU); the alltoall dispatcher builds
    on the GPU only, so its config is checked alone. Its own refusal of a whole dropless MoE is what
    check_model_cfg says first, in one line."""
    import torch

    from fp8_recipes.megatron.model import _transformer_config, build_gpt_model, unwrap_model

    model = build_gpt_model(MOE, params_dtype=torch.float32, device="cpu",
                            config_overrides=graph_config_fields({**MOE, **GRAPHS}))
    config = unwrap_model(model).config
    assert config.cuda_graph_impl == "transformer_engine" and config.cuda_graph_warmup_steps == 3
    assert [m.name for m in config.cuda_graph_modules] == ["attn", "moe_router", "moe_preprocess"]
    config = _transformer_config(PADDED, torch.float32, torch.device("cpu"), False,
                                 graph_config_fields({**PADDED, **GRAPHS}))
    assert [m.name for m in config.cuda_graph_modules] == ["attn", "moe"]
    with pytest.raises(AssertionError, match="only supported with drop-padding MoE"):
        _transformer_config(ALLTOALL, torch.float32, torch.device("cpu"), False,
                            {**GRAPHS, "cuda_graph_modules": ["attn", "moe"]})
    with pytest.raises(ConfigError, match=r"^model\.cuda_graph_modules=\['attn', 'moe'\]: a whole MoE layer is "
                                          r"graphed only with static shapes"):
        check_model_cfg({**ALLTOALL, **GRAPHS, "cuda_graph_modules": ["attn", "moe"]}, device=None)


@pytest.mark.parametrize("cfg, match", [
    ({**TINY, "cuda_graph_impl": "local"}, r"cuda_graph_impl='local': this plugin captures .* through Transformer "
                                           r"Engine only; set model\.cuda_graph_impl=transformer_engine or none$"),
    ({**TINY, **GRAPHS, "cuda_graph_warmup_steps": 0}, r"cuda_graph_warmup_steps=0: the eager steps before the "
                                                       r"capture, an integer >= 1"),
    ({**TINY, **GRAPHS, "cuda_graph_modules": "attn"}, r"cuda_graph_modules='attn': a list of distinct scopes"),
    ({**TINY, **GRAPHS, "cuda_graph_modules": []}, r"cuda_graph_modules=\[\]: a list of distinct scopes"),
    ({**TINY, **GRAPHS, "cuda_graph_modules": ["attn", "attn"]}, r"cuda_graph_modules=.*a list of distinct scopes from attn, mlp, moe"),
    ({**TINY, **GRAPHS, "cuda_graph_modules": ["mlp", "moe_router"]}, r"cuda_graph_modules=.*moe_router is an MoE scope and Megatron-"
                                                                      r"Core graphs it only with more than one "
                                                                      r"expert; drop it$"),
    ({**PADDED, **GRAPHS, "cuda_graph_modules": ["moe", "moe_router"]}, r"cuda_graph_modules=.*keep one of moe and moe_router$"),
    ({**MOE, **GRAPHS, "cuda_graph_modules": ["moe_preprocess"]}, r"cuda_graph_modules=.*only with moe_router; add moe_router$"),
    ({**MOE, **GRAPHS, "cuda_graph_modules": ["attn", "mlp"]}, r"cuda_graph_modules=.*every layer of this model is an MoE layer; drop "
                                                               r"mlp$"),
    ({**MOE, **GRAPHS, "cuda_graph_modules": ["moe"]}, r"cuda_graph_modules=.*set model\.moe_expert_capacity_factor \(e\.g\. 1\.0\), "
                                                       r"model\.moe_pad_expert_input_to_capacity=true"),
    ({**ALLTOALL, **GRAPHS, "moe_router_padding_for_quantization": True,
      "cuda_graph_modules": ["moe_router", "moe_preprocess"]}, r"cuda_graph_modules=.*copies the token counts to the host here .*; drop "
                                                               r"moe_preprocess$")])
def test_graph_keys_are_refused_in_one_line(cfg, match):
    with pytest.raises(ConfigError, match=r"^model\." + match):
        check_model_cfg(cfg, device=None)


def test_graph_keys_need_a_gpu_and_say_when_they_do_nothing():
    check_model_cfg({**TINY, **GRAPHS, "cuda_graph_modules": ["attn"]}, device=None)
    # static shapes: the preprocessing returns before any copy to the host, so it may be graphed beside the router
    check_model_cfg({**PADDED, **GRAPHS, "cuda_graph_modules": ["attn", "moe_router", "moe_preprocess"]}, device=None)
    check_model_cfg({**MOE, "moe_layer_freq": 2, **GRAPHS, "cuda_graph_modules": ["mlp", "moe_router"]}, device=None)
    check_model_device({**TINY, **GRAPHS}, "cuda")
    with pytest.raises(ConfigError, match=r"^model\.cuda_graph_impl=transformer_engine: CUDA graphs need a GPU; on "
                                          r"the CPU set model\.cuda_graph_impl=none$"):
        check_model_device({**TINY, **GRAPHS}, "cpu")
    assert model_notices({**TINY, "cuda_graph_modules": ["attn"]}, device="cpu") == [
        "model.cuda_graph_modules=['attn'] does nothing: model.cuda_graph_impl is none; set "
        "model.cuda_graph_impl=transformer_engine to capture graphs"]
    assert model_notices({**TINY, **GRAPHS, "cuda_graph_modules": ["attn"]}, device="cuda") == []


def _trainer(**keys):
    from fp8_recipes.training.config import TrainerConfig

    return TrainerConfig.from_cfg({"device": "gpu", "on_nonfinite": "stop", **keys})


def _plan(recipe, model=TINY, hardware=H200, **changes):
    from fp8_recipes.megatron.model_config import layout_of

    return PrecisionPlan(dataclasses.replace(load_recipe(recipe), **changes), layout_of(model), hardware)


def test_the_run_refuses_what_the_graphs_cannot_hold():
    """Before anything is built (training/run.check_plan, which the Slurm launchers run too): the emulated backend,
    layers of different TE recipes or a linear with its own inside a layer (at the recipe's last stage), the BF16
    fallback, recompute, FP8-stored weights, and delayed experts at EP > 1; statistics and the autopilot too."""
    from fp8_recipes.training.run import check_graph_observers, check_plan

    model = {**TINY, **GRAPHS}
    for recipe in ("bf16", "delayed", "tensorwise", "blockwise", "safe", "fast"):
        check_plan(_trainer(), model, _plan(recipe))
    check_plan(_trainer(on_nonfinite="skip_then_bf16"), model, _plan("bf16"))  # (nothing to fall back from)
    check_plan(_trainer(), {**TINY, "cuda_graph_modules": None}, _plan("delayed", hardware=Hardware()))
    recipe = load_recipe("tensorwise")
    cases = [
        (_trainer(), _plan("delayed", hardware=Hardware()), r"on the emulated backend \(.*\); train on TE, "
                                                            r"or set model\.cuda_graph_impl=none$"),
        (_trainer(), _plan("tensorwise", layers=dataclasses.replace(recipe.layers, bf16_modules=("*.1.mlp.*",))),
         r"decoder\.layers\.1\.mlp\.linear_fc1 runs its own \(BF16: a modules: policy or a BF16 pattern\); give the "),
        (_trainer(on_nonfinite="skip_then_bf16"), _plan("delayed"), r"trainer\.on_nonfinite=skip_then_bf16: the "
                                                                    r"BF16 fallback cannot run under CUDA graphs"),
        (_trainer(recompute_granularity="selective"), _plan("tensorwise"), r"trainer\.recompute_granularity="
                                                                           r"selective: activation recompute"),
        (_trainer(use_distributed_optimizer=True), _plan("tensorwise", fp8_param=True), r"recipe fp8_param: true"),
        (_trainer(expert_model_parallel_size=2), _plan("tensorwise", model=MOE), r"trainer\.expert_model_"
                                                                                 r"parallel_size=2 with an FP8 recipe"),
        (_trainer(params_dtype="fp32"), _plan("bf16"), r"trainer\.params_dtype=fp32: Megatron-Core's graphs take "
                                                       r"BF16 activations")]
    for trainer, plan, match in cases:
        with pytest.raises(ConfigError, match=r"^model\.cuda_graph_impl=transformer_engine: .*" + match):
            check_plan(trainer, {**(MOE if plan.layout.experts else TINY), **GRAPHS}, plan)
    check_plan(_trainer(expert_model_parallel_size=2), {**MOE, **GRAPHS}, _plan("bf16", model=MOE))
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        env.delenv("NCCL_GRAPH_REGISTER", raising=False)
        with pytest.raises(ConfigError, match=r"expandable_segments:True needs NCCL_GRAPH_REGISTER=0 .*; export "
                                              r"NCCL_GRAPH_REGISTER=0, or set model\.cuda_graph_impl=none$"):
            check_plan(_trainer(), model, _plan("bf16"))
        env.setenv("NCCL_GRAPH_REGISTER", "0")
        check_plan(_trainer(), model, _plan("bf16"))
    from fp8_recipes.training.run import _graphs_notice

    assert _graphs_notice(model, _plan("delayed"), 0, 4) is None  # captured before step 4 (3 warmup steps)
    assert _graphs_notice(model, _plan("delayed"), 0, 3).startswith(
        "model.cuda_graph_impl=transformer_engine does nothing: the graphs would be captured before step 4 ")
    assert _graphs_notice(TINY, _plan("delayed"), 0, 3) is None
    from fp8_recipes.observe.autopilot_config import autopilot_config
    from fp8_recipes.observe.config import debug_config

    check_graph_observers(model, debug_config(None, None), autopilot_config(None))
    check_graph_observers(TINY, debug_config(None, {"interval": 10}), autopilot_config({"enabled": True}))
    with pytest.raises(ConfigError, match=r"^debug: numerics statistics read each linear's forward, which a CUDA "
                                          r"graph replays without calling it; set debug\.interval=0"):
        check_graph_observers(model, debug_config(None, {"interval": 10}), None)
    with pytest.raises(ConfigError, match=r"^autopilot: .*; set autopilot=off or model\.cuda_graph_impl=none$"):
        check_graph_observers(model, debug_config(None, None), autopilot_config({"enabled": True}))


class _Graphs:
    """The engine's graphs as the loop sees them: what it captured, under which plan step."""

    def __init__(self, precision):
        self.precision, self.captures, self.deleted = precision, [], False

    def capture(self, precision):
        self.captures.append((len(precision.begun) - 1, precision.begun[-1]))  # (the step in progress, its plan's)

    def delete(self):
        self.deleted = True


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("warmup, steady_from, at", [(3, 0, 3), (1, 4, 4), (2, 1, 2)])
def test_the_loop_captures_once_after_the_warmup_steps_in_the_last_stage(tmp_path, warmup, steady_from, at):
    """Before step ``max(start + cuda_graph_warmup_steps, the recipe's last stage)``, once, after that step's
    begin_step (its plan is the one captured); the graphs freed at the end. A resumed run warms up again (as
    Megatron-LM does)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from tiny_engine import BATCH, batches, tiny_engine

    from fp8_recipes.training.loop import _graphs_step, train
    from fp8_recipes.training.precision import NoPrecision

    class Recording(NoPrecision):
        begun: list[int] = []

        def begin_step(self, step):
            self.begun.append(step)
            return super().begin_step(step)

    precision = Recording()
    precision.begun = []
    cfg = {"max_steps": 6, "micro_batch_size": BATCH, "global_batch_size": BATCH, "warmup_steps": 1,
           "eval_interval": 0, "lr": 1e-3, "min_lr": 1e-4, "save_checkpoints": False}
    with tiny_engine(cfg) as engine:
        engine.config.cuda_graph_warmup_steps, engine.config.cuda_graph_modules = warmup, ["attn"]
        engine.graphs = graphs = _Graphs(precision)
        summary = train(engine, batches(), None, cfg, precision, tmp_path, steady_from=steady_from)
        assert _graphs_step(engine, start=10, steady_from=steady_from) == 10 + warmup  # a resume: eager again
        engine.graphs = None
        assert _graphs_step(engine, start=0, steady_from=steady_from) is None
    assert summary["steps"] == 6 and graphs.captures == [(at, at)] and graphs.deleted
    assert summary["cuda_graphs"] == {"captured_before_step": at + 1, "modules": ["attn"]}


def test_the_capture_takes_the_plans_arguments_and_skips_te_s_weight_gradient_clones():
    """What LayerGraphs adds to Megatron-Core's make_graphed_callables arguments: the plan's (TEPrecision.graph_capture
    for the callables' layers) and, under gradient_accumulation_fusion, clone_param_grads_on_return=False (the
    returned weight gradients are placeholders DDP drops; TE's default clone copied every expert weight's size per
    layer and micro-batch). Megatron-Core's capture as it is (the benchmark's :raw) keeps TE's clone, and so does a
    model without the fusion. The graphed step's losses against the eager one's: tests/gpu/test_te_moe.py."""
    from fp8_recipes.megatron.graphs import LayerGraphs

    class Precision:
        def graph_capture(self, layers):
            return {"fp8_enabled": tuple(i > 0 for i in layers)}

    def kwargs(precision, fusion, clone=False):
        graphs = object.__new__(LayerGraphs)  # (the helper itself needs TE and a GPU)
        graphs._precision, graphs._clone_param_grads = precision, clone
        return graphs._capture_kwargs(dataclasses.make_dataclass("C", [("gradient_accumulation_fusion", bool)])(
            fusion), [0, 1])

    assert kwargs(Precision(), True) == {"fp8_enabled": (False, True), "clone_param_grads_on_return": False}
    assert kwargs(None, True) == {"clone_param_grads_on_return": False}  # (BF16: the same step)
    assert kwargs(None, True, clone=True) == {} and kwargs(Precision(), False) == {"fp8_enabled": (False, True)}
