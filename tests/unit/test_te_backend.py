"""TEPrecision's wiring on the CPU, against a small fake of Transformer Engine's autocast semantics (the real TE
is exercised by tests/gpu): which autocast each layer and linear runs under at each step, the outer autocast of
delayed scaling (one amax reduction per forward), high-precision evaluation, the counters, weight-cache resets,
and delayed-scaling state put back from a checkpoint before the module's next FP8 forward."""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest
import torch

from fp8_recipes.backends import te as te_backend
from fp8_recipes.backends.te import BF16, FP8, FP8_FWD, TEPrecision
from fp8_recipes.backends.te_state import carry_delayed, delayed_column, delayed_slots, delayed_tensors
from fp8_recipes.plan.precision import Hardware, ModelLayout, PrecisionPlan
from fp8_recipes.recipe.schema import Recipe

H200 = Hardware("cuda", (9, 0), "2.20.2", "NVIDIA H200")
PER_LAYER = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")


class FakeTE:
    """TE's autocast as far as the backend relies on it: a stack of (enabled, recipe); amaxes are reduced when
    the outermost enabled autocast exits. And TE 2.20's "first FP8 module" flag (quantization.py): armed when the
    outermost autocast enters, consumed by the first FP8 module's forward (that module reduces and updates the
    backward amaxes after its backward), and restored from the snapshot taken at entry when any autocast exits."""

    def __init__(self):
        self.stack: list[tuple[bool, object]] = []
        self.reductions = 0
        self.quantization_state = types.SimpleNamespace(is_first_fp8_module=False, autocast_depth=0,
                                                        global_amax_buffer={}, global_amax_history_buffer={},
                                                        global_scale_buffer={})
        te = self

        class autocast:  # noqa: N801 (TE's name)
            def __init__(self, enabled=True, recipe=None, amax_reduction_group=None):
                self.args = (enabled, recipe)

            def __enter__(self):
                q = te.quantization_state
                self.saved = q.is_first_fp8_module  # get_autocast_state()
                te.stack.append(self.args)
                if q.autocast_depth == 0:
                    q.is_first_fp8_module = True
                q.autocast_depth += 1

            def __exit__(self, *exc):
                q = te.quantization_state
                q.is_first_fp8_module = self.saved  # set_autocast_state()
                q.autocast_depth -= 1
                enabled, _ = te.stack.pop()
                if enabled and not te.stack:
                    te.reductions += 1

        self.autocast = autocast

    def first_fp8_module(self) -> bool:
        """FP8GlobalStateManager.is_first_fp8_module(): True once per arming."""
        q = self.quantization_state
        first, q.is_first_fp8_module = q.is_first_fp8_module, False
        return first

    def current(self) -> tuple[bool, object]:
        return self.stack[-1] if self.stack else (False, None)

    @staticmethod
    def get_buffer_info() -> str:
        return "buffer_index_and_autocast_key"


class FakeLinear(torch.nn.Module):
    """Records what it ran under, like TE's modules: `fp8` and `fp8_meta["recipe"]` set by each forward."""

    def __init__(self, te: FakeTE, log: list, name: str):
        super().__init__()
        self.te, self.log, self.name = te, log, name
        self.fp8, self.fp8_meta, self.is_first_microbatch = False, {}, True

    def forward(self, x):
        self.fp8, recipe = self.te.current()
        self.reduces_backward = False
        if self.fp8:
            self.fp8_meta["recipe"] = recipe
            self.reduces_backward = self.te.first_fp8_module()  # ctx.reduce_and_update_bwd_fp8_tensors
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
    quantization = types.ModuleType("transformer_engine.pytorch.quantization")
    quantization.FP8GlobalStateManager = fake  # its quantization_state: the flag and the autocast depth
    recipe.Float8CurrentScaling = lambda: types.SimpleNamespace(name="off", backward_override=None)
    pkg.pytorch, pkg.common, common.recipe = pt, common, recipe
    pt.quantization = quantization
    for mod in (pkg, pt, common, recipe, quantization):
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


