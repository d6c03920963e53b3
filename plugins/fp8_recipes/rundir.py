"""A run directory's files: their names and how they are read and written, in one place.

    run_dir/
      .hydra/                 Hydra's composed config of the run (config.yaml, overrides.yaml)
      train.log               the log, with timestamps (Hydra's job logging)
      plan.txt                the resolved per-layer precision plan (``explain``)
      recipe.yaml             the resolved recipe the run trained with
      metrics.jsonl           one JSON object per row: ``{"kind": "train" | "eval", "step": N, ...}``
      numerics.jsonl          statistics (debug.interval); a pipelined run adds numerics.stageN.jsonl per stage
      routing.jsonl           an MoE model's tokens per expert per step and layer (observe/routing.py)
      tb/                     TensorBoard
      summary.json            the run's results (written atomically, at the end and on a stop)
      loss.png                train and validation loss
      checkpoints/step_N/     checkpoints (training/checkpoint.py)

Training writes these files; the doctor, the benchmarks, the Slurm launcher and evaluation read them.

A run directory has one owner (docs/distributed.md, "what is guaranteed"): the default name is unique per job
(``default_run_name``: every rank of a launched job derives the same one, two jobs never share it) and holds no path
from the recipe name; a running run holds ``.lock`` (``claim``); a fresh start into a directory that holds another
run's results, and any start in a directory inside another run's outputs (its checkpoints/), is refused in one line;
a resumed run drops the metrics and numerics rows past its checkpoint (``drop_rows_after``), so every step keeps one
row across kill -9 and resume. Imports nothing of ours but the guarded YAML reader and the recipe's roles (neither
torch nor Hydra): any floor may use it.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import math
import os
import re
import socket
import time
import unicodedata
from pathlib import Path
from typing import Any, Mapping, NamedTuple

from fp8_recipes.checks import ConfigError
from fp8_recipes.recipe.schema import ROLES
from fp8_recipes.recipe.yaml_guard import load_yaml

__all__ = [
    "CHECKPOINTS",
    "HYDRA",
    "LOSS_PLOT",
    "MAX_ROW_STEP",
    "MAX_TOKENS",
    "METRICS",
    "NUMERICS",
    "PLAN",
    "RECIPE",
    "RUN_OUTPUTS",
    "SUMMARY",
    "TENSORBOARD",
    "TRAIN_LOG",
    "RunFileError",
    "json_number",
    "jsonable",
    "last_metrics_step",
    "load_run_config",
    "numerics_files",
    "numerics_name",
    "read_jsonl",
    "read_metrics",
    "read_numerics",
    "read_recipe",
    "read_routing",
    "read_summary",
    "step_problem",
    "write_summary",
    "write_text",
]

HYDRA = ".hydra"
TRAIN_LOG = "train.log"
PLAN = "plan.txt"
RECIPE = "recipe.yaml"
METRICS = "metrics.jsonl"
NUMERICS = "numerics.jsonl"
ROUTING = "routing.jsonl"
TENSORBOARD = "tb"
SUMMARY = "summary.json"
LOSS_PLOT = "loss.png"
CHECKPOINTS = "checkpoints"
LOCK = ".lock"

logger = logging.getLogger("fp8_recipes")

RUN_OUTPUTS = (HYDRA, TRAIN_LOG, PLAN, RECIPE, METRICS, TENSORBOARD, SUMMARY, LOSS_PLOT)
"""What Hydra and a run write into run_dir besides checkpoints and statistics: a run that failed on its input loses
exactly these (training/errors.py: remove_partial_run_dir), nothing else."""


RESULTS = (PLAN, RECIPE, METRICS, NUMERICS, TENSORBOARD, SUMMARY, CHECKPOINTS)
"""What marks a directory as holding a run (not Hydra's .hydra/ and train.log: Hydra writes them before any check)."""


class RunDirError(ConfigError):
    """The run directory belongs to another run; ``str()`` is one line naming run_dir and the fix."""


class RunFileError(ConfigError):
    """A line of a run's JSONL file that is not a JSON object (or a file that is not UTF-8 text: ``line`` None);
    ``str()`` names the file and the line."""

    def __init__(self, path: Path, line: int | None, msg: str, what: str = "JSON"):
        super().__init__(f"{path}{'' if line is None else f' line {line}'} is not {what} ({msg})")
        self.path, self.line, self.msg = path, line, msg


def overwrite_problem(path: str | os.PathLike) -> str | None:
    """Why writing the file ``path`` would destroy something, or None: an existing path that is no regular file
    (a device, a socket, a fifo), or a file a training run wrote (a run directory's outputs, statistics or
    checkpoints; other files there, e.g. an earlier parity.json, may be rewritten)."""
    p = Path(path)
    if not (p.exists() or p.is_symlink()):
        return None
    if not p.is_file() and not p.is_dir():
        return "exists and is not a regular file"
    inside = _in_run_outputs(p)
    return f"is {inside[1]} of the run in {inside[0]}, which this would overwrite" if inside else None


def _in_run_outputs(path: str | os.PathLike) -> tuple[Path, Path] | None:
    """(the run directory, the part of ``path`` below it) when ``path``, existing or not, lies inside what a run
    wrote into its directory (its outputs, statistics, checkpoints or lock), else None. Only the nearest run
    directory above ``path`` counts: other files and folders there (an evaluation's parity.json) are nobody's run."""
    full = Path(path).resolve()
    for parent in full.parents:
        if (parent / METRICS).is_file() or (parent / HYDRA).is_dir():  # a run directory
            top = full.relative_to(parent).parts[0]
            if top in (*RUN_OUTPUTS, CHECKPOINTS, LOCK) or top.startswith(("numerics", "routing")):
                return parent, full.relative_to(parent)
            break
    return None


def jsonable(value: Any) -> Any:
    """``value`` as JSON can hold it: JSON has no NaN/inf, so they stay visible as strings rather than invalid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def read_jsonl(path: str | os.PathLike, check=None) -> list[dict[str, Any]]:
    """Every row of a JSONL file (blank lines skipped); RunFileError at the first line that is not a JSON object,
    or when the file is not UTF-8 text or cannot be read (a directory in its place), or whose row ``check``
    (row -> a problem or None) finds wrong. A missing file stays FileNotFoundError: callers poll for it."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise RunFileError(path, None, f"{e.reason} at byte {e.start}", what="UTF-8 text") from None
    except FileNotFoundError:
        raise
    except OSError as e:  # (a directory, no permission): say what is there, not that the file is missing
        why = "it is a directory" if path.is_dir() else e.strerror or type(e).__name__
        raise RunFileError(path, None, why, what="a readable file") from None
    rows = []
    for i, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise RunFileError(path, i, e.msg) from None
            if not isinstance(row, dict):
                raise RunFileError(path, i, f"a {type(row).__name__}", what="a JSON object")
            problem = check(row) if check is not None else None
            if problem:
                raise RunFileError(path, i, problem, what="a row of statistics")
            rows.append(row)
    return rows


def read_metrics(run_dir: str | os.PathLike, kind: str | None = None) -> list[dict[str, Any]]:
    """All rows of ``run_dir/metrics.jsonl`` (optionally only one ``kind``)."""
    return [r for r in read_jsonl(Path(run_dir) / METRICS) if kind is None or r.get("kind") == kind]


def last_metrics_step(run_dir: str | os.PathLike) -> int | None:
    """The step of the last metrics row, reading only the file's tail (a progress bar over a running run); None
    when there is none yet."""
    try:
        with open(Path(run_dir) / METRICS, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - 4096))
            last = f.read().splitlines()[-1]
        return int(json.loads(last)["step"])
    except (OSError, ValueError, IndexError, KeyError):
        return None


