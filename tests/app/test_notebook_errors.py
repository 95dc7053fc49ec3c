"""In a notebook an expected error shows its message alone, the traceback one `%tb` away: a real
IPython shell runs the cells."""

from __future__ import annotations

import json
import re
import subprocess
import sys

from conftest import cli_env, tiny_config

SHELL = r"""
import json, sys
from IPython.core.interactiveshell import InteractiveShell
shell = InteractiveShell.instance()
for i, cell in enumerate(json.loads(sys.argv[1])):
    print(f"=== cell {i}", flush=True)
    shell.run_cell(cell, store_history=True)
    sys.stdout.flush()
"""
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def run_cells(cells: list[str], cwd) -> list[str]:
    "Each cell's printed output, from one real `InteractiveShell` that ran `cells` in order."
    proc = subprocess.run(
        [sys.executable, "-c", SHELL, json.dumps(cells)],
        cwd=cwd,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    parts = re.split(r"^=== cell \d+\n", ANSI.sub("", proc.stdout), flags=re.M)[1:]
    assert len(parts) == len(cells), proc.stdout[-3000:]
    return [p.strip() for p in parts]


def message_alone(output: str, kind: str, *needles: str) -> None:
    "`output` is `kind: message` and the `%tb` hint, with no traceback."
    lines = output.splitlines()
    assert lines[0].startswith(f"{kind}: ") and lines[-1] == "(the traceback: %tb)", output
    assert "Traceback" not in output and "File " not in output and "raise_together" not in output, (
        output
    )
    for needle in needles:
        assert needle in output, (needle, output)


def test_refused_runs_show_their_message_and_tb_shows_the_traceback(tmp_path):
    cfg = tiny_config(tmp_path, max_steps=2, every_steps=2)
    locked = tmp_path / "locked"
    holder = (
        f"import sys; from speedtronic.paths import lock_run; lock = lock_run({str(locked)!r}, "
        "'other-run'); "
        "print('held', flush=True); sys.stdin.read()"
    )
    out = run_cells(
        [
            "from speedtronic.runtime import train_from_config\nfrom speedtronic.config import "
            "SpeedtronicConfig\n"
            f"config = SpeedtronicConfig.load({str(cfg)!r})",
            "result = train_from_config(config, device='cpu')",
            "result = train_from_config(config, device='cpu')",  # the training cell run again
            "%tb",
            "SpeedtronicConfig.from_dict({'optimizer': {'lr': -1}})",
            "import subprocess, sys\n"
            f"holder = subprocess.Popen([sys.executable, '-c', {holder!r}], "
            "stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)\n"
            "assert holder.stdout.readline() == 'held\\n'",
            f"train_from_config({{**config.to_dict(), 'run': {{'output_dir': {str(locked)!r}}}}}, "
            "device='cpu')",
            "holder.stdin.close(); holder.wait()",
            "[1][2]",  # a bug keeps its traceback
        ],
        cwd=tmp_path,
    )
    assert "Traceback" not in out[1] and "Error" not in out[1], out[1]
    message_alone(
        out[2], "CheckpointError", "already holds checkpoints", "--overwrite (overwrite=True)"
    )
    assert (
        "raise_together" in out[3]
        and "claim_job" in out[3]
        and "already holds checkpoints" in out[3]
    ), out[3]
    message_alone(out[4], "ConfigError", "optimizer.lr")
    message_alone(out[6], "RunLocked", "is in use by another training process", "other-run")
    assert "Traceback" in out[8] and "IndexError" in out[8], out[8]


def test_jupyterlab_receives_the_message_alone(tmp_path):
    """What a real kernel sends JupyterLab for an expected error: the message and the hint; `%tb`
    then sends the traceback."""
    from jupyter_client.manager import KernelManager

    km = KernelManager(kernel_name="python3")
    km.start_kernel(cwd=str(tmp_path), env=cli_env())
    kc = km.client()
    try:
        kc.start_channels()
        kc.wait_for_ready(timeout=120)
        errors: list[list[str]] = []

        def run(code: str) -> None:
            kc.execute_interactive(
                code,
                timeout=120,
                output_hook=lambda msg: (
                    errors.append(msg["content"]["traceback"])
                    if msg["msg_type"] == "error"
                    else None
                ),
            )

        run(
            "from speedtronic.config import "
            "SpeedtronicConfig\nSpeedtronicConfig.from_dict({'optimizer': {'lr': -1}})"
        )
        run("%tb")
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    shown, again = ([ANSI.sub("", line) for line in tb] for tb in errors)
    assert (
        len(shown) == 2 and shown[0].startswith("ConfigError: ") and "optimizer.lr" in shown[0]
    ), shown
    assert shown[1] == "(the traceback: %tb)", shown
    assert any("from_dict" in line for line in again) and "ConfigError" in "\n".join(again), again
