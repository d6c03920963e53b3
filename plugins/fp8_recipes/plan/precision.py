"""The PrecisionPlan: one pure decision of what runs, per step, per linear module, per GEMM, per tensor role.

    PrecisionPlan(recipe, layout, hardware).at(step) -> StepPlan
        StepPlan.modules[name].gemms[Gemm.FPROP] -> GemmPlan(execution, operand policies)

Each linear module runs three GEMMs: fprop (activations x weights), dgrad (gradients x weights) and wgrad
(gradients x activations). An operand is FP8 when its role is enabled at that step (BF16 warmup and
``schedule.enable``) and the module is not kept BF16 by ``layers`` (first/last N transformer layers,
``bf16_modules`` glob patterns, the LM head unless ``fp8_output_layer``). Backends execute the plan; they do not
re-decide it. :func:`fp8_recipes.plan.format.format_plan` prints it (printing sits a floor above deciding).

With the Transformer Engine backend (``plan.backend == "te"``) a GEMM is real FP8 only where TE can run it
(:mod:`fp8_recipes.plan.te`): both operands FP8, in one scaling family, on hardware that has it. Each module's
plan then also names the TE recipe it runs under (``ModulePlan.te``), operands show the policies TE really
quantizes with, and ``substitutions`` lists every setting TE runs differently from the recipe (``backend: te``
refuses them in one line instead; ``auto`` runs the nearest legal recipe, or the emulated backend when none is
sensible).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from functools import cached_property
from typing import Any

from fp8_recipes.checks import ConfigError, is_int
from fp8_recipes.plan.te import (
    Substitution, TERecipe, TEResolution, delayed_buffer_keys, final_te_recipe, resolve_te, te_attention,
    te_recipe_for, te_stage_note,
)
from fp8_recipes.recipe.schema import (
    ROLES, Attention, Backend, ModulePolicies, Recipe, RecipeError, Role, Scaling, TensorPolicy, one_sided_rht,
)

__all__ = [
    "Execution", "ExpertLayoutWords", "Gemm", "GemmPlan", "Hardware", "ModelLayout", "ModulePlan", "MoEShape",
    "ParallelLayout", "PrecisionPlan", "StepPlan", "GEMM_OPERANDS", "LAYOUT_WORDS", "ROUTER_REASON", "ROW_PARALLEL",
    "Substitution", "TERecipe", "TRAINER_WORDS", "expert_ffn_size", "moe_layer_pattern",
]


class Gemm(StrEnum):
    FPROP = "fprop"  # y  = x  @ w^T         (activations, weights)
    DGRAD = "dgrad"  # dx = dy @ w           (gradients, weights)
    WGRAD = "wgrad"  # dw = dy^T @ x         (gradients, activations)


GEMM_OPERANDS: dict[Gemm, tuple[Role, Role]] = {
    Gemm.FPROP: (Role.ACTIVATIONS, Role.WEIGHTS),
    Gemm.DGRAD: (Role.GRADIENTS, Role.WEIGHTS),
    Gemm.WGRAD: (Role.GRADIENTS, Role.ACTIVATIONS),
}


class Execution(StrEnum):
    BF16 = "bf16"          # high precision GEMM
    FP8 = "fp8"            # real FP8 GEMM (Transformer Engine)
    EMULATED = "emulated"  # operands fake-quantized to FP8 values, GEMM in high precision


@dataclass(frozen=True)
class Hardware:
    """What the machine can execute. `detect()` looks; tests construct it directly."""

    device: str = "cpu"
    compute_capability: tuple[int, int] | None = None
    te_version: str | None = None
    name: str = "cpu"

    @classmethod
    def target(cls, compute_capability: tuple[int, int]) -> Hardware:
        """A GPU of this compute capability with Transformer Engine, as where a job will run (planned elsewhere)."""
        cc = (int(compute_capability[0]), int(compute_capability[1]))
        return cls("cuda", cc, "target", "sm_{}{}".format(*cc))

    @property
    def has_te(self) -> bool:
        return self.te_version is not None and self.device == "cuda"

    @property
    def has_fp8(self) -> bool:
        """FP8 tensor cores (Ada sm_89, Hopper sm_90, Blackwell)."""
        return self.has_te and self.compute_capability is not None and self.compute_capability >= (8, 9)

    @property
    def has_mxfp8(self) -> bool:
        """MXFP8 GEMMs need sm_100+ (TE on Hopper: 'Device compute capability 10.0 or higher required')."""
        return self.has_te and self.compute_capability is not None and self.compute_capability >= (10, 0)

    @property
    def sm(self) -> str:
        """'sm_90' for compute capability 9.0."""
        return "sm_{}{}".format(*self.compute_capability) if self.compute_capability else "no GPU"

    def describe(self) -> str:
        if self.device != "cuda":
            return "CPU"
        cc = ".".join(map(str, self.compute_capability or ()))
        te = f"Transformer Engine {self.te_version}" if self.te_version else "no Transformer Engine"
        return f"{self.name} (sm {cc}), {te}"

    @classmethod
    def detect(cls) -> Hardware:
        import torch

        if not torch.cuda.is_available():
            return cls()
        te_version = None
        try:  # TE breaks in many ways on machines it was not built for: any failure means "no TE"
            import transformer_engine
            import transformer_engine.pytorch  # noqa: F401  (the part the backend needs: core lib + torch extension)

            te_version = transformer_engine.__version__
        except Exception:
            pass
        return cls("cuda", torch.cuda.get_device_capability(), te_version, torch.cuda.get_device_name())


_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_EXPERT_RE = re.compile(r"\.experts\.local_experts\.(\d+)\.")


ROW_PARALLEL = ("linear_proj", "linear_fc2")
"""Megatron-Core's row-parallel linears, as name suffixes (the attention's projection, every MLP's and expert's fc2):
their weight split by input columns over the TP ranks, and so their input by features; linear_qkv, linear_fc1 and
the LM head are column-parallel (weight split by output rows)."""


@dataclass(frozen=True)
class MoEShape:
    """The Mixture-of-Experts part of a model, as the plan needs it: how many routed experts each MoE layer has, which
    (global, 0-based) layers are MoE, and whether they also have shared experts (Megatron-Core's SharedExpertMLP)."""

    experts: int
    layers: tuple[int, ...]
    shared_experts: bool = False


def expert_ffn_size(cfg: Mapping[str, Any]) -> int:
    """A routed expert's FFN width, as Megatron-Core reads it: ``moe_ffn_hidden_size``, else the dense
    ``ffn_hidden_size``, else 4 x hidden."""
    return int(cfg.get("moe_ffn_hidden_size") or cfg.get("ffn_hidden_size") or 4 * int(cfg["hidden_size"]))


def moe_layer_pattern(cfg: Mapping[str, Any]) -> tuple[int, ...]:
    """The MoE layers (global, 0-based) of a model config, as Megatron-Core reads ``moe_layer_freq``: an integer N puts
    experts in every N-th layer from layer 0, a list of 0/1 (one per layer) names them. Empty for a dense model.
    (Here, beside MoEShape, so that the plan and the memory estimator read a model config the same way.)"""
    if cfg.get("num_moe_experts") is None:
        return ()
    n, freq = int(cfg["num_layers"]), cfg.get("moe_layer_freq", 1)
    if is_int(freq) and freq >= 1:
        return tuple(i for i in range(n) if i % freq == 0)
    listed = isinstance(freq, Sequence) and not isinstance(freq, str)
    if listed and len(freq) == n and all(is_int(f) and f in (0, 1) for f in freq):
        if not any(freq):
            raise ConfigError("model.moe_layer_freq: every layer is 0 (dense); put a 1 where a layer has experts, "
                             "or set model.num_moe_experts=null")
        return tuple(i for i, f in enumerate(freq) if f)
    raise ConfigError(f"model.moe_layer_freq={freq!r}: give an integer >= 1 (experts in every N-th layer) or a list "
                     f"of zeros and ones, one per layer (model.num_layers={n})")


_DENSE = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")


@dataclass(frozen=True)
class ModelLayout:
    """The model as the plan sees it: transformer layer count and linear module names (and the routers of its MoE
    layers, which run no GEMM the plan decides: they stay BF16, see :data:`ROUTER_REASON`)."""

    num_layers: int
    module_names: tuple[str, ...]
    routers: tuple[str, ...] = ()
    experts: int = 0
    """Routed experts per MoE layer (0: a dense model)."""

    @staticmethod
    def layer_of(name: str) -> int | None:
        m = _LAYER_RE.search(name)
        return int(m.group(1)) if m else None

    @staticmethod
    def expert_of(name: str) -> int | None:
        """The (global) routed expert a module belongs to, or None."""
        m = _EXPERT_RE.search(name)
        return int(m.group(1)) if m else None

    @classmethod
    def gpt(cls, num_layers: int, output_layer: bool = True, moe: MoEShape | None = None) -> ModelLayout:
        """The linear modules of a Megatron-Core GPTModel (local or TE spec), for planning without a model. An MoE
        layer's MLP is its shared experts' two linears, then each routed expert's, as Megatron-Core's SequentialMLP
        names them (``mlp.experts.local_experts.<e>.linear_fc1``; ``e`` global, whichever rank holds the expert)."""
        moe_layers = set(moe.layers) if moe else set()
        names = []
        for i in range(num_layers):
            if i not in moe_layers:
                names += [f"decoder.layers.{i}.{m}" for m in _DENSE]
                continue
            names += [f"decoder.layers.{i}.{m}" for m in _DENSE[:2]]
            if moe.shared_experts:
                names += [f"decoder.layers.{i}.mlp.shared_experts.linear_fc{k}" for k in (1, 2)]
            names += [f"decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc{k}"
                      for e in range(moe.experts) for k in (1, 2)]
        routers = tuple(f"decoder.layers.{i}.mlp.router" for i in sorted(moe_layers))
        return cls(num_layers, tuple(names + (["output_layer"] if output_layer else [])), routers,
                   moe.experts if moe else 0)


ROUTER_REASON = "router (always BF16)"
"""Why an MoE layer's router stays BF16: its GEMM (Megatron-Core's router_gating_linear, in fp32 with
``moe_router_dtype: fp32``) picks the experts, and a quantized score flips a token's top-k; Megatron-Core never
quantizes it, and DeepSeek-V3's FP8 training kept it in BF16 too."""


@dataclass(frozen=True)
class ExpertLayoutWords:
    """How :meth:`ParallelLayout.check_experts` words a refusal, in the keys the user typed: str.format templates of
    the sizes it names (ep, etp, experts, ffn, pp, stage_ranks, gpus, grid = etp x ep, grid_pp = grid x pp, etp_key;
    dense: key, value, unset). :data:`LAYOUT_WORDS` (``--layout``), :data:`TRAINER_WORDS` (``trainer.*``)."""

    ep_key: str
    """The EP size's key, as the dense refusal names it."""
    etp_key: str
    """The expert TP size's key."""
    tp_key: str
    """The TP size's key: the experts' TP size while the expert TP size is unset."""
    dense: str
    """EP or expert TP set on a dense model."""
    ep: str
    """EP does not divide the routed experts."""
    etp: str
    """The experts' TP size does not divide their FFN width."""
    grid: str
    """Expert TP x EP does not divide a stage's ranks."""


LAYOUT_WORDS = ExpertLayoutWords(
    ep_key="ep", etp_key="etp", tp_key="tp",
    dense="--layout: ep / etp split routed experts, and this model has none (num_moe_experts: null); drop "
          "{key}={value}",
    ep="--layout: ep={ep} does not divide the {experts} routed experts of each MoE layer; pick a divisor of {experts}",
    etp="--layout: {etp_key}={etp} (the experts' TP size) does not divide the experts' FFN width "
        "(model.moe_ffn_hidden_size={ffn}); set etp to a divisor of {ffn}",
    grid="--layout: expert TP x EP = {etp} x {ep} does not divide a stage's tp x cp x dp = {stage_ranks} ranks; "
         "raise dp or lower {grid_key}")
"""`fp8-recipes memory` / `explain --layout`'s wording."""

TRAINER_WORDS = ExpertLayoutWords(
    ep_key="trainer.expert_model_parallel_size", etp_key="trainer.expert_tensor_parallel_size",
    tp_key="trainer.tensor_model_parallel_size",
    dense="{key}={value}: the model has no experts (model.num_moe_experts=null, a dense model); set {key}={unset}, or "
          "pick an MoE model (e.g. model=tiny_moe)",
    ep="trainer.expert_model_parallel_size={ep} does not divide model.num_moe_experts={experts}: each EP rank holds "
       "the same number of experts; pick a divisor of {experts}",
    etp="{etp_key}={etp} does not divide the experts' FFN width (model.moe_ffn_hidden_size={ffn}); pick a divisor "
        "of it",
    grid="{grid_key}: expert tensor parallel x EP x pipeline = {etp} x {ep} x {pp} = {grid_pp} does not divide the "
         "{gpus} launched processes; launch a multiple of {grid_pp} or lower {grid_key}")
"""The trainer's wording (training/config.py ``TrainerConfig.check_experts``)."""


@dataclass(frozen=True)
class ParallelLayout:
    """How a run splits the model over GPUs (Megatron-Core's sizes): the plan's layer numbers are global, and this
    says which pipeline stage and virtual chunk holds which layers, as Megatron-Core places them."""

    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    cp: int = 1
    dp: int = 1
    ep: int = 1
    """Expert parallel (MoE): each EP rank holds 1/EP of every MoE layer's routed experts. Carved out of the
    tp x cp x dp ranks of a stage, as in Megatron-Core: it adds no GPUs."""
    etp: int | None = None
    """Expert tensor parallel: each routed expert split over this many ranks; None = tp (Megatron-Core's default)."""

    KEYS = ("tp", "pp", "vpp", "cp", "dp", "ep", "etp")

    @classmethod
    def parse(cls, text: str) -> ParallelLayout:
        """``tp=2,pp=4,vpp=2,cp=2,dp=8`` (any subset, each once; the rest 1, vpp none; "" all 1); ValueError naming
        the bad part."""
        values: dict[str, int] = {}
        for part in (p.strip() for p in text.split(",")) if text.strip() else ():
            key, _, value = part.partition("=")
            if not part:
                raise ValueError(f"--layout: {text!r} has an empty part; write KEY=N parts separated by single "
                                 f"commas (e.g. tp=2,pp=4,dp=8)")
            if key not in cls.KEYS:
                raise ValueError(f"--layout: {key!r} is not one of {', '.join(cls.KEYS)} (e.g. tp=2,pp=4,dp=8)")
            if not value.isdigit() or int(value) < 1:
                raise ValueError(f"--layout: {part!r}: the size must be an integer >= 1")
            if key in values:
                raise ValueError(f"--layout: {key} is given twice ({key}={values[key]}, {part}); give each size once")
            values[key] = int(value)
        if values.get("vpp") == 1:
            values.pop("vpp")
        return cls(**values)

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    def check(self, num_layers: int) -> None:
        chunks = self.pp * (self.vpp or 1)
        if self.vpp and self.pp < 2:
            raise ValueError("--layout: vpp needs pp >= 2")
        if num_layers % chunks:
            raise ValueError(f"--layout: {num_layers} layers do not split evenly over pp x vpp = {chunks} chunks")

    def chunk_layers(self, num_layers: int) -> dict[tuple[int, int], range]:
        """{(stage, chunk): global layers}: Megatron-Core's even split, chunk v of stage s holding the
        (v x pp + s)-th run of num_layers / (pp x vpp) layers (interleaving: stage 0 chunk 1 follows the last
        stage's chunk 0)."""
        self.check(num_layers)
        vpp = self.vpp or 1
        per = num_layers // (self.pp * vpp)
        return {(stage, v): range((v * self.pp + stage) * per, (v * self.pp + stage + 1) * per)
                for stage in range(self.pp) for v in range(vpp)}

    @property
    def expert_tp(self) -> int:
        return self.etp or self.tp

    @property
    def expert_dp(self) -> int:
        """The experts' data-parallel size: a stage's tp x cp x dp ranks over expert TP x EP (Megatron-Core's
        expert-data-parallel group, world / (expert TP x EP x PP)), over which their optimizer state is sharded."""
        return self.tp * self.cp * self.dp // (self.expert_tp * self.ep)

    def check_experts(self, num_experts: int | None, expert_ffn: int | None = None,
                      words: ExpertLayoutWords = LAYOUT_WORDS) -> None:
        """ConfigError (a ValueError) in the keys the user typed (`words`: --layout's, or :data:`TRAINER_WORDS`),
        unless Megatron-Core can build these experts at this layout: EP or expert TP need routed experts
        (``num_experts`` None: a dense model); EP divides the experts, expert TP their FFN width (``expert_ffn``, the
        model's moe_ffn_hidden_size; None: not checked), expert TP x EP a stage's tp x cp x dp ranks (the launched
        processes over expert TP x EP x PP, as training says it). The one home of these rules: `fp8-recipes
        memory` / `explain` and the trainer's check_experts call it."""
        sizes = {"ep": self.ep, "etp": self.expert_tp, "experts": num_experts, "ffn": expert_ffn, "pp": self.pp,
                 "stage_ranks": self.tp * self.cp * self.dp, "gpus": self.gpus, "grid": self.expert_tp * self.ep,
                 "grid_pp": self.expert_tp * self.ep * self.pp,
                 "etp_key": words.etp_key if self.etp else words.tp_key}
        # the size to lower: the experts' TP size (expert TP, or TP when it is unset) when it alone does not divide a
        # stage's ranks, else EP
        sizes["grid_key"] = sizes["etp_key"] if sizes["stage_ranks"] % self.expert_tp else words.ep_key
        if num_experts is None:
            for key, value, unset in ((words.ep_key, self.ep, 1), (words.etp_key, self.etp, None)):
                if value != unset:
                    raise ConfigError(words.dense.format(key=key, value=value, unset=unset or "null"))
            return
        if num_experts % self.ep:
            raise ConfigError(words.ep.format(**sizes))
        if expert_ffn is not None and expert_ffn % self.expert_tp:
            raise ConfigError(words.etp.format(**sizes))
        if sizes["stage_ranks"] % sizes["grid"]:
            raise ConfigError(words.grid.format(**sizes))

    def describe(self) -> str:
        vpp = f", vpp={self.vpp}" if self.vpp else ""
        experts = (f", ep={self.ep}" if self.ep > 1 else "") + (f", etp={self.etp}" if self.etp else "")
        return f"tp={self.tp}, pp={self.pp}{vpp}, cp={self.cp}, dp={self.dp}{experts}: {self.gpus} GPUs"


@dataclass(frozen=True)
class GemmPlan:
    gemm: Gemm
    execution: Execution
    operands: tuple[tuple[Role, TensorPolicy | None], tuple[Role, TensorPolicy | None]]
    """(role, policy) for the two operands; policy None = high precision."""

    def policy(self, role: Role) -> TensorPolicy | None:
        for r, p in self.operands:
            if r is role:
                return p
        raise KeyError(role)


@dataclass(frozen=True)
class ModulePlan:
    name: str
    layer: int | None
    bf16_reason: str | None
    """Why this module stays BF16 at every step (first/last layer, pattern, LM head), else None."""
    gemms: dict[Gemm, GemmPlan] = field(default_factory=dict)
    te: TERecipe | None = None
    """Transformer Engine backend: the TE recipe this module runs under at this step (None: BF16)."""
    override: str | None = None
    """The recipe's ``modules:`` pattern whose policies this module runs, and what it changes, else None."""

    @property
    def any_fp8(self) -> bool:
        return any(g.execution is not Execution.BF16 for g in self.gemms.values())

    def summary(self) -> str:
        return " ".join(f"{g}:{p.execution}" for g, p in self.gemms.items())


@dataclass(frozen=True)
class StepPlan:
    step: int
    stage: str
    """Short label for the progress bar: 'bf16', 'bf16 warmup', 'fp8 w', 'fp8 w+a+g'."""
    roles_fp8: frozenset[Role]
    modules: dict[str, ModulePlan]
    note: str = ""
    """Transformer Engine backend: how this stage runs there when it differs from the roles ('forward-only ...')."""
    attention: frozenset[int] = frozenset()
    """Layers whose core attention runs FP8 this step (recipe ``attention: fp8``): Q, K, V, the softmax output and
    the output with the activations' policy, their gradients with the gradients' policy."""
    layers_te: dict[int, TERecipe | None] = field(default_factory=dict)
    """Transformer Engine backend: each layer's own TE recipe this step (the recipe's, with ``fp8_dpa`` in the
    ``attention`` layers; None in a ``bf16_first`` / ``bf16_last`` layer or a BF16 stage): the layer's autocast, under
    which its core attention runs; a linear whose TE recipe differs (a ``modules:`` override, a BF16 pattern) runs
    under its own inside it."""

    @property
    def any_fp8(self) -> bool:
        """Whether any GEMM or core attention runs FP8 this step."""
        return bool(self.attention) or any(m.any_fp8 for m in self.modules.values())

    def graph_problem(self, layers: Iterable[int]) -> str | None:
        """Why Megatron-Core's TE CUDA graphs cannot capture ``layers`` (layer numbers) under this step's plan, or
        None. TE's make_graphed_callables captures every callable under one recipe (each callable may be FP8 or not):
        the FP8 layers must share one TE recipe, and no linear inside them may run its own (a ``modules:`` policy, a
        BF16 pattern: its autocast would not be in the graph)."""
        choices = {i: self.layers_te.get(i) for i in layers}
        fp8 = {i: c for i, c in choices.items() if c is not None}
        first = next(iter(fp8), None)
        other = next((i for i, c in fp8.items() if c != fp8[first]), None)
        if other is not None:
            return (f"CUDA graphs capture every layer under one TE recipe; layer {other} runs {fp8[other].describe()}, "
                    f"layer {first} {fp8[first].describe()}")
        own = next((row for row in self.modules.values() if row.layer in choices and row.te != choices[row.layer]),
                   None)
        if own is not None:
            return (f"CUDA graphs capture a layer under one TE recipe; {own.name} runs its own "
                    f"({own.te.describe() if own.te else 'BF16'}: a modules: policy or a BF16 pattern)")
        return None


class PrecisionPlan:
    """Resolves a recipe for one model on one machine. Pure: same inputs, same plan."""

    def __init__(self, recipe: Recipe, layout: ModelLayout, hardware: Hardware | None = None):
        self.recipe = recipe
        self.layout = layout
        self.hardware = hardware or Hardware()
        self.te: TEResolution | None = None
        """The TE resolution (policies as TE runs them, substitutions) when the backend is te, else None."""
        self._te_modules: dict[str, TEResolution | None] = {}
        """On TE: each ``modules:`` override's resolution by pattern (the recipe with that override's policies)."""
        self.backend, self.backend_reason = self._resolve_backend()
        self._cache: dict[frozenset[Role], StepPlan] = {}

    # -- static decisions --------------------------------------------------------------------------------------
    def _resolve_backend(self) -> tuple[Backend, str]:
        want = self.recipe.backend
        hw = self.hardware
        te_ready = hw.has_fp8  # backends/te.py ships in every build; TE itself is the hardware's part (te_version)
        if not self.recipe.is_fp8:
            if want is Backend.EMULATED or not te_ready:
                return Backend.EMULATED, "no FP8 role: every GEMM runs BF16"
            # BF16 in TE's layers, the kernels the FP8 runs use, so a BF16 baseline differs from them by FP8
            # alone (the emulated backend's local layers would add unfused attention and other kernels)
            self.te = resolve_te(self.recipe, hw.compute_capability, hw.name)  # unsupported: no stage is FP8
            return Backend.TE, "no FP8 role: every GEMM runs BF16 in Transformer Engine's layers"
        if want is Backend.EMULATED:
            return Backend.EMULATED, "requested"
        if want is Backend.TE and not te_ready:
            raise RecipeError([f"backend: 'te' needs a CUDA GPU with FP8 (sm_89+) and Transformer Engine; this "
                               f"machine has {hw.describe()}; set backend: emulated (or auto)"])
        if not te_ready:
            return Backend.EMULATED, f"auto: {hw.describe()} has no Transformer Engine FP8 backend"
        resolution = resolve_te(self.recipe, hw.compute_capability, hw.name)
        resolution = self._with_module_overrides(self._te_attention_substitution(resolution))
        if want is Backend.TE:
            refusal = resolution.refusal()
            if refusal:  # one line, before any model is built: the user asked for exactly this recipe on TE
                raise RecipeError([refusal])
            self.te = resolution
            return Backend.TE, "requested"
        if resolution.unsupported:
            return Backend.EMULATED, (f"auto: the emulated backend runs the whole model as asked, because "
                                      f"{resolution.unsupported}")
        self.te = resolution
        n = len(resolution.substitutions)
        return Backend.TE, "auto: FP8 GPU with Transformer Engine" + (
            f"; {n} setting{'s' * (n > 1)} substituted, see below" if n else "")

    def _te_attention_substitution(self, resolution: TEResolution) -> TEResolution:
        """``attention: fp8`` where TE cannot run it under the recipe it resolved to: BF16 attention, said once."""
        if self.recipe.attention is not Attention.FP8 or resolution.unsupported:
            return resolution
        final = final_te_recipe(resolution)
        why = te_attention(final, self.hardware.compute_capability)
        if why is None:
            return resolution
        return dataclasses.replace(resolution, substitutions=resolution.substitutions + (Substitution(
            "attention", "fp8", "FP8 attention", "BF16 attention", why,
            "give activations and gradients delayed scaling, or set attention: bf16"),))

    def _with_module_overrides(self, resolution: TEResolution) -> TEResolution:
        """The recipe's resolution with every ``modules:`` override resolved too (each as the recipe with that
        override's policies; kept in ``_te_modules`` by pattern, the TE recipe of its modules): their substitutions
        join the plan's under ``modules.PATTERN.`` keys, and an override TE cannot run at all makes the plan's (a
        pattern that matches no module is only the plan's warning)."""
        hw, subs = self.hardware, list(resolution.substitutions)
        unsupported, fix = resolution.unsupported, resolution.unsupported_fix
        for override in self.recipe.modules:
            if override.pattern in self.unmatched_module_patterns:
                continue  # (a warning in the plan)
            variant = dataclasses.replace(self.recipe, modules=(), **{
                str(r): override.policy(r) or self.recipe.policy(r) for r in ROLES})
            if not variant.is_fp8:  # BF16 modules, as a bf16_modules pattern makes them
                self._te_modules[override.pattern] = None
                continue
            own = self._te_modules[override.pattern] = resolve_te(variant, hw.compute_capability, hw.name)
            subs += [dataclasses.replace(sub, key=f"modules.{override.pattern}.{sub.key}")
                     for sub in own.substitutions]
            if own.unsupported and not unsupported:
                unsupported, fix = f"modules.{override.pattern}: {own.unsupported}", own.unsupported_fix
        if not unsupported:
            unsupported, fix = self._indistinct_delayed(resolution)
        return dataclasses.replace(resolution, substitutions=tuple(subs), unsupported=unsupported,
                                   unsupported_fix=fix)

    def _indistinct_delayed(self, resolution: TEResolution) -> tuple[str | None, str]:
        """Two delayed-scaling states (the recipe's, a ``modules:`` override's; forward or backward) that TE would
        keep in one amax buffer (:func:`~fp8_recipes.plan.te.delayed_buffer_keys`: the same direction, format, margin
        and history length) but update with different amax algorithms or scale rules: one would update both."""
        seen: dict[tuple, tuple[str, tuple]] = {}
        named = [("the recipe", resolution)] + [(f"modules.{p}", r) for p, r in self._te_modules.items() if r]
        for where, res in named:
            for te_key, full in delayed_buffer_keys(res):
                other = seen.setdefault(te_key, (where, full))
                if other[1] != full:
                    return (f"{where}: {te_key[0]} delayed scaling that differs from {other[0]}'s only in "
                            f"amax_compute_algo, percentile or pow2_scales, which Transformer Engine keys together "
                            f"(one would update both)",
                            "give it another margin or amax_history_len too, or set backend: emulated")
        return None, ""

    @property
    def te_resolutions(self) -> tuple[TEResolution, ...]:
        """On TE: the recipe's resolution, then each ``modules:`` override's (empty on the emulated backend)."""
        return (self.te, *(r for r in self._te_modules.values() if r is not None)) if self.te is not None else ()

    def _te_resolution(self, name: str) -> TEResolution | None:
        """The TE resolution module ``name`` runs: its ``modules:`` override's (None: the override keeps every role
        BF16), else the recipe's."""
        override = self.module_override(name)
        return self._te_modules[override.pattern] if override is not None else self.te

    def attention_layers(self, roles: frozenset[Role]) -> frozenset[int]:
        """Layers whose core attention runs FP8 while `roles` are on: with ``attention: fp8``, once activations and
        gradients both run FP8, in every layer not kept BF16 by ``bf16_first`` / ``bf16_last`` (and on TE only
        where TE runs it: see the substitutions)."""
        if self.recipe.attention is not Attention.FP8 or not {Role.ACTIVATIONS, Role.GRADIENTS} <= roles:
            return frozenset()
        if any(s.key == "attention" for s in self.substitutions):
            return frozenset()
        rules, n = self.recipe.layers, self.layout.num_layers
        return frozenset(range(rules.bf16_first, max(rules.bf16_first, n - rules.bf16_last)))

    def final_step(self) -> int:
        """The first step with every FP8 role on (the plan's last stage)."""
        return max(self.recipe.schedule.role_start(r) for r in ROLES)

    def fp8_param_layers(self) -> dict[int, TERecipe]:
        """Recipe ``fp8_param: true``: the layers whose weights are stored in FP8, each with the TE recipe its
        weights are quantized under (the one the layer runs under: the plan has one stage then). A layer qualifies
        when every linear of it runs FP8 at the final stage; BF16 layers, the LM head and the embeddings keep BF16
        weights. Empty when the recipe does not ask, or :meth:`fp8_param_problem` refuses it."""
        if not self.recipe.fp8_param or self.fp8_param_problem() is not None:
            return {}
        return self._fp8_param_layers()

    def _fp8_param_layers(self) -> dict[int, TERecipe]:
        out = {}
        for mp in self.at(self.final_step()).modules.values():
            if mp.layer is not None and mp.te is not None:
                out.setdefault(mp.layer, mp.te)
        return dict(sorted(out.items()))

    def te_choices(self, names: Sequence[str]) -> list[tuple[int, list[TERecipe | None]]]:
        """Per stage of the run, its first step and the TE recipe each of ``names`` runs under there (None: BF16)."""
        return [(first, [self.at(first).modules[n].te for n in names]) for first, _, _ in self.stages()]

    def grouped_experts_problem(self, grouped: Mapping[str, tuple[str, ...]] | None = None) -> str | None:
        """Why Megatron-Core's grouped experts (model ``moe_grouped_gemm: true``: a layer's experts in one TE
        GroupedLinear per fc, under one autocast) cannot run this plan on the te backend, or None. ``grouped``: each
        grouped linear's expert rows (megatron/model.py ``grouped_expert_rows``); by default every MoE layer's
        experts per fc (what the ranks of any expert-parallel size hold between them)."""
        if self.te is None:
            return None
        if grouped is None:
            by_fc: dict[str, list[str]] = {}
            for name in self.layout.module_names:
                if self.layout.expert_of(name) is not None:
                    by_fc.setdefault(_EXPERT_RE.sub(".experts.", name), []).append(name)
            grouped = {k: tuple(v) for k, v in by_fc.items()}
        for name, rows in grouped.items():
            for first, choices in self.te_choices(rows):
                odd = next((r for r, c in zip(rows, choices) if c != choices[0]), None)
                if odd is not None:
                    return (f"{odd} runs otherwise than {rows[0]} from step {first}, and model.moe_grouped_gemm=true "
                            f"runs a layer's experts in one TE GroupedLinear ({name}) under one recipe; give those "
                            f"experts one policy (recipe modules: / layers.bf16_modules), or set "
                            f"model.moe_grouped_gemm=false")
        return None

    def fp8_param_problem(self) -> str | None:
        """Why ``fp8_param: true`` cannot run with this plan (one line naming the key and the fix), or None. The
        schema already refused a BF16 weights role and a schedule with stages."""
        if not self.recipe.fp8_param:
            return None
        if self.te is None:
            return (f"fp8_param: true needs the te backend (Transformer Engine keeps the weights as FP8 tensors); this "
                    f"plan runs the {self.backend} backend ({self.backend_reason}); set fp8_param: false")
        final = self.at(self.final_step())
        layers = self._fp8_param_layers()
        for mp in final.modules.values():
            if mp.layer in layers and mp.te is None:
                return (f"fp8_param: true stores each layer's weights in one precision, and {mp.bf16_reason} keeps "
                        f"{mp.name} BF16 inside FP8 layer {mp.layer}; match whole layers (e.g. "
                        f"'decoder.layers.{mp.layer}.*') or set fp8_param: false")
            if mp.layer in layers and mp.te != layers[mp.layer]:
                return (f"fp8_param: true quantizes each layer's weights under one TE recipe, and {mp.override} "
                        f"gives {mp.name} another inside layer {mp.layer}; give the whole layer one policy or set "
                        f"fp8_param: false")
        te = next(iter(layers.values()), None)
        if te is None:
            return None  # every layer BF16: nothing to store in FP8
        odd = next((i for i, t in layers.items() if t.recipe is not te.recipe), None)
        if odd is not None:
            return (f"fp8_param: true hands Megatron-Core's optimizer one FP8 recipe for every FP8 weight, and layer "
                    f"{odd} runs {layers[odd].recipe} where layer {next(iter(layers))} runs {te.recipe}; give the FP8 "
                    f"layers one scaling kind or set fp8_param: false")
        if te.recipe not in _FP8_PARAM_RECIPES:
            return (f"fp8_param: true: the FP8 layers run {te.recipe} here, and Transformer Engine runs an FP8-stored "
                    f"weight only under the recipe class it was quantized with ({', '.join(_FP8_PARAM_RECIPES)}); give "
                    f"weights, activations and gradients one scaling with e4m3 forward, or set fp8_param: false")
        if te.weights.scaling is Scaling.BLOCKWISE and te.weights.block[0] == 1:
            return ("fp8_param: true with weights.block [1, 128]: Transformer Engine's cast of the fp32 main params to "
                    "FP8 weights (quantize_master_weights) handles 128x128 weight blocks only; set weights.block: "
                    "[128, 128] or fp8_param: false")
        return None

    @property
    def substitutions(self) -> tuple[Substitution, ...]:
        """Settings the TE backend runs differently from the recipe (empty for the emulated backend)."""
        return self.te.substitutions if self.te else ()

    def bf16_reason(self, name: str) -> str | None:
        rules = self.recipe.layers
        for pat in rules.bf16_modules:
            if fnmatch.fnmatchcase(name, pat):
                return f"bf16_modules '{pat}'"
        layer = self.layout.layer_of(name)
        if layer is None:
            if name.split(".")[-1] == "output_layer" and not rules.fp8_output_layer:
                return "LM head (fp8_output_layer: false)"
            return None
        if layer < rules.bf16_first:
            return f"bf16_first: {rules.bf16_first}"
        if layer >= self.layout.num_layers - rules.bf16_last:
            return f"bf16_last: {rules.bf16_last}"
        return None

    @cached_property
    def unmatched_patterns(self) -> tuple[str, ...]:
        """bf16_modules patterns that match no module of this model (usually a typo)."""
        return tuple(p for p in self.recipe.layers.bf16_modules
                     if not any(fnmatch.fnmatchcase(n, p) for n in self.layout.module_names))

    @cached_property
    def unmatched_module_patterns(self) -> tuple[str, ...]:
        """``modules:`` patterns that match no module of this model (usually a typo)."""
        return tuple(m.pattern for m in self.recipe.modules
                     if not any(fnmatch.fnmatchcase(n, m.pattern) for n in self.layout.module_names))

    @cached_property
    def idle_module_patterns(self) -> tuple[tuple[str, str], ...]:
        """(pattern, why) for ``modules:`` patterns that match modules but change less than they say: every module
        they match takes an earlier pattern (the first match wins) or stays BF16 for a reason of its own; or they
        rotate one wgrad operand only (that GEMM then runs without the RHT)."""
        out = []
        for m in self.recipe.modules:
            names = [n for n in self.layout.module_names if fnmatch.fnmatchcase(n, m.pattern)]
            if not names:
                continue  # (unmatched_module_patterns)
            mine = [n for n in names if self.module_override(n) is m]
            if not mine:
                first = self.module_override(names[0]).pattern
                out.append((m.pattern, f"does nothing: every module it matches takes the earlier pattern '{first}' "
                                       f"(the first match wins); put it first, or narrow '{first}'"))
            elif all(self.bf16_reason(n) for n in mine):
                out.append((m.pattern, f"does nothing: every module it matches stays BF16 ({mine[0]}: "
                                       f"{self.bf16_reason(mine[0])})"))
            elif (role := one_sided_rht(lambda r: self.recipe.module_policy(mine[0], r))) is not None:
                other = Role.GRADIENTS if role is Role.ACTIVATIONS else Role.ACTIVATIONS
                out.append((m.pattern, f"leaves its modules {role}.rht without {other}.rht: their wgrad GEMM runs "
                                       f"without the RHT (it cancels only when both operands are rotated)"))
        return tuple(out)

    def roles_fp8_at(self, step: int) -> frozenset[Role]:
        sched = self.recipe.schedule
        return frozenset(r for r in ROLES if self.recipe.policy(r).is_fp8 and step >= sched.role_start(r))

    def stage_label(self, roles: frozenset[Role], step: int) -> str:
        if not self.recipe.is_fp8:
            return "bf16"
        if not roles:
            return "bf16 warmup" if step < self.recipe.schedule.bf16_warmup_steps else "bf16"
        return "fp8 " + "+".join(r.value[0] for r in ROLES if r in roles)

    # -- per step ----------------------------------------------------------------------------------------------
    def at(self, step: int) -> StepPlan:
        roles = self.roles_fp8_at(step)
        cached = self._cache.get(roles)
        if cached is None:
            attention = self.attention_layers(roles)
            layers_te = {}
            if self.te is not None:
                modules = {n: self._te_module_plan(n, roles, attention) for n in self.layout.module_names}
                note = te_stage_note(roles, self.roles_fp8_at(10**12))
                layers_te = {i: self._layer_te(i, roles, attention) for i in range(self.layout.num_layers)}
            else:
                modules, note = {n: self._module_plan(n, roles) for n in self.layout.module_names}, ""
            cached = self._cache[roles] = StepPlan(step, self.stage_label(roles, step), roles, modules, note,
                                                   attention, layers_te)
        if cached.step != step:
            return dataclasses.replace(cached, step=step, stage=self.stage_label(roles, step))
        return cached

    def te_differences(self) -> frozenset[tuple[str, Role]]:
        """On TE: each (module, role) that TE runs under another policy than the recipe gives it (a substitution of
        its resolution); empty on the emulated backend, which runs every policy as asked."""
        if self.te is None:
            return frozenset()
        out = set()
        for name in self.layout.module_names:
            resolution = self._te_resolution(name)
            if resolution is None or self.bf16_reason(name) is not None:
                continue
            asked = self.module_policies(name)
            out |= {(name, r) for r in ROLES if asked[r].is_fp8 and resolution.policies[r] != asked[r]}
        return frozenset(out)

    def module_override(self, name: str) -> ModulePolicies | None:
        """The recipe's first ``modules:`` entry whose pattern matches ``name``, else None."""
        return self.recipe.module_override(name)

    def module_policies(self, name: str) -> dict[Role, TensorPolicy]:
        """The policy each role runs under in module ``name``: its ``modules:`` override's, else the recipe's."""
        return {r: self.recipe.module_policy(name, r) for r in ROLES}

    def module_policy(self, name: str, role: Role) -> TensorPolicy:
        return self.module_policies(name)[role]

    def _module_plan(self, name: str, roles: frozenset[Role]) -> ModulePlan:
        reason = self.bf16_reason(name)
        override = self.module_override(name)
        policies = self.module_policies(name)
        on = {r: policies[r] if reason is None and r in roles and policies[r].is_fp8 else None for r in ROLES}
        gemms = {}
        for gemm, (a, b) in GEMM_OPERANDS.items():
            ops = ((a, on[a]), (b, on[b]))
            ops = _wgrad_rht(ops) if gemm is Gemm.WGRAD else ops
            gemms[gemm] = GemmPlan(gemm, self._execution(ops), ops)
        note = f"modules '{override.pattern}': {override.describe()}" if override and reason is None else None
        return ModulePlan(name, self.layout.layer_of(name), reason, gemms, override=note)

    def _layer_te(self, layer: int, roles: frozenset[Role], attention: frozenset[int]) -> TERecipe | None:
        rules = self.recipe.layers
        if layer < rules.bf16_first or layer >= self.layout.num_layers - rules.bf16_last:
            return None
        te = te_recipe_for(self.te, roles)
        return dataclasses.replace(te, fp8_dpa=True) if te is not None and layer in attention else te

    def _te_module_plan(self, name: str, roles: frozenset[Role], attention: frozenset[int]) -> ModulePlan:
        """A module on the TE backend: the stage's TE recipe of its resolution (its ``modules:`` override's, else
        the recipe's and its layer's, :meth:`_layer_te`) unless the module is kept BF16 (the LM head runs it
        through a te.Linear when ``fp8_output_layer`` is on: megatron/te_layers.py); an override whose every role is
        BF16 is a BF16 module."""
        reason = self.bf16_reason(name)
        override = self.module_override(name)
        resolution = self._te_resolution(name)
        te = te_recipe_for(resolution, roles) if reason is None and resolution is not None else None
        layer = self.layout.layer_of(name)
        if te is not None and override is None and layer is not None:
            te = self._layer_te(layer, roles, attention)  # (the same object: its layer's autocast runs it)
        gemms = {}
        for gemm, (a, b) in GEMM_OPERANDS.items():
            fp8 = te is not None and (gemm is Gemm.FPROP or not te.forward_only)
            ops = tuple((r, te.policy(r) if fp8 else None) for r in (a, b))
            gemms[gemm] = GemmPlan(gemm, Execution.FP8 if fp8 else Execution.BF16, ops)
        note = f"modules '{override.pattern}': {override.describe()}" if override and reason is None else None
        return ModulePlan(name, self.layout.layer_of(name), reason, gemms, te, override=note)

    def _execution(self, operands) -> Execution:
        if all(p is None for _, p in operands):
            return Execution.BF16
        # The emulated backend's modules (TE's are planned by _te_module_plan): every FP8 GEMM is fake-quantized,
        # which runs any per-role mix on any device.
        return Execution.EMULATED

    def stages(self, max_steps: int | None = None) -> list[tuple[int, int | None, str]]:
        """[(first_step, last_step or None, label)] over the run: where the set of FP8 roles changes."""
        starts = sorted({0} | {self.recipe.schedule.role_start(r) for r in ROLES if self.recipe.policy(r).is_fp8})
        if max_steps is not None:
            starts = [s for s in starts if s < max_steps] or [0]
        out = []
        for i, s in enumerate(starts):
            end = starts[i + 1] - 1 if i + 1 < len(starts) else (max_steps - 1 if max_steps else None)
            out.append((s, end, self.stage_label(self.roles_fp8_at(s), s)))
        return out


def _wgrad_rht(operands):
    """The wgrad GEMM's operands with the RHT where it cancels: on both, or (a stage or module that keeps one of
    them BF16 or FP8) on neither; the RHT rotates only the columnwise copies wgrad reads."""
    if all(p is not None and p.rht for _, p in operands):
        return operands
    return tuple((r, dataclasses.replace(p, rht=False) if p is not None and p.rht else p) for r, p in operands)


_FP8_PARAM_RECIPES = ("DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling", "MXFP8BlockScaling")
"""TE recipe classes whose weights TE 2.20 can hold as FP8 parameters: each quantizer's ``_get_compatible_recipe``
names one of them, and a module's forward refuses any other autocast recipe (``Recipe mismatch``)."""
