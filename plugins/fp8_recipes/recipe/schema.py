"""The typed FP8 recipe: what a YAML file in ``recipes/`` means, checked when it is loaded.

A recipe says, per tensor role (weights, activations, gradients), how FP8 scaling works; when each role turns
FP8 (schedule); and which layers or modules stay BF16 (layers). :meth:`Recipe.from_dict` accepts the YAML
users write, a role as a bare string (``weights: mxfp8``), and the form of NVIDIA's NeMo blog
(``fp8_recipe: {name: hybrid, weights: mxfp8, activations: blockwise, gradients: tensorwise, block_size: [128, 128]}``).
Every problem is reported as ``dotted.key: 'bad value' ... allowed ...`` in a :class:`RecipeError` (a ValueError),
all problems of one recipe at once.

This module imports only checks.py (the shared key checks), nothing else of ours: it is the bottom floor.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from fp8_recipes.checks import ConfigError, KeyReader, fmt

__all__ = [
    "AmaxAlgo", "AmaxReduction", "Attention", "Backend", "Format", "LayerRules", "ModulePolicies", "MxRounding", "Recipe",
    "RecipeError", "Role", "Scaling", "Schedule", "TensorPolicy", "default_policy",
]


class Scaling(StrEnum):
    NONE = "none"              # high precision (BF16)
    DELAYED = "delayed"        # per-tensor scale from an amax history of earlier steps
    TENSORWISE = "tensorwise"  # per-tensor current scaling: scale from this tensor's own amax
    BLOCKWISE = "blockwise"    # one scale per block of `block` elements (1x128, 128x128, ...)
    MXFP8 = "mxfp8"            # OCP MX: 32-element blocks along the reduction dim, E8M0 (power-of-two) scales
    NVFP4 = "nvfp4"            # NVIDIA's 4-bit: E2M1 codes, an E4M3 scale per 16 values, one FP32 scale per tensor


class Format(StrEnum):
    E4M3 = "e4m3"  # max 448, 3 mantissa bits: forward tensors
    E5M2 = "e5m2"  # max 57344, 2 mantissa bits: range for gradients
    E2M1 = "e2m1"  # FP4, max 6, 1 mantissa bit: NVFP4's codes (scaling: nvfp4 only)


class AmaxAlgo(StrEnum):
    MAX = "max"                  # max over the history window (TE default)
    MOST_RECENT = "most_recent"  # the last step's amax
    PERCENTILE = "percentile"    # the `percentile`-th percentile of the window (emulated backend only)


class MxRounding(StrEnum):
    RCEIL = "rceil"  # NVIDIA's rule: E8M0 = amax/fp8_max rounded *up* to a power of two (never saturates)
    FLOOR = "floor"  # OCP MX v1.0: 2^(floor(log2 amax) - emax of the element format) (may saturate)


class Role(StrEnum):
    WEIGHTS = "weights"
    ACTIVATIONS = "activations"
    GRADIENTS = "gradients"


class Backend(StrEnum):
    AUTO = "auto"          # Transformer Engine when a GPU and TE are present, else emulated
    TE = "te"              # real FP8 GEMMs through Transformer Engine; refuses what TE cannot run
    EMULATED = "emulated"  # fake-quantization in high precision; runs anything anywhere


class Attention(StrEnum):
    """The core attention (softmax(Q K^T) V): BF16, or FP8 as Transformer Engine's FP8 attention quantizes it."""

    BF16 = "bf16"
    FP8 = "fp8"


class AmaxReduction(StrEnum):
    """Over which ranks delayed-scaling amaxes are MAX-reduced before a scale is derived from them."""

    DATA_TENSOR = "data_tensor"  # data-parallel x tensor-parallel ranks: one set of scales on every rank, the
    #                              default of Megatron-Core + TE (parallel_state.get_amax_reduction_group)
    DATA = "data"                # data-parallel group only (with TP > 1, each TP rank scales its own shard)
    TENSOR = "tensor"            # tensor-parallel group only (Megatron-LM's --tp-only-amax-red)
    NONE = "none"                # each rank keeps its own amax


ROLES: tuple[Role, ...] = (Role.WEIGHTS, Role.ACTIVATIONS, Role.GRADIENTS)

