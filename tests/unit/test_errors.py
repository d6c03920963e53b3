"""scripts/train.py's error handling pieces: the partial run-dir cleanup and the up-front config checks."""

import os
import time

import pytest

from fp8_recipes.training.config import check_data_cfg, check_model_cfg, check_writable_dir
from fp8_recipes.training.errors import remove_partial_run_dir, worker_hydra_overrides


def test_cleanup_removes_only_what_this_start_wrote(tmp_path):
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / "notes.txt").write_text("mine")
    old = run / "metrics.jsonl"  # an earlier run's output in a reused directory
    old.write_text("{}\n")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    start = time.time()
    (run / ".hydra" / "config.yaml").write_text("x: 1\n")
    (run / "plan.txt").write_text("plan\n")
    remove_partial_run_dir(run, since=start)
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl", "notes.txt"]
    (run / "notes.txt").unlink()
    old.unlink()
    (run / ".hydra").mkdir()
    remove_partial_run_dir(run, since=start)
    assert not run.exists()


def test_checks_name_the_key(tmp_path):
    with pytest.raises(ValueError, match=r"^run_dir: '/etc/hostname/x' cannot be created"):
        check_writable_dir("run_dir", "/etc/hostname/x")
    check_writable_dir("run_dir", str(tmp_path / "a" / "b"))
    with pytest.raises(ValueError, match=r"^model\.num_query_groups=3 does not divide"):
        check_model_cfg({"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 8,
                         "vocab_size": None, "num_query_groups": 3}, vocab_may_be_unset=True)
    with pytest.raises(ValueError, match=r"^model\.ffn_hidden_size=250 is not divisible by trainer\.tensor_model_par"):
        check_model_cfg({"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 8,
                         "vocab_size": 64, "ffn_hidden_size": 250}, tensor_parallel=4)
    with pytest.raises(ValueError, match=r"^data\.split='1,2': must be three"):
        check_data_cfg({"path": str(tmp_path), "split": "1,2"})


def test_compile_caches_are_checked_where_the_run_uses_them(tmp_path, monkeypatch):
    """On a GPU every run compiles (Megatron-Core's fused kernels): both caches must be writable. On the CPU nothing
    compiles: TRITON_CACHE_DIR is not read, and TORCHINDUCTOR_CACHE_DIR, which torch creates, need only exist or be
    creatable (an unwritable existing one, here os.access faked for root, is never written)."""
    from fp8_recipes.training.config import check_compile_caches

    for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        with pytest.raises(ValueError, match=rf"^{var}: '/etc/hostname/x' cannot be created \('/etc/hostname' is a "
                                             rf"file\); point {var} at a writable directory$"):
            check_compile_caches(gpu=True, environ={var: "/etc/hostname/x"})
    check_compile_caches(gpu=False, environ={"TRITON_CACHE_DIR": "/etc/hostname/x"})
    with pytest.raises(ValueError, match=r"^TORCHINDUCTOR_CACHE_DIR: '/etc/hostname' is a file"):
        check_compile_caches(gpu=False, environ={"TORCHINDUCTOR_CACHE_DIR": "/etc/hostname"})
    monkeypatch.setattr(os, "access", lambda *a: False)
    check_compile_caches(gpu=False, environ={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path)})
    with pytest.raises(ValueError, match=r"^TRITON_CACHE_DIR: .* is not writable"):
        check_compile_caches(gpu=True, environ={"TRITON_CACHE_DIR": str(tmp_path)})
    check_compile_caches(gpu=True, environ={})  # unset: torch's and Triton's own defaults


def test_only_rank_0_writes_and_removes_a_failed_starts_run_dir(tmp_path, monkeypatch):
    """Under torchrun only rank 0 lets Hydra write run_dir (the others get worker_hydra_overrides: no run_dir, no
    .hydra/, no train.log handler), and only rank 0 removes a failed start's files: a rank removing while another
    was still writing left files behind, or that rank's log handler without its directory (issue 27, class 6)."""
    run = tmp_path / "run"
    run.mkdir()
    start = time.time()
    (run / ".hydra").mkdir()
    (run / "plan.txt").write_text("plan\n")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert "hydra.output_subdir=null" in worker_hydra_overrides()
    remove_partial_run_dir(run, since=start)
    assert sorted(p.name for p in run.iterdir()) == [".hydra", "plan.txt"]  # rank 0's, still being written maybe
    monkeypatch.setenv("RANK", "0")
    assert worker_hydra_overrides() == []
    remove_partial_run_dir(run, since=start)
    assert not run.exists()
    remove_partial_run_dir(run, since=start)  # nothing left to remove: no error


