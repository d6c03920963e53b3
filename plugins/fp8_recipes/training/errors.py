"""User errors of scripts/train.py as one line each: ``error: <dotted.key>: <what is wrong>; <the fix>``.

    with hydra_errors_as_one_line():   # around the @hydra.main function: composition errors, run-dir creation
        main()

Hydra reports its own errors (an unknown key, a missing group option, a bad override) in several lines, and an
unwritable run directory as a traceback; here each becomes one line naming the key, exit code 2. Errors from
inside the training job are split: a user error (``checks.ConfigError``, raised where the config, recipe, data or
checkpoint is checked) is one ``error:`` line; anything else is a bug and keeps its traceback in the run's train.log
(``report_internal_error``), with one console line saying where. Imports neither torch nor Hydra at module level.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Iterable, Iterator

from fp8_recipes.checks import clipped, did_you_mean
from fp8_recipes.launcher import launch_rank, launch_world_size
from fp8_recipes.rundir import (HYDRA, RUN_OUTPUTS, TRAIN_LOG, RunDirError, check_run_dir, held_by_another,
                                release)

__all__ = ["script_user_errors", "CHECKPOINT_WRITE_EXIT", "CheckpointWriteError", "ConsoleFormatter", "INTERNAL_ERROR_EXIT", "NonFiniteStop", "USER_ERROR_EXIT", "NONFINITE_EXIT", "PREEMPTED_EXIT",
           "RunDirCheck", "hydra_errors_as_one_line", "worker_hydra_overrides", "keep_earlier_run_files", "one_line", "print_error_once",
           "remove_empty_dirs", "remove_partial_run_dir", "remove_written", "report_internal_error"]

INTERNAL_ERROR_EXIT = 1  # a bug (not a config error): the traceback is in run_dir/train.log, the outputs are kept
USER_ERROR_EXIT = 2  # a bad config, recipe or command line: nothing was run
NONFINITE_EXIT = 3   # training stopped on non-finite losses or gradients (trainer.on_nonfinite)
PREEMPTED_EXIT = 4   # SIGTERM/SIGUSR1: checkpointed after the current step, not finished: requeue, resume=auto
CHECKPOINT_WRITE_EXIT = 5  # writing a checkpoint failed (disk full, file size limit): outputs kept, resume=auto

_PACKAGE = str(Path(__file__).resolve().parents[1])
_IMPORTED_AT = time.time()  # scripts/train.py imports this module before Hydra creates run_dir


class ConsoleFormatter(logging.Formatter):
    """The console's log lines (conf/train.yaml's hydra.job_logging): the message alone, a warning as
    ``warning: <message>``; train.log keeps Hydra's timestamped lines."""

    def format(self, record: logging.LogRecord) -> str:
        message = super().format(record)
        return f"{record.levelname.lower()}: {message}" if record.levelno >= logging.WARNING else message


class NonFiniteStop(RuntimeError):
    """The run stopped on non-finite losses or gradients (``trainer.on_nonfinite``); ``str()`` is one line."""


class CheckpointWriteError(RuntimeError):
    """Writing ``step_dir`` failed with an OS error on some rank (a full disk, a file size limit). Not a ConfigError:
    the run's outputs so far stay (scripts/train.py removes a failed start's). Every rank raises it together
    (checkpoint.save_checkpoint agrees on the failure), after rank 0 removed the half-written temporary directory;
    ``latest`` still names ``previous`` (a ``step_N`` name, or None when there was no checkpoint yet). ``key`` is
    the setting that asked for the save (the loop sets it); ``str()`` is one line."""

    def __init__(self, step_dir: str | os.PathLike, reason: str, previous: str | None,
                 key: str = "trainer.save_checkpoints") -> None:
        super().__init__(reason)
        self.step_dir, self.reason, self.previous, self.key = Path(step_dir), reason, previous, key

    def __str__(self) -> str:
        then = f"which continues from {self.previous}" if self.previous else "which starts again from step 0 (no " \
            "earlier checkpoint)"
        return (f"{self.key}: writing checkpoint {self.step_dir} failed: {self.reason}; free space on its file "
                f"system (or raise the file size limit) and continue with trainer.resume=auto, {then}")


