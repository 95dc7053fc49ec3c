"""Errors that are one clear line (exit 2, no traceback) and messages that point the right way; what
`validate --deep` passes does not fail at step 1 for a reason it could see."""

from __future__ import annotations

import functools
import os
import socket
import sys
from pathlib import Path

import pytest
import torch

from speedtronic.checkpoint import CheckpointError
from speedtronic.config import SpeedtronicConfig
from speedtronic.data import build_dataloader
from speedtronic.files import atomic_write_text
from speedtronic.profiling import MetricLogger
from speedtronic.trainer import Trainer

from conftest import ROOT, one_error_line, run_cli, tiny_config


tiny_yaml = functools.partial(tiny_config, max_steps=2, metrics=False)
cli, one_error = run_cli, one_error_line


def train_and_deep_validate(tmp: Path, cfg: Path, *needles: str, env: dict | None = None) -> None:
    "`train` fails with one line holding `needles`, and `validate --deep` had already reported it."
    one_error(cli("train", "--config", str(cfg), "--device", "cpu", cwd=tmp, env=env), *needles)
    deep = cli("validate", "--config", str(cfg), "--deep", "--device", "cpu", cwd=tmp, env=env)
    assert deep.returncode == 2 and "Traceback" not in deep.stderr, deep.stderr[-3000:]
    assert all(n in deep.stderr for n in needles), deep.stderr


def test_labels_outside_the_vocabulary_in_a_pt_dataset(tmp_path):
    torch.save(
        {"input_ids": torch.zeros(8, 16, dtype=torch.long), "labels": torch.full((8, 16), 300)},
        tmp_path / "rows.pt",
    )
    cfg = tiny_yaml(tmp_path, data={"dataset": str(tmp_path / "rows.pt")})
    train_and_deep_validate(tmp_path, cfg, "rows.pt", "holds token id 300", "model.vocab_size")


USER_MODELS = """
import torch
from torch import nn
from speedtronic.registry import register_model

class Returns(nn.Module):
    def __init__(self, kind, vocab_size=64, **_):
        super().__init__(); self.kind, self.emb = kind, nn.Embedding(vocab_size, 8)
    def forward(self, input_ids, labels=None, **_):
        loss = self.emb(input_ids).pow(2).mean()
        if self.kind == "number": return {"loss": 1.5}
        if self.kind == "item": return {"loss": loss.item()}
        return {"loss": loss.detach()}

for kind in ("number", "item", "detached"):
    register_model(f"returns_{kind}", lambda kind=kind, **kw: Returns(kind, **kw))
"""


