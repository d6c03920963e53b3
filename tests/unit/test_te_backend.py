"""TEPrecision's wiring on the CPU, against a small fake of Transformer Engine's autocast semantics (the real TE
is exercised by tests/gpu): which autocast each layer and linear runs under at each step, the outer autocast of
delayed scaling (one amax reduction per forward), high-precision evaluation, the counters, weight-cache resets,
and delayed-scaling state put back from a checkpoint before the module's next FP8 forward."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from fp8_recipes.backends import te as te_backend
from fp8_recipes.backends.te import BF16, FP8, FP8_FWD, TEPrecision
from fp8_recipes.plan import Hardware, ModelLayout, PrecisionPlan
from fp8_recipes.schema import Recipe

H200 = Hardware("cuda", (9, 0), "2.20.2", "NVIDIA H200")
PER_LAYER = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")


class FakeTE:
    """TE's autocast as far as the backend relies on it: a stack of (enabled, recipe); amaxes are reduced when
    the outermost enabled autocast exits."""

    def __init__(self):
        self.stack: list[tuple[bool, object]] = []
        self.reductions = 0
        te = self

        class autocast:  # noqa: N801 (TE's name)
            def __init__(self, enabled=True, recipe=None, amax_reduction_group=None):
                self.args = (enabled, recipe)

            def __enter__(self):
                te.stack.append(self.args)

            def __exit__(self, *exc):
                enabled, _ = te.stack.pop()
                if enabled and not te.stack:
                    te.reductions += 1

        self.autocast = autocast

    def current(self) -> tuple[bool, object]:
        return self.stack[-1] if self.stack else (False, None)


class FakeLinear(torch.nn.Module):
    """Records what it ran under, like TE's modules: `fp8` and `fp8_meta["recipe"]` set by each forward."""

    def __init__(self, te: FakeTE, log: list, name: str):
        super().__init__()
        self.te, self.log, self.name = te, log, name
        self.fp8, self.fp8_meta, self.is_first_microbatch = False, {}, True

    def forward(self, x):
        self.fp8, recipe = self.te.current()
        if self.fp8:
            self.fp8_meta["recipe"] = recipe
        self.log.append((self.name, self.fp8, recipe))
        self.is_first_microbatch = False
        return x

    def init_fp8_meta_tensors(self, recipe):  # TE allocates delayed state here (fake: one quantizer per dir)
        for key in ("scaling_fwd", "scaling_bwd"):
            self.fp8_meta.setdefault(key, types.SimpleNamespace(scale=torch.ones(1), amax_history=torch.zeros(8, 1)))


class Layer(torch.nn.Module):
    def __init__(self, linears):
        super().__init__()
        self.linears = torch.nn.ModuleList(linears)

    def forward(self, x):
        for m in self.linears:
            x = m(x)
        return x


