"""The cost of numerics statistics: the same emulated run with ``debug`` off and with ``debug.interval=N``.

Three measures. In-run (robust to drift between runs): within each run with statistics on, every recorded
step's time beyond the mean of the steps that record nothing, plus the time spent writing rows between steps
(:func:`step_time_overhead`). Recorder: the time the recorder itself counts (measuring, dumping, writing
numerics.jsonl and TensorBoard; on the TE backend not the hooks' own work, so a lower bound), against the rest of
the run's wall time. A/B: runs
alternate (off, on, off, on, ...) so drift in the machine's speed hits both alike, and the time per step is the
run's wall time over its steps (``summary.wall_time_s``, recorded steps included), not the median, which would
hide the recorded steps; on a busy machine its noise can exceed the effect. Before a recipe's runs, an untimed
two-step run with statistics on (``warmup``) compiles what is compiled once per machine (on the GPU the fused
statistics kernels, which Triton then caches on disk), as a long run amortises it.
"""

from __future__ import annotations

import itertools
import statistics
import tempfile
from pathlib import Path

from fp8_recipes.bench.emulated import _compose
from fp8_recipes.bench.output import bar_chart
from fp8_recipes.checks import ConfigError
from fp8_recipes.observe.config import DebugConfig
from fp8_recipes.recipe.pack import check_pack_names
from fp8_recipes.rundir import METRICS, read_jsonl
from fp8_recipes.training.autopilot import statistics_for
from fp8_recipes.training.run import resolve_autopilot, resolve_debug, resolve_recipe, run_training

__all__ = ["SKIP_STEPS", "bench_stats", "check_runs", "format_table", "plot_overhead", "steps_problem"]

SKIP_STEPS = 5
"""The first steps of a run the in-run measure leaves out (compilation, caches)."""


def bench_stats(recipes: list[str], *, interval: int = 10, steps: int = 40, repeats: int = 3,
                overrides: list[str] = (), warmup: bool = True, on: list[str] | None = None) -> dict:
    """``on``: the overrides of the runs with statistics (default ``++debug.interval=INTERVAL``); e.g.
    ``["autopilot=on"]`` measures the autopilot, which reads them every ``autopilot.interval`` steps: the in-run
    measure counts the steps due every ``interval``, so the two must agree (both 10 by default)."""
    measured = list(on) if on else [f"++debug.interval={interval}"]
    check_runs(recipes, interval=interval, steps=steps, overrides=overrides, on=on)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in recipes:
            times: dict[str, list[float]] = {"off": [], "on": []}
            in_run: list[float] = []
            recorder: list[float] = []
            if warmup:  # untimed: compiles what a run compiles once (the GPU's statistics kernels; cached on disk)
                run_training(_compose([f"+recipe={name}", "trainer.max_steps=2", "trainer.warmup_steps=1",
                                       "trainer.eval_interval=0", "trainer.save_checkpoints=false",
                                       f"run_dir={tmp}/{name}-warmup", "++debug.interval=1", *overrides]))
            for rep in range(repeats):
                for mode in ("off", "on"):
                    debug = measured if mode == "on" else []
                    run_dir = Path(tmp) / f"{name}-{mode}-{rep}"
                    cfg = _compose([f"+recipe={name}", f"trainer.max_steps={steps}", "trainer.warmup_steps=2",
                                    "trainer.eval_interval=0", "trainer.save_checkpoints=false",
                                    "trainer.log_interval=1", f"run_dir={run_dir}", *debug, *overrides])
                    summary = run_training(cfg)
                    times[mode].append(summary["wall_time_s"] / summary["steps"])
                    if mode == "on":
                        spent = summary["numerics_s"]
                        recorder.append(100 * spent / (summary["wall_time_s"] - spent))
                        in_run.append(step_time_overhead(run_dir / METRICS, interval,
                                                         summary["numerics_write_s"]))
            off_s, on_s = statistics.median(times["off"]), statistics.median(times["on"])
            rows.append({"recipe": name, "step_s_off": off_s, "step_s_on": on_s,
                         "overhead_pct": 100 * (on_s / off_s - 1),
                         "in_run_overhead_pct": statistics.median(in_run), "runs": times, "in_run": in_run,
                         "recorder_pct": statistics.median(recorder), "recorder": recorder})
    return {"kind": "stats", "rows": rows, "interval": interval, "steps": steps, "repeats": repeats, "warmup": warmup,
            "overrides": list(overrides), "on": measured}


