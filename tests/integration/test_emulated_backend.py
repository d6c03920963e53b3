"""The emulated FP8 backend: its GEMMs against a float64 reference of the same quantized math, and in a real
Megatron-Core GPTModel: BF16 stages bit-identical to Megatron-Core's own linears, the plan's BF16 modules left
alone, staged enablement switching operand roles at exactly the enable steps, delayed-scaling state.

The reference quantizes as the module docstring of ``fp8_recipes.backends.emulated`` says:

    fprop  y  = q(x, activations) @ q(w, weights)^T
    dgrad  dx = q(dy, gradients) @ q(w, weights, columnwise)
    wgrad  dw = q(dy, gradients, columnwise)^T @ q(x, activations, columnwise)
"""

from __future__ import annotations

import pytest
import torch
from megatron.core.tensor_parallel import ColumnParallelLinear

from fp8_recipes.backends.emulated import EmulatedLinearState, EmulatedPrecision, emulated_linear
from fp8_recipes.megatron.emulated_layers import (
    EmulatedColumnParallelLinear, EmulatedRowParallelLinear, attach_emulated_backend,
)
from fp8_recipes.megatron.model import build_gpt_model, model_layout, named_linear_modules
from fp8_recipes.numerics import fake_quant, fp8_spec
from fp8_recipes.plan.precision import Gemm, ModelLayout, PrecisionPlan
from fp8_recipes.recipe.pack import load_recipe, load_recipe_dict
from fp8_recipes.recipe.schema import Recipe, Role, Scaling

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

W, A, G = Role.WEIGHTS, Role.ACTIVATIONS, Role.GRADIENTS
FPROP, DGRAD, WGRAD = Gemm.FPROP, Gemm.DGRAD, Gemm.WGRAD
# Written out rather than taken from the plan module, so that a change there is caught here.
OPERANDS = {FPROP: (A, W), DGRAD: (G, W), WGRAD: (G, A)}
ALL_SIX = {(g, r) for g, roles in OPERANDS.items() for r in roles}


# ---------------------------------------------------------------------------------------------------------------
# One emulated GEMM against a float64 reference


def recipe_from(base: str | None = None, **roles) -> Recipe:
    data = load_recipe_dict(base) if base else {"name": "test"}
    data.update(roles)
    return Recipe.from_dict(data)


MODES = {
    "tensorwise": recipe_from("tensorwise"),
    "delayed": recipe_from("delayed"),
    "blockwise": recipe_from("blockwise"),  # 128x128 weights, 1x128 activations and gradients
    "mxfp8": recipe_from("mxfp8"),
    "hybrid": recipe_from("hybrid"),  # mxfp8 weights, 1x128 activations, tensorwise E5M2 gradients (reused)
    # non-square blocks smaller than the tensor: rowwise and columnwise copies differ for every operand
    "small-blocks": recipe_from(weights={"scaling": "blockwise", "block": [16, 32], "pow2_scales": False},
                                activations={"scaling": "blockwise", "block": [1, 32], "margin": 1},
                                gradients={"scaling": "blockwise", "block": [8, 16]}),
    "mxfp8-floor-e5m2": recipe_from(weights={"scaling": "mxfp8", "mx_rounding": "floor"},
                                    activations={"scaling": "mxfp8", "mx_rounding": "floor"},
                                    gradients={"scaling": "mxfp8", "format": "e5m2"}),
    "delayed-mxfp8-blockwise": recipe_from(weights="delayed", activations="mxfp8", gradients="blockwise"),
    "tensorwise-pow2-margin": recipe_from(weights={"scaling": "tensorwise", "pow2_scales": True, "margin": 2},
                                          activations={"scaling": "tensorwise", "amax_epsilon": 1e-3},
                                          gradients={"scaling": "tensorwise", "format": "e4m3"}),
    "weights-only": recipe_from(weights="tensorwise"),  # activations and gradients stay high precision
}
NAME = "decoder.layers.0.mlp.linear_fc1"