# Role-dependent defaults, in plain view. Gradients default to E5M2 (TE's HYBRID format: E4M3 forward, E5M2
# backward); blockwise blocks default to 128x128 for weights and 1x128 for activations and gradients (TE's
# Float8BlockScaling and DeepSeek-V3).
DEFAULT_FORMAT = {Role.WEIGHTS: Format.E4M3, Role.ACTIVATIONS: Format.E4M3, Role.GRADIENTS: Format.E5M2}
DEFAULT_BLOCK = {Role.WEIGHTS: (128, 128), Role.ACTIVATIONS: (1, 128), Role.GRADIENTS: (1, 128)}
MXFP8_BLOCK = 32
NVFP4_BLOCK = (1, 16)    # NVFP4's block along the reduction dim (TE's NVFP4BlockScaling, NVIDIA's paper)
NVFP4_WEIGHT_BLOCK = (16, 16)  # the 2-D block TE has for weights only (the same copy serves fprop and dgrad)
MAX_MARGIN = 16  # 2^16 of headroom already wastes most of E4M3's range; more lets power-of-two scales reach 0
MAX_HISTORY = 1 << 16     # amax_history_len: TE's default is 1024; a longer window is one nobody trains with
MAX_BLOCK = 1 << 16       # a block side: no tensor dimension of a trained LLM is longer
MAX_STEP = 10**9          # schedule steps: past any run's max_steps

# Spellings people bring from other tools, mapped to ours for the error message.
_HINTS = {
    "current": "tensorwise", "per_tensor": "tensorwise", "per-tensor": "tensorwise", "tensor": "tensorwise",
    "block": "blockwise", "mx": "mxfp8", "mxfp": "mxfp8", "bf16": "none", "fp16": "none", "off": "none",
    "hybrid": "e4m3 (or e5m2 for gradients)", "fp8": "e4m3",
}


class RecipeError(ConfigError):
    """One or more problems in a recipe; ``str()`` is one line per problem, each naming the dotted key."""

    def __init__(self, problems: Sequence[str], source: str | None = None):
        self.problems = list(problems)
        self.source = source
        prefix = f"{source}: " if source else ""
        super().__init__("\n".join(prefix + p for p in self.problems))


# ---------------------------------------------------------------------------------------------------------------
# The typed objects


@dataclass(frozen=True)
class TensorPolicy:
    """How one tensor role is quantized."""

    scaling: Scaling = Scaling.NONE
    """none | delayed | tensorwise | blockwise | mxfp8."""
    format: Format = Format.E4M3
    """e4m3 | e5m2."""
    margin: int = 0
    """Scale divided by 2^margin: headroom against the next step's larger values (delayed, tensorwise, blockwise)."""
    amax_history_len: int = 1024
    """Delayed scaling: how many past amaxes the scale is taken from (TE default 1024)."""
    amax_compute_algo: AmaxAlgo = AmaxAlgo.MAX
    """Delayed scaling: max | most_recent | percentile over the history."""
    percentile: float = 99.9
    """With amax_compute_algo=percentile: which percentile of the history (0 < p <= 100)."""
    amax_epsilon: float = 0.0
    """Lower bound on the amax before the scale is computed (tensorwise, blockwise)."""
    pow2_scales: bool = False
    """Round scales down to a power of two (exact rescaling; TE's default for blockwise)."""
    block: tuple[int, int] = DEFAULT_BLOCK[Role.ACTIVATIONS]
    """Blockwise: block shape [rows, cols] of the tensor as the GEMM reads it (last dim = reduction dim)."""
    mx_rounding: MxRounding = MxRounding.RCEIL
    """MXFP8: how the E8M0 block exponent is chosen: rceil (NVIDIA hardware) | floor (OCP MX v1.0)."""
    rht: bool = False
    """NVFP4, activations and gradients: a 16x16 random Hadamard transform on the wgrad GEMM's copies (both
    operands, along the tokens it sums over; TE's NVFP4BlockScaling ``disable_rht=False``)."""
    stochastic_rounding: bool = False
    """NVFP4, gradients: round the E2M1 codes stochastically (unbiased) instead of to nearest even."""

    @property
    def is_fp8(self) -> bool:
        return self.scaling is not Scaling.NONE

    @property
    def one_copy_both_ways(self) -> bool:
        """Whether one quantized copy reads the same along either dim, so a backward GEMM can reuse the forward's:
        a per-tensor scale or a square block (16x16 NVFP4, 128x128 blockwise), never 1xN blocks or MXFP8's 1x32,
        and never with the RHT or stochastic rounding (each copy gets its own)."""
        if self.scaling is Scaling.NONE or self.rht or self.stochastic_rounding:
            return False
        if self.scaling in (Scaling.TENSORWISE, Scaling.DELAYED):
            return True
        return self.scaling in (Scaling.BLOCKWISE, Scaling.NVFP4) and self.block[0] == self.block[1]

    def relevant_fields(self) -> tuple[str, ...]:
        """The fields that mean something for this scaling mode (what `show` prints)."""
        if self.scaling is Scaling.NONE:
            return ("scaling",)
        common = ("scaling", "format")
        if self.scaling is Scaling.DELAYED:
            algo = ("percentile",) if self.amax_compute_algo is AmaxAlgo.PERCENTILE else ()
            return common + ("margin", "amax_history_len", "amax_compute_algo") + algo + ("pow2_scales",)
        if self.scaling is Scaling.TENSORWISE:
            return common + ("margin", "amax_epsilon", "pow2_scales")
        if self.scaling is Scaling.BLOCKWISE:
            return common + ("block", "margin", "amax_epsilon", "pow2_scales")
        if self.scaling is Scaling.NVFP4:
            return common + ("block", "rht", "stochastic_rounding")
        return common + ("mx_rounding",)

    def to_dict(self) -> dict[str, Any]:
        out = {}
        for name in self.relevant_fields():
            v = getattr(self, name)
            out[name] = list(v) if isinstance(v, tuple) else (str(v) if isinstance(v, StrEnum) else v)
        return out

    def describe(self) -> str:
        """Short human form, e.g. ``blockwise e4m3 1x128 pow2``."""
        if not self.is_fp8:
            return "bf16"
        parts = [str(self.scaling), str(self.format)]
        if self.scaling in (Scaling.BLOCKWISE, Scaling.NVFP4):
            parts.append(f"{self.block[0]}x{self.block[1]}")
        if self.scaling is Scaling.NVFP4:
            parts += ["rht"] * self.rht + ["sr"] * self.stochastic_rounding
        if self.scaling is Scaling.MXFP8:
            parts.append(f"1x{MXFP8_BLOCK} e8m0/{self.mx_rounding}")
        if self.scaling is Scaling.DELAYED:
            algo = str(self.amax_compute_algo)
            if self.amax_compute_algo is AmaxAlgo.PERCENTILE:
                algo = f"p{self.percentile:g}"
            parts.append(f"hist {self.amax_history_len} {algo}")
        if self.margin and self.scaling not in (Scaling.MXFP8, Scaling.NVFP4):
            parts.append(f"margin {self.margin}")
        if self.pow2_scales and self.scaling not in (Scaling.MXFP8, Scaling.NVFP4):
            parts.append("pow2")
        return " ".join(parts)


