"""A self-contained sbatch script for one training run (scripts/slurm/make_sbatch.py writes it).

    text = sbatch_script(settings, train_overrides, run_dir=..., workdir=..., python=..., train_script=...)

The script asks Slurm for the resources in :class:`LauncherSettings`, runs ``srun python scripts/train.py
<overrides> trainer.resume=auto run_dir=<fixed dir>`` (one task per rank: init_distributed reads srun's
SLURM_PROCID / SLURM_STEP_NUM_TASKS and derives the rendezvous port from the job id), and requeues itself when the
run was stopped by the preemption signal: train.py exits with code 4 (PREEMPTED_EXIT) after every rank checkpointed,
and ``scontrol requeue`` puts the job back in the queue, at most ``max_requeues`` times (SLURM_RESTART_COUNT); the
next run continues from the checkpoint. A SIGTERM to the batch shell means Slurm itself is ending the job (scancel,
time limit, its own preemption, which requeues by itself): then nothing is requeued from here.
"""

from __future__ import annotations

import contextlib
import shlex
from pathlib import Path
from typing import Any, Iterable

from fp8_recipes.launch.job import (check_train_config, default_job_name, fixed_run_dir, override_key,
                                    resumable_overrides)
from fp8_recipes.launch.settings import LauncherSettings, sbatch_refusal
from fp8_recipes.recipe.pack import conf_dir, recipe_file_overrides
from fp8_recipes.training.config import check_writable_file
from fp8_recipes.training.errors import PREEMPTED_EXIT, remove_partial_run_dir

__all__ = ["sbatch_script", "sbatch_lines", "SLURM_OUTPUT"]

SLURM_OUTPUT = "slurm-%j.out"
"""The job's stdout and stderr, in the run directory; appended to by every requeued run (--open-mode=append)."""


def sbatch_lines(options: dict[str, Any]) -> list[str]:
    """``#SBATCH --key=value`` lines (``True`` = a flag), values quoted for the shell where needed."""
    return [f"#SBATCH --{k}" if v is True else f"#SBATCH --{k}={shlex.quote(str(v))}" for k, v in options.items()]


def _requeue_block(settings: LauncherSettings) -> list[str]:
    if not (settings.requeue and settings.signal):
        return []
    n = settings.max_requeues
    return [
        f'if [ "$rc" -eq {PREEMPTED_EXIT} ] && [ "$terminated" -eq 0 ]; then',
        f'  # every rank checkpointed after SIG{settings.signal}: run again from the checkpoint (trainer.resume=auto)',
        f'  if [ "${{SLURM_RESTART_COUNT:-0}}" -lt {n} ]; then',
        f'    echo "fp8-recipes: preempted (exit {PREEMPTED_EXIT}); requeueing job $SLURM_JOB_ID'
        f' (restart $(( ${{SLURM_RESTART_COUNT:-0}} + 1 )) of at most {n})"',
        '    scontrol requeue "$SLURM_JOB_ID" && exit 0',
        '    echo "fp8-recipes: scontrol requeue failed; submit this script again to continue" >&2',
        '  else',
        f'    echo "fp8-recipes: preempted and requeued {n} times already (launcher.max_requeues={n}); submit this'
        ' script again to continue" >&2',
        '  fi',
        'fi',
    ]


def _preemption_note(settings: LauncherSettings) -> list[str]:
    if not settings.signal:
        return ["# Preemption: no signal before the time limit (launcher.signal=null)."]
    then = f"requeues the job (at most {settings.max_requeues} times)" if settings.requeue else \
        "stops (launcher.requeue=false)"
    return [f"# Preemption: SIG{settings.signal} reaches every task {settings.signal_lead_s} s before the time limit "
            f"(by hand: scancel --signal={settings.signal} JOBID);",
            f"# every rank finishes its step, writes checkpoints/step_N and exits {PREEMPTED_EXIT}; this script then "
            f"{then}."]


