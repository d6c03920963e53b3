"""Preemption signals in the training loop (in process; tests/integration/test_preemption_cpu.py signals a real
scripts/train.py): handlers only while train() runs, restored after; the stop decision comes from the per-step
all-reduce, so a signal that reached only another rank stops this one after the same step."""

import signal
import threading

import pytest

from fp8_recipes.rundir import read_metrics
from fp8_recipes.training.checkpoint import read_checkpoint
from fp8_recipes.training.engine import Engine
from fp8_recipes.training.loop import train
from fp8_recipes.training.precision import NoPrecision
from fp8_recipes.training.preemption import PreemptionSignals
from tiny_engine import BATCH, batches, tiny_engine

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def test_handlers_only_inside_and_restored_after():
    seen = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    try:
        before = signal.getsignal(signal.SIGTERM)
        with PreemptionSignals() as signals:
            signal.raise_signal(signal.SIGUSR1)
            signal.raise_signal(signal.SIGTERM)  # a second signal: still only the flag, the first name kept
            assert signals.received == "SIGUSR1"
        assert signal.getsignal(signal.SIGTERM) is before and seen == []
        signal.raise_signal(signal.SIGUSR1)  # the previous handler is back
        assert seen == [signal.SIGUSR1]

        def elsewhere():  # not the main thread: nothing installed, nothing raised
            with PreemptionSignals() as other:
                assert other.received is None and not other._previous
        t = threading.Thread(target=elsewhere)
        t.start()
        t.join()
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_another_ranks_signal_stops_after_the_same_step(tmp_path, monkeypatch):
    """The flag summed in the step's all-reduce (here: another rank's 1 added at step 3) stops every rank."""
    reduce, calls = Engine._reduce_flags, []

    def other_rank_signalled_at_step_3(flags):
        calls.append(flags)
        if len(calls) == 3:
            flags = flags.clone()
            flags[2] += 1.0  # [loss, non-finite, preemption]
        return reduce(flags)

    monkeypatch.setattr(Engine, "_reduce_flags", staticmethod(other_rank_signalled_at_step_3))
    cfg = {"max_steps": 8, "micro_batch_size": BATCH, "global_batch_size": BATCH, "warmup_steps": 2,
           "eval_interval": 0, "lr": 1e-2, "min_lr": 1e-3}
    before = signal.getsignal(signal.SIGTERM)
    with tiny_engine(cfg) as engine:
        summary = train(engine, batches(), None, cfg, NoPrecision(), tmp_path)
    assert summary["steps"] == 3 and summary["preempted"] == {"signal": "another rank", "step": 3}
    rows = read_metrics(tmp_path, "train")
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["preempted"] == "another rank"
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_3"
    assert read_checkpoint(tmp_path / "checkpoints" / "step_3")["step"] == 3
    assert signal.getsignal(signal.SIGTERM) is before
