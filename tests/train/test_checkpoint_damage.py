"""A checkpoint whose bytes changed on disk is found by its content hash, through the real CLI.

- one byte flipped in the middle of the tensor data of the newest `step_N.pt`, or of a shard of the
  newest `step_N.dcp` folder: `train --resume` warns naming the file, falls back to the previous
  checkpoint and trains the same losses as an uninterrupted run;
- a shard cut short in a folder with no hash record (an older run's) falls back the same way;
- `generate --run` on a damaged newest checkpoint uses the previous one (with the warning), and
  `generate --checkpoint` on the damaged file exits 2 naming it;
- `train --resume --checkpoint FILE` continues from a named older checkpoint, and refuses (exit 2,
  one line) a damaged, missing or foreign one, or one given without `--resume`;
- a newest `step_N.dcp` whose `.metadata` would run code (its hash record stale, removed or
  rewritten to fit) is never run by a one-process `train --resume`: skipped as unsafe with one
  warning (the resume falls back), and refused with one line when `--checkpoint` names it.
"""

from __future__ import annotations

import json
import shutil
import struct
import zipfile
from pathlib import Path

import pytest

from speedtronic.checkpoint import check_digest, load_checkpoint

from conftest import dotted_payload, jsonl_records, ok, one_error_line, run_cli, tiny_config

TEXT = "the quick brown fox jumps over the lazy dog. " * 40


def train(tmp: Path, name: str, *args: str, **sections):
    "`speedtronic train` of the tiny run (a checkpoint every 2 steps, all kept), logged to `name`."
    logging = {"json_file": str(tmp / f"{name}.jsonl")}
    # max_steps and the rest from `sections`
    cfg = tiny_config(tmp, f"{name}.yaml", keep_last=None, logging=logging, **sections)
    return run_cli("train", "--config", str(cfg), "--device", "cpu", *args, cwd=tmp)


def losses(jsonl: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in jsonl_records(jsonl)}


def tensor_middle(path: Path) -> int:
    "The offset of the middle byte of the largest tensor in the `torch.save` file `path`."
    with zipfile.ZipFile(path) as archive:
        entry = max(
            (i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size
        )
    with open(path, "rb") as f:
        f.seek(entry.header_offset + 26)
        name_length, extra_length = struct.unpack("<HH", f.read(4))
    return entry.header_offset + 30 + name_length + extra_length + entry.file_size // 2


def flip(path: Path, offset: int | None = None) -> None:
    "Flip one bit of the byte at `offset` (default: the middle of the file) of `path`."
    data = bytearray(path.read_bytes())
    offset = len(data) // 2 if offset is None else offset
    data[offset] ^= 0x08
    path.write_bytes(data)


def step_file(tmp: Path, step: int, suffix: str = ".pt") -> Path:
    return tmp / "out" / "checkpoints" / f"step_{step:012d}{suffix}"


def stopped_at_step_4(tmp: Path, *args: str, **sections) -> None:
    "Train the 6-step run, then leave its checkpoints as a run stopped after step 4 would."
    ok(train(tmp, "first", *args, max_steps=6, **sections))
    for last in step_file(tmp, 6, ".pt"), step_file(tmp, 6, ".dcp"):
        if last.is_dir():
            shutil.rmtree(last)
        elif last.exists():
            last.unlink()
            last.with_name(f".{last.name}.sha256.json").unlink()
    pointer = tmp / "out" / "checkpoints" / "latest.json"
    saved = json.loads(pointer.read_text())
    newest = saved["written"][-2]
    saved.update(step=4, file=newest, written=saved["written"][:-1])
    pointer.write_text(json.dumps(saved))


def warnings_of(proc) -> list[str]:
    "The warning lines of a command: the run's log and Python warnings."
    lines = (proc.stdout + proc.stderr).splitlines()
    return [line for line in lines if "| WARNING |" in line or "speedtronic: warning:" in line]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, dict[int, float]]:
    "The losses of the uninterrupted 6-step runs, one process and sharded."
    found = {}
    for kind, sections in [("pt", {}), ("dcp", {"parallel": {"strategy": "fsdp"}})]:
        tmp = tmp_path_factory.mktemp(f"reference-{kind}")
        ok(train(tmp, "reference", max_steps=6, **sections))
        found[kind] = losses(tmp / "reference.jsonl")
    return found


