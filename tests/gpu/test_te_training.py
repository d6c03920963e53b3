"""The TE backend training a Megatron-Core GPT: every shipped recipe through run_training (falling loss, the
plan executed), stage switches taking effect at exactly the planned steps, first/last layers and bf16_modules
patterns really running BF16, delayed-scaling state across a stage switch and through a checkpoint."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from fp8_recipes.backends.te import BF16, FP8, FP8_FWD, te_available
from fp8_recipes.megatron.data import repeated_batch
from fp8_recipes.recipe.pack import recipe_names

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not (torch.cuda.is_available() and te_available()),
                                                  reason="needs a CUDA GPU with Transformer Engine")]

ROOT = Path(__file__).resolve().parents[2]
TINY = dict(num_layers=4, hidden_size=128, ffn_hidden_size=512, num_attention_heads=4, num_query_groups=2,
            seq_length=128, vocab_size=4096, normalization="RMSNorm", activation="swiglu",
            position_embedding_type="rope", share_embeddings_and_output_weights=False)
PER_LAYER = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
STAGED = ["recipe.schedule.bf16_warmup_steps=2", "recipe.schedule.enable.weights=2",
          "recipe.schedule.enable.activations=4", "recipe.schedule.enable.gradients=6"]


# ---------------------------------------------------------------------------------------------------------------
# (b) every shipped recipe through run_training


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("data") / "stdlib-bytes"


def compose(overrides: list[str]):
    pytest.importorskip("hydra", reason="hydra-core is not installed on this machine")
    from hydra import compose as hydra_compose, initialize_config_dir

    from fp8_recipes.recipe.pack import conf_dir

    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        return hydra_compose("train", overrides=overrides)


SM100_ONLY = ("nvfp4",)
"""Recipes whose GEMMs TE runs only on sm_100 and newer: on Hopper they train emulated (the test below)."""


def test_nvfp4_trains_emulated_on_hopper(data_dir, tmp_path, monkeypatch):
    """On the H200 TE has no NVFP4: backend auto plans the emulated backend, which trains on the GPU."""
    from fp8_recipes.rundir import read_metrics
    from fp8_recipes.training.run import run_training

    if torch.cuda.get_device_capability()[0] >= 10:
        pytest.skip("sm_100 runs NVFP4 on TE")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(var, raising=False)
    summary = run_training(compose([
        "+recipe=nvfp4", "model=tiny", "trainer=gpu", "trainer.max_steps=8", "trainer.warmup_steps=2",
        "trainer.micro_batch_size=16", "trainer.global_batch_size=16", "trainer.lr=3e-3", "trainer.min_lr=3e-4",
        "trainer.eval_interval=4", "trainer.eval_iters=2", "trainer.save_checkpoints=false", "data.tokenizer=bytes",
        f"data.path={data_dir}", f"run_dir={tmp_path / 'run'}"]))
    losses = [r["loss"] for r in read_metrics(tmp_path / "run", "train")]
    assert summary["backend"] == "emulated", summary
    assert len(losses) == 8 and all(math.isfinite(x) for x in losses), losses
    assert sum(losses[-2:]) / 2 < losses[0] - 1.0, losses
    assert "nvfp4" in (tmp_path / "run" / "plan.txt").read_text()


def test_emulated_runs_on_the_gpu_take_tes_fused_attention_where_it_is_bf16(megatron_gpu):
    """The emulated backend on CUDA builds TE's TEDotProductAttention for BF16 attention (the fused kernels the TE
    backend runs) and Megatron-Core's local one, with the FP8 quantization points, for ``attention: fp8``; both
    train a step: forward, backward, finite loss and gradients on every linear."""
    from megatron.core.extensions.transformer_engine import TEDotProductAttention

    from fp8_recipes.megatron.emulated_layers import EmulatedDotProductAttention
    from fp8_recipes.plan.precision import Hardware
    from fp8_recipes.recipe.pack import load_recipe
    from fp8_recipes.recipe.schema import Recipe
    from fp8_recipes.training.run import attach_emulated

    dev = megatron_gpu[2]
    fp8_attention = Recipe.from_dict({**load_recipe("delayed").to_dict(), "backend": "emulated", "attention": "fp8"})
    for recipe, core in ((load_recipe("nvfp4"), TEDotProductAttention), (fp8_attention, EmulatedDotProductAttention)):
        chunks, plan, prec = attach_emulated(TINY, recipe, Hardware.detect(), torch.bfloat16, dev)
        model = chunks[0]
        assert plan.backend.value == "emulated"
        cores = [layer.self_attention.core_attention for layer in model.module.decoder.layers]
        assert all(type(c) is core for c in cores), (recipe.name, [type(c).__name__ for c in cores])
        prec.begin_step(1)
        tokens = torch.randint(0, TINY["vocab_size"], (2, TINY["seq_length"]), device=dev)
        position_ids = torch.arange(TINY["seq_length"], device=dev).expand(2, -1)
        loss = model(tokens, position_ids, None, labels=tokens).float().mean()
        loss.backward()
        grads = [p.grad for n, p in model.named_parameters() if "linear" in n]
        assert torch.isfinite(loss) and grads and all(g is not None and torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("name", [n for n in recipe_names() if n not in SM100_ONLY])
def test_every_recipe_trains_on_te(name, data_dir, tmp_path, monkeypatch):
    from fp8_recipes.rundir import read_metrics
    from fp8_recipes.training.run import run_training

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(var, raising=False)
    overrides = [f"+recipe={name}", "model=tiny", "trainer=gpu", "trainer.max_steps=8", "trainer.warmup_steps=2",
                 "trainer.micro_batch_size=16", "trainer.global_batch_size=16", "trainer.lr=3e-3",
                 "trainer.min_lr=3e-4", "trainer.eval_interval=4", "trainer.eval_iters=2",
                 "trainer.save_checkpoints=false", "data.tokenizer=bytes", f"data.path={data_dir}",
                 f"run_dir={tmp_path / 'run'}"] + (STAGED if name == "safe" else [])
    summary = run_training(compose(overrides))
    losses = [r["loss"] for r in read_metrics(tmp_path / "run", "train")]
    assert len(losses) == 8 and all(math.isfinite(x) for x in losses), losses
    assert sum(losses[-2:]) / 2 < losses[0] - 1.0, losses  # bytes of Python source: learnt within a few steps
    assert math.isfinite(summary["val_loss"])
    assert summary["backend"] == "te", summary  # bf16 too: TE's layers in BF16, the FP8 runs' kernels
    run = summary["te_execution"]
    assert run["plan_mismatches"] == 0, run["mismatch_examples"]
    plan_text = (tmp_path / "run" / "plan.txt").read_text()
    assert "backend   te" in plan_text
    if name == "bf16":
        assert run["module_forwards"] == {BF16: 8 * 16}, run
    elif name == "safe":  # layers 0 and 3 BF16; 1-2: BF16 (w alone), forward-only (w+a), then FP8 (w+a+g)
        assert run["by_stage"]["bf16 warmup"] == {BF16: 2 * 16}
        assert run["by_stage"]["fp8 w"] == {BF16: 2 * 16}
        assert run["by_stage"]["fp8 w+a"] == {BF16: 2 * 8, FP8_FWD: 2 * 8}
        assert run["by_stage"]["fp8 w+a+g"] == {BF16: 2 * 8, FP8: 2 * 8}
    else:  # 16 layer linears per step, and the LM head where the recipe runs it FP8 (fast)
        from fp8_recipes.recipe.pack import load_recipe

        head = int(load_recipe(name).layers.fp8_output_layer)
        assert run["module_forwards"] == {FP8: 8 * (16 + head)}, run
    if name == "hybrid":  # the plan says what hybrid became on this GPU
        assert "Transformer Engine runs the nearest legal recipe" in plan_text
        if torch.cuda.get_device_capability() == (9, 0):
            assert "TE: Float8BlockScaling(fp8_format=HYBRID, x 1x128, w 128x128, grad 1x128)" in plan_text


# ---------------------------------------------------------------------------------------------------------------
# (c), (d): the backend on a model we build here, with the real training loop


def fixed_batches(batch_size=8, seq=128, vocab=4096, seed=0):
    return repeated_batch(batch_size, seq, vocab, seed)


def build(recipe: dict, device, seed: int = 0, overrides: dict | None = None, **model_cfg):
    from fp8_recipes.megatron.model import build_gpt_model, model_layout
    from fp8_recipes.megatron.te_layers import attach_te_backend
    from fp8_recipes.plan.precision import Hardware, PrecisionPlan
    from fp8_recipes.recipe.schema import Recipe

    torch.manual_seed(seed)
    model = build_gpt_model({**TINY, **model_cfg}, use_te_spec=True, params_dtype=torch.bfloat16, device=device,
                            config_overrides=overrides)
    plan = PrecisionPlan(Recipe.from_dict(recipe), model_layout(model), Hardware.detect())
    assert str(plan.backend) == "te", plan.backend_reason
    return model, attach_te_backend(model, plan)


def run(model, precision, out: Path, steps: int, resume_from: Path | None = None, **trainer):
    """``steps`` steps of the loop on Megatron-Core's engine (its DDP and optimizer around ``model``)."""
    from fp8_recipes.megatron.te_layers import fp8_param_recipe
    from fp8_recipes.training.config import TrainerConfig
    from fp8_recipes.training.engine import build_engine
    from fp8_recipes.training.loop import train

    cfg = {**dict(max_steps=steps, micro_batch_size=8, global_batch_size=8, lr=3e-3, min_lr=3e-3, warmup_steps=0,
                  eval_interval=0, eval_iters=0, save_checkpoints=False), **trainer}
    tcfg = TrainerConfig.from_cfg(cfg)
    engine = build_engine([model], tcfg, seq_length=int(TINY["seq_length"]), lr=tcfg.lr,
                          device=next(model.parameters()).device, fp8_param=fp8_param_recipe(precision.plan))
    return train(engine, fixed_batches(), None, cfg, precision, out, resume_from=resume_from)


