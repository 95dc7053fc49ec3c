#!/usr/bin/env bash
# Install Speedtronic into ./.venv (created when missing).
#   bash tools/setup.sh        runtime + matplotlib (the demo writes a loss curve)
#   bash tools/setup.sh dev    + notebook, test, docs and logging tools
# When the environment has no torch yet, torch==2.13.0 is installed first: on this project's
# machines that is a local CPU wheel, and it keeps pip from pulling a multi-GB CUDA build for
# the package's own `torch>=2.1` range. Bring your own torch build by installing it first.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
py=.venv/bin/python
$py -m pip install -q --upgrade pip
if ! $py -c "import torch" >/dev/null 2>&1; then
  $py -m pip install -q torch==2.13.0
fi
if [ "${1:-}" = "dev" ]; then
  $py -m pip install -q -e ".[dev,logging]"
else
  $py -m pip install -q -e ".[plot]"
fi
# The notebooks name the kernel `python3` with display name `python3`, which is what `nbdev_clean` writes.
# JupyterLab writes its kernel's display name into a notebook it opens, so this environment's python3
# kernel shows that same name: the shipped notebooks then open unmodified here.
if $py -c "import ipykernel" >/dev/null 2>&1; then
  $py -m ipykernel install --sys-prefix --name python3 --display-name python3 >/dev/null \
    || echo "note: could not set the python3 kernel's display name in .venv; the notebooks open marked modified" >&2
fi
echo "speedtronic installed in .venv ($($py -c 'import speedtronic; print(speedtronic.__version__)'))"
