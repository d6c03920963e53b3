"""What Transformer Engine 2.20 runs as real FP8 GEMMs, and the nearest thing it runs when a recipe asks for more.

    resolution = resolve_te(recipe, compute_capability=(9, 0), device_name="NVIDIA H200")
    resolution.policies          # per role, what TE will quantize with (after substitutions)
    resolution.substitutions     # what changed and why (`backend: te` refuses the first one; `auto` prints them)
    resolution.unsupported       # set when no GEMM of the recipe can run FP8 sensibly (`auto` falls back to emulated)
    te_recipe_for(resolution, roles_enabled)   # per stage: the TERecipe a layer runs under, or None (BF16)

The rules (measured on an H200 or read in TE 2.20.2's source, see docs/facts.md):
- Both operands of one GEMM share a scaling family: per-tensor (delayed and current scaling: one scale per tensor),
  block (1x128 and 128x128 blocks, ``Float8BlockQuantizer``) or MXFP8. FP8 x BF16 GEMMs do not exist.
- Block GEMMs: 1x128 x 1x128 and 1x128 x 128x128 only ("2D by 2D block gemm not supported"); TE has no other
  block shapes. Block scaling needs sm_90+; MXFP8 needs sm_100 (and not yet sm_120+, TE's own check).
- TE's current and block quantizers have no margin; only delayed scaling does. TE's MXFP8 scale is NVIDIA's
  round-up (rceil) rule. cuBLAS has no E5M2 x E5M2 FP8 GEMM. Delayed scaling quantizes forward tensors in E4M3,
  and one DelayedScaling state (its margin, history, algorithm) quantizes a module's inputs and weights together.
- ``backward_override="high_precision"`` (forward FP8, exact BF16 backward) exists for every recipe but
  ``DelayedScaling``; a ``CustomRecipe`` whose factory returns ``DelayedScalingRequest`` quantizers does support it.
- A ``CustomRecipe`` with delayed state in one direction only (delayed weights and inputs with current-scaled or
  BF16 gradients, or the reverse) fails at its first FP8 forward: TE registers a module's delayed state for both
  directions as soon as one has any and reads ``amax_history[0]`` of a direction that has none (H200, 2026-12-06:
  ``TypeError: 'NoneType' object is not subscriptable`` in ``add_fp8_tensors_to_global_buffer``). Such a recipe
  gives the other direction's unused boundary slots (output, grad_input) a delayed state of their own
  (:data:`DELAYED_ANCHOR`, :attr:`TERecipe.delayed_anchor`): its amax stays 0, so its scale stays 1.
- A GEMM runs FP8 only when both its operands are FP8, and TE has no "BF16 forward, FP8 backward": a stage runs
  FP8 only once weights and activations are both on (forward-only until gradients follow).
- NVFP4 (``NVFP4BlockScaling``) needs sm_100+ (TE 2.20.2's ``check_nvfp4_support``: "Device compute capability 10.0
  or higher required"; measured on the H200, issue 29) and quantizes every role in NVFP4: one switch each for the
  RHT of the wgrad operands (``disable_rht``), stochastic rounding of gradients (``disable_stochastic_rounding``)
  and 16x16 weight blocks (``disable_2d_quantization``). NVFP4 beside FP8 roles is no TE recipe (emulated only).

Pure: imports only the schema. The plan calls it; ``backends/te.py`` turns a TERecipe into TE objects.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from fp8_recipes.recipe.schema import (
    DEFAULT_BLOCK, MXFP8_BLOCK, ROLES, AmaxAlgo, AmaxReduction, Format, MxRounding, Recipe, Role, Scaling,
    TensorPolicy,
)

__all__ = ["DELAYED_ANCHOR", "TE_FP8_ALIGN", "Substitution", "TERecipe", "TERecipeKind", "TEResolution",
           "delayed_buffer_keys", "final_te_recipe", "resolve_te", "te_attention", "te_fp8_shape_problem",
           "te_recipe_for", "te_stage_note"]

W, A, G = Role.WEIGHTS, Role.ACTIVATIONS, Role.GRADIENTS
# The GEMMs of a linear module and their operand roles (the plan's GEMM_OPERANDS, kept here to stay import-free).
_GEMMS = (("fprop", A, W), ("dgrad", G, W), ("wgrad", G, A))
TE_FP8_ALIGN = (8, 16)
"""The multiples FP8 GEMM dimensions must be on TE 2.20.2 (delayed, current and block scaling; H200, 2026-12-02:
tests/gpu/test_te_shapes.py). The forward: TE's linear layers assert, at their first FP8 forward, the input's rows
and the weight's rows (out_features) to be multiples of 8 and both last dimensions (in_features) of 16
(``assert_dim_for_fp8_exec``). The backward: cuBLAS needs the dimension each FP8 GEMM sums over to be a multiple of
16, out_features for dgrad and the tokens for wgrad ("Leading dimension requirement on A for FP8 GEMM. Caller must
pad.", raised in the first FP8 backward); under sequence parallelism wgrad sums over the all-gathered tokens (TE's
source: ``gather_along_first_dim`` before the wgrad GEMM; not measured, it needs two GPUs). MXFP8 (Blackwell) was
not measured and may need more (multiples of 32)."""
TE_BLOCKS = ((1, 128), (128, 128))  # Float8BlockQuantizer: block_scaling_dim 1 and 2, block_len 128
DELAYED_ANCHOR = TensorPolicy(scaling=Scaling.DELAYED, amax_history_len=1)
"""The delayed state a CustomRecipe gives the boundary slots of a direction with no delayed role (see the rules
above): one amax, margin 0; never fed (those slots quantize nothing in Megatron-Core's linears)."""


class TERecipeKind(StrEnum):
    """The Transformer Engine recipe class a layer runs under; each value is the class's name in
    ``transformer_engine.common.recipe`` (what ``describe()`` prints and ``backends/te.py`` builds)."""

    DELAYED = "DelayedScaling"           # per-tensor scales from an amax history (margin, history, algorithm)
    CURRENT = "Float8CurrentScaling"     # per-tensor scales from each tensor's own amax
    BLOCK = "Float8BlockScaling"         # 1x128 / 128x128 blocks, power-of-two scales by default
    MXFP8 = "MXFP8BlockScaling"          # 32-element blocks, E8M0 scales (sm_100)
    NVFP4 = "NVFP4BlockScaling"          # E2M1 codes, E4M3 scales per 16 values, FP32 per tensor (sm_100)
    CUSTOM = "CustomRecipe"              # one quantizer per role from our factory: per-role mixes, options the
    #                                      named classes lack, delayed scaling with a forward-only stage


class Family(StrEnum):
    PER_TENSOR = "per-tensor"
    BLOCK = "block"
    MX = "mxfp8"


_FAMILY = {Scaling.DELAYED: Family.PER_TENSOR, Scaling.TENSORWISE: Family.PER_TENSOR,
           Scaling.BLOCKWISE: Family.BLOCK, Scaling.MXFP8: Family.MX}
# Nearest families first: MX and block scaling both keep per-block power-of-two scales.
_NEAREST = {Family.MX: (Family.MX, Family.BLOCK, Family.PER_TENSOR),
            Family.BLOCK: (Family.BLOCK, Family.MX, Family.PER_TENSOR),
            Family.PER_TENSOR: (Family.PER_TENSOR, Family.BLOCK, Family.MX)}


@dataclass(frozen=True)
class Substitution:
    """One requested setting TE cannot run as asked, and what runs instead."""

    key: str
    """The recipe's dotted key, e.g. ``weights.scaling``."""
    value: Any
    """The requested value."""
    before: str
    after: str
    """The role's policy as asked and as TE runs it (``TensorPolicy.describe()``)."""
    reason: str
    fix: str
    """What to write in the recipe to run it as asked on this machine."""

    def line(self) -> str:
        return f"{self.before} -> {self.after} ({self.reason})"

    def refusal(self) -> str:
        return (f"{self.key}: {self.value!r} cannot run on Transformer Engine as asked ({self.reason}); {self.fix}, "
                f"or set backend: auto (runs the nearest legal recipe) or backend: emulated")


@dataclass(frozen=True)
class TERecipe:
    """What one layer runs under for one stage: a TE recipe class and the per-role policies it quantizes with."""

    recipe: TERecipeKind
    """DelayedScaling | Float8CurrentScaling | Float8BlockScaling | MXFP8BlockScaling | CustomRecipe (a plain
    string of one of these is taken too)."""
    weights: TensorPolicy
    activations: TensorPolicy
    gradients: TensorPolicy
    """The gradients' policy (what the backward uses once it runs FP8); scaling none = never FP8."""
    forward_only: bool = False
    """backward_override="high_precision": FP8 fprop, dgrad and wgrad in BF16 from the unquantized operands."""
    fp8_dpa: bool = False
    """The layer's core attention runs TE's FP8 attention too (the recipe's ``fp8_dpa``; recipe ``attention: fp8``)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "recipe", TERecipeKind(self.recipe))  # a bad class name fails here, not in TE

    def policy(self, role: Role) -> TensorPolicy:
        return getattr(self, str(role))

    @property
    def fp8_format(self) -> str:
        """TE's recipe-wide format: HYBRID (E4M3 forward, E5M2 backward) unless the gradients are E4M3 (NVFP4:
        E4M3, the format of its block scales, the only one NVFP4BlockScaling takes)."""
        if self.recipe is TERecipeKind.NVFP4:
            return "E4M3"
        return "E4M3" if self.gradients.is_fp8 and self.gradients.format is Format.E4M3 else "HYBRID"

    def nvfp4_switches(self) -> dict[str, bool]:
        """NVFP4BlockScaling's switches, derived from the policies (the schema keeps activations' and gradients'
        rht equal; NVFP4 activations and gradients have 1x16 blocks, only the weights' may be 16x16)."""
        return {"disable_rht": not self.activations.rht,
                "disable_stochastic_rounding": not (self.gradients.is_fp8 and self.gradients.stochastic_rounding),
                "disable_2d_quantization": self.weights.block[0] == 1}

    @property
    def delayed(self) -> bool:
        """Carries delayed-scaling state (amax histories) that TE reduces and updates once per step."""
        return any(self.delayed_role(r) for r in ROLES)

    def delayed_role(self, role: Role) -> bool:
        """`role`'s policy is delayed scaling (the gradients' too in a forward-only stage: their state is kept)."""
        return self.policy(role).scaling is Scaling.DELAYED

    @property
    def delayed_anchor(self) -> bool | None:
        """The direction (True: forward, False: backward) whose boundary slots get :data:`DELAYED_ANCHOR` state:
        the one without a delayed role, under a CustomRecipe whose other direction has one (TE 2.20.2 fails on a
        delayed state in one direction only); None when both or neither have one, and for the built-in recipes."""
        if self.recipe is not TERecipeKind.CUSTOM:
            return None
        forward, backward = self.delayed_role(W) or self.delayed_role(A), self.delayed_role(G)
        return None if forward == backward else backward

    def describe(self) -> str:
        args = [f"fp8_format={self.fp8_format}"]
        if self.recipe is TERecipeKind.NVFP4:
            args = [f"{k}={v}" for k, v in self.nvfp4_switches().items()]
        if self.recipe is TERecipeKind.DELAYED:
            args += _delayed_args(self.weights)
        elif self.recipe is TERecipeKind.BLOCK:
            args += [f"{x} {'x'.join(map(str, self.policy(r).block))}" for x, r in (("x", A), ("w", W), ("grad", G))
                     if self.policy(r).is_fp8]
        elif self.recipe is TERecipeKind.CUSTOM:
            args = [f"{r}: {self.policy(r).describe()}" for r in ROLES if self.policy(r).is_fp8]
        if self.recipe in (TERecipeKind.CURRENT, TERecipeKind.BLOCK):
            default_pow2 = self.recipe is TERecipeKind.BLOCK
            args += [f"{r} {'no ' if not p.pow2_scales else ''}pow2" for r in ROLES
                     if (p := self.policy(r)).is_fp8 and p.pow2_scales != default_pow2]
            args += [f"{r} amax_epsilon={p.amax_epsilon:g}" for r in ROLES if (p := self.policy(r)).amax_epsilon]
        if self.forward_only:
            args.append("backward_override=high_precision")
        if self.fp8_dpa:
            args.append("fp8_dpa=True")
        return f"{self.recipe}({', '.join(args)})"


