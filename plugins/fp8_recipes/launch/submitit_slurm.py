"""Hydra launcher ``hydra/launcher=slurm`` (conf/hydra/launcher/slurm.yaml -> hydra_plugins.fp8_recipes_slurm):
hydra-submitit-launcher's Slurm launcher, made to train with several tasks, survive preemption and continue after
a requeue.

    python scripts/train.py -m hydra/launcher=slurm +recipe=hybrid launcher.tasks_per_node=2

What it adds to ``hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher``:

- Before submitting (on this host): ``launcher.*`` is checked (LauncherSettings, as the multirun starts:
  :class:`LauncherCheck`; a ``hydra.launcher.*`` size given instead wins and is checked too, :func:`launcher_settings`),
  every job's config gets the checks scripts/train.py makes first, and each job gets one fixed absolute ``run_dir``
  and ``trainer.resume=auto`` (launch/job.py). All of a job's tasks, and every requeued run of it, then write to and
  resume from one directory. A mistake found there, a job sbatch refuses, or no sbatch/srun on this host is one
  ``error:`` line naming the key (exit 2), and what the attempt wrote (submitit's files, the sweep dir's
  multirun.yaml) is removed again.
- The submitit parameters the YAML cannot interpolate: ``--signal=USR1@<signal_lead_s>`` (to the tasks, replacing
  submitit's ``USR2``), ``--requeue``, ``launcher.sbatch_args``, ``srun_args``, ``setup`` and the job name, plus
  ``export SUBMITIT_PREEMPT_SIGNAL=USR1`` so that submitit's own handler listens to the same signal.
- In each task: the ``launcher`` node is dropped from the task config (scripts/train.py knows no such key), and
  the exit of train.py's ``main`` is translated (:class:`TrainTask`).

Preemption, the design that works here (docs/slurm.md): submitit's own protocol (signal -> ``checkpoint()`` of the
task function -> ``scontrol requeue`` from global rank 0 -> exit) would stop rank 0 in the middle of a step and
leave the other ranks waiting in a collective. Instead, while training runs, scripts/train.py's handler owns
SIGUSR1 and SIGTERM on every rank: every rank finishes the step, the checkpoint is written, and ``main`` exits 4
(PREEMPTED_EXIT). :class:`TrainTask` then requeues the job from global rank 0 (``scontrol requeue``, at most
``launcher.max_requeues`` times, only for the configured signal: SIGTERM is Slurm ending the job) and lets the
process exit without a result, so submitit keeps waiting; the requeued job runs the same pickled task, which
resumes from run_dir's latest checkpoint. Before and after training, submitit's handler (on the same signal)
requeues through the launcher's ``checkpoint()``: nothing is lost there.

Rendezvous needs nothing here: submitit starts each task with srun, so SLURM_PROCID / SLURM_STEP_NUM_TASKS are set
and fp8_recipes.megatron.model.init_distributed takes the first node of the step as master address and a port
derived from the job id.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from hydra.experimental.callback import Callback
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher as SubmititSlurmLauncher

from fp8_recipes.launch.job import (
    check_train_config, default_job_name, fixed_run_dir, override_key, resumable_overrides,
)
from fp8_recipes.launch.sbatch import missing_dirs
from fp8_recipes.launch.settings import LauncherSettings, sbatch_refusal
from fp8_recipes.rundir import read_summary
from fp8_recipes.training.errors import PREEMPTED_EXIT, USER_ERROR_EXIT, remove_empty_dirs, remove_written

__all__ = ["LauncherCheck", "TrainingSlurmLauncher", "TrainTask", "launcher_settings", "submitit_parameters"]

log = logging.getLogger(__name__)


# sbatch options that conf/hydra/launcher/slurm.yaml already hands submitit through its own keys
_SET_BY_SUBMITIT_KEYS = {"job-name", "nodes", "ntasks-per-node", "gpus-per-node", "cpus-per-task", "mem", "time",
                         "partition", "account", "qos"}

# conf/hydra/launcher/slurm.yaml's interpolations: submitit's key -> the launcher key it takes its value from
_FROM_LAUNCHER = {"nodes": "nodes", "tasks_per_node": "tasks_per_node", "gpus_per_node": "gpus_per_node",
                  "cpus_per_task": "cpus_per_task", "mem_gb": "mem_gb", "timeout_min": "time_min",
                  "partition": "partition", "account": "account", "qos": "qos", "signal_delay_s": "signal_lead_s"}


def launcher_settings(config: Any) -> tuple[LauncherSettings, dict[str, str]]:
    """(the job's settings, {field: the hydra.launcher key that set it}) from a composed config with its hydra node:
    ``launcher.*``, and a ``hydra.launcher.*`` value given in place of its interpolation wins (as it does for
    submitit), so that the checks, the job's world size and the error lines use what is submitted. A ValueError
    names the key the user wrote: ``hydra.launcher.nodes=0`` as itself, ``launcher.time_min=abc`` as itself."""
    from omegaconf import OmegaConf

    launcher = config.get("launcher")
    if launcher is None:
        return LauncherSettings.from_cfg(None), {}  # (raises: no launcher group)
    values = OmegaConf.to_container(launcher, resolve=True)
    given = OmegaConf.to_container(config.hydra.launcher, resolve=False)
    keys = {}
    for key, field in _FROM_LAUNCHER.items():
        if key in given and given[key] != f"${{launcher.{field}}}":  # (unresolved: the user's value, or its ${...})
            values[field], keys[field] = config.hydra.launcher[key], f"hydra.launcher.{key}"
    return LauncherSettings.from_cfg(values, keys), keys


def submitit_parameters(params: dict[str, Any], settings: LauncherSettings, job_name: str) -> dict[str, Any]:
    """hydra-submitit-launcher's parameters plus what conf/hydra/launcher/slurm.yaml cannot interpolate: the
    ``--signal`` (replacing submitit's USR2), ``--requeue``, launcher.sbatch_args, srun_args, setup, the job name."""
    extra = {k: v for k, v in settings.sbatch_options(job_name).items() if k not in _SET_BY_SUBMITIT_KEYS}
    setup = [*(params.get("setup") or []), *settings.setup]
    if settings.signal:
        setup.insert(0, f"export SUBMITIT_PREEMPT_SIGNAL={settings.signal}")
    out = {**params, "additional_parameters": {**(params.get("additional_parameters") or {}), **extra},
           "setup": setup, "srun_args": list(settings.srun_args)}
    if not settings.job_name and params.get("name") in (None, "train", "app"):  # Hydra's default: the script name
        out["name"] = job_name
    elif settings.job_name:
        out["name"] = settings.job_name
    return out


class TrainTask:
    """The task function run in every Slurm task: scripts/train.py's ``main`` on the config without ``launcher``.

    ``main`` ends with ``sys.exit`` on anything but success. Exit 4 (preempted, checkpoint written) leaves the
    process without a result, after global rank 0 requeued the job when the settings allow it; any other exit
    becomes a RuntimeError, which submitit reports to the submitting process instead of waiting for a result.
    """

    def __init__(self, function: Callable[[Any], Any], settings: LauncherSettings):
        self.function = function
        self.settings = settings

    def __call__(self, cfg: Any) -> Any:
        from omegaconf import open_dict

        restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
        with open_dict(cfg):
            cfg.pop("launcher", None)
            if restarts > 0:  # a requeued run continues from its own checkpoints
                cfg.trainer.resume = "auto"
        try:
            return self.function(cfg)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if code == 0:
                return None
            if code == PREEMPTED_EXIT:
                self._requeue_after_preemption(Path(str(cfg.run_dir)), restarts)
                raise
            raise RuntimeError(f"scripts/train.py exited with code {code} in Slurm task "
                               f"{os.environ.get('SLURM_PROCID', '?')} of job {os.environ.get('SLURM_JOB_ID', '?')}; "
                               f"its error line is in {_task_log()}") from None

    def _requeue_after_preemption(self, run_dir: Path, restarts: int) -> None:
        if int(os.environ.get("SLURM_PROCID", "0")) != 0:
            return  # one requeue per job: global rank 0's
        signal = _preemption_signal(run_dir)
        settings = self.settings
        if not (settings.requeue and settings.signal) or signal != f"SIG{settings.signal}":
            print(f"fp8-recipes: preempted by {signal}; not requeued (launcher.requeue={settings.requeue}, "
                  f"launcher.signal={settings.signal}; SIGTERM is Slurm ending the job)", file=sys.stderr)
            return
        if restarts >= settings.max_requeues:
            print(f"fp8-recipes: preempted and requeued {restarts} times already (launcher.max_requeues="
                  f"{settings.max_requeues}); continue with trainer.resume=auto run_dir={run_dir}", file=sys.stderr)
            return
        job = os.environ["SLURM_JOB_ID"]
        print(f"fp8-recipes: preempted (exit {PREEMPTED_EXIT}); requeueing job {job} (restart {restarts + 1} of at "
              f"most {settings.max_requeues})", file=sys.stderr, flush=True)
        proc = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            print(f"fp8-recipes: scontrol requeue {job} failed: {proc.stderr.strip()}", file=sys.stderr)


def _task_log() -> str:
    """This task's stderr file under submitit (where train.py printed its ``error:`` line)."""
    try:
        import submitit

        return str(submitit.JobEnvironment().paths.stderr)
    except Exception:  # noqa: BLE001 - outside a submitit job: no file to name
        return "this task's log"


def _preemption_signal(run_dir: Path) -> str | None:
    """The signal that stopped the run, from rank 0's summary.json (``{"preempted": {"signal": ..., "step": ...}}``)."""
    return (read_summary(run_dir).get("preempted") or {}).get("signal")


class TrainingSlurmLauncher(SubmititSlurmLauncher):
    """The launcher's behaviour (module docstring). Hydra accepts launcher classes only from modules under
    ``hydra_plugins``: conf/hydra/launcher/slurm.yaml names its subclass hydra_plugins.fp8_recipes_slurm.SlurmLauncher."""

    def setup(self, *, hydra_context, task_function, config) -> None:
        settings, self.keys = _settings_or_exit(config)
        super().setup(hydra_context=hydra_context, task_function=TrainTask(task_function, settings), config=config)
        self.settings = settings

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int):
        from submitit.core.utils import FailedJobError, JobPaths

        folder = JobPaths.get_first_id_independent_folder(self.params["submitit_folder"])
        attempt = _Attempt(folder, missing_dirs(folder), _files(folder), initial_job_idx)
        try:
            fixed, job_name = self._fixed_jobs(job_overrides, initial_job_idx)
            missing = [c for c in ("sbatch", "srun") if shutil.which(c) is None]  # (submitit: a traceback)
            if missing:
                raise ValueError(f"hydra/launcher: {' and '.join(missing)} not found (run this on a Slurm login "
                                 f"node, or write an sbatch script with scripts/slurm/make_sbatch.py)")
        except ValueError as e:
            self._give_up(str(e), attempt)
        self.params = submitit_parameters(self.params, self.settings, job_name)
        if self.params.get("gpus_per_node") is None and self.settings.gpus_per_node is not None:
            self.params["gpus_per_node"] = self.settings.gpus_per_node  # trainer.device=gpu: a GPU per task
        if self.settings.signal:  # the sbatch --signal line submitit writes, and its handler in the job
            os.environ["SUBMITIT_PREEMPT_SIGNAL"] = self.settings.signal
        try:
            with _without_sbatch_lines():
                return super().launch(fixed, initial_job_idx)
        except FailedJobError as e:  # also how a job that ran and failed is reported: only sbatch's refusal is ours
            cause = e.__cause__
            if not (isinstance(cause, subprocess.CalledProcessError) and Path(str(cause.cmd[0])).name == "sbatch"):
                raise
            self._give_up(sbatch_refusal(str(e), self.keys), attempt)

    def _give_up(self, message: str, attempt: _Attempt) -> None:
        """A user error before this batch of jobs was queued (a config check, no Slurm here, sbatch refusing):
        one line, exit 2, and what this attempt wrote is removed, nothing else: the pickles and submission scripts
        submitit left loose in its folder since the attempt began (a queued job's move into its own folder), the
        folders made for them, and, for the sweep's first batch, Hydra's multirun.yaml and the folders Hydra made
        for it (hydra.sweep.dir, multirun/<date>/) when left empty."""
        written = [p for p in _files(attempt.folder) - attempt.files if _SUBMITIT_LOOSE.fullmatch(p.name)]
        sweep = Path(str(self.config.hydra.sweep.dir))
        if attempt.first_batch:
            written.append(sweep / "multirun.yaml")
        remove_written(written)
        for made in attempt.made:  # (deepest first; one still holding anything stays)
            with contextlib.suppress(OSError):
                made.rmdir()
        if attempt.first_batch:
            remove_empty_dirs(sweep)
        _exit_user_error(message)

    def _fixed_jobs(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> tuple[list[list[str]], str]:
        """Every job's overrides with its own fixed run_dir (checked first); the first job's default name."""
        loader = self.hydra_context.config_loader
        fixed, seen, names = [], set(), set()
        for idx, overrides in enumerate(job_overrides):
            cfg = loader.load_sweep_config(self.config, list(overrides))
            if idx == 0:  # one job array: the first job's trainer decides the GPUs per task
                self.settings = self.settings.for_trainer(cfg.trainer)
            try:
                check_train_config(cfg, self.settings.world_size)
            except ValueError as e:
                job = f" (job {' '.join(overrides)})" if overrides else ""  # (a sweep's job: which one)
                raise ValueError(f"{str(e).splitlines()[0]}{job}") from None
            run_dir = fixed_run_dir(cfg)
            if run_dir in seen:  # a sweep whose jobs share a run_dir (same recipe, same second): one each
                run_dir = run_dir.with_name(f"{run_dir.name}-{initial_job_idx + idx}")
            seen.add(run_dir)
            names.add(default_job_name(cfg))
            kept = [o for o in overrides if not override_key(o).startswith("launcher")]
            fixed.append(resumable_overrides(kept, run_dir) + [o for o in overrides if o not in kept])
            log.info("job %d: run_dir %s", initial_job_idx + idx, run_dir)
        return fixed, names.pop() if len(names) == 1 else "fp8-sweep"  # one job array: one name


_SUBMITIT_LOOSE = re.compile(r"[0-9a-f]{32}\.pkl|\.submission_file_[0-9a-f]{32}\.sh")
"""The files submitit writes loose in its folder while submitting (a job's pickle, the batch's sbatch script)."""


@dataclasses.dataclass(frozen=True)
class _Attempt:
    """What the submitit folder held when a batch's submission began: what a failed one may remove is the rest."""

    folder: Path
    made: list[Path]
    """The folders submitting would make for it (launch.sbatch.missing_dirs), deepest first."""
    files: frozenset[Path]
    initial_job_idx: int

    @property
    def first_batch(self) -> bool:
        return self.initial_job_idx == 0


def _files(folder: Path) -> frozenset[Path]:
    return frozenset(p for p in folder.glob("*") if p.is_file() and not p.is_symlink()) if folder.is_dir() \
        else frozenset()


def _settings_or_exit(config: Any) -> tuple[LauncherSettings, dict[str, str]]:
    try:
        return launcher_settings(config)
    except ValueError as e:
        _exit_user_error(str(e))


class LauncherCheck(Callback):
    """Hydra callback that conf/hydra/launcher/slurm.yaml adds: checks the launcher settings as a multirun starts,
    before Hydra builds the launcher. Building it resolves hydra.launcher.*, whose typed keys would report a bad
    ``launcher.time_min`` as ``hydra.launcher.timeout_min`` (the key interpolating it); here it is one line naming
    the key the user wrote, exit 2, before the sweep dir exists."""

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        _settings_or_exit(config)


def _exit_user_error(message: str) -> None:
    """A user error found before submitting: one line, exit 2, nothing submitted."""
    print(f"error: {message.splitlines()[0]}", file=sys.stderr)
    sys.exit(USER_ERROR_EXIT)


class _WithoutSbatchLines(io.TextIOBase):
    """sys.stderr, less sbatch's own lines: submitit prints them only when sbatch refused the job, right before it
    raises FailedJobError, which the launcher says in one line. Whole lines pass on as they are written."""

    def __init__(self, stream: Any):
        self.stream, self.partial = stream, ""

    def write(self, text: str) -> int:
        *lines, self.partial = (self.partial + text).split("\n")
        for line in lines:
            if not line.startswith(("sbatch: ", 'Try "sbatch --help"')):
                self.stream.write(line + "\n")
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def fileno(self) -> int:  # (what writes to the descriptor itself is not filtered)
        return self.stream.fileno()


@contextlib.contextmanager
def _without_sbatch_lines() -> Iterator[None]:
    stream = _WithoutSbatchLines(sys.stderr)
    try:
        with contextlib.redirect_stderr(stream):
            yield
    finally:
        stream.stream.write(stream.partial)  # (a last line without its newline)
