"""backends/te_observe.py without a GPU: the hooks hand the recorder every operand of a linear's three GEMMs, the
tensor the GEMM reads (a LayerNormLinear's normalised input), and the recorder measures the plan's quantization of
it once per distinct copy. The same code on Transformer Engine modules, against TE's own GEMM output: tests/gpu/test_te_observe.py."""

from __future__ import annotations

import types

import pytest
import torch

from fp8_recipes.backends.te_observe import TEObservedLinear, _gemm_input
from fp8_recipes.numerics import fake_quant
from fp8_recipes.plan.precision import Hardware, ModelLayout, PrecisionPlan
from fp8_recipes.recipe.schema import Recipe, Role

NAME = "decoder.layers.0.mlp.linear_fc1"


class NormLinear(torch.nn.Module):
    """What the hooks need of TE's LayerNormLinear: RMSNorm parameters, `weight`, the `fp8` flag, (out, bias)."""

    def __init__(self, hidden=64, out=96):
        super().__init__()
        self.normalization, self.eps, self.zero_centered_gamma = "RMSNorm", 1e-5, False
        self.layer_norm_weight = torch.nn.Parameter(1 + 0.1 * torch.randn(hidden))
        self.weight = torch.nn.Parameter(0.05 * torch.randn(out, hidden))
        self.fp8 = True

    def forward(self, x):
        y = torch.nn.functional.rms_norm(x, x.shape[-1:], self.layer_norm_weight, self.eps)
        return y @ self.weight.t(), None


def observed(scaling: str):
    torch.manual_seed(0)
    recipe = Recipe.from_dict({"weights": scaling, "activations": scaling, "gradients": scaling})
    plan = PrecisionPlan(recipe, ModelLayout.gpt(1), Hardware())
    module = NormLinear()
    state = TEObservedLinear(NAME, module, lambda: plan.at(0))
    seen = []
    state.observer = lambda s, gemm, role, hp, fq, q=None: seen.append((str(gemm), str(role), hp, fq))
    x = torch.randn(8, 2, 64, requires_grad=True)
    module(x)[0].square().sum().backward()
    return plan.at(0).modules[NAME], module, x, seen


@pytest.mark.parametrize("scaling", ["tensorwise", "blockwise"])
def test_every_operand_of_the_three_gemms_is_observed_unquantized(scaling):
    plan, module, x, seen = observed(scaling)
    assert [(g, r) for g, r, _, _ in seen] == [("fprop", "activations"), ("fprop", "weights"), ("dgrad", "weights"),
                                               ("wgrad", "activations"), ("dgrad", "gradients"), ("wgrad", "gradients")]
    by = {(g, r): (hp, fq) for g, r, hp, fq in seen}
    normed = torch.nn.functional.rms_norm(x.detach(), (64,), module.layer_norm_weight.detach(), 1e-5)
    torch.testing.assert_close(by[("fprop", "activations")][0], normed)  # the GEMM's input, not the module's
    assert all(fq is None for _, fq in by.values())  # the recorder quantizes (measure(fq_x=None))
    for role in ("activations", "weights", "gradients"):  # both GEMMs of a role read the same tensor object
        first, second = (hp for (g, r), (hp, _) in by.items() if r == role)
        assert first is second, role


@pytest.mark.parametrize("scaling, measured", [("tensorwise", 3), ("blockwise", 5)])
def test_the_recorder_measures_each_distinct_copy_once(scaling, measured, tmp_path, monkeypatch):
    """Per-tensor copies are the same both ways (one measure per role); 1x128 activation and gradient blocks
    are not (128x1 for wgrad), 128x128 weight blocks are. Each row is the statistics of the policy's own
    quantization of the GEMM's tensor, as measure() of the numerics core's copy gives them."""
    from fp8_recipes.observe import recorder as recorder_mod
    from fp8_recipes.observe.config import DebugConfig
    from fp8_recipes.observe.stats import COLUMNWISE, measure

    calls = []
    monkeypatch.setattr(recorder_mod, "measure", lambda *a, **k: calls.append(a) or measure(*a, **k))
    torch.manual_seed(0)
    recipe = Recipe.from_dict({"weights": scaling, "activations": scaling, "gradients": scaling})
    plan = PrecisionPlan(recipe, ModelLayout.gpt(1), Hardware())
    module = NormLinear()
    state = TEObservedLinear(NAME, module, lambda: plan.at(0))
    state.record_amax = True
    seen = {}
    rec = recorder_mod.NumericsRecorder(DebugConfig.from_dict({"interval": 1}), tmp_path, tensorboard=False)
    rec.attach({NAME: state})
    rec.begin_step(0)
    real = state.observer
    state.observer = lambda s, g, r, hp, fq, q=None: seen.__setitem__((str(g), str(r)), hp) or real(s, g, r, hp, fq)
    x = torch.randn(8, 2, 64, requires_grad=True)
    module(x)[0].square().sum().backward()
    rows = dict(zip((k[1:] for k in rec._pending), recorder_mod.stats_rows(list(rec._pending.values()))))
    assert len(calls) == measured and len(rows) == 6
    mod_plan = plan.at(0).modules[NAME]
    for (gemm, role), hp in seen.items():
        policy = mod_plan.gemms[gemm].policy(Role(role))
        fq = fake_quant(hp, policy, columnwise=COLUMNWISE[(gemm, role)]).float()
        assert rows[(gemm, role)] == measure(hp, fq, policy, columnwise=COLUMNWISE[(gemm, role)]).row(), (gemm, role)


