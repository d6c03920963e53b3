"""The TE backend on Megatron-Core's MoE layers (issue 28): the tiny MoE GPT trains through run_training with its
experts as TE's grouped GEMM (TEGroupedMLP) or as TE linears one after another (SequentialMLP), the plan executed
(no mismatch), the experts' token counts padded for TE's FP8 GEMMs (by the experts, or by the router with
``moe_router_padding_for_quantization``), per-expert statistics from the grouped GEMM, a grouped layer's delayed
state through a checkpoint, and the grouped experts' outputs against the emulated backend's."""

from __future__ import annotations

import math

import pytest
import torch

from fp8_recipes.backends.te import BF16, FP8, te_available

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not (torch.cuda.is_available() and te_available()),
                                                  reason="needs a CUDA GPU with Transformer Engine")]

from test_te_training import compose  # noqa: E402  (same directory)

GPU_MOE = ["model=tiny_moe", "model.moe_token_dispatcher_type=alltoall", "model.moe_permute_fusion=true"]


def train(tmp_path, monkeypatch, recipe: str, *extra: str, steps: int = 8,
          model: list[str] = GPU_MOE) -> tuple[dict, list[float]]:
    from fp8_recipes.rundir import read_metrics
    from fp8_recipes.training.run import run_training

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(var, raising=False)
    run_dir = tmp_path / "run"
    summary = run_training(compose([
        f"+recipe={recipe}", *model, "trainer=gpu", f"trainer.max_steps={steps}", "trainer.warmup_steps=2",
        "trainer.micro_batch_size=16", "trainer.global_batch_size=16", "trainer.lr=3e-3", "trainer.min_lr=3e-4",
        "trainer.eval_interval=0", "trainer.save_checkpoints=false", "data.tokenizer=bytes",
        f"data.path={tmp_path / 'data'}", f"run_dir={run_dir}", *extra]))
    return summary, [r["loss"] for r in read_metrics(run_dir, "train")]


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "sequential"])
@pytest.mark.parametrize("recipe", ["delayed", "tensorwise", "blockwise", "moe_blockwise", "moe_delayed", "bf16"])
def test_moe_trains_on_te_as_planned(recipe, grouped, tmp_path, monkeypatch):
    summary, losses = train(tmp_path, monkeypatch, recipe, f"model.moe_grouped_gemm={str(grouped).lower()}")
    assert summary["backend"] == "te", summary
    assert len(losses) == 8 and all(math.isfinite(x) for x in losses), losses
    assert sum(losses[-2:]) / 2 < losses[0] - 1.0, losses
    run = summary["te_execution"]
    assert run["plan_mismatches"] == 0, run["mismatch_examples"]
    # per step: 4 layers x 2 attention linears, 2 dense MLPs x 2, 2 MoE layers x 2 fc (grouped: one module each;
    # sequential: one per expert, 4 experts) = 16 grouped, 28 sequential
    per_step = 8 + 4 + 2 * 2 * (1 if grouped else 4)
    assert run["module_forwards"] == {BF16 if recipe == "bf16" else FP8: 8 * per_step}, run


def test_router_padding_trains_and_pads_in_the_dispatcher(tmp_path, monkeypatch):
    summary, losses = train(tmp_path, monkeypatch, "tensorwise", "model.moe_grouped_gemm=true",
                            "model.moe_router_padding_for_quantization=true", steps=4)
    assert summary["te_execution"]["plan_mismatches"] == 0 and all(math.isfinite(x) for x in losses)


def test_grouped_experts_statistics_are_per_expert(tmp_path, monkeypatch):
    from fp8_recipes.rundir import read_numerics

    summary, _ = train(tmp_path, monkeypatch, "delayed", "model.moe_grouped_gemm=true", "++debug.interval=2",
                       steps=4)
    assert summary["numerics_s"] > 0
    rows = read_numerics(tmp_path / "run")
    experts = {r["module"] for r in rows if ".local_experts." in r["module"]}
    assert experts <= {f"decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc{k}"
                       for i in (0, 2) for e in range(4) for k in (1, 2)}
    assert len(experts) >= 12, sorted(experts)  # (an expert without tokens in both observed steps has no row)
    for r in rows:
        assert math.isfinite(r["mse"]) and 0 <= r["cosine"] <= 1.0 + 1e-6, r
        assert r.get("scale_ratio") is not None, r