def controller(recipe: Recipe) -> tuple[EmulatedPrecision, EmulatedLinearState]:
    state = EmulatedLinearState(NAME)
    return EmulatedPrecision(PrecisionPlan(recipe, ModelLayout(1, (NAME,))), {NAME: state}), state


def operands(seed: int, scale: float = 1.0):
    """x [3, 50, 160], w [136, 160], dy [3, 50, 136]: 150 tokens, and no dimension a multiple of every block
    (partial edge blocks); rows and columns of very different magnitudes, so that where the blocks lie matters."""
    g = torch.Generator().manual_seed(seed)

    def spread(*shape):
        return torch.exp(torch.randn(*shape, generator=g))

    x = torch.randn(3, 50, 160, generator=g) * spread(3, 50, 1) * spread(160) * scale
    w = torch.randn(136, 160, generator=g) * spread(136, 1) * spread(160) * 0.05 * scale
    dy = torch.randn(3, 50, 136, generator=g) * spread(3, 50, 1) * spread(136) * 1e-3 * scale
    return x, w, dy


def run_emulated(state, x, w, dy):
    x = x.clone().requires_grad_()
    w = w.clone().requires_grad_()
    y = emulated_linear(x, w, state)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


def ref_quant(t: torch.Tensor, recipe: Recipe, role: Role, columnwise: bool, delayed_scale=None) -> torch.Tensor:
    """t as the FP8 GEMM reads it, then float64. Delayed scaling: the scale from earlier steps, TE's rule."""
    policy = recipe.policy(role)
    if not policy.is_fp8:
        return t.double()
    if policy.scaling is Scaling.DELAYED:
        spec = fp8_spec(policy.format)
        codes = (t.float() * delayed_scale).clamp(-spec.max, spec.max).to(spec.dtype)
        return (codes.float() * torch.reciprocal(delayed_scale)).double()  # dequantize: float32 multiply
    return fake_quant(t.float(), policy, columnwise=columnwise).double()


def reference(recipe: Recipe, x, w, dy, scales=None, wrong_orientation: bool = False):
    """(y, dx, dw) and the bound matrices |A| @ |B| of each GEMM, in float64."""
    scales = scales or {}
    x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    col = not wrong_orientation  # the negative control quantizes the backward operands rowwise instead

    def q(t, role, columnwise):
        return ref_quant(t, recipe, role, columnwise, scales.get(role))

    pairs = {
        FPROP: (q(x2, A, False), q(w, W, False).t()),
        DGRAD: (q(dy2, G, False), q(w, W, col)),
        WGRAD: (q(dy2, G, col).t(), q(x2, A, col)),
    }
    out = {g: a @ b for g, (a, b) in pairs.items()}
    bound = {g: a.abs() @ b.abs() for g, (a, b) in pairs.items()}
    return out, bound


def gamma(k: int) -> float:
    """Worst-case relative error of a float32 dot product of k terms, whatever the summation order:
    |fl(a.b) - a.b| <= gamma_k * |a|.|b| with gamma_k = k u / (1 - k u), u = 2^-24 (Higham, Thm 3.1)."""
    u = 2.0**-24
    return k * u / (1 - k * u)


def within_bound(got: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, k: int) -> bool:
    # The operands are identical (both sides quantize to the same float32 values), so the only difference is
    # float32 accumulation in the emulated GEMM against exact-enough float64: the bound above, plus float32's
    # smallest subnormal for products that underflow.
    return bool(((got.double().reshape(ref.shape) - ref).abs() <= gamma(k) * bound + 2.0**-149).all())