def _first_line(text: str) -> str:
    return next((line.strip() for line in str(text).splitlines() if line.strip()), "")


def _omegaconf_line(e: BaseException) -> str:
    key = getattr(e, "full_key", None) or "(config)"
    if key in ("hydra.run.dir", "hydra.sweep.dir") and "${run_dir}" in str(e):  # (run_dir=null, run_dir=[...])
        return "run_dir: must be a directory path (e.g. run_dir=runs/mine); it was given no path"
    return f"{key}: {_first_line(str(e))}"


def one_line(e: BaseException) -> str | None:
    """The one-line form of a Hydra/OmegaConf user error, or None when ``e`` is not one (re-raise it)."""
    from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

    if isinstance(e, MissingConfigException):
        missing = str(e.missing_cfg_file or "")
        group, _, name = missing.rpartition("/")
        if "/" in group:  # (model=/path/x.yaml: Hydra read the path as a nested group)
            top = group.split("/", 1)[0]
            return (f"{top}: {missing.removeprefix(top + '/')!r} is a path; {top}= takes an option name of the {top} "
                    f"group (put your own file in a folder DIR/{top}/NAME.yaml and add "
                    f"hydra.searchpath=[file://DIR], then {top}=NAME)")
        if group and e.options:
            return (f"{group}: {name!r} is not an option of the {group} group{did_you_mean(name, e.options)}; "
                    f"choose one of {', '.join(e.options)}")
        return f"{missing or '(config)'}: {_first_line(str(e))}; check the group name (model, data, trainer, recipe)"
    if isinstance(e, OverrideParseException):
        key = str(e.override).split("=", 1)[0].lstrip("+~") or "(override)"
        return f"{key}: cannot parse the override {e.override!r}: {_first_line(e.message)}; quote values with " \
               f"commas or brackets, e.g. {key}='a,b'"
    if isinstance(e, ConfigCompositionException):
        msg, cause = str(e), e.__cause__
        quoted = re.findall(r"'([^']+)'", msg)
        key = getattr(cause, "full_key", None) or (quoted[0].split("=", 1)[0].lstrip("+~") if quoted else "(config)")
        if "Could not override" in msg and isinstance(cause, (ConfigKeyError, ConfigAttributeError)):
            parent = getattr(cause, "parent_node", None)
            known = list(parent.keys()) if hasattr(parent, "keys") else []
            leaf = key.rsplit(".", 1)[-1]
            append = re.search(r"use (\+\S+)", msg)
            return (f"{key}: not in the config{did_you_mean(leaf, known)}; fix the spelling, or add it "
                    f"with {append.group(1) if append else f'+{key}=VALUE'}")
        if "No match in the defaults list" in msg:
            return f"{key}: not in the defaults list; add the group with +{key}=NAME"
        if "Ambiguous value" in msg:
            value = quoted[0].split("=", 1)[1] if quoted and "=" in quoted[0] else "a,b"
            as_list = "" if key in _TEXT_WITH_COMMAS else f", or write a list, {key}=[{value}]"
            return f"{key}: {value!r} has commas: quote it as a string, {key}='{value}'{as_list}"
        if "An item is already at" in msg:
            return f"{key}: already in the config; set it without '+': {key}=VALUE"
        if "Error merging override" in msg and cause is not None and "Cannot merge" in str(cause):
            return _merge_kind_line(key, cause)
        return f"{key}: {_first_line(msg)}"
    if isinstance(e, OmegaConfBaseException):
        return _omegaconf_line(e)
    if isinstance(e, ValueError) and "Config group override must be a string" in str(e):
        return _group_value_line()
    if isinstance(e, ValueError) and "Unable to configure handler 'file'" in str(e) and \
            isinstance(e.__cause__, OSError):  # Hydra opening run_dir/train.log in a directory it cannot write
        cause, key = e.__cause__, _output_dir_key(e)
        return (f"{key}: cannot write {cause.filename or 'train.log'!r} ({cause.strerror or type(cause).__name__}); "
                f"set {key} to a writable directory")
    if isinstance(e, UnicodeDecodeError) or (isinstance(e, OSError) and "Invalid loaded object type" in str(e)):
        return _unreadable_group_line(e)  # (Hydra loading a group's file: binary, or a scalar / list, not a mapping)
    if isinstance(e, OSError) and not _raised_in_task(e):  # Hydra creating run_dir (or the sweep's) and its .hydra
        key = _output_dir_key(e)
        return (f"{key}: cannot create {str(e.filename or key)!r} ({e.strerror or type(e).__name__}); set {key} to a "
                f"writable directory")
    return None


