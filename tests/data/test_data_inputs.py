"""Bad data inputs through `speedtronic train` and `build_dataloader`: one clear error line, nothing
lost.

Real subprocesses, real files, real DataLoader workers; no mocks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml
from conftest import run_cli

from speedtronic.data import DataError, build_dataloader, infinite_batches

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ROOT / "configs" / "smoke.yaml"  # model vocab 128, 4 steps


def run_py(code: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def train(tmp_path: Path, *extra: str, **data) -> subprocess.CompletedProcess:
    raw = yaml.safe_load(SMOKE.read_text())
    raw["run"]["output_dir"] = str(tmp_path / "out")
    raw["logging"].update(loss_plot=False, progress=False, level="WARNING")
    raw["data"].update(data)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    # `python -m speedtronic`: the warm interpreter forks it (conftest.run_cli)
    return run_cli("train", "--config", str(cfg), "--device", "cpu", *extra, cwd=tmp_path)


def one_error_line(proc: subprocess.CompletedProcess, *needles: str) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("speedtronic: error:")]
    assert len(errors) == 1, proc.stderr
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])
    return errors[0]


def token_file(path: Path, ids, vocab_size: int) -> Path:
    np.asarray(ids, dtype=np.uint16).tofile(path)
    Path(str(path) + ".json").write_text(
        json.dumps(
            {
                "format": "speedtronic-tokens",
                "version": 1,
                "dtype": "uint16",
                "num_tokens": len(ids),
                "vocab_size": vocab_size,
                "tokenizer": "byte",
            }
        )
    )
    return path


def test_text_path_directory_points_at_prepare(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("hello\n" * 100)
    one_error_line(
        train(tmp_path, text_path=str(tmp_path / "docs")), "is a directory", "speedtronic prepare"
    )


def test_token_ids_beyond_the_declared_vocabulary_fail_clearly_in_a_worker(tmp_path):
    # the sidecar says vocabulary 128 (fits the model), but blocks after the first hold id 200
    ids = np.concatenate([np.arange(100) % 100, np.full(60, 200)])
    path = token_file(tmp_path / "t.bin", ids, 128)
    proc = train(
        tmp_path, token_file=str(path), synthetic=False, block_size=8, num_workers=2, shuffle=True
    )
    one_error_line(proc, "t.bin", "holds token id 200", "model vocabulary is 128")


def test_edited_sidecar_names_the_field(tmp_path):
    path = token_file(tmp_path / "t.bin", np.arange(500) % 100, 128)
    side = Path(str(path) + ".json")
    side.write_text(side.read_text().replace('"num_tokens": 500', '"num_tokens": "500"'))
    one_error_line(
        train(tmp_path, token_file=str(path), synthetic=False),
        "num_tokens must be an integer",
        "speedtronic prepare",
    )


def test_dataset_that_is_not_a_torch_file(tmp_path):
    (tmp_path / "notes.txt").write_text("just text\n" * 50)
    one_error_line(
        train(tmp_path, dataset=str(tmp_path / "notes.txt"), synthetic=False),
        "not a file written by torch.save",
    )
    one_error_line(
        train(tmp_path, dataset=str(tmp_path / "notes.txt"), synthetic=False, trust_pickle=True),
        "cannot be loaded even with data.trust_pickle",
    )


def test_data_smaller_than_one_batch(tmp_path):
    (tmp_path / "tiny.txt").write_text("x" * 40)  # 40 tokens: a block of 33 and a tail of 7
    proc = train(
        tmp_path, text_path=str(tmp_path / "tiny.txt"), micro_batch_size=4, target_batch_size=4
    )
    one_error_line(proc, "holds 2 samples", "data.micro_batch_size is 4", "data.drop_last: false")


def test_shuffled_text_stream_warns_and_trains(tmp_path):
    (tmp_path / "t.txt").write_text("some words on a line\n" * 400)
    proc = train(tmp_path, text_path=str(tmp_path / "t.txt"), shuffle=True)
    assert proc.returncode == 0, proc.stderr
    assert (
        "data.shuffle is true but data.text_path" in proc.stderr
        and "speedtronic prepare" in proc.stderr
    )


def test_resume_with_other_batch_or_workers_continues(tmp_path):
    """The data position is the job's place in one sample order: another micro batch or worker count
    continues from it."""
    (tmp_path / "t.txt").write_text("".join(f"line {i} of some text\n" for i in range(2000)))
    text = str(tmp_path / "t.txt")
    assert train(tmp_path, text_path=text, num_workers=2).returncode == 0
    ck = tmp_path / "out" / "checkpoints"
    for steps, data in (
        ("6", {"num_workers": 2, "micro_batch_size": 2}),
        ("8", {"num_workers": 1}),
    ):
        proc = train(tmp_path, "--resume", "--max-steps", steps, text_path=text, **data)
        assert proc.returncode == 0, proc.stderr[-3000:]
        state = torch.load(ck / f"step_{int(steps):012d}.pt", weights_only=True)
        # global batch 2 per step
        assert (state["step"], state["data"]["samples"]) == (
            int(steps),
            int(steps) * 2,
        )


@pytest.mark.parametrize("source", ["synthetic", "text", "token"])
def test_no_worker_processes_remain_after_a_run(tmp_path, source):
    (tmp_path / "t.txt").write_text("".join(f"line {i} of some text\n" for i in range(2000)))
    token_file(tmp_path / "t.bin", np.arange(5000) % 100, 128)
    data = {
        "synthetic": {},
        "text": {"text_path": "t.txt"},
        "token": {"token_file": "t.bin", "shuffle": True},
    }[source]
    raw = yaml.safe_load(SMOKE.read_text())
    raw["run"]["output_dir"] = "out"
    raw["logging"].update(loss_plot=False, progress=False, level="WARNING")
    raw["data"].update(num_workers=2, **data)
    code = f"""
