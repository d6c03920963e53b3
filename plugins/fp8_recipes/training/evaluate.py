"""Inference parity: a trained checkpoint's validation loss with the recipe's FP8 GEMMs and with BF16 GEMMs.

    result = evaluate_checkpoint("runs/tensorwise-...")      # the run's latest checkpoint, the run's own recipe
    result["gap_pct"]                                         # 100 x (FP8 eval loss - BF16 eval loss) / BF16

The model, data and validation batches are rebuilt from what the run recorded (``.hydra/config.yaml``, the
composed config of scripts/train.py, and ``recipe.yaml``), so the batches are exactly the ones the run's own
evaluations used: on the CPU the FP8 number equals the run's last ``val_loss`` bit for bit when the checkpoint is
the final step of a one-process run. (A data-parallel run reduced each tensor's amax over its ranks, i.e. over
other ranks' batches too, which one process evaluating every batch cannot repeat: seen 5e-6 relative at DP 2.) FP8 means the plan at a step where every stage of the schedule is on (BF16 warmup and staged enablement
over); BF16 means the same model under ``precision.high_precision()`` (every GEMM in high precision, as the
training loop's full-precision evaluation). The checkpoint's scaling state (delayed-scaling amax histories) is
restored, so delayed scaling evaluates with the scales training ended with; another ``recipe`` starts from fresh
scaling state (load_checkpoint says so). The backend follows the recipe (``auto``: TE on an FP8 GPU, emulated
elsewhere); a checkpoint loads only into the model kind it was written from (TE spec on the GPU, local spec on
the CPU). It evaluates in one process at TP=1 (under torchrun, at the run's TP), one pipeline stage and whole
sequences: a checkpoint of another tensor or pipeline layout is resharded on load, as a resume at another layout.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fp8_recipes.checks import ConfigError
from fp8_recipes.launcher import launch_rank, launch_world_size
from fp8_recipes.megatron.data import prepared_meta
from fp8_recipes.megatron.model_config import layout_of, run_model_cfg
from fp8_recipes.plan.precision import Hardware, PrecisionPlan
from fp8_recipes.recipe.pack import load_recipe
from fp8_recipes.rundir import HYDRA, RECIPE, load_run_config, read_recipe
from fp8_recipes.recipe.schema import ROLES, Backend
from fp8_recipes.training.config import TrainerConfig
from fp8_recipes.training.run import (attach_emulated, attach_te, quiet_third_party_logs, run_datasets,
                                      torch_dtype, validation_batches)
from fp8_recipes.recipe.yaml_guard import UnsafeYAML

# torch and Megatron-Core (checkpoints, the model, the engine) are imported inside the functions that evaluate a
# checkpoint: gap_pct and format_parity serve the comparison tables without them.

__all__ = ["evaluate_checkpoint", "eval_step_all_on", "format_parity", "gap_pct"]

logger = logging.getLogger("fp8_recipes")


def gap_pct(value: float, reference: float) -> float:
    """100 x (value - reference) / reference: how much worse (positive) or better than the reference, in %."""
    return 100.0 * (value - reference) / reference if reference else math.nan


def _warn_if_all_bf16(plan: PrecisionPlan, recipe: Any, step: int) -> None:
    """One warning when the evaluated step runs no GEMM in FP8 (its layer rules keep every layer of this model BF16):
    the FP8 and BF16 losses are then the same model's, and the gap says nothing."""
    if recipe.is_fp8 and not plan.at(step).any_fp8:
        logger.warning("--recipe %s: no GEMM of this model runs FP8 at the evaluated step (recipe.layers keeps all %d "
                       "layers BF16): the FP8 and BF16 losses are the same; evaluate with a recipe that quantizes "
                       "this model", recipe.name, plan.layout.num_layers)


def eval_step_all_on(recipe: Any, trained_steps: int) -> int:
    """The 0-based step whose plan evaluates: the checkpoint's last training step, or later when the schedule's
    last stage had not begun by then (every FP8 role on: the recipe's steady state, what inference would run)."""
    starts = [recipe.schedule.role_start(r) for r in ROLES if recipe.policy(r).is_fp8]
    return max([trained_steps - 1, 0, *starts])


