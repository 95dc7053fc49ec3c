"""No secret reaches any output of a training run: console, text log, JSONL, checkpoints,
TensorBoard files, the saved config — whether it came from the config file or from the environment.
"""

import os, subprocess, sys
from pathlib import Path

import pytest
from conftest import run_command

ROOT = Path(__file__).resolve().parents[2]
CONFIG_TOKEN = "hf_configSECRETvalue0123456789"
ENV_TOKEN = "hf_envSECRETvalue9876543210"


def test_a_training_run_writes_no_secret_anywhere(tmp_path):
    pytest.importorskip("tensorboard")
    out = tmp_path / "out"
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"""run: {{max_steps: 4, output_dir: {out}}}
model: {{vocab_size: 64, max_seq_len: 16, n_layer: 1, n_head: 2, d_model: 16}}
data: {{num_tokens: 64, micro_batch_size: 2, target_batch_size: 2}}
checkpoint: {{every_steps: 2}}
logging:
  file: {out}/train.log
  json_file: {out}/metrics.jsonl
  tensorboard_dir: {out}/tb
  progress: false
distributed:
  enabled: false
  token: {CONFIG_TOKEN}
""")
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "HF_TOKEN": ENV_TOKEN,
        "HUGGING_FACE_HUB_TOKEN": ENV_TOKEN,
    }
    runs = [
        run_command(
            [sys.executable, "-m", "speedtronic", *args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        for args in (
            ["validate", "--config", str(cfg)],
            ["validate", "--config", str(cfg), "--format", "json"],
            ["train", "--config", str(cfg), "--device", "cpu"],
        )
    ]
    for r in runs:
        assert r.returncode == 0, r.stderr[-2000:]
    files = [p for p in out.rglob("*") if p.is_file()]
    assert any(p.suffix == ".pt" for p in files) and any("tfevents" in p.name for p in files)
    assert (out / "train.log").exists() and (out / "metrics.jsonl").exists()
    for secret in (CONFIG_TOKEN, ENV_TOKEN):
        for r in runs:
            assert secret not in r.stdout and secret not in r.stderr
        leaked = [p for p in files if secret.encode() in p.read_bytes()]
        assert leaked == [], leaked
    assert "<redacted>" in runs[0].stdout


@pytest.mark.parametrize("naming", ["--config PATH", "--config=PATH", "--conf PATH"])
def test_an_error_quoting_a_config_secret_masks_it_however_the_config_is_named(tmp_path, naming):
    """A config error that quotes a value (here lower-cased, as a choice is read) which is also the
    config's token says `<redacted>`, whichever way the command line names the file: `--config=PATH`
    and abbreviations are read as argparse reads them."""
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"optimizer: {{name: {CONFIG_TOKEN}}}\ndistributed: {{token: {CONFIG_TOKEN}}}\n")
    words = naming.replace("PATH", str(cfg)).split()
    done = run_command(
        [sys.executable, "-m", "speedtronic", "validate", *words],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "optimizer.name" in done.stderr and "<redacted>" in done.stderr, done.stderr
    assert CONFIG_TOKEN.lower() not in (done.stdout + done.stderr).lower()
