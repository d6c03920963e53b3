"""The README's commands are the project's contract: keep them true."""

import re
from pathlib import Path

from fp8_recipes import cli

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def first_bash_block() -> list[str]:
    block = re.search(r"```bash\n(.*?)```", README, re.S).group(1)
    return [line for line in block.splitlines() if line.strip()]


def test_readme_starts_with_the_two_setup_commands():
    main, tests = first_bash_block()
    assert main.startswith("bash scripts/setup.sh && ") and "scripts/train.py +recipe=hybrid" in main
    assert tests.startswith("bash scripts/setup.sh --dev && ") and "pytest" in tests
    # nothing but a title and one paragraph before them
    assert README.index("```bash") < 600


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    setup, pytest_cmd = first_bash_block()[1].split(" && ")
    assert setup.replace("bash ", "") in ci and pytest_cmd in ci


def test_readme_plan_example_is_what_explain_prints(capsys):
    block = re.search(r"`fp8-recipes explain (\S+) --layers (\d+) --steps (\d+)`\):\n\n```\n(.*?)```", README, re.S)
    name, layers, steps, shown = block.groups()
    assert cli.main(["explain", name, "--layers", layers, "--steps", steps]) == 0
    assert capsys.readouterr().out == shown