class Decoder(torch.nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.fixture
def fake_te(monkeypatch) -> FakeTE:
    fake = FakeTE()
    pkg, pt, common, recipe = (types.ModuleType(n) for n in ("transformer_engine", "transformer_engine.pytorch",
                                                               "transformer_engine.common",
                                                               "transformer_engine.common.recipe"))
    pt.autocast = fake.autocast
    recipe.Float8CurrentScaling = lambda: types.SimpleNamespace(name="off", backward_override=None)
    pkg.pytorch, pkg.common, common.recipe = pt, common, recipe
    for mod in (pkg, pt, common, recipe):
        monkeypatch.setitem(sys.modules, mod.__name__, mod)
    # the recipe objects: a tag per TERecipe, with the one attribute the counter reads
    monkeypatch.setattr(te_backend, "te_recipe", lambda choice, reduce_amax: types.SimpleNamespace(
        choice=choice, backward_override="high_precision" if choice.forward_only else None))
    return fake


def attach(fake: FakeTE, recipe: dict, layers: int = 3):
    plan = PrecisionPlan(Recipe.from_dict(recipe), ModelLayout.gpt(layers), H200)
    log: list = []
    linears = {f"decoder.layers.{i}.{m}": FakeLinear(fake, log, f"decoder.layers.{i}.{m}")
               for i in range(layers) for m in PER_LAYER}
    blocks = [Layer([linears[f"decoder.layers.{i}.{m}"] for m in PER_LAYER]) for i in range(layers)]
    decoder = Decoder(blocks)
    precision = TEPrecision(plan, layers=dict(enumerate(blocks)), linears=linears, chunks=[decoder])
    return precision, decoder, log


def step(precision, decoder, log, s: int, training: bool = True) -> dict[str, str]:
    """One forward at step `s`; returns what each linear ran: bf16 / fp8 / fp8 fwd."""
    precision.begin_step(s)
    log.clear()
    decoder.train(training)
    decoder(torch.zeros(1))
    return {n: BF16 if not on else (FP8_FWD if r.choice.forward_only else FP8) for n, on, r in log}


def staged(scaling: str, **layers) -> dict:
    return {"weights": scaling, "activations": scaling, "gradients": scaling, "layers": layers,
            "schedule": {"bf16_warmup_steps": 2, "enable": {"weights": 2, "activations": 4, "gradients": 6}}}


@pytest.mark.parametrize("scaling", ["tensorwise", "delayed"])
def test_each_step_runs_the_plan(fake_te, scaling):
    precision, decoder, log = attach(fake_te, staged(scaling, bf16_first=1))
    for s in range(8):
        reductions = fake_te.reductions
        ran = step(precision, decoder, log, s)
        want = BF16 if s < 4 else (FP8_FWD if s < 6 else FP8)
        assert ran == {n: BF16 if n.startswith("decoder.layers.0.") else want for n in ran}, s
        if scaling == "delayed" and s >= 4:  # one outer autocast: one reduction per forward, not one per layer
            assert fake_te.reductions == reductions + 1, s
    assert sum(precision.mismatches.values()) == 0
    assert dict(precision.step_kinds[7]) == {BF16: 4, FP8: 8}
    assert len(precision._recipes) == 2  # forward-only and full: built once each, reused across steps
    summary = precision.execution_summary()
    assert summary["plan_mismatches"] == 0 and summary["by_stage"]["fp8 w+a"] == {BF16: 8, FP8_FWD: 16}


def test_a_pattern_disables_one_linear_inside_an_fp8_layer(fake_te):
    precision, decoder, log = attach(fake_te, {"weights": "tensorwise", "activations": "tensorwise",
                                               "gradients": "tensorwise", "layers": {"bf16_modules": ["*.linear_qkv"]}})
    ran = step(precision, decoder, log, 0)
    assert ran == {n: BF16 if n.endswith("linear_qkv") else FP8 for n in ran}
    assert fake_te.reductions == 3  # no delayed state: no outer autocast, each layer's autocast is outermost


def test_high_precision_and_the_counters(fake_te):
    precision, decoder, log = attach(fake_te, {"weights": "delayed", "activations": "delayed",
                                               "gradients": "delayed"})
    step(precision, decoder, log, 0)
    reductions = fake_te.reductions
    with precision.high_precision():
        decoder(torch.zeros(1))
    assert {on for _, on, _ in log[-12:]} == {False} and fake_te.reductions == reductions
    ran = step(precision, decoder, log, 1, training=False)  # evaluation: checked against the plan, not counted
    assert set(ran.values()) == {FP8}
    assert sum(precision.mismatches.values()) == 0
    assert dict(precision.step_kinds) == {0: {FP8: 12, BF16: 12}}  # step 1 was evaluation only


def test_mismatch_is_reported(fake_te):
    precision, decoder, log = attach(fake_te, {"weights": "tensorwise", "activations": "tensorwise",
                                               "gradients": "tensorwise"})
    precision.begin_step(0)
    precision._layer_ctx[1] = precision._off  # something else switched layer 1 off
    decoder(torch.zeros(1))
    assert precision.execution_summary()["plan_mismatches"] == 4


def test_weight_cache_and_extra_state(fake_te):
    precision, decoder, log = attach(fake_te, {"weights": "tensorwise", "activations": "tensorwise",
                                               "gradients": "tensorwise"})
    step(precision, decoder, log, 0)
    lin = precision.linears["decoder.layers.1.mlp.linear_fc1"]
    assert lin.is_first_microbatch is False
    precision.after_optimizer_step(0)  # new weights: the next forward (evaluation, next step) requantizes them
    assert lin.is_first_microbatch is True
    assert lin.get_extra_state().numel() == 0 and "decoder.layers.1.mlp.linear_fc1._extra_state" not in \
        {k for k, v in decoder.state_dict().items() if v.numel()}


def test_delayed_state_is_put_back_before_the_next_fp8_forward(fake_te):
    recipe = staged("delayed")
    precision, decoder, log = attach(fake_te, recipe)
    name = "decoder.layers.2.mlp.linear_fc2"
    saved = {"scale_fwd": torch.full((1,), 4.0), "amax_history_fwd": torch.arange(8.0).reshape(8, 1),
             "scale_bwd": torch.full((1,), 8.0), "amax_history_bwd": torch.ones(8, 1)}
    precision.load_state_dict({"delayed": {name: saved, "decoder.layers.9.gone": saved}})
    step(precision, decoder, log, 3)  # BF16 stage: nothing to put back into yet, and it is kept for saving
    assert "scaling_fwd" not in precision.linears[name].fp8_meta
    assert torch.equal(precision.state_dict()["delayed"][name]["scale_fwd"], saved["scale_fwd"])
    step(precision, decoder, log, 4)  # first FP8 (forward-only) step: restored before the forward ran
    meta = precision.linears[name].fp8_meta
    assert torch.equal(meta["scaling_fwd"].amax_history, saved["amax_history_fwd"])
    assert torch.equal(meta["scaling_bwd"].scale, saved["scale_bwd"]) and meta["recipe"].choice.delayed
    assert set(precision.state_dict()["delayed"]) == {name} and not precision._pending