def recorded_any(history: torch.Tensor) -> list[int]:
    """Rows of a TE amax history with a recorded amax in any column."""
    return (history.abs().sum(1) > 0).nonzero().flatten().tolist()


def recorded(history: torch.Tensor) -> list[int]:
    """Rows of a TE amax history (column 0: a module's input, or its grad_output) that hold a recorded amax."""
    return (history[:, 0] > 0).nonzero().flatten().tolist()


def staged(scaling: str, **layers) -> dict:
    return {"weights": scaling, "activations": scaling, "gradients": scaling, "layers": layers,
            "schedule": {"bf16_warmup_steps": 2, "enable": {"weights": 2, "activations": 4, "gradients": 6}}}


@pytest.mark.parametrize("scaling", ["tensorwise", "blockwise", "delayed"])
def test_stage_switches_take_effect_at_the_planned_steps(scaling, megatron_gpu, tmp_path):
    model, precision = build(staged(scaling), megatron_gpu[2])
    summary = run(model, precision, tmp_path, 8)
    per_step = {s: dict(precision.step_kinds[s]) for s in range(8)}
    n = 4 * 4  # 4 layers x 4 TE linears, one micro-batch per step
    assert per_step == {0: {BF16: n}, 1: {BF16: n}, 2: {BF16: n}, 3: {BF16: n}, 4: {FP8_FWD: n},
                        5: {FP8_FWD: n}, 6: {FP8: n}, 7: {FP8: n}}
    assert sum(precision.mismatches.values()) == 0 and summary["nonfinite_loss_steps"] == 0
    assert summary["final_loss"] < 8.0  # ln(4096) = 8.3 at the start; one fixed batch is learnt quickly
    if scaling == "delayed":  # one amax history across the forward-only -> FP8 switch (CustomRecipe carrier)
        from fp8_recipes.backends.te_state import delayed_tensors

        t = delayed_tensors(precision.linears["decoder.layers.1.mlp.linear_fc1"])
        # input amaxes of steps 4-7, one roll per step; [1022, 1023] alone would mean a reset at step 6
        assert recorded(t["amax_history_fwd"]) == [1020, 1021, 1022, 1023]
        assert recorded(t["amax_history_bwd"]) == [1022, 1023]  # FP8 gradients from step 6
        assert (t["scale_bwd"][0] != 1).item()


