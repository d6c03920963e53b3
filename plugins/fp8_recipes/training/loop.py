"""The training loop on Megatron-Core's engine (training/engine.py: its DDP, optimizer and pipeline schedules): the
step sequence, and between steps the periodic duties (evaluation in the training precision and in full precision,
checkpoints, metrics and the progress bar); at the end a summary.

    engine = build_engine(chunks, cfg.trainer, seq_length=..., lr=..., device=...)
    summary = train(engine, batches_train, batches_valid, cfg.trainer, precision, run_dir, rank=rank,
                    world_size=world_size)

Step convention: ``step`` is the 0-based index of the iteration in progress (= iterations completed before it,
skipped ones included, as Megatron counts them). ``precision.begin_step(step)`` / ``after_optimizer_step(step)``
use it; metrics rows, evaluation and ``checkpoints/step_N`` use ``N = step + 1`` (Megatron's "iteration").

The loop's other concepts live beside it: what it needs of a precision backend (training/precision.py), the LR
schedule (training/lr_schedule.py), the non-finite fault policy, skip / BF16 fallback / stop (training/faults.py),
preemption by SIGTERM / SIGUSR1 (training/preemption.py) and the progress bar (training/progress.py).

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
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from fp8_recipes.rundir import write_summary
from fp8_recipes.training.checkpoint import barrier, load_checkpoint, save_checkpoint
from fp8_recipes.training.config import TrainerConfig
from fp8_recipes.training.engine import Engine, StepResult
from fp8_recipes.training.errors import CheckpointWriteError, NonFiniteStop
from fp8_recipes.training.faults import NonFinitePolicy, Stop
from fp8_recipes.training.lr_schedule import LRSchedule
from fp8_recipes.training.metrics import MetricsWriter, plot_loss
from fp8_recipes.training.precision import Precision
from fp8_recipes.training.preemption import PreemptionSignals
from fp8_recipes.training.progress import progress_bar

__all__ = ["train"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class LoopState:
    """Where the run stands: what the duties read and the summary reports."""

    done: int
    """Iterations completed, skipped ones included (the next step's 0-based index)."""
    stage: str = ""
    """The last step's precision stage label ("bf16 fallback" inside a fallback)."""
    losses: list[float] = dataclasses.field(default_factory=list)
    rates: list[float] = dataclasses.field(default_factory=list)
    """Tokens per second of each step, all ranks."""
    val_loss: float | None = None
    val_loss_fp: float | None = None
    stop: Stop | None = None
    """Set when the fault policy stopped the run."""
    preempted: dict[str, Any] | None = None
    """{"signal", "step"} when some rank was signalled."""

    def record(self, done: int, result: StepResult, tokens_per_s: float, signal_received: str | None) -> None:
        """The step that completed iteration ``done``; its preemption flag is every rank's (the same all-reduce), so
        rank 0 may stop without having been signalled itself."""
        self.done = done
        self.losses.append(result.loss)
        self.rates.append(tokens_per_s)
        if result.preempted:
            self.preempted = {"signal": signal_received or "another rank", "step": done}


def _due(done: int, interval: int, last: int) -> bool:
    return interval > 0 and (done % interval == 0 or done == last)


class StepLog:
    """Metrics rows (metrics.jsonl and TensorBoard, rank 0) and the console: the progress bar, its notes (rank 0)."""

    def __init__(self, run_dir: Path, cfg: TrainerConfig, *, rank: int, start: int) -> None:
        self.cfg, self.rank = cfg, rank
        self.writer = MetricsWriter(run_dir, enabled=rank == 0)
        self.bar = progress_bar(total=cfg.max_steps, initial=start, disable=rank != 0)

    def note(self, text: str) -> None:
        if self.rank == 0:
            self.bar.write(text)

    def step(self, state: LoopState, result: StepResult, *, lr: float, step_time: float, skipped_steps: int) -> None:
        """The bar's line for every step; a metrics row every ``log_interval`` steps, at the end, and for a skipped or
        preempted step."""
        tokens_per_s, done = state.rates[-1], state.done
        self.bar.update(1)
        skips = f" | skipped {skipped_steps}" if skipped_steps else ""
        self.bar.set_postfix_str(f"loss {result.loss:.3f} | {tokens_per_s:,.0f} tok/s | {state.stage}{skips}",
                                 refresh=False)
        if result.skipped or state.preempted or done % self.cfg.log_interval == 0 or done == self.cfg.max_steps:
            row = {"kind": "train", "step": done, "loss": result.loss, "lr": lr, "grad_norm": result.grad_norm,
                   "tokens_per_s": tokens_per_s, "stage": state.stage, "step_time": step_time,
                   "skipped": result.skipped, "skipped_steps": skipped_steps}
            self.writer.log({**row, "preempted": state.preempted["signal"]} if state.preempted else row)

    def close(self) -> None:
        self.bar.close()
        self.writer.close()


class Evaluation:
    """Validation on the same batches every time (curves, and full vs training precision, differ by the model only):
    in the training precision every ``trainer.eval_interval`` steps, in full precision every
    ``precision.full_precision_eval_interval`` steps, and both at the last step."""

    def __init__(self, engine: Engine, precision: Precision,
                 batches: Sequence[Mapping[str, Any]] | Iterator[Mapping[str, Any]] | None, cfg: TrainerConfig) -> None:
        self.engine, self.precision, self.cfg = engine, precision, cfg
        if batches is None or isinstance(batches, Sequence):  # (training/run.py's: loaded when read, held as indices)
            self.batches = batches or []
        else:  # an iterator: its first eval_iters batches, kept
            self.batches = [next(batches) for _ in range(cfg.eval_iters)]
        self.fp_interval = int(getattr(precision, "full_precision_eval_interval", 0) or 0)

    def __call__(self, state: LoopState, log: StepLog) -> None:
        done, last = state.done, self.cfg.max_steps
        if self.batches and _due(done, self.cfg.eval_interval, last):
            state.val_loss = self.engine.evaluate(self.batches)
            log.writer.log({"kind": "eval", "step": done, "val_loss": state.val_loss, "stage": state.stage})
            log.note(f"step {done}: val_loss {state.val_loss:.4f} ({state.stage})")
        if self.batches and _due(done, self.fp_interval, last):
            with self.precision.high_precision():
                state.val_loss_fp = self.engine.evaluate(self.batches)
            log.writer.log({"kind": "eval", "step": done, "val_loss_full_precision": state.val_loss_fp})
            log.note(f"step {done}: val_loss_full_precision {state.val_loss_fp:.4f}")


class Checkpoints:
    """``checkpoints/step_N`` when ``trainer.save_checkpoints``: every ``trainer.save_interval`` steps and when the
    loop ends (finished, preempted or stopped)."""

    def __init__(self, run_dir: Path, cfg: TrainerConfig, engine: Engine, precision: Precision,
                 schedule: LRSchedule) -> None:
        self.run_dir, self.cfg, self.engine, self.precision, self.schedule = run_dir, cfg, engine, precision, schedule

    def save(self, done: int, key: str = "trainer.save_checkpoints") -> Path | None:
        cfg = self.cfg
        if not cfg.save_checkpoints:
            return None
        # the data position in samples: a run at another data-parallel size continues from it exactly
        position = {"consumed_samples": done * cfg.global_batch_size, "global_batch_size": cfg.global_batch_size,
                    "micro_batch_size": cfg.micro_batch_size}
        try:
            return save_checkpoint(self.run_dir, done, engine=self.engine, precision=self.precision,
                                   scheduler=self.schedule, extra={"trainer": dataclasses.asdict(cfg)}, meta=position)
        except CheckpointWriteError as e:
            e.key = key  # the setting that asked for this save, for its one error line
            raise

    def periodic(self, done: int) -> None:
        if self.cfg.save_interval > 0 and done % self.cfg.save_interval == 0 and done != self.cfg.max_steps:
            self.save(done, key="trainer.save_interval")


def _run_step(engine: Engine, batches: Any, precision: Precision, schedule: LRSchedule, faults: NonFinitePolicy,
              signals: PreemptionSignals, step: int, capture: bool = False) -> tuple[StepResult, str, float]:
    """One iteration: the plan's stage (or the BF16 fallback), the layers' CUDA graphs captured first when
    ``capture``, the engine's step, then the LR schedule and the precision backend told whether the optimizer
    stepped. Returns the result, the stage label and the step's time (the capture's not included)."""
    stage = precision.begin_step(step)
    in_fallback = faults.in_fallback
    if capture:
        engine.graphs.capture(precision)
    t0 = time.perf_counter()
    with precision.high_precision() if in_fallback else contextlib.nullcontext():
        result = engine.train_step(batches, preempt_requested=signals.received is not None)
    if result.skipped:
        precision.skip_step(step)
    else:
        schedule.advance()
        engine.set_lr(schedule.lr())  # the next step's, as a scheduler leaves it (checkpoints)
        precision.after_optimizer_step(step)
    return result, "bf16 fallback" if in_fallback else stage, time.perf_counter() - t0


def _scopes(engine: Engine) -> list[str]:
    return [getattr(m, "name", str(m)) for m in engine.config.cuda_graph_modules] or ["whole layers"]


def _autopilot_duties(precision: Precision, done: int, result: StepResult, log: StepLog) -> None:
    """With the autopilot on (training/autopilot.py): tell it the step's loss and gradient norm, and log what it
    did since the last step (a ``kind: autopilot`` metrics row, and a console / train.log line, each)."""
    if not hasattr(precision, "step_result"):
        return
    precision.step_result(done, result.loss, result.grad_norm)
    for event in precision.drain_events():
        log.writer.log(event.row)
        if log.rank == 0:
            logger.info("%s", event.line)


def _warn_preempted(state: LoopState, cfg: TrainerConfig, run_dir: Path) -> None:
    logger.warning("preempted by %s after step %d: %s", state.preempted["signal"], state.done,
                   f"checkpoint {run_dir / 'checkpoints' / f'step_{state.done}'}; continue with trainer.resume=auto"
                   if cfg.save_checkpoints else "no checkpoint (trainer.save_checkpoints=false)")


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process so far: allocated on the GPU (CUDA's allocator), resident on the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def _start(engine: Engine, cfg: TrainerConfig, rank: int) -> LRSchedule:
    """The model chunks in training mode, and the run's LR schedule; rank 0 logs the global batch and LR scaling."""
    schedule = LRSchedule.of(cfg)
    if rank == 0:
        logger.info("global batch %d = micro %d x data parallel %d x accumulation %d", cfg.global_batch_size,
                    cfg.micro_batch_size, engine.dp_size, engine.num_microbatches)
    for chunk in engine.chunks:
        chunk.train()
    if rank == 0 and cfg.lr_scaling.enabled:
        logger.info("lr scaling: global batch %d / base %d: lr %.3g -> %.3g, min_lr %.3g -> %.3g",
                    cfg.global_batch_size, cfg.lr_scaling.base_global_batch_size, cfg.lr, schedule.peak, cfg.min_lr,
                    schedule.min_lr)
    return schedule


def _summary(state: LoopState, faults: NonFinitePolicy, stopped: str | None, wall_time_s: float,
             device: torch.device, extra: Mapping[str, Any] | None) -> dict[str, Any]:
    losses, rates = state.losses, state.rates
    return {
        "steps": state.done,
        "final_loss": losses[-1] if losses else None,
        "final_loss_mean_last_10": statistics.fmean(losses[-10:]) if losses else None,
        "val_loss": state.val_loss,
        "val_loss_full_precision": state.val_loss_fp,
        "tokens_per_s_median": statistics.median(rates) if rates else None,
        "wall_time_s": wall_time_s,
        "final_stage": state.stage,
        "nonfinite_loss_steps": sum(not math.isfinite(x) for x in losses),
        "skipped_steps": faults.skipped_steps,
        "bf16_fallbacks": faults.fallbacks,
        "stopped": stopped,
        "preempted": state.preempted,
        "peak_memory_bytes": peak_memory_bytes(device),
        **(extra or {}),
    }


def _write_summary(run_dir: Path, summary: dict[str, Any]) -> None:
    """summary.json and loss.png (rank 0)."""
    write_summary(run_dir, summary)
    try:
        plot_loss(run_dir)
    except Exception as e:  # noqa: BLE001 - a plot must never fail a finished run
        logger.warning("plot_loss failed: %s: %s", type(e).__name__, e)


def _resume(engine: Engine, cfg: TrainerConfig, precision: Precision, schedule: LRSchedule,
            resume_from: str | os.PathLike | None, rank: int) -> int:
    """The step to start at: 0, or the checkpoint's, with model, optimizer, LR schedule, RNG and (unless
    trainer.reset_scaling_state) the precision's scaling state loaded from it."""
    reset = resume_from is not None and precision is not None and cfg.reset_scaling_state
    if reset and rank == 0:
        logger.warning("resume: trainer.reset_scaling_state=true: weights, optimizer, LR schedule and step from %s; "
                       "the scaling state (amax histories, scales) starts fresh", resume_from)
    if reset and hasattr(precision, "reset_scaling"):  # the autopilot's decisions still load (its plan): not scaling
        precision.reset_scaling = True
        reset = False
    return 0 if resume_from is None else load_checkpoint(resume_from, engine=engine, scheduler=schedule,
                                                         precision=None if reset else precision)


def _leave_together(run_dir: Path, summary: dict[str, Any], stopped: str | None, rank: int) -> None:
    """summary.json and loss.png written (rank 0) before any rank leaves (the module docstring says why); a run
    the fault policy stopped leaves with NonFiniteStop."""
    if rank == 0:
        _write_summary(run_dir, summary)
    barrier()
    if stopped is not None:
        raise NonFiniteStop(stopped)


def graphs_capture_step(start: int, warmup_steps: int, steady_from: int) -> int:
    """The step before which the layers' CUDA graphs are captured: after ``warmup_steps`` (the model config's
    cuda_graph_warmup_steps) eager steps of this run from ``start`` (Megatron-LM's rule, a resumed run's too), and not
    before the recipe's last stage begins (``steady_from``: what the graphs replay cannot change)."""
    return max(start + int(warmup_steps), steady_from)


def _graphs_step(engine: Engine, start: int, steady_from: int) -> int | None:
    """:func:`graphs_capture_step` for the engine's model, or None without graphs."""
    if engine.graphs is None:
        return None
    return graphs_capture_step(start, engine.config.cuda_graph_warmup_steps, steady_from)


def _graphs_done(engine: Engine, graphs_at: int | None, done: int) -> dict[str, Any] | None:
    """The graphs freed (Megatron-LM's end of training); what the summary says of them (steps 1-based, as the metrics
    rows count them), or None when none were captured."""
    if engine.graphs is None:
        return None
    engine.graphs.delete()
    return {"captured_before_step": graphs_at + 1, "modules": _scopes(engine)} if done > graphs_at else None


def train(engine: Engine, batches_train: Iterator[Mapping[str, Any]] | list[Iterator[Mapping[str, Any]]],
          batches_valid: Sequence[Mapping[str, Any]] | Iterator[Mapping[str, Any]] | None, trainer_cfg: Any,
          precision: Precision, run_dir: str | os.PathLike, *, rank: int = 0, world_size: int = 1,
          resume_from: str | os.PathLike | None = None,
          summary_extra: Mapping[str, Any] | None = None,
          on_ready: Callable[[], None] | None = None, steady_from: int = 0) -> dict[str, Any]:
    """Train ``engine``'s model for ``trainer_cfg.max_steps`` optimizer steps; return the summary (also in
    summary.json, with ``summary_extra``'s keys, e.g. the recipe's name and the backend).

    ``batches_*`` yield dicts of ``tokens``, ``labels``, ``loss_mask``, ``position_ids`` ([b, s] tensors) for
    this data-parallel rank; ``batches_train`` may be a list, one iterator per model chunk (interleaved pipeline
    stages each read the stream); ``batches_valid`` a Sequence evaluated whole each time, or an iterator whose
    first ``trainer.eval_iters`` batches are kept. ``resume_from`` (a run dir or step dir) restores model, optimizer,
    precision state and RNG (the LR schedule is the configured one, from the checkpoint's step); the caller starts
    ``batches_train`` at the checkpoint's data position (the samples it consumed, in its meta.json; training/run.py
    does, through checkpoint.resume_skip). ``on_ready`` runs once the checkpoint is loaded, before the first step
    (training/run.py writes the run's plan and recipe there, so a resume refused while loading rewrites nothing).
    ``steady_from``: the first step of the recipe's last stage, before which no CUDA graph is captured.
    """
    cfg, run_dir = TrainerConfig.from_cfg(trainer_cfg), Path(run_dir)
    schedule = _start(engine, cfg, rank)
    start = _resume(engine, cfg, precision, schedule, resume_from, rank)
    if on_ready is not None:
        on_ready()
    evaluate = Evaluation(engine, precision, batches_valid, cfg)
    log = StepLog(run_dir, cfg, rank=rank, start=start)
    checkpoints = Checkpoints(run_dir, cfg, engine, precision, schedule)
    state, faults = LoopState(done=start), NonFinitePolicy(cfg)
    tokens = cfg.global_batch_size * engine.seq_length  # per optimizer step, all ranks
    graphs_at = _graphs_step(engine, start, steady_from)
    wall0 = time.perf_counter()
    # SIGTERM/SIGUSR1 -> a flag, for the loop's lifetime only; the log closed however the loop ends (a failed save:
    # the bar's line ended before the error's)
    with PreemptionSignals() as signals, contextlib.closing(log):
        engine.set_lr(schedule.lr())  # then again after each optimizer step: only they move the LR
        for step in range(start, cfg.max_steps):
            lr = schedule.lr()  # a skipped step leaves the schedule where it was: the next step runs at this LR
            result, state.stage, step_time = _run_step(engine, batches_train, precision, schedule, faults, signals,
                                                       step, capture=step == graphs_at)
            if step == graphs_at:
                log.note(f"step {step + 1}: CUDA graphs captured ({', '.join(_scopes(engine))}), replayed from here")
            verdict = faults.decide(result, step + 1)
            state.record(step + 1, result, tokens / step_time, signals.received)
            log.step(state, result, lr=lr, step_time=step_time, skipped_steps=faults.skipped_steps)
            for note in verdict.notes:
                log.note(note)
            _autopilot_duties(precision, step + 1, result, log)
            if verdict.stop is not None:
                state.stop = verdict.stop
                break
            if state.preempted:  # no evaluation: the grace period is for the checkpoint
                log.note(f"step {state.done}: {state.preempted['signal']} signal: checkpointing and stopping "
                         f"(preempted)")
                break
            evaluate(state, log)
            checkpoints.periodic(state.done)
        log.bar.close()
        graphed = _graphs_done(engine, graphs_at, state.done)
        # still under the handlers (a second signal must not cut this save short); after a stop: the last good state
        saved = checkpoints.save(state.done) if state.done > start or resume_from is None else None
        if state.preempted and rank == 0:
            _warn_preempted(state, cfg, run_dir)
    stopped = state.stop.message(saved) if state.stop is not None else None
    summary = _summary(state, faults, stopped, time.perf_counter() - wall0, engine.device,
                       {"cuda_graphs": graphed, **(summary_extra or {})})
    _leave_together(run_dir, summary, stopped, rank)
    return summary
