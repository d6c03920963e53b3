"""Emulated-FP8 step time against BF16 on the CPU: the same model, data and seed, recipes run round-robin.

Each (recipe, repeat) is one short training run through :func:`~fp8_recipes.training.run.run_training`; the
step time is the run's median (the loop excludes evaluation and checkpoints from it). Recipes with BF16 warmup or
staged enablement run with their schedule set to 0, so the steady state (every role FP8) is what is timed. Recipes are interleaved
(bf16, r1, r2, ..., bf16, r1, ...) so drift in the machine's speed hits every recipe alike; per recipe the
median over repeats is reported, as a ratio to BF16 measured in the same run.
"""

from __future__ import annotations

import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

from fp8_recipes.recipe.pack import check_pack_names, conf_dir
from fp8_recipes.training.run import run_training

__all__ = ["bench_emulated", "format_table", "plot"]


def _compose(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        return compose("train", overrides=overrides)


def bench_emulated(recipes: list[str], *, steps: int = 40, repeats: int = 2, overrides: list[str] = ()) -> dict:
    from omegaconf import OmegaConf

    names = ["bf16"] + [r for r in recipes if r != "bf16"]
    check_pack_names("--recipes", names)  # (each run is +recipe=NAME)
    times: dict[str, list[float]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(repeats):
            for name in names:
                cfg = _compose([f"+recipe={name}", f"trainer.max_steps={steps}", "trainer.warmup_steps=2",
                                "trainer.eval_interval=0", "trainer.save_checkpoints=false",
                                f"run_dir={tmp}/{name}-{rep}", *overrides])
                if "schedule" in cfg.recipe:  # time the recipe's final stage (all roles FP8): its steady state
                    OmegaConf.update(cfg, "recipe.schedule", {"bf16_warmup_steps": 0, "enable": 0}, merge=False,
                                     force_add=True)
                summary = run_training(cfg)
                tokens = int(cfg.trainer.global_batch_size) * int(cfg.model.seq_length)
                times[name].append(tokens / summary["tokens_per_s_median"])
    base = statistics.median(times["bf16"])
    rows = [{"recipe": n, "step_s": statistics.median(t), "ratio_vs_bf16": statistics.median(t) / base,
             "runs": t} for n, t in times.items()]
    return {"rows": rows, "steps": steps, "repeats": repeats, "overrides": list(overrides),
            "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.processor() or platform.machine()}, "
            f"{_cores()} cores", "torch": _torch_version()}


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0


def _torch_version() -> str:
    import torch

    return torch.__version__


def format_table(result: dict) -> str:
    lines = ["| recipe | step (s) | vs BF16 |", "|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['recipe']} | {r['step_s']:.3f} | {r['ratio_vs_bf16']:.2f}x |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar([r["recipe"] for r in rows], [r["ratio_vs_bf16"] for r in rows], color="tab:blue")
    ax.axhline(2.0, color="tab:red", linestyle="--", label="target: <= 2x BF16")
    ax.set_ylabel("step time / BF16 step time")
    ax.set_title(f"Emulated FP8 on the CPU ({result['machine']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def save(result: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_emulated.json").write_text(json.dumps(result, indent=2))
    plot(result, out_dir / "bench_emulated.png")
