"""Overhead of numerics statistics (debug.interval) on FP8 training, emulated or TE (target: <= 5% at interval 10).

    python scripts/bench_stats.py                                  # tensorwise and hybrid, tiny model, 40 steps x 3
    python scripts/bench_stats.py --recipes delayed --interval 5 --steps 60
    python scripts/bench_stats.py -- model.num_layers=2             # extra Hydra overrides
    python scripts/bench_stats.py --json docs/bench/bench_stats.json  # also the JSON and a PNG beside it
    python scripts/bench_stats.py --plot-only docs/bench/bench_stats.json
    python scripts/bench_stats.py --recipes delayed --on autopilot=on   # the autopilot's cost (it reads them)

Prints a Markdown table: mean step time with debug off and on, the A/B overhead, the in-run overhead (recorded
steps' extra time within each run) and the recorder's own time. Refused before any run, in one line: runs that would
leave that nothing to measure (--steps with no recorded and plain step after the first 5, a recipe with nothing in
FP8, --on runs that record no statistics or not every --interval steps) and an unwritable --json.
"""

import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins"))  # a checkout without `pip install -e`


def main() -> None:
    from fp8_recipes.bench.observe import bench_stats, format_table, plot_overhead, steps_problem
    from fp8_recipes.bench.output import load_result, save_json

    from fp8_recipes.checks import OneLineArgumentParser, at_least  # (one error line for a usage error)

    p = OneLineArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipes", nargs="+", default=["tensorwise", "hybrid"])
    p.add_argument("--interval", type=at_least(1), default=10)
    p.add_argument("--steps", type=at_least(1), default=40)
    p.add_argument("--repeats", type=at_least(1), default=3)
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed two-step run before each recipe")
    p.add_argument("--json", type=Path, default=None, help="also write the result here (and a PNG beside it)")
    p.add_argument("--plot-only", type=Path, default=None, help="redraw the table and PNG of a saved JSON")
    p.add_argument("--on", nargs="+", default=None, metavar="OVERRIDE",
                   help="overrides of the runs measured against debug off (default: ++debug.interval=INTERVAL)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides for every run (after --)")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.plot_only:
        result = load_result(args.plot_only, "stats")
        print(format_table(result))
        plot_overhead(result, args.plot_only.with_suffix(".png"))
        return
    problem = steps_problem(args.interval, args.steps)  # (the in-run measure compares plain and recorded steps)
    if problem:
        p.error(problem)
    from fp8_recipes.training.config import check_writable_file
    from fp8_recipes.training.errors import script_user_errors

    with script_user_errors():  # (a recipe that is none or not FP8, an override the config refuses, --on recording
        # no statistics, an unwritable --json: one line, before any run)
        if args.json:  # (before minutes of runs)
            check_writable_file("--json", args.json, "bench_stats.json")
        result = bench_stats(args.recipes, interval=args.interval, steps=args.steps, repeats=args.repeats,
                             overrides=args.overrides, warmup=not args.no_warmup, on=args.on)
    if args.json:
        save_json(args.json, result)
        plot_overhead(result, args.json.with_suffix(".png"))
    print(format_table(result))
    print(f"({args.steps} steps x {args.repeats} repeats, statistics every {args.interval} steps, every module)")


if __name__ == "__main__":
    main()