def _output_dir_key(e: BaseException) -> str:
    """The key of the directory Hydra was setting up when ``e`` was raised: under a multirun (-m) Hydra writes the
    jobs' .hydra/ and logs under hydra.sweep.dir, its own key (run_dir then holds only what the run writes); a
    run's is run_dir (conf/train.yaml: hydra.run.dir is ${run_dir})."""
    return "hydra.sweep.dir" if any(code.co_name == "multirun" for code in _frames(e)) else "run_dir"


def _command_line_overrides() -> list[tuple[str, Any]]:
    """(key, value) of each command-line override, as Hydra's own parser reads it (those it cannot parse left
    out: Hydra reports them); a group option's key is the group (``model@pkg=x``: ``model``)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser, out = OverridesParser.create(), []
    for arg in sys.argv[1:]:
        if arg.startswith("-"):
            continue
        try:
            override = parser.parse_overrides([arg])[0]
            out.append((override.key_or_group, override.value()))
        except Exception:  # noqa: BLE001 - not an override Hydra can read: it says so itself
            continue
    return out


_TEXT_WITH_COMMAS = ("data.split",)
"""Keys whose value is one string with commas (Megatron's split weights): a list is no way to write them."""


def _group_options(group: str) -> list[str]:
    from fp8_recipes.recipe.pack import conf_dir, recipes_dir, search_path_roots

    where = [recipes_dir()] if group == "recipe" else [conf_dir() / group]
    where += [root / group for root in search_path_roots(sys.argv[1:])]
    return sorted({p.stem for d in where if d.is_dir() for p in d.glob("*.yaml")})


def _group_value_line() -> str:
    """A config group given a value that is no option name (``model=null``, ``autopilot=true``, ``model=1``):
    Hydra's message names neither the group nor the value."""
    given = [(k, v) for k, v in _command_line_overrides() if "." not in k and not isinstance(v, (str, list))]
    if not given:
        return "(group): a config group was given a value that is no option name; give it one, e.g. model=tiny"
    group, value = given[0][0].lstrip("+~"), given[0][1]
    shown = "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
    options = _group_options(group)
    pick = f"choose one of {', '.join(options)}" if options else "give the group an option name"
    plus = "+" if group == "recipe" else ""
    return f"{group}: {shown} is not an option of the {group} group; {pick} (e.g. {plus}{group}=NAME)"


def _unreadable_group_line(e: BaseException) -> str:
    """A chosen group option whose file is not a YAML mapping of UTF-8 text: the group and file it is, found by
    reading each chosen option's file on the search path (the package's conf/, ``hydra.searchpath``,
    ``--config-dir``) through the guarded YAML reader."""
    from fp8_recipes.recipe.pack import conf_dir, search_path_roots
    from fp8_recipes.recipe.yaml_guard import UnsafeYAML, load_yaml

    roots = [conf_dir(), *search_path_roots(sys.argv[1:])]
    for group, name in ((k, v) for k, v in _command_line_overrides() if "." not in k and isinstance(v, str)):
        for path in (root / group / f"{name}.yaml" for root in roots):
            try:
                if not path.is_file():
                    continue
                data = load_yaml(path.read_bytes(), source=str(path))
            except (UnsafeYAML, OSError) as bad:
                return f"{group}: {path}: {_first_line(str(bad))}; or choose another {group}"
            if not isinstance(data, dict):
                return (f"{group}: {path} holds {type(data).__name__} {data!r:.40}, not a mapping of keys; fix the "
                        f"file or choose another {group}")
    return (f"(config): a config file of the chosen groups is not a YAML mapping of UTF-8 text "
            f"({_first_line(str(e))}); check the files of the groups on the command line")


def _merge_kind_line(key: str, cause: BaseException) -> str:
    """An override of the wrong kind (a mapping where the config has a list, or the other way): OmegaConf's
    message says 'DictConfig with ListConfig' either way, so the kind comes from the override's own value."""
    value = next((v for k, v in _command_line_overrides() if k.lstrip("+~") == key), None)
    want = "a list [a, b]" if isinstance(value, dict) else "a mapping {k: v}"
    return f"{key}: cannot merge {type(value).__name__ if value is not None else 'this value'} into it; give {key} " \
           f"{want}, as the config has it"


def _frames(e: BaseException) -> Iterator[Any]:
    """The code objects of ``e``'s traceback, outermost first."""
    tb = e.__traceback__
    while tb is not None:
        yield tb.tb_frame.f_code
        tb = tb.tb_next


def _raised_in_task(e: BaseException) -> bool:
    """Whether ``e`` came from the task function (our code) rather than from Hydra setting the run up."""
    # (Hydra's own wrapper of the task function is `decorated_main`)
    return any((code.co_filename.startswith(_PACKAGE) and code.co_filename != __file__) or code.co_name == "main"
               for code in _frames(e))


@contextlib.contextmanager
def hydra_errors_as_one_line() -> Iterator[None]:
    """Around a ``@hydra.main`` function: Hydra's user errors become ``error: ...`` and exit 2. With
    HYDRA_FULL_ERROR=1 already set by the user, everything is left as Hydra reports it."""
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        yield
        return
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra then raises its errors instead of printing them itself
    try:
        yield
    except Exception as e:  # noqa: BLE001 - classified below; anything else is re-raised with its traceback
        line = one_line(e)
        if line is None:
            raise
        print_error_once([line])  # under torchrun/srun every rank composes the same config
        sys.exit(USER_ERROR_EXIT)



@contextlib.contextmanager
def script_user_errors() -> Iterator[None]:
    """Around a script's work: a user error (a ValueError such as a RecipeError or ConfigError, or a Hydra
    composition error) becomes one ``error:`` line and exit 2; anything else propagates with its traceback."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - classified below
        line = str(e).splitlines()[0] if isinstance(e, ValueError) and str(e) else one_line(e)
        if line is None:
            raise
        print(clipped(f"error: {line}"), file=sys.stderr)
        sys.exit(USER_ERROR_EXIT)


def report_internal_error(e: BaseException, run_dir: str | os.PathLike) -> str:
    """Append ``e``'s traceback to ``run_dir/train.log`` (Hydra's log of the run) and return the one console line
    saying where: ``internal error: <Type>: <message>; traceback in <run_dir>/train.log``. Nothing is removed."""
    log = Path(run_dir) / "train.log"
    text = "".join(traceback.format_exception(e))
    rank = launch_rank()
    try:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "a", encoding="utf-8") as f:
            f.write(f"internal error on rank {rank}:\n{text}")
    except OSError:  # the run directory itself is gone or unwritable: the traceback goes to the console then
        print(text, file=sys.stderr, end="")
        return f"internal error: {type(e).__name__}: {_first_line(str(e))} (rank {rank}; traceback above)"
    return f"internal error: {type(e).__name__}: {_first_line(str(e))}; traceback in {log}" + \
        (f" (rank {rank})" if rank else "")

QUIET_RANK_DELAY_S = 5.0
"""How long a rank other than 0 waits before it prints (or not) and leaves: rank 0 claims an error every rank
raises alike first, and torchrun stops the other workers as soon as one exits, so a rank that left at once would
cut rank 0 off before its line."""


def print_error_once(lines: list[str]) -> None:
    """``error: <line>`` on stderr once per launch. Rank 0 prints at once. Another rank waits QUIET_RANK_DELAY_S,
    then prints (with ``(rank N)``) only lines no rank has printed: an error every rank raises alike (a config)
    reads once, and one a single rank raises (its shard of a damaged checkpoint) is not lost while the others wait
    for it in a collective. The ranks agree through the process group's store (one counter per error, every node
    alike); before the process group exists every rank raises what rank 0 does, and rank 0 alone prints."""
    rank = launch_rank()
    if rank != 0:
        time.sleep(QUIET_RANK_DELAY_S)
    if not _first_to_print(lines, rank):
        return
    for line in lines:
        print(clipped(f"error: {line}") + (f" (rank {rank})" if rank else ""), file=sys.stderr, flush=True)


def _first_to_print(lines: list[str], rank: int) -> bool:
    """Whether this rank is the first of its launch to print `lines`: the first to add to their counter in the
    default process group's store (torchrun's or srun's rendezvous store, shared by every rank and gone with the
    launch). One process always prints; without a process group, or if the store fails, rank 0 alone prints."""
    if launch_world_size() == 1:
        return True
    store = _launch_store()
    if store is None:
        return rank == 0
    key = "fp8-recipes/error/" + hashlib.blake2b("\n".join(lines).encode(), digest_size=12).hexdigest()
    try:
        return store.add(key, 1) == 1
    except Exception:  # noqa: BLE001 - a store gone with a rank that left: print as before the counters did
        return rank == 0


def _launch_store():
    """The default process group's store, or None before init_process_group (or without torch.distributed)."""
    try:
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store() if dist.is_available() and dist.is_initialized() else None
    except Exception:  # noqa: BLE001 - no distributed build: one process's behaviour
        return None