def test_a_flipped_byte_in_the_newest_file_falls_back_to_the_previous_one(tmp_path, reference):
    stopped_at_step_4(tmp_path)
    newest = step_file(tmp_path, 4)
    flip(newest, tensor_middle(newest))
    load_checkpoint(step_file(tmp_path, 2))  # the previous one is sound
    proc = train(tmp_path, "resumed", "--resume", max_steps=6)
    ok(proc)
    damaged = [w for w in warnings_of(proc) if newest.name in w]
    assert len(damaged) == 1 and "is damaged: it no longer has the content written" in damaged[0], (
        proc.stdout[-3000:] + proc.stderr[-3000:]
    )
    got = losses(tmp_path / "resumed.jsonl")
    assert sorted(got) == [3, 4, 5, 6], got  # from step 2, not the damaged step 4
    assert got == {s: reference["pt"][s] for s in got}
    assert check_digest(newest) and load_checkpoint(newest)["step"] == 4  # written again, whole


def test_a_flipped_byte_in_a_shard_of_the_newest_folder_falls_back(tmp_path, reference):
    sharded = {"parallel": {"strategy": "fsdp"}}
    stopped_at_step_4(tmp_path, **sharded)
    shard = step_file(tmp_path, 4, ".dcp") / "__0_0.distcp"
    flip(shard)
    whole = tmp_path / "whole.pt"
    one_error_line(
        run_cli("consolidate", str(shard.parent), "--output", str(whole), cwd=tmp_path),
        "step_000000000004.dcp is damaged: its file __0_0.distcp",
    )
    ok(
        run_cli(
            "consolidate", str(step_file(tmp_path, 2, ".dcp")), "--output", str(whole), cwd=tmp_path
        )
    )
    assert check_digest(whole)  # the file consolidate writes has its record too
    proc = train(tmp_path, "resumed", "--resume", max_steps=6, **sharded)
    ok(proc)
    damaged = [w for w in warnings_of(proc) if "step_000000000004.dcp" in w]
    assert len(damaged) == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "is damaged: its file __0_0.distcp no longer has the content written" in damaged[0]
    got = losses(tmp_path / "resumed.jsonl")
    assert got == {s: reference["dcp"][s] for s in (3, 4, 5, 6)}, got


def test_a_truncated_shard_falls_back_even_without_a_hash_record(tmp_path, reference):
    "A folder of an older run (no record): a shard shorter than its index says is skipped."
    sharded = {"parallel": {"strategy": "fsdp"}}
    stopped_at_step_4(tmp_path, **sharded)
    folder = step_file(tmp_path, 4, ".dcp")
    (folder / ".sha256.json").unlink(missing_ok=True)
    shard = folder / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-300])
    proc = train(tmp_path, "resumed", "--resume", max_steps=6, **sharded)
    ok(proc)
    assert any(
        folder.name in w and "is truncated: its shard __0_0.distcp is" in w
        for w in warnings_of(proc)
    ), proc.stdout[-3000:] + proc.stderr[-3000:]
    got = losses(tmp_path / "resumed.jsonl")
    assert got == {s: reference["dcp"][s] for s in (3, 4, 5, 6)}, got


def test_generate_on_a_damaged_newest_checkpoint_uses_the_previous_one(tmp_path):
    "`generate --run` falls back as `--resume` does; `--checkpoint` of the damaged file exits 2."
    (tmp_path / "text.txt").write_text(TEXT)
    text = {"text_path": str(tmp_path / "text.txt"), "synthetic": False}
    model = {"vocab_size": 256, "n_head": 4, "n_kv_head": 2}
    ok(train(tmp_path, "first", max_steps=4, data=text, model=model))
    args = ["--prompt", "the qu", "--temperature", "0", "--max-new-tokens", "20", "--device", "cpu"]
    older = step_file(tmp_path, 2)
    want = ok(run_cli("generate", "--checkpoint", str(older), *args, cwd=tmp_path)).stdout
    newest = step_file(tmp_path, 4)
    flip(newest, tensor_middle(newest))
    proc = ok(run_cli("generate", "--run", str(tmp_path / "out"), *args, cwd=tmp_path))
    assert proc.stdout == want
    assert any(newest.name in w and "is damaged" in w for w in warnings_of(proc)), proc.stderr
    one_error_line(
        run_cli("generate", "--checkpoint", str(newest), *args, cwd=tmp_path),
        newest.name,
        "is damaged: it no longer has the content written",
    )