def default_policy(role: Role) -> TensorPolicy:
    """A role's policy when the recipe says nothing of it: the field defaults with the role's format and block."""
    return TensorPolicy(format=DEFAULT_FORMAT[role], block=DEFAULT_BLOCK[role])


@dataclass(frozen=True)
class RoleSteps:
    """The step at which each role turns FP8 (staged enablement)."""

    weights: int = 0
    activations: int = 0
    gradients: int = 0

    def __getitem__(self, role: Role | str) -> int:
        return getattr(self, str(role))


@dataclass(frozen=True)
class Schedule:
    bf16_warmup_steps: int = 0
    """Everything BF16 for the first N steps."""
    enable: RoleSteps = field(default_factory=RoleSteps)
    """Step at which each role turns FP8 (never before bf16_warmup_steps)."""
    full_precision_eval_interval: int = 0
    """Every N steps also evaluate with everything in high precision (0 = off)."""

    def role_start(self, role: Role | str) -> int:
        """First step at which `role` runs FP8 (warmup included)."""
        return max(self.bf16_warmup_steps, self.enable[role])


@dataclass(frozen=True)
class LayerRules:
    bf16_first: int = 0
    """The first N transformer layers stay BF16."""
    bf16_last: int = 0
    """The last N transformer layers stay BF16."""
    bf16_modules: tuple[str, ...] = ()
    """fnmatch glob patterns over module names (e.g. "*.linear_qkv", "decoder.layers.3.*") forced to BF16."""
    fp8_output_layer: bool = False
    """Quantize the LM head too, under the roles' policies: input (activations), weight (weights; the word embedding
    when embeddings are tied) and the logits' gradient (gradients). Both backends; on TE through a te.Linear."""


@dataclass(frozen=True)
class ModulePolicies:
    """``modules: {PATTERN: {ROLE: policy}}``: the modules whose names match the fnmatch ``pattern`` run the given
    roles under these policies instead of the recipe's (the other roles as the recipe says); the first matching
    pattern wins. A role may become BF16 there (``scaling: none``) or change its scaling, but not turn FP8 where
    the recipe keeps it BF16 (its schedule is the recipe's)."""

    pattern: str
    policies: tuple[tuple[Role, TensorPolicy], ...]

    def policy(self, role: Role) -> TensorPolicy | None:
        return next((p for r, p in self.policies if r is role), None)

    def describe(self) -> str:
        """``gradients tensorwise e5m2, activations delayed e4m3 hist 16 max``."""
        return ", ".join(f"{r} {p.describe()}" for r, p in self.policies)


