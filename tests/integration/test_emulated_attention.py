"""The emulated backend's FP8 attention (recipe ``attention: fp8``): one core attention against a float64 reference
of the same quantized math, then in a Megatron-Core GPTModel (BF16 stages bit-identical, FP8 only in the plan's
layers and steps, delayed scaling state round-tripped), then through the training run.

The quantization points, written out here as backends/emulated.py's docstring gives them (Transformer Engine's
FP8 attention emulation):

    forward   QKV = q(Q, K, V together; activations)   S = q(softmax output)   O = q(output)
    backward  dO = q(output gradient; gradients)   dP = q(pre-softmax scores' gradient)   dQKV = q(dQ, dK, dV together)

The reference follows the emulation's chain stage by stage: each quantization's input must equal the float64 math
of the stage before it (from the previous quantized values) within float32's error bound, and each quantized tensor
must equal an independent quantization of that same input, exactly. (Quantizing the reference's own float64 values
instead would let a value one float32 rounding away from an FP8 rounding boundary flip a code.)
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from fp8_recipes.backends.emulated import EmulatedAttentionState, EmulatedPrecision
from fp8_recipes.megatron.emulated_layers import (
    EmulatedColumnParallelLinear, EmulatedDotProductAttention, EmulatedRowParallelLinear, attach_emulated_backend,
)
from fp8_recipes.megatron.model import build_gpt_model, model_layout
from fp8_recipes.numerics import fp8_spec
from fp8_recipes.plan.precision import ModelLayout, PrecisionPlan
from fp8_recipes.recipe.pack import load_recipe_dict
from fp8_recipes.recipe.schema import Recipe
from test_train_cpu import ROOT, compose_train, dataset, small_run  # noqa: F401  (dataset: the shared fixture)

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

FORWARD, BACKWARD = ("QKV", "S", "O"), ("dO", "dP", "dQKV")
U = 2.0**-24  # float32's unit roundoff


def gamma(k: int) -> float:
    """Worst-case relative error of a float32 sum of k products (Higham, Thm 3.1)."""
    return k * U / (1 - k * U)


def fp8_attention_recipe(base: str, **extra) -> Recipe:
    return Recipe.from_dict({**load_recipe_dict(base), "attention": "fp8", **extra})


# ---------------------------------------------------------------------------------------------------------------
# One core attention against a float64 reference

SQ, B, HEADS, GROUPS, HN = 16, 2, 4, 2, 8


def core_attention(dtype=torch.float32) -> EmulatedDotProductAttention:
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    config = TransformerConfig(num_layers=1, hidden_size=HEADS * HN, num_attention_heads=HEADS,
                               num_query_groups=GROUPS, masked_softmax_fusion=False, attention_dropout=0.0,
                               use_cpu_initialization=True,
                               params_dtype=dtype, bf16=dtype == torch.bfloat16)
    return EmulatedDotProductAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                       attention_type="self")


def attached(module: EmulatedDotProductAttention, recipe: Recipe) -> tuple[EmulatedPrecision, EmulatedAttentionState]:
    state = module._fp8_state = EmulatedAttentionState("core_attention", 0)
    precision = EmulatedPrecision(PrecisionPlan(recipe, ModelLayout(1, ())), {}, {0: state})
    return precision, state


def qkv_inputs(seed: int, scale: float = 1.0):
    """q [sq, b, heads, hn], k and v [sq, b, groups, hn], the output gradient [sq, b, heads * hn]; magnitudes that
    vary per position and channel, so that where a scale's amax comes from matters."""
    g = torch.Generator().manual_seed(seed)

    def spread(*shape):
        return torch.exp(torch.randn(*shape, generator=g))

    q = torch.randn(SQ, B, HEADS, HN, generator=g) * spread(SQ, 1, 1, 1) * spread(HN) * scale
    k = torch.randn(SQ, B, GROUPS, HN, generator=g) * spread(SQ, 1, 1, 1) * scale
    v = torch.randn(SQ, B, GROUPS, HN, generator=g) * spread(HN) * 0.5 * scale
    dy = torch.randn(SQ, B, HEADS * HN, generator=g) * spread(SQ, 1, 1) * 1e-3 * scale
    return q, k, v, dy


def run(module, q, k, v, dy):
    """(output, dq, dk, dv) and what each quantization point saw: {tensor: (hp tuple, fq tuple)}."""
    seen: dict[str, tuple] = {}
    if module._fp8_state is not None:
        module._fp8_state.observer = lambda state, tensor, hp, fq: seen.__setitem__(
            tensor, (tuple(t.detach().clone() for t in hp), tuple(t.detach().clone() for t in fq)))
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = module(q, k, v, None)
    out.backward(dy)
    return (out.detach(), q.grad, k.grad, v.grad), seen