def test_grouped_experts_delayed_state_survives_a_checkpoint(megatron_gpu, tmp_path):
    from fp8_recipes.backends.te_state import delayed_tensors
    from fp8_recipes.megatron.model import build_gpt_model, model_layout
    from fp8_recipes.megatron.te_layers import attach_te_backend
    from fp8_recipes.plan.precision import Hardware, PrecisionPlan
    from fp8_recipes.recipe.schema import Recipe
    from test_te_training import TINY, run

    moe = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=256, moe_layer_freq=2,
               moe_token_dispatcher_type="alltoall", moe_grouped_gemm=True, moe_permute_fusion=True,
               moe_router_dtype="fp32")
    recipe = Recipe.from_dict({"weights": "delayed", "activations": "delayed", "gradients": "delayed"})

    def build(seed):
        torch.manual_seed(seed)
        model = build_gpt_model({**TINY, **moe}, use_te_spec=True, params_dtype=torch.bfloat16,
                                device=megatron_gpu[2])
        return model, attach_te_backend(model, PrecisionPlan(recipe, model_layout(model), Hardware.detect()))

    model, precision = build(0)
    assert precision.rows["decoder.layers.0.mlp.experts.linear_fc1"] == tuple(
        f"decoder.layers.0.mlp.experts.local_experts.{e}.linear_fc1" for e in range(4))
    run(model, precision, tmp_path, 3, save_checkpoints=True)
    saved = precision.state_dict()["delayed"]["decoder.layers.2.mlp.experts.linear_fc2"]
    assert saved["scale_fwd"].numel() == 3 * 4 and saved["scale_bwd"].numel() == 2 * 4  # a slot set per expert
    fresh_model, fresh = build(1)
    summary = run(fresh_model, fresh, tmp_path, 4, save_checkpoints=True, resume_from=tmp_path)
    assert summary["steps"] == 4 and summary["nonfinite_loss_steps"] == 0
    now = {k: v.cpu() for k, v in delayed_tensors(fresh.linears["decoder.layers.2.mlp.experts.linear_fc2"]).items()}
    # resumed with the saved histories: step 3 rolled the weights' columns once more (every expert's weight is
    # quantized each step); the saved rows moved up by one
    weights = [3 * e + 1 for e in range(4)]
    assert torch.equal(now["amax_history_fwd"][-2, weights], saved["amax_history_fwd"][-1, weights])


def test_module_policies_give_the_grouped_experts_their_own_delayed_state(megatron_gpu, tmp_path):
    """moe_delayed on TE (per-module policies: the experts' linears under their own autocast inside the layer's):
    the grouped experts keep 16-step amax histories, attention TE's 1024, each rolled once per step (both recipes'
    states reduced and updated at the one outer autocast's exit), and the plan runs as planned."""
    from fp8_recipes.backends.te_state import delayed_tensors
    from fp8_recipes.megatron.model import build_gpt_model, model_layout
    from fp8_recipes.megatron.te_layers import attach_te_backend
    from fp8_recipes.plan.precision import Hardware, PrecisionPlan
    from fp8_recipes.recipe.pack import load_recipe
    from test_te_training import TINY, recorded, recorded_any, run

    moe = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=256, moe_layer_freq=2,
               moe_token_dispatcher_type="alltoall", moe_grouped_gemm=True, moe_permute_fusion=True,
               moe_router_dtype="fp32")
    torch.manual_seed(0)
    model = build_gpt_model({**TINY, **moe}, use_te_spec=True, params_dtype=torch.bfloat16, device=megatron_gpu[2])
    plan = PrecisionPlan(load_recipe("moe_delayed"), model_layout(model), Hardware.detect())
    assert str(plan.backend) == "te" and not plan.substitutions, (plan.backend_reason, plan.substitutions)
    precision = attach_te_backend(model, plan)
    summary = run(model, precision, tmp_path, 4)
    assert summary["nonfinite_loss_steps"] == 0 and sum(precision.mismatches.values()) == 0
    experts = delayed_tensors(precision.linears["decoder.layers.0.mlp.experts.linear_fc1"])
    qkv = delayed_tensors(precision.linears["decoder.layers.0.self_attention.linear_qkv"])
    assert experts["amax_history_fwd"].shape[0] == 16 and qkv["amax_history_fwd"].shape[0] == 1024
    assert recorded_any(experts["amax_history_fwd"]) == [12, 13, 14, 15]  # (every expert's weight, each step)
    assert recorded(qkv["amax_history_fwd"]) == [1020, 1021, 1022, 1023]
    assert recorded(qkv["amax_history_bwd"]) == [1020, 1021, 1022, 1023]


