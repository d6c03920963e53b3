# Sourced by scripts/setup.sh and scripts/lock.sh: find_python prints a Python 3.12 interpreter ($PYTHON first).
find_python() {
  for c in "${PYTHON:-}" python3.12 "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12 /usr/bin/python3.12 /usr/local/bin/python3.12; do
    [ -n "$c" ] || continue
    if "$c" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' >/dev/null 2>&1; then echo "$c"; return 0; fi
  done
  return 1
}
