"""A checkpoint directory written by Speedtronic 2.0.0 (`step_*.pt` + `latest.json`) resumes from
the CLI into another output folder (`--output-dir`), with 2.0's optimizer state mapped onto ours and
2.0's files kept.

The run is the real 2.0.0 one in `shared/fixtures/v2.0/checkpoint-adamw` (README there), copied to a
temporary folder.
"""

import shutil, stat, subprocess, sys
from pathlib import Path

import pytest
import yaml

from conftest import cli_env, jsonl_records
from conftest import run_command

ROOT = Path(__file__).resolve().parents[2]
V2 = ROOT.parent / "shared" / "fixtures" / "v2.0" / "checkpoint-adamw"


@pytest.mark.skipif(not V2.is_dir(), reason="the 2.0 fixtures (shared/fixtures/v2.0) are not here")
def test_v2_checkpoint_resumes_from_the_cli(tmp_path):
    work = tmp_path / "v2"
    shutil.copytree(V2, work)
    for p in [work, *work.rglob("*")]:
        p.chmod(p.stat().st_mode | stat.S_IWUSR)
    (work / "run").rename(work / "moved")  # the run's folder is now elsewhere
    raw = yaml.safe_load((work / "config.yaml").read_text())
    # our retention keeps one of its own files
    raw["max_steps"], raw["checkpoint"]["keep_last"] = (
        12,
        1,
    )
    (work / "config.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    res = run_command(
        [
            sys.executable,
            "-m",
            "speedtronic",
            "train",
            "--config",
            "config.yaml",
            "--device",
            "cpu",
            "--resume",
            "--output-dir",
            "moved",
        ],
        cwd=work,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert "resumed from" in res.stdout and "optimizer state written by 2.0" in res.stdout, (
        res.stdout
    )
    last = res.stdout.strip().splitlines()[-1]
    assert last.startswith("completed steps=12 samples=96 tokens=1536 loss=") and not last.endswith(
        "None"
    ), last
    saved = sorted(p.name for p in (work / "moved" / "checkpoints").glob("step_*.pt"))
    # 2.0's files are not ours to prune
    assert saved == [
        "step_000000000004.pt",
        "step_000000000008.pt",
        "step_000000000012.pt",
    ]
    # its metrics followed the folder
    assert [r["step"] for r in jsonl_records(work / "moved" / "metrics.jsonl")][8:] == [
        9,
        10,
        11,
        12,
    ]
    assert not (work / "run").exists()