def _delayed_args(p: TensorPolicy) -> list[str]:
    algo = f"percentile {p.percentile:g} (callable)" if p.amax_compute_algo is AmaxAlgo.PERCENTILE \
        else str(p.amax_compute_algo)
    out = [f"margin={p.margin}", f"amax_history_len={p.amax_history_len}", f"amax_compute_algo={algo}"]
    return out + (["pow2 scales (callable)"] if p.pow2_scales else [])


@dataclass(frozen=True)
class TEResolution:
    policies: dict[Role, TensorPolicy]
    substitutions: tuple[Substitution, ...] = ()
    unsupported: str | None = None
    """Why no GEMM of the recipe can run FP8 on TE as asked or nearly so (auto: emulated; te: refused)."""
    unsupported_fix: str = ""
    notes: tuple[str, ...] = ()
    custom_delayed: bool = False
    """Delayed roles run through CustomRecipe(DelayedScalingRequest) at every stage: the schedule has a
    forward-only stage, which DelayedScaling cannot run, and one amax history must carry across the switch."""

    def refusal(self) -> str | None:
        """The one-line error of `backend: te`, or None when the recipe runs as asked."""
        if self.unsupported:
            return f"{self.unsupported}; {self.unsupported_fix}"
        if not self.substitutions:
            return None
        more = self.substitutions[1:]
        tail = f" (also: {', '.join(s.key for s in more)})" if more else ""
        return self.substitutions[0].refusal() + tail