@pytest.mark.parametrize("scaling", ["delayed", "tensorwise"])
def test_one_backward_amax_update_per_forward_under_delayed_scaling(fake_te, scaling):
    """TE reduces and updates every backward amax history after the backward of each module that consumed the
    "first FP8 module" flag in its forward. Under the outer autocast of delayed scaling that is one module per
    chunk and forward, as under Megatron-Core's single autocast, although each layer (and a linear kept apart by
    a pattern) runs its own nested autocast, whose exit restores the flag: before the fix every FP8 layer's first
    linear got it (L updates per micro-batch, each rolling every gradient history). Without delayed state each
    layer's autocast is outermost, and each arms the flag afresh (an update with nothing to update in TE)."""
    precision, decoder, log = attach(fake_te, {"weights": scaling, "activations": scaling, "gradients": scaling,
                                               "layers": {"bf16_first": 1, "bf16_modules": ["*.2.mlp.linear_fc1"]}},
                                     layers=4)
    step(precision, decoder, log, 0)
    reducers = [n for n, m in decoder.named_modules() if getattr(m, "reduces_backward", False)]
    if scaling == "delayed":
        assert reducers == ["layers.1.linears.0"]  # layer 1's linear_qkv: the first FP8 module of the forward
    else:
        assert reducers == ["layers.1.linears.0", "layers.2.linears.0", "layers.3.linears.0"]
    assert fake_te.quantization_state.autocast_depth == 0


def test_a_pattern_disables_one_linear_inside_an_fp8_layer(fake_te):
    precision, decoder, log = attach(fake_te, {"weights": "tensorwise", "activations": "tensorwise",
                                               "gradients": "tensorwise", "layers": {"bf16_modules": ["*.linear_qkv"]}})
    ran = step(precision, decoder, log, 0)
    assert ran == {n: BF16 if n.endswith("linear_qkv") else FP8 for n in ran}
    assert fake_te.reductions == 3  # no delayed state: no outer autocast, each layer's autocast is outermost


class GraphedLayer(Layer):
    """A layer as Megatron-Core's TE CUDA graphs run it once captured: TransformerLayer.__call__ replays the graph
    through ``_te_cuda_graph_replay`` (the parts a partial graph leaves out run eagerly inside it), not forward."""

    replay = False

    def __call__(self, x):
        return self._te_cuda_graph_replay(x) if self.replay else super().__call__(x)

    def _te_cuda_graph_replay(self, x):
        for m in self.linears:
            x = m(x)
        return x


@pytest.mark.parametrize("scaling", ["tensorwise", "delayed"])
def test_a_graph_replay_runs_under_the_layers_autocast(fake_te, scaling):
    """bench_train's lever graphs on this backend: the capture takes the plan's recipe (one TE recipe object, per
    layer FP8 or not) where Megatron-Core's helper would take its own FP8 config; the replay, which does not call
    the forward our per-layer autocast wraps, runs under that layer's autocast all the same (the experts a
    dropless MoE's graph leaves eager, TE's weight caching and amax updates depend on it). Without the wrap every
    replayed linear ran outside any autocast: BF16."""
    plan = PrecisionPlan(Recipe.from_dict({"weights": scaling, "activations": scaling, "gradients": scaling,
                                           "layers": {"bf16_first": 1}}), ModelLayout.gpt(3), H200)
    log: list = []
    linears = {f"decoder.layers.{i}.{m}": FakeLinear(fake_te, log, f"decoder.layers.{i}.{m}")
               for i in range(3) for m in PER_LAYER}
    blocks = [GraphedLayer([linears[f"decoder.layers.{i}.{m}"] for m in PER_LAYER]) for i in range(3)]
    decoder = Decoder(blocks)
    precision = TEPrecision(plan, layers=dict(enumerate(blocks)), linears=linears, chunks=[decoder])
    eager = step(precision, decoder, log, 0)
    capture = precision.graph_capture([0, 1, 2])
    choice = precision.step_plan.layers_te[1]
    assert capture == {"fp8_enabled": (False, True, True), "fp8_recipe": precision.te_recipe(choice),
                       "fp8_weight_caching": True, "fp8_group": None}
    for block in blocks:
        block.replay = True
    reductions = fake_te.reductions
    assert step(precision, decoder, log, 1) == eager
    assert {r.choice for _, on, r in log if on} == {choice}
    assert fake_te.reductions == reductions + (1 if scaling == "delayed" else 2)  # as eagerly (the outer autocast)
    assert fake_te.quantization_state.autocast_depth == 0


