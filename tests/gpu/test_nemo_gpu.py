"""NeMo 2's precision plugin and schedule callback in a real Lightning training job (issue 7).

A LightningModule holds a Megatron-Core GPTModel as ``.module`` (TE layer spec on the GPU), as NeMo's GPTModel
does, and ``lightning.pytorch.Trainer`` trains it on one device for a few steps with ``plugins=[precision]``:
``FP8RecipePrecision("hybrid")`` runs FP8 natively (Megatron-Core's autocast, from the fields the plugin put on
the config), ``FP8RecipePrecision(<safe, shortened>)`` plugin-owned with its ``FP8ScheduleCallback`` (BF16 first,
then the stages), ``"bf16"`` wherever NeMo imports (CPU too), and plugin-owned without the callback must stop at
the first step.

No MegatronStrategy: it needs far more of NeMo (MegatronParallel, its DDP and optimizer wrappers, the data
sampler, the io/fiddle model configs and their dependencies) than the GPU machine can carry without a network.
A SingleDeviceStrategy does what MegatronStrategy does with a precision plugin: ``connect`` copies its
``dtype_config`` onto the module's TransformerConfig (NeMo's ``update_config_with_dtype_overrides``, how native
FP8 fields reach Megatron-Core) and Lightning's own setup calls its ``convert_module`` (Float16Module around
``.module``) and wraps each step in its ``train_step_context``. The callback then finds no ``megatron_parallel``
and drives the LightningModule itself (its ``.module`` chain leads to the GPTModel).

On the GPU machine NeMo comes from wheels carried in ``.nwhl`` (not in git; tests/gpu/offline/nemo_wheels.txt):
``pip install --no-index --no-deps --target /tmp/nsite .nwhl/*.whl`` and ``PYTHONPATH=/tmp/nsite:$PWD/plugins``.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from fp8_recipes.backends.te import BF16, FP8, FP8_FWD, te_available, what_ran

try:  # anything NeMo's import chain raises (not only ImportError) means: no usable NeMo here
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import SingleDeviceStrategy
    from nemo.lightning.pytorch.plugins.mixed_precision import update_config_with_dtype_overrides
except Exception as e:  # noqa: BLE001
    pytest.skip(f"needs nemo-toolkit 2.7.3 (nemo.lightning.pytorch.plugins) and lightning: {type(e).__name__}: {e}",
                allow_module_level=True)

GPU = torch.cuda.is_available() and te_available()
pytestmark = pytest.mark.gpu
needs_te = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU with Transformer Engine")

STEPS = 12
BATCH, SEQ, VOCAB = 8, 256, 1024
MODEL = dict(num_layers=4, hidden_size=256, ffn_hidden_size=1024, num_attention_heads=4, num_query_groups=2)
SAFE_SCHEDULE = {"bf16_warmup_steps": 2, "enable": {"weights": 2, "activations": 4, "gradients": 6}}
"""safe.yaml's stages moved from steps 100/100/200/300 into a 12-step run."""


@pytest.fixture
def world(request):
    """A one-process Megatron-Core world: NCCL on the GPU (megatron_gpu also resets TE's FP8 state), else gloo."""
    return request.getfixturevalue("megatron_gpu" if GPU else "megatron_cpu")


def transformer_config(cuda: bool):
    """The model's TransformerConfig as model code writes it (FP32, no fp8): the plugin's dtype_config sets bf16,
    params_dtype and the fp8 fields on it. Fusions as build_gpt_model sets them."""
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(**MODEL, normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
                             add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
                             use_cpu_initialization=not cuda, bias_activation_fusion=cuda, bias_dropout_fusion=cuda,
                             masked_softmax_fusion=False, apply_rope_fusion=cuda and GPU,
                             cross_entropy_loss_fusion=cuda, gradient_accumulation_fusion=False)


