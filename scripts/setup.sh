#!/usr/bin/env bash
# Create or reuse .venv (Python 3.12) and install this project from setup.cfg, editable, at the versions of
# scripts/constraints.txt (the lock: a fresh machine gets what the suite was last verified with; refresh it with
# bash scripts/lock.sh).
#   bash scripts/setup.sh          # runtime dependencies
#   bash scripts/setup.sh --dev    # + test dependencies (pytest, hypothesis) and the hf extra the tests load
#   FP8_RECIPES_TORCH=newest bash scripts/setup.sh --dev
#                                  # .venv-newest-torch: the lock without torch (and its CUDA libraries), so the
#                                  # newest torch on the index: run the suite there to see drift before a re-lock
# Never installs Transformer Engine: on a CPU machine it cannot load and breaks `import megatron.core`.
# Reuse is keyed on setup.cfg, the lock and this script: the install runs again only when they (or the extras) change.
# Editable in "compat" mode: plugins/ goes on sys.path through a .pth file, so Hydra finds the hydra_plugins
# namespace package (setuptools' default editable finder hides namespace packages from Hydra's plugin scan).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
EXTRAS=""
[ "${1:-}" = "--dev" ] && EXTRAS="[dev,hf]"
source scripts/find_python.sh
VENV=.venv
LOCK=scripts/constraints.txt
case "${FP8_RECIPES_TORCH:-locked}" in
  locked) ;;
  newest)
    VENV=.venv-newest-torch
    mkdir -p "$VENV"
    # torch's own family moves with it: its CUDA libraries and triton
    grep -v -i -E "^(torch|triton|nvidia-[a-z0-9-]+|cuda-[a-z-]+)==" scripts/constraints.txt > "$VENV/constraints.txt"
    LOCK=$VENV/constraints.txt ;;
  *) echo "error: FP8_RECIPES_TORCH=${FP8_RECIPES_TORCH}: give locked (the default) or newest" >&2; exit 2 ;;
esac

if [ ! -x "$VENV/bin/python" ]; then
  PY=$(find_python) || { echo "setup: python3.12 not found; install Python 3.12 or set PYTHON=/path/to/python3.12" >&2; exit 2; }
  "$PY" -m venv "$VENV"
fi
STAMP=$VENV/.fp8-recipes-installed
WANT="$(cat setup.cfg scripts/setup.sh "$LOCK" | sha256sum | cut -c1-16)$EXTRAS"
HAVE=$(cat "$STAMP" 2>/dev/null || true)
if [ "$HAVE" != "$WANT" ] && [ "$HAVE" != "$WANT[dev,hf]" ]; then
  echo "setup: installing fp8-recipes$EXTRAS into $VENV (first time: ~2 minutes, torch is large)" >&2
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -c "$LOCK" -e ".$EXTRAS" \
    --config-settings editable_mode=compat 2>&1 | grep -v -E "^WARNING: Location|is ignored: it is neither" >&2 || true
  "$VENV/bin/python" -W ignore -c "import fp8_recipes, megatron.core, hydra" || { echo "setup: install failed" >&2; exit 3; }
  echo "$WANT" > "$STAMP"
fi