WORKER_HYDRA_OVERRIDES = ("hydra.run.dir=.", "hydra.output_subdir=null", "~hydra.job_logging.handlers.file",
                          "hydra.job_logging.root.handlers=[console]")


def worker_hydra_overrides() -> list[str]:
    """Hydra overrides for a launched job's ranks other than 0: Hydra creates neither run_dir, nor its ``.hydra/``,
    nor a train.log handler there (their messages go to the console; an internal error's traceback is still appended
    to train.log). Every rank once did, each at its own pace: a refused fresh start's clean-up by one rank raced
    another rank still creating them (a run dir left behind, or a logging traceback for the vanished directory).
    The working directory (``.``) is where Hydra puts nothing: it exists, and no output_subdir is written."""
    return list(WORKER_HYDRA_OVERRIDES) if launch_rank() != 0 else []


class RunDirCheck:
    """Hydra callback (conf/train.yaml ``hydra.callbacks``): refuses a start that rundir.check_run_dir refuses (another
    running job holds run_dir; a fresh start into a directory holding another run) before Hydra writes its .hydra/
    and train.log there, so the other run's files stay as they were."""

    def on_run_start(self, config, **kwargs) -> None:
        try:
            run_dir, resume = str(config.run_dir), config.trainer.get("resume")
        except Exception:  # noqa: BLE001 - a config error: run_training reports it with its key
            return
        try:
            check_run_dir(run_dir, fresh=resume is None)
        except RunDirError as e:  # (Hydra turns a callback's exception into a warning: leave from here)
            print_error_once([str(e)])
            sys.exit(USER_ERROR_EXIT)
        keep_earlier_run_files(run_dir)

    def __getattr__(self, name: str):
        if name.startswith("on_"):  # Hydra calls every hook of a callback; only on_run_start matters here
            return lambda **kwargs: None
        raise AttributeError(name)