@dataclass(frozen=True)
class Recipe:
    name: str = "bf16"
    description: str = ""
    backend: Backend = Backend.AUTO
    weights: TensorPolicy = field(default_factory=lambda: default_policy(Role.WEIGHTS))
    activations: TensorPolicy = field(default_factory=lambda: default_policy(Role.ACTIVATIONS))
    gradients: TensorPolicy = field(default_factory=lambda: default_policy(Role.GRADIENTS))
    schedule: Schedule = field(default_factory=Schedule)
    layers: LayerRules = field(default_factory=LayerRules)
    amax_reduction: AmaxReduction = AmaxReduction.DATA_TENSOR
    """Delayed scaling: the ranks whose amaxes are MAX-reduced (data_tensor | data | tensor | none); data_tensor
    is Megatron-Core's choice, and with TP = 1 the same as data."""
    attention: Attention = Attention.BF16
    """fp8: the core attention in FP8 too, in the layers and stages whose activations and gradients run FP8: Q, K, V,
    the softmax output and the attention output quantized with the activations' policy, their gradients (dO, the
    scores' gradient, dQ/dK/dV) with the gradients' policy, as Transformer Engine's FP8 attention does. Needs
    per-tensor (delayed or tensorwise) activations and gradients."""
    fp8_param: bool = False
    """Store the FP8 layers' weights in FP8 (Megatron-Core's ``fp8_param``, Megatron-LM's --fp8-param-gather): each
    linear weight is a Transformer Engine FP8 tensor quantized once per optimizer step from the fp32 main params, not
    a BF16 copy quantized at every forward (less memory). BF16 layers (bf16_first/bf16_last/bf16_modules), the LM
    head and the embeddings keep BF16 weights. TE backend only; the weights are FP8 from step 0 (no BF16 stage)."""
    modules: tuple[ModulePolicies, ...] = ()
    """Per-module policy overrides (:class:`ModulePolicies`), in the recipe's order; the emulated backend runs them."""

    def policy(self, role: Role | str) -> TensorPolicy:
        return getattr(self, str(role))

    def module_override(self, name: str) -> ModulePolicies | None:
        """The first ``modules:`` entry whose pattern matches module ``name`` (fnmatch, case-sensitive), else None."""
        return next((m for m in self.modules if fnmatch.fnmatchcase(name, m.pattern)), None)

    def module_policy(self, name: str, role: Role | str) -> TensorPolicy:
        """The policy `role` runs under in module ``name``: its ``modules:`` override's, else the recipe's."""
        override = self.module_override(name)
        return (override.policy(Role(role)) if override else None) or self.policy(role)

    @property
    def is_fp8(self) -> bool:
        return any(self.policy(r).is_fp8 for r in ROLES)

    def stated_policies(self) -> list[tuple[Role, TensorPolicy]]:
        """Every (role, policy) the recipe states: its roles' and each ``modules:`` entry's (what a setting that
        applies to one kind of scaling may find work in)."""
        return [(r, self.policy(r)) for r in ROLES] + [(r, p) for m in self.modules for r, p in m.policies]

    def to_dict(self) -> dict[str, Any]:
        """The resolved recipe as plain YAML-able data (what `fp8-recipes show` prints)."""
        return {
            "name": self.name,
            "description": self.description,
            "backend": str(self.backend),
            **{str(r): self.policy(r).to_dict() for r in ROLES},
            "schedule": {
                "bf16_warmup_steps": self.schedule.bf16_warmup_steps,
                "enable": dataclasses.asdict(self.schedule.enable),
                "full_precision_eval_interval": self.schedule.full_precision_eval_interval,
            },
            "layers": {
                "bf16_first": self.layers.bf16_first,
                "bf16_last": self.layers.bf16_last,
                "bf16_modules": list(self.layers.bf16_modules),
                "fp8_output_layer": self.layers.fp8_output_layer,
            },
            "amax_reduction": str(self.amax_reduction),
            "attention": str(self.attention),
            "fp8_param": self.fp8_param,
            "modules": {m.pattern: {str(r): p.to_dict() for r, p in m.policies} for m in self.modules},
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None, source: str | None = None) -> Recipe:
        """Validate and build a Recipe; raises :class:`RecipeError` listing every problem with its key."""
        return _RecipeReader(source).read(data)


# ---------------------------------------------------------------------------------------------------------------
# Reading and validation


