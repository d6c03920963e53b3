"""Recipes as Megatron-Core precision fields (the Bridge / NeMo 2 integrations), on the CPU without TE:
every pack recipe maps or is refused in one line, Megatron-Core's own TransformerConfig accepts what is produced,
the quantizer factory is importable the way Megatron-Core imports it, and the adapters import nothing at load.

The NeMo 2 adapter runs against real nemo-toolkit 2.7.3 in an opt-in test: FP8_RECIPES_OPTIONAL_ENVS=DIR builds a
throwaway venv there (fp8_recipes.integrations.optional_env: --no-deps wheels on top of this venv; ~70 s the first
time) and runs the check in it. The Bridge adapter's check runs where megatron-bridge imports (it needs TE: never on
a CPU machine), else skips saying why."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from fp8_recipes.integrations.common import (
    FACTORY_PATH, QUANTIZER_ENV, NeedsPluginOwned, ScheduleDriver, _role_quantizers, activate_quantizer_factory,
    fp8_quantizer_factory, megatron_fp8_fields, megatron_precision, plugin_owned_plan,
)
from fp8_recipes.recipe.pack import load_recipe, recipe_names
from fp8_recipes.recipe.schema import Recipe, RecipeError

H200, B200, ADA = (9, 0), (10, 0), (8, 9)
MODEL = dict(num_layers=4, hidden_size=64, num_attention_heads=4)
# pack recipe -> (fp8, fp8_recipe) on an H200 and on a B200; None = needs the schedule callback (plugin-owned)
EXPECTED = {
    "bf16": ((None, None), (None, None)),
    "tensorwise": (("hybrid", "tensorwise"), ("hybrid", "tensorwise")),
    "delayed": (("hybrid", "delayed"), ("hybrid", "delayed")),
    "fast": (None, None),                                  # the FP8 LM head
    "blockwise": (("e4m3", "blockwise"), ("e4m3", "blockwise")),
    "mxfp8": (("e4m3", "blockwise"), ("e4m3", "mxfp8")),   # no MXFP8 on Hopper: the plan's 128x128/1x128 blocks
    "hybrid": (("hybrid", "blockwise"), ("hybrid", "mxfp8")),
    "safe": (None, None),                                  # warmup + stages
    "moe_blockwise": (("e4m3", "blockwise"), ("e4m3", "blockwise")),
    "moe_delayed": ("refused", "refused"),                 # per-module policies: scripts/train.py's emulated backend
    "nvfp4": ("refused", "refused"),                       # NVFP4: scripts/train.py's loop only
}
REFUSED = {"moe_delayed": "modules: per-module policies", "nvfp4": "weights.scaling: 'nvfp4' runs in fp8-recipes'"}


def recipe(**kw) -> Recipe:
    return Recipe.from_dict({"name": "t", **kw})


def transformer_config(fields: dict):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(**MODEL, **fields)


# ---------------------------------------------------------------------------------------------------------------
# Every pack recipe


def test_expected_covers_the_pack():
    assert sorted(EXPECTED) == recipe_names()


@pytest.mark.parametrize("cc", [H200, B200], ids=["H200", "B200"])
@pytest.mark.parametrize("name", recipe_names())
def test_pack_recipe_maps_or_is_refused_in_one_line(name, cc):
    expected = EXPECTED[name][cc == B200]
    if expected == "refused":
        for build in (megatron_fp8_fields, plugin_owned_plan):
            with pytest.raises(RecipeError) as e:
                build(name, compute_capability=cc, num_layers=4)
            assert "\n" not in str(e.value) and str(e.value).startswith(REFUSED[name]), str(e.value)
        return
    if expected is None:
        with pytest.raises(NeedsPluginOwned) as e:
            megatron_fp8_fields(name, compute_capability=cc, num_layers=4)
        assert "\n" not in str(e.value) and str(e.value).startswith(("schedule.", "layers.fp8_output_layer"))
        assert "FP8RecipeCallback" in str(e.value) and "FP8ScheduleCallback" in str(e.value)
        plugin_owned_plan(name, compute_capability=cc, num_layers=4)  # ...and that way it runs
        return
    fields = megatron_fp8_fields(name, compute_capability=cc, num_layers=4)
    assert (fields.get("fp8"), fields.get("fp8_recipe")) == expected
    config = transformer_config(fields)  # Megatron-Core's own validation (__post_init__)
    for key, value in fields.items():
        assert getattr(config, key) == value


def test_delayed_carries_the_recipes_history_margin_and_algorithm():
    role = {"scaling": "delayed", "amax_history_len": 16, "margin": 1, "amax_compute_algo": "most_recent"}
    r = recipe(weights=role, activations=role, gradients=role)
    f = megatron_fp8_fields(r, compute_capability=H200)
    assert (f["fp8_recipe"], f["fp8_amax_history_len"], f["fp8_margin"], f["fp8_amax_compute_algo"]) == \
        ("delayed", 16, 1, "most_recent")
    transformer_config(f)


def test_hybrid_on_hopper_reports_the_plans_substitutions():
    mp = megatron_precision("hybrid", compute_capability=H200)
    assert [s.key for s in mp.substitutions] == ["weights.scaling", "gradients.scaling"]
    assert mp.te.recipe == "Float8BlockScaling" and mp.payload is None


def test_first_last_layer_bf16_maps_to_megatrons_counts():
    r = recipe(weights="tensorwise", activations="tensorwise", gradients="tensorwise",
               layers={"bf16_first": 1, "bf16_last": 2, "bf16_modules": ["output_layer"]})
    f = megatron_fp8_fields(r, compute_capability=H200, num_layers=6)
    assert (f["first_last_layers_bf16"], f["num_layers_at_start_in_bf16"], f["num_layers_at_end_in_bf16"]) == \
        (True, 1, 2)
    from megatron.core.fp8_utils import is_first_last_bf16_layer
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(**{**MODEL, "num_layers": 6}, **f)
    assert [is_first_last_bf16_layer(config, i) for i in range(6)] == [True, False, False, False, True, True]


# ---------------------------------------------------------------------------------------------------------------
# fp8_recipe="custom": per-role mixes and options Megatron-Core's named recipes do not pass


@pytest.mark.parametrize("kw", [
    dict(weights={"scaling": "tensorwise", "pow2_scales": True}, activations="tensorwise", gradients="tensorwise"),
    dict(weights="blockwise", activations={"scaling": "blockwise", "pow2_scales": False},
         gradients={"scaling": "blockwise", "amax_epsilon": 1e-8}),
], ids=["pow2-weights", "block-options"])
def test_custom_recipe_points_megatron_at_our_factory(kw, monkeypatch):
    monkeypatch.delenv(QUANTIZER_ENV, raising=False)
    mp = megatron_precision(recipe(**kw), compute_capability=H200)
    assert mp.fields["fp8_recipe"] == "custom" and mp.fields["fp8_quantizer_factory"] == FACTORY_PATH
    transformer_config(mp.fields)
    activate_quantizer_factory(mp)
    assert os.environ[QUANTIZER_ENV] == mp.payload
    quantizers = _role_quantizers(mp.payload)  # what the factory calls per role (TE is imported only then)
    assert quantizers.choice == mp.te
    assert quantizers.reduce_amax is True


def test_factory_is_importable_the_way_megatron_imports_it():
    from megatron.core.fp8_utils import _resolve_callable_from_python_import_path

    assert _resolve_callable_from_python_import_path(FACTORY_PATH) is fp8_quantizer_factory


def test_factory_payload_round_trips_the_recipe():
    r = recipe(weights={"scaling": "tensorwise", "pow2_scales": True},
               activations={"scaling": "tensorwise", "amax_epsilon": 1e-6},
               gradients={"scaling": "tensorwise", "format": "e5m2"}, amax_reduction="tensor")
    mp = megatron_precision(r, compute_capability=H200)
    data = json.loads(mp.payload)
    assert Recipe.from_dict(data["recipe"]) == r and tuple(data["compute_capability"]) == H200
    assert mp.fields["tp_only_amax_red"] is True


def test_factory_without_a_recipe_says_how_to_set_one(monkeypatch):
    monkeypatch.delenv(QUANTIZER_ENV, raising=False)
    with pytest.raises(RuntimeError, match=QUANTIZER_ENV):
        fp8_quantizer_factory(None)


# ---------------------------------------------------------------------------------------------------------------
# What the native path cannot run: one line each, naming the key and the fix


@pytest.mark.parametrize("kw, key, plugin_owned", [
    (dict(weights="delayed", activations="delayed", gradients="delayed", layers={"bf16_first": 1}),
     "layers.bf16_first/bf16_last with delayed scaling", True),
    (dict(weights="tensorwise", activations="tensorwise", gradients="tensorwise",
          layers={"bf16_modules": ["*.linear_qkv"]}), "layers.bf16_modules", True),
    (dict(weights="tensorwise", activations="tensorwise"), "gradients.scaling", True),
    (dict(weights="delayed", activations="delayed", gradients="delayed", amax_reduction="data"),
     "amax_reduction", True),
    (dict(weights="delayed", activations="tensorwise", gradients="tensorwise"), "weights.scaling", True),
    (dict(weights="delayed", activations="delayed", gradients="delayed", amax_reduction="none"),
     "weights.scaling", True),
    (dict(weights="tensorwise", activations="tensorwise", gradients="tensorwise",
          schedule={"full_precision_eval_interval": 10}), "schedule.full_precision_eval_interval", True),
    (dict(weights="tensorwise", activations="tensorwise", gradients="tensorwise", backend="emulated"),
     "backend", False),
    (dict(weights="mxfp8", activations="blockwise", gradients="tensorwise", backend="te"), "weights.scaling", False),
    (dict(weights="none", activations="tensorwise", gradients="tensorwise"), "backend", False),
], ids=["delayed-first-last", "module-pattern", "forward-only", "dp-only-amax", "delayed-mix",
        "delayed-no-reduction", "fp-eval", "emulated",
        "te-refuses-substitution", "bf16-weights"])
def test_refusals_are_one_line(kw, key, plugin_owned):
    with pytest.raises(RecipeError) as e:
        megatron_fp8_fields(recipe(**kw), compute_capability=H200, num_layers=4)
    text = str(e.value)
    assert text.startswith(key) and "\n" not in text
    assert isinstance(e.value, NeedsPluginOwned) is plugin_owned


def test_megatron_itself_refuses_delayed_with_first_last_bf16():
    """Why the mapping refuses it (docs/facts.md): Megatron-Core's own check, not ours."""
    with pytest.raises(ValueError, match="Delayed scaling does not support first / last layer"):
        transformer_config(dict(fp8="hybrid", fp8_recipe="delayed", first_last_layers_bf16=True))


def test_lm_head_pattern_is_native():
    """The LM head is BF16 in Megatron-Core anyway: a pattern matching only it needs no callback."""
    r = load_recipe("safe")
    r = Recipe.from_dict({**r.to_dict(), "schedule": {}})
    f = megatron_fp8_fields(r, compute_capability=H200, num_layers=4)
    assert f["fp8_recipe"] == "tensorwise" and f["first_last_layers_bf16"] is True


def test_no_gpu_and_no_compute_capability_is_a_clear_error():
    with pytest.raises(RecipeError, match=r"^compute_capability: .*\(9, 0\)"):
        megatron_fp8_fields("tensorwise")


def test_schedule_driver_plans_the_whole_model_over_pipeline_chunks(monkeypatch):
    """A pipeline stage's chunks (here two, as with virtual stages) go to the TE backend together, under the plan of
    the whole model (global layer numbers; which stage holds which layer: tests/integration/test_parallel_cpu.py)."""
    import types

    import torch

    import fp8_recipes.megatron.te_layers as te_layers
    from fp8_recipes.plan.precision import Hardware

    class Chunk(torch.nn.Module):
        config = types.SimpleNamespace(num_layers=4)

    attached = []
    monkeypatch.setattr(Hardware, "detect", classmethod(lambda cls: Hardware("cuda", (9, 0), "2.20.2", "H200")))
    monkeypatch.setattr(te_layers, "attach_te_backend",
                        lambda chunks, plan, router_padding: attached.append((chunks, plan)) or "te")
    chunks = [Chunk(), Chunk()]
    driver = ScheduleDriver("safe")
    driver.attach(chunks)
    (got, plan), = attached
    assert got == chunks and driver.precision == "te" and plan.layout.num_layers == 4
    assert plan.bf16_reason("decoder.layers.0.self_attention.linear_qkv") == "bf16_first: 1"
    assert plan.bf16_reason("decoder.layers.3.mlp.linear_fc2") == "bf16_last: 1"


