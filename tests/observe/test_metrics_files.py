"""A run's own files around the training — the JSONL metrics, the loss plot, the folders they go to
— as real runs of the CLI meet them: a record cut short by a kill, a second run on the same file, a
plot that cannot be written, a log folder on a read-only filesystem."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import cli_env, communicate_or_dump, ok, one_error_line, run_cli, tiny_config
from conftest import spawn


def warnings_of(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("speedtronic: warning:")]


def parsed(path: Path) -> list[dict]:
    "Every line of a JSONL file, parsed: a line that is not JSON fails the test."
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_record_cut_short_by_a_kill_does_not_swallow_the_resumed_runs_first(tmp_path):
    cfg = tiny_config(tmp_path)
    ok(run_cli("train", "--config", str(cfg), "--device", "cpu", cwd=tmp_path))
    metrics = tmp_path / "metrics.jsonl"
    whole = metrics.read_bytes()
    metrics.write_bytes(whole + b'{"event": "train_step", "step": 5, "lo')  # a kill mid-write
    args = ["train", "--config", str(cfg), "--device", "cpu", "--resume", "--max-steps", "6"]
    proc = ok(run_cli(*args, cwd=tmp_path))
    records = parsed(metrics)  # every line parses
    assert metrics.read_bytes().startswith(whole)  # the whole records before stay as they were
    steps = [r["step"] for r in records if r["event"] == "train_step"]
    assert steps == [1, 2, 3, 4, 5, 6], steps
    cut = [w for w in warnings_of(proc) if "cut short" in w]
    assert len(cut) == 1 and str(metrics) in cut[0], proc.stderr


def test_a_second_run_on_the_same_json_file_is_warned_naming_the_first(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    first = tiny_config(tmp_path, "first.yaml", max_steps=100_000, every_steps=100_000)
    second = tiny_config(
        tmp_path, "second.yaml", max_steps=2, run={"output_dir": str(tmp_path / "out2")}
    )
    args = [sys.executable, "-m", "speedtronic", "train", "--config", str(first), "--device", "cpu"]
    running = spawn(
        args,
        cwd=tmp_path,
        env=cli_env(PYTHONUNBUFFERED="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while '"train_step"' not in (metrics.read_text() if metrics.exists() else ""):
            assert running.poll() is None and time.monotonic() < deadline, "first run never trained"
            time.sleep(0.2)
        first_id = parsed_prefix(metrics)[0]["run_id"]
        proc = ok(run_cli("train", "--config", str(second), "--device", "cpu", cwd=tmp_path))
    finally:
        with contextlib.suppress(ProcessLookupError):
            running.send_signal(signal.SIGINT)
        communicate_or_dump(running, 120)
    shared = [w for w in warnings_of(proc) if "another process" in w]
    assert len(shared) == 1, proc.stderr
    assert str(metrics) in shared[0] and f"run {first_id}" in shared[0], shared[0]


def parsed_prefix(path: Path) -> list[dict]:
    """The records of a JSONL file another process is still appending to (its last line may be in
    flight)."""
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def test_a_loss_plot_that_cannot_be_written_is_a_warning_and_the_run_succeeds(tmp_path):
    # No full disk here: a directory where loss_curve.png should go makes the write fail the same
    # way.
    cfg = tiny_config(tmp_path, logging={"loss_plot": True})
    (tmp_path / "loss_curve.png").mkdir()
    proc = ok(run_cli("train", "--config", str(cfg), "--device", "cpu", cwd=tmp_path))
    plot = [w for w in warnings_of(proc) if "loss_curve.png" in w]
    assert len(plot) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert (tmp_path / "out" / "checkpoints" / "step_000000000004.pt").is_file()
    assert [
        r["step"] for r in parsed(tmp_path / "metrics.jsonl") if r["event"] == "train_step"
    ] == [
        1,
        2,
        3,
        4,
    ]
    assert list((tmp_path / "loss_curve.png").iterdir()) == []  # nothing half-written left in it


@contextlib.contextmanager
def read_only_folder(path: Path):
    "`path` as a read-only filesystem (a tmpfs mounted ro), else a folder without write permission."
    path.mkdir()
    mounted = os.geteuid() == 0 and (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=64k,ro", "tmpfs", str(path)], capture_output=True
        ).returncode
        == 0
    )
    if not mounted:
        if os.geteuid() == 0:
            pytest.skip("needs a read-only folder: root here, and tmpfs cannot be mounted")
        path.chmod(0o555)
    try:
        yield path
    finally:
        if mounted:
            subprocess.run(["umount", str(path)], check=True)
        else:
            path.chmod(0o755)


def test_deep_validation_refuses_a_json_log_on_a_read_only_filesystem_as_train_does(tmp_path):
    with read_only_folder(tmp_path / "ro") as ro:
        cfg = tiny_config(tmp_path, logging={"json_file": str(ro / "logs" / "metrics.jsonl")})
        deep = ["validate", "--config", str(cfg), "--deep", "--device", "cpu"]
        one_error_line(run_cli(*deep, cwd=tmp_path), "logging.json_file", str(ro))
        train = ["train", "--config", str(cfg), "--device", "cpu"]
        one_error_line(run_cli(*train, cwd=tmp_path), "logging.json_file", str(ro))
        log = tiny_config(tmp_path, "log.yaml", logging={"file": str(ro / "train.log")})
        one_error_line(
            run_cli("validate", "--config", str(log), "--deep", "--device", "cpu", cwd=tmp_path),
            "logging.file",
        )
