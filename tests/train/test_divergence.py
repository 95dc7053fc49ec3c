"""A diverging run (NaN/inf loss or gradient) stops with one clear error and never costs the last
good checkpoint."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from speedtronic.checkpoint import (
    CheckpointError,
    CheckpointManager,
    checkpoint_files,
    load_checkpoint,
    nonfinite_state,
)
from speedtronic.config import SpeedtronicConfig
from speedtronic.profiling import MetricLogger
from speedtronic.trainer import Trainer, TrainingError

from conftest import one_error_line, run_cli, tiny_config


tiny_yaml = functools.partial(tiny_config, max_steps=10, keep_last=1)
cli, error_line = run_cli, one_error_line


def test_huge_learning_rate_stops_with_one_error_and_keeps_a_finite_checkpoint(tmp_path):
    cfg = tiny_yaml(
        tmp_path, optimizer={"lr": 1e6}, scheduler={"name": "constant", "warmup_steps": 0}
    )
    proc = cli("train", "--config", str(cfg), "--device", "cpu", cwd=tmp_path)
    line = error_line(proc)
    assert "the loss is nan" in line or "the gradient norm is" in line, line
    assert "optimizer.lr" in line and "optimizer.max_nonfinite_skips" in line, line
    assert "completed steps=" not in proc.stdout
    files = checkpoint_files(tmp_path / "out" / "checkpoints")
    assert files, "the last good step is kept"
    for f in files:
        model = load_checkpoint(f)["model"]
        assert all(torch.isfinite(t).all() for t in model.values() if t.is_floating_point()), f
    records = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # no NaN step was recorded
    assert all(r["loss"] is not None for r in records if r["event"] == "train_step")


class NanAt(nn.Module):
    "A regression model whose loss is NaN at the forward calls in `bad`."

    def __init__(self, bad):
        super().__init__()
        self.lin, self.bad, self.calls = nn.Linear(4, 1), set(bad), 0

    def forward(self, x, y):
        self.calls += 1
        loss = ((self.lin(x).squeeze(-1) - y) ** 2).mean()
        return loss * float("nan") if self.calls in self.bad else loss


def trainer(model, tmp_path=None, **config) -> Trainer:
    torch.manual_seed(0)
    cfg = SpeedtronicConfig.from_dict(
        {"precision": "fp32", "shape_validation": {"enabled": False}, **config}
    )
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(2, 4, generator=g), torch.randn(2, generator=g)) for _ in range(4)]
    manager = CheckpointManager(tmp_path, every_steps=1, keep_last=1) if tmp_path else None
    return Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        data,
        device="cpu",
        config=cfg,
        logger=MetricLogger(stream=False),
        checkpoint_manager=manager,
        max_steps=6,
    )


def test_nan_loss_stops_before_the_update(tmp_path):
    t = trainer(NanAt({3}), tmp_path)
    with pytest.raises(
        TrainingError, match=r"step 3: the loss is nan, so the update was not applied"
    ):
        t.fit()
    assert t.step == 2 and torch.isfinite(t.model.lin.weight).all()
    assert load_checkpoint(checkpoint_files(tmp_path)[0])["step"] == 2


def test_a_budget_skips_isolated_bad_updates():
    t = trainer(NanAt({2, 5}), optimizer={"max_nonfinite_skips": 1})
    assert t.fit().steps == 6
    with pytest.raises(TrainingError, match="after 1 skipped update in a row"):
        trainer(NanAt({2, 3}), optimizer={"max_nonfinite_skips": 1}).fit()


def test_an_infinite_gradient_with_a_finite_loss_is_caught():
    class InfGrad(NanAt):
        def forward(self, x, y):
            loss = super().forward(x, y)
            if self.calls == 2:
                loss = loss + 0.0 * (self.lin.weight * float("inf")).sum().nan_to_num(0.0)
            return loss

    model = InfGrad(set())
    with pytest.raises(TrainingError, match="step 2: the gradient norm is"):
        trainer(model).fit()


def test_nan_weights_are_never_written_and_the_good_checkpoint_stays(tmp_path):
    m = CheckpointManager(tmp_path, every_steps=1, keep_last=1)
    m.save(1, {"model": {"w": torch.ones(3)}, "step": 1})
    for step in (2, 3):
        with pytest.raises(
            CheckpointError, match="not written: the model weights hold NaN or infinity"
        ):
            m.save(step, {"model": {"w": torch.full((3,), float("nan"))}, "step": step})
    assert [p.name for p in checkpoint_files(tmp_path)] == ["step_000000000001.pt"]
    assert m.load_latest()["step"] == 1


def test_nan_optimizer_moments_in_the_newest_checkpoint_fall_back_to_the_good_one(tmp_path):
    """A newest checkpoint whose optimizer state holds NaN (weights finite) is skipped with its
    reason; the run resumes the older one."""
    cfg = tiny_config(tmp_path, max_steps=4, every_steps=2, keep_last=None)
    ck = tmp_path / "out" / "checkpoints"
    assert cli("train", "--config", str(cfg), "--device", "cpu", cwd=tmp_path).returncode == 0
    newest = ck / "step_000000000004.pt"
    state = load_checkpoint(newest)
    moments = next(iter(state["optimizer"]["state"].values()))
    # what a diverged 2.0 run (or a bad disk) leaves
    moments["exp_avg_sq"].view(-1)[0] = float("nan")
    torch.save(state, newest)
    cfg = tiny_config(tmp_path, max_steps=6, every_steps=2, keep_last=None)
    proc = cli("train", "--config", str(cfg), "--device", "cpu", "--resume", cwd=tmp_path)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    assert "skipping unusable checkpoint" in log and newest.name in log, log[-3000:]
    assert "the optimizer state holds NaN or infinity (in: optimizer.state." in log, log[-3000:]
    assert "optimizer.lr" not in log, log[-3000:]  # nothing tells the user to lower a good lr
    steps = [
        r["step"]
        for r in json.loads(
            "[" + ",".join((tmp_path / "metrics.jsonl").read_text().splitlines()) + "]"
        )
        if r.get("event") == "train_step"
    ]
    assert steps[-4:] == [3, 4, 5, 6], steps  # resumed from step 2, not the sick step 4
    for f in checkpoint_files(ck):
        assert not nonfinite_state(load_checkpoint(f)), f  # step 4 was written again, finite


def test_nan_optimizer_moments_are_never_written(tmp_path):
    m = CheckpointManager(tmp_path, every_steps=1, keep_last=1)
    m.save(
        1,
        {
            "model": {"w": torch.ones(3)},
            "optimizer": {"state": {0: {"exp_avg": torch.ones(3)}}},
            "step": 1,
        },
    )
    sick = {
        "state": {0: {"exp_avg": torch.tensor([0.0, float("inf"), 1.0])}},
        "param_groups": [{"lr": 0.1}],
    }
    with pytest.raises(
        CheckpointError,
        match=r"not written: the optimizer state holds NaN or infinity \(in: "
        r"optimizer.state.0.exp_avg\)",
    ):
        m.save(2, {"model": {"w": torch.ones(3)}, "optimizer": sick, "step": 2})
    assert [p.name for p in checkpoint_files(tmp_path)] == ["step_000000000001.pt"]
