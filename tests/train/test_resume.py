"""Kill a real training process at a random point, resume it, and get bit-identical results (C1, C6,
C7)."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
import yaml

from speedtronic.checkpoint import load_checkpoint

from conftest import ROOT, communicate_or_dump, start_cli, jsonl_records, ok, run_cli, tiny_config

STEPS = 60
WORDS = (
    "the model reads a stream of text and learns which byte tends to follow which one while the "
    "optimizer moves every weight a little after each batch so that the loss falls"
).split()


def corpus(path: Path) -> Path:
    rng = random.Random(0)
    path.write_text(
        "\n".join(" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(400)) + "\n"
    )
    return path


def write_config(
    tmp: Path, name: str, *, workers: int, text: bool, every: int, max_steps: int = STEPS
) -> Path:
    data = {"micro_batch_size": 2, "target_batch_size": 4, "num_workers": workers, "block_size": 16}
    if text:
        data.update(text_path=str(corpus(tmp / "corpus.txt")))
    else:
        data.update(synthetic=True, num_tokens=40, shuffle=True)
    raw = {
        "run": {"name": name, "seed": 7, "max_steps": max_steps, "output_dir": str(tmp / name)},
        "model": {
            "vocab_size": 128,
            "max_seq_len": 16,
            "n_layer": 1,
            "n_head": 4,
            "n_kv_head": 2,
            "d_model": 32,
            "d_ff": 64,
            "dropout": 0.1,
        },
        "data": data,
        "optimizer": {"lr": 3e-3, "weight_decay": 0.01, "grad_clip": 1.0},
        "scheduler": {"warmup_steps": 3},
        "precision": {"mode": "fp32"},
        "checkpoint": {"every_steps": every, "keep_last": None},
        "logging": {
            "json_file": str(tmp / f"{name}.jsonl"),
            "every_steps": 1,
            "progress": False,
            "loss_plot": False,
        },
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def start(cfg: Path, *extra: str) -> subprocess.Popen:
    return start_cli(
        "train",
        "--config",
        str(cfg),
        "--device",
        "cpu",
        *extra,
        faulthandler=False,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def finish(proc: subprocess.Popen, timeout: float = 300) -> None:
    _, err = communicate_or_dump(proc, timeout)
    assert proc.returncode == 0, err[-3000:]


records = jsonl_records


def kill_at(
    proc: subprocess.Popen, jsonl: Path, step: int, sig: int = signal.SIGKILL, timeout: float = 120
) -> int:
    "Send `sig` once the JSONL shows `step`; returns the newest step seen at that moment."
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen = [r["step"] for r in records(jsonl)]
        if seen and max(seen) >= step:
            proc.send_signal(sig)
            return max(seen)
        if proc.poll() is not None:
            pytest.fail(f"the run ended before step {step}: {proc.stderr.read()[-2000:]}")
        time.sleep(0.003)
    proc.kill()
    pytest.fail(f"step {step} never appeared in {jsonl}")


def final_model(out: Path) -> dict:
    return load_checkpoint(out / "checkpoints" / f"step_{STEPS:012d}.pt")["model"]


def losses_by_step(jsonl: Path) -> dict[int, list[float]]:
    by = {}
    for r in records(jsonl):
        by.setdefault(r["step"], []).append(r["loss"])
    return by


VARIANTS = [
    pytest.param(w, t, e, id=f"{'text' if t else 'synthetic'}-workers{w}-every{e}")
    for (w, t, e) in [(0, True, 1), (2, True, 2), (0, False, 2), (2, False, 1)]
]
_REFERENCE: dict = {}


def reference(tmp_path_factory, workers: int, text: bool) -> tuple[dict[int, float], dict]:
    key = (workers, text)
    if key not in _REFERENCE:
        tmp = tmp_path_factory.mktemp(f"ref-{workers}-{text}")
        cfg = write_config(tmp, "ref", workers=workers, text=text, every=STEPS)
        finish(start(cfg))
        losses = {s: v[-1] for s, v in losses_by_step(tmp / "ref.jsonl").items()}
        assert sorted(losses) == list(range(1, STEPS + 1))
        _REFERENCE[key] = (losses, final_model(tmp / "ref"))
    return _REFERENCE[key]


def assert_same_run(jsonl: Path, out: Path, ref_losses: dict[int, float], ref_model: dict) -> None:
    got = losses_by_step(jsonl)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step, values in got.items():  # every record, from the killed process and the resumed one
        assert all(v == ref_losses[step] for v in values), (step, values, ref_losses[step])
    model = final_model(out)
    assert model.keys() == ref_model.keys()
    for name, tensor in ref_model.items():
        assert torch.equal(model[name], tensor), name


@pytest.mark.parametrize("workers,text,every", VARIANTS)
def test_kill9_and_resume_is_bit_identical(tmp_path, tmp_path_factory, workers, text, every):
    ref_losses, ref_model = reference(tmp_path_factory, workers, text)
    cfg = write_config(tmp_path, "run", workers=workers, text=text, every=every)
    jsonl = tmp_path / "run.jsonl"
    proc = start(cfg)
    kill_at(proc, jsonl, random.Random(f"{workers}{text}{every}").randint(2, 20))
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert not records(jsonl, "train_end")
    finish(start(cfg, "--resume"))
    assert_same_run(jsonl, tmp_path / "run", ref_losses, ref_model)


def test_truncated_newest_checkpoint_falls_back_and_still_matches(tmp_path, tmp_path_factory):
    ref_losses, ref_model = reference(tmp_path_factory, 0, False)
    cfg = write_config(tmp_path, "run", workers=0, text=False, every=1)
    jsonl = tmp_path / "run.jsonl"
    proc = start(cfg)
    kill_at(proc, jsonl, 8)
    proc.wait(timeout=60)
    ck = tmp_path / "run" / "checkpoints"
    newest = max(ck.glob("step_*.pt"))
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    finish(start(cfg, "--resume"))
    assert_same_run(jsonl, tmp_path / "run", ref_losses, ref_model)


def test_sigterm_saves_the_last_completed_step(tmp_path):
    cfg = write_config(tmp_path, "run", workers=0, text=False, every=100_000, max_steps=100_000)
    jsonl = tmp_path / "run.jsonl"
    proc = start(cfg)
    kill_at(proc, jsonl, 5, sig=signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "Traceback" not in err, err[-2000:]
    last = max(r["step"] for r in records(jsonl))
    pointer = json.loads((tmp_path / "run" / "checkpoints" / "latest.json").read_text())
    assert pointer["step"] == last >= 5
    state = load_checkpoint(tmp_path / "run" / "checkpoints" / pointer["file"])
    assert state["step"] == last and state["data"] is not None and state["rng"]


def _tiny_run(tmp: Path, name: str, max_steps: int) -> Path:
    """Train the tiny run `name` in `tmp/name` to `max_steps` (a checkpoint every 2 steps, all
    kept); its config."""
    cfg = tiny_config(
        tmp,
        f"{name}.yaml",
        max_steps=max_steps,
        every_steps=2,
        keep_last=None,
        run={"output_dir": str(tmp / name)},
        logging={"json_file": str(tmp / f"{name}.jsonl")},
    )
    ok(run_cli("train", "--config", str(cfg), "--device", "cpu", cwd=tmp))
    return cfg


def test_another_runs_checkpoint_linked_in_is_not_adopted(tmp_path):
    """A step file that is a link to another run's checkpoint, or holds another step, is skipped;
    the run resumes its own."""
    _tiny_run(tmp_path, "a", 6)
    cfg = _tiny_run(tmp_path, "b", 2)
    own = tmp_path / "b" / "checkpoints"
    run_b = json.loads((own / "latest.json").read_text())["run_id"]
    (own / "step_000000000006.pt").symlink_to(
        tmp_path / "a" / "checkpoints" / "step_000000000006.pt"
    )
    # step 2 under step 4's name
    (own / "step_000000000004.pt").write_bytes((own / "step_000000000002.pt").read_bytes())
    cfg.write_text(cfg.read_text().replace("max_steps: 2", "max_steps: 4"))
    proc = ok(run_cli("train", "--config", str(cfg), "--device", "cpu", "--resume", cwd=tmp_path))
    log = proc.stdout + proc.stderr
    assert "is a link to" in log and "outside" in log, log[-3000:]
    assert "holds step 2, not step 4 as its name says" in log, log[-3000:]
    assert f"run {run_b}" in log and "loss=None" not in log, log[-2000:]
    steps = [r["step"] for r in jsonl_records(tmp_path / "b.jsonl")]
    assert steps == [1, 2, 3, 4], steps
    assert {r["run_id"] for r in jsonl_records(tmp_path / "b.jsonl")} == {run_b}
    assert load_checkpoint(own / "step_000000000004.pt")["run_id"] == run_b
    assert (own / "step_000000000006.pt").is_symlink()  # the user's link is left as it was