@pytest.mark.parametrize("roles", [("delayed", "delayed", "tensorwise"), ("tensorwise", "tensorwise", "delayed"),
                                   ("delayed", "delayed", "none")], ids=["fwd-delayed", "bwd-delayed", "fwd-only"])
def test_delayed_scaling_in_one_direction_trains(roles, megatron_gpu, tmp_path):
    """A CustomRecipe with delayed state in one direction only (TE 2.20.2 failed on it at the first FP8 forward:
    plan/te.py, DELAYED_ANCHOR): it trains with every linear as planned, the delayed roles' histories record
    amaxes and the anchor's columns (the other direction's boundary slots) none, their scales 1."""
    from fp8_recipes.backends.te_state import delayed_slots, delayed_tensors

    recipe = dict(zip(("weights", "activations", "gradients"), roles))
    model, precision = build(recipe, megatron_gpu[2])
    summary = run(model, precision, tmp_path, 4)
    assert sum(precision.mismatches.values()) == 0 and summary["nonfinite_loss_steps"] == 0
    name = "decoder.layers.1.mlp.linear_fc1"
    choice, t = precision._choices[name], delayed_tensors(precision.linears[name])
    for fwd, d in ((True, "fwd"), (False, "bwd")):
        slots = delayed_slots(choice, 3 if fwd else 2, fwd)
        assert t[f"amax_history_{d}"].shape[1] == len(slots) > 0
        anchor = choice.delayed_anchor is fwd
        assert bool((t[f"amax_history_{d}"] > 0).any()) != anchor, (d, t)
        if anchor:
            assert torch.equal(t[f"scale_{d}"], torch.ones_like(t[f"scale_{d}"]))


