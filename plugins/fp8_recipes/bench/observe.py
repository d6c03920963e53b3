"""The cost of numerics statistics: the same emulated run with ``debug`` off and with ``debug.interval=N``.

Two measures. In-run (robust on a shared machine): the recorder times what it spends (measuring, dumping,
writing numerics.jsonl and TensorBoard), reported against the rest of the same run's wall time. A/B: runs
alternate (off, on, off, on, ...) so drift in the machine's speed hits both alike, and the time per step is the
run's wall time over its steps (``summary.wall_time_s``, recorded steps included), not the median, which would
hide the recorded steps; on a busy machine its noise can exceed the effect.
"""

from __future__ import annotations

import statistics
import tempfile

from fp8_recipes.bench.emulated import _compose

__all__ = ["bench_stats", "format_table", "plot_overhead"]


def bench_stats(recipes: list[str], *, interval: int = 10, steps: int = 40, repeats: int = 3,
                overrides: list[str] = ()) -> dict:
    from fp8_recipes.training.run import run_training

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in recipes:
            times: dict[str, list[float]] = {"off": [], "on": []}
            in_run: list[float] = []
            for rep in range(repeats):
                for mode in ("off", "on"):
                    debug = [f"++debug.interval={interval}"] if mode == "on" else []
                    cfg = _compose([f"+recipe={name}", f"trainer.max_steps={steps}", "trainer.warmup_steps=2",
                                    "trainer.eval_interval=0", "trainer.save_checkpoints=false",
                                    f"run_dir={tmp}/{name}-{mode}-{rep}", *debug, *overrides])
                    summary = run_training(cfg)
                    times[mode].append(summary["wall_time_s"] / summary["steps"])
                    if mode == "on":
                        spent = summary["numerics_s"]
                        in_run.append(100 * spent / (summary["wall_time_s"] - spent))
            off, on = statistics.median(times["off"]), statistics.median(times["on"])
            rows.append({"recipe": name, "step_s_off": off, "step_s_on": on, "overhead_pct": 100 * (on / off - 1),
                         "in_run_overhead_pct": statistics.median(in_run), "runs": times, "in_run": in_run})
    return {"rows": rows, "interval": interval, "steps": steps, "repeats": repeats, "overrides": list(overrides)}


def format_table(result: dict) -> str:
    lines = [f"| recipe | step (s), debug off | step (s), interval {result['interval']} | A/B overhead | "
             f"in-run overhead |", "|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['recipe']} | {r['step_s_off']:.4f} | {r['step_s_on']:.4f} | {r['overhead_pct']:+.1f}% | "
                     f"{r['in_run_overhead_pct']:.2f}% |")
    return "\n".join(lines)


def plot_overhead(result: dict, path):
    """Both overheads per recipe as bars, with the 5% target as the dashed line."""
    from pathlib import Path

    from fp8_recipes.bench.output import bar_chart

    rows = result["rows"]
    return bar_chart(Path(path), [r["recipe"] for r in rows],
                     {"A/B: step time on vs off": [r["overhead_pct"] for r in rows],
                      "in-run: recorder time / rest": [r["in_run_overhead_pct"] for r in rows]},
                     ylabel="overhead %", baseline=5.0,
                     title=f"numerics statistics every {result['interval']} steps (target <= 5%), "
                           f"{result['steps']} steps x {result['repeats']}")
