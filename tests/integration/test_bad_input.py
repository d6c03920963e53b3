"""The bad-input corpus (bad_input/cases.yaml) through scripts/train.py: every case exits 2 with exactly one
``error:`` line naming the key (the last line of stderr), no traceback, and no run directory left behind.

The cases run as subprocesses a few at a time (each is mostly interpreter start-up; those that need torch, ~2 s).
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from test_train_cpu import dataset, small_run  # noqa: F401  (the shared tiny dataset fixture)

ROOT = Path(__file__).resolve().parents[2]
CASES = yaml.safe_load((Path(__file__).parent / "bad_input" / "cases.yaml").read_text())
IDS = [c["id"] for c in CASES]


def test_corpus_is_well_formed():
    assert len(CASES) >= 40 and len(set(IDS)) == len(IDS)
    for case in CASES:
        assert set(case) <= {"id", "args", "key", "phrase"} and case["args"] and case["key"], case
        assert all(isinstance(a, str) for a in case["args"]), case  # (a flow list splits unquoted commas)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory, dataset):  # noqa: F811
    """{case id: (returncode, stdout, stderr, run_dir)} for the whole corpus, run 4 at a time."""
    tmp = tmp_path_factory.mktemp("bad_input")
    (tmp / "empty.yaml").write_text("# a recipe of comments only\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "HYDRA_FULL_ERROR")}

    def run(case):
        run_dir = tmp / "runs" / case["id"]
        args = [*dataset, *small_run(run_dir, num_layers=1, steps=2), "trainer.eval_iters=1",
                *(a.replace("{tmp}", str(tmp)) for a in case["args"])]
        proc = subprocess.run([sys.executable, "scripts/train.py", *args], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=120)
        return case["id"], (proc.returncode, proc.stdout, proc.stderr, run_dir)

    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(pool.map(run, CASES))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_bad_input(case, outcomes):
    rc, stdout, stderr, run_dir = outcomes[case["id"]]
    out = stdout + stderr
    assert "Traceback" not in out, out[-3000:]
    assert rc == 2, out[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    last = [line for line in stderr.splitlines() if line.strip()][-1]
    assert len(errors) == 1 and last == errors[0], stderr[-3000:]
    line = errors[0]
    assert case["key"] in line, line
    assert case.get("phrase", "") in line, line
    assert not run_dir.exists(), sorted(p.name for p in run_dir.iterdir())  # not even Hydra's .hydra
    assert "recipe    " not in stdout  # failed before the plan was printed
