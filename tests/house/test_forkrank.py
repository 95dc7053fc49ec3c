"""`tests/forkrank.py`, the stand-in torchrun starts for a rank the warm interpreter forks: it ends
as the rank ends, passes signals on, takes the rank with it when killed, and starts the rank afresh
in its own process when the server refuses it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import TESTS, fork_server

RANK = """
import os, signal, sys, time
from pathlib import Path
out = Path(sys.argv[1])
signal.signal(signal.SIGTERM, lambda *_: (out.with_suffix(".term").write_text("1"), sys.exit(7)))
out.write_text(f"{os.getpid()} {os.getppid()} {os.environ.get('RANK', '')}")
if sys.argv[2] == "wait":
    time.sleep(60)
sys.exit(int(sys.argv[2]))
"""


def stand_in(tmp: Path, how: str, env: dict | None = None) -> tuple[subprocess.Popen, Path]:
    server = fork_server()
    if server is None:
        pytest.skip("no fork server (SPEEDTRONIC_TEST_FORK=0)")
    (tmp / "rank.py").write_text(RANK)
    out = tmp / "rank.txt"
    argv = [sys.executable, "-S", TESTS / "forkrank.py", server, tmp / "rank.py", out, how]
    proc = subprocess.Popen(argv, env={**os.environ, "RANK": "1", **(env or {})})
    return proc, out


def written(out: Path) -> list[str]:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if out.exists() and len(text := out.read_text().split()) == 3:
            return text
        time.sleep(0.02)
    pytest.fail(f"the rank never wrote {out}")


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_the_stand_in_ends_with_the_rank_s_exit_code_and_the_rank_is_forked(tmp_path):
    proc, out = stand_in(tmp_path, "3")
    assert proc.wait(60) == 3
    pid, parent, rank = written(out)
    assert int(pid) != proc.pid and int(parent) != proc.pid  # forked by the server, not by it
    assert rank == "1"  # in the stand-in's environment


def test_a_sigterm_to_the_stand_in_reaches_the_rank(tmp_path):
    proc, out = stand_in(tmp_path, "wait")
    written(out)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 7  # the rank's handler ran and chose the exit code
    assert out.with_suffix(".term").exists()


def test_a_stand_in_killed_takes_its_rank_with_it(tmp_path):
    proc, out = stand_in(tmp_path, "wait")
    pid = int(written(out)[0])
    proc.kill()
    assert proc.wait(60) == -signal.SIGKILL
    deadline = time.monotonic() + 30
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not alive(pid)


def test_a_rank_the_server_refuses_runs_afresh_in_the_stand_in_itself(tmp_path):
    # a start-up setting that differs from the server's: a fresh interpreter must start it
    proc, out = stand_in(tmp_path, "4", env={"PYTHONHASHSEED": "12345"})
    assert proc.wait(120) == 4
    pid, _, _ = written(out)
    assert int(pid) == proc.pid  # exec'd in place: torchrun still watches the rank itself
