"""TE Linear forward + backward under each FP8 recipe against BF16, over a grid of (M, K, N), in one run.

A config is a recipe of the pack (what the plan runs for it on this GPU: ``hybrid`` and ``mxfp8`` become their
nearest legal TE recipe on Hopper) or ``NAME:fwd`` (the same, forward-only FP8). Each (shape, config) gets a fresh
``te.Linear(K, N)`` in BF16 and a BF16 input (M, K); one iteration is forward under ``te.autocast`` plus
backward with a fixed dy; time = CUDA events around ``iters`` iterations after ``warmup``. Also the relative
error of y, dx and dw against the BF16 run of the same shape (same weights, inputs and dy).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from pathlib import Path
from typing import Any

import torch

from fp8_recipes.backends.te import te_recipe
from fp8_recipes.bench.output import bar_chart, markdown_table, save_json
from fp8_recipes.plan.precision import Hardware, ModelLayout, PrecisionPlan
from fp8_recipes.plan.te import TERecipeKind
from fp8_recipes.recipe.pack import load_recipe

__all__ = ["DEFAULT_CONFIGS", "DEFAULT_SHAPES", "bench_gemm", "resolve_configs", "save", "summarize"]

DEFAULT_SHAPES = [(m, k, n) for m, (k, n) in itertools.product(
    (4096, 16384), ((4096, 4096), (4096, 14336), (14336, 4096), (8192, 8192)))]
DEFAULT_CONFIGS = ["delayed", "tensorwise", "blockwise", "hybrid", "mxfp8", "tensorwise:fwd", "blockwise:fwd"]


def resolve_configs(names: list[str]) -> list[tuple[str, Any]]:
    """[(label, TERecipe)] as the plan runs each recipe on this GPU; duplicates (e.g. mxfp8 = blockwise on
    Hopper) are dropped with a note."""
    hardware = Hardware.detect()
    out: list[tuple[str, Any]] = []
    for label in names:
        name, _, variant = label.partition(":")
        plan = PrecisionPlan(load_recipe(name), ModelLayout.gpt(1), hardware)
        if plan.te is None:
            raise ValueError(f"--configs {label}: no Transformer Engine plan here ({plan.backend_reason})")
        choice = plan.at(10**9).modules["decoder.layers.0.mlp.linear_fc1"].te
        if variant == "fwd":  # DelayedScaling has no backward_override: the CustomRecipe carrier has
            kind = TERecipeKind.CUSTOM if choice.recipe is TERecipeKind.DELAYED else choice.recipe
            choice = dataclasses.replace(choice, forward_only=True, recipe=kind)
        elif variant:
            raise ValueError(f"--configs {label}: unknown variant {variant!r}; use NAME or NAME:fwd")
        same = next((lbl for lbl, c in out if c == choice), None)
        if same:
            print(f"note: {label} runs as {same} on {hardware.name} ({choice.describe()}): measured once")
            continue
        out.append((label, choice))
    return out


def _one_config(m: int, k: int, n: int, recipe: Any, warmup: int, iters: int) -> tuple[float, list[torch.Tensor]]:
    import transformer_engine.pytorch as te

    torch.manual_seed(0)
    lin = te.Linear(k, n, bias=False, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)

    def once(keep: bool = False):
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            y = lin(x)
        y.backward(dy)
        out = [y.detach(), x.grad, lin.weight.grad] if keep else None
        x.grad = lin.weight.grad = None
        return out

    outputs = once(keep=True)
    for _ in range(warmup):
        once()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        once()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters, outputs


def _rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def bench_gemm(shapes: list[tuple[int, int, int]], configs: list[str], *, warmup: int = 5, iters: int = 20,
               out_dir: Path | None = None) -> dict[str, Any]:
    """Every config on every shape; with ``out_dir`` the results so far are saved after each shape."""
    resolved = resolve_configs(configs)
    recipes = {label: te_recipe(choice) for label, choice in resolved}
    rows: list[dict] = []
    result = {"kind": "gemm", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "te": _te_version(), "warmup": warmup, "iters": iters, "seconds": 0.0,
              "configs": {label: choice.describe() for label, choice in resolved}, "rows": rows}
    t0 = time.perf_counter()
    for m, k, n in shapes:
        base_ms, ref = _one_config(m, k, n, None, warmup, iters)
        row = {"shape": [m, k, n], "bf16_ms": base_ms, "bf16_tflops": 6 * m * k * n / base_ms / 1e9, "configs": {}}
        for label, _ in resolved:
            ms, outs = _one_config(m, k, n, recipes[label], warmup, iters)
            errors = {f"err_{w}": _rel_err(o, r) for w, o, r in zip(("y", "dx", "dw"), outs, ref, strict=True)}
            row["configs"][label] = {"ms": ms, "speedup": base_ms / ms, **errors}
        rows.append(row)
        print(f"  {m}x{k}x{n}: bf16 {base_ms:.2f} ms; " + ", ".join(
            f"{lbl} {c['speedup']:.2f}x" for lbl, c in row["configs"].items()), flush=True)
        result["seconds"] = time.perf_counter() - t0
        if out_dir is not None:
            save(result, out_dir)
    return result


def _te_version() -> str:
    import transformer_engine

    return transformer_engine.__version__


def summarize(result: dict[str, Any]) -> tuple[str, list[str], dict[str, list[float]]]:
    """(Markdown table of speedups vs BF16 and errors, x labels, series) for printing and plotting."""
    labels = list(result["configs"])
    header = ["M x K x N", "BF16 ms", "BF16 TFLOP/s"] + [f"{lbl} (x)" for lbl in labels]
    rows, groups = [], []
    series: dict[str, list[float]] = {lbl: [] for lbl in labels}
    for row in result["rows"]:
        groups.append("x".join(map(str, row["shape"])))
        rows.append([groups[-1], row["bf16_ms"], row["bf16_tflops"]] +
                    [row["configs"][lbl]["speedup"] for lbl in labels])
        for lbl in labels:
            series[lbl].append(row["configs"][lbl]["speedup"])
    errs = [[lbl, result["configs"][lbl]] + [max(r["configs"][lbl][f"err_{w}"] for r in result["rows"])
                                            for w in ("y", "dx", "dw")] for lbl in labels]
    text = (markdown_table(header, rows) + "\n\nworst relative error vs BF16 over the shapes:\n" +
            markdown_table(["config", "TE recipe", "y", "dx", "dw"], errs))
    return text, groups, series


def save(result: dict[str, Any], out_dir: Path) -> None:
    save_json(out_dir / "bench_gemm.json", result)
    _, groups, series = summarize(result)
    bar_chart(out_dir / "bench_gemm.png", groups, series, ylabel="speed-up vs BF16 (fwd + bwd)",
              title=f"te.Linear, {result['device']}, TE {result['te']}")