def ref_fake_quant(tensors, recipe: Recipe, tensor: str, scale: torch.Tensor | None = None) -> tuple:
    """Fake-quantized together with one per-tensor scale: fp8_max / amax over all of them (tensorwise), or the
    delayed scale given; codes saturate; dequantized by a float32 multiply with the reciprocal (TE's order)."""
    policy = recipe.activations if tensor in FORWARD else recipe.gradients
    spec = fp8_spec(policy.format)
    hp = [t.float() for t in tensors]
    if scale is None:
        amax = torch.stack([t.abs().max() for t in hp]).max()
        scale = torch.tensor(spec.max, dtype=torch.float32) / amax
    return tuple((t * scale).clamp(-spec.max, spec.max).to(spec.dtype).float().mul(torch.reciprocal(scale))
                 .to(src.dtype) for t, src in zip(hp, tensors))


def heads(t: torch.Tensor) -> torch.Tensor:
    """[s, b, heads, hn] -> [b * heads, s, hn] in float64 (Megatron-Core's batched layout)."""
    return t.double().permute(1, 2, 0, 3).reshape(B * HEADS, t.shape[0], HN)


def check_against_reference(recipe: Recipe, module, q, k, v, dy, scales: dict | None = None):
    """Run the emulated attention and walk the reference chain; returns the emulation's (out, dq, dk, dv)."""
    scales = scales or {}
    (out, dq, dk, dv), seen = run(module, q, k, v, dy)
    assert list(seen) == [*FORWARD, *BACKWARD]
    for tensor, (hp, fq) in seen.items():  # every quantization: exactly the independent one of the same input
        expected = ref_fake_quant(hp, recipe, tensor, scales.get(tensor))
        assert all(torch.equal(a, b) for a, b in zip(fq, expected)), tensor
        assert any(not torch.equal(a, b) for a, b in zip(fq, hp)), f"{tensor}: the quantization changed nothing"

    def close(got, ref, tol, what):
        worst = (got.double() - ref).abs() - tol
        assert bool((worst <= 0).all()), f"{what}: off by up to {float(worst.max()):.3g} beyond float32's bound"

    # forward: QKV are the inputs, K and V expanded to every query head (GQA), as TE quantizes them
    (q_hp, k_hp, v_hp), (q8, k8, v8) = seen["QKV"]
    expand = HEADS // GROUPS
    assert torch.equal(q_hp, q) and torch.equal(k_hp, k.repeat_interleave(expand, 2))
    assert torch.equal(v_hp, v.repeat_interleave(expand, 2))
    q8, k8, v8 = heads(q8), heads(k8), heads(v8)
    softmax_scale = 1.0 / math.sqrt(HN)
    scores = q8 @ k8.transpose(1, 2) * softmax_scale
    scores_err = gamma(HN + 1) * (q8.abs() @ k8.abs().transpose(1, 2)) * softmax_scale
    causal = torch.triu(torch.ones(SQ, SQ, dtype=torch.bool), 1)
    probs = torch.softmax(scores.masked_fill(causal, -10000.0), -1)
    (p_hp,), (s8,) = seen["S"]
    # softmax's sensitivity: |dp_i| <= p_i * 2 max|ds|, plus float32's exp and sum over the row
    close(p_hp, probs, probs * (2 * scores_err.amax(-1, keepdim=True) + gamma(SQ + 4)) + 2.0**-126, "S")
    s8 = s8.double()
    context = s8 @ v8
    (o_hp,), (o8,) = seen["O"]
    to_sbh = lambda t: t.reshape(B, HEADS, SQ, HN).permute(2, 0, 1, 3).reshape(SQ, B, HEADS * HN)  # noqa: E731
    close(o_hp, to_sbh(context), to_sbh(gamma(SQ) * (s8.abs() @ v8.abs())) + 2.0**-126, "O")
    assert torch.equal(out, o8)

    # backward: dO is the gradient given, dS = dO V^T passes S's quantization, dP = P * (dS - sum(dS * P))
    (do_hp,), (do8,) = seen["dO"]
    assert torch.equal(do_hp, dy)
    do8 = do8.double().reshape(SQ, B, HEADS, HN).permute(1, 2, 0, 3).reshape(B * HEADS, SQ, HN)
    d_s = do8 @ v8.transpose(1, 2)
    d_s_err = gamma(HN) * (do8.abs() @ v8.abs().transpose(1, 2))
    p = p_hp.double()  # the softmax's backward reads its own float32 output
    d_p = p * (d_s - (d_s * p).sum(-1, keepdim=True))
    d_p_err = p * (d_s_err + (p * d_s_err).sum(-1, keepdim=True)) + \
        gamma(SQ + 3) * p * (d_s.abs() + (d_s * p).abs().sum(-1, keepdim=True))
    (dp_hp,), (dp8,) = seen["dP"]
    close(dp_hp.reshape(B * HEADS, SQ, SQ), d_p, d_p_err + 2.0**-140, "dP")
    dp8 = dp8.double().reshape(B * HEADS, SQ, SQ)
    d_q, d_k, d_v = dp8 @ k8 * softmax_scale, dp8.transpose(1, 2) @ q8 * softmax_scale, s8.transpose(1, 2) @ do8
    bounds = (gamma(SQ + 1) * (dp8.abs() @ k8.abs()) * softmax_scale,
              gamma(SQ + 1) * (dp8.abs().transpose(1, 2) @ q8.abs()) * softmax_scale,
              gamma(SQ) * (s8.abs().transpose(1, 2) @ do8.abs()))
    dqkv_hp, dqkv8 = seen["dQKV"]
    to_sbhd = lambda t: t.reshape(B, HEADS, SQ, HN).permute(2, 0, 1, 3)  # noqa: E731
    for name, got, ref, bound in zip(("dQ", "dK", "dV"), dqkv_hp, (d_q, d_k, d_v), bounds):
        close(got, to_sbhd(ref), to_sbhd(bound) + 2.0**-140, name)
    # the inputs' gradients: dQ as quantized; dK, dV summed over the query heads sharing a group (GQA)
    assert torch.equal(dq, dqkv8[0])
    for got, fq in ((dk, dqkv8[1]), (dv, dqkv8[2])):
        summed = fq.double().reshape(SQ, B, GROUPS, expand, HN).sum(3)
        close(got, summed, U * fq.double().abs().reshape(SQ, B, GROUPS, expand, HN).sum(3), "group sum")
    return out, dq, dk, dv