def numerics_name(stage: int | None) -> str:
    """The statistics file of pipeline stage ``stage`` (None or 0: numerics.jsonl): each stage's first rank writes its
    own modules' rows to its own file; module names are global, so the files read as one."""
    return NUMERICS if not stage else f"numerics.stage{stage}.jsonl"


def numerics_files(run_dir: str | os.PathLike) -> list[Path]:
    """A run's statistics files that exist, stage by stage: numerics.jsonl, numerics.stage1.jsonl, ..."""
    run_dir = Path(run_dir)
    stages = []
    for path in run_dir.glob("numerics.stage*.jsonl"):
        number = path.name.split(".")[1].removeprefix("stage")
        if number.isdigit():
            stages.append((int(number), path))
    first = run_dir / NUMERICS
    return ([first] if first.is_file() else []) + [p for _, p in sorted(stages)]


def read_numerics(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """Every row of the run's statistics (numerics.jsonl and, for a pipelined run, each stage's file); RunFileError
    at a row whose step, names or statistics have the wrong type, or a statistic a value it cannot take (a damaged
    or hand-edited file)."""
    return [row for path in numerics_files(run_dir) for row in read_jsonl(path, _numerics_row_problem)]


MAX_ROW_STEP = 10**12
"""The largest step a row of a run's files may hold. Training refuses a run of more than 2**31 - 1 samples
(training/config.py: MAX_SAMPLES), so no run reaches step 2**31: a step past this bound is a damaged or
hand-edited row (one of 10**30 was read as a step, and drawn)."""

MAX_TOKENS = 2**53
"""The largest token count a routing row may hold: a float holds every integer up to it, and no step routes
nearly as many (int 10**400 was an OverflowError in the heat map)."""


def step_problem(value: Any, low: int = 0) -> str | None:
    """Why `value` is no row's step, or None: "is ..., not ..." for an integer from `low` to MAX_ROW_STEP (1e9 in
    JSON is a float: not one)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        return f"is {value!r:.60}, not an integer >= {low}"
    if value > MAX_ROW_STEP:
        return f"is {value!r:.60}, more than any run takes (at most {MAX_ROW_STEP:,})"
    return None


_NAMES = ("module", "gemm", "role", "tensor", "policy")
_NOT_FINITE = ("nan", "inf", "-inf")  # how jsonable() writes them


class _Range(NamedTuple):
    """What a statistic can be (observe/stats.py's definitions): from `low` to `high`, give or take `slack`, and
    of the non-finite values only those the recorder can write (jsonable()'s names)."""

    low: float
    high: float = math.inf
    nonfinite: tuple[str, ...] = ()
    slack: float = 0.0

    def words(self) -> str:
        span = f"from {self.low:g} to {self.high:g}" if self.high < math.inf else f">= {self.low:g}"
        return f"a number {span}" + (f" (or {' / '.join(self.nonfinite)})" if self.nonfinite else "")


_PERCENT = _Range(0.0, 100.0)
"""Every ``*_pct``: a share of counted elements or blocks (never NaN or inf: counts over a count >= 1)."""

_STAT_RANGES = {
    "numel": _Range(0.0), "min_nonzero": _Range(0.0),  # (null for an all-zero tensor)
    "amax": _Range(0.0, nonfinite=("inf",)),  # max |x|, NaN ignored: inf when the tensor holds one
    "mse": _Range(0.0, nonfinite=("nan", "inf")),  # NaN or inf elements make it so
    # float32 dot products may round a cosine of about 1 past it, never by 0.01
    "cosine": _Range(-1.0, 1.0, ("nan",), slack=0.01),
    **{k: _Range(0.0, nonfinite=("nan", "inf")) for k in ("scale", "scale_min", "scale_median", "scale_ratio")},
}


def _stat_problem(key: str, value: Any) -> str | None:
    """Why statistic `key` of a row cannot be `value` (null passes), or None."""
    if value is None:
        return None
    number = json_number(value)
    if number is None:
        return f"{key!r} is {value!r:.60}, not a number"
    rule = _PERCENT if key.endswith("_pct") else _STAT_RANGES.get(key)
    if rule is None:
        return None
    if math.isnan(number) or math.isinf(number):
        ok = ("nan" if math.isnan(number) else str(number)) in rule.nonfinite
    else:
        ok = rule.low - rule.slack <= number <= rule.high + rule.slack
    return None if ok else f"{key!r} is {value!r:.60}, not {rule.words()}"


def _numerics_row_problem(row: dict[str, Any]) -> str | None:
    """What makes a statistics row unreadable, or None: an integer step, text names (a role of the recipe's), and
    elsewhere numbers (or null, or the strings jsonable() writes for NaN and inf) that the statistic can take
    (:data:`_STAT_RANGES`: a percentage above 100, a cosine of 2, a negative amax are a damaged row)."""
    problem = step_problem(row.get("step"))
    if problem:
        return f"'step' {problem}"
    for key, value in row.items():
        if key in _NAMES and not isinstance(value, str):
            return f"{key!r} is {value!r:.60}, not text"
        if key == "role" and value not in ROLES:
            return f"'role' is {value!r:.60}, not one of {' | '.join(ROLES)}"
        problem = None if key in (*_NAMES, "step") else _stat_problem(key, value)
        if problem:
            return problem
    return None


def read_routing(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """Every row of an MoE run's routing.jsonl ([] when there is none: a dense model); RunFileError when it cannot
    be read, or at a row whose step, layer, counts or weights have the wrong type, or whose counts are not one per
    expert of the run's model (.hydra/config.yaml's model.num_moe_experts, else the file's first row)."""
    path = Path(run_dir) / ROUTING
    if not (path.exists() or path.is_symlink()):
        return []
    return read_jsonl(path, _routing_row_check(_moe_experts(run_dir)))


def _moe_experts(run_dir: str | os.PathLike) -> int | None:
    """model.num_moe_experts of the run's composed config, or None when it cannot be read."""
    try:
        model = load_yaml((Path(run_dir) / HYDRA / "config.yaml").read_bytes()).get("model") or {}
    except (OSError, ValueError, AttributeError):
        return None
    experts = model.get("num_moe_experts") if isinstance(model, dict) else None
    return experts if isinstance(experts, int) and not isinstance(experts, bool) and experts > 0 else None


def json_number(value: Any) -> float | None:
    """`value` as a float when it is a JSON number or a string jsonable() writes for NaN and inf ("nan", "inf",
    "-inf"; not "NaN", " 1", "1e3": no writer of ours writes them), else None; an integer too large for a float
    is inf."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    if isinstance(value, str):
        return float(value) if value in _NOT_FINITE else None
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def _number(value: Any) -> bool:
    """A JSON number, or a string jsonable() writes for NaN and inf."""
    return json_number(value) is not None


def _routing_row_check(experts: int | None):
    """routing.jsonl's row check for read_jsonl (row -> a problem or None): integer step >= 1 (at most
    MAX_ROW_STEP) and layer >= 0, a count from 0 to MAX_TOKENS per expert, a weight (or null) per expert. Without
    `experts` the first row sets the count."""
    where = "model.num_moe_experts" if experts else "in the first row"

    def problem(row: dict[str, Any]) -> str | None:
        nonlocal experts
        layer, bad_step = row.get("layer"), step_problem(row.get("step"), 1)
        if bad_step:
            return f"'step' {bad_step}"
        if not isinstance(layer, int) or isinstance(layer, bool) or layer < 0:
            return f"'layer' is {layer!r:.60}, not an integer >= 0"
        tokens, weight = row.get("tokens"), row.get("weight")
        if not isinstance(tokens, list) or not tokens or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_TOKENS for t in tokens):
            return f"'tokens' is {tokens!r:.60}, not a list of token counts (0 to 2**53)"
        experts = experts or len(tokens)
        if len(tokens) != experts:
            return f"'tokens' has {len(tokens)} entries, not one per expert ({experts}, as {where})"
        if weight is not None and not (isinstance(weight, list) and len(weight) == experts
                                       and all(w is None or _number(w) for w in weight)):
            return f"'weight' is {weight!r:.60}, not a list of {experts} numbers or nulls"
        bad = next((k for k in ("imbalance", "idle", "z_loss") if row.get(k) is not None and not _number(row[k])),
                   None)
        return f"{bad!r} is {row[bad]!r:.60}, not a number" if bad else None
    return problem


def write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``path`` atomically (a reader, or a run killed meanwhile, never leaves half a file)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path


def write_summary(run_dir: str | os.PathLike, summary: dict[str, Any]) -> Path:
    """Write ``run_dir/summary.json`` (atomically: a reader never sees half a file)."""
    return write_text(Path(run_dir) / SUMMARY,
                      json.dumps({k: jsonable(v) for k, v in summary.items()}, indent=2) + "\n")


def read_summary(run_dir: str | os.PathLike) -> dict[str, Any]:
    """``run_dir/summary.json``, or {} when there is none or it cannot be read (a run killed before its end)."""
    try:
        summary = json.loads((Path(run_dir) / SUMMARY).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return summary if isinstance(summary, dict) else {}


def read_recipe(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The resolved recipe a run trained with (``run_dir/recipe.yaml``) as plain YAML data, None when the run has
    none; yaml_guard.UnsafeYAML when the file is not a safe YAML document."""
    path = Path(run_dir) / RECIPE
    if not path.is_file():
        return None
    data = load_yaml(path.read_bytes(), str(path))
    return data if isinstance(data, dict) else {}


# ---------------------------------------------------------------------------------------------------------------
# One owner: unique default names, the lock, the refusal, rows past a resumed checkpoint


_NAME_BYTES = 96  # of UTF-8 in the recipe part: with '-<time>-<job>' well inside a file system's 255 bytes


def _name_char(ch: str) -> bool:
    """Whether ``ch`` may stay in a run directory's name: a letter, mark or digit of any script (名前, é, ट),
    a symbol such as an emoji, '_' or '-'. Path separators, '.', spaces, punctuation the shell reads, control and
    format characters (the bidirectional overrides U+202A..U+202E and U+2066..U+2069, zero-width characters) and
    lone surrogates (a command line that is not UTF-8) are not."""
    return ch in "_-" or unicodedata.category(ch)[0] in "LMN" or unicodedata.category(ch) == "So"


def safe_name(name: str) -> str:
    """``name`` as one path component that keeps the recipe's own letters in any script: every character that
    :func:`_name_char` refuses becomes '-' (a recipe ``name: ../../x`` stays in runs/), runs of '-' become one,
    and the name is cut to ``_NAME_BYTES`` bytes of UTF-8 at a character boundary. NFC first, so that an accent
    typed as one character or as two gives one directory."""
    text = "".join(ch if _name_char(ch) else "-" for ch in unicodedata.normalize("NFC", str(name)))
    text = re.sub(r"-{2,}", "-", text).strip("-")
    text = text.encode("utf-8")[:_NAME_BYTES].decode("utf-8", "ignore").strip("-")
    return text or "run"


def _short_hash(*parts: object) -> str:
    return hashlib.sha1("\0".join(map(str, parts)).encode()).hexdigest()[:6]


def _agent_start(pid: int) -> float | None:
    """When process ``pid`` started (Linux /proc), or None."""
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def job_identity(env: Mapping[str, str] | None = None) -> tuple[str, float | None]:
    """(token, start time) shared by every rank of this job and by no other job: a Slurm job's id; torchrun's
    rendezvous (run id, store address) and, on one node, its agent (the workers' parent) and when it started; ranks
    given torchrun's variables by another launcher: their rendezvous address; else this process (host, pid). The
    time is None where the ranks cannot agree on one (torchrun over several nodes)."""
    env = os.environ if env is None else env
    if env.get("SLURM_JOB_ID") and env.get("SLURM_STEP_ID") is not None:  # srun: every task of the job step
        start = env.get("SLURM_JOB_START_TIME")
        return f"job{safe_name(env['SLURM_JOB_ID'])}", float(start) if start and start.isdigit() else None
    if "TORCHELASTIC_RUN_ID" in env:
        rendezvous = (env["TORCHELASTIC_RUN_ID"], env.get("MASTER_ADDR"), env.get("MASTER_PORT"))
        if env.get("GROUP_WORLD_SIZE", "1") != "1":  # several agents (nodes): only the rendezvous is shared
            return _short_hash(*rendezvous), None
        agent = os.getppid()
        start = _agent_start(agent)
        return _short_hash(*rendezvous, socket.gethostname(), agent, start), start
    if all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        # ranks started with torchrun's variables by something else (a script, an MPI wrapper): the rendezvous
        # address is what they share, and no other running job can hold it
        return _short_hash(env["MASTER_ADDR"], env["MASTER_PORT"], env["WORLD_SIZE"]), None
    if _PROCESS.get("pid") != os.getpid():  # once per process: its lock and its name keep one identity
        now = time.time()
        _PROCESS.update(pid=os.getpid(), identity=(_short_hash(socket.gethostname(), os.getpid(), now), now))
    return _PROCESS["identity"]


_PROCESS: dict[str, Any] = {}


def default_run_name(recipe_name: str, env: Mapping[str, str] | None = None) -> str:
    """conf/train.yaml's default run_dir name: ``<recipe>-<YYYYmmdd-HHMMSS>-<job>``, the same on every rank of one
    job and unique across jobs (two runs started in one second differ in ``<job>``)."""
    token, start = job_identity(env)
    stamp = time.strftime("%Y%m%d-%H%M%S-", time.localtime(start)) if start is not None else ""
    return f"{safe_name(recipe_name)}-{stamp}{token}"


LOCK_SETTLE_S = 2.0
"""How long a reader waits for an unreadable lock to become a complete record before it names "an unreadable lock":
claim() writes the record whole (a hard link of a complete file), but a lock of an older version, or one written
where hard links fail, exists empty for a moment before its record is in it."""


def _holder(run_dir: Path) -> dict[str, Any] | None:
    deadline = time.monotonic() + LOCK_SETTLE_S
    while True:
        try:
            holder = json.loads((run_dir / LOCK).read_text(encoding="utf-8"))
        except (FileNotFoundError, NotADirectoryError):
            return None  # no lock (a run_dir under a file is no one's: the writability check names it)
        except (OSError, ValueError):
            holder = None  # being written, or garbage
        if isinstance(holder, dict):
            return holder
        if time.monotonic() >= deadline:
            return {}  # half-written or garbage for good: nobody we can name
        time.sleep(0.05)


def _alive(pid: Any) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, TypeError, OverflowError):
        return isinstance(pid, int)  # another user's live process
    return True


def _ours(holder: dict[str, Any]) -> bool:
    return holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname()


def _other_live_holder(run_dir: Path, token: str) -> dict[str, Any] | None:
    """The lock's holder when it is another job that may be running (same host and alive, or another host)."""
    holder = _holder(run_dir)
    if holder is None or _ours(holder) or (holder and holder.get("job") == token):
        return None
    if holder.get("host") == socket.gethostname() and not _alive(holder.get("pid")):
        return None
    return holder


def has_results(run_dir: str | os.PathLike) -> list[str]:
    """The run results in ``run_dir`` (RESULTS and per-stage numerics files), by name."""
    run_dir = Path(run_dir)
    return [n for n in RESULTS if (run_dir / n).exists()] + [p.name for p in numerics_files(run_dir)[1:]]


def check_run_dir(run_dir: str | os.PathLike, *, fresh: bool, env: Mapping[str, str] | None = None) -> None:
    """RunDirError (one line) when this job may not use ``run_dir``: it lies inside another run's outputs (e.g. its
    checkpoints/), another running job holds its lock, or this is a fresh start (not a resume) and it holds another
    run's results. Reads only: every rank may call it."""
    run_dir = Path(run_dir)
    inside = _in_run_outputs(run_dir)
    if inside is not None:  # another run's checkpoints/ (or tb/, .hydra/): its `latest`, its files, interleaved
        raise RunDirError(f"run_dir: {str(run_dir)!r} is inside {inside[1].parts[0]}/ of the run in "
                          f"'{inside[0]}'; choose a run_dir outside that run's directory (e.g. beside it)")
    token, _ = job_identity(env)
    holder = _other_live_holder(run_dir, token)
    if holder is not None:
        who = f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}" if holder else "an unreadable lock"
        raise RunDirError(f"run_dir: {str(run_dir)!r} is in use by another run ({who}, {LOCK}); wait for it to end "
                          f"or choose another run_dir (if no run uses it, delete {run_dir / LOCK})")
    found = has_results(run_dir) if fresh else []
    if found:
        raise RunDirError(f"run_dir: {str(run_dir)!r} already holds another run ({', '.join(found)}); choose another "
                          f"run_dir, or continue that run with trainer.resume=auto")


def claim(run_dir: str | os.PathLike, env: Mapping[str, str] | None = None) -> None:
    """Take ``run_dir``'s lock for this job (rank 0 calls it, after check_run_dir): created atomically with this
    process's pid, host and job; a stale lock (a dead process on this host, or a lock of this same job, e.g. a
    requeued Slurm job) is taken over with a warning; RunDirError when another job holds it. Released at exit."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    token, _ = job_identity(env)
    record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "job": token, "since": time.time()})
    for _ in range(3):
        if _create_whole(run_dir / LOCK, record):
            atexit.register(release, run_dir)
            return
        holder = _holder(run_dir)
        if holder and _ours(holder):
            return  # this process holds it already (a second run_training in one process)
        check_run_dir(run_dir, fresh=False, env=env)  # refuses a live other job
        logger.warning("run_dir: taking over the stale lock %s (%s)", run_dir / LOCK,
                       f"pid {holder.get('pid')} on {holder.get('host')}" if holder else "unreadable")
        (run_dir / LOCK).unlink(missing_ok=True)
    raise RunDirError(f"run_dir: {str(run_dir)!r}: another run keeps taking its {LOCK}; choose another run_dir")


def _create_whole(path: Path, text: str) -> bool:
    """Create ``path`` holding ``text``, never seen without it: the other ranks of a job check the lock while rank 0
    takes it, and an empty lock reads as another job's (a CI run's rank 1 refused its own job so). A complete file
    hard-linked into place, which fails when ``path`` exists; where hard links fail (some file systems), an
    exclusive create and a write, which readers wait out (_holder). False when ``path`` exists."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{time.monotonic_ns()}")
    tmp.write_text(text, encoding="utf-8")
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    except OSError:  # no hard links here
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        return True
    finally:
        tmp.unlink(missing_ok=True)