def steps_problem(interval: int, steps: int) -> str | None:
    """Why a run of ``steps`` steps with statistics every ``interval`` leaves the in-run measure nothing to compare
    (a step with statistics and one without, after the first :data:`SKIP_STEPS`): one line naming the option and
    the fix; else None."""
    if interval == 1:
        return ("--interval 1 records statistics at every step, leaving no plain step to compare with; give "
                "--interval >= 2")
    due = DebugConfig.from_dict({"interval": interval}).stats_due

    def kinds(last: int) -> set[bool]:
        return {due(step) for step in range(SKIP_STEPS + 1, last + 1)}

    if kinds(steps) == {True, False}:
        return None
    need = next(n for n in itertools.count(SKIP_STEPS + 2) if kinds(n) == {True, False})
    return (f"--steps {steps}: the in-run measure leaves out the first {SKIP_STEPS} steps and needs a step with "
            f"statistics (every {interval}: --interval) and one without after them; give --steps >= {need}")


def check_runs(recipes: list[str], *, interval: int, steps: int, overrides: list[str] = (),
               on: list[str] | None = None) -> None:
    """ConfigError (one line naming the option) before any run, for runs that would train and then leave nothing to
    measure: too few steps, a recipe with nothing in FP8 (no statistics), ``on`` runs that record none or not every
    ``interval`` steps (the in-run measure counts those)."""
    problem = steps_problem(interval, steps)
    if problem:
        raise ConfigError(problem)
    check_pack_names("--recipes", recipes)
    due = DebugConfig.from_dict({"interval": interval}).stats_due
    measured = list(on) if on else [f"++debug.interval={interval}"]
    for name in recipes:
        cfg = _compose([f"+recipe={name}", *measured, *overrides])
        if not resolve_recipe(cfg).is_fp8:
            raise ConfigError(f"--recipes {name}: runs nothing in FP8, so it records no numerics statistics to "
                              f"measure; give FP8 recipes (e.g. --recipes tensorwise hybrid)")
        debug = statistics_for(resolve_autopilot(cfg), resolve_debug(cfg))
        steps_on = [step for step in range(1, steps + 1) if debug.stats_due(step)]
        if steps_on != [step for step in range(1, steps + 1) if due(step)]:
            said, fix = (f"--on {' '.join(on)}", f"give --on ++debug.interval={interval}, or leave --on out") if on \
                else ("the overrides after --", "drop their debug keys, or set the statistics steps with --on")
            if steps_on and debug.interval > 1 and debug.start_step == 1 and debug.end_step is None:
                fix = f"give --interval {debug.interval}"  # (e.g. autopilot=on: its own interval)
            what = f"statistics at steps {', '.join(map(str, steps_on[:3]))}, ..." if steps_on else "no statistics"
            raise ConfigError(f"{said}: the runs measured against debug off record {what}, not every {interval} steps "
                              f"from step 1 (--interval {interval}); {fix}")


def step_time_overhead(metrics: Path, interval: int, write_s: float, skip: int = SKIP_STEPS) -> float:
    """The statistics' cost within one run, in % of the step time without them: each recorded step's time
    beyond the mean of the steps that record nothing, plus the time spent writing rows (between steps, outside
    any step's time), over the steps after the first `skip` (compilation, caches), each at the plain mean."""
    due = DebugConfig.from_dict({"interval": interval}).stats_due
    rows = read_jsonl(metrics)
    every = {r["step"]: r["step_time"] for r in rows if r.get("kind") == "train"}
    times = {step: t for step, t in every.items() if step > skip}
    plain = [t for step, t in times.items() if not due(step)]
    recorded = [t for step, t in times.items() if due(step)]
    if not plain or not recorded:
        raise ValueError(f"{metrics}: no recorded or no plain steps after step {skip} (interval {interval})")
    base = statistics.fmean(plain)
    writes = write_s * len(recorded) / sum(1 for step in every if due(step))  # the counted steps' share
    return 100 * (sum(t - base for t in recorded) + writes) / (base * len(times))


def format_table(result: dict) -> str:
    lines = [f"| recipe | step (s), debug off | step (s), interval {result['interval']} | A/B overhead | "
             f"in-run overhead | recorder's own time |", "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        recorder = f"{r['recorder_pct']:.2f}%" if "recorder_pct" in r else "-"
        lines.append(f"| {r['recipe']} | {r['step_s_off']:.4f} | {r['step_s_on']:.4f} | {r['overhead_pct']:+.1f}% | "
                     f"{r['in_run_overhead_pct']:.2f}% | {recorder} |")
    return "\n".join(lines)


def plot_overhead(result: dict, path):
    """The overheads per recipe as bars, with the 5% target as the dashed line."""
    rows = result["rows"]
    bars = {"A/B: step time on vs off": [r["overhead_pct"] for r in rows],
            "in-run: recorded steps' extra time": [r["in_run_overhead_pct"] for r in rows]}
    if all("recorder_pct" in r for r in rows):
        bars["recorder's own time"] = [r["recorder_pct"] for r in rows]
    return bar_chart(Path(path), [r["recipe"] for r in rows], bars, ylabel="overhead %", baseline=5.0,
                     title=f"numerics statistics every {result['interval']} steps (target <= 5%), "
                           f"{result['steps']} steps x {result['repeats']}")