def relative_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_fp8_attention_equals_float64_reference_and_shows(megatron_cpu):
    recipe = fp8_attention_recipe("tensorwise")
    module = core_attention()
    precision, state = attached(module, recipe)
    assert precision.begin_step(0) == "fp8 w+a+g" and state.active
    q, k, v, dy = qkv_inputs(seed=1)
    fp8 = check_against_reference(recipe, module, q, k, v, dy)
    assert not state.scalers  # tensorwise: each tensor's own amax, nothing kept
    with precision.high_precision():  # Megatron-Core's own attention
        plain, seen = run(module, q, k, v, dy)
    assert not seen
    module._fp8_state = None
    assert all(torch.equal(a, b) for a, b in zip(run(module, q, k, v, dy)[0], plain))
    # E4M3 forward, E5M2 backward: an error of a few percent, as docs/facts.md measured on an H200
    errors = [relative_l2(a, b) for a, b in zip(fp8, plain)]
    assert all(0.005 < e < 0.3 for e in errors), errors


def test_delayed_fp8_attention_uses_the_scales_of_earlier_steps(megatron_cpu):
    recipe = fp8_attention_recipe("delayed")
    module = core_attention()
    precision, state = attached(module, recipe)
    assert set(state.scalers) == {*FORWARD, *BACKWARD}
    precision.begin_step(0)
    q, k, v, dy = qkv_inputs(seed=2)
    check_against_reference(recipe, module, q, k, v, dy, {t: torch.tensor(1.0) for t in state.scalers})
    amax = {t: float(sc.history[0]) for t, sc in state.scalers.items()}
    assert amax["QKV"] == float(torch.stack([q.abs().max(), k.abs().max(), v.abs().max()]).max())
    assert amax["dO"] == float(dy.abs().max())
    precision.after_optimizer_step(0)
    scales = {t: sc.scale.clone() for t, sc in state.scalers.items()}
    for t, sc in state.scalers.items():
        fmt = (recipe.activations if t in FORWARD else recipe.gradients).format
        assert torch.equal(sc.scale, torch.tensor(fp8_spec(fmt).max, dtype=torch.float32) / amax[t]), t
    # evaluation reads the scales but records nothing
    module.eval()
    run(module, q, k, v, dy)
    assert not any(sc.history[0] for sc in state.scalers.values())
    module.train()
    # step 1 with 4x larger tensors: quantized with step 0's scales
    precision.begin_step(1)
    check_against_reference(recipe, module, *qkv_inputs(seed=3, scale=4.0), scales)
    # state_dict round trip into a fresh controller
    fresh_precision, fresh = attached(core_attention(), recipe)
    fresh_precision.load_state_dict(precision.state_dict())
    for t, sc in state.scalers.items():
        assert torch.equal(fresh.scalers[t].scale, sc.scale) and torch.equal(fresh.scalers[t].history, sc.history)


