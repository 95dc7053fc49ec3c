"""Every writer cleans up after itself: the last step record survives an interrupt, a full disk
never tears a JSONL line and the error names the file, an interrupted `prepare` leaves no temp file,
and checkpoints a kill or a lost `latest.json` left unlisted are still pruned."""

from __future__ import annotations

import functools
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from speedtronic.checkpoint import load_checkpoint

from conftest import cli_env, ok, run_cli, tiny_config
from conftest import spawn


tiny_yaml = functools.partial(tiny_config, every_steps=1)  # a checkpoint at every step


def env() -> dict:
    return cli_env(PYTHONDONTWRITEBYTECODE="1")


def cli(*args: str, cwd: Path, **popen) -> subprocess.CompletedProcess:
    return run_cli(*args, cwd=cwd, env={"PYTHONDONTWRITEBYTECODE": "1"}, **popen)


def records(jsonl: Path, event: str = "train_step") -> list[dict]:
    if not jsonl.exists():
        return []
    return [r for r in map(json.loads, jsonl.read_text().splitlines()) if r["event"] == event]


def start(cfg: Path, cwd: Path) -> subprocess.Popen:
    return spawn(
        [sys.executable, "-m", "speedtronic", "train", "--config", str(cfg), "--device", "cpu"],
        cwd=cwd,
        env=env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_step(proc, jsonl: Path, step: int, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if any(r["step"] >= step for r in records(jsonl)):
                return
        except json.JSONDecodeError:
            pass
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        time.sleep(0.02)
    proc.kill()
    raise AssertionError(f"step {step} never appeared")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_the_step_a_run_stops_at_is_in_the_jsonl(tmp_path, sig):
    cfg = tiny_yaml(
        tmp_path,
        run={"max_steps": 100_000},
        checkpoint={"every_steps": 1},
        logging={"every_steps": 10},
    )
    proc = start(cfg, tmp_path)
    wait_for_step(proc, tmp_path / "metrics.jsonl", 10)
    time.sleep(0.3)  # somewhere between two logged steps
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "Traceback" not in err, err[-3000:]
    text = (tmp_path / "metrics.jsonl").read_text()
    assert text.endswith("\n")
    logged = [r["step"] for r in records(tmp_path / "metrics.jsonl")]
    pointer = json.loads((tmp_path / "out" / "checkpoints" / "latest.json").read_text())
    # the last completed (and saved) step has its record
    assert logged[-1] == pointer["step"], (
        pointer,
        logged,
    )


def limit_file_size(limit: int):
    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="needs RLIMIT_FSIZE")
def test_a_full_disk_leaves_whole_jsonl_lines_and_names_the_file(tmp_path):
    jsonl = tmp_path / "metrics.jsonl"
    cfg = tiny_yaml(tmp_path, run={"max_steps": 200}, checkpoint={"enabled": False})
    proc = cli(
        "train",
        "--config",
        str(cfg),
        "--device",
        "cpu",
        cwd=tmp_path,
        preexec_fn=limit_file_size(6000),
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("speedtronic: error:")]
    assert len(errors) == 1 and f"logging.json_file: cannot append to {jsonl}" in errors[0], (
        proc.stderr
    )
    text = jsonl.read_text()
    assert text.endswith("\n") and len(text) <= 6000
    assert all(json.loads(line) for line in text.splitlines())  # every line whole


def test_sigterm_during_prepare_leaves_no_temp_file(tmp_path):
    big = tmp_path / "big.txt"
    big.write_text("the quick brown fox jumps over the lazy dog\n" * 400_000)
    out = tmp_path / "tokens"
    proc = spawn(
        [sys.executable, "-m", "speedtronic", "prepare", str(big), str(out / "big.bin")],
        cwd=tmp_path,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not (out.exists() and any(out.iterdir())):
        assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()
        time.sleep(0.005)
    proc.send_signal(signal.SIGSTOP)  # frozen while its temp file is there: it cannot finish first
    writing = sorted(p.name for p in out.iterdir())
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGCONT)
    _, err = proc.communicate(timeout=120)
    # it was stopped before writing its outputs
    assert writing and not {"big.bin", "big.json"} & set(writing), writing
    assert (
        proc.returncode == 143
        and err.strip().splitlines()[-1] == "speedtronic: error: terminated (SIGTERM)"
    ), err
    assert list(out.iterdir()) == []


def test_a_killed_prepare_leaves_nothing_once_it_is_run_again(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("hello world\n" * 1000)
    out = tmp_path / "tokens"
    out.mkdir()
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    ).stdout.strip()
    # what SIGKILL leaves behind
    (out / f".t.bin.tmp-{dead}-0123abcd").write_bytes(b"half a token file")
    ok(cli("prepare", str(text), str(out / "t.bin"), "--no-progress", cwd=tmp_path))
    assert sorted(p.name for p in out.iterdir()) == ["t.bin", "t.bin.json"]


def names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob("step_*.pt"))


def test_a_checkpoint_written_just_before_a_kill_is_pruned_later(tmp_path):
    cfg = tiny_yaml(tmp_path)
    ok(cli("train", "--config", str(cfg), "--device", "cpu", cwd=tmp_path))
    ck = tmp_path / "out" / "checkpoints"
    assert names(ck) == ["step_000000000003.pt", "step_000000000004.pt"]
    state = load_checkpoint(ck / "step_000000000004.pt")
    # complete on disk, the pointer not yet updated
    torch.save({**state, "step": 5}, ck / "step_000000000005.pt")
    ok(
        cli(
            "train",
            "--config",
            str(cfg),
            "--device",
            "cpu",
            "--resume",
            "--max-steps",
            "8",
            cwd=tmp_path,
        )
    )
    assert names(ck) == ["step_000000000007.pt", "step_000000000008.pt"]


def test_checkpoints_are_pruned_after_latest_json_was_lost(tmp_path):
    cfg = tiny_yaml(tmp_path)
    ok(cli("train", "--config", str(cfg), "--device", "cpu", cwd=tmp_path))
    ck = tmp_path / "out" / "checkpoints"
    (ck / "latest.json").unlink()
    ok(
        cli(
            "train",
            "--config",
            str(cfg),
            "--device",
            "cpu",
            "--resume",
            "--max-steps",
            "8",
            cwd=tmp_path,
        )
    )
    assert names(ck) == ["step_000000000007.pt", "step_000000000008.pt"]