def test_graphs_are_refused_where_the_layers_run_more_than_one_recipe(fake_te):
    """One TE recipe per capture: a linear with its own autocast inside a graphed layer (a BF16 pattern, a
    ``modules:`` policy) or layers of different recipes are refused in one line; a stage change after the capture
    too (the graphs replay the stage they were captured in)."""
    precision, decoder, log = attach(fake_te, {"weights": "tensorwise", "activations": "tensorwise",
                                               "gradients": "tensorwise", "layers": {"bf16_modules": ["*.2.mlp.*"]}})
    precision.begin_step(0)
    with pytest.raises(ValueError, match=r"^te backend: .*decoder\.layers\.2\.mlp\.linear_fc1 runs its own \(BF16: "):
        precision.graph_capture([0, 1, 2])
    assert precision.graph_capture([0, 1])["fp8_enabled"] == (True, True)  # layer 2 left eager
    sp = precision.step_plan
    other = dataclasses.replace(sp.layers_te[0], fp8_dpa=True)
    mixed = dataclasses.replace(sp, layers_te={**sp.layers_te, 1: other})
    assert mixed.graph_problem([0, 1, 2]).startswith("CUDA graphs capture every layer under one TE recipe; "
                                                     "layer 1 runs ")
    assert mixed.graph_problem([0]) is None
    staged_precision, _, _ = attach(fake_te, staged("tensorwise"))
    staged_precision.begin_step(7)
    staged_precision.graph_capture([0, 1, 2])
    staged_precision.begin_step(8)  # the same stage: fine
    with pytest.raises(ValueError, match=r"^te backend: CUDA graphs were captured in stage 'fp8 w\+a\+g' .* "
                                         r"stage 'bf16 warmup'"):
        staged_precision.begin_step(0)


def test_a_capture_leaves_the_delayed_state_and_the_counters_as_the_step_found_them(fake_te):
    """Megatron-Core's capture runs TE's warmup forwards and backwards on static inputs: their amaxes would reach the
    delayed histories (TE puts back only its DelayedScaling recipe's state, not a per-role mix's CustomRecipe), and
    the counting hooks would count forwards no step ran. ``graphs_captured`` puts back the state ``begin_step``
    found; the hooks count nothing while Megatron-Core captures."""
    from megatron.core.transformer import cuda_graphs

    precision, decoder, log = attach(fake_te, {"weights": "delayed", "activations": "delayed",
                                               "gradients": "delayed"})
    step(precision, decoder, log, 0)
    linear = precision.linears["decoder.layers.1.self_attention.linear_qkv"]
    linear.init_fp8_meta_tensors(None)  # (TE's delayed state, as its first FP8 forward builds it)
    meta = linear.fp8_meta["scaling_fwd"]
    meta.amax_history.fill_(3.0)
    precision.begin_step(1)
    found, kinds = meta.amax_history.clone(), dict(precision.module_kinds)
    cuda_graphs._set_capture_start()
    try:
        decoder(torch.zeros(1))  # a capture's warmup forward
        meta.amax_history.fill_(1e4)  # the amaxes of the static inputs
    finally:
        cuda_graphs._set_capture_end()
    assert dict(precision.module_kinds) == kinds
    precision.graphs_captured()
    assert torch.equal(meta.amax_history, found)


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


# ---------------------------------------------------------------------------------------------------------------
# fp8_param: true (FP8-stored weights)

FP8_PARAM = {"weights": "tensorwise", "activations": "tensorwise", "gradients": "tensorwise", "fp8_param": True}


class FakeFP8Weight:
    """What the backend reads of a TE QuantizedTensor: ``get_metadata()`` (its tensors and the rest)."""

    def __init__(self, data: torch.Tensor, scale_inv: torch.Tensor, transpose: torch.Tensor | None = None):
        self.data, self.scale_inv, self.transpose = data, scale_inv, transpose

    def get_metadata(self):
        return {"data": self.data, "fp8_scale_inv": self.scale_inv, "data_transpose": self.transpose,
                "fp8_dtype": "E4M3", "quantizer": object()}


