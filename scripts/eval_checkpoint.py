"""Inference parity of a trained run: its checkpoint's validation loss with the recipe's FP8 and with BF16 GEMMs.

    python scripts/eval_checkpoint.py runs/tensorwise-20261129-140000              # the run's own recipe, latest step
    python scripts/eval_checkpoint.py runs/bf16-20261129-140000 --recipe blockwise  # a BF16-trained model in FP8
    python scripts/eval_checkpoint.py RUN_DIR --checkpoint RUN_DIR/checkpoints/step_100 --eval-iters 32

Rebuilds the run's model and validation batches from RUN_DIR/.hydra/config.yaml (the same batches its own
evaluations used), loads the checkpoint (scaling state included), evaluates with the plan at a step where every
FP8 stage is on and again with every GEMM in high precision, prints one line and writes RUN_DIR/parity.json
(or --out). Emulated on the CPU, Transformer Engine on an FP8 GPU (recipe `backend: auto`).
Exit codes: 0 done; 2 a bad argument (one `error: <key>: ...` line).
"""

import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins"))  # a checkout without `pip install -e`


def main() -> None:
    from fp8_recipes.checks import OneLineArgumentParser, at_least  # (one error line for a usage error)

    p = OneLineArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path, help="a directory written by scripts/train.py")
    p.add_argument("--checkpoint", type=Path, help="a checkpoints/step_N dir (default: the run's latest)")
    p.add_argument("--recipe", help="evaluate with this recipe's FP8 (default: the run's own recipe.yaml)")
    p.add_argument("--eval-iters", type=at_least(1),
                   help="validation micro-batches (default: the run's own, trainer.eval_iters x its DP size)")
    p.add_argument("--out", type=Path, help="where the JSON goes (default: RUN_DIR/parity.json)")
    args = p.parse_args()

    from fp8_recipes.bench.output import save_json
    from fp8_recipes.launcher import launch_rank
    from fp8_recipes.training.config import check_writable_file
    from fp8_recipes.training.errors import USER_ERROR_EXIT, ConsoleFormatter, print_error_once

    console = logging.StreamHandler()
    console.setFormatter(ConsoleFormatter("%(message)s"))  # `warning: ...`, as scripts/train.py's console says it
    # under torchrun every rank evaluates alike: rank 0 says it (the warnings, the error, the result) and writes it
    logging.basicConfig(level=logging.WARNING if launch_rank() == 0 else logging.ERROR, handlers=[console])
    from fp8_recipes.training.evaluate import evaluate_checkpoint, format_parity

    out = args.out or args.run_dir / "parity.json"
    try:
        if not args.run_dir.is_dir():  # (its parity.json would be the first thing to fail, naming --out)
            raise ValueError(f"run_dir: '{args.run_dir}' is not a directory; give a directory scripts/train.py "
                             f"wrote")
        check_writable_file("--out", out, "parity.json")  # before minutes of evaluation
        result = evaluate_checkpoint(args.run_dir, checkpoint=args.checkpoint, recipe=args.recipe,
                                     eval_iters=args.eval_iters)
    except ValueError as e:  # a user error: one line naming the argument, nothing written
        print_error_once([str(e).splitlines()[0]])
        sys.exit(USER_ERROR_EXIT)
    if launch_rank() == 0:
        save_json(out, result)
        print(format_parity(result))


if __name__ == "__main__":
    main()
