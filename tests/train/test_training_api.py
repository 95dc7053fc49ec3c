"""The Python training API as a user drives it: train_from_config, Trainer with a plain DataLoader
(spec §7, §8)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from speedtronic.checkpoint import CheckpointError, CheckpointManager
from speedtronic.profiling import MetricLogger
from speedtronic.runtime import train_from_config
from speedtronic.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]


def smoke(tmp_path: Path, **sections) -> dict:
    raw = yaml.safe_load((ROOT / "configs" / "smoke.yaml").read_text())
    raw["run"]["output_dir"] = str(tmp_path / "out")
    raw["logging"]["progress"] = False
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    return raw


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x, y):
        return nn.functional.mse_loss(self.lin(x).squeeze(-1), y)


def regressor_trainer(manager: CheckpointManager, max_steps: int) -> Trainer:
    torch.manual_seed(0)
    model = Regressor()
    loader = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64)), batch_size=4)
    return Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        loader,
        device="cpu",
        logger=MetricLogger(stream=False),
        checkpoint_manager=manager,
        max_steps=max_steps,
    )


def test_checkpoint_directory_under_a_file_fails_before_training(tmp_path):
    blocker = tmp_path / "ck"
    blocker.write_text("a file where the checkpoint folder should be")
    jsonl = tmp_path / "events.jsonl"
    raw = smoke(
        tmp_path, checkpoint={"directory": str(blocker / "run1")}, logging={"json_file": str(jsonl)}
    )
    with pytest.raises(
        CheckpointError, match=f"{blocker} is a file, not a folder.*checkpoint.directory"
    ):
        train_from_config(raw, device="cpu")
    events = (
        [json.loads(line)["event"] for line in jsonl.read_text().splitlines()]
        if jsonl.exists()
        else []
    )
    assert "train_step" not in events  # refused before the first step, not at the first save


def test_failed_save_keeps_the_earlier_checkpoints(tmp_path):
    manager = CheckpointManager(tmp_path / "ck", every_steps=2, keep_last=2)
    trainer = regressor_trainer(manager, max_steps=4)
    trainer.fit()
    manager.path_for(6).mkdir()  # something in the way of the step-6 file
    with pytest.raises(CheckpointError, match="step_000000000006.pt.*already in .* are kept"):
        trainer.fit(max_steps=6)
    assert sorted(p.name for p in manager.directory.glob("step_*.pt") if p.is_file()) == [
        "step_000000000002.pt",
        "step_000000000004.pt",
    ]
    assert json.loads(manager.pointer_path.read_text())["step"] == 4
    assert manager.load_latest()["step"] == 4


def _can_write_read_only_folders(tmp: Path) -> bool:
    "Whether this process writes into a 0o555 folder anyway (root, with CAP_DAC_OVERRIDE)."
    probe = tmp / "probe"
    probe.mkdir(mode=0o555)
    try:
        (probe / "x").write_text("")
        return True
    except PermissionError:
        return False
    finally:
        probe.chmod(0o755)


def test_read_only_checkpoint_directory_is_refused_up_front(tmp_path):
    # root: run this very test again without the capability that ignores modes
    if _can_write_read_only_folders(tmp_path):
        assert not os.environ.get("SPEEDTRONIC_NO_DAC"), "setpriv did not drop CAP_DAC_OVERRIDE"
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip(
                "root writes read-only folders and util-linux setpriv is missing to drop that"
            )
        name = "test_read_only_checkpoint_directory_is_refused_up_front"
        proc = subprocess.run(
            [
                setpriv,
                "--bounding-set",
                "-dac_override,-dac_read_search",
                "--inh-caps",
                "-all",
                "--",
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                f"{__file__}::{name}",
            ],
            cwd=Path(__file__).resolve().parents[2],
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, "SPEEDTRONIC_NO_DAC": "1"},
        )
        assert proc.returncode == 0 and "1 passed" in proc.stdout, (
            proc.stdout[-3000:] + proc.stderr[-2000:]
        )
        return
    manager = CheckpointManager(tmp_path / "ck", every_steps=2)
    trainer = regressor_trainer(manager, max_steps=2)
    trainer.fit()
    manager.directory.chmod(0o555)
    try:
        with pytest.raises(CheckpointError, match="cannot write checkpoints to"):
            trainer.fit(max_steps=4)
        assert trainer.step == 2
    finally:
        manager.directory.chmod(0o755)
    assert manager.load_latest()["step"] == 2


def test_two_runs_in_one_process_leave_no_handlers_or_threads(tmp_path):
    threads = set(threading.enumerate())
    for name in ("a", "b"):
        raw = smoke(
            tmp_path / name,
            logging={
                "file": str(tmp_path / f"{name}.log"),
                "json_file": str(tmp_path / f"{name}.jsonl"),
            },
        )
        result = train_from_config(raw, device="cpu")
        assert (result.steps, len(result.metrics)) == (4, 4)
    for name in ("a", "b"):
        steps = [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        assert [r["step"] for r in steps if r["event"] == "train_step"] == [1, 2, 3, 4]
    assert set(threading.enumerate()) <= threads
    leaked = [
        n
        for n, lg in logging.Logger.manager.loggerDict.items()
        if n.startswith("speedtronic.metrics.") and isinstance(lg, logging.Logger) and lg.handlers
    ]
    assert leaked == []
