"""Training speed and memory per parallel layout, through scripts/train.py itself (Megatron-Core's engine): tokens/s
per GPU against one GPU, FP8 against BF16 within each layout, and peak memory per GPU, measured in one session.

Each (layout, recipe) is one ``scripts/train.py`` run (``torchrun`` for more than one process) with checkpoints and
evaluation off; its summary.json gives the median tokens/s over the steps and rank 0's peak memory. Layouts keep the
micro-batch and the accumulation per data-parallel rank of the one-GPU run (data parallelism scales the global batch
with the ranks; model parallelism keeps it). ``--baseline DIR`` also runs another checkout's scripts/train.py on one
GPU (the engine before a change: the side-by-side before/after a change of engine asks for).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from fp8_recipes.bench.output import bar_chart, markdown_table, save_json
from fp8_recipes.rundir import read_summary

__all__ = ["LAYOUTS", "bench_parallel", "save"]

DISTOPT_OFF = ["trainer.use_distributed_optimizer=false", "trainer.overlap_grad_reduce=false",
               "trainer.overlap_param_gather=false"]
LAYOUTS: dict[str, tuple[int, list[str], int]] = {
    # name: (processes, trainer overrides, global-batch multiple of the one-GPU run's)
    "1gpu": (1, [], 1),
    "1gpu-plainopt": (1, DISTOPT_OFF, 1),
    "1gpu-bf16moments": (1, ["trainer.use_precision_aware_optimizer=true", "trainer.exp_avg_dtype=bf16",
                             "trainer.exp_avg_sq_dtype=bf16"], 1),
    "dp2": (2, [], 2),
    "dp2-plainopt": (2, DISTOPT_OFF, 2),
    "tp2sp": (2, ["trainer.tensor_model_parallel_size=2", "trainer.sequence_parallel=true"], 1),
    "pp2": (2, ["trainer.pipeline_model_parallel_size=2"], 1),
    "cp2": (2, ["trainer.context_parallel_size=2"], 1),
    "dp4": (4, [], 4),
    "tp2pp2": (4, ["trainer.tensor_model_parallel_size=2", "trainer.pipeline_model_parallel_size=2"], 1),
}
BASELINE = "1gpu (baseline)"


def _value(overrides: list[str], key: str, default: int) -> int:
    for o in overrides:
        if o.startswith(f"{key}="):
            return int(o.split("=", 1)[1])
    return default


def _command(train_py: Path, nproc: int, args: list[str]) -> list[str]:
    if nproc == 1:
        return [sys.executable, str(train_py), *args]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), str(train_py), *args]


def bench_parallel(layouts: list[str], recipes: list[str], overrides: list[str], *, out: Path, steps: int,
                   gbs: int, baseline: Path | None = None) -> dict[str, Any]:
    """Run every (layout, recipe) and return {"runs": [...], "command", "date"}; logs in ``out/logs``."""
    root = Path(__file__).resolve().parents[3]
    unknown = [name for name in layouts if name not in LAYOUTS]
    if unknown:
        raise ValueError(f"--layouts: {unknown[0]!r} is not one of {', '.join(LAYOUTS)}")
    plan = [(name, recipe) for name in layouts for recipe in recipes]
    if baseline is not None:
        plan = [(BASELINE, recipe) for recipe in recipes] + plan
    runs = []
    (out / "logs").mkdir(parents=True, exist_ok=True)
    for i, (name, recipe) in enumerate(plan, 1):
        nproc, extra, multiple = LAYOUTS["1gpu" if name == BASELINE else name]
        train_py = (Path(baseline).resolve() if name == BASELINE else root) / "scripts" / "train.py"
        run_dir = out / "runs" / f"{name.split()[0]}{'-base' if name == BASELINE else ''}-{recipe}"
        args = [*([f"+recipe={recipe}"] if recipe != "bf16" else []), *overrides, *extra,
                f"trainer.max_steps={steps}", f"trainer.global_batch_size={gbs * multiple}",
                "trainer.save_checkpoints=false", "trainer.eval_interval=0", f"run_dir={run_dir}"]
        log = out / "logs" / f"{run_dir.name}.log"
        print(f"[{i}/{len(plan)}] {name} {recipe}: {' '.join(_command(train_py, nproc, args)[1:])}", flush=True)
        t0 = time.perf_counter()
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        with open(log, "w") as f:
            proc = subprocess.run(_command(train_py, nproc, args), cwd=train_py.parents[1], stdout=f,
                                  stderr=subprocess.STDOUT, env=env)
        row: dict[str, Any] = {"layout": name, "recipe": recipe, "gpus": nproc, "rc": proc.returncode,
                               "wall_s": round(time.perf_counter() - t0, 1)}
        summary = read_summary(run_dir) if proc.returncode == 0 else {}
        if summary:
            row.update(tokens_per_s=summary["tokens_per_s_median"],
                       peak_gib=summary["peak_memory_bytes"] / 2**30, final_loss=summary["final_loss"])
        else:
            row["error"] = log.read_text()[-2000:].strip().splitlines()[-1:] if log.is_file() else []
        runs.append(row)
        print(f"    -> {row.get('tokens_per_s', 0):,.0f} tok/s, peak {row.get('peak_gib', 0):.1f} GiB, "
              f"rc {row['rc']} ({row['wall_s']} s)", flush=True)
    return {"kind": "parallel", "runs": runs, "overrides": overrides, "steps": steps, "global_batch_size_1gpu": gbs,
            "date": time.strftime("%Y-%m-%d"), "micro_batch_size": _value(overrides, "trainer.micro_batch_size", 0)}


def _ratios(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Each run with tokens/s per GPU, its ratio to the one-GPU run of its recipe, and FP8 / BF16 in its layout."""
    ok = [r for r in result["runs"] if "tokens_per_s" in r]
    one = {r["recipe"]: r["tokens_per_s"] for r in ok if r["layout"] == "1gpu"}
    bf16 = {r["layout"]: r["tokens_per_s"] for r in ok if r["recipe"] == "bf16"}
    rows = []
    for r in result["runs"]:
        per_gpu = r.get("tokens_per_s", float("nan")) / r["gpus"]
        rows.append({**r, "per_gpu": per_gpu,
                     "vs_1gpu": r["tokens_per_s"] / one[r["recipe"]] if r["recipe"] in one and "tokens_per_s" in r
                     else float("nan"),
                     "fp8_vs_bf16": r["tokens_per_s"] / bf16[r["layout"]] if r["layout"] in bf16
                     and "tokens_per_s" in r and r["recipe"] != "bf16" else float("nan")})
    return rows


def save(result: dict[str, Any], out: Path) -> str:
    """bench_parallel.json, .md (the table) and .png (tokens/s per GPU, per layout and recipe); returns the table."""
    rows = _ratios(result)
    table = markdown_table(
        ["layout", "recipe", "GPUs", "tokens/s", "per GPU", "x one GPU (same recipe)", "FP8 / BF16", "peak GiB/GPU"],
        [[r["layout"], r["recipe"], r["gpus"], r.get("tokens_per_s", float("nan")), r["per_gpu"], r["vs_1gpu"],
          r["fp8_vs_bf16"], r.get("peak_gib", float("nan"))] for r in rows])
    save_json(out / "bench_parallel.json", result)
    (out / "bench_parallel.md").write_text(table + "\n")
    layouts = list(dict.fromkeys(r["layout"] for r in rows))
    recipes = list(dict.fromkeys(r["recipe"] for r in rows))
    series = {rec: [next((r["per_gpu"] / 1000 for r in rows if r["layout"] == lay and r["recipe"] == rec),
                         float("nan")) for lay in layouts] for rec in recipes}
    bar_chart(out / "bench_parallel.png", layouts, series, ylabel="thousand tokens/s per GPU",
              title=f"scripts/train.py per layout ({result['date']}): tokens/s per GPU", baseline=None)
    return table