def test_fp8_weights_bytes_are_state_restored_in_place(fake_te, monkeypatch):
    processed = []
    utils = types.ModuleType("transformer_engine.pytorch.tensor.utils")
    utils.post_all_gather_processing = processed.extend
    monkeypatch.setitem(sys.modules, utils.__name__, utils)
    plan = PrecisionPlan(Recipe.from_dict(FP8_PARAM), ModelLayout.gpt(1), H200)
    buffer = torch.zeros(8, dtype=torch.uint8)  # the DDP buffer the weight's data is a view of
    weight = FakeFP8Weight(buffer[:6].view(2, 3), torch.ones(1), torch.zeros(3, 2, dtype=torch.uint8))
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    precision = TEPrecision(plan, layers={}, linears={}, chunks=[], fp8_params={name: weight})
    saved = {name: {"data": torch.arange(6, dtype=torch.uint8).view(2, 3), "fp8_scale_inv": torch.full((1,), 0.5)}}
    precision.load_state_dict({"delayed": {}, "fp8_params": saved})
    assert buffer[:6].tolist() == list(range(6)) and weight.scale_inv.item() == 0.5 and processed == [weight]
    state = precision.state_dict()["fp8_params"][name]
    assert set(state) == {"data", "fp8_scale_inv", "data_transpose"} and torch.equal(state["data"], saved[name]["data"])
    state["data"][0, 0] = 99  # a copy, not the live buffer
    assert buffer[0] == 0
    with pytest.raises(ValueError, match=r"^decoder.layers.0.mlp.linear_fc1.weight: FP8 weight data has shape \(6,\)"):
        precision.load_state_dict({"fp8_params": {name: {"data": torch.zeros(6, dtype=torch.uint8)}}})
    # a checkpoint without FP8 bytes (saved with BF16 weights): the model's state dict has set the weights already
    precision.load_state_dict({"delayed": {}})
    assert "fp8_params" not in TEPrecision(plan, layers={}, linears={}, chunks=[]).state_dict()


def test_fp8_param_init_builds_fp8_layers_under_their_recipe(request):
    from fp8_recipes.megatron.te_layers import FP8ParamInit, fp8_param_recipe  # (imports Megatron-Core: before TE's fake)
    from fp8_recipes.recipe.schema import RecipeError

    from fp8_recipes.megatron import te_layers

    request.getfixturevalue("fake_te")
    request.getfixturevalue("monkeypatch").setattr(te_layers, "te_recipe", te_backend.te_recipe)  # the fake's

    entered = []
    fake_te_pt = sys.modules["transformer_engine.pytorch"]

    class quantized_model_init:  # noqa: N801 (TE's name)
        def __init__(self, enabled, recipe, preserve_high_precision_init_val):
            entered.append((enabled, recipe, preserve_high_precision_init_val))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    fake_te_pt.quantized_model_init = quantized_model_init
    plan = PrecisionPlan(Recipe.from_dict({**FP8_PARAM, "layers": {"bf16_first": 1}}), ModelLayout.gpt(3), H200)
    init = FP8ParamInit(plan)
    for layer in range(3):
        with init(layer):
            pass
    assert [e[0] for e in entered] == [True, True] and entered[0][1] is entered[1][1] and entered[0][2]
    (choice, obj), = init.recipes.items()
    assert choice == plan.fp8_param_layers()[1] and obj is entered[0][1] and fp8_param_recipe(plan) == "tensorwise"
    # the layers then run under the very object their weights were quantized with
    precision = TEPrecision(plan, layers={}, linears={}, chunks=[], recipes=init.recipes)
    assert precision.te_recipe(choice) is obj
    delayed = PrecisionPlan(Recipe.from_dict({**FP8_PARAM, "weights": "delayed", "activations": "delayed",
                                              "gradients": "delayed"}), ModelLayout.gpt(3), H200)
    assert fp8_param_recipe(delayed) == "delayed" and fp8_param_recipe(
        PrecisionPlan(Recipe.from_dict({**FP8_PARAM, "fp8_param": False}), ModelLayout.gpt(3), H200)) is None
    with pytest.raises(RecipeError, match=r"^fp8_param: true: the FP8 layers run CustomRecipe here"):
        FP8ParamInit(PrecisionPlan(Recipe.from_dict({**FP8_PARAM, "weights": "delayed"}), ModelLayout.gpt(3), H200))