@pytest.mark.parametrize("scaling", ["tensorwise", "delayed"])
def test_first_and_last_layers_run_bf16(scaling, megatron_gpu, tmp_path):
    recipe = {"weights": scaling, "activations": scaling, "gradients": scaling,
              "layers": {"bf16_first": 1, "bf16_last": 1}}
    model, precision = build(recipe, megatron_gpu[2])
    summary = run(model, precision, tmp_path, 4)
    assert summary["nonfinite_loss_steps"] == 0 and sum(precision.mismatches.values()) == 0
    from fp8_recipes.backends.te_state import delayed_tensors

    for layer in range(4):
        for m in PER_LAYER:
            name = f"decoder.layers.{layer}.{m}"
            ran = {k for (n, k), c in precision.module_kinds.items() if n == name and c}
            want = BF16 if layer in (0, 3) else FP8
            assert ran == {want}, (name, ran)
            if scaling == "delayed":  # independent of our hook: only FP8 modules record amaxes in TE's state
                t = delayed_tensors(precision.linears[name])
                assert bool(t and (t["amax_history_fwd"] > 0).any()) == (want == FP8), name
                if want == FP8:  # one roll per step forward and backward (the outer autocast), not one per layer
                    assert recorded(t["amax_history_fwd"]) == [1020, 1021, 1022, 1023], name
                    assert recorded(t["amax_history_bwd"]) == [1020, 1021, 1022, 1023], name


@pytest.mark.parametrize("head", ["bf16", "fp8"])
def test_gradient_accumulation_fusion_gives_the_same_gradients(head, megatron_gpu, tmp_path):
    """trainer.gradient_accumulation_fusion (on by default on TE): every TE module's wgrad GEMM accumulates into
    DDP's fp32 main_grad; the plain LM head (no APEX) keeps its own wgrad; with tied embeddings the FP8 head's fused
    wgrad and the embedding's gradient both arrive. Same gradients as unfused, to BF16's rounding of each wgrad."""
    from transformer_engine.pytorch.module.base import TransformerEngineBaseModule

    from fp8_recipes.megatron.model import unwrap_model
    from fp8_recipes.rundir import read_metrics

    recipe = {"weights": "delayed", "activations": "delayed", "gradients": "delayed",
              "layers": {"fp8_output_layer": head == "fp8"}}
    norms, losses = {}, {}
    from megatron.core import tensor_parallel

    for fused in (False, True):
        tensor_parallel.model_parallel_cuda_manual_seed(0)  # (the TE layers' init draws from its CUDA stream)
        model, precision = build(recipe, megatron_gpu[2], overrides={"gradient_accumulation_fusion": fused},
                                 share_embeddings_and_output_weights=True)
        te_modules = [m for m in model.modules()  # TE's linears (its attention has no wgrad)
                      if isinstance(m, TransformerEngineBaseModule) and hasattr(m, "fuse_wgrad_accumulation")]
        assert len(te_modules) == 16 and {m.fuse_wgrad_accumulation for m in te_modules} == {fused}
        out_layer = unwrap_model(model).output_layer
        if head == "fp8":
            assert out_layer.te_linear.fuse_wgrad_accumulation == fused
        else:
            assert out_layer.gradient_accumulation_fusion is False  # Megatron-Core's own wgrad (APEX's otherwise)
        run(model, precision, tmp_path / str(fused), 3, micro_batch_size=4, global_batch_size=8)  # 2 micro-batches
        rows = read_metrics(tmp_path / str(fused), "train")
        norms[fused], losses[fused] = [r["grad_norm"] for r in rows], [r["loss"] for r in rows]
    assert losses[True][0] == losses[False][0]  # the same weights and batch before the first update
    assert norms[True][0] == pytest.approx(norms[False][0], rel=1e-2), norms
    assert losses[True] == pytest.approx(losses[False], rel=2e-2), losses


def test_te_spec_model_has_the_plans_layout(megatron_gpu):
    from transformer_engine.pytorch import LayerNormLinear, Linear

    from fp8_recipes.megatron.model import build_gpt_model, named_linear_modules
    from fp8_recipes.plan.precision import ModelLayout

    model = build_gpt_model(TINY, use_te_spec=True, params_dtype=torch.bfloat16, device=megatron_gpu[2])
    named = named_linear_modules(model)
    assert [n for n, _ in named] == list(ModelLayout.gpt(4).module_names)
    kinds = {n.rsplit(".", 1)[-1]: m for n, m in named}
    assert isinstance(kinds["linear_qkv"], LayerNormLinear) and isinstance(kinds["linear_fc1"], LayerNormLinear)
    assert isinstance(kinds["linear_proj"], Linear) and isinstance(kinds["linear_fc2"], Linear)
    assert not isinstance(kinds["output_layer"], (Linear, LayerNormLinear))  # the LM head: Megatron's own, BF16
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16} and next(model.parameters()).is_cuda