# ---------------------------------------------------------------------------------------------------------------
# Resolving a recipe for one machine


def _sm(cc: tuple[int, int] | None) -> str:
    return f"sm_{cc[0]}{cc[1]}" if cc else "sm_?"


def _to_family(p: TensorPolicy, family: Family, role: Role) -> TensorPolicy:
    """The nearest policy of `family`: same element format; the family's TE defaults for the rest."""
    if family is Family.PER_TENSOR:
        return TensorPolicy(scaling=Scaling.TENSORWISE, format=p.format, amax_epsilon=p.amax_epsilon)
    if family is Family.BLOCK:
        return TensorPolicy(scaling=Scaling.BLOCKWISE, format=p.format, block=DEFAULT_BLOCK[role], pow2_scales=True,
                            amax_epsilon=p.amax_epsilon)
    return TensorPolicy(scaling=Scaling.MXFP8, format=p.format, block=(1, MXFP8_BLOCK), pow2_scales=True)


def _delayed_key(p: TensorPolicy) -> tuple:
    pct = p.percentile if p.amax_compute_algo is AmaxAlgo.PERCENTILE else None
    return (p.margin, p.amax_history_len, p.amax_compute_algo, pct, p.pow2_scales)


class _Resolver:
    def __init__(self, recipe: Recipe, cc: tuple[int, int] | None, device_name: str):
        self.recipe = recipe
        self.cc = cc or (0, 0)
        self.where = f"{device_name} is {_sm(cc)}"
        self.eff = {r: recipe.policy(r) for r in ROLES}
        self.subs: list[Substitution] = []

    def sub(self, role: Role, field: str, new: TensorPolicy, reason: str, fix: str) -> None:
        old = self.eff[role]
        value = getattr(self.recipe.policy(role), field)
        value = list(value) if isinstance(value, tuple) else (str(value) if isinstance(value, StrEnum) else value)
        self.subs.append(Substitution(f"{role}.{field}", value, old.describe(), new.describe(), reason, fix))
        self.eff[role] = new

    def families_available(self) -> tuple[Family, ...]:
        out = [Family.PER_TENSOR]
        if self.cc >= (9, 0):
            out.append(Family.BLOCK)
        if (10, 0) <= self.cc < (12, 0):
            out.append(Family.MX)
        return tuple(out)

    def run(self) -> TEResolution:
        fp8 = [r for r in ROLES if self.eff[r].is_fp8]
        if not (self.eff[W].is_fp8 and self.eff[A].is_fp8):
            off = W if not self.eff[W].is_fp8 else A
            return TEResolution(dict(self.eff), unsupported=(
                f"{off}.scaling: 'none' with {'+'.join(map(str, fp8))} FP8: Transformer Engine runs a GEMM in FP8 "
                f"only when both its operands are FP8, and the backward only after an FP8 forward, so no GEMM of "
                f"this recipe can"), unsupported_fix=f"give {off} a scaling, or set backend: emulated")
        if any(self.eff[r].scaling is Scaling.NVFP4 for r in fp8):
            return self.nvfp4(fp8)
        self.per_role_fixes(fp8)
        self.one_family(fp8)
        self.one_2d_block()
        bad = self.e5m2_pairs()
        if bad:
            return TEResolution(dict(self.eff), tuple(self.subs), unsupported=bad[0], unsupported_fix=bad[1])
        self.shared_delayed_state()
        return TEResolution(dict(self.eff), tuple(self.subs), notes=self.notes(), custom_delayed=self.custom_delayed())

    def nvfp4(self, fp8: list[Role]) -> TEResolution:
        """NVFP4BlockScaling on sm_100+ when every quantized role is NVFP4; else nothing TE runs (no substitution:
        NVFP4 becoming FP8, or FP8 becoming NVFP4, is another recipe, not the nearest one)."""
        nv = [r for r in fp8 if self.eff[r].scaling is Scaling.NVFP4]
        if self.cc < (10, 0):
            return TEResolution(dict(self.eff), unsupported=(
                f"{nv[0]}.scaling: 'nvfp4': Transformer Engine's NVFP4 GEMMs need sm_100 (Blackwell); {self.where}"),
                unsupported_fix="set backend: emulated (NVFP4 quantized as TE's reference quantizer does)")
        other = next((r for r in fp8 if r not in nv), None)
        if other is not None:
            return TEResolution(dict(self.eff), unsupported=(
                f"{other}.scaling: '{self.eff[other].scaling}' beside {'+'.join(map(str, nv))} nvfp4: Transformer "
                f"Engine's NVFP4BlockScaling quantizes every role in NVFP4"),
                unsupported_fix=f"give {other} scaling: nvfp4, or set backend: emulated (it runs any per-role mix)")
        return TEResolution(dict(self.eff), notes=(
            "NVFP4BlockScaling rounds gradients stochastically with TE's Philox stream: the emulated backend rounds "
            "with the same law from its own seeded stream, so SR bits differ between the two",) if
            self.eff[G].is_fp8 and self.eff[G].stochastic_rounding else ())

    def per_role_fixes(self, fp8: list[Role]) -> None:
        for r in fp8:
            p = self.eff[r]
            if p.scaling is Scaling.MXFP8 and p.mx_rounding is MxRounding.FLOOR:
                self.sub(r, "mx_rounding", dataclasses.replace(p, mx_rounding=MxRounding.RCEIL),
                         "TE's MXFP8 scales use NVIDIA's round-up rule", f"set {r}.mx_rounding: rceil")
            if p.scaling is Scaling.BLOCKWISE and p.block not in TE_BLOCKS:
                block = (1, 128) if p.block[0] == 1 else (128, 128)
                self.sub(r, "block", dataclasses.replace(p, block=block),
                         "TE's block quantizer has 1x128 and 128x128 blocks only",
                         f"set {r}.block: [{block[0]}, {block[1]}]")
            p = self.eff[r]
            if p.scaling in (Scaling.TENSORWISE, Scaling.BLOCKWISE) and p.margin:
                self.sub(r, "margin", dataclasses.replace(p, margin=0),
                         "TE's current and block scaling have no margin; only delayed scaling does",
                         f"remove {r}.margin")
            p = self.eff[r]
            if p.scaling is Scaling.DELAYED and r is not G and p.format is Format.E5M2:
                self.sub(r, "format", dataclasses.replace(p, format=Format.E4M3),
                         "TE's delayed scaling quantizes forward tensors in E4M3", f"set {r}.format: e4m3")

    def one_family(self, fp8: list[Role]) -> None:
        available = self.families_available()
        have = {r: _FAMILY[self.eff[r].scaling] for r in fp8}
        if len(set(have.values())) == 1 and next(iter(have.values())) in available:
            return
        prefer = _NEAREST[have[W]]
        target = min(available, key=lambda f: (sum(fam is not f for fam in have.values()), prefer.index(f)))
        for r in fp8:
            if have[r] is target:
                continue
            if have[r] not in available:
                reason = (f"MXFP8 needs sm_100; {self.where}" if have[r] is Family.MX
                          else f"block-scaled FP8 GEMMs need sm_90; {self.where}")
            else:
                reason = f"one TE GEMM cannot mix {have[r]} with {target} scaling"
            new = _to_family(self.eff[r], target, r)
            self.sub(r, "scaling", new, reason, f"set {r}.scaling: {new.scaling}")

    def one_2d_block(self) -> None:
        two_d = [r for r in (W, A, G) if self.eff[r].scaling is Scaling.BLOCKWISE and self.eff[r].block[0] > 1]
        for r in two_d[1:]:  # every pair of roles meets in a GEMM: at most one role may have 2D blocks
            self.sub(r, "block", dataclasses.replace(self.eff[r], block=(1, 128)),
                     f"TE has no GEMM with two 128x128-block operands ({two_d[0]} has them)",
                     f"set {r}.block: [1, 128]")

    def e5m2_pairs(self) -> tuple[str, str] | None:
        for gemm, x, y in _GEMMS:
            px, py = self.eff[x], self.eff[y]
            if px.is_fp8 and py.is_fp8 and px.format is py.format is Format.E5M2:
                return (f"{x}.format: 'e5m2' with {y}.format: 'e5m2': the {gemm} GEMM would multiply two E5M2 "
                        f"operands, which cuBLAS has no FP8 kernel for"), f"set {x}.format: e4m3, or backend: emulated"
        return None

    def shared_delayed_state(self) -> None:
        pw, pa = self.eff[W], self.eff[A]
        if pw.scaling is pa.scaling is Scaling.DELAYED and _delayed_key(pw) != _delayed_key(pa):
            field = next(f for f in ("margin", "amax_history_len", "amax_compute_algo", "percentile", "pow2_scales")
                         if getattr(pw, f) != getattr(pa, f))
            new = dataclasses.replace(pa, **{f: getattr(pw, f) for f in
                                             ("margin", "amax_history_len", "amax_compute_algo", "percentile",
                                              "pow2_scales")})
            self.sub(A, field, new, "one TE delayed-scaling state quantizes a module's inputs and weights together",
                     f"set activations.{field} as weights.{field}")

    def custom_delayed(self) -> bool:
        if not any(self.eff[r].scaling is Scaling.DELAYED for r in ROLES):
            return False
        s = self.recipe.schedule
        fwd_on = max(s.role_start(W), s.role_start(A))
        return not self.eff[G].is_fp8 or s.role_start(G) > fwd_on

    def notes(self) -> tuple[str, ...]:
        out = []
        if self.custom_delayed():
            out.append("delayed scaling with a forward-only stage: DelayedScaling has no backward_override, so every "
                       "stage runs CustomRecipe(DelayedScalingRequest) quantizers, which keep one amax history "
                       "across the switch to FP8 gradients")
        current = [r for r in ROLES if self.eff[r].scaling in (Scaling.TENSORWISE, Scaling.BLOCKWISE, Scaling.MXFP8)]
        if current and self.recipe.amax_reduction is not AmaxReduction.NONE:
            out.append(f"amax_reduction: {self.recipe.amax_reduction} reduces delayed-scaling amaxes only; TE's "
                       f"current and block scaling use each rank's own amax (as in Megatron-Core)")
        return tuple(out)