_EARLIER_HYDRA: dict[Path, tuple[bytes, float]] = {}  # .hydra/ files of an earlier job: (contents, mtime)
_EARLIER_LOG: dict[Path, tuple[int, float]] = {}  # train.log of an earlier job: (size, mtime) before this start


def keep_earlier_run_files(run_dir: str | os.PathLike, since: float = _IMPORTED_AT) -> None:
    """Before Hydra rewrites them (RunDirCheck): remember the ``.hydra/`` files an earlier job wrote into ``run_dir``
    (modified before ``since``: a resumed run's config) and the size of its ``train.log``, so that a refused start
    puts the files back and cuts the log's new lines (:func:`remove_partial_run_dir`), and a refused resume's advice,
    "its run dir's .hydra/config.yaml", still names the config the run was saved with. A file another rank of this
    job wrote already is not one of them."""
    for path in Path(run_dir, HYDRA).glob("*"):
        with contextlib.suppress(OSError):
            mtime = path.stat().st_mtime
            if path.is_file() and mtime < since - 1.0:  # (1 s: coarse file-system clocks)
                _EARLIER_HYDRA[path] = (path.read_bytes(), mtime)
    log = Path(run_dir, TRAIN_LOG)
    with contextlib.suppress(OSError):
        if log.is_file() and (stat := log.stat()).st_mtime < since - 1.0:
            _EARLIER_LOG[log] = (stat.st_size, stat.st_mtime)


