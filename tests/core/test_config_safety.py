"""A configuration can neither hang the CLI nor print a credential."""

from __future__ import annotations

import subprocess
import sys

from speedtronic.config import SpeedtronicConfig
from conftest import run_command


def bomb_yaml(levels: int = 9) -> str:
    "A ~1 KB YAML file whose anchors expand to 10**levels values under logging.wandb."
    lines = ["logging:", "  wandb:", "    a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"    a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def test_alias_bomb_is_refused_by_validate_in_one_line(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(bomb_yaml())
    assert path.stat().st_size < 1500
    out = run_command(
        [sys.executable, "-m", "speedtronic", "validate", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out.stderr
    assert (
        out.stderr.startswith("speedtronic: error: logging.wandb: holds")
        and "Traceback" not in out.stderr
    )
    assert len(out.stderr.strip().splitlines()) == 1


def test_repr_and_str_redact_every_credential():
    cfg = SpeedtronicConfig.from_dict(
        {
            "distributed": {"token": "hf_TOPSECRET"},
            "logging": {"wandb": {"project": "p", "api_key": "wb_TOPSECRET"}},
        }
    )
    for text in (
        repr(cfg),
        str(cfg),
        repr(cfg.distributed),
        str(cfg.distributed),
        repr(cfg.logging),
        f"{cfg}",
    ):
        assert "TOPSECRET" not in text and "<redacted>" in text
    assert cfg.distributed.token == "hf_TOPSECRET"  # the value itself is untouched
