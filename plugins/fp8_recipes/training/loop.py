"""The training loop on Megatron-Core's engine (training/engine.py: its DDP, optimizer and pipeline schedules): the
warmup + cosine LR schedule, evaluation (in the training precision and in full precision), the non-finite policy,
preemption, metrics, checkpoints, a summary.

    engine = build_engine(chunks, cfg.trainer, seq_length=..., lr=..., device=...)
    summary = train(engine, batches_train, batches_valid, cfg.trainer, precision, run_dir, rank=rank,
                    world_size=world_size)

Step convention: ``step`` is the 0-based index of the iteration in progress (= iterations completed before it,
skipped ones included, as Megatron counts them). ``precision.begin_step(step)`` / ``after_optimizer_step(step)``
use it; metrics rows, evaluation and ``checkpoints/step_N`` use ``N = step + 1`` (Megatron's "iteration").

Faults: a non-finite loss or gradient norm on any rank skips the optimizer step on every rank (one flag, summed
over every rank): weights, optimizer state and the LR schedule stay as they were (Megatron
also does not advance its scheduler on a skipped iteration), and the precision backend forgets what the step
recorded (``skip_step``). After ``trainer.max_consecutive_skips`` in a row: ``on_nonfinite=skip_then_bf16`` runs
the next ``fallback_bf16_steps`` steps under ``precision.high_precision()``; ``stop`` (or the limit reached again
inside a fallback) ends the run with :class:`NonFiniteStop`, after checkpointing ``checkpoints/step_N`` (N = the
last step run): the skipped steps left weights, optimizer and LR schedule as the last good step did, and the data
position moves past the bad batches, so the run can continue from there under a lower ``trainer.lr`` (a resumed
run takes the configured LR, not the checkpoint's) or another recipe. The one-line message names the directory.

Preemption (training/preemption.py): SIGTERM / SIGUSR1 set a flag that rides in the step's all-reduce; every rank
stops after the same step, checkpoints it, and the summary's ``preempted`` names the signal and step.

Every rank leaves :func:`train` together, after rank 0 has written summary.json and loss.png: a launcher that stops
the other workers as soon as one exits non-zero (torchrun, on exit code 3 or 4) cannot cut those short.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import statistics
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from fp8_recipes.training.checkpoint import barrier, load_checkpoint, save_checkpoint
from fp8_recipes.training.config import TrainerConfig
from fp8_recipes.training.engine import Engine
from fp8_recipes.training.errors import NonFiniteStop
from fp8_recipes.training.lr_schedule import LRSchedule
from fp8_recipes.training.metrics import MetricsWriter, plot_loss, write_summary
from fp8_recipes.training.precision import Precision
from fp8_recipes.training.preemption import PreemptionSignals
from fp8_recipes.training.progress import progress_bar

__all__ = ["train"]

logger = logging.getLogger(__name__)


def _stop_message(reason: str, first_bad: int, saved: Path | None) -> str:
    """The one line of a non-finite stop: what happened, and where the last good state is."""
    if saved is None:
        return (f"{reason}; the weights are those before step {first_bad}, not checkpointed "
                f"(trainer.save_checkpoints=false; lower trainer.lr, check the data, or resume from an earlier "
                f"checkpoint)")
    return (f"{reason}; the weights from before step {first_bad} are checkpointed in {saved} (continue with "
            f"trainer.resume={saved} and a lower trainer.lr or another recipe)")


def _due(done: int, interval: int, last: int) -> bool:
    return interval > 0 and (done % interval == 0 or done == last)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process so far: allocated on the GPU (CUDA's allocator), resident on the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def _log_lr_scaling(cfg: TrainerConfig, schedule: LRSchedule) -> None:
    if cfg.lr_scaling.enabled:
        logger.info("lr scaling: global batch %d / base %d: lr %.3g -> %.3g, min_lr %.3g -> %.3g",
                    cfg.global_batch_size, cfg.lr_scaling.base_global_batch_size, cfg.lr, schedule.peak, cfg.min_lr,
                    schedule.min_lr)


def train(engine: Engine, batches_train: Iterator[Mapping[str, Any]] | list[Iterator[Mapping[str, Any]]],
          batches_valid: Iterator[Mapping[str, Any]] | None, trainer_cfg: Any, precision: Precision,
          run_dir: str | os.PathLike, *, rank: int = 0, world_size: int = 1,
          resume_from: str | os.PathLike | None = None,
          summary_extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Train ``engine``'s model for ``trainer_cfg.max_steps`` optimizer steps; return the summary (also in
    summary.json, with ``summary_extra``'s keys, e.g. the recipe's name and the backend).

    ``batches_*`` yield dicts of ``tokens``, ``labels``, ``loss_mask``, ``position_ids`` ([b, s] tensors) for
    this data-parallel rank; ``batches_train`` may be a list, one iterator per model chunk (interleaved pipeline
    stages each read the stream). ``resume_from`` (a run dir or step dir) restores model, optimizer, precision state
    and RNG (the LR schedule is the configured one, from the checkpoint's step); the caller starts ``batches_train``
    at the checkpoint's data position (the samples it consumed, in its meta.json; training/run.py does, through
    checkpoint.resume_skip).
    """
    cfg = TrainerConfig.from_cfg(trainer_cfg)
    run_dir = Path(run_dir)
    device = engine.device
    if rank == 0:
        logger.info("global batch %d = micro %d x data parallel %d x accumulation %d", cfg.global_batch_size,
                    cfg.micro_batch_size, engine.dp_size, engine.num_microbatches)
    for chunk in engine.chunks:
        chunk.train()
    schedule = LRSchedule.of(cfg)
    if rank == 0:
        _log_lr_scaling(cfg, schedule)
    start = 0
    if resume_from is not None:
        start = load_checkpoint(resume_from, engine=engine, precision=precision, scheduler=schedule)
    # The same validation batches every time: val curves (and full vs training precision) differ by the model only.
    valid = [next(batches_valid) for _ in range(cfg.eval_iters)] if batches_valid is not None else []
    fp_interval = int(getattr(precision, "full_precision_eval_interval", 0) or 0)
    tokens = cfg.global_batch_size * engine.seq_length  # per optimizer step, all ranks

    def checkpoint(done: int) -> Path | None:
        if not cfg.save_checkpoints:
            return None
        # the data position in samples: a run at another data-parallel size continues from it exactly
        position = {"consumed_samples": done * cfg.global_batch_size, "global_batch_size": cfg.global_batch_size,
                    "micro_batch_size": cfg.micro_batch_size}
        return save_checkpoint(run_dir, done, engine=engine, precision=precision, scheduler=schedule,
                               extra={"trainer": dataclasses.asdict(cfg)}, meta=position)

    writer = MetricsWriter(run_dir, enabled=rank == 0)
    bar = progress_bar(total=cfg.max_steps, initial=start, disable=rank != 0)
    losses, rates, val_loss, val_loss_fp, stage, done = [], [], None, None, "", start
    skipped_total, in_a_row, fallback_left, fallbacks, stopped, preempted = 0, 0, 0, 0, None, None
    first_bad = 0
    wall0 = time.perf_counter()
    with PreemptionSignals() as signals:  # SIGTERM/SIGUSR1 -> a flag, for the loop's lifetime only
        engine.set_lr(schedule.lr())  # then again after each optimizer step: only they move the LR
        for step in range(start, cfg.max_steps):
            # A skipped step leaves the schedule where it was: the next step runs at this step's LR (Megatron's rule).
            step_lr = schedule.lr()
            stage = precision.begin_step(step)
            in_fallback = fallback_left > 0
            if in_fallback:
                stage = "bf16 fallback"
            t0 = time.perf_counter()
            with precision.high_precision() if in_fallback else contextlib.nullcontext():
                result = engine.train_step(batches_train, preempt_requested=signals.received is not None)
            step_loss, grad_norm, skipped, stop_now = result.loss, result.grad_norm, result.skipped, result.preempted
            if skipped:
                precision.skip_step(step)
                skipped_total, in_a_row = skipped_total + 1, in_a_row + 1
            else:
                schedule.advance()
                engine.set_lr(schedule.lr())  # the next step's, as a scheduler leaves it (checkpoints)
                precision.after_optimizer_step(step)
                in_a_row = 0
            fallback_left = max(fallback_left - 1, 0)
            step_time = time.perf_counter() - t0
            tokens_per_s = tokens / step_time
            done = step + 1
            losses.append(step_loss)
            rates.append(tokens_per_s)
            bar.update(1)
            skips = f" | skipped {skipped_total}" if skipped_total else ""
            bar.set_postfix_str(f"loss {step_loss:.3f} | {tokens_per_s:,.0f} tok/s | {stage}{skips}", refresh=False)
            if stop_now:  # every rank decided this in the same all-reduce; rank 0 may not have been signalled itself
                preempted = {"signal": signals.received or "another rank", "step": done}
            if skipped or preempted or done % cfg.log_interval == 0 or done == cfg.max_steps:
                row = {"kind": "train", "step": done, "loss": step_loss, "lr": step_lr, "grad_norm": grad_norm,
                       "tokens_per_s": tokens_per_s, "stage": stage, "step_time": step_time, "skipped": skipped,
                       "skipped_steps": skipped_total}
                writer.log({**row, "preempted": preempted["signal"]} if preempted else row)
            if skipped and rank == 0:
                bar.write(f"step {done}: non-finite loss {step_loss:.4g} or grad norm {grad_norm:.4g}: optimizer "
                          f"step skipped ({in_a_row} in a row, {skipped_total} in all)")
            if in_a_row >= cfg.max_consecutive_skips:
                if cfg.on_nonfinite == "stop" or in_fallback:
                    why = "in the BF16 fallback too" if in_fallback else "trainer.on_nonfinite=stop"
                    first_bad = done - in_a_row + 1
                    stopped = (f"trainer.max_consecutive_skips: {in_a_row} steps in a row (to step {done}) had "
                               f"a non-finite loss or gradient ({why})")
                    break
                fallback_left, in_a_row, fallbacks = cfg.fallback_bf16_steps, 0, fallbacks + 1
                if rank == 0:
                    bar.write(f"step {done}: {cfg.max_consecutive_skips} skipped steps in a row: the next "
                              f"{cfg.fallback_bf16_steps} steps run in BF16 (trainer.fallback_bf16_steps)")
            if preempted:  # no evaluation: the grace period is for the checkpoint
                if rank == 0:
                    bar.write(f"step {done}: {preempted['signal']} signal: checkpointing and stopping (preempted)")
                break
            if valid and _due(done, cfg.eval_interval, cfg.max_steps):
                val_loss = engine.evaluate(valid)
                writer.log({"kind": "eval", "step": done, "val_loss": val_loss, "stage": stage})
                if rank == 0:
                    bar.write(f"step {done}: val_loss {val_loss:.4f} ({stage})")
            if valid and _due(done, fp_interval, cfg.max_steps):
                with precision.high_precision():
                    val_loss_fp = engine.evaluate(valid)
                writer.log({"kind": "eval", "step": done, "val_loss_full_precision": val_loss_fp})
                if rank == 0:
                    bar.write(f"step {done}: val_loss_full_precision {val_loss_fp:.4f}")
            if cfg.save_interval > 0 and done % cfg.save_interval == 0 and done != cfg.max_steps:
                checkpoint(done)
        bar.close()
        saved = checkpoint(done) if done > start or resume_from is None else None  # (still under the
        # handlers: a second signal must not cut this save short); after a non-finite stop: the last good state
        if stopped is not None:
            stopped = _stop_message(stopped, first_bad, saved)
        if preempted and rank == 0:
            logger.warning("preempted by %s after step %d: %s", preempted["signal"], done,
                           f"checkpoint {run_dir / 'checkpoints' / f'step_{done}'}; continue with trainer.resume=auto"
                           if cfg.save_checkpoints else "no checkpoint (trainer.save_checkpoints=false)")
    summary = {
        "steps": done,
        "final_loss": losses[-1] if losses else None,
        "final_loss_mean_last_10": statistics.fmean(losses[-10:]) if losses else None,
        "val_loss": val_loss,
        "val_loss_full_precision": val_loss_fp,
        "tokens_per_s_median": statistics.median(rates) if rates else None,
        "wall_time_s": time.perf_counter() - wall0,
        "final_stage": stage,
        "nonfinite_loss_steps": sum(not math.isfinite(x) for x in losses),
        "skipped_steps": skipped_total,
        "bf16_fallbacks": fallbacks,
        "stopped": stopped,
        "preempted": preempted,
        "peak_memory_bytes": peak_memory_bytes(device),
        **(summary_extra or {}),
    }
    writer.close()
    if rank == 0:
        write_summary(run_dir, summary)
        try:
            plot_loss(run_dir)
        except Exception as e:  # noqa: BLE001 - a plot must never fail a finished run
            logger.warning("plot_loss failed: %s: %s", type(e).__name__, e)
    barrier()  # see the module docstring: no rank exits before the summary is written
    if stopped is not None:
        raise NonFiniteStop(stopped)
    return summary