# ---------------------------------------------------------------------------------------------------------------
# A plan changed mid-run (the autopilot): each changed module's delayed state moved to its new TE recipe


class SlotLinear(FakeLinear):
    """A fake TE linear with TE's delayed-state layout (backends/te_state.py): per direction one column per slot
    that the recipe gives delayed state; kept while ``fp8_meta_tensors_initialized`` (TE's same-class early
    return), built at the first FP8 forward, and registered once in the global amax buffers."""

    def forward(self, x):
        out = super().forward(x)
        if self.fp8:
            if not getattr(self, "fp8_meta_tensors_initialized", False):
                self.fp8_meta["num_gemms"] = 1
                self.init_fp8_meta_tensors(self.fp8_meta["recipe"])
            state = self.te.quantization_state
            if self.te.get_buffer_info() not in self.fp8_meta and delayed_tensors(self):
                self.fp8_meta[self.te.get_buffer_info()] = [0, "key"]
                state.global_amax_buffer.setdefault(self.fp8_meta["recipe"].choice, []).append(self.name)
        return out

    def init_fp8_meta_tensors(self, recipe):
        if getattr(self, "fp8_meta_tensors_initialized", False):
            return
        for fwd, key in ((True, "scaling_fwd"), (False, "scaling_bwd")):
            n = len(delayed_slots(recipe.choice, 3 if fwd else 2, fwd))
            length = (recipe.choice.weights if fwd else recipe.choice.gradients).amax_history_len  # (TE: per request)
            self.fp8_meta[key] = types.SimpleNamespace(scale=torch.ones(n), amax_history=torch.zeros(length, n)) \
                if n else types.SimpleNamespace()
        self.fp8_meta_tensors_initialized = True


def test_replan_moves_the_changed_modules_delayed_state(fake_te, monkeypatch):
    """delayed, history 8, on 2 layers. The autopilot's new plan: one module's activations to current scaling (a
    CustomRecipe: its weight and grad_output keep their delayed columns), one module to BF16 (its state left alone,
    fresh when it comes back), one module's inputs and weights to a history of 3 (the newest amaxes kept, the scale
    taken again). Untouched modules keep their state; TE's amax buffers are emptied so every module registers again
    under its recipe now."""
    monkeypatch.setattr(te_backend, "TEPrecision", TEPrecision)
    base = {"weights": "delayed", "activations": "delayed", "gradients": "delayed",
            **{r: {"scaling": "delayed", "amax_history_len": 8} for r in ("weights", "activations", "gradients")}}
    plan = PrecisionPlan(Recipe.from_dict(base), ModelLayout.gpt(2), H200)
    log: list = []
    names = [f"decoder.layers.{i}.{m}" for i in range(2) for m in PER_LAYER]
    linears = {n: SlotLinear(fake_te, log, n) for n in names}
    decoder = Decoder([Layer([linears[f"decoder.layers.{i}.{m}"] for m in PER_LAYER]) for i in range(2)])
    precision = TEPrecision(plan, layers=dict(enumerate(decoder.layers)), linears=linears, chunks=[decoder])
    precision.begin_step(0)
    decoder(torch.zeros(1))
    for i, m in enumerate(linears.values()):  # a recorded past: rows 1..7, column c of module i = 10 i + c + row
        for d, n in (("fwd", 3), ("bwd", 2)):
            t = delayed_tensors(m)
            t[f"amax_history_{d}"].copy_(torch.arange(8.0)[:, None] + 10 * i + torch.arange(n)[None, :])
            t[f"amax_history_{d}"][0] = 0.0
            t[f"scale_{d}"].fill_(2.0)
    current, bf16, short, kept = names[0], names[1], names[2], names[5]
    before = {n: {k: v.clone() for k, v in delayed_tensors(linears[n]).items()} for n in names}
    new = {**base, "layers": {"bf16_modules": [bf16]}, "modules": {
        current: {"activations": "tensorwise"},
        short: {r: {"scaling": "delayed", "amax_history_len": 3} for r in ("weights", "activations")}}}
    precision.replan(PrecisionPlan(Recipe.from_dict(new), ModelLayout.gpt(2), H200))
    assert fake_te.quantization_state.global_amax_buffer  # (registered under the old recipes until the next step)
    precision.begin_step(1)
    assert not fake_te.quantization_state.global_amax_buffer
    assert all(fake_te.get_buffer_info() not in m.fp8_meta for m in linears.values())
    decoder(torch.zeros(1))  # every FP8 module registers again, under its recipe now
    assert sum(map(len, fake_te.quantization_state.global_amax_buffer.values())) == 7

    now = delayed_tensors(linears[current])  # weight and grad_output: their columns, unchanged policies, verbatim
    assert torch.equal(now["amax_history_fwd"][:, 0], before[current]["amax_history_fwd"][:, 1])
    assert torch.equal(now["amax_history_bwd"][:, 0], before[current]["amax_history_bwd"][:, 0])
    assert now["scale_fwd"].tolist() == [2.0] and now["scale_bwd"].tolist() == [2.0]
    # a CustomRecipe now (its gradients' history differs): input and weight columns, the 2 newest rows, rescaled;
    # grad_output's column verbatim (its policy is unchanged), no state for the boundary slots
    now, old = delayed_tensors(linears[short]), before[short]
    newest = torch.cat([old["amax_history_fwd"][:1], old["amax_history_fwd"][-2:]])[:, :2]
    assert torch.equal(now["amax_history_fwd"], newest)
    assert torch.equal(now["scale_fwd"], torch.tensor(448.0) / torch.tensor([27.0, 28.0]))  # row 7, the largest
    assert torch.equal(now["amax_history_bwd"], old["amax_history_bwd"][:, :1])
    for n in (bf16, kept):
        assert all(torch.equal(v, before[n][k]) for k, v in delayed_tensors(linears[n]).items()), n
    precision.replan(plan)  # back: the BF16 module starts afresh, the others move back
    precision.begin_step(2)
    decoder(torch.zeros(1))
    back = delayed_tensors(linears[bf16])
    assert back["amax_history_fwd"].abs().sum() == 0 and back["scale_bwd"].tolist() == [1.0, 1.0]
    assert delayed_tensors(linears[short])["amax_history_fwd"].shape == (8, 3)
    assert not precision.mismatches


