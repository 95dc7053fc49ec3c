"""One run per output directory: a fresh run does not take over another run's checkpoints, two
trainers do not share a directory, every run has an id that survives resumes and is in every JSONL
record."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from speedtronic.checkpoint import load_checkpoint

from conftest import cli_env, one_error_line, ok, run_cli, tiny_config
from conftest import spawn


tiny_yaml = tiny_config
error_line = one_error_line


def env() -> dict:
    return cli_env(PYTHONUNBUFFERED="1")


def cli(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return run_cli(*args, cwd=cwd, env={"PYTHONUNBUFFERED": "1"}, timeout=timeout)


def snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


def records(jsonl: Path) -> list[dict]:
    return [json.loads(line) for line in jsonl.read_text().splitlines()] if jsonl.exists() else []


def test_a_fresh_run_refuses_another_runs_checkpoints(tmp_path):
    a = tiny_yaml(tmp_path, "a.yaml")
    ok(cli("train", "--config", str(a), "--device", "cpu", cwd=tmp_path))
    ck = tmp_path / "out" / "checkpoints"
    before = snapshot(ck)
    b = tiny_yaml(tmp_path, "b.yaml", run={"seed": 99})
    line = error_line(cli("train", "--config", str(b), "--device", "cpu", cwd=tmp_path))
    assert (
        "already holds checkpoints of run " in line and "--resume" in line and "--overwrite" in line
    ), line
    assert snapshot(ck) == before  # run A's files untouched


def test_overwrite_starts_over_and_resume_continues_the_new_run(tmp_path):
    a = tiny_yaml(tmp_path, "a.yaml")
    ok(cli("train", "--config", str(a), "--device", "cpu", cwd=tmp_path))
    ck = tmp_path / "out" / "checkpoints"
    run_a = json.loads((ck / "latest.json").read_text())["run_id"]
    b = tiny_yaml(tmp_path, "b.yaml", run={"seed": 99, "max_steps": 2})
    ok(cli("train", "--config", str(b), "--device", "cpu", "--overwrite", cwd=tmp_path))
    pointer = json.loads((ck / "latest.json").read_text())
    run_b = pointer["run_id"]
    assert run_b != run_a and pointer["written"] == ["step_000000000002.pt"]
    assert sorted(p.name for p in ck.glob("step_*.pt")) == ["step_000000000002.pt"]
    ok(
        cli(
            "train",
            "--config",
            str(b),
            "--device",
            "cpu",
            "--resume",
            "--max-steps",
            "4",
            cwd=tmp_path,
        )
    )
    assert json.loads((ck / "latest.json").read_text())["run_id"] == run_b  # kept across the resume
    assert load_checkpoint(ck / "step_000000000004.pt")["run_id"] == run_b
    by_run = {}
    for r in records(tmp_path / "metrics.jsonl"):
        by_run.setdefault(r["run_id"], []).append(r)  # every record has one
    assert set(by_run) == {run_b}  # --overwrite started the metrics file over: one run (issue 27)
    assert [r["step"] for r in by_run[run_b] if r["event"] == "train_step"] == [1, 2, 3, 4]
    line = error_line(
        cli("train", "--config", str(b), "--device", "cpu", "--resume", "--overwrite", cwd=tmp_path)
    )
    assert "cannot be combined" in line


def test_empty_output_dir_is_an_error(tmp_path):
    proc = cli("train", "--config", str(tiny_yaml(tmp_path)), "--output-dir", "", cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "argument --output-dir: must not be empty" in proc.stderr
    assert not (tmp_path / "runs").exists() and not (tmp_path / "out").exists()
    bad = tiny_yaml(tmp_path, "blank.yaml", run={"output_dir": ""})
    assert "run.output_dir: must not be empty" in error_line(
        cli("validate", "--config", str(bad), cwd=tmp_path)
    )


def wait_for_step(proc: subprocess.Popen, jsonl: Path, step: int = 1, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(r.get("event") == "train_step" and r["step"] >= step for r in records(jsonl)):
            return
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        time.sleep(0.05)
    raise AssertionError(f"step {step} never appeared in {jsonl}")


def test_a_second_trainer_on_the_same_directory_exits_2_naming_the_first(tmp_path):
    long = tiny_yaml(
        tmp_path, "long.yaml", run={"max_steps": 100_000}, checkpoint={"every_steps": 100_000}
    )
    first = spawn(
        [sys.executable, "-m", "speedtronic", "train", "--config", str(long), "--device", "cpu"],
        cwd=tmp_path,
        env=env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for_step(first, tmp_path / "metrics.jsonl")
        run_id = next(r["run_id"] for r in records(tmp_path / "metrics.jsonl"))
        for extra in ([], ["--resume"], ["--overwrite"]):
            line = error_line(
                cli("train", "--config", str(long), "--device", "cpu", *extra, cwd=tmp_path)
            )
            assert (
                "is in use by another training process" in line
                and f"run {run_id} (pid {first.pid}" in line
            ), line
        deep = cli("validate", "--config", str(long), "--deep", "--device", "cpu", cwd=tmp_path)
        assert (
            deep.returncode == 2
            and f"is in use by another training process: run {run_id} (pid {first.pid}"
            in deep.stderr
        )
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=120)
    ck = tmp_path / "out" / "checkpoints"
    # nothing of the refused ones
    assert {r["run_id"] for r in records(tmp_path / "metrics.jsonl")} == {run_id}
    assert (
        load_checkpoint(ck / json.loads((ck / "latest.json").read_text())["file"])["run_id"]
        == run_id
    )
    assert not (tmp_path / "out" / ".speedtronic.lock").exists()  # released on exit


def test_a_lock_left_by_kill_9_does_not_block_the_next_run(tmp_path):
    long = tiny_yaml(
        tmp_path, "long.yaml", run={"max_steps": 100_000}, checkpoint={"every_steps": 1}
    )
    first = spawn(
        [sys.executable, "-m", "speedtronic", "train", "--config", str(long), "--device", "cpu"],
        cwd=tmp_path,
        env=env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for_step(first, tmp_path / "metrics.jsonl", step=2)
    first.kill()
    first.communicate(timeout=60)
    assert (tmp_path / "out" / ".speedtronic.lock").exists()
    again = ok(
        cli(
            "train",
            "--config",
            str(long),
            "--device",
            "cpu",
            "--resume",
            "--max-steps",
            "4",
            cwd=tmp_path,
        )
    )
    assert f"pid {first.pid}" in again.stdout and "ended without releasing it" in again.stdout, (
        again.stdout[-3000:]
    )


DEMO = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"


def test_the_readme_demo_trains_and_a_moved_run_takes_every_output_along(tmp_path):
    # The README's first command, shortened with --max-steps (its 20-update warmup then spans the
    # whole run).
    first = ok(cli("train", "--config", str(DEMO), "--max-steps", "20", cwd=tmp_path))
    demo = tmp_path / "runs" / "demo"
    assert first.stdout.splitlines()[-1].startswith(
        "completed steps=20 samples=640 tokens=40960 loss="
    )
    assert float(first.stdout.split("loss=")[-1]) < 5.0  # it learned something from the text
    assert [r["step"] for r in records(demo / "metrics.jsonl") if r["event"] == "train_step"] == [
        10,
        20,
    ]
    assert (demo / "loss_curve.png").read_bytes()[:4] == b"\x89PNG"
    before = snapshot(demo)
    ok(
        cli(
            "train",
            "--config",
            str(DEMO),
            "--max-steps",
            "20",
            "--output-dir",
            "runs/x",
            cwd=tmp_path,
        )
    )
    moved = tmp_path / "runs" / "x"
    assert snapshot(demo) == before  # the first run's files are untouched
    lines = records(moved / "metrics.jsonl")
    assert len({r["run_id"] for r in lines}) == 1 and [
        r["step"] for r in lines if r["event"] == "train_step"
    ] == [10, 20]
    assert (moved / "loss_curve.png").exists() and sorted(
        p.name for p in (moved / "checkpoints").glob("step_*.pt")
    )


def test_relative_logging_paths_follow_the_output_dir_absolute_ones_stay(tmp_path):
    cfg = tiny_yaml(
        tmp_path,
        "logs.yaml",
        metrics=False,
        run={"output_dir": "runs/a"},
        logging={
            "json_file": "runs/a/metrics.jsonl",
            "file": "logs/train.log",
            "tensorboard_dir": "runs/a/tb",
        },
    )
    ok(
        cli(
            "train", "--config", str(cfg), "--device", "cpu", "--output-dir", "runs/b", cwd=tmp_path
        )
    )
    b = tmp_path / "runs" / "b"
    assert records(b / "metrics.jsonl") and (b / "logs" / "train.log").read_text()
    assert list((b / "tb").glob("events.out.tfevents.*"))
    assert not (tmp_path / "runs" / "a").exists() and not (tmp_path / "logs").exists()
    mine = tiny_yaml(
        tmp_path,
        "mine.yaml",
        metrics=False,
        run={"output_dir": "runs/a"},
        logging={"json_file": str(tmp_path / "all.jsonl")},
    )
    ok(
        cli(
            "train",
            "--config",
            str(mine),
            "--device",
            "cpu",
            "--output-dir",
            "runs/c",
            cwd=tmp_path,
        )
    )
    assert records(tmp_path / "all.jsonl") and not (tmp_path / "runs" / "c" / "all.jsonl").exists()


def test_a_missing_tokenizer_or_init_from_folder_is_found_before_the_run_directory_is_made(
    tmp_path,
):
    (tmp_path / "a.txt").write_text("some text to learn from\n" * 40)
    for key, section, value in [
        ("data.tokenizer: file not found", "data", {"text_path": "a.txt", "tokenizer": "tok.json"}),
        ("model.init_from: folder not found", "model", {"init_from": "llama"}),
    ]:
        cfg = tiny_yaml(tmp_path, "named.yaml", **{section: value})
        proc = cli("train", "--config", str(cfg), "--device", "cpu", cwd=tmp_path)
        # nothing made for a run that cannot start
        assert not (tmp_path / "out").exists(), proc.stderr
        error_line(proc, key)


def test_a_run_refused_while_its_components_are_built_leaves_no_folder_and_validate_deep_finds_it(
    tmp_path,
):
    # A held-out source too small, or a split that leaves nothing to train on: found after the
    # claim, which made the folder.
    (tmp_path / "short.txt").write_text("ab\n")
    (tmp_path / "a.txt").write_text("x" * 40)
    for key, data, evaluation in [
        ("eval.text_path 'short.txt' holds 3 tokens", {}, {"text_path": "short.txt"}),
        ("eval.holdout_fraction 0.9", {"text_path": "a.txt"}, {"holdout_fraction": 0.9}),
    ]:
        cfg = tiny_yaml(
            tmp_path,
            "late.yaml",
            metrics=False,
            data=data,
            eval=evaluation,
            logging={"json_file": "runs/late/metrics.jsonl"},
            run={"output_dir": "runs/late"},
        )
        proc = cli("train", "--config", str(cfg), "--device", "cpu", cwd=tmp_path)
        assert not (tmp_path / "runs").exists(), (
            proc.stderr,
            sorted(str(p) for p in (tmp_path / "runs").rglob("*")),
        )
        error_line(proc, key)
        # found by the deep check too
        deep = cli("validate", "--config", str(cfg), "--deep", "--device", "cpu", cwd=tmp_path)
        assert deep.returncode == 2 and key in deep.stderr, deep.stderr[-2000:]
