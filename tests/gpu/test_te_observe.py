"""Numerics statistics on the TE backend (backends/te_observe.py): the operands handed to the recorder, as its
fused kernel quantizes them, are what TE's FP8 GEMMs read (TE's own output equals the product of those FP8
operands, and not the high-precision one), and a training run with `debug:` writes numerics.jsonl rows for every TE linear, GEMM and operand."""

from __future__ import annotations

import math

import pytest
import torch

from fp8_recipes.backends.te import te_available

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not (torch.cuda.is_available() and te_available()),
                                                  reason="needs a CUDA GPU with Transformer Engine")]

from test_te_training import build, compose, fixed_batches, run  # noqa: E402  (same directory)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("scaling", ["tensorwise", "blockwise", "delayed"])
def test_observed_operands_are_what_te_multiplied(scaling, megatron_gpu, tmp_path):
    from fp8_recipes.backends.te_observe import te_observer_states
    from fp8_recipes.observe.stats import COLUMNWISE, measure_fused

    model, precision = build({"weights": scaling, "activations": scaling, "gradients": scaling}, megatron_gpu[2])
    run(model, precision, tmp_path, 3)  # delayed: scales from real amax histories, not TE's initial 1.0
    states = te_observer_states(precision)
    seen: dict[tuple[str, str, str], tuple[torch.Tensor, torch.Tensor]] = {}
    outputs: dict[str, torch.Tensor] = {}
    watched = ("decoder.layers.1.mlp.linear_fc2", "decoder.layers.1.mlp.linear_fc1")  # Linear, LayerNormLinear
    def fused_copy(s, gemm, role, hp):
        """The FP8 values the recorder's fused kernel measures (what measure(fq_x=None) quantizes on the GPU)."""
        fq = torch.empty(hp.shape, dtype=torch.float32, device=hp.device)
        measure_fused(hp, s.plan.gemms[gemm].policy(role), columnwise=COLUMNWISE[(str(gemm), str(role))],
                      scaler=s.scalers[role], fq_out=fq)
        return fq

    for name in watched:
        states[name].observer = lambda s, gemm, role, hp, fq, q=None: seen.__setitem__(
            (s.name, str(gemm), str(role)), (hp.clone(), fused_copy(s, gemm, role, hp)))
        precision.linears[name].register_forward_hook(
            lambda m, a, out, name=name: outputs.__setitem__(name, out[0].detach().clone()))
    precision.begin_step(3)
    model.train()
    batch = {k: v.cuda() for k, v in next(fixed_batches()).items()}
    loss = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"]).float().mean()
    loss.backward()
    for name in watched:
        keys = {k[1:] for k in seen if k[0] == name}
        assert keys == {("fprop", "activations"), ("fprop", "weights"), ("dgrad", "weights"),
                        ("wgrad", "activations"), ("dgrad", "gradients"), ("wgrad", "gradients")}, (name, keys)
        hp_a, fq_a = seen[(name, "fprop", "activations")]
        hp_w, fq_w = seen[(name, "fprop", "weights")]
        te_out = outputs[name]
        ours = (fq_a.float() @ fq_w.float().t()).reshape(te_out.shape)
        exact = (hp_a.float() @ hp_w.float().t()).reshape(te_out.shape)
        # TE's FP8 GEMM = the product of our quantized operands up to BF16 output rounding (2^-9 relative), far
        # closer than to the high-precision product (FP8's ~2-6% error); LayerNormLinear: our recomputed norm
        # may round a rare element differently from TE's kernel
        tol = 0.006 if name.endswith("fc2") else 0.01
        assert _rel(te_out, ours) < tol, (name, _rel(te_out, ours), _rel(te_out, exact))
        assert _rel(te_out, exact) > 3 * _rel(te_out, ours), (name, _rel(te_out, ours), _rel(te_out, exact))
        g_hp, g_fq = seen[(name, "dgrad", "gradients")]
        assert g_hp.shape == te_out.shape and 0.9 < float(torch.nn.functional.cosine_similarity(
            g_hp.float().flatten(), g_fq.float().flatten(), dim=0)) <= 1.0 + 1e-6


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_training_with_debug_writes_statistics_on_te(recipe, tmp_path, monkeypatch):
    from fp8_recipes.rundir import read_numerics
    from fp8_recipes.training.run import run_training

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(var, raising=False)
    run_dir = tmp_path / "run"
    summary = run_training(compose([
        f"+recipe={recipe}", "model=tiny", "trainer=gpu", "trainer.max_steps=4", "trainer.warmup_steps=1",
        "trainer.micro_batch_size=8", "trainer.global_batch_size=8", "trainer.eval_interval=0",
        "trainer.save_checkpoints=false", "data.tokenizer=bytes", f"data.path={tmp_path / 'data'}",
        f"run_dir={run_dir}", "++debug.interval=2"]))
    assert summary["backend"] == "te" and summary["numerics_s"] > 0
    from fp8_recipes.observe import stats
    assert stats.FUSED_ERROR is None  # every operand went through the fused kernel (no fallback to the core)
    rows = read_numerics(run_dir)
    assert sorted({r["step"] for r in rows}) == [1, 3]  # 1-based steps 1, 1 + interval
    modules = {r["module"] for r in rows}
    assert len(modules) == 4 * 4 and "output_layer" not in modules  # every TE linear; the BF16 LM head has none
    assert len(rows) == 2 * 16 * 6  # 2 steps x 16 linears x (fprop, dgrad, wgrad) x 2 operands
    for r in rows:
        assert 0 <= r["underflow_pct"] <= 100 and 0 <= r["saturation_pct"] <= 100, r
        assert math.isfinite(r["mse"]) and 0 <= r["cosine"] <= 1.0 + 1e-6, r
        if not (recipe == "delayed" and r["step"] == 1 and r["role"] == "gradients"):
            # (step 1 of delayed scaling: gradient scales from a one-step history, cosine down to 0.88 on the H200)
            assert 0.9 < r["cosine"], r
        assert (r.get("scale_ratio") is not None) == (recipe == "delayed"), r
    assert (run_dir / "numerics_underflow.png").stat().st_size > 0