def test_bf16_module_pattern_runs_bf16(megatron_gpu, tmp_path):
    recipe = {"weights": "tensorwise", "activations": "tensorwise", "gradients": "tensorwise",
              "layers": {"bf16_modules": ["*.linear_qkv"]}}
    model, precision = build(recipe, megatron_gpu[2])
    run(model, precision, tmp_path, 2)
    for name, kind in precision.module_kinds:
        assert kind == (BF16 if name.endswith("linear_qkv") else FP8), (name, kind)
    assert sum(precision.mismatches.values()) == 0


def test_high_precision_evaluation_runs_bf16(megatron_gpu):
    model, precision = build({"weights": "tensorwise", "activations": "tensorwise", "gradients": "tensorwise"},
                             megatron_gpu[2])
    precision.begin_step(0)
    batch = {k: v.cuda() for k, v in next(fixed_batches()).items()}
    model.train()
    with precision.high_precision():
        model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    assert {k for (_, k) in precision.module_kinds} == {BF16, FP8}
    assert sum(precision.mismatches.values()) == 0


def test_delayed_state_survives_a_checkpoint(megatron_gpu, tmp_path):
    from fp8_recipes.backends.te_state import delayed_tensors

    recipe = {"weights": "delayed", "activations": "delayed", "gradients": "delayed", "layers": {"bf16_first": 1}}
    model, precision = build(recipe, megatron_gpu[2])
    run(model, precision, tmp_path, 3, save_checkpoints=True)
    saved = precision.state_dict()["delayed"]
    assert set(saved) == {f"decoder.layers.{i}.{m}" for i in (1, 2, 3) for m in PER_LAYER}
    fresh_model, fresh = build(recipe, megatron_gpu[2], seed=1)
    summary = run(fresh_model, fresh, tmp_path, 4, save_checkpoints=True, resume_from=tmp_path)
    assert summary["steps"] == 4 and summary["nonfinite_loss_steps"] == 0
    # resumed at step 3 with the saved histories and scales: step 3 rolled each history once more
    for name, tensors in saved.items():
        now = {k: v.cpu() for k, v in delayed_tensors(fresh.linears[name]).items()}
        for key in ("amax_history_fwd", "amax_history_bwd"):
            assert recorded(tensors[key]) == [1021, 1022, 1023] and recorded(now[key]) == [1020, 1021, 1022, 1023]
            assert torch.equal(now[key][-4:-1], tensors[key][-3:]), (name, key)


# ---------------------------------------------------------------------------------------------------------------
# The FP8 LM head (layers.fp8_output_layer): a te.Linear handed Megatron-Core's head weight, or the tied embedding