def test_carry_delayed_between_te_state_layouts():
    """The per-slot carry on its own: a E4M3 DelayedScaling's backward state into a HYBRID one (the grad_output
    scale taken again for E5M2's range; the grad_input slot, no role's, verbatim) and into nothing."""
    from fp8_recipes.plan.te import TERecipe, TERecipeKind
    from fp8_recipes.recipe.schema import Format, Role, Scaling, TensorPolicy

    d = TensorPolicy(scaling=Scaling.DELAYED, amax_history_len=4)
    e4m3 = TERecipe(TERecipeKind.DELAYED, d, d, d)
    hybrid = TERecipe(TERecipeKind.DELAYED, d, d, TensorPolicy(scaling=Scaling.DELAYED, amax_history_len=4,
                                                                format=Format.E5M2))
    history = torch.tensor([[0.0, 0.0], [1.0, 5.0], [2.0, 6.0], [4.0, 7.0]])
    old = (history, torch.tensor([112.0, 3.0]), delayed_slots(e4m3, 2, False), e4m3)
    new_history, new_scale = torch.empty(4, 2), torch.empty(2)
    carry_delayed(old, new_history, new_scale, delayed_slots(hybrid, 2, False), hybrid)
    assert torch.equal(new_history, history) and new_scale.tolist() == [57344.0 / 4.0, 3.0]
    carry_delayed(None, new_history, new_scale, delayed_slots(hybrid, 2, False), hybrid)
    assert new_history.abs().sum() == 0 and new_scale.tolist() == [1.0, 1.0]
    custom = TERecipe(TERecipeKind.CUSTOM, d, TensorPolicy(scaling=Scaling.TENSORWISE), d)
    assert delayed_slots(custom, 6, True) == [(1, "weights"), (4, "weights")]  # a two-GEMM module's weights
    # where the statistics read a delayed scale (backends/te_observe.py): the column of that slot under the recipe
    assert delayed_column(custom, 2, Role.WEIGHTS, 1) == ("scale_fwd", 1)
    assert delayed_column(custom, 2, Role.ACTIVATIONS, 1) is None
    assert delayed_column(e4m3, 2, Role.WEIGHTS, 1) == ("scale_fwd", 4)
    assert delayed_column(hybrid, 1, Role.GRADIENTS) == ("scale_bwd", 0)
    assert delayed_slots(TERecipe(TERecipeKind.CURRENT, *(TensorPolicy(scaling=Scaling.TENSORWISE),) * 3), 3,
                         True) == []


