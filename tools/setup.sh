#!/usr/bin/env bash
# Install Speedtronic into ./.venv (created when missing).
#   bash tools/setup.sh        runtime + matplotlib (the demo writes a loss curve)
#   bash tools/setup.sh hf     + transformers (what loads `speedtronic export`'s folder)
#   bash tools/setup.sh dev    + notebook, test, docs and logging tools, and Debian's Chromium
#                              for the browser tests (installed with apt-get where this user may:
#                              root, or password-less sudo; elsewhere a note says how, and the
#                              test summary lists the browser tests as skipped)
# When the environment has no torch yet, torch==2.13.0 is installed first: on this project's
# machines that is a local CPU wheel, and it keeps pip from pulling a multi-GB CUDA build for
# the package's own `torch>=2.1` range. Bring your own torch build by installing it first.
set -euo pipefail
cd "$(dirname "$0")/.."

have_browser() {
  command -v chromium || command -v chromium-browser || command -v google-chrome
} >/dev/null 2>&1

# The browser tests drive Debian's chromium with the playwright package (which brings no browser of
# its own).
install_browser() {
  have_browser && return 0
  local sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo -n"
  if command -v apt-get >/dev/null 2>&1 && { [ -z "$sudo" ] || sudo -n true 2>/dev/null; }; then
    echo "+ apt-get install chromium (for the browser tests)"
    if $sudo apt-get update -qq >/dev/null \
       && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq chromium >/dev/null \
       && have_browser; then return 0; fi
  fi
  echo "note: no chromium here and it could not be installed (needs root or sudo, and apt-get):" \
       "the browser tests will be skipped; install Debian's chromium package to run them" >&2
}
[ -x .venv/bin/python ] || python3 -m venv .venv
py=.venv/bin/python
# pip's and setuptools' own chatter (index notes, build warnings) goes to a log, shown when a step
# fails
log=.venv/setup.log
: >"$log"
quietly() {
  "$@" >>"$log" 2>&1 && return 0
  echo "setup failed: $* (the last lines of $log):" >&2
  tail -n 25 "$log" >&2
  return 1
}
echo "installing into .venv (pip's output: $log)"
quietly $py -m pip install -q --upgrade pip
if ! $py -c "import torch" >/dev/null 2>&1; then
  quietly $py -m pip install -q torch==2.13.0
fi
if [ "${1:-}" = "dev" ]; then
  quietly $py -m pip install -q -e ".[dev,logging]"
  install_browser
elif [ "${1:-}" = "hf" ]; then
  quietly $py -m pip install -q -e ".[plot,hf]"
else
  quietly $py -m pip install -q -e ".[plot]"
fi
# The notebooks name the kernel `python3` with display name `python3`, which is what `nbdev_clean`
# writes. JupyterLab writes its kernel's display name into a notebook it opens, so this
# environment's python3 kernel shows that same name: the shipped notebooks then open unmodified
# here.
if $py -c "import ipykernel" >/dev/null 2>&1; then
  $py -m ipykernel install --sys-prefix --name python3 --display-name python3 >/dev/null \
    || echo "note: could not set the python3 kernel's display name in .venv;" \
            "the notebooks open marked modified" >&2
fi
version=$($py -c 'import speedtronic; print(speedtronic.__version__)')
echo "speedtronic installed in .venv ($version)"
