"""`speedtronic train` end to end in real subprocesses (spec §2.1, §13)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import run_command

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ROOT / "configs" / "smoke.yaml"
COMPLETED = re.compile(r"^completed steps=(\d+) samples=(\d+) tokens=(\d+) loss=(\S+)$")


def speedtronic(
    *args: str, cwd: Path | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return run_command(
        [sys.executable, "-m", "speedtronic", *args],
        cwd=cwd or ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def completed(proc: subprocess.CompletedProcess) -> tuple[int, int, int, str]:
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("completed ")]
    assert len(lines) == 1, proc.stdout[-3000:]
    m = COMPLETED.match(lines[0])
    assert m, lines[0]
    return int(m[1]), int(m[2]), int(m[3]), m[4]


def smoke_config(tmp_path: Path, name: str = "cfg.yaml", **sections) -> Path:
    raw = yaml.safe_load(SMOKE.read_text())
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def one_error_line(proc: subprocess.CompletedProcess, *needles: str) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("speedtronic: error:")]
    assert len(errors) == 1, proc.stderr
    for needle in needles:
        assert needle in proc.stderr, (needle, proc.stderr)
    return errors[0]


def test_smoke_trains_saves_and_resumes_without_updates(tmp_path):
    out = tmp_path / "out"
    steps, samples, tokens, loss = completed(
        speedtronic("train", "--config", str(SMOKE), "--device", "cpu", "--output-dir", str(out))
    )
    assert (steps, samples, tokens) == (4, 8, 256)
    assert loss != "None" and float(loss) > 0
    ck = out / "checkpoints"
    assert sorted(p.name for p in ck.glob("step_*.pt")) == [
        "step_000000000002.pt",
        "step_000000000004.pt",
    ]
    pointer = json.loads((ck / "latest.json").read_text())
    assert (pointer["step"], pointer["file"]) == (4, "step_000000000004.pt")
    stamp = (ck / "step_000000000004.pt").stat().st_mtime_ns

    again = speedtronic(
        "train", "--config", str(SMOKE), "--device", "cpu", "--output-dir", str(out), "--resume"
    )
    assert again.returncode == 0, again.stderr[-3000:]
    # no update: the closing line says so, and no completed line reports `loss=None`
    assert "loss=None" not in again.stdout and "completed " not in again.stdout, again.stdout
    assert re.search(r"^done: step 4 in \d\d:\d\d \| no update made$", again.stdout, re.M)
    # a no-op resume rewrites nothing
    assert (ck / "step_000000000004.pt").stat().st_mtime_ns == stamp


def test_two_phase_demo_reaches_the_same_counters(tmp_path):
    out = tmp_path / "out"
    first = completed(
        speedtronic(
            "train",
            "--config",
            str(SMOKE),
            "--device",
            "cpu",
            "--output-dir",
            str(out),
            "--max-steps",
            "2",
        )
    )
    assert first[:3] == (2, 4, 128)
    second = completed(
        speedtronic(
            "train",
            "--config",
            str(SMOKE),
            "--device",
            "cpu",
            "--output-dir",
            str(out),
            "--max-steps",
            "4",
            "--resume",
        )
    )
    assert second[:3] == (4, 8, 256) and second[3] != "None"


def test_jsonl_lines_parse_and_hold_the_event_catalogue(tmp_path):
    jsonl = tmp_path / "metrics.jsonl"
    cfg = smoke_config(tmp_path, logging={"json_file": str(jsonl)})
    completed(
        speedtronic(
            "train", "--config", str(cfg), "--device", "cpu", "--output-dir", str(tmp_path / "o")
        )
    )
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    events = [r["event"] for r in records]
    for needed in ("optimizer", "train_start", "train_step", "checkpoint", "train_end"):
        assert needed in events, (needed, events)
    assert events.index("train_start") < events.index("train_step") < events.index("train_end")
    steps = [r for r in records if r["event"] == "train_step"]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for key in (
        "loss",
        "lr",
        "steps_per_sec",
        "samples_per_sec",
        "tokens_per_sec",
        "samples",
        "tokens",
        "micro_batches",
    ):
        assert key in steps[0], key
    start = records[events.index("train_start")]
    assert (start["start_step"], start["target_step"], start["precision"]) == (0, 4, "fp32")
    assert [r["step"] for r in records if r["event"] == "checkpoint"] == [2, 4]


def test_tensorboard_dir_from_yaml_gets_event_files(tmp_path):
    tb = tmp_path / "tb"
    cfg = smoke_config(tmp_path, logging={"tensorboard_dir": str(tb)})
    completed(
        speedtronic(
            "train", "--config", str(cfg), "--device", "cpu", "--output-dir", str(tmp_path / "o")
        )
    )
    files = list(tb.rglob("events.out.tfevents.*"))
    assert files and all(f.stat().st_size > 0 for f in files)


def test_loss_plot_is_written_beside_the_metrics(tmp_path):
    out = tmp_path / "out"
    completed(
        speedtronic("train", "--config", str(SMOKE), "--device", "cpu", "--output-dir", str(out))
    )
    png = out / "loss_curve.png"  # no metrics file: in run.output_dir
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (out / "checkpoints" / "loss_curve.png").exists()
    cfg = smoke_config(tmp_path, logging={"json_file": str(tmp_path / "logs" / "metrics.jsonl")})
    completed(
        speedtronic(
            "train", "--config", str(cfg), "--device", "cpu", "--output-dir", str(tmp_path / "o")
        )
    )
    assert (tmp_path / "logs" / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_config_is_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("run:\n  max_stepz: 3\n")
    one_error_line(speedtronic("train", "--config", str(bad)), "max_stepz")


def test_missing_text_file_is_one_line(tmp_path):
    cfg = smoke_config(tmp_path, data={"text_path": str(tmp_path / "nowhere.txt")})
    one_error_line(
        speedtronic(
            "train", "--config", str(cfg), "--device", "cpu", "--output-dir", str(tmp_path / "o")
        ),
        "nowhere.txt",
    )


def test_corrupt_only_checkpoint_is_one_line(tmp_path):
    out = tmp_path / "out"
    ck = out / "checkpoints"
    ck.mkdir(parents=True)
    (ck / "step_000000000002.pt").write_bytes(b"this is not a checkpoint")
    one_error_line(
        speedtronic(
            "train", "--config", str(SMOKE), "--device", "cpu", "--output-dir", str(out), "--resume"
        ),
        "step_000000000002.pt",
    )


def test_adamw_checkpoint_resumed_with_muon_is_refused_with_one_line(tmp_path):
    out = tmp_path / "out"
    completed(
        speedtronic(
            "train",
            "--config",
            str(SMOKE),
            "--device",
            "cpu",
            "--output-dir",
            str(out),
            "--max-steps",
            "2",
        )
    )
    cfg = smoke_config(tmp_path, optimizer={"name": "muon"})
    one_error_line(
        speedtronic(
            "train", "--config", str(cfg), "--device", "cpu", "--output-dir", str(out), "--resume"
        ),
        "optimizer.name: saved 'adamw', now 'muon'",
        "another optimizer",
        "Resume with the saved values",
    )


def test_resume_with_another_width_names_the_config_value_first(tmp_path):
    out = tmp_path / "out"
    completed(
        speedtronic(
            "train",
            "--config",
            str(SMOKE),
            "--device",
            "cpu",
            "--output-dir",
            str(out),
            "--max-steps",
            "2",
        )
    )
    narrow = smoke_config(tmp_path, model={"d_model": 32})
    line = one_error_line(
        speedtronic(
            "train",
            "--config",
            str(narrow),
            "--device",
            "cpu",
            "--output-dir",
            str(out),
            "--resume",
        ),
        "step_000000000002.pt",
    )
    assert "- model.d_model: saved 64 vs current 32 -" in line, line
    assert "more tensors with a different shape" in line and len(line) < 1500, line
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*.pt")) == [
        "step_000000000002.pt"
    ]