@pytest.mark.parametrize("checkpoints", [True, False])
def test_a_refused_resume_puts_back_the_runs_hydra_files_and_log(tmp_path, checkpoints):
    """Hydra rewrites run_dir/.hydra/ and appends to train.log before the run starts; a resume refused afterwards
    (e.g. another model config) puts back the earlier run's files, so its error's advice, the run dir's
    .hydra/config.yaml, names the config the checkpoint was saved with, and cuts the refused start's lines from the
    log (with checkpoints, and without: resume=auto into a run that saved none). Files this job wrote first
    (another rank's) are not taken for the earlier run's."""
    from fp8_recipes.training import errors

    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    if checkpoints:
        (run / "checkpoints").mkdir()
    saved, written, log = run / ".hydra" / "config.yaml", run / ".hydra" / "overrides.yaml", run / "train.log"
    saved.write_text("model: {vocab_size: 512}\n")
    log.write_text("[step 8] the earlier run\n")
    then = time.time() - 3600
    for path in (saved, log):
        os.utime(path, (then, then))
    start = time.time()
    written.write_text("- another rank's\n")  # rewritten by this job already: not the earlier run's
    errors.keep_earlier_run_files(run, since=start)
    saved.write_text("model: {vocab_size: null}\n")  # Hydra's files of the refused start
    written.write_text("- model.vocab_size=null\n")
    with log.open("a") as f:
        f.write("[resume] refused\n")
    try:
        remove_partial_run_dir(run, since=start)
    finally:
        errors._EARLIER_HYDRA.clear()
        errors._EARLIER_LOG.clear()
    assert saved.read_text() == "model: {vocab_size: 512}\n" and saved.stat().st_mtime == then
    assert log.read_text() == "[step 8] the earlier run\n" and log.stat().st_mtime == then
    if checkpoints:  # a refused resume's own files stay; without checkpoints this start's files are removed
        assert written.read_text() == "- model.vocab_size=null\n" and (run / "checkpoints").is_dir()
    else:
        assert not written.exists()


def test_an_unwritable_run_dir_is_one_line():
    """Hydra opening run_dir/train.log where it cannot write (a read-only mount, chmod 555) raised logging's
    'Unable to configure handler' with the OSError as its cause: one run_dir line now."""
    from fp8_recipes.training.errors import one_line

    try:
        try:
            raise PermissionError(13, "Permission denied", "/ro/run/train.log")
        except PermissionError as cause:
            raise ValueError("Unable to configure handler 'file'") from cause
    except ValueError as e:
        line = one_line(e)
    assert line == ("run_dir: cannot write '/ro/run/train.log' (Permission denied); set run_dir to a writable "
                    "directory")
    assert one_line(ValueError("Unable to configure handler 'file'")) is None  # (no OSError cause: not this)

    def multirun():  # (Hydra.multirun: -m, whose jobs' directories are under hydra.sweep.dir)
        try:
            raise PermissionError(13, "Permission denied", "/ro/sweep/0/train.log")
        except PermissionError as cause:
            raise ValueError("Unable to configure handler 'file'") from cause

    try:
        multirun()
    except ValueError as e:
        assert one_line(e) == ("hydra.sweep.dir: cannot write '/ro/sweep/0/train.log' (Permission denied); set "
                               "hydra.sweep.dir to a writable directory")


def test_half_of_torchruns_pair_is_warned(monkeypatch, capsys):
    from fp8_recipes.launcher import check_launch_env

    for k in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(k, raising=False)
    check_launch_env()
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("WORLD_SIZE", "2")
    check_launch_env()
    assert capsys.readouterr().err.startswith("warning: WORLD_SIZE=2 is set without RANK: not torchrun's")


def test_an_error_reads_once_per_launch_and_one_ranks_own_error_is_not_lost(monkeypatch, capsys):
    """Rank 0 prints at once; another rank, after QUIET_RANK_DELAY_S, only lines no rank of the launch printed (its
    own error: a shard of a damaged checkpoint, say), with its rank; the ranks count in the process group's store
    (another launch has another store); one process always prints; without a store rank 0 alone prints."""
    import torch.distributed as dist

    from fp8_recipes.training import errors

    slept = []
    store = dist.HashStore()  # (the launch's store: what _launch_store returns after init_process_group)
    monkeypatch.setattr(errors, "_launch_store", lambda: store)
    monkeypatch.setattr(errors.time, "sleep", slept.append)
    for key, value in {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"}.items():
        monkeypatch.setenv(key, value)

    def as_rank(rank: int, *lines: str) -> str:
        monkeypatch.setenv("RANK", str(rank))
        errors.print_error_once(list(lines))
        return capsys.readouterr().err

    assert as_rank(0, "model.hidden_size: 7 is not a multiple of 16") == \
        "error: model.hidden_size: 7 is not a multiple of 16\n" and slept == []
    assert as_rank(1, "model.hidden_size: 7 is not a multiple of 16") == "" and slept == [errors.QUIET_RANK_DELAY_S]
    assert as_rank(1, "checkpoint: shard 3 is damaged") == "error: checkpoint: shard 3 is damaged (rank 1)\n"
    assert as_rank(0, "checkpoint: shard 3 is damaged") == ""  # (the launch has read it)
    store = dist.HashStore()  # another launch
    assert as_rank(1, "checkpoint: shard 3 is damaged") == "error: checkpoint: shard 3 is damaged (rank 1)\n"
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert as_rank(0, "x") == as_rank(0, "x") == "error: x\n"  # (one process: no counter)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(errors, "_launch_store", lambda: None)  # (before init_process_group)
    assert as_rank(0, "y") == "error: y\n" and as_rank(1, "y") == "" and as_rank(0, "y") == "error: y\n"
    assert errors._launch_store is not None and dist.is_initialized() is False
