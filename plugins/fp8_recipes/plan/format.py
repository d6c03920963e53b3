"""Print a PrecisionPlan as the table users read before training (and `fp8-recipes explain`).

    print(format_plan(plan, max_steps=1000, parallel=ParallelLayout(pp=2, dp=4)))

One floor above plan/precision.py: the plan decides, this module only prints the decision (plan/precision.py never
imports it).
"""

from __future__ import annotations

from fp8_recipes.plan.precision import (
    ROUTER_REASON, Execution, Gemm, ModelLayout, ModulePlan, ParallelLayout, PrecisionPlan, StepPlan,
)
from fp8_recipes.recipe.schema import ROLES, Attention, Scaling

__all__ = ["format_plan"]


def _ranges(nums: list[int]) -> str:
    return f"{nums[0]}" if len(nums) == 1 else f"{nums[0]}-{nums[-1]}"


def _spans(nums: list[int]) -> str:
    """'0-2,4-7' for [0, 1, 2, 4, 5, 6, 7]."""
    runs: list[list[int]] = []
    for n in nums:
        if runs and runs[-1][-1] == n - 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    return ",".join(_ranges(r) for r in runs)


Row = tuple[str, str, str]
"""A GEMM table row before it is printed: (layers, module, the GEMM cells and why BF16)."""


def _row(layers: str, module: str, mp: ModulePlan | None, reason: str | None = None) -> Row:
    """One table row; ``mp`` None: a module the plan never quantizes (an MoE router), BF16 in every GEMM."""
    cells = "".join(f"{mp.gemms[g].execution if mp else Execution.BF16:<10}" for g in Gemm)
    return layers, module, f"{cells}{reason or (mp.bf16_reason or mp.override if mp else '') or ''}".rstrip()


def _kind(m: ModulePlan) -> tuple:
    """What a row says of a module: its GEMMs, why BF16, its modules: override."""
    return m.summary(), m.bf16_reason, m.override


def _layer_groups(final: StepPlan) -> tuple[list[tuple[list[int], list[ModulePlan]]], list[ModulePlan]]:
    """Consecutive layers whose linears have the same plans, grouped; and the modules of no layer (the LM head)."""
    by_layer: dict[int, list[ModulePlan]] = {}
    others: list[ModulePlan] = []
    for mp in final.modules.values():
        (by_layer.setdefault(mp.layer, []) if mp.layer is not None else others).append(mp)

    def signature(mps: list[ModulePlan]):
        return tuple((m.name.split(f"layers.{m.layer}.", 1)[-1], *_kind(m)) for m in mps)

    groups: list[tuple[list[int], list[ModulePlan]]] = []
    for layer in sorted(by_layer):
        mps = by_layer[layer]
        if groups and signature(groups[-1][1]) == signature(mps) and groups[-1][0][-1] == layer - 1:
            groups[-1][0].append(layer)
        else:
            groups.append(([layer], mps))
    return groups, others


def _gemm_table(plan: PrecisionPlan, final: StepPlan) -> list[str]:
    """The GEMM table with every role on: a row per layer group whose linears agree, else per linear (an MoE layer's
    experts collapsed into a row with their count, always), each MoE layer group's router, the LM head; then the
    MoE line."""
    groups, others = _layer_groups(final)
    routers = set(plan.layout.routers)
    rows: list[Row] = []
    for layers, mps in groups:
        span, uniform = _ranges(layers), len({_kind(m) for m in mps}) == 1
        experts = [m for m in mps if ModelLayout.expert_of(m.name) is not None]
        if uniform and not experts:
            rows.append(_row(span, "(all linears)", mps[0]))
        elif uniform:  # an MoE layer: its experts keep their row, with their count
            rows += [_row(span, "(other linears)", mps[0]), *_module_rows(span, experts)]
        else:
            rows += _module_rows(span, mps)
        if f"decoder.layers.{layers[0]}.mlp.router" in routers:
            rows.append(_row(span, "mlp.router", None, ROUTER_REASON))
    rows += [_row("-", m.name, m) for m in others]
    width = max(28, *(len(module) for _, module, _ in rows))  # (28: every dense model's names fit)
    lines = ["", "GEMMs with every role on (fprop = activations x weights, dgrad = gradients x weights, "
                 "wgrad = gradients x activations)",
             f"  {'layers':<8} {'module':<{width}} " + "".join(f"{g!s:<10}" for g in Gemm) + "why BF16"
             + (" / own policies (modules:)" if plan.recipe.modules else "")]
    lines += [f"  {layers:<8} {module:<{width}} {rest}".rstrip() for layers, module, rest in rows]
    if routers:
        moe = sorted({ModelLayout.layer_of(n) for n in routers})
        lines.append(f"  MoE: {plan.layout.experts} routed experts in layers {_spans(moe).replace(',', ', ')}; each "
                     f"expert's GEMMs quantized on their own (a quantizer per expert GEMM); the router's GEMM stays "
                     f"BF16")
    return lines


