#!/usr/bin/env bash
# The whole test suite (what the README and CI run):
#   1. notebooks and package agree: nbdev_export and nbdev_clean change no tracked file, and every notebook
#      holds the kernel metadata JupyterLab writes (checked by tools/check_notebooks.py);
#   2. every notebook's tests (nbdev_test);
#   3. the pytest suites in tests/ (CLI, multi-process, fault injection, docs build).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d .venv/bin ] && export PATH="$PWD/.venv/bin:$PATH"
export PYTHONHASHSEED=0 MPLBACKEND=Agg

echo "== export/clean check"
before=$(git status --porcelain 2>/dev/null || true)
nbdev_export
nbdev_clean
after=$(git status --porcelain 2>/dev/null || true)
if [ "$before" != "$after" ]; then
  echo "nbdev_export or nbdev_clean changed files: commit the exported package and cleaned notebooks" >&2
  diff <(echo "$before") <(echo "$after") >&2 || true
  git diff --stat >&2 || true
  exit 1
fi

python tools/check_notebooks.py
python tools/make_readme.py --check

echo "== nbdev_test"
start=$(date +%s)
nbdev_test --n_workers 2 --timing
echo "nbdev_test took $(( $(date +%s) - start ))s"

echo "== pytest"
python -m pytest -q -p no:cacheprovider tests
