"""scripts/constraints.txt, the CPU environment's lock: every requirement setup.cfg names for that environment
(install_requires and the dev and hf extras scripts/setup.sh --dev installs) is pinned there to one version its
specifier allows, and torch is the GPU image's (docs/facts.md), so a fresh machine runs the suite on what it was
last verified with."""

from __future__ import annotations

import configparser
import re
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "scripts" / "constraints.txt"
GPU_IMAGE_TORCH = "2.11.0"
"""torch on the GPU machines' image (docs/facts.md, "Versions that work together")."""


def _pins() -> dict[str, str]:
    pins = {}
    for line in LOCK.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;]+)", line.strip())
        assert m, f"{LOCK.name}: not a 'name==version' line: {line!r}"
        name = canonicalize_name(m.group(1))
        assert name not in pins, f"{LOCK.name}: {name} pinned twice"
        pins[name] = m.group(2)
    return pins


def _requirements() -> list[Requirement]:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    lines = cfg["options"]["install_requires"].splitlines()
    for extra in ("dev", "hf"):  # what scripts/setup.sh --dev installs
        lines += cfg["options.extras_require"][extra].splitlines()
    return [Requirement(line) for line in (s.split("#")[0].strip() for s in lines) if line]


def test_every_requirement_is_locked_to_a_version_it_allows():
    pins = _pins()
    reqs = _requirements()
    assert len(reqs) >= 15, reqs  # the reader still finds setup.cfg's requirements
    problems = []
    for req in reqs:
        version = pins.get(canonicalize_name(req.name))
        if version is None:
            problems.append(f"{req.name} is not in {LOCK.name}")
        elif not req.specifier.contains(version, prereleases=True):
            problems.append(f"{req.name}=={version} is outside setup.cfg's {req.specifier}")
    assert not problems, problems + ["refresh the lock: bash scripts/lock.sh"]


def test_torch_is_the_gpu_images():
    assert _pins()["torch"] == GPU_IMAGE_TORCH


def test_the_installed_environment_is_the_lock():
    """This venv (what the suite runs on) holds the locked versions of setup.cfg's requirements; the opt-in venv of
    the newest torch (FP8_RECIPES_TORCH=newest) all but torch."""
    import sys
    from importlib.metadata import version

    pins = _pins()
    if Path(sys.prefix).name == ".venv-newest-torch":
        pins.pop("torch")
    wrong = {r.name: (version(r.name), pins[canonicalize_name(r.name)]) for r in _requirements()
             if canonicalize_name(r.name) in pins and version(r.name).split("+")[0] != pins[canonicalize_name(r.name)]}
    assert not wrong, f"installed vs locked: {wrong}; run bash scripts/setup.sh --dev"


def test_setup_installs_from_the_lock():
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert '-c "$LOCK"' in setup and "LOCK=scripts/constraints.txt" in setup
    ci = (ROOT / ".ci" / "run").read_text()
    assert "bash scripts/setup.sh --dev" in ci