class TinyGPT(pl.LightningModule):
    """NeMo's layout: ``config`` (a TransformerConfig the strategy updates), ``module`` built in configure_model.
    Records per step the loss, what every TE linear ran, the recipe class TE saw and the schedule callback's stage."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.config = transformer_config(device.type == "cuda")
        self.module = None
        self.losses: list[float] = []
        self.kinds: list[Counter] = []
        self.te_recipes: list[set[str]] = []
        self.stages: list[str | None] = []

    def configure_model(self) -> None:
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_local_spec, get_gpt_layer_with_transformer_engine_spec,
        )

        if self.module is not None:
            return
        torch.manual_seed(0)
        spec = (get_gpt_layer_with_transformer_engine_spec() if GPU
                else get_gpt_layer_local_spec(normalization="RMSNorm"))
        self.module = GPTModel(config=self.config, transformer_layer_spec=spec, vocab_size=VOCAB,
                               max_sequence_length=SEQ, position_embedding_type="rope",
                               share_embeddings_and_output_weights=False)

    def te_linears(self) -> dict:
        from fp8_recipes.megatron.model import named_linear_modules

        return {n: m for n, m in named_linear_modules(self) if hasattr(m, "fp8_meta")}

    def training_step(self, batch, batch_idx):
        losses = self.module(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        loss = (losses.float() * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
        linears = self.te_linears()
        self.kinds.append(Counter(what_ran(m) for m in linears.values()))
        self.te_recipes.append({type(m.fp8_meta["recipe"]).__name__ for m in linears.values() if m.fp8})
        self.losses.append(float(loss.detach()))
        self.stages.append(next((c.driver.stage for c in self.trainer.callbacks if hasattr(c, "driver")), None))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.0)


class PluginConfigStrategy(SingleDeviceStrategy):
    """SingleDeviceStrategy + what MegatronStrategy.connect does with a precision plugin (nemo 2.7.3,
    megatron_strategy.py): copy its dtype_config onto the model's config before the model is built."""

    def connect(self, model) -> None:
        super().connect(model)
        update_config_with_dtype_overrides(self.precision_plugin.dtype_config, model.config)


