"""te.Linear forward + backward: each FP8 recipe against BF16 over a grid of M x K x N, measured side by side.

    python scripts/bench_gemm.py                                          # default grid and recipes, runs/bench_gemm
    python scripts/bench_gemm.py --shapes 8192x4096x4096 16384x8192x28672 --configs delayed tensorwise blockwise
    python scripts/bench_gemm.py --configs tensorwise tensorwise:fwd --iters 50 --out runs/gemm-fwd
    python scripts/bench_gemm.py --plot-only runs/bench_gemm/bench_gemm.json   # the PNG, where matplotlib is

A config is a recipe of the pack as the plan runs it on this GPU (hybrid and mxfp8 become their nearest legal TE
recipe on Hopper), or NAME:fwd for forward-only FP8. Prints speed-ups vs BF16 and the worst relative errors of
y, dx, dw; writes bench_gemm.json and bench_gemm.png (matplotlib) into --out. Needs a GPU with Transformer Engine.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins"))  # a checkout without `pip install -e`


def shape(text: str) -> tuple[int, int, int]:
    try:
        m, k, n = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not MxKxN, e.g. 8192x4096x4096") from None
    return m, k, n


def main() -> None:
    from fp8_recipes.bench.gemm import DEFAULT_CONFIGS, DEFAULT_SHAPES, bench_gemm, save, summarize
    from fp8_recipes.bench.output import load_result
    from fp8_recipes.plan.precision import Hardware
    from fp8_recipes.training.config import check_writable_dir
    from fp8_recipes.training.errors import script_user_errors

    from fp8_recipes.checks import OneLineArgumentParser  # (one error line for a usage error)

    p = OneLineArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", type=shape, default=DEFAULT_SHAPES, metavar="MxKxN")
    p.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, metavar="NAME[:fwd]")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", type=Path, default=Path("runs/bench_gemm"))
    p.add_argument("--plot-only", type=Path, metavar="JSON", help="redraw the table and PNG from a result file")
    args = p.parse_args()
    if not args.plot_only:
        with script_user_errors():  # (results are saved after each shape: an unwritable --out would fail the first)
            check_writable_dir("--out", str(args.out))
    if args.plot_only:
        result = load_result(args.plot_only, "gemm")
        save(result, args.plot_only.parent)
    elif not Hardware.detect().has_te:
        sys.exit("error: bench_gemm: needs a CUDA GPU with Transformer Engine (or --plot-only FILE.json)")
    else:
        result = bench_gemm(args.shapes, args.configs, warmup=args.warmup, iters=args.iters, out_dir=args.out)
    print(summarize(result)[0])
    print(f"({result['device']}, TE {result['te']}, {result['iters']} iterations after {result['warmup']}; "
          f"JSON and PNG in {args.plot_only.parent if args.plot_only else args.out})")


if __name__ == "__main__":
    main()
