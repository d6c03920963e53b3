"""Train a Megatron-Core GPT with an FP8 recipe.

    python scripts/train.py +recipe=hybrid                          # tiny model on the CPU, emulated FP8
    python scripts/train.py                                         # the same in BF16
    python scripts/train.py +recipe=safe trainer.max_steps=400 recipe.schedule.bf16_warmup_steps=50
    python scripts/train.py +recipe=tensorwise model=llama3_8b_16l trainer=gpu
    torchrun --nproc-per-node 2 scripts/train.py +recipe=delayed    # data parallel (gloo on CPU, NCCL on GPU)

Config: conf/train.yaml (+ groups model/, data/, trainer/), recipes from recipes/ (group `recipe`). Outputs go to
`run_dir` (plan.txt, recipe.yaml, metrics.jsonl, tb/, checkpoints/, summary.json, loss.png).
"""

import logging
import shutil
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins"))  # a checkout without `pip install -e`


@hydra.main(config_path="../conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from fp8_recipes.training.run import run_training

    run_dir = Path(cfg.run_dir)
    try:
        summary = run_training(cfg)
    except ValueError as e:  # a user error: one line naming the key, nothing half-written, exit 2
        for line in str(e).splitlines():
            print(f"error: {line}", file=sys.stderr)
        if run_dir.is_dir() and not (run_dir / "checkpoints").exists():
            shutil.rmtree(run_dir, ignore_errors=True)
        sys.exit(2)
    if summary.get("rank", 0) == 0:
        val = f", val loss {summary['val_loss']:.3f}" if summary.get("val_loss") is not None else ""
        print(f"done: {summary['steps']} steps of {summary['recipe']} ({summary['backend']}), loss "
              f"{summary['final_loss_mean_last_10']:.3f} (mean of last 10){val}, "
              f"{summary['tokens_per_s_median']:,.0f} tokens/s -> {run_dir}")


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    main()