def _module_rows(layers: str, mps: list[ModulePlan]) -> list[Row]:
    """A layer group's rows, one per linear; an MoE layer's routed experts collapsed into a row per plan they share
    (``mlp.experts[0-7] fc1+fc2``: every expert's two linears)."""
    lines, experts = [], {}
    for m in mps:
        e = ModelLayout.expert_of(m.name)
        if e is None:
            lines.append(_row(layers, m.name.split(f"layers.{m.layer}.", 1)[-1], m))
        else:
            by_fc = experts.setdefault(_kind(m), ({}, m))[0]
            by_fc.setdefault(m.name.rsplit(".", 1)[-1], []).append(e)
    for by_fc, m in experts.values():
        if len(by_fc) == 2 and len(set(map(tuple, by_fc.values()))) == 1:
            lines.append(_row(layers, f"mlp.experts[{_spans(next(iter(by_fc.values())))}] fc1+fc2", m))
        else:
            lines += [_row(layers, f"mlp.experts[{_spans(es)}].{fc}", m) for fc, es in by_fc.items()]
    return lines


def _te_lines(plan: PrecisionPlan) -> list[str]:
    """What the TE backend changes: each substituted setting (as asked -> as run, and why), then notes."""
    out = [""]
    if plan.substitutions:
        out += [f"Transformer Engine runs the nearest legal recipe on {plan.hardware.name} ({plan.hardware.sm}):"]
        out += [f"  {s.key:<24} {s.line()}" for s in plan.substitutions]
    out += [f"note: {n}" for n in plan.te.notes]
    return out if len(out) > 1 else []


def _precision_runs(layers: range, step_plan: StepPlan) -> str:
    """'0 bf16, 1-2 fp8' for a chunk's layers: each layer's precision with every role on (BF16 when all its GEMMs
    are, FP8 / emulated when all are, else mixed)."""
    def kind(layer: int) -> str:
        mps = [m for m in step_plan.modules.values() if m.layer == layer]
        execs = {str(g.execution) for m in mps for g in m.gemms.values()}
        return execs.pop() if len(execs) == 1 else "mixed"

    runs: list[tuple[list[int], str]] = []
    for layer in layers:
        k = kind(layer)
        if runs and runs[-1][1] == k:
            runs[-1][0].append(layer)
        else:
            runs.append(([layer], k))
    return ", ".join(f"{_ranges(ls)} {k}" for ls, k in runs)


def _pipeline_lines(plan: PrecisionPlan, parallel: ParallelLayout, final: StepPlan, experts: bool = False) -> list[str]:
    """Which pipeline stage (and virtual chunk) runs which layers in which precision; ``experts``: also how the routed
    experts split (explain --layout: a run's own layout carries no EP)."""
    lines = ["", f"pipeline stages ({parallel.describe()}; layer numbers are global)" if parallel.pp > 1 else
             f"parallel layout ({parallel.describe()}; one pipeline stage)"]
    head = final.modules.get("output_layer")
    chunks = parallel.chunk_layers(plan.layout.num_layers)
    last = max(chunks)
    for (stage, chunk), layers in sorted(chunks.items()):
        extra = ""
        if (stage, chunk) == (0, 0):
            extra = "  + embedding"
        if (stage, chunk) == last and head is not None:
            extra += "  + LM head " + (str(next(iter(head.gemms.values())).execution) if head.any_fp8 else "bf16")
        chunk_label = f" chunk {chunk}" if parallel.vpp else ""
        lines.append(f"  stage {stage}{chunk_label:<9} layers {_ranges(list(layers)):<8} "
                     f"{_precision_runs(layers, final)}{extra}")
    if experts and plan.layout.experts:
        lines.append(f"  routed experts: {plan.layout.experts} per MoE layer, {plan.layout.experts // parallel.ep} on "
                     f"each of the ep={parallel.ep} ranks, each expert split over expert TP {parallel.expert_tp}; their "
                     f"optimizer state sharded over expert DP {parallel.expert_dp}")
    return lines


