"""A throwaway virtual environment with NeMo 2 on top of this one, for CPU checks of the NeMo 2 adapter.

    python -m fp8_recipes.integrations.optional_env nemo /tmp/nemo-env     # prints the interpreter to use

nemo-toolkit 2.7.3 does not install cleanly beside this project (its extras pin ``transformers~=4.57`` and a long
tail), but what ``nemo.lightning.pytorch.plugins`` and Lightning's Callback need to *import* is small: the pinned
wheels below, installed with ``--no-deps`` into a separate venv that sees this environment's packages (torch,
megatron-core 0.19.2, hydra, this project) through a ``.pth`` line. Never TE. The list was found by importing
until nothing was missing.

Megatron-Bridge has no such route: 0.6.2 imports ``transformer_engine.pytorch`` unconditionally while importing
its package (``megatron/bridge/peft/lora_layers.py``, reached from ``megatron/bridge/__init__.py``), and TE cannot
load on a CPU machine, so no Bridge module imports there.
"""

from __future__ import annotations

import hashlib
import site
import subprocess
import sys
from pathlib import Path

__all__ = ["PINS", "build_env"]

PINS: dict[str, tuple[str, ...]] = {
    # `from nemo.lightning.pytorch.plugins import MegatronMixedPrecision` + lightning's Callback
    "nemo": (
        "nemo-toolkit==2.7.3", "lightning==2.4.0", "lightning-utilities==0.15.3", "torchmetrics==1.9.0",
        "fiddle==0.3.1", "cloudpickle", "libcst==1.9.0", "wrapt==2.5.2", "wget==3.2", "onnx==1.23.2",
        "ml_dtypes==0.6.0", "nv-one-logger-core==2.3.1", "nv-one-logger-training-telemetry==2.3.1",
        "nv-one-logger-pytorch-lightning-integration==2.3.1", "pydantic==2.14.4", "pydantic_core==2.50.5",
        "typing-inspection==0.4.5", "annotated-types==0.8.0", "StrEnum==0.5.0", "overrides==7.7.0",
        "toml==0.10.2",
    ),
}


def _pins_key(kind: str) -> str:
    return hashlib.sha256("\n".join(PINS[kind]).encode()).hexdigest()[:12]


def build_env(kind: str, dest: Path) -> Path:
    """Create (or reuse, when built from the same pins) the venv at `dest`; return its python."""
    dest = Path(dest)
    python = dest / "bin" / "python"
    marker = dest / f".fp8-recipes-{kind}-{_pins_key(kind)}"
    if marker.exists() and python.exists():
        return python
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--clear", str(dest)], check=True)
    target = subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"], check=True,
                            capture_output=True, text=True).stdout.strip()
    # "import" lines of a .pth run at start-up: addsitedir also reads this environment's own .pth files (the
    # editable install of fp8-recipes); the new venv's packages stay first on sys.path.
    here = site.getsitepackages()[0]
    Path(target, "zz_fp8_recipes_base.pth").write_text(f"import site; site.addsitedir({here!r})\n")
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
                    *PINS[kind]], check=True)
    marker.touch()
    return python


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] not in PINS:
        print(f"usage: python -m fp8_recipes.integrations.optional_env {{{'|'.join(PINS)}}} DEST", file=sys.stderr)
        return 2
    print(build_env(args[0], Path(args[1])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
