#!/usr/bin/env bash
# Create or reuse .venv (Python 3.12) and install this project from setup.cfg, editable.
#   bash scripts/setup.sh          # runtime dependencies
#   bash scripts/setup.sh --dev    # + test dependencies (pytest, hypothesis) and the hf extra the tests load
# Never installs Transformer Engine: on a CPU machine it cannot load and breaks `import megatron.core`.
# Reuse is keyed on setup.cfg and this script: the install runs again only when they (or the extras) change.
# Editable in "compat" mode: plugins/ goes on sys.path through a .pth file, so Hydra finds the hydra_plugins
# namespace package (setuptools' default editable finder hides namespace packages from Hydra's plugin scan).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
EXTRAS=""
[ "${1:-}" = "--dev" ] && EXTRAS="[dev,hf]"

find_python() {
  for c in "${PYTHON:-}" python3.12 "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12 /usr/bin/python3.12 /usr/local/bin/python3.12; do
    [ -n "$c" ] || continue
    if "$c" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' >/dev/null 2>&1; then echo "$c"; return 0; fi
  done
  return 1
}

if [ ! -x .venv/bin/python ]; then
  PY=$(find_python) || { echo "setup: python3.12 not found; install Python 3.12 or set PYTHON=/path/to/python3.12" >&2; exit 2; }
  "$PY" -m venv .venv
fi
STAMP=.venv/.fp8-recipes-installed
WANT="$(cat setup.cfg scripts/setup.sh | sha256sum | cut -c1-16)$EXTRAS"
HAVE=$(cat "$STAMP" 2>/dev/null || true)
if [ "$HAVE" != "$WANT" ] && [ "$HAVE" != "$WANT[dev,hf]" ]; then
  echo "setup: installing fp8-recipes$EXTRAS into .venv (first time: ~2 minutes, torch is large)" >&2
  .venv/bin/python -m pip install -q --disable-pip-version-check -e ".$EXTRAS" --config-settings editable_mode=compat 2>&1 | grep -v -E "^WARNING: Location|is ignored: it is neither" >&2 || true
  .venv/bin/python -W ignore -c "import fp8_recipes, megatron.core, hydra" || { echo "setup: install failed" >&2; exit 3; }
  echo "$WANT" > "$STAMP"
fi
