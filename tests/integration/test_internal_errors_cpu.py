"""Internal failures are not dressed as config errors (issue 19): scripts/train.py prints a user error
(checks.ConfigError, raised where the config is checked) as one `error:` line and removes what the failed start
wrote; anything else keeps its traceback in run_dir/train.log, says so in one console line, exits 1 and leaves the
run's outputs for inspection. In-process: scripts/train.py's Hydra main called with a composed config."""

from __future__ import annotations

import importlib.util
import signal

import pytest

from fp8_recipes.checks import ConfigError
from test_train_cpu import ROOT, compose_train, dataset, small_run  # noqa: F401  (dataset: the shared fixture)

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def _train_script():
    spec = importlib.util.spec_from_file_location("train_script", ROOT / "scripts" / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(tmp_path, dataset, monkeypatch, raised: Exception) -> int:  # noqa: F811
    from fp8_recipes.training import loop

    def planted(*args, **kwargs):  # deep inside training, after the run's files were written
        kwargs["on_ready"]()  # the loop writes them once the checkpoint (if any) is loaded
        raise raised

    monkeypatch.setattr(loop, "train", planted)
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # _exit_written ignores SIGTERM: not in pytest's process
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)
    cfg = compose_train(["+recipe=tensorwise", *dataset, *small_run(tmp_path / "run", num_layers=1, steps=2)])
    with pytest.raises(SystemExit) as e:
        _train_script().main(cfg)
    return e.value.code


def test_internal_error_keeps_its_traceback_and_the_outputs(tmp_path, dataset, monkeypatch, capsys):  # noqa: F811
    code = _run(tmp_path, dataset, monkeypatch, ValueError("planted: not a config error"))
    run = tmp_path / "run"
    err = [ln for ln in capsys.readouterr().err.splitlines() if "error" in ln]
    assert code == 1
    assert err == [f"internal error: ValueError: planted: not a config error; traceback in {run / 'train.log'}"]
    log = (run / "train.log").read_text()
    assert "Traceback (most recent call last)" in log and "in planted" in log
    assert (run / "plan.txt").is_file() and (run / "recipe.yaml").is_file()  # left for inspection


def test_user_error_is_one_line_and_removes_the_start(tmp_path, dataset, monkeypatch, capsys):  # noqa: F811
    code = _run(tmp_path, dataset, monkeypatch, ConfigError("trainer.x=1: planted; set it to 2"))
    err = [ln for ln in capsys.readouterr().err.splitlines() if "error" in ln]
    assert code == 2 and err == ["error: trainer.x=1: planted; set it to 2"]
    assert not (tmp_path / "run" / "plan.txt").exists()