def test_resume_from_a_named_older_checkpoint(tmp_path, reference):
    ok(train(tmp_path, "first", max_steps=6))
    proc = ok(
        train(tmp_path, "resumed", "--resume", "--checkpoint", "step_000000000002.pt", max_steps=6)
    )
    assert any(
        "resuming from step_000000000002.pt though newer checkpoints are kept" in w
        for w in warnings_of(proc)
    ), proc.stdout[-3000:] + proc.stderr[-3000:]
    got = losses(tmp_path / "resumed.jsonl")
    assert got == {s: reference["pt"][s] for s in (3, 4, 5, 6)}, got
    assert load_checkpoint(step_file(tmp_path, 6))["step"] == 6


def test_a_named_checkpoint_is_checked_with_no_fallback(tmp_path):
    ok(train(tmp_path, "first", max_steps=4))
    older = step_file(tmp_path, 2)
    flip(older, tensor_middle(older))
    one_error_line(
        train(tmp_path, "named", "--resume", "--checkpoint", str(older), max_steps=6),
        older.name,
        "is damaged",
    )
    one_error_line(
        train(tmp_path, "named", "--resume", "--checkpoint", "step_000000000008.pt", max_steps=6),
        "--checkpoint step_000000000008.pt does not exist",
        "step_000000000004.pt",
    )
    elsewhere = tmp_path / "step_000000000004.pt"
    elsewhere.write_bytes(step_file(tmp_path, 4).read_bytes())
    one_error_line(
        train(tmp_path, "named", "--resume", "--checkpoint", str(elsewhere), max_steps=6),
        "is not in this run's checkpoint folder",
    )
    one_error_line(
        train(tmp_path, "named", "--checkpoint", "step_000000000004.pt", max_steps=6),
        "add --resume",
    )
    assert "--checkpoint PATH" in ok(run_cli("train", "--help", cwd=tmp_path)).stdout


@pytest.mark.parametrize("record", ["stale", "removed", "rewritten"])
def test_a_sharded_index_that_runs_code_is_never_run_by_a_one_process_resume(
    tmp_path, reference, record
):
    """The newest `step_N.dcp` of a one-process run gets a `.metadata` that runs code, then holds
    the real index; its hash record is left stale, removed (an older run's folder) or rewritten to
    fit. `train --resume` skips it with one warning naming it as unsafe and resumes from the
    previous checkpoint, as from any unusable newest one; `--resume --checkpoint` naming it exits
    2 with one line naming it. The payload never runs (its marker file is never created)."""
    import hashlib, pickle

    sharded = {"parallel": {"strategy": "fsdp"}}
    stopped_at_step_4(tmp_path, **sharded)
    folder = step_file(tmp_path, 4, ".dcp")
    marker = tmp_path / "marker"
    index = folder / ".metadata"
    crafted = dotted_payload(index.read_bytes(), f"touch {marker}")
    index.write_bytes(crafted)
    digests = folder / ".sha256.json"
    if record == "removed":
        digests.unlink()
    elif record == "rewritten":
        saved = json.loads(digests.read_text())
        digest = hashlib.sha256(crafted).hexdigest()
        saved["files"][".metadata"] = {"size": len(crafted), "sha256": digest}
        digests.write_text(json.dumps(saved))
    one_error_line(
        train(tmp_path, "named", "--resume", "--checkpoint", str(folder), max_steps=6, **sharded),
        folder.name,
        "is unsafe to load",
        "os.system",
    )
    assert not marker.exists()
    proc = ok(train(tmp_path, "resumed", "--resume", max_steps=6, **sharded))
    assert not marker.exists()
    unsafe = [w for w in warnings_of(proc) if folder.name in w]
    assert len(unsafe) == 1 and "is unsafe to load: its index (.metadata)" in unsafe[0], (
        proc.stdout[-3000:] + proc.stderr[-3000:]
    )
    assert "step_000000000002.dcp at step 2" in proc.stdout, proc.stdout[-3000:]
    got = losses(tmp_path / "resumed.jsonl")
    assert got == {s: reference["dcp"][s] for s in (3, 4, 5, 6)}, got
    pickle.loads(crafted)  # control: the payload is live, plain unpickling runs it
    assert marker.exists()