def check_against_reference(recipe, state, x, w, dy, scales=None):
    y, dx, dw = run_emulated(state, x, w, dy)
    ref, bound = reference(recipe, x, w, dy, scales)
    k = {FPROP: x.shape[-1], DGRAD: dy.shape[-1], WGRAD: x.numel() // x.shape[-1]}
    got = {FPROP: y.reshape(-1, y.shape[-1]), DGRAD: dx.reshape(-1, dx.shape[-1]), WGRAD: dw}
    for gemm in Gemm:
        worst = (got[gemm].double() - ref[gemm]).abs().max()
        assert within_bound(got[gemm], ref[gemm], bound[gemm], k[gemm]), (gemm, worst)
    # and the quantization did something: float64 GEMMs of the unquantized operands are farther away than the bound
    hp, hp_bound = reference(recipe_from(), x, w, dy)
    for gemm, (a, b) in OPERANDS.items():
        if recipe.policy(a).is_fp8 or recipe.policy(b).is_fp8:
            assert not within_bound(got[gemm], hp[gemm], hp_bound[gemm], k[gemm]), gemm
    return y, dx, dw


@pytest.mark.parametrize("mode", [m for m, r in MODES.items()
                                  if Scaling.DELAYED not in {r.policy(x).scaling for x in Role}])
def test_emulated_gemms_equal_float64_reference(mode):
    recipe = MODES[mode]
    precision, state = controller(recipe)
    assert precision.begin_step(0) == "fp8 " + "+".join(r.value[0] for r in Role if recipe.policy(r).is_fp8)
    x, w, dy = operands(seed=1)
    y, dx, dw = check_against_reference(recipe, state, x, w, dy)
    assert y.dtype == dx.dtype == dw.dtype == torch.float32
    assert y.shape == (3, 50, 136) and dx.shape == x.shape and dw.shape == w.shape


@pytest.mark.parametrize("mode", ["delayed", "delayed-mxfp8-blockwise"])
def test_delayed_gemms_use_the_scale_of_earlier_steps(mode):
    recipe = MODES[mode]
    delayed_roles = [r for r in Role if recipe.policy(r).scaling is Scaling.DELAYED]
    precision, state = controller(recipe)
    precision.begin_step(0)
    x1, w, dy1 = operands(seed=2)
    # step 0: no history yet, every delayed scale is 1
    check_against_reference(recipe, state, x1, w, dy1, {r: torch.tensor(1.0) for r in delayed_roles})
    precision.after_optimizer_step(0)
    scales = {r: state.scalers[r].scale.clone() for r in delayed_roles}
    assert all(float(s) != 1.0 for s in scales.values())
    # step 1 with 8x larger tensors: quantized with step 0's scales, not with scales from their own amax
    precision.begin_step(1)
    x2, w2, dy2 = operands(seed=3, scale=8.0)
    y, dx, dw = check_against_reference(recipe, state, x2, w2, dy2, scales)
    current = {r: fp8_spec(recipe.policy(r).format).max / {W: w2, A: x2, G: dy2}[r].abs().max()
               for r in delayed_roles}
    ref_now, bound = reference(recipe, x2, w2, dy2, current)
    assert not within_bound(y.reshape(-1, 136), ref_now[FPROP], bound[FPROP], 160)


@pytest.mark.parametrize("mode", ["mxfp8", "hybrid", "small-blocks", "blockwise"])
def test_reference_tells_rowwise_from_columnwise(mode):
    """Negative control: the bound is tight enough that quantizing the backward operands along the wrong
    dimension fails it (blocks that are not per-tensor lie differently in the two copies)."""
    recipe = MODES[mode]
    precision, state = controller(recipe)
    precision.begin_step(0)
    x, w, dy = operands(seed=4)
    y, dx, dw = run_emulated(state, x, w, dy)
    wrong, bound = reference(recipe, x, w, dy, wrong_orientation=True)
    wrong_backward = [not within_bound(dx.reshape(-1, 160), wrong[DGRAD], bound[DGRAD], 136),
                      not within_bound(dw, wrong[WGRAD], bound[WGRAD], 150)]
    # 128x128 weight blocks cover the whole 136x160 weight either way: only wgrad's 1x128 blocks can tell
    assert wrong_backward == ([False, True] if mode == "blockwise" else [True, True])


def test_bf16_plan_and_high_precision_leave_the_gemm_alone():
    recipe = recipe_from("tensorwise", layers={"bf16_modules": ["*.linear_fc1"]})
    precision, state = controller(recipe)
    precision.begin_step(0)
    assert not state.plan.any_fp8
    x, w, dy = operands(seed=5)
    plain = run_emulated(EmulatedLinearState("plain"), x, w, dy)  # no plan at all: high precision
    assert all(torch.equal(a, b) for a, b in zip(run_emulated(state, x, w, dy), plain))
    fp8_precision, fp8_state = controller(MODES["tensorwise"])
    fp8_precision.begin_step(0)
    assert not torch.equal(run_emulated(fp8_state, x, w, dy)[0], plain[0])
    with fp8_precision.high_precision():
        assert all(torch.equal(a, b) for a, b in zip(run_emulated(fp8_state, x, w, dy), plain))
    assert not torch.equal(run_emulated(fp8_state, x, w, dy)[0], plain[0])  # back on after the context


# ---------------------------------------------------------------------------------------------------------------
# In a Megatron-Core GPTModel

MODEL = dict(num_layers=3, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
             seq_length=32, vocab_size=256, normalization="RMSNorm", activation="swiglu",
             position_embedding_type="rope")
SEED = 11
# safe, rescheduled for a few steps: BF16 warmup 0-1, weights from 2, activations from 4, gradients from 6;
# layers 0 and 2 and the LM head BF16 (safe's rules), and one module of layer 1 by an extra pattern.
STAGED = Recipe.from_dict({**load_recipe_dict("safe"),
                           "schedule": {"bf16_warmup_steps": 2, "enable": {"weights": 2, "activations": 4,
                                                                           "gradients": 6}},
                           "layers": {"bf16_first": 1, "bf16_last": 1,
                                      "bf16_modules": ["output_layer", "decoder.layers.1.mlp.linear_fc2"]}})
FP8_MODULES = {f"decoder.layers.1.{m}" for m in ("self_attention.linear_qkv", "self_attention.linear_proj",
                                                  "mlp.linear_fc1")}
EXPECTED_STAGES = {0: ("bf16 warmup", set()), 1: ("bf16 warmup", set()),
                   2: ("fp8 w", {(FPROP, W), (DGRAD, W)}), 3: ("fp8 w", {(FPROP, W), (DGRAD, W)}),
                   4: ("fp8 w+a", {(FPROP, W), (DGRAD, W), (FPROP, A), (WGRAD, A)}),
                   5: ("fp8 w+a", {(FPROP, W), (DGRAD, W), (FPROP, A), (WGRAD, A)}),
                   6: ("fp8 w+a+g", ALL_SIX), 7: ("fp8 w+a+g", ALL_SIX)}


def batch(seed: int = 0, b: int = 2):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, 256, (b, 33), generator=g)
    return t[:, :-1], torch.arange(32).expand(b, 32), t[:, 1:]


