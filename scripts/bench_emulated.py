"""Emulated FP8 step time vs BF16 on the CPU (target: <= 2x BF16 for the tiny model).

    python scripts/bench_emulated.py                               # every recipe, tiny model, 40 steps x 2
    python scripts/bench_emulated.py --recipes hybrid mxfp8 --steps 60 --repeats 3
    python scripts/bench_emulated.py --out docs/bench -- trainer.micro_batch_size=8   # extra Hydra overrides

Prints a Markdown table of step times and ratios measured side by side in one run; writes JSON and a PNG.
"""

import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins"))  # a checkout without `pip install -e`


def main() -> None:
    from fp8_recipes.bench.emulated import bench_emulated, format_table, save
    from fp8_recipes.recipe.pack import recipe_names

    from fp8_recipes.checks import OneLineArgumentParser, at_least  # (one error line for a usage error)
    from fp8_recipes.training.config import check_writable_dir
    from fp8_recipes.training.errors import script_user_errors

    p = OneLineArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipes", nargs="+", default=recipe_names())
    p.add_argument("--steps", type=at_least(1), default=40)
    p.add_argument("--repeats", type=at_least(1), default=2)
    p.add_argument("--out", type=Path, default=Path("runs/bench_emulated"))
    p.add_argument("overrides", nargs="*", help="Hydra overrides for every run (after --)")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    with script_user_errors():  # (an unknown recipe, a bad override, an unwritable --out: one line)
        check_writable_dir("--out", str(args.out))
        result = bench_emulated(args.recipes, steps=args.steps, repeats=args.repeats, overrides=args.overrides)
    save(result, args.out)
    print(format_table(result))
    print(f"({result['machine']}, torch {result['torch']}, {args.steps} steps x {args.repeats} repeats; "
          f"JSON and PNG in {args.out})")


if __name__ == "__main__":
    main()
