"""Every command shown in README.md and docs/*.md runs as written (with short step counts), so a doc command can
never fail again.

Commands are read from ```bash blocks and from 4-space indented blocks (```console transcripts show outputs of
runs that are not rebuilt here). Each one is run, in document order, from a scratch directory that looks like the
checkout (scripts/, conf/, recipes/, plugins/, tests/, docs/, .venv linked), so `runs/...` and `mine/...` land there:

- scripts/train.py and torchrun (2 CPU ranks, gloo): trained for 2 steps of a 2-layer tiny model on a small byte
  corpus (appended overrides; the command's own batch sizes and layout stay); exit 0 and a `done:` line;
- trainer=gpu commands: on a machine without CUDA, the one-line refusal naming trainer.device (exit 2);
- scripts/train.py -m hydra/launcher=slurm: composed with the launcher group and checked as the launcher checks
  before submitting (nothing is submitted);
- scripts/slurm/make_sbatch.py: the script is written (without --submit) and its #SBATCH lines say what the
  command asked for (nodes, tasks, GPUs per node; a GPU per task with trainer=gpu);
- GPU benchmarks and GPU-image scripts: every --option the command uses exists in the script's --help, and the
  Hydra overrides after `--` compose and pass the config checks;
- fp8-recipes, prepare_data.py, compare_recipes.py, eval_checkpoint.py, the doctor's chain: run, exit 0 (the doctor
  1 when it finds a problem).

A command that none of these rules covers fails `test_every_doc_command_is_covered`: add a rule with it.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from test_train_cpu import dataset, processes_at_once  # noqa: F401  (the shared tiny dataset fixture)

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FAST = ["trainer.max_steps=2", "trainer.eval_interval=0", "trainer.eval_iters=1", "model.num_layers=2",
        "model.vocab_size=null"]
PROGRAMS = ("python", ".venv/bin/python", "python3", "torchrun", "fp8-recipes", "bash", "pip", "mkdir", "S=",
            "BASELINE=", "PYTHONPATH=")


def _commands(text: str) -> list[str]:
    lines, out = [], []
    for raw in text.splitlines():
        line = raw.strip()
        if lines and lines[-1].endswith("\\"):
            lines[-1] = lines[-1][:-1].rstrip() + " " + line
        else:
            lines.append(line)
    for line in lines:
        code = re.split(r"\s+#\s", line, maxsplit=1)[0].strip()  # a trailing comment ("  # ...")
        program = re.sub(r"^(?:[A-Z_]+=(?:\"[^\"]*\"|'[^']*'|\S*)\s+)+", "", code)  # past `SEED=1 NAME=x ...`
        if code and not code.startswith("#") and (code.startswith(PROGRAMS) or program.startswith(("bash ", "python"))):
            out.append(code)
    return out


def doc_commands(path: Path) -> list[str]:
    """The commands of one Markdown file, in order: ```bash blocks and 4-space indented blocks."""
    text = path.read_text()
    found = []
    for m in re.finditer(r"```(\w*)\n(.*?)```|((?:^    .*\n)+)", text, re.S | re.M):
        if m.group(3) is not None:
            found += _commands(m.group(3))
        elif m.group(1) in ("bash", "sh"):
            found += _commands(m.group(2))
    variables = {}  # S="model=... trainer=gpu": later commands use $S
    for i, command in enumerate(found):
        for name, value in variables.items():
            found[i] = command = command.replace(f"${name}", value)
        m = re.fullmatch(r'(\w+)="([^"]*)"', command)
        if m:
            variables[m.group(1)] = m.group(2)
    return found


ALL = [(p.name, c) for p in DOCS for c in doc_commands(p)]
# run dirs a later `fp8-recipes export` reads: their training commands keep their checkpoints
EXPORTED = {c.split()[2] for _, c in ALL if c.startswith("fp8-recipes export ") and c.split()[2][0] != "-"}


def rule(command: str) -> str:
    """How a command is checked here (the module docstring); '' when no rule covers it."""
    words = command.split()
    if command.startswith(("bash scripts/setup.sh", "FP8_RECIPES_TORCH=", "bash scripts/lock.sh", "TORCH=",
                           "bash tests/gpu/run_gpu.sh", "pip install", "S=", "BASELINE=", "PYTHONPATH=")) \
            or "scripts/bench_" in command or "tests/gpu/run_gpu.sh" in command or "scripts/bridge_pretrain.py" in command:
        return "gpu-or-setup"
    if words[0].endswith("python") and words[1:3] == ["-m", "pytest"]:
        return "pytest"
    if words[:3] == ["python3", "-m", "pytest"] and "tests/gpu/" in command:  # (the GPU machine's python3)
        return "gpu-or-setup"
    if "scripts/train.py" in command and (" -m " in command or command.endswith(" -m")):
        return "submitit"
    if "scripts/train.py" in command and "trainer=gpu" in command:
        return "train-gpu"
    if "scripts/compare_recipes.py" in command and "trainer=gpu" in command:
        return "gpu-or-setup"
    if words[0] == "torchrun" and "scripts/train.py" in command:
        return "torchrun"
    if "scripts/train.py" in command:
        return "train"
    if "scripts/slurm/make_sbatch.py" in command:
        return "sbatch"
    if words[0] in ("fp8-recipes", "mkdir") or any(s in command for s in (
            "scripts/prepare_data.py", "scripts/compare_recipes.py", "scripts/eval_checkpoint.py")):
        return "run"
    return ""


def test_every_doc_command_is_covered():
    assert len(ALL) >= 40, ALL  # the parser still finds the docs' commands
    assert {p.name for p in DOCS} >= {"README.md", "distributed.md", "slurm.md", "doctor.md", "data.md"}
    uncovered = [c for _, c in ALL if not rule(c)]
    assert not uncovered, f"no rule in {Path(__file__).name} runs these doc commands: {uncovered}"
    assert rule("python scripts/train.py +recipe=hybrid") == "train"  # the rules themselves
    assert rule("torchrun --nproc-per-node 2 scripts/train.py") == "torchrun"


# ---------------------------------------------------------------------------------------------------------------
# Running them


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory, dataset) -> tuple[Path, list[str]]:  # noqa: F811
    """A directory that looks like the checkout, and the data overrides of the tiny byte corpus."""
    box = tmp_path_factory.mktemp("docs")
    for name in ("scripts", "conf", "recipes", "plugins", "tests", "docs", "setup.cfg", ".venv"):
        if (ROOT / name).exists():
            (box / name).symlink_to(ROOT / name)
    (box / "corpus.jsonl").write_text('{"text": "def f():\\n    return 1\\n"}\n' * 50)
    (box / "more_text").mkdir()
    (box / "more_text" / "a.txt").write_text("plain text for the tokenizer\n" * 200)
    return box, dataset


def _env(box: Path, port: int | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "HYDRA_FULL_ERROR")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"  # python, torchrun, fp8-recipes
    env["PWD"] = str(box)
    return env


def _python(words: list[str]) -> list[str]:
    return [sys.executable, *words[1:]] if words[0].endswith(("python", "python3")) else words


def _prepare_readme_files(box: Path) -> None:
    """The YAML files the README shows (a block starting with `# <name>.yaml` outside recipes/), written where
    its commands read them."""
    for path in DOCS:
        for block in re.findall(r"```yaml\n(.*?)```", path.read_text(), re.S):
            m = re.match(r"# (\S+\.yaml)\n", block)
            if m and not m.group(1).startswith(("recipes/", "tests/")):
                (box / m.group(1)).write_text(block)


def run_command(command: str, box: Path, data: list[str], port: int) -> tuple[str, subprocess.CompletedProcess]:
    kind = rule(command)
    words = shlex.split(command)
    env = _env(box)
    if kind in ("train", "train-gpu"):
        argv = _python(words) + data + FAST
        if "run_dir=" not in command:
            argv.append(f"run_dir=runs/{abs(hash(command))}")
        if "trainer.resume=" not in command and not any(f"run_dir={d}" in words for d in EXPORTED):
            argv.append("trainer.save_checkpoints=false")
        if "batch_size" not in command:  # one process: the batch sizes only cost time here (torchrun keeps them)
            argv += ["trainer.micro_batch_size=4", "trainer.global_batch_size=4"]
        if "$" in command:  # "hydra.searchpath=[file://$PWD/mine]": as a shell would expand it
            argv = [os.path.expandvars(a.replace("$PWD", str(box))) for a in argv]
    elif kind == "torchrun":
        i = words.index("scripts/train.py")
        argv = [sys.executable, "-m", "torch.distributed.run", f"--master-port={port}", *words[1:i], *words[i:],
                *data, *FAST, "trainer.save_checkpoints=false", f"run_dir=runs/{abs(hash(command))}"]
    elif kind == "run":
        argv = ["bash", "-c", command]
        if "scripts/prepare_data.py" in command:  # the small corpus unless the command names its own inputs
            extra = [] if "--inputs" in command else ["--inputs", "more_text"]
            argv = _python(words) + extra + (["--out", "data/docs-stdlib"] if "--out" not in command else [])
        elif "scripts/compare_recipes.py" in command and "--over-seeds" not in command:  # (that one trains nothing)
            argv = _python(words) + data + FAST + ["trainer.micro_batch_size=4", "trainer.global_batch_size=4"]
        elif "scripts/eval_checkpoint.py" in command:
            argv = _python(words) + ["--eval-iters", "1"]
    else:
        raise AssertionError(kind)
    proc = subprocess.run(argv, cwd=box, env=env, capture_output=True, text=True, timeout=600)
    return kind, proc


def _doctor_chain_seed(box: Path) -> None:
    """docs/doctor.md trains with the recipe `--write` saved; a 2-step run gives the doctor nothing to fix, so the
    file it would have written is put there (what the chain then checks is the searchpath command)."""
    fixed = box / "mine" / "recipe" / "fixed.yaml"
    if not fixed.exists() and fixed.parent.is_dir():
        fixed.write_text("defaults: [delayed, _self_]\nname: fixed\n")


RUNNABLE = ("train", "train-gpu", "torchrun", "run")


def _check(command: str, kind: str, proc: subprocess.CompletedProcess) -> str | None:
    """None when the command did what its rule expects, else what went wrong."""
    out = proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    if kind == "train-gpu":
        import torch

        if torch.cuda.is_available():
            return None  # a GPU machine: the command is the GPU suite's business
        if proc.returncode != 2 or len(errors) != 1 or "trainer.device=gpu" not in errors[0]:
            return f"expected the one-line trainer.device refusal, got rc {proc.returncode}: {out[-1500:]}"
        return None
    if "Traceback" in out and kind != "torchrun":
        return f"traceback: {out[-2500:]}"
    allowed = (0, 1) if " doctor " in f" {command} " else (0,)
    if proc.returncode not in allowed:
        return f"rc {proc.returncode}: {out[-2500:]}"
    if kind in ("train", "torchrun") and "done: " not in proc.stderr + proc.stdout:
        return f"no done: line: {out[-1500:]}"
    return None


def test_doc_commands_run(sandbox, free_port):
    box, data = sandbox
    _prepare_readme_files(box)
    seen, failures = set(), []
    by_doc: dict[str, list[str]] = {}
    for doc, command in ALL:
        first = command.split(" && ")[-1] if command.startswith("bash scripts/setup.sh") else command
        if rule(first) in RUNNABLE and first not in seen:
            seen.add(first)
            by_doc.setdefault(doc, []).append(first)

    def run_doc(commands: list[str]) -> list[str]:
        bad = []
        for command in commands:  # in document order: later commands read what earlier ones wrote
            if "+recipe=fixed" in command:
                _doctor_chain_seed(box)
            kind, proc = run_command(command, box, data, free_port())
            problem = _check(command, kind, proc)
            if problem:
                bad.append(f"{command}\n    {problem}")
        return bad

    with ThreadPoolExecutor(max_workers=processes_at_once()) as pool:
        for bad in pool.map(run_doc, by_doc.values()):
            failures += bad
    assert not failures, "doc commands that fail:\n" + "\n".join(failures)
    assert len(seen) >= 20, sorted(seen)


# ---------------------------------------------------------------------------------------------------------------
# What can be checked of commands that need Slurm, GPUs or a GPU image


def _overrides(words: list[str]) -> list[str]:
    return [w for w in words if "=" in w and not w.startswith("-")]


def _launcher_checked(overrides: list[str]):
    """The composed config with its launcher settings, checked as the launchers check before submitting."""
    from hydra import compose, initialize_config_dir

    from fp8_recipes.launch.job import check_train_config
    from fp8_recipes.launch.settings import LauncherSettings
    from fp8_recipes.recipe.pack import conf_dir

    sweep = [o.split(",")[0] if o.startswith("+recipe=") else o for o in overrides]  # the sweep's first job
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = compose("train", overrides=sweep, return_hydra_config=True)
    settings = LauncherSettings.from_cfg(cfg.launcher).for_trainer(cfg.trainer)
    check_train_config(cfg, settings.world_size)
    return settings


@pytest.mark.parametrize("command", [c for _, c in ALL if rule(c) == "submitit"])
def test_submitit_commands_pass_the_launchers_checks(command):
    settings = _launcher_checked(_overrides(shlex.split(command)))
    for key, value in (o.split("=", 1) for o in _overrides(shlex.split(command)) if o.startswith("launcher.")):
        assert str(getattr(settings, key.split(".", 1)[1])) == value, (key, settings)


@pytest.mark.parametrize("command", sorted({c for _, c in ALL if rule(c) == "sbatch"}))
def test_make_sbatch_commands_write_the_job_they_describe(command, tmp_path):
    words = [w for w in shlex.split(command) if w != "--submit"]
    proc = subprocess.run(_python(words) + [f"run_dir={tmp_path / 'run'}"], cwd=ROOT, env=_env(tmp_path),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    script = Path(proc.stdout.strip().splitlines()[-1]).read_text()
    sbatch = dict(re.findall(r"^#SBATCH --([\w-]+)=?(\S*)", script, re.M))
    asked = dict(o.split("=", 1) for o in _overrides(words))
    tasks = asked.get("launcher.tasks_per_node", "1")
    assert sbatch["nodes"] == asked.get("launcher.nodes", "1") and sbatch["ntasks-per-node"] == tasks
    if "launcher.gpus_per_node" in asked:
        assert sbatch["gpus-per-node"] == asked["launcher.gpus_per_node"]
    elif asked.get("trainer") == "gpu":
        assert sbatch["gpus-per-node"] == tasks  # a GPU per task
    else:
        assert "gpus-per-node" not in sbatch  # a CPU job
    train_line = next(line for line in script.splitlines() if "srun " in line)
    assert all(o in train_line for o in asked if not o.startswith("launcher."))


def _script_options(script: str) -> set[str]:
    proc = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, env=_env(ROOT), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, (script, proc.stderr[-1500:])
    return set(re.findall(r"(--[\w-]+)", proc.stdout))


@pytest.mark.parametrize("command", sorted({c for _, c in ALL if rule(c) == "gpu-or-setup"}))
def test_gpu_and_setup_commands_name_what_exists(command):
    words = shlex.split(command)
    if words[1:3] == ["-m", "pytest"]:  # GPU tests: their files or folders exist (they skip on this machine)
        paths = [w.split("::")[0] for w in words[3:] if w.startswith("tests/")]
        assert paths and all((ROOT / f).exists() for f in paths), paths
        return
    if words[0] in ("bash", "pip") or words[0].endswith("=") or "=" in words[0]:
        if command.startswith("pip install"):
            extras = re.search(r"\[([\w,]+)\]", command).group(1).split(",")
            setup = (ROOT / "setup.cfg").read_text()
            assert all(re.search(rf"^{e}\s*=", setup, re.M) for e in extras), extras
            return
        assigned = [w for w in words if re.fullmatch(r"[A-Z_]+=.*", w, re.S)]
        scripts = [w for w in words if w.endswith((".sh", ".py")) and w not in assigned]
        for s in [p for w in assigned for p in w.split("=", 1)[1].split() if p.endswith((".py", ".yaml"))]:
            assert (ROOT / s).is_file(), s  # (a file a variable names: TESTS=tests/gpu/x.py, RECIPES=a.yaml)
        for s in scripts:
            assert (ROOT / s).is_file(), s
            if s.endswith(".sh"):
                assert subprocess.run(["bash", "-n", str(ROOT / s)]).returncode == 0, s
        if "tests/gpu/run_gpu.sh" in words:  # its part exists; CONFIGS are bench_train's; a shoot-out's EXTRA composes
            part = words[words.index("tests/gpu/run_gpu.sh") + 1:][:1] or ["all"]
            assert re.search(rf"^{re.escape(part[0])}\)", (ROOT / "tests/gpu/run_gpu.sh").read_text(), re.M), part
            env = dict(w.split("=", 1) for w in words if re.fullmatch(r"[A-Z_]+=.*", w, re.S))
            if "CONFIGS" in env:  # bench_train's configs (levers-bench)
                from fp8_recipes.bench.train import check_configs

                check_configs(env["CONFIGS"].split(), engine=bool(env.get("ENGINE")))
            if part[0] == "shootout":
                _launcher_checked(["+launcher=slurm", "+recipe=fast", f"model={env.get('MODEL', 'gpt_125m')}",
                                   "trainer=gpu", *env.get("EXTRA", "").split()])
        if not any(s.endswith(".py") for s in scripts):
            return
    script = next(w for w in words if w.endswith(".py"))
    main, _, hydra = " ".join(words[words.index(script):]).partition(" -- ")
    used = set(re.findall(r"(?<![\w-])(--[a-z][\w-]*)", main))
    assert used <= _script_options(script), (command, used - _script_options(script))
    overrides = _overrides(shlex.split(hydra)) if hydra else \
        [w for w in _overrides(words) if "scripts/compare_recipes.py" in command]
    if overrides:
        _launcher_checked(["+launcher=slurm", *overrides])


def test_a_config_error_under_torchrun_is_said_once_and_leaves_nothing(sandbox, free_port):
    """README: data parallel needs the global batch to hold micro-batch x DP; without it, one `error:` line (rank 0)
    with the fix, a failed exit, and no runs/ left behind in a fresh directory."""
    box, data = sandbox
    fresh = box / "fresh"
    fresh.mkdir()
    for name in ("scripts", "conf", "recipes", "plugins"):
        (fresh / name).symlink_to(ROOT / name)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--master-port={free_port()}",
                           "--nproc-per-node", "2", "scripts/train.py", "+recipe=delayed", *data, *FAST],
                          cwd=fresh, env=_env(fresh), capture_output=True, text=True, timeout=300)
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error:")]
    assert proc.returncode != 0 and len(errors) == 1, proc.stderr[-2000:]
    assert errors[0].startswith("error: trainer.global_batch_size=16 is not a multiple of") and \
        "set trainer.global_batch_size=32" in errors[0]
    assert not (fresh / "runs").exists()