def build(emulated: bool, cfg: dict = MODEL, dtype=torch.bfloat16):
    torch.manual_seed(SEED)
    kw = dict(column_linear=EmulatedColumnParallelLinear, row_linear=EmulatedRowParallelLinear) if emulated else {}
    return build_gpt_model(cfg, params_dtype=dtype, device="cpu", **kw)


def forward_backward(model, seed: int = 0):
    """(logits, loss, {param name: grad}) for one batch."""
    tokens, pos, labels = batch(seed)
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        logits = model(tokens, pos, None)
    loss = model(tokens, pos, None, labels=labels).float().mean()
    loss.backward()
    return logits, loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def identical(a, b) -> bool:
    la, lossa, ga = a
    lb, lossb, gb = b
    return torch.equal(la, lb) and torch.equal(lossa, lossb) and ga.keys() == gb.keys() and all(
        torch.equal(ga[n], gb[n]) for n in ga)


@pytest.fixture
def staged_model(megatron_cpu):
    model = build(emulated=True)
    plan = PrecisionPlan(STAGED, model_layout(model))
    return model, attach_emulated_backend(model, plan)


def test_bf16_stage_is_bit_identical_to_megatron_core(megatron_cpu, staged_model):
    model, precision = staged_model
    plain = build(emulated=False)
    assert type(dict(named_linear_modules(plain))["output_layer"]) is ColumnParallelLinear
    assert all(isinstance(m, (EmulatedColumnParallelLinear, EmulatedRowParallelLinear))
               for _, m in named_linear_modules(model))
    reference_ = forward_backward(plain)
    assert precision.begin_step(0) == "bf16 warmup"
    assert identical(forward_backward(model), reference_)
    assert precision.begin_step(6) == "fp8 w+a+g"
    fp8 = forward_backward(model)
    assert not torch.equal(fp8[0], reference_[0]) and not torch.equal(fp8[1], reference_[1])
    qkv = "module.decoder.layers.1.self_attention.linear_qkv.weight"
    assert not torch.equal(fp8[2][qkv], reference_[2][qkv])
    with precision.high_precision():  # full-precision evaluation at an FP8 stage: Megatron-Core's own path
        assert identical(forward_backward(model), reference_)
    assert torch.equal(forward_backward(model)[0], fp8[0])  # and FP8 again afterwards, deterministically