def test_a_skipped_step_puts_back_the_delayed_state_it_found(fake_te):
    """TE rolls a step's amaxes into its histories (and may rescale between micro-batches) before the engine knows
    the step is skipped: skip_step puts back the state the step found, so a non-finite amax does not freeze the scale
    for a window; a step that is not skipped keeps what it recorded."""
    recipe = {**{r: {"scaling": "delayed", "amax_history_len": 8} for r in ("weights", "activations", "gradients")}}
    plan = PrecisionPlan(Recipe.from_dict(recipe), ModelLayout.gpt(1), H200)
    log: list = []
    linears = {f"decoder.layers.0.{m}": SlotLinear(fake_te, log, f"decoder.layers.0.{m}") for m in PER_LAYER}
    decoder = Decoder([Layer(list(linears.values()))])
    precision = TEPrecision(plan, layers={0: decoder.layers[0]}, linears=linears, chunks=[decoder])
    precision.begin_step(0)
    decoder(torch.zeros(1))  # the first FP8 forward builds the state
    precision.after_optimizer_step(0)
    fc1 = delayed_tensors(linears["decoder.layers.0.mlp.linear_fc1"])
    fc1["amax_history_fwd"][-1] = 3.0
    found = {k: v.clone() for k, v in fc1.items()}
    precision.begin_step(1)
    fc1["amax_history_fwd"][-1] = float("inf")  # what TE rolled in during the bad step, and a scale it updated
    fc1["scale_bwd"].fill_(1e-30)
    precision.skip_step(1)
    assert all(torch.equal(v, found[k]) for k, v in fc1.items())
    precision.begin_step(2)
    fc1["amax_history_fwd"][-1] = 5.0
    precision.after_optimizer_step(2)
    precision.begin_step(3)  # a good step keeps what it recorded: the next snapshot holds it
    precision.skip_step(3)
    assert float(fc1["amax_history_fwd"][-1, 0]) == 5.0


def test_routed_experts_reduce_their_delayed_amaxes_over_their_own_group(fake_te):
    """At EP > 1 the ranks holding the same experts are not the dense data-parallel ranks: each routed expert runs
    under its own autocast with the experts' group (TE keys its amax buffers by recipe and group, and reduces each
    key over its own group), the dense linears under their layer's with the dense group. Where both groups are one
    (te_expert_amax_reduction_group hands the dense group itself), experts run under their layer's autocast."""
    from fp8_recipes.megatron.model_config import layout_of

    groups = []
    real = fake_te.autocast

    class autocast(real):  # noqa: N801
        def __init__(self, enabled=True, recipe=None, amax_reduction_group=None):
            super().__init__(enabled, recipe, amax_reduction_group)
            groups.append(amax_reduction_group)

    fake_te.autocast = autocast
    sys.modules["transformer_engine.pytorch"].autocast = autocast
    plan = PrecisionPlan(Recipe.from_dict({"weights": "delayed", "activations": "delayed", "gradients": "delayed"}),
                         layout_of({"num_layers": 1, "num_moe_experts": 2}), H200)
    names = [n for n in plan.layout.module_names if n.startswith("decoder.")]
    experts = [n for n in names if ".local_experts." in n]
    for expert_group, expected in (("expert-dp", "expert-dp"), ("dense-dp", None)):
        log: list = []
        linears = {n: FakeLinear(fake_te, log, n) for n in names}
        decoder = Decoder([Layer(list(linears.values()))])
        precision = TEPrecision(plan, layers={0: decoder.layers[0]}, linears=linears, chunks=[decoder],
                                amax_group="dense-dp", expert_amax_group=expert_group)
        precision.begin_step(0)
        groups.clear()
        decoder(torch.zeros(1))
        assert groups[:2] == ["dense-dp", "dense-dp"]  # the outer autocast and the layer's
        assert groups[2:] == [expected] * len(experts) if expected else groups[2:] == [], groups
        own = {n for n, ctx in precision._module_ctx.items() if ctx is not None}
        assert own == (set(experts) if expected else set()), own