# ---------------------------------------------------------------------------------------------------------------
# Mixture-of-Experts: the model keys onto a framework's config, the plan of its MoE layers


def test_apply_moe_puts_a_conf_models_moe_keys_on_a_model_provider(caplog):
    """Bridge's GPTModelProvider is a Megatron-Core TransformerConfig subclass: apply_moe sets our MoE keys (the same
    names) on one, and Megatron-Core's own validation takes them."""
    import logging

    from fp8_recipes.integrations.bridge import apply_moe
    from fp8_recipes.megatron.model_config import config_layout

    config = transformer_config({})
    with caplog.at_level(logging.INFO, logger="fp8_recipes.integrations"):
        fields = apply_moe(config, "tiny_moe")
    assert fields["num_moe_experts"] == 4 and fields["moe_layer_freq"] == 2 and fields["moe_router_dtype"] == "fp32"
    assert "model provider moe_layer_freq: 1 -> 2" in caplog.text  # each changed field, old -> new
    config.__post_init__()  # Megatron-Core's checks of the MoE fields
    layout = config_layout(config)
    assert layout.experts == 4 and layout.routers == ("decoder.layers.0.mlp.router", "decoder.layers.2.mlp.router")
    mixtral = apply_moe(transformer_config({}), "mixtral_8x7b_4l")  # the provider keeps its shape, takes the keys
    assert (mixtral["moe_token_dispatcher_type"], mixtral["moe_grouped_gemm"]) == ("alltoall", True)
    listed = apply_moe(transformer_config({}), {"num_moe_experts": 8, "moe_router_topk": 2,
                                                "moe_layer_freq": [0, 1, 1, 1]})
    assert listed["moe_layer_freq"] == [0, 1, 1, 1]


