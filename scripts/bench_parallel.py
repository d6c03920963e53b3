"""Training speed per parallel layout through scripts/train.py (Megatron-Core's engine): tokens/s per GPU vs one GPU,
FP8 vs BF16 within each layout, peak memory per GPU, with and without the distributed optimizer.

    python scripts/bench_parallel.py --layouts 1gpu dp2 dp2-plainopt tp2sp pp2 cp2 --recipes bf16 delayed tensorwise \
        -- model=llama3_8b_8l trainer=gpu trainer.micro_batch_size=2
    python scripts/bench_parallel.py --layouts 1gpu 1gpu-plainopt --recipes bf16 delayed --baseline /path/to/old/checkout \
        -- model=llama3_8b_8l trainer=gpu
    python scripts/bench_parallel.py --plot-only runs/bench_parallel/bench_parallel.json

Layouts (fp8_recipes/bench/parallel.py): 1gpu, 1gpu-plainopt, 1gpu-bf16moments, dp2, dp2-plainopt, tp2sp, pp2, cp2,
dp4, tp2pp2; `-plainopt` turns the distributed optimizer and the overlaps off, `-bf16moments` keeps Adam's moments in
BF16 (the precision-aware optimizer). Data-parallel layouts scale the global batch with
the ranks (the same micro-batch and accumulation per rank as the one-GPU run). Needs as many GPUs as a layout has.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins"))  # a checkout without `pip install -e`


def main() -> None:
    from fp8_recipes.bench.parallel import bench_parallel, save
    from fp8_recipes.bench.output import load_result

    from fp8_recipes.checks import OneLineArgumentParser  # (one error line for a usage error)

    p = OneLineArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layouts", nargs="+", default=["1gpu", "dp2", "dp2-plainopt", "tp2sp", "pp2", "cp2"])
    p.add_argument("--recipes", nargs="+", default=["bf16", "delayed", "tensorwise"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--gbs", type=int, default=8, help="global batch of the one-GPU run (x ranks for data parallel)")
    p.add_argument("--baseline", type=Path, help="another checkout whose scripts/train.py runs the 1gpu layout too")
    p.add_argument("--out", type=Path, default=Path("runs/bench_parallel"))
    p.add_argument("--plot-only", type=Path, metavar="JSON", help="redraw the table and PNG from a result file")
    p.add_argument("overrides", nargs="*", help="scripts/train.py overrides for every run (after --)")
    args = p.parse_args()
    if args.plot_only:
        print(save(load_result(args.plot_only, "parallel"), args.plot_only.parent))
        return
    from fp8_recipes.recipe.pack import check_pack_names
    from fp8_recipes.training.config import check_writable_dir
    from fp8_recipes.training.errors import script_user_errors

    with script_user_errors():  # (each run is +recipe=NAME; its logs and results go to --out: before any run)
        check_pack_names("--recipes", args.recipes)
        check_writable_dir("--out", str(args.out))
    import torch

    if not torch.cuda.is_available():  # (every layout's runs would fail, one after another)
        sys.exit("error: bench_parallel: needs CUDA GPUs, as many as a layout has (or --plot-only FILE.json)")
    try:
        result = bench_parallel(args.layouts, args.recipes, args.overrides, out=args.out, steps=args.steps,
                                gbs=args.gbs, baseline=args.baseline)
    except ValueError as e:
        sys.exit(f"error: {e}")
    result["command"] = " ".join(["python", "scripts/bench_parallel.py", *sys.argv[1:]])
    print(save(result, args.out))
    failed = [f"{r['layout']}/{r['recipe']}" for r in result["runs"] if r.get("rc")]
    if failed:
        sys.exit(f"error: bench_parallel: {len(failed)} run(s) failed ({', '.join(failed[:6])}); their logs are in "
                 f"{args.out}")


if __name__ == "__main__":
    main()