def test_nothing_is_observed_when_off_or_bf16_or_in_eval():
    plan, module, x, seen = observed("tensorwise")
    state = TEObservedLinear(NAME, module, lambda: plan)  # noqa: F841  (a second hook: observer None)
    n = len(seen)
    module.fp8 = False  # the module ran BF16 (a fallback, a BF16 stage): nothing was quantized
    module(x)[0].sum().backward()
    module.fp8 = True
    module.eval()
    module(x)
    assert len(seen) == n


def test_gemm_input_is_the_normalised_tensor():
    module = NormLinear()
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    ref = torch.nn.functional.rms_norm(x.float(), (64,), module.layer_norm_weight.detach(), 1e-5)
    assert _gemm_input(module, x).dtype is torch.bfloat16
    torch.testing.assert_close(_gemm_input(module, x), ref.bfloat16())
    torch.testing.assert_close(_gemm_input(module, x, fused=True), ref)  # delayed: TE casts the float32 result
    plain = types.SimpleNamespace()  # a Linear: no normalisation inside
    assert _gemm_input(plain, x) is not None and torch.equal(_gemm_input(plain, x), x)


@pytest.mark.parametrize("mode, reduced", [("column", "activations"), ("row", "gradients"), (None, None)])
def test_sequence_parallel_current_scaling_amaxes_are_reduced_as_te_reduces_them(mode, reduced, tmp_path,
                                                                                 monkeypatch):
    """Under sequence parallelism TE MAX-reduces the current-scaling amax of a column-parallel linear's input and
    of a row-parallel one's output gradient over the TP ranks (the operands it all-gathers in FP8): the recorder
    quantizes those with the reduced amax, the other roles (and every role without SP) with the rank's own."""
    import torch.distributed as dist

    from fp8_recipes.numerics import fp8_spec
    from fp8_recipes.observe import recorder as recorder_mod
    from fp8_recipes.observe.config import DebugConfig

    other_rank = 4.0  # the other TP rank's amax, 4x this one's
    calls = []
    monkeypatch.setattr(dist, "all_reduce", lambda t, op=None, group=None: calls.append(group) or t.mul_(other_rank))
    torch.manual_seed(0)
    plan = PrecisionPlan(Recipe.from_dict({"weights": "tensorwise", "activations": "tensorwise",
                                           "gradients": "tensorwise"}), ModelLayout.gpt(1), Hardware())
    module = NormLinear()
    tp_group = object()
    module.sequence_parallel, module.parallel_mode, module.tp_group = mode is not None, mode, tp_group
    state = TEObservedLinear(NAME, module, lambda: plan.at(0))
    rec = recorder_mod.NumericsRecorder(DebugConfig.from_dict({"interval": 1}), tmp_path, tensorboard=False)
    rec.attach({NAME: state})
    rec.begin_step(0)
    seen = {}
    real = state.observer
    state.observer = lambda s, g, r, hp, fq, q=None: seen.__setitem__(str(r), hp) or real(s, g, r, hp, fq)
    module(torch.randn(8, 2, 64, requires_grad=True))[0].square().sum().backward()
    rows = dict(zip(rec._pending, recorder_mod.stats_rows(list(rec._pending.values()))))
    e4m3, e5m2 = fp8_spec("e4m3").max, fp8_spec("e5m2").max
    for (_, gemm, role), row in rows.items():
        own = seen[role].abs().max().item()
        want = (e5m2 if role == "gradients" else e4m3) / (own * (other_rank if role == reduced else 1.0))
        assert row["scale"] == pytest.approx(want, rel=1e-6), (gemm, role, row["scale"], want)
    assert calls == ([tp_group] if reduced else []), calls  # one copy measured per role, reduced once