def _put_back_earlier_run_files() -> None:
    for path, (contents, mtime) in _EARLIER_HYDRA.items():
        with contextlib.suppress(OSError):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(contents)
            os.utime(path, (mtime, mtime))
    for path, (size, mtime) in _EARLIER_LOG.items():  # the refused start's lines, appended by Hydra's log handler
        with contextlib.suppress(OSError):
            if path.stat().st_size > size:
                os.truncate(path, size)
                os.utime(path, (mtime, mtime))


def remove_partial_run_dir(run_dir: str | os.PathLike, since: float = _IMPORTED_AT) -> None:
    """After a failed start: remove what Hydra and this run wrote into ``run_dir`` (modified at or after ``since``;
    never other files, an earlier run's outputs, a run with checkpoints, or a directory another running job holds),
    put back the ``.hydra/`` files of an earlier run that Hydra rewrote and cut its train.log to what it held
    (:func:`keep_earlier_run_files`), then
    remove the directory when empty. Under torchrun/srun only the launcher's rank 0 removes: it alone let Hydra
    write into ``run_dir`` (:func:`worker_hydra_overrides`), so it removes after its own last write, and no other
    rank writes there after it."""
    run_dir = Path(run_dir)
    if launch_rank() != 0:  # the other ranks wrote nothing here (worker_hydra_overrides); removing while rank 0's
        return  # Hydra is still writing left its files behind, or its log handler without a directory
    if not run_dir.is_dir() or held_by_another(run_dir):
        return
    if (run_dir / "checkpoints").exists():  # a refused resume: its outputs stay, its config as it was
        _put_back_earlier_run_files()
        return
    release(run_dir)  # this process's lock, if it took one
    # (an earlier run's train.log is cut back to its own lines instead)
    remove_written([run_dir / name for name in RUN_OUTPUTS if run_dir / name not in _EARLIER_LOG], since)
    _put_back_earlier_run_files()
    remove_empty_dirs(run_dir, since)


def remove_written(paths: Iterable[str | os.PathLike], since: float = _IMPORTED_AT) -> None:
    """Each of ``paths`` (a file or a directory tree) modified at or after ``since``: what a failed start wrote.
    Older ones stay, missing ones are skipped."""
    for p in map(Path, paths):
        try:
            if p.stat().st_mtime < since - 1.0:  # (1 s: coarse file-system clocks)
                continue
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
        except FileNotFoundError:  # not written, or another rank removed it first
            continue


def remove_empty_dirs(directory: str | os.PathLike, since: float = _IMPORTED_AT) -> None:
    """``directory`` when empty, then the parents made for it (runs/ in a fresh checkout): empty, changed at or
    after ``since``, below the working directory. What a failed start made and left empty goes; nothing else."""
    directory = Path(directory)
    with contextlib.suppress(OSError):
        directory.rmdir()  # only when empty
    cwd = Path.cwd().resolve()
    with contextlib.suppress(OSError):  # (another rank may be removing them too)
        for parent in directory.resolve().parents:
            if cwd not in parent.parents or any(parent.iterdir()) or parent.stat().st_mtime < since - 1.0:
                break
            parent.rmdir()