def test_whole_model_bf16_recipe_is_bit_identical_in_fp32_too(megatron_cpu):
    model = build(emulated=True, dtype=torch.float32)
    precision = attach_emulated_backend(model, PrecisionPlan(load_recipe("bf16"), model_layout(model)))
    assert precision.begin_step(0) == "bf16"
    assert identical(forward_backward(model), forward_backward(build(emulated=False, dtype=torch.float32)))


def test_observer_sees_the_plans_operands_and_stages_switch_at_the_enable_steps(megatron_cpu, staged_model):
    model, precision = staged_model
    modules = dict(named_linear_modules(model))
    calls: list[tuple[str, Gemm, Role, torch.Tensor, torch.Tensor]] = []
    for state in precision.states.values():
        state.observer = lambda st, gemm, role, hp, fq, q=None: calls.append((st.name, gemm, role, hp, fq))

    # a forward hook on every linear: is its output exactly Megatron-Core's unquantized GEMM of its input?
    unquantized: dict[str, bool] = {}

    def hook(name):
        def fn(module, inputs, output):
            unquantized[name] = torch.equal(output[0], torch.matmul(inputs[0], module.weight.t()))
        return fn

    for name, module in modules.items():
        module.register_forward_hook(hook(name))

    bf16_modules = set(modules) - FP8_MODULES
    assert {n for n, mp in precision.plan.at(7).modules.items() if mp.bf16_reason} == bf16_modules
    for step, (stage, expected) in EXPECTED_STAGES.items():
        calls.clear()
        assert precision.begin_step(step) == stage
        forward_backward(model, seed=step)
        assert not {c[0] for c in calls} & bf16_modules, f"step {step}: a BF16 module was quantized"
        for name in FP8_MODULES:
            seen = {(g, r) for n, g, r, _, _ in calls if n == name}
            assert seen == expected, (step, name)
            # each operand once per GEMM: forward_backward runs two forwards (logits, loss) and one backward
            assert sorted((g, r) for n, g, r, _, _ in calls if n == name) == sorted(
                [(g, r) for g, r in expected for _ in range(2 if g is FPROP else 1)]), (step, name)
        for name in modules:  # a module with no FP8 GEMM at this step runs Megatron-Core's GEMM untouched
            assert unquantized[name] is (name in bf16_modules or not expected), (step, name)
        for name, gemm, role, hp, fq in calls:
            weight = modules[name].weight
            if role is W:
                assert hp is weight or torch.equal(hp, weight)
            else:  # activations are read along in_features, gradients along out_features
                assert hp.shape[-1] == weight.shape[1 if role is A else 0], (name, gemm, role)
            assert fq.shape == hp.shape and fq.dtype == hp.dtype == torch.bfloat16
            assert not torch.equal(fq, hp), (name, gemm, role)