def resolve_te(recipe: Recipe, compute_capability: tuple[int, int] | None, device_name: str = "this GPU"
               ) -> TEResolution:
    """Per role, what TE runs for `recipe` on a GPU of this compute capability, and every substitution made."""
    return _Resolver(recipe, compute_capability, device_name).run()


# ---------------------------------------------------------------------------------------------------------------
# Per stage: the TE recipe of an FP8 layer


def _builtin(pw: TensorPolicy, pa: TensorPolicy, pg: TensorPolicy, forward_only: bool, custom_delayed: bool
             ) -> TERecipeKind:
    kinds = {pw.scaling, pa.scaling} | ({pg.scaling} if pg.is_fp8 else set())
    if kinds == {Scaling.NVFP4}:
        return TERecipeKind.NVFP4
    if len(kinds) > 1 or pw.format is not Format.E4M3 or pa.format is not Format.E4M3:
        return TERecipeKind.CUSTOM  # a per-role mix within one family, or E5M2 forward tensors: a quantizer per role
    kind = kinds.pop()
    if kind is Scaling.DELAYED:
        same = pg.scaling is not Scaling.DELAYED or _delayed_key(pg) == _delayed_key(pw)
        return TERecipeKind.DELAYED if same and not (forward_only or custom_delayed) else TERecipeKind.CUSTOM
    return {Scaling.TENSORWISE: TERecipeKind.CURRENT, Scaling.BLOCKWISE: TERecipeKind.BLOCK,
            Scaling.MXFP8: TERecipeKind.MXFP8}[kind]