def run_data_parallel_size(step_dir: Path) -> int:
    """The data-parallel size the checkpoint was trained at (its meta.json; 1 for a checkpoint without one)."""
    from fp8_recipes.training.checkpoint import checkpoint_meta

    return int(checkpoint_meta(step_dir).get("data_parallel_size", 1))


def _valid_batches(cfg: Any, eval_iters: int, train_dp: int) -> Sequence[dict]:
    """This rank's share of the first ``eval_iters`` micro-batches of the run's validation stream, built as
    training/run.py builds it (the same sample counts for ``train_dp`` ranks, the same seed, the same bound on passes
    over the split), so the batches are the ones the run itself evaluated on: at ``train_dp`` ranks, rank r evaluated
    micro-batches r, r + dp, ... of one global stream (in a single process, all of them)."""
    from megatron.core import parallel_state as ps

    _, valid_ds = run_datasets(cfg, Path(cfg.data.path), train_dp)
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()  # (under torchrun: a share each)
    return validation_batches(cfg, valid_ds, eval_iters, rank, dp, key="--eval-iters", per_rank=False,
                              warn=launch_rank() == 0)


def _model_cfg(cfg: Any) -> dict:
    """The model group with the vocabulary training/run.py gave it (the tokenizer's when the config says null)."""
    data_dir = Path(cfg.data.path)
    return run_model_cfg(cfg, prepared_meta(data_dir), data_dir)


def _run_recipe(run_dir: Path, recipe: str | None) -> Any:
    """``recipe`` (a pack name or YAML path), else what the run trained with (its resolved recipe.yaml)."""
    if recipe is not None:
        return load_recipe(recipe)
    try:
        data = read_recipe(run_dir)
    except UnsafeYAML as e:
        raise ValueError(f"run_dir: {run_dir / RECIPE}: {e}; restore the run's {RECIPE}, or give --recipe NAME") \
            from None
    if data is None:
        raise ValueError(f"run_dir: {str(run_dir)!r} has no {RECIPE}; give a directory written by "
                         "scripts/train.py, or --recipe NAME")
    return load_recipe(data)


def evaluate_checkpoint(run_dir: str | Path, *, checkpoint: str | Path | None = None, recipe: str | None = None,
                        eval_iters: int | None = None) -> dict[str, Any]:
    """Validation loss and perplexity of a run's checkpoint with FP8 and with BF16 GEMMs, and the gap between them.

    ``checkpoint``: a run dir, checkpoints dir or step_N dir (default: the run's latest); ``recipe``: evaluate
    with another recipe's FP8 (a pack name or YAML path; default: the run's own); ``eval_iters``: validation
    micro-batches (default: the run's ``trainer.eval_iters`` x its data-parallel size, the ones its evaluations
    used). User errors (not a run dir, no checkpoint, a bad recipe) are ValueErrors of one line naming the argument
    as scripts/eval_checkpoint.py spells it (run_dir, --checkpoint, --eval-iters).
    """
    from fp8_recipes.training.checkpoint import intact_checkpoint

    run_dir = Path(run_dir)
    cfg = load_run_config(run_dir)
    chosen = _run_recipe(run_dir, recipe)
    named_by = "--checkpoint" if checkpoint is not None else "run_dir"  # the argument that names the checkpoint
    step_dir = intact_checkpoint(checkpoint if checkpoint is not None else run_dir, named_by)
    train_dp = run_data_parallel_size(step_dir)  # the run evaluated eval_iters micro-batches on each of its ranks
    iters = int(eval_iters if eval_iters is not None else int(cfg.trainer.eval_iters) * train_dp)
    if eval_iters is None and iters < 1:
        raise ConfigError(f"--eval-iters: the run evaluated no validation batches (trainer.eval_iters="
                          f"{cfg.trainer.eval_iters}); give --eval-iters N")
    if iters < 1:
        raise ConfigError(f"--eval-iters: {iters} must be >= 1")
    return _evaluate(cfg, chosen, step_dir, iters, train_dp, (run_dir, named_by)) | {"run_dir": str(run_dir),
                                                                                      "checkpoint": str(step_dir)}


