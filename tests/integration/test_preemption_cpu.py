"""Preemption on the CPU (issue 6 item 4, without Slurm): SIGTERM or SIGUSR1 (Slurm's preemption and
``--signal``) to a running ``scripts/train.py`` -> the step in progress finishes, ``checkpoints/step_N`` is written,
the process exits with PREEMPTED_EXIT within seconds, summary.json and the last metrics row say ``preempted``; then
``trainer.resume=auto`` runs steps N + 1 .. max_steps.

Both signalled runs start together (one module fixture) to share the start-up time of two processes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fp8_recipes.training.errors import PREEMPTED_EXIT
from fp8_recipes.training.metrics import read_metrics
from test_train_cpu import ROOT, dataset, small_run  # noqa: F401  (dataset: the shared fixture)

STEPS = 40          # far more than the run reaches before the signal (a step takes ~0.05 s here)
SIGNAL_AFTER = 3    # metrics rows seen before the signal is sent
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "SLURM_PROCID", "SLURM_STEP_NUM_TASKS")


def command(run_dir: Path, dataset: list[str], *extra: str) -> list[str]:
    overrides = [o for o in small_run(run_dir, steps=STEPS) if not o.startswith("trainer.save_checkpoints=")]
    return [sys.executable, "scripts/train.py", *overrides, "trainer.log_interval=1", "+recipe=delayed", *dataset,
            *extra]


def environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env["OMP_NUM_THREADS"] = "1"  # a tiny model: one thread per process is as fast, and two runs share the cores
    return env


def train_rows(run_dir: Path) -> list[dict]:
    try:
        return read_metrics(run_dir, "train")
    except (FileNotFoundError, json.JSONDecodeError):  # not there yet, or a row half-written
        return []


@pytest.fixture(scope="module")
def preempted(dataset, tmp_path_factory) -> dict[str, dict]:
    """signal name -> {run_dir, rc, seconds (signal to exit), sent_after (rows seen), stderr} of a signalled run."""
    runs = {}
    for name in ("SIGTERM", "SIGUSR1"):
        run_dir = tmp_path_factory.mktemp(f"preempt_{name}")
        log = open(run_dir.parent / f"{run_dir.name}.log", "w+")
        proc = subprocess.Popen(command(run_dir, dataset), cwd=ROOT, env=environment(), stdout=log,
                                stderr=subprocess.STDOUT, text=True)
        runs[name] = {"run_dir": run_dir, "proc": proc, "log": log, "sent": None}
    deadline = time.monotonic() + 240
    while any(r["sent"] is None for r in runs.values()) and time.monotonic() < deadline:
        for name, r in runs.items():
            if r["sent"] is None and (r["proc"].poll() is not None or len(train_rows(r["run_dir"])) >= SIGNAL_AFTER):
                r["sent_after"] = len(train_rows(r["run_dir"]))
                r["proc"].send_signal(getattr(signal, name))
                r["sent"] = time.monotonic()
        time.sleep(0.01)
    for r in runs.values():
        proc = r.pop("proc")
        try:
            r["rc"] = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            r["rc"] = proc.wait()
        r["seconds"] = time.monotonic() - (r["sent"] or 0)
        log = r.pop("log")
        log.seek(0)
        r["output"] = log.read()
        log.close()
    return runs


@pytest.mark.parametrize("name", ["SIGTERM", "SIGUSR1"])
def test_signal_checkpoints_and_exits_preempted(name, preempted):
    r = preempted[name]
    run_dir, out = r["run_dir"], r["output"][-3000:]
    assert r["rc"] == PREEMPTED_EXIT, out
    assert r["sent_after"] >= SIGNAL_AFTER and r["seconds"] < 20, (r["seconds"], out)
    summary = json.loads((run_dir / "summary.json").read_text())
    n = summary["steps"]
    assert summary["preempted"] == {"signal": name, "step": n} and SIGNAL_AFTER <= n < STEPS
    rows = read_metrics(run_dir, "train")
    assert [row["step"] for row in rows] == list(range(1, n + 1))  # every step it began, it finished
    assert rows[-1]["preempted"] == name and all("preempted" not in row for row in rows[:-1])
    ckpts = run_dir / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == f"step_{n}" and (ckpts / f"step_{n}" / "tp_00.pt").is_file()
    assert not list(ckpts.glob(".*.tmp"))
    assert f"preempted: {name} signal, stopped after step {n}" in r["output"] and "Traceback" not in r["output"]


def test_resume_auto_continues_after_the_preemption_checkpoint(preempted, dataset):
    run_dir = preempted["SIGTERM"]["run_dir"]
    n = json.loads((run_dir / "summary.json").read_text())["steps"]
    proc = subprocess.run(command(run_dir, dataset, "trainer.resume=auto"), cwd=ROOT, env=environment(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [row["step"] for row in read_metrics(run_dir, "train")]
    assert steps == list(range(1, n + 1)) + list(range(n + 1, STEPS + 1))  # no step repeated or left out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["preempted"] is None
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{STEPS}"
