"""Megatron-Core GPT training speed per FP8 recipe vs BF16, and this project's TE backend vs Megatron-Core's own.

    python scripts/bench_train.py                                    # llama3_8b_8l + _16l, delayed/tensorwise/blockwise
    python scripts/bench_train.py --models llama3_8b_8l --configs tensorwise tensorwise:raw --steps 20
    python scripts/bench_train.py --models llama3_8b_16l --configs delayed delayed+head delayed:raw
    python scripts/bench_train.py --models llama3_8b_16l --configs tensorwise+masters tensorwise+fp8param \
        tensorwise+fp8param:raw
    python scripts/bench_train.py --models llama3_8b_16l --mbs 2 --seq 4096 --warmup 3 --steps 8 --out runs/train16
    python scripts/bench_train.py --models mixtral_8x7b_4l --mbs 1 --accum 8 --configs delayed delayed:raw \
        delayed+pad delayed+pad:raw bf16+nofuse
    python scripts/bench_train.py --models mixtral_8x7b_4l --mbs 1 --accum 8 --engine --configs delayed \
        delayed:raw bf16+nogaf delayed+nogaf
    python scripts/bench_train.py --models mixtral_8x7b_4l --layers 2 --mbs 1 --accum 8 --engine --configs \
        bf16+capacity+graphs delayed+capacity+graphs      # the Mixtral layer on an 80 GiB card (rows: NAME@2l)
    python scripts/bench_train.py --models mixtral_8x7b_4l --mbs 1 --accum 8 --engine --configs \
        bf16+capacity+graphs+grads16+moments16 delayed+capacity+graphs+grads16+moments16   # 4 layers, 80 GiB
    python scripts/bench_train.py --models llama3_8b_16l --configs bf16+emulated tensorwise+emulated nvfp4 --profile
    python scripts/bench_train.py --plot-only runs/bench_train/bench_train.json

Configs: bf16 (always first, the baseline), NAME (a recipe through this project's TE backend), NAME:raw (the
same TE recipe through Megatron-Core's own fp8 config and get_fp8_context) and NAME+LEVER (a speed lever on:
`head` runs the LM head in FP8, `attn` the core attention, `fp8param` stores the FP8 layers' weights in FP8 with
fp32 master weights in TE's FusedAdam, `masters` is that optimizer on BF16-stored weights: fp8param's baseline,
`moments16` its Adam moments in BF16 (with --engine, on bf16 too: the distributed optimizer's); MoE models: `pad`
pads each expert's tokens in the router, `nofuse` turns the fused token permutation off; `emulated`, on bf16 too,
runs the emulated backend).
--accum N: micro-batches per optimizer step.
Same model, seed and random tokens; one GPU, plain fused torch AdamW (fp8param, masters: TE's FusedAdam).
--engine: a step is scripts/train.py's instead (Megatron-Core's DDP with the TE wgrad GEMMs accumulating into its
fp32 buffers, the distributed optimizer, the schedule; lever `nogaf` turns that accumulation fusion off, `grads16`
keeps those buffers in BF16; on bf16 too). A config whose step cannot fit the GPU is refused before anything runs;
where the plain bf16 baseline cannot fit but the configs' levers do, it is skipped and rows read x BF16 same levers.
Prints tokens/s, the ratio to BF16 (and to BF16 at the config's model / step levers), ours / raw and peak memory
(--profile: then each config's GPU time per kernel category, side by side); writes bench_train.json and
bench_train.png (--profile: bench_train_profile.png) into --out. Needs a GPU with Transformer Engine.
"""

import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins"))  # a checkout without `pip install -e`

DEFAULT_CONFIGS = ["delayed", "delayed:raw", "tensorwise", "tensorwise:raw", "blockwise", "blockwise:raw"]


def main() -> None:
    from fp8_recipes.bench.train import bench_train, check_configs, check_fits, check_models, plot, summarize
    from fp8_recipes.bench.output import load_result
    from fp8_recipes.bench.profile import profile_table
    from fp8_recipes.plan.precision import Hardware
    from fp8_recipes.training.config import check_writable_dir
    from fp8_recipes.training.errors import script_user_errors

    from fp8_recipes.checks import OneLineArgumentParser  # (one error line for a usage error)

    p = OneLineArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["llama3_8b_8l", "llama3_8b_16l"], help="conf/model/ names")
    p.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, metavar="NAME[+LEVER][:raw]")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--mbs", type=int, default=2)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step (gradient accumulation)")
    p.add_argument("--layers", type=int, help="the models' layer count instead of their own: a model's layer shape "
                   "on a GPU too small for all its layers (rows read NAME@Nl)")
    p.add_argument("--out", type=Path, default=Path("runs/bench_train"))
    p.add_argument("--profile", action="store_true",
                   help="after timing, profile 2 steps per config: GPU time per kernel category (bench/profile.py)")
    p.add_argument("--engine", action="store_true",
                   help="time scripts/train.py's step: Megatron-Core DDP, distributed optimizer, schedule")
    p.add_argument("--plot-only", type=Path, metavar="JSON", help="redraw the table and PNG from a result file")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    with script_user_errors():  # (a config it cannot run, an unwritable --out: one line, before any model)
        check_configs(args.configs, engine=args.engine, warmup=args.warmup)
        if not args.plot_only:  # (results are saved after each config: an unwritable --out would fail the first)
            check_models(args.models)
            if args.layers is not None and args.layers < 1:
                raise ValueError(f"--layers {args.layers}: give a layer count of 1 or more")
            check_writable_dir("--out", str(args.out))
    if args.plot_only:
        result = load_result(args.plot_only, "train")
        plot(result, args.plot_only.with_suffix(".png"))  # (beside the JSON, under its name)
    elif not Hardware.detect().has_te:
        sys.exit("error: bench_train: needs a CUDA GPU with Transformer Engine (or --plot-only FILE.json)")
    else:
        import torch

        with script_user_errors():  # (a model the engine's step cannot fit: one line, not an out-of-memory trace)
            skip = check_fits(args.models, args.configs, seq=args.seq, mbs=args.mbs, engine=args.engine,
                              gpu_bytes=torch.cuda.get_device_properties(0).total_memory, layers=args.layers)
        from fp8_recipes.training.run import quiet_third_party_logs

        quiet_third_party_logs()
        result = bench_train(args.models, args.configs, seq=args.seq, mbs=args.mbs, warmup=args.warmup,
                             steps=args.steps, out_dir=args.out, profile=args.profile, accum=args.accum,
                             engine=args.engine, layers=args.layers, skip_baseline=skip)
    print(summarize(result)[0])
    if table := profile_table(result["rows"]):  # (--profile: the configs' kernels side by side, ms per step)
        print(f"\nGPU time per step by kernel category, ms:\n{table}")
    where = f"PNG: {args.plot_only.with_suffix('.png')}" if args.plot_only else f"JSON and PNG in {args.out}"
    step = "the engine's step" if result.get("engine") else "plain AdamW"
    print(f"({result['device']}, seq {result['seq']}, mbs {result['mbs']} x {result.get('accum', 1)} micro-batches, "
          f"{step}, "
          f"{result['steps']} timed steps after "
          f"{result['warmup']}; {result['seconds']:.0f}s; {where})")


if __name__ == "__main__":
    main()