import multiprocessing, gc
from speedtronic.runtime import train_from_config
result = train_from_config({raw!r}, device="cpu")
assert result.steps == 4, result.steps
gc.collect()
print("children", len(multiprocessing.active_children()))
"""
    proc = run_py(code, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "children 0" in proc.stdout, proc.stdout


def test_text_stream_memory_stays_bounded(tmp_path):
    """Reading a 96 MiB text file (one line, no newlines) block by block keeps the process well
    under its size."""
    path = tmp_path / "big.txt"
    with open(path, "wb") as f:
        for _ in range(96):
            f.write(b"abcdefghij" * (2**20 // 10) + b"abcdef")
    code = f"""
import resource
from speedtronic.data import TextFileTokenDataset
ds = TextFileTokenDataset({str(path)!r}, 256)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
n = sum(1 for _ in ds)
print("blocks", n, "grew_mib", (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)
"""
    proc = run_py(code, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    blocks, grew = proc.stdout.split()[1], float(proc.stdout.split()[3])
    # each 1 MiB segment drops at most its short tail
    assert 96 * 2**20 // 257 - 100 <= int(blocks) <= 96 * 2**20 // 257 + 1
    assert grew < 48, grew


def test_short_last_batch_with_drop_last_false(tmp_path):
    ids = torch.arange(10 * 9) % 50  # exactly 10 blocks of 8 + 1
    torch.save(ids, tmp_path / "ids.pt")
    cfg = SimpleNamespace(
        dataset=str(tmp_path / "ids.pt"),
        block_size=8,
        micro_batch_size=4,
        target_batch_size=4,
        drop_last=False,
    )
    assert [len(b["input_ids"]) for b in build_dataloader(cfg, vocab_size=50)] == [4, 4, 2]
    cfg.drop_last = True
    assert [len(b["input_ids"]) for b in build_dataloader(cfg, vocab_size=50)] == [4, 4]
    cfg.micro_batch_size = cfg.target_batch_size = 16
    with pytest.raises(DataError, match="holds 10 samples"):
        build_dataloader(cfg, vocab_size=50)


def test_tensor_file_follows_data_shuffle(tmp_path):
    torch.save(torch.arange(64 * 9) % 50, tmp_path / "ids.pt")
    make = lambda shuffle: build_dataloader(
        SimpleNamespace(
            dataset=str(tmp_path / "ids.pt"),
            block_size=8,
            micro_batch_size=64,
            target_batch_size=64,
            shuffle=shuffle,
            seed=1,
        ),
        vocab_size=50,
    )
    plain, shuffled = next(iter(make(False)))["input_ids"], next(iter(make(True)))["input_ids"]
    assert not torch.equal(plain, shuffled)
    assert sorted(map(tuple, plain.tolist())) == sorted(map(tuple, shuffled.tolist()))
    it = infinite_batches(make(True))
    assert torch.equal(next(it)["input_ids"], shuffled)
