#!/usr/bin/env bash
# The whole test suite (what the README and CI run):
#   1. notebooks and package agree: nbdev_export and nbdev_clean change no tracked file, and
#      every notebook holds the kernel metadata JupyterLab writes (tools/check_notebooks.py);
#   2. every notebook's tests (nbdev_test), run beside 3.;
#   3. the pytest suites in tests/ (CLI, multi-process, fault injection, docs build);
#   4. a plain list of what did not run: each skipped pytest test's reason (grouped) with how to
#      run it, and the notebook cells nbdev_test leaves out (`#| slow`).
#   bash tools/test_all.sh --skipped JUNIT.xml   prints only that list, for a pytest --junitxml
#   file.
set -euo pipefail
only_skipped=""; [ "${1:-}" = "--skipped" ] && only_skipped=$(realpath "$2")
cd "$(dirname "$0")/.."
[ -d .venv/bin ] && export PATH="$PWD/.venv/bin:$PATH"
# one PyTorch thread per process: the workers, nbdev_test and the commands they start run side by
# side on two cores, where PyTorch's default of a thread per core makes every process spin waiting
# for its other thread (tests/conftest.py has the measurement)
export PYTHONHASHSEED=0 MPLBACKEND=Agg OMP_NUM_THREADS=1

# What did not run, from pytest's junit file: one line per skip reason with its count and the way
# to run them.
skipped() {
  python - "$1" <<'PY'
import collections, re, sys, xml.etree.ElementTree as ET
HOW = [("chromium", "install Debian's chromium (bash tools/setup.sh dev does, as root or with "
                    "sudo; .ci/run requires it)"),
       ("playwright", "pip install playwright (in the dev extra: bash tools/setup.sh dev)"),
       ("cuda", "run on a machine with a CUDA GPU"),
       ("root", "run as a user other than root"),
       ("fixtures", "put the shared/ folder (shared/fixtures/v2.0) beside the clone, or set "
                    "SPEEDTRONIC_FIXTURES")]
reasons = collections.Counter()
for case in ET.parse(sys.argv[1]).iter("testcase"):
    for skip in case.iter("skipped"):
        reason = (skip.get("message") or "").strip()
        reasons[re.sub(r"^Skipped: ", "", reason) or "(no reason given)"] += 1
if not reasons: print("pytest: nothing skipped")
for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1]):
    how = next((h for key, h in HOW if key in reason.lower()), None)
    tests = f"{n} test{'s' if n != 1 else ''}"
    print(f"pytest: {tests} skipped: {reason}" + (f" -> to run: {how}" if how else ""))
PY
}
if [ -n "$only_skipped" ]; then skipped "$only_skipped"; exit 0; fi

echo "== export/clean check"
before=$(git status --porcelain 2>/dev/null || true)
nbdev_export
nbdev_clean
after=$(git status --porcelain 2>/dev/null || true)
if [ "$before" != "$after" ]; then
  echo "nbdev_export or nbdev_clean changed files:" \
       "commit the exported package and cleaned notebooks" >&2
  diff <(echo "$before") <(echo "$after") >&2 || true
  git diff --stat >&2 || true
  exit 1
fi

python tools/check_notebooks.py
python tools/make_readme.py --check

echo "== ruff (the formatter and a small rule set, over nbs/, tests/, bench/ and tools/)"
if ! ruff format --check --quiet . || ! ruff check --quiet .; then
  echo "ruff would change or flags the files above: run 'ruff format . && ruff check .'," \
       "then nbdev_export, and commit" >&2
  exit 1
fi

report=$(mktemp -d)
notebooks=""
trap '[ -n "$notebooks" ] && kill "$notebooks" 2>/dev/null; rm -rf "$report"' EXIT
# nbdev_test runs beside pytest (its output is shown after pytest's): pytest's workers leave a
# core partly idle while DiLoCo nodes poll and wait, and nbdev_test takes about a minute of it.
echo "== nbdev_test (beside pytest; its output follows pytest's)"
start=$(date +%s)
( nbdev_test --n_workers 1 --timing > "$report/nbdev_test.log" 2>&1
  echo "nbdev_test took $(( $(date +%s) - start ))s" >> "$report/nbdev_test.log" ) &
notebooks=$!

echo "== pytest"
rc=0
# Three workers (pytest-xdist) on two cores: the DiLoCo tests, over a third of the suite's time,
# keep a core about half busy (their nodes poll and wait), so a third worker runs other tests in
# what they leave. Four measured no faster (15.5 and 16.1 min against three's 15.9) and put the
# load at 5 to 7, which the paced DiLoCo tests need not meet. Each test file runs on
# one worker so its module fixtures (a JupyterLab, a browser) start once; the docs site is built
# once for all (tests/conftest.py). The files go out slowest first (tests/conftest.py's
# SLOWEST_FILES; --no-loadscope-reorder keeps that order). One worker: SPEEDTRONIC_TEST_WORKERS=0.
workers=${SPEEDTRONIC_TEST_WORKERS:-3}
python -m pytest -q -p no:cacheprovider -rs --durations=25 --junitxml="$report/junit.xml" \
  -n "$workers" --dist loadfile --no-loadscope-reorder tests || rc=$?
echo "== nbdev_test"
nbdev_rc=0
wait "$notebooks" || nbdev_rc=$?
notebooks=""
cat "$report/nbdev_test.log"
if [ "$nbdev_rc" != 0 ]; then
  echo "nbdev_test failed (exit $nbdev_rc): the notebooks' tests above" >&2
  [ "$rc" = 0 ] && rc=$nbdev_rc
fi
# SPEEDTRONIC_TEST_REPORT=FILE keeps pytest's junit report (each test's time, setup included)
if [ -n "${SPEEDTRONIC_TEST_REPORT:-}" ] && [ -f "$report/junit.xml" ]; then
  cp "$report/junit.xml" "$SPEEDTRONIC_TEST_REPORT"
fi

echo "== not run"
if [ -f "$report/junit.xml" ]; then
  skipped "$report/junit.xml"
else
  echo "pytest: wrote no report (exit $rc)"
fi
slow=$(grep -rl --include='*.ipynb' '#| *slow' nbs 2>/dev/null | tr '\n' ' ' || true)
if [ -n "$slow" ]; then
  echo "nbdev_test: cells marked '#| slow' were not run (in ${slow% })" \
       "-> to run: nbdev_test --flags slow"
fi
exit $rc