class Grouped(torch.nn.Module):
    """What the hooks need of TE's GroupedLinear (as Megatron-Core's TEGroupedLinear calls it): ``weight{e}`` per
    expert, the ``fp8`` flag, forward ``(x, m_splits) -> (out, bias)``, and TE's delayed slots (3 forward, 2
    backward per GEMM)."""

    def __init__(self, experts=3, hidden=32, out=48):
        super().__init__()
        for e in range(experts):
            self.register_parameter(f"weight{e}", torch.nn.Parameter(0.05 * torch.randn(out, hidden)))
        self.num_gemms, self.fp8 = experts, True
        self.fp8_meta = {"scaling_fwd": types.SimpleNamespace(scale=torch.arange(3.0 * experts) + 1,
                                                              amax_history=torch.zeros(4, 3 * experts)),
                         "scaling_bwd": types.SimpleNamespace(scale=torch.arange(2.0 * experts) + 100,
                                                              amax_history=torch.zeros(4, 2 * experts))}

    def forward(self, x, m_splits):
        outs = [xs @ getattr(self, f"weight{e}").t() for e, xs in enumerate(torch.split(x, m_splits))]
        return torch.cat(outs), None


def test_a_grouped_expert_linear_is_observed_per_expert():
    from fp8_recipes.backends.te_observe import te_observer_states
    from fp8_recipes.megatron.model_config import layout_of

    torch.manual_seed(0)
    cfg = {"num_layers": 1, "num_moe_experts": 3}
    recipe = Recipe.from_dict({"weights": "delayed", "activations": "delayed", "gradients": "delayed"})
    plan = PrecisionPlan(recipe, layout_of(cfg), Hardware("cuda", (9, 0), "2.20.2", "NVIDIA H200"))
    module = Grouped()
    grouped = "decoder.layers.0.mlp.experts.linear_fc1"
    rows = tuple(f"decoder.layers.0.mlp.experts.local_experts.{e}.linear_fc1" for e in range(3))
    precision = types.SimpleNamespace(linears={grouped: module}, rows={grouped: rows}, step_plan=plan.at(0))
    states = te_observer_states(precision)
    assert list(states) == list(rows)  # a state per expert, under the plan's rows
    seen = []
    for state in states.values():
        state.observer = lambda s, gemm, role, hp, fq, q=None: seen.append((s.name, str(gemm), str(role), hp))
    splits = [5, 0, 11]
    x = torch.randn(16, 32, requires_grad=True)
    module(x, splits)[0].square().sum().backward()
    experts = [n for n, *_ in seen]
    assert [(g, r) for n, g, r, _ in seen if n == rows[1]] == [("fprop", "weights"), ("dgrad", "weights")]  # no token
    assert experts.count(rows[0]) == experts.count(rows[2]) == 6  # three GEMMs x two operands each
    by = {(n, g, r): hp for n, g, r, hp in seen}
    torch.testing.assert_close(by[(rows[2], "fprop", "activations")], x.detach()[5:])
    assert by[(rows[2], "fprop", "weights")] is not None
    torch.testing.assert_close(by[(rows[2], "fprop", "weights")], module.weight2.detach())
    assert by[(rows[0], "dgrad", "gradients")].shape == (5, 48)
    # TE's slots of GEMM e: forward 3e (input), 3e+1 (weight); backward 2e (grad_output)
    assert float(states[rows[2]].scalers[Role.ACTIVATIONS].scale) == 7.0
    assert float(states[rows[2]].scalers[Role.WEIGHTS].scale) == 8.0
    assert float(states[rows[2]].scalers[Role.GRADIENTS].scale) == 104.0


@pytest.mark.parametrize("recipe, fused", [
    ({"weights": "delayed", "activations": "delayed", "gradients": "delayed"}, True),  # DelayedScaling
    # a CustomRecipe (E4M3 gradients at margin 16): its input quantizer is a DelayedScalingRequest's Float8Quantizer
    ({"weights": "delayed", "activations": "delayed",
      "gradients": {"scaling": "delayed", "format": "e4m3", "margin": 16}}, True),
    ({"weights": "delayed", "activations": "tensorwise", "gradients": "delayed"}, False),  # current-scaling input
    ({"weights": "tensorwise", "activations": "tensorwise", "gradients": "tensorwise"}, False),
])
def test_the_fused_norm_cast_follows_the_input_quantizer_not_the_recipe_class(recipe, fused, monkeypatch):
    """TE fuses a LayerNormLinear's norm with the FP8 cast (the float32 result cast straight to FP8) for a delayed
    input quantizer, whichever recipe class made it, unless a backward_override is set."""
    from fp8_recipes.backends import te_observe

    asked = []
    monkeypatch.setattr(te_observe, "_gemm_input", lambda module, x, fused=False: asked.append(fused) or x.detach())
    plan = PrecisionPlan(Recipe.from_dict(recipe), ModelLayout.gpt(1), Hardware("cuda", (9, 0), "2.20.2", "H200"))
    module = NormLinear()
    state = TEObservedLinear(NAME, module, lambda: plan.at(10**6))
    state.observer = lambda *a, **k: None
    module(torch.randn(8, 2, 64))
    assert asked == [fused], plan.at(10**6).modules[NAME].te.describe()