def release(run_dir: str | os.PathLike) -> None:
    """Remove ``run_dir``'s lock when this process holds it."""
    holder = _holder(Path(run_dir))
    if holder and _ours(holder):
        (Path(run_dir) / LOCK).unlink(missing_ok=True)


def held_by_another(run_dir: str | os.PathLike, env: Mapping[str, str] | None = None) -> bool:
    """Whether another job that may be running holds ``run_dir``'s lock (a failed start then removes nothing)."""
    return _other_live_holder(Path(run_dir), job_identity(env)[0]) is not None


def drop_rows_after(run_dir: str | os.PathLike, step: int) -> int:
    """Before a resumed run continues from ``step``: drop the metrics, routing and numerics rows past it (written after the
    checkpoint by a run killed later), each file rewritten atomically; the number of rows dropped."""
    dropped = 0
    for path in [Path(run_dir) / METRICS, Path(run_dir) / ROUTING, *numerics_files(run_dir)]:
        if not path.is_file():
            continue
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
        kept = [line for line in lines if not _past(line, step)]
        if len(kept) != len(lines):
            dropped += len(lines) - len(kept)
            write_text(path, "".join(line if line.endswith("\n") else line + "\n" for line in kept))
    return dropped


def _past(line: str, step: int) -> bool:
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        return bool(line.strip())  # a row cut off by the kill: past the checkpoint by definition
    return isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] > step