_POLICY_KEYS = {f.name for f in dataclasses.fields(TensorPolicy)}
_TOP_KEYS = {f.name for f in dataclasses.fields(Recipe)} | {"fp8_recipe", "defaults", "debug"}
_NEMO_BLOG_KEYS = {"name", "description", "weights", "activations", "gradients", "block_size", "backend"}


def _given(raw: Mapping[str, Any], defaults: Any):
    """``given(name)``: the value the mapping gives for a field, else the field's default (read off `defaults`, an
    instance of the dataclass), so every default is written once, in the dataclass."""
    return lambda name: raw.get(name, getattr(defaults, name))


def one_sided_rht(policy: Callable[[Role], TensorPolicy]) -> Role | None:
    """The wgrad operand whose NVFP4 copy asks for the RHT while the other's does not (None: both or neither):
    ``policy`` gives each role's, a recipe's or a module's."""
    for role, other in ((Role.ACTIVATIONS, Role.GRADIENTS), (Role.GRADIENTS, Role.ACTIVATIONS)):
        p, q = policy(role), policy(other)
        if p.scaling is Scaling.NVFP4 and p.rht and not (q.scaling is Scaling.NVFP4 and q.rht):
            return role
    return None


class _RecipeReader(KeyReader):
    """Turns a mapping into a Recipe, collecting one message per bad key (the scalar readers are KeyReader's)."""

    value_hints = _HINTS

    def __init__(self, source: str | None):
        super().__init__()
        self.source = source

    def block(self, key: str, value: Any, default: tuple[int, int]) -> tuple[int, int]:
        ok = (isinstance(value, Sequence) and not isinstance(value, str) and len(value) == 2
              and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value))
        if not ok:
            self.bad(key, f"{fmt(value)} is not a block shape (expected [rows, cols], two positive integers, "
                          f"e.g. [1, 128] or [128, 128])")
            return default
        if max(value) > MAX_BLOCK:
            self.bad(key, f"{fmt(value)} has a side over {MAX_BLOCK}, longer than any tensor dimension; "
                          f"use e.g. [1, 128] or [128, 128]")
            return default
        return (int(value[0]), int(value[1]))

    # -- structured readers ------------------------------------------------------------------------------------
    def policy(self, key: str, role: Role, value: Any, block_size: Any = None) -> TensorPolicy:
        if isinstance(value, str):  # bare string: `weights: mxfp8`
            value = {"scaling": value}
        if value is None:
            value = {}
        raw = self.mapping(key, value, _POLICY_KEYS)
        d = default_policy(role)  # the defaults are the fields' (each written once, in the dataclasses above)
        given = _given(raw, d)
        scaling = self.enum(f"{key}.scaling", given("scaling"), Scaling, d.scaling)
        if scaling is not Scaling.NONE:  # first: a key that does not apply needs no other check (a BF16 role may
            reported = {"percentile"} | ({"block"} if scaling is Scaling.MXFP8 else set())  # keep its settings)
            for k in sorted(set(raw) - set(TensorPolicy(scaling=scaling).relevant_fields()) - reported):
                users = ", ".join(s.value for s in Scaling if k in TensorPolicy(scaling=s).relevant_fields())
                self.bad(f"{key}.{k}", f"{fmt(raw[k])} does not apply to scaling: {scaling} (only to {users}); "
                                       f"remove it")
        kw: dict[str, Any] = {"scaling": scaling}
        nvfp4 = scaling is Scaling.NVFP4  # (derived defaults, once and visibly: E2M1 codes in 1x16 blocks)
        format_default, block_default = (Format.E2M1, NVFP4_BLOCK) if nvfp4 else (d.format, d.block)
        kw["format"] = self.enum(f"{key}.format", raw.get("format", format_default), Format, format_default)
        kw["margin"] = self.integer(f"{key}.margin", given("margin"), 0, d.margin, maximum=MAX_MARGIN)
        kw["amax_history_len"] = self.integer(f"{key}.amax_history_len", given("amax_history_len"), 1,
                                              d.amax_history_len, maximum=MAX_HISTORY)
        kw["amax_compute_algo"] = self.enum(f"{key}.amax_compute_algo", given("amax_compute_algo"), AmaxAlgo,
                                            d.amax_compute_algo)
        kw["percentile"] = self.number(f"{key}.percentile", given("percentile"), 0.0, 100.0, d.percentile,
                                       lo_open=True)
        kw["amax_epsilon"] = self.number(f"{key}.amax_epsilon", given("amax_epsilon"), 0.0, math.inf, d.amax_epsilon)
        # Derived default, once and visibly: blockwise scales are powers of two unless asked otherwise (TE's
        # Float8BlockScaling default); MXFP8 scales are powers of two by construction.
        pow2_default = scaling in (Scaling.BLOCKWISE, Scaling.MXFP8)
        kw["pow2_scales"] = self.boolean(f"{key}.pow2_scales", raw.get("pow2_scales", pow2_default), pow2_default)
        if scaling is Scaling.MXFP8:
            kw["pow2_scales"] = True
        # the NeMo blog's one block_size is for the blockwise roles only
        use_block_size = block_size is not None and scaling is Scaling.BLOCKWISE
        block = raw.get("block", block_size if use_block_size else list(block_default))
        kw["block"] = self.block(f"{key}.block", block, block_default)
        kw["mx_rounding"] = self.enum(f"{key}.mx_rounding", given("mx_rounding"), MxRounding, d.mx_rounding)
        kw["rht"] = self.boolean(f"{key}.rht", given("rht"), d.rht)
        kw["stochastic_rounding"] = self.boolean(f"{key}.stochastic_rounding", given("stochastic_rounding"),
                                                 d.stochastic_rounding)
        self.nvfp4_checks(key, role, kw)
        if scaling is Scaling.MXFP8 and "block" in raw and tuple(kw["block"]) not in ((1, MXFP8_BLOCK),):
            self.bad(f"{key}.block", f"{fmt(raw['block'])} cannot be set for mxfp8 (blocks are always 32 "
                                     f"elements along the reduction dim); use scaling: blockwise for other shapes")
        if scaling is Scaling.MXFP8:
            kw["block"] = (1, MXFP8_BLOCK)
        if ("percentile" in raw and kw["amax_compute_algo"] is not AmaxAlgo.PERCENTILE
                and not self.has_problem(f"{key}.amax_compute_algo")):
            self.bad(f"{key}.percentile", f"{fmt(raw['percentile'])} is set but amax_compute_algo is not "
                                          f"'percentile'; set amax_compute_algo: percentile or remove percentile")
        return TensorPolicy(**kw)

    def nvfp4_checks(self, key: str, role: Role, kw: Mapping[str, Any]) -> None:
        """E2M1 goes with nvfp4 only; NVFP4 blocks are 1x16 (16x16 for weights); the RHT is for the wgrad GEMM's
        operands (activations, gradients), stochastic rounding for gradients (TE's NVFP4BlockScaling)."""
        scaling, element = kw["scaling"], kw["format"]
        if scaling is not Scaling.NVFP4:
            if element is Format.E2M1 and scaling is not Scaling.NONE:
                self.bad(f"{key}.format", f"'e2m1' is NVFP4's 4-bit element format, not an FP8 one; set scaling: "
                                          f"nvfp4, or format: e4m3 / e5m2 with scaling: {scaling}")
            return
        if element is not Format.E2M1:
            self.bad(f"{key}.format", f"{fmt(str(element))} with scaling: nvfp4, which stores E2M1 codes (its block "
                                      f"scales are E4M3); set format: e2m1 or remove it")
        block = tuple(kw["block"])
        if block not in (NVFP4_BLOCK, NVFP4_WEIGHT_BLOCK):
            self.bad(f"{key}.block", f"{fmt(list(block))} is not an NVFP4 block; use [1, 16] (16 values along the "
                                     f"reduction dim), or [16, 16] for weights")
        elif block == NVFP4_WEIGHT_BLOCK and role is not Role.WEIGHTS:
            self.bad(f"{key}.block", f"[16, 16] 2-D NVFP4 blocks are for weights only (TE quantizes {role} in 1x16 "
                                     f"blocks along the reduction dim); use [1, 16]")
        if kw["rht"] and role is Role.WEIGHTS:
            self.bad(f"{key}.rht", "true, but the RHT rotates the wgrad GEMM's operands (activations and "
                                   "gradients) and weights are not one of them; remove it")
        if kw["stochastic_rounding"] and role is not Role.GRADIENTS:
            self.bad(f"{key}.stochastic_rounding", f"true, but stochastic rounding is for gradients only ({role} "
                                                   f"round to nearest even, as in NVIDIA's recipe); remove it")

    def rht_pair_checks(self, r: Recipe) -> None:
        """The RHT is undone by the product only when both wgrad operands are rotated: activations and gradients
        ask for it together (TE has one switch, ``disable_rht``, for both). A ``modules:`` override may keep one
        of them otherwise (a remedy for one role): its wgrad runs without the RHT, and the plan warns."""
        role = one_sided_rht(r.policy)
        if role is not None:
            other = Role.GRADIENTS if role is Role.ACTIVATIONS else Role.ACTIVATIONS
            self.bad(f"{role}.rht", f"true without {other}.rht: the wgrad GEMM multiplies activations and "
                                    f"gradients both rotated, so the rotation cancels; give {other} scaling: "
                                    f"nvfp4 with rht: true, or set {role}.rht: false")

    def schedule(self, value: Any) -> Schedule:
        raw = self.mapping("schedule", value, {"bf16_warmup_steps", "enable", "full_precision_eval_interval"})
        enable_raw = raw.get("enable")
        if isinstance(enable_raw, (int, float)) and not isinstance(enable_raw, bool):  # `enable: 100` = all roles
            enable_raw = {str(r): enable_raw for r in ROLES}
        en = self.mapping("schedule.enable", enable_raw, {str(r) for r in ROLES})
        d = Schedule()
        given = _given(raw, d)
        enable = RoleSteps(**{str(r): self.integer(f"schedule.enable.{r}", en.get(str(r), d.enable[r]), 0,
                                                   d.enable[r], maximum=MAX_STEP) for r in ROLES})
        return Schedule(
            bf16_warmup_steps=self.integer("schedule.bf16_warmup_steps", given("bf16_warmup_steps"), 0,
                                           d.bf16_warmup_steps, maximum=MAX_STEP),
            enable=enable,
            full_precision_eval_interval=self.integer("schedule.full_precision_eval_interval",
                                                      given("full_precision_eval_interval"), 0,
                                                      d.full_precision_eval_interval),
        )

    def layers(self, value: Any) -> LayerRules:
        raw = self.mapping("layers", value, {f.name for f in dataclasses.fields(LayerRules)})
        mods = raw.get("bf16_modules")
        if mods is None:  # not `or []`: 0 or false must be reported, not read as "no patterns"
            mods = []
        if isinstance(mods, str):
            mods = [mods]
        patterns = []
        if not isinstance(mods, Sequence):
            self.bad("layers.bf16_modules", f"{fmt(mods)} is not a list of glob patterns (e.g. ['*output_layer*'])")
        else:
            for i, m in enumerate(mods):
                if not isinstance(m, str) or not m.strip():
                    self.bad(f"layers.bf16_modules[{i}]", f"{fmt(m)} is not a glob pattern string")
                else:
                    patterns.append(m)
        d = LayerRules()
        given = _given(raw, d)
        return LayerRules(
            bf16_first=self.integer("layers.bf16_first", given("bf16_first"), 0, d.bf16_first),
            bf16_last=self.integer("layers.bf16_last", given("bf16_last"), 0, d.bf16_last),
            bf16_modules=tuple(patterns),
            fp8_output_layer=self.boolean("layers.fp8_output_layer", given("fp8_output_layer"), d.fp8_output_layer),
        )

    def modules(self, value: Any, policies: Mapping[str, TensorPolicy]) -> tuple[ModulePolicies, ...]:
        """``modules: {PATTERN: {ROLE: policy}}``, each role read as a recipe's role is (its defaults, its rules)."""
        if value is None:
            return ()
        if not isinstance(value, Mapping):
            self.bad("modules", f"{fmt(value)} is not a mapping of module patterns to role policies (e.g. "
                                f"{{'*experts*': {{gradients: {{scaling: tensorwise}}}}}})")
            return ()
        out = []
        for pattern, roles in value.items():
            key = f"modules.{pattern}"
            if not isinstance(pattern, str) or not pattern.strip():
                self.bad(f"modules.{pattern}", f"{fmt(pattern)} is not a glob pattern string")
                continue
            raw = self.mapping(key, roles, {str(r) for r in ROLES})
            if roles is None or (isinstance(roles, Mapping) and not roles):  # (unknown roles: mapping() above)
                self.bad(key, "gives no role; give weights, activations or gradients a policy, or remove it")
            read = []
            for role in ROLES:
                if str(role) not in raw:
                    continue
                policy = self.policy(f"{key}.{role}", role, raw[str(role)])
                if policy.is_fp8 and not policies[str(role)].is_fp8 and not self.has_problem(str(role)):
                    self.bad(f"{key}.{role}", f"{policy.scaling} where the recipe keeps {role} BF16 ({role}.scaling: "
                                              f"none): a module may keep a role BF16 or scale it otherwise, not turn "
                                              f"it FP8 alone; give {role} a scaling and keep the other modules BF16 "
                                              f"with another pattern ({role}: none)")
                read.append((role, policy))
            out.append(ModulePolicies(pattern, tuple(read)))
        return tuple(out)

    def read(self, data: Mapping[str, Any] | None) -> Recipe:
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise RecipeError([f"(top level): {fmt(data)} is not a mapping of recipe keys"], self.source)
        raw = self.mapping("", data, _TOP_KEYS)
        raw.pop("defaults", None)  # Hydra's defaults list, already applied by composition
        raw.pop("debug", None)     # observer settings, read by the observers
        block_size = None
        blog = raw.pop("fp8_recipe", None)
        if blog is not None:  # NVIDIA NeMo blog form: flat strings, one block_size for every blockwise role
            blog = self.mapping("fp8_recipe", blog, _NEMO_BLOG_KEYS)
            for k, v in blog.items():
                if k == "block_size":
                    block_size = v
                elif k in raw and raw[k] != v:
                    self.bad(f"fp8_recipe.{k}", f"{fmt(v)} conflicts with top-level {k}: {fmt(raw[k])}; "
                                                f"set it in one place")
                else:
                    raw[k] = v
            if block_size is not None:  # a bad one is reported once, here; the roles then keep their defaults
                block_size = self.block("fp8_recipe.block_size", block_size, None)
        policies = {str(r): self.policy(str(r), r, raw.get(str(r)), block_size) for r in ROLES}
        d = Recipe()
        given = _given(raw, d)
        recipe = Recipe(
            name=self.text("name", raw.get("name", "unnamed"), "unnamed"),  # a file without a name is not "bf16"
            description=self.text("description", given("description") or d.description, d.description),
            backend=self.enum("backend", given("backend"), Backend, d.backend),
            schedule=self.schedule(raw.get("schedule")),
            layers=self.layers(raw.get("layers")),
            amax_reduction=self.enum("amax_reduction", given("amax_reduction"), AmaxReduction, d.amax_reduction),
            attention=self.enum("attention", given("attention"), Attention, d.attention),
            fp8_param=self.boolean("fp8_param", given("fp8_param"), d.fp8_param),
            modules=self.modules(raw.get("modules"), policies),
            **policies,
        )
        if not self.problems:  # (rules between keys: on values read as given, not a bad key's default)
            self.cross_checks(recipe)
        if self.problems:
            raise RecipeError(self.problems, self.source)
        return recipe

    def cross_checks(self, r: Recipe) -> None:
        s = r.schedule
        self.rht_pair_checks(r)
        if r.attention is Attention.FP8:
            per_tensor = (Scaling.DELAYED, Scaling.TENSORWISE)
            off = next((role for role in (Role.ACTIVATIONS, Role.GRADIENTS)
                        if r.policy(role).scaling not in per_tensor), None)
            if off is not None:
                self.bad("attention", f"'fp8' quantizes Q, K, V and the softmax with the activations' policy and their "
                                      f"gradients with the gradients', which must be per-tensor (delayed or "
                                      f"tensorwise); {off}.scaling is {r.policy(off).scaling}; set attention: bf16")
        if r.fp8_param:
            self.fp8_param_checks(r)
        if not r.is_fp8 and s.bf16_warmup_steps:  # (enable steps of non-FP8 roles are reported per role below)
            self.bad("schedule.bf16_warmup_steps", f"{s.bf16_warmup_steps} is set but no role is FP8; give a role a "
                                                   f"scaling (weights/activations/gradients.scaling) or remove it")
        for role in ROLES:
            if s.enable[role] and not r.policy(role).is_fp8:
                self.bad(f"schedule.enable.{role}", f"{s.enable[role]} is set but {role}.scaling is none; "
                                                    f"remove it or give {role} a scaling")

    def fp8_param_checks(self, r: Recipe) -> None:
        """``fp8_param: true`` stores the weights in FP8 from the model's construction on: the weights role must be
        FP8, and FP8 from step 0 (a BF16 stage would compute with the stored FP8 weights dequantized, not BF16)."""
        if not r.weights.is_fp8:
            self.bad("fp8_param", "true stores the weights in FP8, but weights.scaling is none; give weights a "
                                  "scaling or set fp8_param: false")
            return
        s = r.schedule
        if s.bf16_warmup_steps:
            self.bad("schedule.bf16_warmup_steps", f"{s.bf16_warmup_steps} with fp8_param: true: the weights are "
                                                   f"stored in FP8 from step 0, so a BF16 warmup would run on FP8 "
                                                   f"weights; remove it or set fp8_param: false")
        for role in ROLES:
            if s.enable[role] and r.policy(role).is_fp8:
                self.bad(f"schedule.enable.{role}", f"{s.enable[role]} with fp8_param: true: FP8-stored weights run "
                                                    f"under one Transformer Engine recipe from step 0, and a later "
                                                    f"stage changes it; remove it or set fp8_param: false")