def te_recipe_for(resolution: TEResolution, roles: frozenset[Role]) -> TERecipe | None:
    """The TERecipe an FP8 layer runs under while `roles` are enabled, or None: the stage runs BF16 on TE."""
    if resolution.unsupported or W not in roles or A not in roles:
        return None
    pw, pa, pg = (resolution.policies[r] for r in (W, A, G))
    forward_only = G not in roles or not pg.is_fp8
    return TERecipe(_builtin(pw, pa, pg, forward_only, resolution.custom_delayed), pw, pa, pg, forward_only)


def final_te_recipe(resolution: TEResolution) -> TERecipe | None:
    """The TERecipe a resolution's layers run at its final stage (every FP8 role on), or None (BF16 on TE)."""
    return te_recipe_for(resolution, frozenset(r for r in ROLES if resolution.policies[r].is_fp8))


def delayed_buffer_keys(resolution: TEResolution) -> list[tuple[tuple, tuple]]:
    """(TE's amax-buffer key, the settings TE updates that buffer with) for each direction of the delayed state a
    resolution runs (its final stage). TE keys a buffer by its direction and the text of the DelayedScaling that
    updates it, which names the format, margin and history length but not the amax algorithm or the scale rule
    (TE 2.20.2: ``get_unique_autocast_key``, ``DelayedScaling._make_repr``). A built-in DelayedScaling updates both
    directions with the weights' settings; a CustomRecipe builds one per direction from its requests: the forward's
    from the inputs' and weights' (which share one state), the backward's from the gradients' (a direction without
    either: :data:`DELAYED_ANCHOR`'s)."""
    te = final_te_recipe(resolution)
    if te is None or te.recipe not in (TERecipeKind.DELAYED, TERecipeKind.CUSTOM):
        return []
    fmt = te.fp8_format

    def key(direction: str, p: TensorPolicy) -> tuple[tuple, tuple]:
        return (direction, fmt, p.margin, p.amax_history_len), _delayed_key(p)
    if te.recipe is TERecipeKind.DELAYED:
        return [key("forward", te.weights), key("backward", te.weights)]
    forward = next((te.policy(r) for r in (W, A) if te.delayed_role(r)), None)
    backward = te.gradients if te.delayed_role(G) else None
    forward = DELAYED_ANCHOR if te.delayed_anchor is True else forward
    backward = DELAYED_ANCHOR if te.delayed_anchor is False else backward
    return ([key("forward", forward)] if forward else []) + ([key("backward", backward)] if backward else [])


