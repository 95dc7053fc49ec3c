"""Exact resume for every optimizer and wrapper, through the real runtime and real checkpoint files.

For AdamW, Muon, Muon+, cautious AdamW and cautious Muon: a run stopped and resumed from its
checkpoint gives bit-identical losses, weights and optimizer state to one run straight through
(save/resume in process, and a SIGKILLed CLI process resumed from the CLI). Also: Muon with gradient
accumulation matches one big batch, and a checkpoint of one optimizer family is refused by the
other.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from speedtronic.checkpoint import load_checkpoint
from speedtronic.runtime import build_runtime, close_logger, train_from_config
from conftest import spawn

ROOT = Path(__file__).resolve().parents[2]

VARIANTS = {
    "adamw": {"name": "adamw"},
    "muon": {"name": "muon"},
    "muon_plus": {"name": "muon", "muon_plus": True, "muon_lr": 0.02, "muon_scale": "original"},
    "cautious_adamw": {"name": "adamw", "cautious": True},
    "cautious_muon": {"name": "muon", "cautious": True, "muon_plus": True},
}


def raw_config(
    out: Path, optimizer: dict, *, steps: int = 6, micro: int = 2, target: int = 4
) -> dict:
    return {
        "run": {"name": "resume", "seed": 11, "max_steps": steps, "output_dir": str(out)},
        "model": {
            "vocab_size": 64,
            "max_seq_len": 16,
            "n_layer": 1,
            "n_head": 4,
            "n_kv_head": 2,
            "d_model": 32,
            "d_ff": 64,
            "dropout": 0.1,
        },
        "data": {
            "synthetic": True,
            "num_tokens": 64,
            "shuffle": True,
            "block_size": 16,
            "micro_batch_size": micro,
            "target_batch_size": target,
        },
        "optimizer": {
            "lr": 3e-3,
            "weight_decay": 0.01,
            "grad_clip": 1.0,
            "fused": False,
            **optimizer,
        },
        "scheduler": {"warmup_steps": 2},
        "precision": {"mode": "fp32"},
        "checkpoint": {"every_steps": 1, "keep_last": None},
        "logging": {
            "every_steps": 1,
            "progress": False,
            "loss_plot": False,
            "json_file": str(out / "metrics.jsonl"),
        },
        "ooo_backprop": True,
    }


def final_state(out: Path, step: int) -> dict:
    return load_checkpoint(out / "checkpoints" / f"step_{step:012d}.pt")


def assert_same_tensors(a, b, where=""):
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert set(a) == set(b), where
        for k in a:
            assert_same_tensors(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tensors(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


@pytest.mark.parametrize("variant", VARIANTS)
def test_save_and_resume_is_bit_exact(tmp_path, variant):
    straight_dir, split_dir = tmp_path / "straight", tmp_path / "split"
    straight = train_from_config(raw_config(straight_dir, VARIANTS[variant]), device="cpu")
    first = train_from_config(raw_config(split_dir, VARIANTS[variant]), device="cpu", max_steps=3)
    second = train_from_config(raw_config(split_dir, VARIANTS[variant]), device="cpu", resume=True)
    assert (first.steps, second.steps, straight.steps) == (3, 6, 6)
    losses = [r["loss"] for r in straight.metrics]
    # a resumed run's result covers the whole run (its earlier steps come from the metrics file)
    assert [r["loss"] for r in first.metrics] == losses[:3] and [
        r["loss"] for r in second.metrics
    ] == losses
    assert [r["lr"] for r in second.metrics] == [r["lr"] for r in straight.metrics]
    a, b = final_state(straight_dir, 6), final_state(split_dir, 6)
    assert_same_tensors(a["model"], b["model"], "model")
    assert_same_tensors(a["optimizer"], b["optimizer"], "optimizer")
    algorithms = [g.get("algorithm") for g in a["optimizer"]["param_groups"]]
    assert ("muon" in algorithms) == (VARIANTS[variant]["name"] == "muon")


HELD_MODEL = """
import os, sys
import torch
from speedtronic.model import ReferenceTransformer
from speedtronic.registry import register_model

class HeldReference(ReferenceTransformer):
    '''The reference model; with HOLD_AT_FORWARD=N its N-th training forward pass says so on stderr
    and waits on stdin.'''
    forwards = 0
    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled():
            type(self).forwards += 1
            if type(self).forwards == int(os.environ.get("HOLD_AT_FORWARD", "0")):
                print("held", file=sys.stderr, flush=True)
                sys.stdin.readline()
        return super().forward(*args, **kwargs)

