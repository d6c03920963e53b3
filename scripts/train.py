"""Train a Megatron-Core GPT with an FP8 recipe.

    python scripts/train.py +recipe=hybrid                          # tiny model on the CPU, emulated FP8
    python scripts/train.py                                         # the same in BF16
    python scripts/train.py +recipe=safe trainer.max_steps=400 recipe.schedule.bf16_warmup_steps=50
    python scripts/train.py +recipe=path/to/mine.yaml                # a recipe file anywhere (defaults: [hybrid, _self_])
    python scripts/train.py +recipe=tensorwise model=llama3_8b_16l trainer=gpu
    torchrun --nproc-per-node 2 scripts/train.py +recipe=delayed trainer.global_batch_size=32  # data parallel

Config: conf/train.yaml (+ groups model/, data/, trainer/), recipes from recipes/ (group `recipe`). Outputs go to
`run_dir` (plan.txt, recipe.yaml, metrics.jsonl, tb/, checkpoints/, summary.json, loss.png).

Exit codes: 0 done; 1 an internal error (a bug: one `internal error: ...; traceback in RUN/train.log` line, the
outputs kept for inspection); 2 a bad config, recipe or override (one `error: <key>: ...` line, no run_dir left behind);
3 stopped on non-finite losses/gradients (trainer.on_nonfinite=stop; the outputs so far are kept and
checkpoints/step_N holds the last good state);
4 preempted: SIGTERM or SIGUSR1 (Slurm's preemption, `--signal=USR1@<s>`) reached a rank during training, every
rank finished the step, checkpoints/step_N was written and summary.json says `"preempted": {"signal", "step"}`;
`trainer.resume=auto` continues at step N + 1. Not 0, so that a finished run and an interrupted one differ for a
requeue wrapper (`[ $? -eq 4 ] && scontrol requeue $SLURM_JOB_ID`) and for `afterok` dependencies; not 128 +
signal, which means killed without a checkpoint. (torchrun reports any nonzero worker code as its own failure:
there, read summary.json.) A signal before training starts or after it ends has its usual effect;
5 writing a checkpoint failed (a full disk, a file size limit): one `error: trainer.save_interval: writing checkpoint
RUN/checkpoints/step_N failed: [Errno 28] ...` line, the half-written temporary directory removed, `latest` and the
outputs so far kept; free space, then `trainer.resume=auto` continues from the previous checkpoint.
"""

import logging
import signal
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins"))  # a checkout without `pip install -e`


def _exit_written(code: int) -> None:
    """Exit with `code` once the outputs are written. torchrun stops the other workers with SIGTERM as soon as one
    exits: ignoring it now keeps a worker that is already leaving with its checkpoint from showing up as -15."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.exit(code)


@hydra.main(config_path="../conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from omegaconf.errors import OmegaConfBaseException

    from fp8_recipes.checks import ConfigError, clipped, first_problem
    from fp8_recipes.rundir import RunDirError
    from fp8_recipes.training.errors import (
        CHECKPOINT_WRITE_EXIT, INTERNAL_ERROR_EXIT, NONFINITE_EXIT, PREEMPTED_EXIT, USER_ERROR_EXIT,
        CheckpointWriteError, NonFiniteStop, print_error_once, remove_partial_run_dir, report_internal_error,
    )
    from fp8_recipes.training.run import run_training

    run_dir = Path(cfg.run_dir)
    try:
        summary = run_training(cfg)
    except (ConfigError, OmegaConfBaseException) as e:  # a user error: one line naming the key, nothing half-written
        lines = [f"{e.full_key}: {str(e).splitlines()[0]}"] if isinstance(e, OmegaConfBaseException) else \
            [first_problem(e)]
        if not isinstance(e, RunDirError):  # another run's directory: none of it is this run's to remove
            remove_partial_run_dir(run_dir)
        if getattr(e, "same_on_every_rank", False):  # a config error: torchrun/srun ranks all raise it, said once
            print_error_once(lines)
        else:
            for line in lines:
                print(clipped(f"error: {line}"), file=sys.stderr)
        sys.exit(USER_ERROR_EXIT)
    except NonFiniteStop as e:  # trainer.on_nonfinite=stop: the run's outputs so far stay
        print(clipped(f"error: {e}"), file=sys.stderr)
        _exit_written(NONFINITE_EXIT)
    except CheckpointWriteError as e:  # a full disk, a file size limit: every rank raises it; the outputs stay
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # (a rank that is leaving anyway, see _exit_written)
        print_error_once([str(e)])
        _exit_written(CHECKPOINT_WRITE_EXIT)
    except Exception as e:  # noqa: BLE001 - a bug, not a config error: its traceback in train.log, the outputs kept
        print(report_internal_error(e, run_dir), file=sys.stderr, flush=True)
        _exit_written(INTERNAL_ERROR_EXIT)
    if summary.get("finished"):  # resumed a run that already reached max_steps: a no-op, exit 0
        remove_partial_run_dir(run_dir)  # (nothing of this start stays: a new run_dir goes, a run's .hydra is put back)
        if summary.get("rank", 0) == 0:
            f = summary["finished"]
            trained = run_dir if Path(f["checkpoint"]).resolve().is_relative_to(run_dir.resolve()) else \
                Path(f["checkpoint"]).parent.parent  # (resumed from another run's checkpoint: that run)
            print(f"nothing to do: {trained} already trained {f['steps']} steps (checkpoint {f['checkpoint']}) and "
                  f"trainer.max_steps={f['max_steps']}; raise trainer.max_steps to train further")
        return
    if summary.get("preempted"):  # every rank: the same decision, the same exit code
        if summary.get("rank", 0) == 0:
            print(f"preempted: {summary['preempted']['signal']} signal, stopped after step {summary['steps']} "
                  f"({run_dir}); continue with trainer.resume=auto", file=sys.stderr)
        _exit_written(PREEMPTED_EXIT)
    if summary.get("rank", 0) == 0:
        val = f", val loss {summary['val_loss']:.3f}" if summary.get("val_loss") is not None else ""
        how = summary["backend"] if summary.get("fp8", True) else "every GEMM BF16"
        print(f"done: {summary['steps']} steps of {summary['recipe']} ({how}), loss "
              f"{summary['final_loss_mean_last_10']:.3f} (mean of last 10){val}, "
              f"{summary['tokens_per_s_median']:,.0f} tokens/s -> {run_dir}")


if __name__ == "__main__":
    from fp8_recipes.checks import clipped, first_problem
    from fp8_recipes.launcher import LaunchError, check_launch_env
    from fp8_recipes.recipe.pack import recipe_file_overrides
    from fp8_recipes.training.errors import (
        USER_ERROR_EXIT, hydra_errors_as_one_line, print_error_once, worker_hydra_overrides,
    )

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:  # stale RANK / WORLD_SIZE: said by this process itself (which rank prints is what they get wrong)
        check_launch_env()
    except LaunchError as e:
        print(clipped(f"error: {e}"), file=sys.stderr)
        sys.exit(USER_ERROR_EXIT)
    try:  # +recipe=path/to/mine.yaml: a recipe file anywhere (as fp8-recipes show/validate/explain take it)
        sys.argv[1:] = recipe_file_overrides(sys.argv[1:]) + worker_hydra_overrides()  # (rank 0 alone writes run_dir)
    except ValueError as e:
        print_error_once([first_problem(e)])
        sys.exit(USER_ERROR_EXIT)
    with hydra_errors_as_one_line():  # Hydra's own errors (unknown key, group option, run_dir) as one line, exit 2
        main()
