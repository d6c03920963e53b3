"""The recipe shoot-out: the same model, data and seed trained under BF16 and N FP8 recipes; loss curves against
BF16, a table (final-loss gap %, eval loss, tokens/s, peak memory) and inference parity per recipe.

    python scripts/compare_recipes.py --recipes tensorwise blockwise               # tiny model, CPU, emulated
    python scripts/compare_recipes.py --recipes tensorwise blockwise hybrid delayed --out runs/cmp \
        trainer.max_steps=150 trainer.eval_interval=50
    python scripts/compare_recipes.py --recipes tensorwise blockwise hybrid --parallel 4 --out runs/cmp125m \
        model=gpt_125m trainer=gpu trainer.max_steps=1000 trainer.eval_interval=1000       # one H200, real FP8
    python scripts/compare_recipes.py --recipes nvfp4 tests/gpu/nvfp4_ablations/*.yaml   # recipe files: runs
                                                                                   # named by their stems
    python scripts/compare_recipes.py --plot-only runs/cmp                         # redraw table and PNG
    python scripts/compare_recipes.py --over-seeds runs/cmp1234 runs/cmp4321 --out runs/seeds   # one shoot-out's
                                      # seeds side by side: gaps per seed and their mean (seeds.md, .json, .png)
    python scripts/compare_recipes.py --recipes tensorwise blockwise --out runs/cmp --resume   # go on after an
                                      # interruption (the same arguments): finished runs kept, the others resumed

BF16 is always run, as the reference. Every other argument is a Hydra override of scripts/train.py, given to every
run (`recipe.*` ones to the FP8 runs only); each run is scripts/train.py in a subprocess with its run dir OUT/NAME
and its log in OUT/logs/NAME.log. After each FP8 run its final checkpoint is evaluated with FP8 and with BF16
GEMMs (inference parity; scripts/eval_checkpoint.py does the same for any run; --no-parity skips it).
Writes OUT/compare.json, OUT/compare.md and OUT/compare.png (see fp8_recipes/bench/compare.py for what each
number is). Exit codes: 0 every run finished; 1 some run failed (its row says so); 2 a bad argument or override
(one `error: <key>: ...` line, nothing run); 130 interrupted by Ctrl-C or SIGTERM (each running run finishes its
step and checkpoints; the table and PNG show what was logged).
"""

import logging
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins"))  # a checkout without `pip install -e`


PATH_OPTIONS = ("--out", "--reference", "--plot-only", "--over-seeds")


def _split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the options and recipe names, the Hydra overrides): KEY=VALUE words are overrides wherever they stand, but
    not a path option's value or a path that exists (a recipe file or run dir may hold '=': runs/lr=3e-4/bf16)."""
    words, overrides = [], []
    for i, arg in enumerate(argv):
        path = (i > 0 and argv[i - 1] in PATH_OPTIONS) or Path(arg).exists()
        (overrides if "=" in arg and not arg.startswith("-") and not path else words).append(arg)
    return words, overrides


TRAINING_OPTIONS = ("--recipes", "--parallel", "--no-parity", "--parity-iters", "--plot-only", "--reference",
                    "--resume")
"""What --over-seeds, which trains nothing, refuses beside it (rather than ignore)."""


def _over_seeds(args, words: list[str]) -> None:
    """--over-seeds: merge the shoot-outs' tables; a user error is one line (exit 2), nothing written."""
    from fp8_recipes.bench.seeds import load_shootout, merge_seeds, save_seeds
    from fp8_recipes.training.config import check_writable_dir
    from fp8_recipes.training.errors import USER_ERROR_EXIT

    out = args.out or Path("runs") / f"seeds-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        options = [w.split("=")[0] for w in words]  # (--parallel=2 is the option --parallel)
        others = [o for o in options if o in TRAINING_OPTIONS] + ["overrides"] * bool(args.overrides)
        if others:
            raise ValueError(f"--over-seeds: merges finished shoot-outs and trains nothing; drop {others[0]}")
        merged = merge_seeds([load_shootout(path) for path in args.over_seeds])
        check_writable_dir("--out", str(out))
    except ValueError as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        sys.exit(USER_ERROR_EXIT)
    print(save_seeds(merged, out))
    print(f"({', '.join(f.name for f in sorted(out.glob('seeds.*')))} in {out})")


