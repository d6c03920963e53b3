"""Where a training step's GPU time goes: CUDA kernels from torch.profiler, grouped into categories.

The categories come from kernel names (cuBLASLt / CUTLASS GEMMs, cuDNN / flash attention, TE's cast and
transpose kernels, ...); the top kernels are listed by name as well, so nothing hides behind a wrong bucket.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable

__all__ = ["CATEGORIES", "categorize", "category_ms", "format_profile", "profile_parts", "profile_steps",
           "profile_table", "timeline"]

# First match wins; the order matters (an FP8 GEMM is a GEMM before it is an FP8 kernel).
# cuBLASLt's Hopper kernels are named nvjet_sm90_<operand types>_...: t = bf16, q = e4m3, r = e5m2 (measured:
# the BF16 run has only "tst" GEMMs; fprop under FP8 runs "qqtst", dgrad/wgrad with E5M2 gradients "qrtst").
CATEGORIES: list[tuple[str, re.Pattern]] = [
    ("gemm fp8", re.compile(r"nvjet_sm\d+_[qr]{2}|(gemm|xmma|cutlass).*(e4m3|e5m2|fp8)|(e4m3|e5m2|fp8).*gemm", re.I)),
    ("gemm bf16", re.compile(r"gemm|nvjet|xmma|cutlass|cublas", re.I)),
    ("attention", re.compile(r"flash|fmha|attn|attention|cudnn|sdpa", re.I)),
    # MoE: the router's top-k, token permutation and un-permutation, the experts' FP8 padding
    ("moe route/permute/pad", re.compile(r"permut|topk|radix|sort|moe|routing|padding|histogram|bincount", re.I)),
    # (before FP8's: TE's multi_tensor_scale is the gradient clipping's scale, not a quantization)
    ("optimizer", re.compile(r"adam|multi_tensor|foreach", re.I)),
    ("fp8 quantize/amax/transpose", re.compile(
        r"transformer_engine.*(cast|quantiz|amax|transpose|scale)|cast_transpose|block_scaled|compute_amax|"
        r"fp8_quantize|delayed_scaling|amax_and_scale", re.I)),
    ("norm", re.compile(r"norm", re.I)),
    ("loss / softmax / embedding", re.compile(r"softmax|cross_entropy|nll|log_softmax|embedding|index", re.I)),
    ("activation / elementwise", re.compile(r"elementwise|vectorized|silu|swiglu|gelu|mul|add|copy|fill", re.I)),
]


def categorize(name: str) -> str:
    for label, pattern in CATEGORIES:
        if pattern.search(name):
            return label
    return "other"


def profile_steps(step: Callable[[int], object], first_step: int, n: int = 2) -> dict:
    """Run `step(i)` n times under torch.profiler; return {categories: {label: ms per step}, top: [...], kernels:
    {name: ms per step}} and the GPU's timeline per step (:func:`timeline`: span_ms, busy_ms)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(first_step, first_step + n):
            step(i)
        torch.cuda.synchronize()
    kernels: Counter = Counter()
    for e in prof.key_averages():
        if _on_gpu(e):
            us = getattr(e, "self_device_time_total", None)
            if us is None:
                us = getattr(e, "self_cuda_time_total", 0)
            kernels[e.key] += us / 1000 / n
    cats = {cat: sum(ms for _, ms in members) for cat, members in _by_category(kernels).items()}
    spans = [(e.time_range.start, e.time_range.end) for e in prof.events() if _on_gpu(e)]
    return {"total_ms": sum(cats.values()), "categories": cats,
            "top": [(name[:110], ms, categorize(name)) for name, ms in kernels.most_common(12)],
            "kernels": {name: ms for name, ms in kernels.most_common()},  # all of them: re-bucket offline
            **timeline(spans, n)}


def _on_gpu(event: object) -> bool:
    """A profiler event that ran on the GPU (a kernel, a copy, a memset)."""
    return str(getattr(event, "device_type", "")).endswith("CUDA")


def timeline(spans: list[tuple[float, float]], n: int) -> dict[str, float]:
    """Per step of ``n``, from the GPU's (start, end) intervals in microseconds: ``span_ms`` from the first start to
    the last end, ``busy_ms`` their union (span - busy: the GPU idle, waiting on the host; the kernels' sum - busy:
    kernels that ran beside others, on other streams); {} without any."""
    if not spans:
        return {}
    spans = sorted(spans)
    busy, (first, end) = 0.0, spans[0]
    start = first
    for s, e in spans:
        if s > end:
            busy, start = busy + end - start, s
        end = max(end, e)  # (after the last span: the last end)
    busy += end - start
    return {"span_ms": (end - first) / 1000 / n, "busy_ms": busy / 1000 / n}