def fit(precision, device, callbacks=()) -> TinyGPT:
    """STEPS optimizer steps of Lightning's loop on one fixed batch (memorisable: the loss must fall)."""
    from fp8_recipes.megatron.data import repeated_batch

    model = TinyGPT(device)
    batch = next(repeated_batch(BATCH, SEQ, VOCAB))
    loader = torch.utils.data.DataLoader([batch] * STEPS, batch_size=None)
    trainer = pl.Trainer(accelerator="gpu" if device.type == "cuda" else "cpu",
                         strategy=PluginConfigStrategy(device=device), plugins=[precision],
                         callbacks=list(callbacks), max_steps=STEPS, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(model, train_dataloaders=loader)
    assert trainer.global_step == STEPS
    return model


def assert_learns(losses: list[float]) -> None:
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses), losses
    assert sum(losses[-2:]) / 2 < losses[0] - 1.0, losses  # one random batch: BF16 on the CPU falls 7.0 -> 3.4
    assert losses[-1] < losses[STEPS // 2] - 0.3, losses   # still falling in the second half (safe's FP8 steps)


def assert_plugin_applied(model: TinyGPT) -> None:
    """What the plugin's convert_module and dtype_config did to the model (BF16 params, Float16Module)."""
    from megatron.core.transformer.module import Float16Module

    assert isinstance(model.module, Float16Module), type(model.module)
    assert model.config.bf16 and model.config.params_dtype == torch.bfloat16
    assert {p.dtype for p in model.module.parameters()} == {torch.bfloat16}


def test_bf16_recipe_trains_in_lightning(world):
    """The plugin with a BF16 recipe in Lightning's loop (no TE needed): Megatron-Core's BF16 path, no callback."""
    from fp8_recipes.integrations.nemo import FP8RecipePrecision

    precision = FP8RecipePrecision("bf16", params_dtype=torch.bfloat16)
    assert (precision.owner, precision.dtype_config.fp8, precision.callbacks()) == ("native", None, [])
    model = fit(precision, world[2])
    assert_plugin_applied(model)
    assert model.config.fp8 is None
    assert_learns(model.losses)
    if GPU:
        assert all(k == Counter({BF16: 16}) for k in model.kinds), model.kinds  # 4 layers x 4 TE linears


def test_plugin_owned_recipe_without_its_callback_stops_at_the_first_step(world):
    """safe without FP8ScheduleCallback: the plugin's train_step_context refuses the first step (no silent BF16).
    The plan is made for an H200 (sm_90) so this runs wherever NeMo imports."""
    from fp8_recipes.integrations.nemo import FP8RecipePrecision

    precision = FP8RecipePrecision("safe", compute_capability=(9, 0), params_dtype=torch.bfloat16)
    assert precision.owner == "plugin" and precision.dtype_config.fp8 is None
    with pytest.raises(RuntimeError, match="FP8ScheduleCallback, which is not in the trainer's callbacks"):
        fit(precision, world[2])


@needs_te
def test_native_recipe_runs_fp8_in_lightning(world):
    """hybrid natively: the fields reach the TransformerConfig through the strategy's connect, Megatron-Core's own
    autocast runs every TE linear FP8 with the TE recipe the plan chose for this GPU, and the loss falls."""
    from fp8_recipes.integrations.common import megatron_precision
    from fp8_recipes.integrations.nemo import FP8RecipePrecision

    mp = megatron_precision("hybrid", num_layers=MODEL["num_layers"])
    precision = FP8RecipePrecision("hybrid", num_layers=MODEL["num_layers"], params_dtype=torch.bfloat16)
    assert (precision.owner, precision.callbacks()) == ("native", [])
    model = fit(precision, world[2])
    assert_plugin_applied(model)
    assert (model.config.fp8, model.config.fp8_recipe) == (mp.fields["fp8"], mp.fields["fp8_recipe"])
    assert_learns(model.losses)
    assert all(k == Counter({FP8: 16}) for k in model.kinds), model.kinds
    assert all(r == {mp.te.recipe} for r in model.te_recipes), (model.te_recipes, mp.te.describe())
    if torch.cuda.get_device_capability() == (9, 0):
        assert mp.te.recipe == "Float8BlockScaling"  # docs/nemo.md: hybrid on sm_90 -> blockwise


@needs_te
def test_plugin_owned_recipe_follows_its_plan_in_lightning(world):
    """safe (stages shortened to 2/2/4/6) plugin-owned: the callback wraps the LightningModule's layers at train
    start and applies the plan's stage at each batch; what TE ran, read from the modules inside training_step,
    is BF16 for the warmup and weights-only steps, then FP8 forward-only, then FP8, in layers 1-2 only (the first
    and last layers stay BF16); the model itself was built without fp8."""
    from fp8_recipes.integrations.nemo import FP8RecipePrecision, FP8ScheduleCallback
    from fp8_recipes.recipe.pack import load_recipe

    recipe = {**load_recipe("safe").to_dict(), "schedule": SAFE_SCHEDULE}
    precision = FP8RecipePrecision(recipe, num_layers=MODEL["num_layers"], max_steps=STEPS,
                                   params_dtype=torch.bfloat16)
    assert precision.owner == "plugin" and precision.dtype_config.fp8 is None
    callbacks = precision.callbacks()
    assert [type(c) for c in callbacks] == [FP8ScheduleCallback]
    model = fit(precision, world[2], callbacks)
    assert_plugin_applied(model)
    assert model.config.fp8 is None and precision.scheduled_by is callbacks[0]
    assert_learns(model.losses)
    assert model.stages == ["bf16 warmup"] * 2 + ["fp8 w"] * 2 + ["fp8 w+a"] * 2 + ["fp8 w+a+g"] * 6, model.stages
    bf16, half = Counter({BF16: 16}), 8  # layers 1-2: 8 TE linears; layers 0 and 3 BF16 throughout
    expected = [bf16] * 4 + [Counter({BF16: half, FP8_FWD: half})] * 2 + [Counter({BF16: half, FP8: half})] * 6
    assert model.kinds == expected, model.kinds
    te = callbacks[0].driver.precision  # the backend's own count agrees, and nothing ran off-plan
    assert [te.step_kinds[s] for s in range(STEPS)] == expected
    assert not te.mismatches, dict(te.mismatches)
    assert model.te_recipes == [set()] * 4 + [{"Float8CurrentScaling"}] * 8, model.te_recipes  # safe is tensorwise