def head_recipe(scaling: str) -> dict:
    return {"weights": scaling, "activations": scaling, "gradients": scaling, "layers": {"fp8_output_layer": True}}


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("scaling", ["tensorwise", "blockwise", "delayed"])
def test_fp8_lm_head_trains(scaling, tied, megatron_gpu, tmp_path):
    from fp8_recipes.megatron.model import unwrap_model
    from fp8_recipes.megatron.te_layers import TEOutputLayer

    model, precision = build(head_recipe(scaling), megatron_gpu[2], share_embeddings_and_output_weights=tied)
    gpt = unwrap_model(model)
    assert isinstance(gpt.output_layer, TEOutputLayer) and "output_layer" in precision.linears
    assert (gpt.output_layer.weight is None) == tied
    summary = run(model, precision, tmp_path, 4)
    assert summary["nonfinite_loss_steps"] == 0 and math.isfinite(summary["final_loss"])
    head = {kind for (name, kind) in precision.module_kinds if name == "output_layer"}
    assert head == {FP8} and sum(precision.mismatches.values()) == 0
    weight = gpt.embedding.word_embeddings.weight if tied else gpt.output_layer.weight
    assert precision.linears["output_layer"].weight is weight  # TE ran on Megatron-Core's parameter
    assert weight.main_grad.abs().sum() > 0  # its gradient reached DDP's buffer
    if scaling == "delayed":  # the outer autocast spans the head: every history rolled once per step
        from fp8_recipes.backends.te_state import delayed_tensors

        for name in ("output_layer", "decoder.layers.0.mlp.linear_fc1"):
            tensors = delayed_tensors(precision.linears[name])
            assert recorded(tensors["amax_history_fwd"]) == [1020, 1021, 1022, 1023], name
        assert "output_layer" in precision.state_dict()["delayed"]


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_fp8_lm_head_computes_the_quantized_gemm(tied, megatron_gpu):
    """The head's logits are the tensorwise-quantized input times the quantized weight (our numerics core, which
    equals TE's quantizers bit for bit), up to the GEMM's accumulation order, and far from the unquantized ones."""
    from fp8_recipes.megatron.model import unwrap_model
    from fp8_recipes.numerics import fake_quant
    from fp8_recipes.recipe.schema import Recipe, Role

    recipe = head_recipe("tensorwise")
    model, precision = build(recipe, megatron_gpu[2], share_embeddings_and_output_weights=tied)
    gpt = unwrap_model(model)
    seen = {}
    gpt.output_layer.register_forward_pre_hook(
        lambda m, args, kwargs: seen.update(x=args[0].detach(), w=kwargs.get("weight")), with_kwargs=True)
    precision.begin_step(0)
    batch = {k: v.cuda() for k, v in next(fixed_batches()).items()}
    model.eval()
    with torch.no_grad():
        logits = model(batch["tokens"], batch["position_ids"], None).float().transpose(0, 1)  # [s, b, v]
    w = (seen["w"] if seen["w"] is not None else gpt.output_layer.weight).detach()
    r = Recipe.from_dict(recipe)
    ref = fake_quant(seen["x"], r.policy(Role.ACTIVATIONS)).float() @ fake_quant(w, r.policy(Role.WEIGHTS)).float().t()
    plain = seen["x"].float() @ w.float().t()
    # TE returns BF16 logits: within one BF16 ulp of the largest logit (rounding and accumulation order); the
    # unquantized GEMM is farther (measured on the H200: 0.0102 vs 0.0494 tied, 4.8x apart)
    err, unquantized = (logits - ref).abs().max().item(), (plain - ref).abs().max().item()
    ulp = 2.0 ** (math.floor(math.log2(ref.abs().max().item())) - 7)
    assert err <= ulp and unquantized > 2 * err, (err, ulp, unquantized)
    assert {kind for (name, kind) in precision.module_kinds if name == "output_layer"} == set()  # eval: not counted
    assert sum(precision.mismatches.values()) == 0


def test_bf16_lm_head_is_left_as_built(megatron_gpu):
    from megatron.core.tensor_parallel import ColumnParallelLinear

    from fp8_recipes.megatron.model import unwrap_model

    model, precision = build({"weights": "tensorwise", "activations": "tensorwise", "gradients": "tensorwise"},
                             megatron_gpu[2])
    assert type(unwrap_model(model).output_layer) is ColumnParallelLinear and "output_layer" not in precision.linears


# ---------------------------------------------------------------------------------------------------------------
# attention: fp8 (TE's FP8 dot-product attention: the layers' DelayedScaling recipe with fp8_dpa)


# Head dim 128: TE's FP8 attention found no backend for TINY's head dim 32 on the H200 ("No dot product attention
# backend is available"); Llama's is 128.
WIDE_HEADS = dict(hidden_size=256, num_attention_heads=2, num_query_groups=2, ffn_hidden_size=512)


def test_fp8_attention_runs_in_the_plans_layers_and_survives_a_checkpoint(megatron_gpu, tmp_path):
    from fp8_recipes.backends.te_state import delayed_tensors

    recipe = {"weights": "delayed", "activations": "delayed", "gradients": "delayed", "attention": "fp8",
              "layers": {"bf16_first": 1}}
    model, precision = build(recipe, megatron_gpu[2], **WIDE_HEADS)
    assert set(precision.attention) == {f"decoder.layers.{i}.self_attention.core_attention" for i in range(4)}
    assert set(build({**recipe, "attention": "bf16"}, megatron_gpu[2])[1].attention) == set()  # kept only for fp8
    summary = run(model, precision, tmp_path, 3, save_checkpoints=True)
    assert summary["nonfinite_loss_steps"] == 0 and math.isfinite(summary["final_loss"])
    for i in range(4):
        dpa = precision.attention[f"decoder.layers.{i}.self_attention.core_attention"]
        ran_fp8 = bool(getattr(dpa, "fp8", False)) and dpa.fp8_meta["recipe"].fp8_dpa
        assert ran_fp8 == (i > 0), i  # layer 0 is BF16 (bf16_first), its attention too
    saved = precision.state_dict()["delayed"]
    attn = {n for n in saved if n.endswith("core_attention")}
    assert attn == {f"decoder.layers.{i}.self_attention.core_attention" for i in (1, 2, 3)}
    for name in attn:  # one forward per step: three recorded amaxes, the newest last (TE's attention records in
        # other columns than a linear's: 2, 3 and 8 of its 9 forward ones, measured on the H200)
        assert recorded_any(saved[name]["amax_history_fwd"]) == [1021, 1022, 1023], name
    fresh_model, fresh = build(recipe, megatron_gpu[2], seed=1, **WIDE_HEADS)
    run(fresh_model, fresh, tmp_path, 4, save_checkpoints=True, resume_from=tmp_path)
    for name in attn:  # resumed with the saved history: step 3 rolled it once more
        now = delayed_tensors(fresh.attention[name])["amax_history_fwd"].cpu()
        assert recorded_any(now) == [1020, 1021, 1022, 1023] and torch.equal(now[-4:-1], saved[name]["amax_history_fwd"][-3:])