# ---------------------------------------------------------------------------------------------------------------
# Delayed scaling state


def amax_recorder(precision):
    amax: dict[tuple[str, Role], torch.Tensor] = {}

    def observe(state, gemm, role, hp, fq, q=None):
        key = (state.name, role)
        a = hp.detach().float().abs().max()
        amax[key] = torch.maximum(amax[key], a) if key in amax else a

    for state in precision.states.values():
        state.observer = observe
    return amax


def test_delayed_scales_follow_the_observed_amax_and_round_trip(megatron_cpu):
    cfg = {**MODEL, "num_layers": 2}
    recipe = Recipe.from_dict({**load_recipe_dict("delayed"), "weights": {"scaling": "delayed", "amax_history_len": 4}})
    model = build(emulated=True, cfg=cfg)
    precision = attach_emulated_backend(model, PrecisionPlan(recipe, model_layout(model)))
    history: dict[tuple[str, Role], list[torch.Tensor]] = {}
    for step in range(2):
        amax = amax_recorder(precision)
        precision.begin_step(step)
        forward_backward(model, seed=10 + step)
        precision.after_optimizer_step(step)
        for key, a in amax.items():
            history.setdefault(key, []).append(a)
        fp8 = set(precision.states) - {"output_layer"}  # the LM head is BF16 (fp8_output_layer: false)
        assert {name for name, _ in amax} == fp8 and {role for _, role in amax} == set(Role)
        for name, state in precision.states.items():
            for role, scaler in state.scalers.items():
                if name not in fp8:  # never quantized: no amax, the scale stays 1
                    assert float(scaler.scale) == 1.0 and not scaler.history.any()
                    continue
                fp8_max = torch.tensor(fp8_spec(recipe.policy(role).format).max)  # 448 (E4M3), 57344 (E5M2)
                expected = fp8_max / torch.stack(history[(name, role)]).max()  # history max over both steps
                assert torch.equal(scaler.scale, expected), (step, name, role)
                assert precision.scales()[name][str(role)] == float(expected)
    assert precision.scales()["decoder.layers.0.self_attention.linear_qkv"]["weights"] == pytest.approx(
        448.0 / max(float(a) for a in history[("decoder.layers.0.self_attention.linear_qkv", W)]))

    # state_dict -> load_state_dict into a fresh controller of a fresh model
    saved = precision.state_dict()
    fresh_model = build(emulated=True, cfg=cfg)
    fresh = attach_emulated_backend(fresh_model, PrecisionPlan(recipe, model_layout(fresh_model)))
    assert fresh.scales() != precision.scales()
    fresh.load_state_dict(saved)
    assert fresh.scales() == precision.scales()
    again = fresh.state_dict()
    assert again.keys() == saved.keys() and again["scalers"].keys() == saved["scalers"].keys()
    for name, per_role in saved["scalers"].items():
        for role, sd in per_role.items():
            assert all(torch.equal(sd[k], again["scalers"][name][role][k]) for k in ("history", "scale"))
    # the loaded state drives the next step exactly as the original does
    precision.begin_step(2)
    fresh.begin_step(2)
    assert identical(forward_backward(model, seed=20), forward_backward(fresh_model, seed=20))