def test_grouped_experts_compute_the_emulated_experts_product(megatron_gpu):
    """A TEGroupedMLP under tensorwise scaling against the emulated backend's SequentialMLP with the same weights and
    tokens. One GroupedLinear (fc1: each expert's split quantized on its own) equals the emulated experts' fc1 to BF16
    rounding, far closer than to BF16's product; the whole experts module (uneven splits, an empty expert, padded to
    16 inside; two FP8 GEMMs in a row, where an FP8 code the first one's rounding flips carries into the second) stays
    at most half as far from the emulated experts as from BF16's."""
    import transformer_engine.pytorch as te

    from fp8_recipes.plan.precision import Hardware
    from fp8_recipes.recipe.pack import load_recipe
    from fp8_recipes.recipe.schema import Recipe
    from fp8_recipes.training.run import attach_emulated, attach_te
    from test_te_training import TINY

    cfg = {**TINY, "num_layers": 1, "num_moe_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 256,
           "moe_token_dispatcher_type": "alltoall", "moe_router_dtype": "fp32"}
    recipe, hw, dev = load_recipe("tensorwise"), Hardware.detect(), megatron_gpu[2]
    te_chunks, _, te_prec = attach_te({**cfg, "moe_grouped_gemm": True}, recipe, hw, torch.bfloat16, dev)
    emulated = Recipe.from_dict({**recipe.to_dict(), "backend": "emulated"})
    em_chunks, _, em_prec = attach_emulated({**cfg, "moe_grouped_gemm": False}, emulated, hw, torch.bfloat16, dev)
    te_experts = te_chunks[0].module.decoder.layers[0].mlp.experts
    em_experts = em_chunks[0].module.decoder.layers[0].mlp.experts
    with torch.no_grad():
        for e, local in enumerate(em_experts.local_experts):
            getattr(te_experts.linear_fc1, f"weight{e}").copy_(local.linear_fc1.weight)
            getattr(te_experts.linear_fc2, f"weight{e}").copy_(local.linear_fc2.weight)
    te_prec.begin_step(0)
    em_prec.begin_step(0)
    choice = te_prec.step_plan.modules["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1"].te
    rel = lambda a, b: float((a.float() - b.float()).norm() / b.float().norm())  # noqa: E731
    g = torch.Generator(device=dev).manual_seed(0)

    def inputs(splits):
        x = torch.randn(sum(splits), cfg["hidden_size"], device=dev, generator=g).bfloat16()
        return x, torch.rand(sum(splits), device=dev, generator=g).float()

    with torch.no_grad(), te.autocast(enabled=True, recipe=te_prec.te_recipe(choice)):
        splits = [48, 0, 32, 96]  # one GEMM: multiples of 16 (no padding)
        x, _ = inputs(splits)
        te_fc1, _ = te_experts.linear_fc1(x, splits)
        em_fc1 = torch.cat([local.linear_fc1(xs)[0] for local, xs in zip(em_experts.local_experts,
                                                                         torch.split(x, splits))])
        hp_fc1 = torch.cat([xs @ local.linear_fc1.weight.t() for local, xs in zip(em_experts.local_experts,
                                                                                 torch.split(x, splits))])
        splits = [45, 0, 37, 91]  # the module: padded to 48, 0, 48, 96 for TE
        x, probs = inputs(splits)
        te_out, _ = te_experts(x, torch.tensor(splits), probs)
    with torch.no_grad():
        em_out, _ = em_experts(x, torch.tensor(splits), probs)
        with em_prec.high_precision():
            bf16, _ = em_experts(x, torch.tensor(splits), probs)
    assert rel(te_fc1, em_fc1) < 0.01 and rel(te_fc1, hp_fc1) > 3 * rel(te_fc1, em_fc1), (
        rel(te_fc1, em_fc1), rel(te_fc1, hp_fc1))
    assert te_out.shape == em_out.shape == bf16.shape
    assert rel(te_out, bf16) > 2 * rel(te_out, em_out), (rel(te_out, em_out), rel(te_out, bf16))


@pytest.mark.parametrize("model, label", [("tiny", "bf16+graphs"), ("tiny_moe", "bf16+attngraphs"),
                                          ("tiny_moe", "bf16+graphs"), ("tiny_moe", "delayed+graphs:raw"),
                                          ("tiny_moe", "bf16+capacity+graphs"),
                                          ("tiny_moe", "delayed+capacity+graphs:raw"),
                                          ("tiny", "fast+graphs"), ("tiny", "safe+graphs"),
                                          ("tiny_moe", "delayed+graphs"),
                                          ("tiny_moe", "tensorwise+capacity+graphs")])
