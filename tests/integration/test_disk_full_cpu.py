"""A checkpoint write that fails (issue 27, class 4): a full disk while DCP writes checkpoints/step_N, injected by a
test-only sitecustomize into torch's FileSystem.create_stream (the shard file is half written, then ENOSPC).
scripts/train.py ends with one `error:` line naming the checkpoint and the OS error, exit 5, no traceback; the
temporary directory is gone, `latest` still names the previous checkpoint, the outputs so far stay, and
trainer.resume=auto continues from that checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fp8_recipes.rundir import read_metrics
from test_train_cpu import ROOT, dataset, small_run  # noqa: F401  (dataset: the shared fixture)

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning")]

ENOSPC_HOOK = '''
import contextlib, errno, os
from pathlib import Path

_step = os.environ.get("FP8_TEST_ENOSPC_STEP")
if _step:
    from torch.distributed.checkpoint import filesystem

    _create_stream = filesystem.FileSystem.create_stream

    @contextlib.contextmanager
    def _full_disk(self, path, mode):
        if f".step_{_step}.tmp" in str(path) and "w" in mode:
            Path(path).write_bytes(b"half a shard")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        with _create_stream(self, path, mode) as stream:
            yield stream

    filesystem.FileSystem.create_stream = _full_disk
'''


def _train(run_dir: Path, dataset, tmp_path: Path, *extra: str, fail_at: int | None = None):  # noqa: F811
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK")}
    if fail_at is not None:
        hook = tmp_path / "hook"
        hook.mkdir(exist_ok=True)
        (hook / "sitecustomize.py").write_text(ENOSPC_HOOK)
        env.update(PYTHONPATH=os.pathsep.join([str(hook), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
                   FP8_TEST_ENOSPC_STEP=str(fail_at))
    overrides = [*dataset, *(o for o in small_run(run_dir, num_layers=1, steps=6) if "save_checkpoints" not in o),
                 "trainer.save_interval=2", *extra]
    return subprocess.run([sys.executable, "scripts/train.py", *overrides], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def test_a_full_disk_while_checkpointing_is_one_line_and_resumable(dataset, tmp_path):  # noqa: F811
    run_dir = tmp_path / "run"
    proc = _train(run_dir, dataset, tmp_path, fail_at=4)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 5, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    ckpts = run_dir / "checkpoints"
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: trainer.save_interval: writing checkpoint {ckpts / 'step_4'} failed: [Errno 28] No "
                      f"space left on device; free space on its file system (or raise the file size limit) and "
                      f"continue with trainer.resume=auto, which continues from step_2"], out[-4000:]
    assert (ckpts / "latest").read_text().strip() == "step_2"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_2"]  # no .step_4.tmp, no .latest.tmp
    assert [r["step"] for r in read_metrics(run_dir, "train")] == [1, 2, 3, 4]  # the outputs so far stay
    assert (run_dir / "train.log").is_file() and (run_dir / ".hydra" / "config.yaml").is_file()

    proc = _train(run_dir, dataset, tmp_path, "trainer.resume=auto")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "step_2" in proc.stdout + proc.stderr  # resumed from it
    assert [r["step"] for r in read_metrics(run_dir, "train")] == [1, 2, 3, 4, 5, 6]
    assert (ckpts / "latest").read_text().strip() == "step_6"