def sbatch_script(settings: LauncherSettings, train_overrides: Iterable[str], *, run_dir: Path, workdir: Path,
                  python: str, train_script: Path, job_name: str, script: Path, generated_by: str = "") -> str:
    """The script's text. ``train_overrides`` already hold ``run_dir=`` and ``trainer.resume=`` (job.py)."""
    options = settings.sbatch_options(job_name)
    options.update({"output": str(run_dir / SLURM_OUTPUT), "open-mode": "append"})
    srun = ["srun", *settings.srun_args, python, str(train_script), *train_overrides]
    lines = [
        "#!/bin/bash",
        "# fp8-recipes training job, written by scripts/slurm/make_sbatch.py" + (f":\n#   {generated_by}" if
                                                                                  generated_by else ""),
        f"# Submit with: sbatch {script}",
        *_preemption_note(settings),
        *sbatch_lines(options),
        "",
        "set -u",
        f"cd {shlex.quote(str(workdir))}",
        *settings.setup,
        "# SIGTERM to this shell is Slurm ending the job (scancel, time limit, preemption): remember it, let srun's",
        "# tasks checkpoint, and requeue nothing from here.",
        "terminated=0",
        "trap 'terminated=1' TERM",
        'echo "fp8-recipes: job $SLURM_JOB_ID run $(( ${SLURM_RESTART_COUNT:-0} + 1 )) on $SLURM_JOB_NODELIST"',
        "# a requeued run continues from its own checkpoints, whatever trainer.resume the first run had",
        "resume=()",
        '[ "${SLURM_RESTART_COUNT:-0}" -gt 0 ] && resume=(trainer.resume=auto)',
        " ".join(shlex.quote(a) for a in srun) + ' "${resume[@]}"',
        "rc=$?",
        *_requeue_block(settings),
        'echo "fp8-recipes: train.py exited with $rc"',
        'exit "$rc"',
        "",
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------
# scripts/slurm/make_sbatch.py


def split_overrides(overrides: Iterable[str]) -> tuple[list[str], list[str]]:
    """(overrides composing the `launcher` group, overrides for scripts/train.py). ``launcher=NAME`` picks
    conf/launcher/NAME.yaml (default slurm); ``launcher.KEY=VALUE`` edits it; neither reaches train.py."""
    launcher, train = [], []
    for o in overrides:
        key = override_key(o)
        if key == "launcher":
            launcher.insert(0, "+launcher=" + o.split("=", 1)[1])
        elif key.startswith("launcher."):
            launcher.append(o)
        else:
            train.append(o)
    if not launcher or not launcher[0].startswith("+launcher="):
        launcher.insert(0, "+launcher=slurm")
    return launcher, train


QUOTES = "'\""


def compose_job(overrides: Iterable[str]):
    """(train config with the `launcher` group, overrides for train.py), composed as scripts/train.py would."""
    from hydra import compose, initialize_config_dir

    launcher, train = split_overrides(overrides)
    composable = recipe_file_overrides(train)  # +recipe=FILE.yaml: composed here, passed to train.py as an absolute path
    for i, (original, changed) in enumerate(zip(list(train), composable)):
        if original != changed:
            key, value = original.split("=", 1)
            train[i] = f"{key}={Path(value.strip(QUOTES)).resolve()}"
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = compose("train", overrides=[*launcher, *composable])
    return cfg, train


def write_sbatch(overrides: Iterable[str], output: Path | None = None, *, python: str, train_script: Path,
                 workdir: Path, generated_by: str = "") -> tuple[Path, Path]:
    """Check the job and write its script (atomically, executable): (script path, run_dir). ValueError on a user
    error (nothing written); Hydra's own errors pass through for errors.hydra_errors_as_one_line."""
    import os

    cfg, train = compose_job(overrides)
    settings = LauncherSettings.from_cfg(cfg.launcher).for_trainer(cfg.trainer)
    check_train_config(cfg, settings.world_size)
    run_dir = fixed_run_dir(cfg)
    path = Path(output).resolve() if output else run_dir / "job.sbatch"
    if output:
        check_writable_file("--output", output, "jobs/tw.sbatch")
    text = sbatch_script(settings, resumable_overrides(train, run_dir), run_dir=run_dir, workdir=workdir,
                         python=python, train_script=train_script, job_name=default_job_name(cfg), script=path,
                         generated_by=generated_by)
    path.parent.mkdir(parents=True, exist_ok=True)
    run_dir.mkdir(parents=True, exist_ok=True)  # Slurm opens <run_dir>/slurm-<id>.out before train.py starts
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.chmod(tmp, 0o755)
    tmp.replace(path)
    return path, run_dir


def missing_dirs(folder: Path) -> list[Path]:
    """The folders ``folder.mkdir(parents=True)`` would make, deepest first (none when it exists)."""
    out = []
    folder = Path(folder).resolve()
    while not folder.exists():
        out.append(folder)
        folder = folder.parent
    return out


def submit(script: Path, run_dir: Path, env: dict[str, str] | None = None, made: Iterable[Path] = ()) -> str:
    """``sbatch --parsable SCRIPT`` -> the job id. ValueError (one line) when sbatch is missing (the script stays:
    it can be copied to a login node) or refuses the job (the line names the launcher key; the script goes, and
    run_dir when write_sbatch made it and it holds nothing else: no job will use it; ``made``: the folders made for
    the script (missing_dirs before write_sbatch), removed when empty)."""
    import shutil
    import subprocess

    if shutil.which("sbatch") is None:
        raise ValueError(f"launcher: sbatch not found (run this on a Slurm login node, or copy {script} there and "
                         f"sbatch it)")
    proc = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, env=env, timeout=120)
    if proc.returncode != 0:
        script.unlink(missing_ok=True)
        remove_partial_run_dir(run_dir)
        for folder in made:  # (--output elsewhere: the folders made for it, and only those)
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise ValueError(sbatch_refusal(proc.stderr))
    return proc.stdout.strip().split(";")[0]