def test_the_graphs_lever_captures_and_steps_as_the_eager_engine(model, label):
    """bench_train's levers graphs / attngraphs (Megatron-Core's TE CUDA graphs of the attention, the router and the
    dispatcher's preprocessing / of the attention alone, captured before step 1; under lever capacity, static
    shapes, of the whole MoE block) on the engine's step of a tiny dense GPT and the tiny MoE, for BF16, Megatron-
    Core's own FP8 (NAME:raw) and this project's TE backend (NAME: the plan's recipe; fast: the FP8 LM head, outside
    the graphs; safe: BF16 first and last layers, captured without FP8): the capture succeeds (it raises when no layer was graphed) and the
    step computes what the eager step does, from the same weights and tokens. (On 2026-12-06 both MoE cases failed in the backward's
    capture, "operation would make the legacy stream depend on a capturing blocking stream": DDP's AccumulateGrad
    nodes were made on the default stream, fixed by bench/train.py's graph_side_stream. The dense and attention-only
    cases tell a capture that fails on the engine's step from one that fails on the MoE scopes.)"""
    from fp8_recipes.bench.train import _run_config_apart, load_model_cfg

    cfg = {**load_model_cfg(model), "vocab_size": 256}
    if model == "tiny_moe":
        cfg.update(moe_token_dispatcher_type="alltoall", moe_grouped_gemm=True, moe_permute_fusion=True)
    kwargs = {"seq": 128, "mbs": 2, "warmup": 2, "steps": 2, "seed": 1234, "accum": 2, "engine": True}
    eager = _run_config_apart(cfg, label.replace("+attngraphs", "").replace("+graphs", ""), **kwargs)
    graphed = _run_config_apart(cfg, label, **kwargs)
    assert math.isfinite(graphed["loss"]) and graphed["loss"] == pytest.approx(eager["loss"], rel=1e-3), \
        (eager["loss"], graphed["loss"])
    if label.startswith("bf16") or label.endswith(":raw"):
        return
    # This project's TE backend: captured under the plan's recipe, replayed under each layer's autocast. A replay
    # outside it would run BF16: where the eager FP8 and BF16 losses differ, the graphed one is the FP8 one.
    bf16 = _run_config_apart(cfg, "bf16" + label[label.index("+"):].replace("+graphs", ""), **kwargs)
    gap = abs(eager["loss"] - bf16["loss"])
    assert gap < 1e-4 or abs(graphed["loss"] - eager["loss"]) < gap / 4, (bf16["loss"], eager["loss"],
                                                                          graphed["loss"])


@pytest.mark.parametrize("recipe, model", [("tensorwise", "capacity"), ("delayed", "dropless"), ("fast", "dense")])
def test_train_captures_graphs_and_trains_as_the_eager_run(recipe, model, tmp_path, monkeypatch):
    """scripts/train.py with model cuda_graph_impl=transformer_engine (megatron/graphs.py): captured after two eager
    steps, replayed from step 3 on, and the losses are the eager run's, step by step. Capacity: the whole MoE layer
    graphed (static shapes); dropless: the router's scopes, the experts eager under the replay (delayed scaling: the
    eager part reads the layer's autocast); dense with the FP8 LM head (fast: outside the graphs)."""
    extra = {"capacity": ["model.moe_grouped_gemm=true", "model.moe_expert_capacity_factor=1.0",
                          "model.moe_pad_expert_input_to_capacity=true"],
             "dropless": ["model.moe_grouped_gemm=true"], "dense": []}[model]
    layers = ["model=tiny"] if model == "dense" else GPU_MOE
    graphs = ["+model.cuda_graph_impl=transformer_engine", "+model.cuda_graph_warmup_steps=2"]
    eager, eager_losses = train(tmp_path / "eager", monkeypatch, recipe, *extra, "trainer.on_nonfinite=stop", steps=6,
                                model=layers)
    summary, losses = train(tmp_path / "graphs", monkeypatch, recipe, *extra, *graphs, "trainer.on_nonfinite=stop",
                            steps=6, model=layers)
    assert summary["cuda_graphs"]["captured_before_step"] == 3, summary.get("cuda_graphs")
    assert losses == pytest.approx(eager_losses, rel=1e-3), (eager_losses, losses)
    assert losses[-1] < losses[0] - 0.5, losses


def test_a_graphed_run_resumes_from_its_checkpoint(tmp_path, monkeypatch):
    """A graphed run's checkpoint holds TE's graph-safe RNG tracker states (torch Generators) as state tensors, which
    the checkpoint's weights_only loading takes, and a resumed graphed run (eager again for its warmup step, then
    captured) continues it: its steps' losses are the uninterrupted run's."""
    extra = ["model.moe_grouped_gemm=true", "model.moe_expert_capacity_factor=1.0",
             "model.moe_pad_expert_input_to_capacity=true", "+model.cuda_graph_impl=transformer_engine",
             "+model.cuda_graph_warmup_steps=1", "trainer.on_nonfinite=stop", "trainer.save_checkpoints=true",
             "trainer.save_interval=3"]
    _, whole = train(tmp_path / "whole", monkeypatch, "tensorwise", *extra, steps=6)
    step_3 = tmp_path / "whole" / "run" / "checkpoints" / "step_3"
    summary, resumed = train(tmp_path / "resumed", monkeypatch, "tensorwise", *extra, f"trainer.resume={step_3}",
                             steps=6)
    assert summary["cuda_graphs"]["captured_before_step"] == 5, summary.get("cuda_graphs")
    assert resumed == pytest.approx(whole[3:], rel=1e-3), (whole, resumed)