def te_fp8_shape_problem(rows: int, in_features: int, out_features: int,
                         gemms: frozenset[str] = frozenset({"fprop", "dgrad", "wgrad"}),
                         gemm_rows: int | None = None) -> str | None:
    """Why TE cannot run a linear layer's FP8 ``gemms`` (of fprop, dgrad, wgrad) on an input of ``rows`` tokens and
    a weight ``[out_features, in_features]`` (:data:`TE_FP8_ALIGN`), or None when they run. ``gemm_rows``: the
    tokens the GEMMs multiply when the layer all-gathers its slice of them (sequence parallelism; default rows)."""
    lead, summed = TE_FP8_ALIGN
    gathered = "gathered tokens" if gemm_rows not in (None, rows) else "tokens"
    need: dict[str, int] = {}
    if "fprop" in gemms:
        need.update(in_features=summed, out_features=lead, tokens=lead)
    if "dgrad" in gemms:
        need["out_features"] = summed
    if "wgrad" in gemms:
        need[gathered] = summed
    size = {"in_features": in_features, "out_features": out_features, "tokens": rows,
            "gathered tokens": gemm_rows if gemm_rows is not None else rows}
    return ", ".join(f"{what} {size[what]} is not a multiple of {k}" for what, k in need.items() if size[what] % k) \
        or None