register_model("held_reference", HeldReference)
"""


def cli(cfg: Path, *extra: str, **env: str) -> subprocess.Popen:
    """`speedtronic train` of `cfg` on CPU, with the config's folder (its model module) and this
    checkout importable."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(cfg.parent), str(ROOT)]),
        "OMP_NUM_THREADS": "1",
        **env,
    }
    return spawn(
        [
            sys.executable,
            "-m",
            "speedtronic",
            "train",
            "--config",
            str(cfg),
            "--device",
            "cpu",
            *extra,
        ],
        cwd=ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def train_steps(jsonl: Path) -> dict[int, float]:
    out = {}
    if jsonl.exists():
        for line in jsonl.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by kill -9
            if rec.get("event") == "train_step":
                out[rec["step"]] = rec["loss"]
    return out


def test_kill_and_resume_from_the_cli_is_bit_exact(tmp_path):
    """The full v2 stack (Muon+, cautious) killed with SIGKILL mid-run resumes to the same losses
    and weights. The kill lands at a known point, not a raced one: in the forward pass of step 13
    (two micro-batches a step), which holds."""
    steps = 40
    optimizer = {"name": "muon", "muon_plus": True, "cautious": True}
    (tmp_path / "held_model.py").write_text(HELD_MODEL)
    configs = {}
    for name in ("straight", "killed"):
        raw = raw_config(tmp_path / name, optimizer, steps=steps)
        raw["model"].update(name="held_reference", imports=["held_model"])
        configs[name] = tmp_path / f"{name}.yaml"
        configs[name].write_text(yaml.safe_dump(raw, sort_keys=False))
    proc = cli(configs["straight"])
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    proc, jsonl = (
        cli(configs["killed"], HOLD_AT_FORWARD=str(2 * 12 + 1)),
        tmp_path / "killed" / "metrics.jsonl",
    )
    try:
        lines = []
        # ends at "held", or at the end of a child that never held
        for line in iter(proc.stderr.readline, ""):
            lines.append(line)
            if line == "held\n":
                break
        assert lines and lines[-1] == "held\n", "".join(lines)[-3000:]
        proc.send_signal(signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=60)
        proc.stdin.close()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    assert max(train_steps(jsonl)) <= 12
    assert (
        sorted(p.name for p in (tmp_path / "killed" / "checkpoints").glob("step_*.pt"))[-1]
        == "step_000000000012.pt"
    )
    proc = cli(configs["killed"], "--resume")
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert train_steps(jsonl) == train_steps(tmp_path / "straight" / "metrics.jsonl")
    a, b = final_state(tmp_path / "straight", steps), final_state(tmp_path / "killed", steps)
    assert_same_tensors(a["model"], b["model"], "model")
    assert_same_tensors(a["optimizer"], b["optimizer"], "optimizer")


def test_muon_accumulation_matches_one_big_batch(tmp_path):
    "Two micro-batches of 2 accumulate to the update one batch of 4 gives (up to float rounding)."
    results = {}
    for micro in (2, 4):
        raw = raw_config(
            tmp_path / f"m{micro}",
            {"name": "muon", "cautious": True},
            steps=3,
            micro=micro,
            target=4,
        )
        raw["model"]["dropout"] = 0.0
        raw["data"]["shuffle"] = False
        trainer, _ = build_runtime(raw, device="cpu")
        results[micro] = (
            [r["loss"] for r in trainer.fit().metrics],
            [p.detach().clone() for p in trainer.model.parameters()],
        )
        close_logger(trainer.logger)
    assert results[2][0] == pytest.approx(results[4][0], rel=1e-5)
    for a, b in zip(results[2][1], results[4][1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_adamw_checkpoint_is_refused_by_a_muon_run_and_kept(tmp_path):
    train_from_config(raw_config(tmp_path, {"name": "adamw"}, steps=4), device="cpu", max_steps=2)
    before = {p.name: p.read_bytes() for p in (tmp_path / "checkpoints").iterdir()}
    from speedtronic.checkpoint import CheckpointError

    with pytest.raises(CheckpointError) as err:
        train_from_config(
            raw_config(tmp_path, {"name": "muon"}, steps=4), device="cpu", resume=True
        )
    message = str(err.value)
    assert (
        "optimizer.name: saved 'adamw', now 'muon'" in message
        and "Muon keeps one momentum matrix" in message
    ), message
    assert message.count("optimizer.") == 1, message  # one reason, not two
    # saved work intact
    assert {p.name: p.read_bytes() for p in (tmp_path / "checkpoints").iterdir()} == before