def load_run_config(run_dir: str | os.PathLike, key: str = "run_dir") -> Any:
    """The composed config scripts/train.py ran with (Hydra writes it to ``run_dir/.hydra/config.yaml``). A missing
    one, or one damaged or edited into something else (not YAML, not a mapping with the model, data and trainer
    groups), is a one-line ConfigError naming ``key`` (the caller's argument) and the file."""
    from omegaconf import OmegaConf  # Hydra's config library: a dependency, kept out of this module's import

    path = Path(run_dir) / HYDRA / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"{key}: {str(run_dir)!r} has no .hydra/config.yaml; give a directory written by "
                          "scripts/train.py")
    fix = "restore it from a copy of the run (scripts/train.py wrote it), or give another run directory"
    try:  # the guarded reader first: OmegaConf's own would end in a YAML traceback, or walk an alias bomb
        data = load_yaml(path.read_bytes(), str(path))
    except (ConfigError, OSError) as e:
        raise ConfigError(f"{key}: {path}: {str(e).splitlines()[0]}; {fix}") from None
    groups = data if isinstance(data, dict) else {}
    missing = [g for g in ("model", "data", "trainer") if not isinstance(groups.get(g), dict)]
    if missing:
        raise ConfigError(f"{key}: {path} has no {missing[0]} group (a mapping of its keys); {fix}")
    from omegaconf.errors import OmegaConfBaseException

    try:
        return OmegaConf.load(path)  # (its YAML 1.2 floats: 1e-5 is a number there, a string to the plain reader)
    except OmegaConfBaseException as e:  # (e.g. a malformed ${...} interpolation)
        raise ConfigError(f"{key}: {path}: {str(e).splitlines()[0]}; {fix}") from None