def test_fp8_lm_head_with_tied_embeddings(megatron_cpu):
    """fp8_output_layer with tied embeddings: the LM head's GEMM quantizes its input (activations) and the word
    embedding it is handed as its weight (weights), and its weight gradient reaches the embedding."""
    cfg = {**MODEL, "num_layers": 2, "share_embeddings_and_output_weights": True}
    recipe = Recipe.from_dict({**load_recipe_dict("tensorwise"), "layers": {"fp8_output_layer": True}})
    model = build(emulated=True, cfg=cfg)
    gpt = model.module
    assert gpt.output_layer.weight is None  # tied: Megatron-Core hands the head the embedding at each call
    precision = attach_emulated_backend(model, PrecisionPlan(recipe, model_layout(model)))
    assert precision.plan.at(0).modules["output_layer"].any_fp8
    seen = {}
    gpt.output_layer.register_forward_pre_hook(lambda m, args, kwargs: seen.update(x=args[0], w=kwargs["weight"]),
                                               with_kwargs=True)
    precision.begin_step(0)
    logits, _, grads = forward_backward(model)
    emb = gpt.embedding.word_embeddings.weight
    assert seen["w"] is emb
    x = seen["x"].detach()
    expected = fake_quant(x, recipe.policy(A)) @ fake_quant(emb.detach(), recipe.policy(W)).t()  # [s, b, vocab]
    assert torch.equal(logits, expected.transpose(0, 1))  # the model returns [b, s, vocab]
    assert not torch.equal(expected, x @ emb.detach().t())  # the quantization shows
    # the same model with a BF16 head: same logits only where FP8 is off, and another embedding gradient
    plain = build(emulated=True, cfg=cfg)
    bf16_head = attach_emulated_backend(plain, PrecisionPlan(
        Recipe.from_dict(load_recipe_dict("tensorwise")), model_layout(plain)))
    bf16_head.begin_step(0)
    logits_bf16, _, grads_bf16 = forward_backward(plain)
    assert not torch.equal(logits, logits_bf16)
    key = next(n for n in grads if n.endswith("word_embeddings.weight"))
    assert grads[key].abs().sum() > 0 and not torch.equal(grads[key], grads_bf16[key])


def test_replan_carries_resizes_and_drops_the_delayed_state():
    """A plan changed between steps (the autopilot's): fc1's activations move to a 4-step history (the 3 newest
    amaxes kept and the scale taken from them, so an older, larger amax no longer sets it), fc2's gradients to
    tensorwise (their scaler dropped); every other scaler is the same object, history and scale untouched."""
    names = ("decoder.layers.0.mlp.linear_fc1", "decoder.layers.0.mlp.linear_fc2")
    layout, base = ModelLayout(1, names), recipe_from("delayed")
    states = {n: EmulatedLinearState(n) for n in names}
    prec = EmulatedPrecision(PrecisionPlan(base, layout), states)
    for state in states.values():
        for scaler in state.scalers.values():
            n = scaler.history.numel()
            scaler.history.copy_(torch.linspace(1.0, 2.0, n))
            scaler.history[n // 2] = 100.0  # an old outlier, far outside a 4-step window
            scaler.history[0] = 0.0
            scaler.scale = torch.tensor(448.0 / 100.0)
    before = {(n, r): s for n, st in states.items() for r, s in st.scalers.items()}
    old_fc1 = before[(names[0], A)].history.clone()
    short = {**base.policy(A).to_dict(), "amax_history_len": 4}
    patched = Recipe.from_dict({**base.to_dict(), "modules": {
        names[0]: {"activations": short},
        names[1]: {"gradients": {"scaling": "tensorwise", "format": "e5m2"}}}})
    prec.replan(PrecisionPlan(patched, layout))
    fc1 = states[names[0]].scalers[A]
    assert fc1.history.numel() == 4 and torch.equal(fc1.history[1:], old_fc1[-3:]) and fc1.history[0] == 0
    assert torch.isclose(fc1.scale, torch.tensor(448.0 / 2.0))  # max of the kept amaxes (2.0), not the outlier
    assert G not in states[names[1]].scalers
    kept = {k: s for k, s in before.items() if k not in ((names[0], A), (names[1], G))}
    assert all(states[n].scalers[r] is s for (n, r), s in kept.items()) and kept
    prec.begin_step(3)
    assert states[names[1]].plan.gemms[DGRAD].policy(G).scaling is Scaling.TENSORWISE
    with pytest.raises(ValueError, match="same model layout"):
        prec.replan(PrecisionPlan(patched, ModelLayout(1, names[:1])))