def _by_category(kernels: dict[str, float]) -> dict[str, list[tuple[str, float]]]:
    """The kernels (name, ms) of each category, each category's largest first; the categories largest first."""
    groups: dict[str, list[tuple[str, float]]] = {}
    for name, ms in sorted(kernels.items(), key=lambda kernel: -kernel[1]):
        groups.setdefault(categorize(name), []).append((name, ms))
    return dict(sorted(groups.items(), key=lambda group: -sum(ms for _, ms in group[1])))


def format_profile(label: str, prof: dict, per_category: int = 3) -> str:
    """The categories, largest first, each with its ``per_category`` largest kernels (what a category is made of:
    a GEMM count, a copy, a clipping's scale), then the largest kernels overall. Categories are sorted anew from
    the kernels where the result keeps them all (a result saved before a category changed reads as now)."""
    lines = [f"{label}: {prof['total_ms']:.1f} ms of GPU kernels per step"]
    if "busy_ms" in prof:  # (results before the timeline have none)
        lines.append(f"  GPU busy {prof['busy_ms']:.1f} of {prof['span_ms']:.1f} ms per step: idle "
                     f"{prof['span_ms'] - prof['busy_ms']:.1f} ms (waiting on the host), "
                     f"{max(prof['total_ms'] - prof['busy_ms'], 0.0):.1f} ms of kernels beside others (other streams)")
    groups = _by_category(prof.get("kernels", {}))  # (all of them; results before it have only "top")
    totals = dict(sorted(category_ms(prof).items(), key=lambda category: -category[1]))
    for cat, ms in totals.items():
        lines.append(f"  {cat:<30} {ms:8.1f} ms  {100 * ms / prof['total_ms']:5.1f}%")
        for name, kernel_ms in groups.get(cat, [])[:per_category]:
            lines.append(f"      {kernel_ms:7.2f} ms  {name[:100]}")
    lines.append("  top kernels:")
    for name, ms, _ in prof["top"]:
        lines.append(f"    {ms:7.2f} ms  [{categorize(name)}] {name}")
    return "\n".join(lines)


def category_ms(prof: dict) -> dict[str, float]:
    """ms per step of each category, in :data:`CATEGORIES`' order ("other" last), from the kernels where the result
    keeps them all (re-bucketed as now), else its saved categories; categories without a kernel left out."""
    totals = {cat: sum(ms for _, ms in members) for cat, members in _by_category(prof.get("kernels", {})).items()}
    totals = totals or prof["categories"]
    order = [label for label, _ in CATEGORIES] + ["other"]
    order += [cat for cat in totals if cat not in order]  # (a saved result's category since renamed: kept, last)
    return {cat: totals[cat] for cat in order if totals.get(cat)}


def profile_parts(rows: list[dict]) -> tuple[list[dict], dict[str, list[float]]]:
    """The rows with a profile, and each category's ms per step in each of them (:data:`CATEGORIES`' order, "other"
    last; a category no row has left out)."""
    profiled = [r for r in rows if r.get("profile")]
    per_row = [category_ms(r["profile"]) for r in profiled]
    order = list(dict.fromkeys([label for label, _ in CATEGORIES] + ["other"] + [cat for c in per_row for cat in c]))
    return profiled, {cat: [c.get(cat, 0.0) for c in per_row] for cat in order if any(cat in c for c in per_row)}


def profile_table(rows: list[dict]) -> str | None:
    """Markdown: one line per profiled row (model, config) with its step's GPU span, idle time and ms per category,
    side by side, so a config's kernels read against BF16's; None where no row has a profile."""
    from fp8_recipes.bench.output import markdown_table

    profiled, parts = profile_parts(rows)
    if not profiled:
        return None

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    lines = [[r["model"], r["config"], ms(r["profile"].get("span_ms")),
              ms(r["profile"]["span_ms"] - r["profile"]["busy_ms"] if "busy_ms" in r["profile"] else None),
              *(ms(values[i]) for values in parts.values())] for i, r in enumerate(profiled)]
    return markdown_table(["model", "config", "step (GPU span)", "GPU idle", *parts], lines)