def test_fp8_attention_changes_the_output_only_where_planned(megatron_gpu):
    """Same weights, same batch: FP8 attention moves the logits away from the BF16-attention run of the same
    recipe, by the size FP8 attention's error has (docs/facts.md: ~5% relative on the attention output)."""
    batch = {k: v.cuda() for k, v in next(fixed_batches()).items()}
    out, weights = {}, None
    for attention in ("bf16", "fp8"):
        model, precision = build({"weights": "delayed", "activations": "delayed", "gradients": "delayed",
                                  "attention": attention}, megatron_gpu[2], **WIDE_HEADS)
        if weights is None:  # the same weights in both (each build draws from the advanced GPU RNG tracker)
            weights = {k: v.clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
        else:
            from fp8_recipes.megatron.model import unwrap_model

            missing, unexpected = unwrap_model(model).load_state_dict(weights, strict=False)  # (Float16Module's
            # load_state_dict returns nothing)
            assert not unexpected and all(k.endswith("_extra_state") for k in missing)
        model.eval()
        precision.begin_step(0)
        with torch.no_grad():
            for _ in range(3):  # delayed scaling: let the histories see this batch
                out[attention] = model(batch["tokens"], batch["position_ids"], None).float()
    diff = ((out["fp8"] - out["bf16"]).norm() / out["bf16"].norm()).item()
    assert 1e-4 < diff < 0.2, diff


# ---------------------------------------------------------------------------------------------------------------
# FP8 primary weights (recipe fp8_param: true): the FP8 layers' weights stored as TE FP8 tensors


def stored_recipe(scaling: str, fp8_param: bool = True) -> dict:
    return {"weights": scaling, "activations": scaling, "gradients": scaling, "fp8_param": fp8_param,
            "layers": {"bf16_first": 1}}


def build_stored(recipe: dict, device, **model_cfg):
    """The model as training/run.py's attach_te builds it: the plan first, its FP8 layers built with FP8 weights
    (the same initial values with and without fp8_param: init_seed)."""
    from fp8_recipes.megatron.model import build_gpt_model
    from fp8_recipes.megatron.te_layers import FP8ParamInit, attach_te_backend
    from fp8_recipes.plan.precision import Hardware, ModelLayout, PrecisionPlan
    from fp8_recipes.recipe.schema import Recipe

    plan = PrecisionPlan(Recipe.from_dict(recipe), ModelLayout.gpt(TINY["num_layers"]), Hardware.detect())
    assert str(plan.backend) == "te" and plan.fp8_param_problem() is None, plan.fp8_param_problem()
    init = FP8ParamInit(plan) if plan.recipe.fp8_param else None
    model = build_gpt_model({**TINY, **model_cfg}, use_te_spec=True, params_dtype=torch.bfloat16, device=device,
                            init_seed=1234, layer_init=init)
    return model, attach_te_backend(model, plan, recipes=init.recipes if init else None)


def fp8_bytes(precision) -> dict[str, torch.Tensor]:
    """The FP8 weights' row-wise codes and scale inverses, as saved (backends/te.py)."""
    return {f"{name}/{k}": v.clone() for name, t in precision.state_dict().get("fp8_params", {}).items()
            for k, v in t.items() if k in ("data", "fp8_scale_inv", "rowwise_data", "rowwise_scale_inv")}


def train_losses(out: Path) -> list[float]:
    from fp8_recipes.rundir import read_metrics

    return [r["loss"] for r in read_metrics(out, "train")]


STORED = dict(use_distributed_optimizer=True)  # what fp8_param needs (the optimizer re-quantizes the FP8 weights)


@pytest.mark.parametrize("scaling", ["delayed", "tensorwise", "blockwise"])
def test_fp8_param_stores_fp8_weights_where_planned_and_trains_like_bf16_storage(scaling, megatron_gpu, tmp_path):
    from transformer_engine.pytorch.tensor import QuantizedTensor

    from fp8_recipes.megatron.model import unwrap_model

    model, precision = build_stored(stored_recipe(scaling), megatron_gpu[2])
    gpt = unwrap_model(model)
    kind = "Float8BlockwiseQTensor" if scaling == "blockwise" else "Float8Tensor"
    for i, layer in enumerate(gpt.decoder.layers):
        for m in PER_LAYER:
            linear = layer.get_submodule(m)
            assert isinstance(linear.weight, QuantizedTensor) == (i > 0), (i, m)  # layer 0: bf16_first
            assert i == 0 or type(linear.weight).__name__ == kind, type(linear.weight)
            assert linear.weight.dtype == torch.bfloat16  # (the FP8 tensor stands for a BF16 one)
        norm = getattr(layer.self_attention.linear_qkv, "layer_norm_weight", None)
        assert norm is None or not isinstance(norm, QuantizedTensor)
    for p in (gpt.output_layer.weight, gpt.embedding.word_embeddings.weight):
        assert not isinstance(p, QuantizedTensor) and p.dtype == torch.bfloat16
    assert set(precision.fp8_params) == {f"decoder.layers.{i}.{m}.weight" for i in (1, 2, 3) for m in PER_LAYER}
    before = fp8_bytes(precision)
    summary = run(model, precision, tmp_path / "fp8", 4, **STORED)
    assert summary["nonfinite_loss_steps"] == 0 and sum(precision.mismatches.values()) == 0
    after = fp8_bytes(precision)
    assert all(isinstance(p, QuantizedTensor) for p in precision.fp8_params.values())  # still FP8 after updates
    assert any(not torch.equal(before[k], after[k]) for k in before)  # and the optimizer updated them
    # the same recipe storing BF16 weights, from the same initial values: the same losses up to FP8 rounding
    bf16_model, bf16_precision = build_stored(stored_recipe(scaling, fp8_param=False), megatron_gpu[2])
    run(bf16_model, bf16_precision, tmp_path / "bf16", 4, **STORED)
    fp8, bf16 = train_losses(tmp_path / "fp8"), train_losses(tmp_path / "bf16")
    assert all(math.isfinite(x) for x in fp8) and fp8[-1] < fp8[0], fp8
    assert fp8[0] == pytest.approx(bf16[0], rel=2e-3), (fp8, bf16)  # step 1: the same quantized weights
    assert fp8 == pytest.approx(bf16, rel=3e-2), (fp8, bf16)


@pytest.mark.parametrize("scaling", ["delayed", "tensorwise", "blockwise"])
def test_fp8_param_checkpoint_resumes_bit_exactly(scaling, megatron_gpu, tmp_path):
    from fp8_recipes.megatron.te_layers import fp8_param_recipe
    from fp8_recipes.training.checkpoint import load_checkpoint
    from fp8_recipes.training.config import TrainerConfig
    from fp8_recipes.training.engine import build_engine

    recipe = stored_recipe(scaling)
    runs = []
    for name in ("a", "b"):  # two uninterrupted runs: is training on this GPU deterministic?
        model, precision = build_stored(recipe, megatron_gpu[2])
        run(model, precision, tmp_path / name, 4, **STORED)
        runs.append((train_losses(tmp_path / name), fp8_bytes(precision)))
    model, precision = build_stored(recipe, megatron_gpu[2])
    run(model, precision, tmp_path / "cut", 2, save_checkpoints=True, **STORED)
    saved = fp8_bytes(precision)
    # restored exactly: a fresh model and engine loading the checkpoint hold the saved FP8 bytes
    fresh_model, fresh = build_stored(recipe, megatron_gpu[2])
    tcfg = TrainerConfig.from_cfg(dict(max_steps=4, micro_batch_size=8, global_batch_size=8, lr=3e-3, min_lr=3e-3,
                                       warmup_steps=0, **STORED))
    engine = build_engine([fresh_model], tcfg, seq_length=TINY["seq_length"], lr=tcfg.lr, device=megatron_gpu[2],
                          fp8_param=fp8_param_recipe(fresh.plan))
    assert load_checkpoint(tmp_path / "cut", engine=engine, precision=fresh) == 2
    restored = fp8_bytes(fresh)
    assert restored.keys() == saved.keys() and all(torch.equal(restored[k], saved[k]) for k in saved)
    # and the resumed run continues as the uninterrupted one (bit for bit where training is deterministic here)
    model, precision = build_stored(recipe, megatron_gpu[2])
    run(model, precision, tmp_path / "cut", 4, resume_from=tmp_path / "cut", **STORED)
    resumed, final = train_losses(tmp_path / "cut")[-2:], fp8_bytes(precision)
    (losses_a, bytes_a), (losses_b, bytes_b) = runs
    if losses_a == losses_b and all(torch.equal(bytes_a[k], bytes_b[k]) for k in bytes_a):
        assert resumed == losses_a[-2:], (resumed, losses_a)
        assert all(torch.equal(final[k], bytes_a[k]) for k in bytes_a)
    else:
        assert resumed == pytest.approx(losses_a[-2:], rel=1e-2), (resumed, losses_a)