@pytest.mark.parametrize(
    "kind,needle",
    [
        ("number", "is a float, not a tensor"),
        ("item", "is a float, not a tensor"),
        ("detached", "does not depend on any trainable parameter"),
    ],
)
def test_a_custom_model_whose_loss_cannot_train(tmp_path, kind, needle):
    (tmp_path / "user_models.py").write_text(USER_MODELS)
    cfg = tiny_yaml(tmp_path, model={"name": f"returns_{kind}", "imports": ["user_models"]})
    train_and_deep_validate(
        tmp_path, cfg, needle, env={"PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"}
    )


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_huge_synthetic_sample_count_costs_no_memory(tmp_path, shuffle):
    cfg = tiny_yaml(tmp_path, data={"num_tokens": 10**12, "shuffle": shuffle})
    proc = cli("train", "--config", str(cfg), "--device", "cpu", cwd=tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "completed steps=2 samples=4" in proc.stdout


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_wandb_without_a_reachable_server_fails_fast_in_one_line(tmp_path):
    pytest.importorskip("wandb")
    cfg = tiny_yaml(tmp_path, logging={"wandb": {"project": "x"}})
    env = {
        "WANDB_API_KEY": "0123456789" * 4,
        "WANDB_BASE_URL": f"http://127.0.0.1:{closed_port()}",
        "HOME": str(tmp_path),
        "WANDB_MODE": "",
        "WANDB_DIR": str(tmp_path),
    }
    train_and_deep_validate(
        tmp_path,
        cfg,
        f"logging.wandb: W&B cannot reach {env['WANDB_BASE_URL']}",
        "mode: offline",
        env=env,
    )


def test_wandb_without_a_login_is_one_line(tmp_path):
    pytest.importorskip("wandb")
    with socket.socket() as server:  # a server that answers, so only the missing key is wrong
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        env = {
            "WANDB_API_KEY": "",
            "WANDB_BASE_URL": f"http://127.0.0.1:{server.getsockname()[1]}",
            "HOME": str(tmp_path),
            "WANDB_MODE": "",
            "WANDB_DIR": str(tmp_path),
            "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
        }
        cfg = tiny_yaml(tmp_path, logging={"wandb": {"project": "x"}})
        one_error(
            cli(
                "train", "--config", str(cfg), "--device", "cpu", cwd=tmp_path, env=env, timeout=120
            ),
            "logging.wandb: wandb.init failed",
            "wandb login",
        )


def unwritable_dir(tmp_path: Path) -> Path:
    # root writes anywhere, except a read-only /sys
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        if not (Path("/sys").is_dir() and _really_readonly(Path("/sys"))):
            pytest.skip("no folder root cannot write to")
        return Path("/sys")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    return locked


def _really_readonly(d: Path) -> bool:
    try:
        (d / ".speedtronic-probe").write_text("x")
    except OSError:
        return True
    (d / ".speedtronic-probe").unlink()
    return False


def test_a_permission_error_names_the_target_not_a_temp_file(tmp_path):
    target = unwritable_dir(tmp_path) / "speedtronic-test.json"
    with pytest.raises(PermissionError) as err:
        atomic_write_text("{}", target)
    assert str(target) in str(err.value) and ".tmp-" not in str(err.value)
    (tmp_path / "t.txt").write_text("hello\n" * 100)
    line = one_error(
        cli(
            "prepare",
            str(tmp_path / "t.txt"),
            str(target.with_name("t.bin")),
            "--no-progress",
            cwd=tmp_path,
        )
    )
    assert str(target.with_name("t.bin")) in line and ".tmp-" not in line, line


def test_an_unsafe_checkpoint_is_called_unsafe_not_corrupt(tmp_path):
    ck = tmp_path / "out" / "checkpoints"
    ck.mkdir(parents=True)
    torch.save({"model": {}, "step": 2, "callback": os.system}, ck / "step_000000000002.pt")
    line = one_error(
        cli(
            "train",
            "--config",
            str(tiny_yaml(tmp_path)),
            "--device",
            "cpu",
            "--resume",
            cwd=tmp_path,
        ),
        "step_000000000002.pt",
        "is unsafe to load",
    )
    assert "corrupt" not in line, line


class Regressor(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)

    def forward(self, x, y):
        return ((self.lin(x).squeeze(-1) - y) ** 2).mean()


def test_resume_of_a_missing_file_says_it_is_missing(tmp_path):
    model = Regressor()
    t = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        [],
        device="cpu",
        logger=MetricLogger(stream=False),
    )
    with pytest.raises(CheckpointError, match="step_000000000004.pt does not exist"):
        t.resume(str(tmp_path / "step_000000000004.pt"))


def test_an_exhausted_one_shot_loader_is_not_called_empty():
    model = Regressor()
    batches = ((torch.randn(2, 4), torch.randn(2)) for _ in range(3))
    t = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        batches,
        device="cpu",
        logger=MetricLogger(stream=False),
        max_steps=5,
    )
    with pytest.raises(
        RuntimeError, match="one-shot generator that gave 3 batches and is used up"
    ) as err:
        t.fit()
    assert "empty" not in str(err.value)
    assert t.step == 3


def test_a_tensorboard_dir_that_is_a_file_names_the_key(tmp_path):
    (tmp_path / "tb").write_text("a file")
    cfg = tiny_yaml(tmp_path, logging={"tensorboard_dir": str(tmp_path / "tb")})
    train_and_deep_validate(tmp_path, cfg, "logging.tensorboard_dir", str(tmp_path / "tb"))


def test_the_loader_argument_wins_over_a_vocab_filled_in_from_the_model():
    # data.vocab_size filled: 512
    config = SpeedtronicConfig.from_dict({"data": {"num_tokens": 8, "block_size": 4}})
    loader = build_dataloader(config.data, vocab_size=256)
    assert loader.dataset.vocab_size == 256 and next(iter(loader))["input_ids"].max() < 256
    # an unwritten target follows
    wide = SpeedtronicConfig.from_dict({"data": {"micro_batch_size": 8}})
    assert (wide.data.target_batch_size, wide.accumulation_steps) == (8, 1)
    with pytest.raises(
        ValueError, match="data.vocab_size=1000 is larger than the model vocabulary 256"
    ):
        build_dataloader(
            SpeedtronicConfig.from_dict(
                {"data": {"vocab_size": 1000, "num_tokens": 8, "block_size": 4}}
            ).data,
            vocab_size=256,
        )