def _evaluate(cfg: Any, recipe: Any, step_dir: Path, eval_iters: int, train_dp: int,
              source: tuple[Path, str]) -> dict[str, Any]:
    """Build the run's model under ``recipe``'s backend, load ``step_dir``, evaluate in FP8 and in BF16. ``source``:
    (the run dir whose config describes the model, the argument that named the checkpoint)."""
    from fp8_recipes.megatron.model import destroy_distributed, init_distributed
    from fp8_recipes.training.checkpoint import (check_config_matches, check_model_matches, checkpoint_step,
                                                 load_checkpoint)
    from fp8_recipes.training.engine import Engine

    quiet_third_party_logs()
    hardware = Hardware.detect()
    first_plan = PrecisionPlan(recipe, layout_of(cfg.model), hardware)  # refuses early
    # One stage, whole sequences: the checkpoint is resharded on load when it was written at another tensor or
    # pipeline layout (training/checkpoint.py), as a resume at another layout is. The run's TP when launched with
    # processes for it (torchrun), else 1.
    trainer = TrainerConfig.from_cfg(cfg.trainer)
    world = launch_world_size()
    tp = trainer.tensor_model_parallel_size if world > 1 and world % trainer.tensor_model_parallel_size == 0 else 1
    trainer = dataclasses.replace(trainer, tensor_model_parallel_size=tp, sequence_parallel=trainer.sequence_parallel
                                  and tp > 1, pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=None,
                                  context_parallel_size=1)
    _, _, device = init_distributed(tensor_model_parallel_size=trainer.tensor_model_parallel_size, seed=trainer.seed)
    try:
        valid = _valid_batches(cfg, eval_iters, train_dp)
        attach = attach_te if first_plan.backend is Backend.TE else attach_emulated
        model_cfg = _model_cfg(cfg)
        check_config_matches(step_dir, model_cfg, source[0] / HYDRA / "config.yaml", source[1])  # (the export's)
        chunks, plan, precision = attach(model_cfg, recipe, hardware, torch_dtype(trainer.params_dtype), device)
        try:  # a checkpoint written before meta.json recorded the model: its shapes
            check_model_matches(step_dir, chunks)
        except ValueError as e:
            what = str(e).split("; resume with", 1)[0].removeprefix("model: ")
            raise ConfigError(f"--checkpoint: not a checkpoint of this run's model: {what}; name one of the run's "
                              f"own checkpoints (or evaluate the run that wrote it)") from None
        trained = load_checkpoint(step_dir, models=chunks, precision=precision, restore_rng=False)
        engine = Engine(chunks, None, trainer, seq_length=int(cfg.model.seq_length), num_microbatches=len(valid),
                        device=device)
        step = eval_step_all_on(recipe, checkpoint_step(step_dir))
        _warn_if_all_bf16(plan, recipe, step)
        stage = precision.begin_step(step)
        fp8_loss = engine.evaluate(valid)
        with precision.high_precision():
            bf16_loss = engine.evaluate(valid)
    finally:
        destroy_distributed()
    tokens = sum(int(b["loss_mask"].sum()) for b in valid)  # (this rank's: the losses are over all ranks)
    return {"recipe": recipe.name, "backend": str(plan.backend), "trained_steps": trained, "eval_step": step + 1,
            "stage": stage, "eval_iters": eval_iters, "eval_tokens": tokens,
            "fp8_loss": fp8_loss, "bf16_loss": bf16_loss, "fp8_ppl": _ppl(fp8_loss), "bf16_ppl": _ppl(bf16_loss),
            "gap_pct": gap_pct(fp8_loss, bf16_loss)}


def _ppl(loss: float) -> float:
    """Perplexity of a mean token loss in nats (inf past float range rather than an OverflowError)."""
    return math.exp(loss) if loss < 700 else math.inf


def format_parity(result: dict[str, Any]) -> str:
    """One line for a person: what was evaluated, both losses and perplexities, the gap."""
    return (f"{result['recipe']} ({result['backend']}) checkpoint step {result['trained_steps']}, "
            f"{result['eval_iters']} batches ({result['eval_tokens']:,} tokens), plan of step {result['eval_step']} "
            f"({result['stage']}): FP8 eval loss {result['fp8_loss']:.4f} (ppl {result['fp8_ppl']:.2f}), "
            f"BF16 eval loss {result['bf16_loss']:.4f} (ppl {result['bf16_ppl']:.2f}), gap {result['gap_pct']:+.3f}%")
