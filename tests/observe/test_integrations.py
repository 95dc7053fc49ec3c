"""TensorBoard and W&B hooks against the real libraries (spec §9.4, O5, K6)."""

import json
import os
from pathlib import Path

import pytest

from conftest import run_python
from speedtronic.config import SpeedtronicConfig
from speedtronic.integrations import hooks_from_config
from speedtronic.profiling import MetricLogger

ROOT = Path(__file__).resolve().parents[2]


def run_bare(code, *args, env=None, timeout=180):
    """Run `code` in a fresh interpreter whose environment is the repository's path, PATH, HOME and
    `env`."""
    bare = {
        "PYTHONPATH": str(ROOT),
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": os.environ.get("HOME", "/tmp"),
    }
    return run_python(code, *args, env={**bare, **(env or {})}, timeout=timeout)


def test_tensorboard_event_files_have_tags_steps_and_values(tmp_path):
    pytest.importorskip("tensorboard")  # the optional `logging` extra
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb_dir = tmp_path / "tb"
    with MetricLogger(
        stream=False,
        every_steps=2,
        hooks=hooks_from_config({"tensorboard_dir": str(tb_dir), "progress": False}),
    ) as log:
        log.emit(
            "train_start",
            {"start_step": 0, "target_step": 6, "device": "cpu", "ooo_backprop": False},
        )
        for s in range(1, 7):
            log.emit("train_step", {"step": s, "loss": 10.0 / s, "lr": 1e-3 * s, "samples": 2 * s})
        log.emit("compile", {"enabled": True})
        log.emit("checkpoint", {"step": 6, "path": str(tmp_path / "step_6.pt")})
        log.emit("train_end", {"steps": 6, "elapsed_s": 1.5, "loss": 10.0 / 6})
    assert list(tb_dir.glob("events.out.tfevents.*"))
    acc = EventAccumulator(str(tb_dir)).Reload()
    tags = set(acc.Tags()["scalars"])
    assert {
        "train_step/loss",
        "train_step/lr",
        "train_step/samples",
        "train_step/elapsed_s",
        "train_start/target_step",
        "train_end/loss",
        "train_end/steps",
    } <= tags
    assert (
        not {"train_step/step", "compile/enabled", "train_start/ooo_backprop", "train_start/device"}
        & tags
    )
    loss = acc.Scalars("train_step/loss")
    assert [e.step for e in loss] == [2, 4, 6]  # cadence every 2, real global steps (O5)
    assert [e.value for e in loss] == pytest.approx([5.0, 2.5, 10.0 / 6])
    assert [(e.step, e.value) for e in acc.Scalars("train_end/elapsed_s")] == [(6, 1.5)]
    assert [e.step for e in acc.Scalars("checkpoint/elapsed_s")] == [6]


def test_wandb_offline_run_is_written_and_finished(tmp_path):
    pytest.importorskip("wandb")  # the optional `logging` extra
    result = run_bare(
        """
        from speedtronic.integrations import hooks_from_config
        from speedtronic.profiling import MetricLogger
        settings = {"project": "speedtronic-test", "mode": "offline"}
        hooks = hooks_from_config({"wandb": settings, "progress": False})
        with MetricLogger(stream=False, hooks=hooks) as log:
            for s in range(1, 4):
                log.emit("train_step", {"step": s, "loss": 1.0 / s, "token": "hf_secret"})
            log.emit("checkpoint", {"step": 3, "path": "runs/x/step_3.pt"})
        assert hooks[0].run is None
        print("finished")
    """,
        env={
            "WANDB_MODE": "offline",
            "WANDB_DIR": str(tmp_path),
            "WANDB_SILENT": "true",
            "WANDB_CONFIG_DIR": str(tmp_path / "config"),
            "WANDB_CACHE_DIR": str(tmp_path / "cache"),
        },
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "finished" in result.stdout
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    data = list(runs[0].glob("run-*.wandb"))
    assert data and data[0].stat().st_size > 0
    assert b"hf_secret" not in data[0].read_bytes()  # redacted before any hook saw it


@pytest.mark.parametrize(
    "blocked,hook", [("wandb", "WandbHook()"), ("torch.utils.tensorboard", "TensorboardHook('x')")]
)
def test_missing_library_names_the_extra(blocked, hook):
    result = run_bare(f"""
        import sys
        sys.modules[{blocked!r}] = None          # makes `import {blocked}` fail as if not installed
        from speedtronic.integrations import WandbHook, TensorboardHook
        try: {hook}
        except RuntimeError as e: print("ERR", e)
    """)
    assert result.returncode == 0, result.stderr
    assert "ERR" in result.stdout and "pip install 'speedtronic[logging]'" in result.stdout


def test_hooks_from_a_real_logging_config(tmp_path):
    pytest.importorskip("tensorboard")  # the optional `logging` extra
    cfg = SpeedtronicConfig.from_dict(
        {"logging": {"tensorboard_dir": str(tmp_path / "tb"), "progress": True}}
    )
    hooks = hooks_from_config(cfg.logging)  # the bar is left to the caller by default
    assert [type(h).__name__ for h in hooks] == ["TensorboardHook"]
    for h in hooks:
        h.close()
    hooks = hooks_from_config(cfg.logging, progress=True, progress_stream=open(os.devnull, "w"))
    assert [type(h).__name__ for h in hooks] == ["TensorboardHook", "ProgressBar"]
    for h in hooks:
        h.close()
    assert hooks_from_config(SpeedtronicConfig.from_dict({}).logging) == []