# ---------------------------------------------------------------------------------------------------------------
# A CustomRecipe with delayed state in one direction only (TE 2.20.2 fails on it: plan/te.py, DELAYED_ANCHOR)


@pytest.fixture
def te_quantizers(monkeypatch):
    """The quantizer classes RoleQuantizers builds, as tags: ("ds", settings) for a DelayedScalingRequest."""
    pkg, pt, common, recipe, tex = (types.ModuleType(n) for n in (
        "transformer_engine", "transformer_engine.pytorch", "transformer_engine.common",
        "transformer_engine.common.recipe", "transformer_engine_torch"))
    pkg.pytorch, pkg.common, common.recipe = pt, common, recipe
    pt.DelayedScalingRequest = lambda **kw: ("ds", tuple(sorted((k, repr(v)) for k, v in kw.items())))
    pt.IdentityQuantizer = lambda: ("identity",)
    pt.Float8CurrentScalingQuantizer = lambda dtype, *a, **kw: ("current", dtype)
    pt.Float8BlockQuantizer = lambda dtype, **kw: ("block", dtype)
    recipe.Format = {"HYBRID": "HYBRID", "E4M3": "E4M3"}
    tex.DType = types.SimpleNamespace(kFloat8E4M3="e4m3", kFloat8E5M2="e5m2")
    for mod in (pkg, pt, common, recipe, tex):
        monkeypatch.setitem(sys.modules, mod.__name__, mod)


@pytest.mark.parametrize("roles, anchor", [
    ({"weights": "delayed", "activations": "delayed", "gradients": "tensorwise"}, False),
    ({"weights": "delayed", "activations": "tensorwise", "gradients": "tensorwise"}, False),
    ({"weights": "delayed", "activations": "delayed", "gradients": "none"}, False),       # FP8 forward only
    ({"weights": "tensorwise", "activations": "tensorwise", "gradients": "delayed"}, True),
    ({"weights": "delayed", "activations": "delayed",                                     # a margin of their own
      "gradients": {"scaling": "delayed", "format": "e4m3", "margin": 16}}, None)])
def test_a_one_sided_delayed_custom_recipe_has_delayed_state_both_ways(te_quantizers, roles, anchor):
    """TE 2.20.2 registers a module's delayed state for both directions once either has any, and fails on a
    direction without (H200: TypeError in add_fp8_tensors_to_global_buffer). The factory, asked for the slots of a
    Linear and of a 2-expert GroupedLinear in TE's order, gives such a direction's boundary slots (role None) the
    anchor's request; every request of one direction is equal (TE refuses a state whose requests differ); and
    delayed_slots names exactly the slots with a request (where the state's columns are read and carried)."""
    plan = PrecisionPlan(Recipe.from_dict(roles), ModelLayout.gpt(2), H200)
    choice = plan.at(0).layers_te[0]
    assert choice.recipe == "CustomRecipe" and choice.delayed_anchor is anchor
    factory = te_backend.RoleQuantizers(choice, reduce_amax=True)
    # (a boundary slot has no role, unless a parent module names it: then its tensor type is output / grad_input)
    for module_type, gemms, named in (("linear", 1, False), ("grouped_linear", 2, False), ("linear", 1, True)):
        for fwd, names in ((True, ("input", "weight", "output")), (False, ("grad_output", "grad_input"))):
            slots = [None if n in ("output", "grad_input") and not named else
                     types.SimpleNamespace(module_type=module_type, tensor_type=n, name="x") for n in names * gemms]
            made = [factory(role) for role in slots]
            requests = [i for i, q in enumerate(made) if q[0] == "ds"]
            assert requests, (module_type, fwd, made)
            assert len({made[i] for i in requests}) == 1, made
            assert requests == [i for i, _ in delayed_slots(choice, len(slots), fwd)]
            boundary = [i for i, n in enumerate(names * gemms) if n in ("output", "grad_input")]
            assert (requests == boundary) == (anchor is fwd)
    assert (anchor is None) == all(role is not None for _, role in
                                   delayed_slots(choice, 3, True) + delayed_slots(choice, 2, False))