# ---------------------------------------------------------------------------------------------------------------
# In a Megatron-Core GPTModel

MODEL = dict(num_layers=3, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
             seq_length=32, vocab_size=256, normalization="RMSNorm", activation="swiglu",
             position_embedding_type="rope")
SEED = 11
# delayed, staged: BF16 warmup 0-1, weights from 2, activations from 3, gradients from 4 (attention from 4, once
# activations and gradients both run FP8); layers 0 and 2 BF16, so only layer 1's attention ever runs FP8.
STAGED = dict(schedule={"bf16_warmup_steps": 2, "enable": {"weights": 2, "activations": 3, "gradients": 4}},
              layers={"bf16_first": 1, "bf16_last": 1})


def build(core_attention: bool = True, linears: bool = True):
    torch.manual_seed(SEED)
    kw = dict(column_linear=EmulatedColumnParallelLinear, row_linear=EmulatedRowParallelLinear) if linears else {}
    if core_attention:
        kw["core_attention"] = EmulatedDotProductAttention
    return build_gpt_model(MODEL, params_dtype=torch.bfloat16, device="cpu", **kw)


def forward_backward(model, seed: int = 0):
    """(loss per token, {param name: grad}) for one batch."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, 256, (2, 33), generator=g)
    model.zero_grad(set_to_none=True)
    loss = model(t[:, :-1], torch.arange(32).expand(2, 32), None, labels=t[:, 1:])
    loss.float().mean().backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def identical(a, b) -> bool:
    return torch.equal(a[0], b[0]) and a[1].keys() == b[1].keys() and all(torch.equal(a[1][n], b[1][n]) for n in a[1])


def test_fp8_attention_only_in_the_plans_layers_and_steps(megatron_cpu):
    recipe = fp8_attention_recipe("delayed", **STAGED)
    model = build()
    precision = attach_emulated_backend(model, PrecisionPlan(recipe, model_layout(model)))
    assert sorted(precision.attention) == [0, 1, 2]
    quantized: list[tuple[int, str]] = []
    for state in precision.attention.values():
        state.observer = lambda st, tensor, hp, fq: quantized.append((st.layer, tensor))
    # the same linears without the attention substitution, under the same recipe with attention: bf16
    linears_only = build(core_attention=False)
    reference = attach_emulated_backend(linears_only, PrecisionPlan(
        Recipe.from_dict({**recipe.to_dict(), "attention": "bf16"}), model_layout(linears_only)))
    plain = build(core_attention=False, linears=False)  # Megatron-Core's own layers
    for step in range(6):
        quantized.clear()
        stage = precision.begin_step(step)
        assert reference.begin_step(step) == stage
        ours, theirs = forward_backward(model, seed=step), forward_backward(linears_only, seed=step)
        attention_on = precision.plan.at(step).attention
        assert attention_on == (frozenset({1}) if step >= 4 else frozenset()), step
        assert sorted(quantized) == sorted((1, t) for t in (*FORWARD, *BACKWARD) if step >= 4), step
        assert identical(ours, theirs) is (step < 4), (step, stage)
        if step < 2:  # BF16 warmup: bit-identical to Megatron-Core's own model
            assert identical(ours, forward_backward(plain, seed=step)), step
        precision.after_optimizer_step(step)
        reference.after_optimizer_step(step)
    with precision.high_precision():
        assert identical(forward_backward(model, seed=9), forward_backward(plain, seed=9))


def test_fp8_forward_is_megatron_cores_forward(megatron_cpu, monkeypatch):
    """The forward the module runs with FP8 on is Megatron-Core's, step for step: with the quantization made the
    identity, it is bit-identical to Megatron-Core's own attention (a newer Megatron-Core that changes its forward
    fails here)."""
    recipe = fp8_attention_recipe("tensorwise")
    model, linears_only = build(), build(core_attention=False)
    precision = attach_emulated_backend(model, PrecisionPlan(recipe, model_layout(model)))
    reference = attach_emulated_backend(linears_only, PrecisionPlan(
        Recipe.from_dict({**recipe.to_dict(), "attention": "bf16"}), model_layout(linears_only)))
    precision.begin_step(0)
    reference.begin_step(0)
    theirs = forward_backward(linears_only)
    assert not identical(forward_backward(model), theirs)
    monkeypatch.setattr(EmulatedAttentionState, "quantized", lambda self, tensor, hp, record_amax: hp)
    assert identical(forward_backward(model), theirs)


def test_attention_fp8_needs_the_emulated_core_attention(megatron_cpu):
    model = build(core_attention=False)
    with pytest.raises(ValueError, match=r"core_attention=EmulatedDotProductAttention"):
        attach_emulated_backend(model, PrecisionPlan(fp8_attention_recipe("tensorwise"), model_layout(model)))


def test_delayed_attention_state_round_trips(megatron_cpu):
    recipe = fp8_attention_recipe("delayed", layers={"bf16_first": 1})
    model = build()
    precision = attach_emulated_backend(model, PrecisionPlan(recipe, model_layout(model)))
    for step in range(2):
        precision.begin_step(step)
        forward_backward(model, seed=10 + step)
        precision.after_optimizer_step(step)
    saved = precision.state_dict()
    names = {f"decoder.layers.{n}.self_attention.core_attention" for n in range(3)}
    assert set(saved["attention"]) == names
    layer1 = saved["attention"]["decoder.layers.1.self_attention.core_attention"]
    assert all(float(sd["scale"]) != 1.0 for sd in layer1.values())  # FP8 there: real amaxes, real scales
    layer0 = saved["attention"]["decoder.layers.0.self_attention.core_attention"]
    assert all(float(sd["scale"]) == 1.0 and not sd["history"].any() for sd in layer0.values())  # bf16_first
    fresh_model = build()
    fresh = attach_emulated_backend(fresh_model, PrecisionPlan(recipe, model_layout(fresh_model)))
    precision.begin_step(2)
    fresh.begin_step(2)
    assert not identical(forward_backward(model, seed=20), forward_backward(fresh_model, seed=20))
    fresh.load_state_dict(saved)
    assert identical(forward_backward(model, seed=20), forward_backward(fresh_model, seed=20))
    assert "attention" not in attach_emulated_backend(build(), PrecisionPlan(
        Recipe.from_dict(load_recipe_dict("delayed")), model_layout(model))).state_dict()


# ---------------------------------------------------------------------------------------------------------------
# Through the training run

STEPS, SAVED = 4, 2


def train_run(run_dir, dataset, *extra: str, steps: int = STEPS) -> dict:
    from fp8_recipes.rundir import read_metrics
    from fp8_recipes.training.run import run_training

    overrides = [o for o in small_run(run_dir, steps=steps) if not o.startswith("trainer.save_checkpoints=")]
    overrides += ["+recipe=delayed", "++recipe.attention=fp8", f"trainer.save_interval={SAVED}", *dataset, *extra]
    with pytest.MonkeyPatch.context() as mp:
        for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS"):
            mp.delenv(var, raising=False)
        run_training(compose_train(overrides))
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in read_metrics(run_dir, "train")}


def test_resumed_run_with_delayed_fp8_attention_is_bit_exact(dataset, tmp_path):
    import shutil

    from fp8_recipes.training.checkpoint import read_checkpoint

    full = train_run(tmp_path / "full", dataset)
    assert sorted(full) == list(range(1, STEPS + 1)) and all(math.isfinite(v[0]) for v in full.values())
    assert "core attention" in (tmp_path / "full" / "plan.txt").read_text()
    ckpt = tmp_path / "full" / "checkpoints" / f"step_{SAVED}"
    attention = read_checkpoint(ckpt)["precision"]["attention"]
    assert any(float(sd["history"].abs().sum()) > 0 for per in attention.values() for sd in per.values())
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(ckpt, resumed_dir / "checkpoints" / f"step_{SAVED}")
    (resumed_dir / "checkpoints" / "latest").write_text(f"step_{SAVED}\n")
    resumed = train_run(resumed_dir, dataset, "trainer.resume=auto")
    assert resumed == {s: full[s] for s in range(SAVED + 1, STEPS + 1)}  # loss and grad norm, bit for bit


def test_train_script_with_fp8_attention(dataset, tmp_path):
    args = ["scripts/train.py", "+recipe=tensorwise", "++recipe.attention=fp8", *small_run(tmp_path, steps=3),
            *dataset]
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "core attention (softmax(Q K^T) V): fp8 in layers 0-1" in proc.stdout
    from fp8_recipes.rundir import read_metrics

    losses = [r["loss"] for r in read_metrics(tmp_path, "train")]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), losses