def main() -> None:
    from fp8_recipes.checks import OneLineArgumentParser  # (one error line for a usage error)

    p = OneLineArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipes", nargs="+", default=["tensorwise", "blockwise", "hybrid"], metavar="NAME|FILE",
                   help="recipes of the pack or recipe files (each run named by the file's stem) to compare with "
                   "BF16 (default: tensorwise blockwise hybrid)")
    p.add_argument("--out", type=Path, default=None, help="output directory (default: runs/compare-<time>)")
    p.add_argument("--parallel", type=int, default=1, help="runs at once (default 1; one H200 fits 4 gpt_125m)")
    p.add_argument("--no-parity", dest="parity", action="store_false", help="skip the inference-parity evaluation")
    p.add_argument("--parity-iters", type=int, help="validation micro-batches for parity (default: trainer.eval_iters)")
    p.add_argument("--plot-only", type=Path, metavar="DIR", help="redraw table and PNG of a shoot-out directory")
    p.add_argument("--reference", type=Path, metavar="RUN_DIR", help="a finished BF16 run of the same config (e.g. "
                   "OUT/bf16 of an earlier shoot-out), linked as OUT/bf16 instead of training BF16 again")
    p.add_argument("--resume", action="store_true", help="continue the shoot-out in --out (the same recipes and "
                   "overrides): finished runs are kept, interrupted ones go on from their checkpoints, missing ones "
                   "start")
    p.add_argument("--over-seeds", nargs="+", action="extend", type=Path, metavar="DIR|JSON",
                   help="shoot-outs of one experiment under different trainer.seed (directories or their "
                   "compare.json): write the gaps per seed and their mean to --out (seeds.md, seeds.json, "
                   "seeds.png); trains nothing")
    p.add_argument("overrides", nargs="*", help="Hydra overrides for every run, e.g. model=gpt_125m trainer=gpu")
    # KEY=VALUE words are overrides wherever they stand (else `--recipes a b trainer.max_steps=9` would take the
    # override for a recipe name), unless they are a path (_split_overrides).
    words, overrides = _split_overrides(sys.argv[1:])
    args = p.parse_args(words)
    args.overrides += overrides
    logging.basicConfig(level=logging.WARNING, format="%(message)s")

    from fp8_recipes.bench.compare import collect, compare_recipes, save
    from fp8_recipes.training.config import check_writable_dir
    from fp8_recipes.training.errors import USER_ERROR_EXIT
    from fp8_recipes.training.run import quiet_third_party_logs

    quiet_third_party_logs()
    if args.over_seeds:
        _over_seeds(args, words)
        return
    out = args.plot_only or args.out or Path("runs") / f"compare-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        if args.parity_iters is not None and args.parity_iters < 1:
            raise ValueError(f"--parity-iters: {args.parity_iters} must be >= 1 (or leave it out: trainer.eval_iters)")
        if args.plot_only and not args.plot_only.is_dir():
            raise ValueError(f"--plot-only: '{args.plot_only}' is not a directory; give a directory written by "
                             f"scripts/compare_recipes.py")
        if args.reference is not None and args.plot_only:
            raise ValueError("--reference: --plot-only trains nothing; drop one of them")
        if args.reference is not None and not args.reference.is_dir():
            raise ValueError(f"--reference: '{args.reference}' is not a directory; give the run dir of a finished "
                             f"BF16 run (e.g. OUT/bf16 of an earlier shoot-out)")
        if args.resume and (args.plot_only or args.out is None):
            raise ValueError("--resume: continues the shoot-out in --out; give --out DIR (and no --plot-only)")
        if args.resume and not (args.out / "compare.json").is_file():
            raise ValueError(f"--resume: '{args.out}' holds no shoot-out (no compare.json); check --out, or drop "
                             f"--resume to start one there")
        if not args.plot_only and set(args.recipes) <= {"bf16"}:  # (the BF16 reference runs anyway: nothing beside it)
            raise ValueError("--recipes: bf16 alone compares nothing (every comparison runs the BF16 reference "
                             "anyway); name FP8 recipes, e.g. --recipes tensorwise blockwise")
        if args.plot_only:
            result = collect(args.plot_only)
        else:
            check_writable_dir("--out", str(out))  # (else the first run's run_dir is named: OUT/bf16)
            result = compare_recipes(args.recipes, args.overrides, out, parallel=args.parallel, parity=args.parity,
                                     parity_iters=args.parity_iters, command=shlex.join(["python", *sys.argv]),
                                     reference=args.reference, resume=args.resume)
    except ValueError as e:  # a user error: one line naming the key, no run started
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        sys.exit(USER_ERROR_EXIT)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM (e.g. `timeout`): the runs checkpointed; tabulate what they logged
        print(f"interrupted: the runs stopped after their current step (checkpoints in {out}/*/checkpoints; "
              f"continue with the same arguments and --resume)",
              file=sys.stderr)
        if any(out.glob("*/metrics.jsonl")):
            print(save(collect(out), out))
        sys.exit(130)
    print(save(result, out))
    print(f"(compare.json, compare.md, compare.png in {out})")
    if any(r["status"] != "ok" for r in result["runs"]):
        sys.exit(1)


if __name__ == "__main__":
    main()
