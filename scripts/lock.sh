#!/usr/bin/env bash
# Refresh scripts/constraints.txt: the lock of the CPU environment that scripts/setup.sh (and so .ci/run) installs
# from. It resolves setup.cfg's install_requires with the dev and hf extras, torch pinned, in a throwaway venv, and
# writes the version of every distribution that landed there.
#   bash scripts/lock.sh                  # torch at the GPU image's version (2.11.0)
#   TORCH=2.12.1 bash scripts/lock.sh     # another torch (then run the suite before committing the new lock)
# Takes about 3 minutes (torch and its CUDA libraries are ~4 GB); needs the package index.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
TORCH=${TORCH:-2.11.0}
source scripts/find_python.sh
PY=$(find_python) || { echo "error: python3.12 not found; set PYTHON=/path/to/python3.12" >&2; exit 2; }
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
"$PY" -m venv "$TMP/venv"
echo "lock: resolving fp8-recipes[dev,hf] with torch==$TORCH (a few minutes)" >&2
"$TMP/venv/bin/python" -m pip install -q --disable-pip-version-check --no-cache-dir "torch==$TORCH" ".[dev,hf]" \
  2>&1 | grep -v -E "^WARNING: Location|is ignored: it is neither" >&2 || true
"$TMP/venv/bin/python" -c "import torch, megatron.core, hydra" || { echo "error: the resolved set does not import" >&2; exit 3; }
{
  echo "# The CPU environment's lock: scripts/setup.sh installs with -c this file, so a fresh machine gets these"
  echo "# versions whatever the index serves today. Made by: bash scripts/lock.sh (torch==$TORCH, $(date -u +%F))"
  "$TMP/venv/bin/python" -m pip freeze --disable-pip-version-check --all --exclude-editable \
    | grep -v -i -E "^(fp8-recipes|pip)==" | LC_ALL=C sort -f
} > scripts/constraints.txt.tmp
mv scripts/constraints.txt.tmp scripts/constraints.txt
echo "lock: wrote scripts/constraints.txt ($(grep -c '==' scripts/constraints.txt) pins)" >&2