def _fp8_param_line(plan: PrecisionPlan) -> str:
    """Where the weights are stored in FP8 (recipe ``fp8_param: true``), or why training refuses it here."""
    problem = plan.fp8_param_problem()
    if problem is not None:
        return f"  weights stored (fp8_param): refused: {problem}"
    layers = plan.fp8_param_layers()
    if not layers:
        return "  weights stored (fp8_param): bf16 everywhere (no layer runs FP8)"
    fp8 = sorted(layers)
    bf16 = [i for i in range(plan.layout.num_layers) if i not in layers]
    kinds = sorted({te.recipe for te in layers.values()})
    rest = (f"layers {', '.join(map(str, bf16))}, " if bf16 else "") + "LM head, embeddings"
    return (f"  weights stored (fp8_param): fp8 in layers {_ranges(fp8)} (TE {', '.join(kinds)} tensors, re-quantized "
            f"from the fp32 main params each step); bf16: {rest}")


def format_plan(plan: PrecisionPlan, max_steps: int | None = None, parallel: ParallelLayout | None = None,
                show_layout: bool = False) -> str:
    """The plan as text; with ``parallel``, which pipeline stage runs which layers when there are several stages, or
    always with ``show_layout`` (explain --layout: a layout the user gave, experts too)."""
    r = plan.recipe
    sched = r.schedule
    lines = [
        f"recipe    {r.name}" + (f": {r.description}" if r.description else ""),
        f"backend   {plan.backend} ({plan.backend_reason})",
        f"hardware  {plan.hardware.describe()}",
        "",
        f"  {'role':<12} {'policy':<40} FP8 from step",
    ]
    for role in ROLES:
        p = r.policy(role)
        start = str(sched.role_start(role)) if p.is_fp8 else "-"
        lines.append(f"  {role!s:<12} {p.describe():<40} {start}")
    if plan.te is not None:
        lines += _te_lines(plan)
    elif any(r.policy(role).scaling is Scaling.NVFP4 for role in ROLES):
        lines += ["", "note: nvfp4 operands are emulated as TE's NVFP4 GEMMs read them (bit-exact with its reference "
                      "quantizer): 1x16 blocks along each GEMM's reduction dim (wgrad: the tokens), the RHT on both "
                      "wgrad operands or neither, stochastic rounding seeded by (seed, step, module, GEMM)"]
    lines += ["", "stages"]
    for first, last, label in plan.stages(max_steps):
        span = f"{first}-{last}" if last is not None else f"{first}-"
        lines.append(f"  steps {span:<14} {label}")
        step_plan = plan.at(first)
        if plan.te is not None and step_plan.roles_fp8:
            te = next((m.te for m in step_plan.modules.values() if m.te is not None), None)
            runs = te.describe() if te is not None else "BF16"
            lines.append(f"  {'':<20} TE: {runs}" + (f" ({step_plan.note})" if step_plan.note else ""))
            own = {m.override.split(":")[0]: m.te for m in step_plan.modules.values() if m.override and m.te != te}
            lines += [f"  {'':<20} TE, {pattern}: {t.describe() if t else 'BF16'}" for pattern, t in own.items()]
    if sched.full_precision_eval_interval:
        lines.append(f"  full-precision evaluation every {sched.full_precision_eval_interval} steps")

    final = plan.at(max(sched.role_start(x) for x in ROLES))
    lines += _gemm_table(plan, final)
    if r.attention is Attention.FP8:
        where = sorted(final.attention)
        lines.append("  core attention (softmax(Q K^T) V): " + (
            f"fp8 in layers {_ranges(where)}: Q, K, V, softmax, output as activations; their gradients as gradients"
            if where else "bf16 (attention: fp8 cannot run here, see above)"))
        if where:
            lines.append("warning: attention: fp8 is experimental: in the gpt_125m shoot-out on an H200 it ended far "
                         "above BF16 (docs/benchmarks.md, FP8 attention); compare it with BF16 before relying on it")
    if r.fp8_param:
        lines.append(_fp8_param_line(plan))
    if parallel is not None and (parallel.pp > 1 or show_layout):
        lines += _pipeline_lines(plan, parallel, final, experts=show_layout)
    for pat in plan.unmatched_patterns:
        lines.append(f"warning: layers.bf16_modules pattern '{pat}' matches no module of this model")
    for pat in plan.unmatched_module_patterns:
        lines.append(f"warning: modules pattern '{pat}' matches no module of this model: its policies do nothing")
    for pat, why in plan.idle_module_patterns:
        lines.append(f"warning: modules pattern '{pat}' {why}")
    if r.is_fp8 and not final.any_fp8:
        rules = r.layers
        lines.append(f"warning: no GEMM of this model runs FP8, every linear layer stays BF16 (why BF16 above: "
                     f"recipe.layers.bf16_first={rules.bf16_first}, bf16_last={rules.bf16_last}"
                     f"{', bf16_modules' if rules.bf16_modules else ''} of {plan.layout.num_layers} layers); "
                     f"lower them or add layers, or train with +recipe=bf16 to say so")
    return "\n".join(lines)