@pytest.mark.parametrize("model, message", [
    ({"num_moe_experts": 4, "moe_router_topk": 5}, "model.moe_router_topk=5 is more than model.num_moe_experts=4"),
    ({"num_moe_experts": 4, "moe_layer_freq": [1, 0]}, "model.moe_layer_freq=[1, 0]: give an integer >= 1"),
    ({"num_moe_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 255}, "model.moe_ffn_hidden_size=255 is not "
                                                                             "divisible by"),
    ({"num_moe_expert": 4}, "apply_moe: 'num_moe_expert' is not a model key"),
    ("tiny", "apply_moe: model.num_moe_experts is not set: a dense model"),
    ("tiny_mo", "apply_moe: 'tiny_mo' is not a model; give one of "),
])
def test_apply_moe_refuses_in_one_line(model, message):
    from fp8_recipes.integrations.bridge import apply_moe

    config = transformer_config({})
    config.tensor_model_parallel_size = 2  # (the provider's TP: an expert's FFN must divide over it)
    with pytest.raises(ValueError) as e:
        apply_moe(config, model)
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


def test_an_moe_models_plan_maps_natively_or_runs_plugin_owned():
    from fp8_recipes.integrations.bridge import apply_moe
    from fp8_recipes.megatron.model_config import config_layout

    config = transformer_config({})
    apply_moe(config, "mixtral_8x7b_4l")
    layout = config_layout(config)
    mp = megatron_precision("moe_blockwise", compute_capability=H200, layout=layout)
    assert (mp.fields["fp8"], mp.fields["fp8_recipe"]) == ("e4m3", "blockwise")  # Megatron-Core's TE experts natively
    experts_bf16 = recipe(weights="tensorwise", activations="tensorwise", gradients="tensorwise",
                          layers={"bf16_modules": ["*experts*"]})
    for r in (experts_bf16, "safe"):  # a pattern over the experts, stages: only plugin-owned says them
        with pytest.raises(NeedsPluginOwned):
            megatron_precision(r, compute_capability=H200, layout=layout)
        plan = plugin_owned_plan(r, compute_capability=H200, layout=layout)  # our TE backend runs the MoE layers
        assert plan.layout.experts == 8 and plan.grouped_experts_problem() is None
    assert "decoder.layers.0.mlp.router" in plan.layout.routers  # (the router: BF16 whatever the recipe)
    one_expert = recipe(weights="tensorwise", activations="tensorwise", gradients="tensorwise",
                        layers={"bf16_modules": ["*local_experts.3.*"]})
    # moe_grouped_gemm runs a layer's experts in one GroupedLinear under one TE recipe: apply_recipe refuses this
    problem = plugin_owned_plan(one_expert, compute_capability=H200, layout=layout).grouped_experts_problem()
    assert problem.startswith("decoder.layers.0.mlp.experts.local_experts.3.linear_fc1 runs otherwise than") \
        and "model.moe_grouped_gemm=false" in problem


# ---------------------------------------------------------------------------------------------------------------
# Lazy imports; the adapters in their own environments (opt-in)


def test_importing_the_adapters_imports_neither_stack():
    code = ("import sys, fp8_recipes.integrations.bridge, fp8_recipes.integrations.nemo; "
            "bad = [m for m in ('megatron.bridge', 'nemo', 'lightning', 'transformer_engine') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


NEMO_CHECK = """
import json, logging
from fp8_recipes.integrations.nemo import FP8RecipePrecision, FP8ScheduleCallback
from nemo.lightning.pytorch.plugins import MegatronMixedPrecision
from nemo.lightning.pytorch.plugins.mixed_precision import update_config_with_dtype_overrides
from lightning.pytorch import Callback
from megatron.core.transformer import TransformerConfig
out = {}
for name, r in [("hybrid", "hybrid"), ("safe", "safe"),
                ("mix", {"name": "mix", "weights": {"scaling": "tensorwise", "pow2_scales": True},
                        "activations": "tensorwise", "gradients": "tensorwise"})]:
    p = FP8RecipePrecision(r, compute_capability=(9, 0))
    cfg = update_config_with_dtype_overrides(p.dtype_config, TransformerConfig(num_layers=4, hidden_size=64,
                                                                               num_attention_heads=4))
    cfg.__post_init__()
    cbs = p.callbacks()
    out[name] = dict(owner=p.owner, fp8=cfg.fp8, fp8_recipe=cfg.fp8_recipe, factory=cfg.fp8_quantizer_factory,
                     bf16=cfg.bf16, plugin=isinstance(p, MegatronMixedPrecision),
                     callbacks=[type(c).__name__ for c in cbs if isinstance(c, Callback)])
    if p.owner == "plugin":
        try:
            with p.train_step_context():
                pass
        except RuntimeError as e:
            out[name]["no_callback"] = str(e)
print("RESULT " + json.dumps(out))
"""

BRIDGE_CHECK = """
import json
from fp8_recipes.integrations.bridge import FP8RecipeCallback, mixed_precision_config, FP8MixedPrecisionConfig
from megatron.bridge.training.callbacks import Callback
from megatron.bridge.training.mixed_precision import MixedPrecisionConfig, update_config_with_precision_overrides
from megatron.core.transformer import TransformerConfig
out = {}
for name, r in [("hybrid", "hybrid"),
                ("mix", {"name": "mix", "weights": {"scaling": "tensorwise", "pow2_scales": True},
                        "activations": "tensorwise", "gradients": "tensorwise"})]:
    mpc = mixed_precision_config(r, compute_capability=(9, 0))
    mpc.finalize()
    cfg = update_config_with_precision_overrides(mpc, TransformerConfig(num_layers=4, hidden_size=64,
                                                                        num_attention_heads=4))
    cfg.__post_init__()
    out[name] = dict(fp8=cfg.fp8, fp8_recipe=cfg.fp8_recipe, factory=cfg.fp8_quantizer_factory, bf16=cfg.bf16,
                     is_mpc=isinstance(mpc, MixedPrecisionConfig))
out["callback"] = issubclass(FP8RecipeCallback, Callback)
from types import SimpleNamespace
from megatron.bridge.models import GPTModelProvider
from fp8_recipes.integrations.bridge import apply_moe, apply_recipe
for name in ("moe_blockwise", "bf16", "safe"):
    provider = GPTModelProvider(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=256, seq_length=64)
    apply_moe(provider, {"num_moe_experts": 8, "moe_router_topk": 2, "moe_token_dispatcher_type": "alltoall",
                         "moe_router_padding_for_quantization": True})
    container = SimpleNamespace(model=provider, train=SimpleNamespace(train_iters=10))
    callbacks = apply_recipe(container, name, compute_capability=(9, 0))
    cfg = update_config_with_precision_overrides(container.mixed_precision, provider)
    out[name] = dict(experts=cfg.num_moe_experts, dispatcher=cfg.moe_token_dispatcher_type, fp8=cfg.fp8,
                     fp8_recipe=cfg.fp8_recipe, padding=cfg.moe_router_padding_for_quantization,
                     callbacks=[type(c).__name__ for c in callbacks])
print("RESULT " + json.dumps(out))
"""


def _run_check(python: str | Path, code: str) -> dict:
    r = subprocess.run([str(python), "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=600)
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert r.returncode == 0 and line, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(line.removeprefix("RESULT "))


@pytest.mark.slow
def test_nemo2_plugin_in_real_nemo():
    # CI builds it under the checkout (.ci/run exports CI): the adapter is checked against real NeMo there
    root = os.environ.get("FP8_RECIPES_OPTIONAL_ENVS") or (
        str(Path(__file__).resolve().parents[2] / ".venv-optional") if os.environ.get("CI") else None)
    if not root:
        pytest.skip("opt-in: set FP8_RECIPES_OPTIONAL_ENVS=DIR to build a NeMo 2.7.3 venv there (--no-deps wheels on "
                    "top of this venv, ~70 s once) and run the NeMo 2 adapter against real NeMo in it")
    from fp8_recipes.integrations.optional_env import build_env

    out = _run_check(build_env("nemo", Path(root) / "nemo"), NEMO_CHECK)
    assert out["hybrid"] == dict(owner="native", fp8="hybrid", fp8_recipe="blockwise", factory=None, bf16=True,
                                 plugin=True, callbacks=[])
    assert out["mix"]["fp8_recipe"] == "custom" and out["mix"]["factory"] == FACTORY_PATH
    safe = out["safe"]
    assert (safe["owner"], safe["fp8"], safe["callbacks"]) == ("plugin", None, ["FP8ScheduleCallback"])
    assert "FP8ScheduleCallback" in safe["no_callback"]


def test_bridge_mixed_precision_in_real_bridge():
    pytest.importorskip("megatron.bridge.training.mixed_precision", reason=(
        "megatron-bridge 0.6.2 imports transformer_engine.pytorch while importing its package "
        "(megatron/bridge/peft/lora_layers.py) and TE cannot load on a CPU machine; runs where Bridge and TE are"))
    out = _run_check(sys.executable, BRIDGE_CHECK)
    assert out["hybrid"] == dict(fp8="hybrid", fp8_recipe="blockwise", factory=None, bf16=True, is_mpc=True)
    assert out["mix"]["fp8_recipe"] == "custom" and out["mix"]["factory"] == FACTORY_PATH
    assert out["callback"] is True
    moe = dict(experts=8, dispatcher="alltoall")
    assert out["moe_blockwise"] == dict(**moe, fp8="e4m3", fp8_recipe="blockwise", padding=True, callbacks=[])
    # BF16: no padding (Megatron-Core refuses it without fp8); plugin-owned: built BF16, the callback pads
    assert out["bf16"] == dict(**moe, fp8=None, fp8_recipe=out["bf16"]["fp8_recipe"], padding=False, callbacks=[])
    assert out["safe"] == dict(**moe, fp8=None, fp8_recipe=out["safe"]["fp8_recipe"], padding=False,
                               callbacks=["FP8RecipeCallback"])


def test_fp8_param_maps_to_megatrons_own_fp8_weights():
    for scaling, name in (("delayed", "delayed"), ("tensorwise", "tensorwise"), ("blockwise", "blockwise")):
        r = recipe(weights=scaling, activations=scaling, gradients=scaling, fp8_param=True)
        f = megatron_fp8_fields(r, compute_capability=H200, num_layers=4)
        assert f["fp8_param"] is True and f["fp8_recipe"] == name
        transformer_config(f)  # Megatron-Core takes it (fp8_param needs fp8 set: it is)
    assert "fp8_param" not in megatron_fp8_fields("tensorwise", compute_capability=H200, num_layers=4)
    with pytest.raises(RecipeError, match=r"^fp8_param: true with weights.block \[1, 128\]") as e:
        megatron_fp8_fields(recipe(weights={"scaling": "blockwise", "block": [1, 128]}, activations="blockwise",
                                   gradients="blockwise", fp8_param=True), compute_capability=H200, num_layers=4)
    assert "\n" not in str(e.value)
    with pytest.raises(RecipeError, match=r"^fp8_param: true with plugin-owned precision") as e:
        plugin_owned_plan(recipe(weights="tensorwise", activations="tensorwise", gradients="tensorwise",
                                 fp8_param=True), compute_capability=H200, num_layers=4)


def test_plugin_owned_precision_is_refused_under_the_frameworks_cuda_graphs():
    """Bridge's (and NeMo's) training loop captures Megatron-Core's TE graphs under the model config's own fp8 fields,
    which plugin-owned precision leaves unset: the graphed layers would replay BF16 whatever the plan says. Refused in
    one line by apply_recipe before anything is built (and by the schedule callback's attach); a recipe Megatron-Core
    runs natively keeps the graphs (its fp8 fields are what the capture reads)."""
    from types import SimpleNamespace

    from fp8_recipes.integrations.common import plugin_owned_graphs_problem
    from fp8_recipes.recipe.schema import RecipeError

    config = transformer_config({})
    assert plugin_owned_graphs_problem(config) is None
    config.cuda_graph_impl = "transformer_engine"
    line = plugin_owned_graphs_problem(config)
    assert line.startswith("model cuda_graph_impl='transformer_engine' with plugin-owned precision: ") \
        and "\n" not in line and line.endswith("(no BF16 warmup, stages or BF16 patterns)")
    bridge = pytest.importorskip("fp8_recipes.integrations.bridge")
    container = SimpleNamespace(model=config, train=SimpleNamespace(train_iters=10))
    with pytest.raises(RecipeError, match="with plugin-owned precision: the framework captures CUDA graphs"):
        bridge.apply_recipe(container, "safe", compute_capability=H200)