def te_stage_note(roles: frozenset[Role], fp8_roles: frozenset[Role]) -> str:
    """Why a stage runs as it does on TE, when that differs from its roles (empty otherwise)."""
    if not roles or roles == fp8_roles and W in roles and A in roles:
        return ""
    if W in roles and A in roles:
        return "forward only: the backward runs BF16 until gradients turn FP8"
    if G in roles:
        return "the forward GEMM needs weights and activations in FP8, and TE runs no FP8 backward under a BF16 forward"
    on = "+".join(str(r) for r in ROLES if r in roles)
    return f"with {on} alone every GEMM has a BF16 operand; an FP8 GEMM needs both in FP8"


def te_attention(choice: TERecipe | None, compute_capability: tuple[int, int] | None) -> str | None:
    """Why TE 2.20 cannot run FP8 attention under `choice` on this GPU, or None when it can (docs/facts.md, "FP8
    attention on Hopper": measured on an H200 and read in TE's backend selection)."""
    if choice is None or choice.forward_only:
        return "the stage's backward is not FP8"
    if choice.recipe is TERecipeKind.DELAYED:
        return None
    if choice.recipe is TERecipeKind.CURRENT:
        if (compute_capability or (0, 0)) >= (10, 0):
            return None
        return f"TE has no current-scaled FP8 attention before sm_100; this GPU is {_sm(compute_capability)}"
    return f"TE's FP8 attention runs under DelayedScaling or Float8CurrentScaling, not {choice.recipe}"
