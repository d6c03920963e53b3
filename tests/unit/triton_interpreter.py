"""A check of a test module run in a fresh Python with Triton's CPU interpreter on: ``TRITON_INTERPRET=1`` is read
when a kernel is defined, so a test cannot turn it on in its own process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def interpreted(module: str, check: str) -> str:
    """What ``module.check()`` (a function of a module in tests/unit returning what it counted) prints as ``checked
    N`` under the interpreter, once the process has exited 0 (else an AssertionError with its output's tail)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore"}
    code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import {module} as t; " \
           f"print('checked', t.{check}())"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout
