"""Checkpoint files on disk: corruption, fallback, unsafe pickle, 2.0 compatibility, retention,
SIGKILL mid-write."""

import hashlib
import io
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from speedtronic.checkpoint import (
    CheckpointError,
    CheckpointManager,
    atomic_json_dump,
    atomic_torch_save,
    capture_rng_state,
    check_compatible,
    checkpoint_files,
    load_checkpoint,
    restore_rng_state,
)
from speedtronic.files import atomic_write_bytes

from conftest import V2_FIXTURES, needs_v2_fixtures, one_error_line, run_cli, tiny_config

ROOT = Path(__file__).resolve().parents[2]


class Warnings(list):
    "A logger stand-in that records `.warning` messages."

    def warning(self, msg):
        self.append(msg)


def names(directory):
    "The files in `directory` but the hash records, each of which must sit beside its file."
    found = sorted(p.name for p in Path(directory).iterdir())
    records = [n for n in found if n.startswith(".step_") and n.endswith(".sha256.json")]
    orphans = [r for r in records if r[1 : -len(".sha256.json")] not in found]
    assert not orphans, f"hash records left without their checkpoint: {orphans}"
    return [n for n in found if n not in records]


def saved_manager(tmp_path, steps=(1, 2, 3), **kw):
    "A manager in `tmp_path` that has saved small checkpoints for `steps`."
    m = CheckpointManager(
        tmp_path, every_steps=1, keep_last=kw.pop("keep_last", None), logger=Warnings(), **kw
    )
    for s in steps:
        m.save(s, {"step": s, "w": torch.full((64,), float(s))})
    return m


# ---------------------------------------------------------------- corruption and fallback (C2, C3)


@pytest.mark.parametrize("damage", ["truncate", "random", "empty"])
def test_damaged_newest_falls_back_to_older(tmp_path, damage):
    m = saved_manager(tmp_path)
    newest = m.path_for(3)
    data = newest.read_bytes()
    newest.write_bytes(
        {"truncate": data[: len(data) // 2], "random": os.urandom(len(data)), "empty": b""}[damage]
    )
    state = m.load_latest()
    assert state["step"] == 2 and m.loaded_path == m.path_for(2)
    assert [p for p, _ in m.skipped] == [newest]
    assert len(m.logger) == 1 and newest.name in m.logger[0]
    assert {"empty": "is empty", "truncate": "is truncated", "random": "is corrupt"}[
        damage
    ] in m.skipped[0][1]


def test_missing_pointer_target_uses_newest_file(tmp_path):
    m = saved_manager(tmp_path)
    m.path_for(3).unlink()
    assert json.loads(m.pointer_path.read_text())["file"] == "step_000000000003.pt"
    assert m.load_latest()["step"] == 2
    assert any("does not exist" in w for w in m.logger)


def test_stale_pointer_never_hides_a_newer_valid_file(tmp_path):
    m = saved_manager(tmp_path, steps=(1, 2))
    # written, then "crashed" before the pointer update
    atomic_torch_save({"step": 5}, m.path_for(5))
    assert json.loads(m.pointer_path.read_text())["step"] == 2
    assert m.latest_path() == m.path_for(5)
    assert m.load_latest()["step"] == 5 and m.skipped == []


def test_pointer_cannot_escape_the_directory(tmp_path):
    ckpt, outside = tmp_path / "ckpt", tmp_path / "outside"
    outside.mkdir()
    torch.save({"step": 99}, outside / "step_000000000099.pt")
    m = saved_manager(ckpt, steps=(1,))
    m.pointer_path.write_text(json.dumps({"step": 99, "file": "../outside/step_000000000099.pt"}))
    assert m.load_latest()["step"] == 1
    assert any("not a checkpoint name" in w for w in m.logger)


def test_nothing_loadable_names_every_file(tmp_path):
    m = saved_manager(tmp_path, steps=(1, 2))
    m.path_for(1).write_bytes(b"")
    m.path_for(2).write_bytes(os.urandom(100))
    with pytest.raises(CheckpointError) as e:
        m.load_latest()
    assert "step_000000000001.pt" in str(e.value) and "step_000000000002.pt" in str(e.value)
    assert "empty" in str(e.value) and "corrupt" in str(e.value)


def test_empty_or_missing_directory_gives_none(tmp_path):
    assert CheckpointManager(tmp_path / "never-created").load_latest() is None
    with pytest.raises(CheckpointError, match="no checkpoint is available to copy"):
        CheckpointManager(tmp_path).copy_to(tmp_path / "x.pt")


# ---------------------------------------------------------------- no unrestricted pickle (C9)


def _write_marker(path):
    Path(path).write_text("code ran")


class Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (_write_marker, (self.marker,))


def test_arbitrary_object_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "marker"
    m = CheckpointManager(tmp_path / "ckpt", every_steps=1)
    m.save(1, {"step": 1})
    torch.save({"step": 2, "coordinator": Payload(str(marker))}, m.path_for(2))
    with pytest.raises(CheckpointError, match="could run code"):
        load_checkpoint(m.path_for(2))
    with pytest.warns(RuntimeWarning, match="could run code"):
        state = m.load_latest()
    assert state["step"] == 1 and not marker.exists()
    # control: the payload is live — plain pickle loading would have run it
    torch.load(m.path_for(2), weights_only=False)
    assert marker.read_text() == "code ran"


# ---------------------------------------------------------------- 2.0 checkpoints still resume

# files written by the published 2.0.0 (README there), found where every test finds them
V2 = V2_FIXTURES or Path("shared/fixtures/v2.0")


@needs_v2_fixtures
def test_checkpoint_written_by_2_0_resumes(tmp_path):
    """A checkpoint folder 2.0.0 wrote loads, fits its model, restores its RNG, and its files are
    never pruned by our retention."""
    import shutil, yaml
    from speedtronic.config import SpeedtronicConfig
    from speedtronic.registry import build_model

    folder = tmp_path / "checkpoints"
    shutil.copytree(V2 / "checkpoint-adamw" / "run" / "checkpoints", folder)
    for p in folder.iterdir():
        p.chmod(0o644)
    allowed = [np.dtype, np.ndarray, np._core.multiarray._reconstruct, type(np.dtype(np.uint32))]
    with torch.serialization.safe_globals(allowed):  # plain torch's reading, not ours
        plain = torch.load(folder / "step_000000000008.pt", weights_only=True)
    random.setstate(plain["rng"]["python"])
    np.random.set_state(plain["rng"]["numpy"])
    torch.set_rng_state(plain["rng"]["torch"])
    expected = (random.random(), np.random.rand(), torch.rand(2).tolist())

    m = CheckpointManager(folder, every_steps=4, keep_last=2)
    loaded = m.load_latest()
    assert (loaded["step"], loaded["samples"], loaded["precision"]["mode"]) == (
        8,
        plain["samples"],
        "fp32",
    )
    config = SpeedtronicConfig.from_dict(
        yaml.safe_load((V2 / "checkpoint-adamw" / "config.yaml").read_text())
    )
    fresh = build_model(config.model)
    check_compatible(loaded, model=fresh, config=config)
    fresh.load_state_dict(loaded["model"])
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in plain["model"].items())
    assert restore_rng_state(loaded["rng"]) == []
    assert (random.random(), np.random.rand(), torch.rand(2).tolist()) == expected
    for s in (12, 16, 20):
        m.save(s, {"step": s})  # the 2.0 files are foreign: kept
    assert names(folder) == [
        "latest.json",
        "step_000000000004.pt",
        "step_000000000008.pt",
        "step_000000000016.pt",
        "step_000000000020.pt",
    ]


def test_incompatible_checkpoint_names_the_differences(tmp_path):
    m = CheckpointManager(tmp_path, every_steps=1)
    m.save(
        1,
        {
            "model": torch.nn.Linear(8, 4).state_dict(),
            "config": {"model": {"d_model": 8, "n_head": 2}},
        },
    )
    with pytest.raises(CheckpointError) as e:
        check_compatible(
            m.load_latest(),
            model=torch.nn.Linear(16, 4),
            config={"model": {"d_model": 16, "n_head": 2}},
        )
    msg = str(e.value)
    assert (
        "weight: saved (4, 8) vs current (4, 16)" in msg
        and "model.d_model: saved 8 vs current 16" in msg
    )
    assert "n_head" not in msg and "bias" not in msg


def test_config_object_checked_and_secrets_redacted(tmp_path):
    from speedtronic.config import SpeedtronicConfig

    saved_cfg = SpeedtronicConfig.from_dict(
        {"model": {"d_model": 8, "n_head": 2}, "distributed": {"token": "hf_secret"}}
    )
    m = CheckpointManager(tmp_path, every_steps=1)
    # caller forgot to redact
    m.save(1, {"model": torch.nn.Linear(8, 4).state_dict(), "config": saved_cfg.to_dict()})
    assert b"hf_secret" not in m.path_for(1).read_bytes()
    state = m.load_latest()
    assert state["config"]["distributed"]["token"] == "<redacted>"
    check_compatible(state, model=torch.nn.Linear(8, 4), config=saved_cfg)
    other = SpeedtronicConfig.from_dict({"model": {"d_model": 8, "n_head": 4}})
    with pytest.raises(CheckpointError, match="model.n_head: saved 2 vs current 4"):
        check_compatible(state, model=torch.nn.Linear(8, 4), config=other)


# ---------------------------------------------------------------- RNG


def test_rng_roundtrip_through_a_weights_only_file(tmp_path):
    atomic_torch_save({"rng": capture_rng_state()}, tmp_path / "r.pt")
    want = (random.random(), np.random.rand(), torch.rand(3).tolist())
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    assert restore_rng_state(load_checkpoint(tmp_path / "r.pt")["rng"]) == []
    assert (random.random(), np.random.rand(), torch.rand(3).tolist()) == want


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_rng_roundtrip(tmp_path):
    atomic_torch_save({"rng": capture_rng_state()}, tmp_path / "r.pt")
    want = torch.rand(4, device="cuda").tolist()
    torch.cuda.manual_seed_all(0)
    rng = load_checkpoint(tmp_path / "r.pt")["rng"]
    assert len(rng["cuda"]) == torch.cuda.device_count() and restore_rng_state(rng) == []
    assert torch.rand(4, device="cuda").tolist() == want


def test_rng_restore_failures_are_reported():
    log = Warnings()
    problems = restore_rng_state({"python": "garbage", "torch": torch.get_rng_state()}, logger=log)
    assert (
        len(problems) == 1
        and problems[0].startswith("python:")
        and log == [f"RNG state not restored: {problems[0]}"]
    )


# ---------------------------------------------------------------- retention (C11) and idempotent
# saves


def test_retention_counts_only_own_files(tmp_path):
    torch.save({"step": 7}, tmp_path / "step_000000000007.pt")  # a user's copy
    torch.save({"step": 1}, tmp_path / "step_1.pt")  # another tool's naming
    (tmp_path / "notes.txt").write_text("keep me")
    m = CheckpointManager(tmp_path, every_steps=1, keep_last=2)
    for s in (2, 3, 4, 5):
        m.save(s, {"step": s})
    assert names(tmp_path) == [
        "latest.json",
        "notes.txt",
        "step_000000000004.pt",
        "step_000000000005.pt",
        "step_000000000007.pt",
        "step_1.pt",
    ]
    pointer = json.loads(m.pointer_path.read_text())
    assert pointer == {
        "step": 5,
        "file": "step_000000000005.pt",
        "written": ["step_000000000004.pt", "step_000000000005.pt"],
    }


def test_retention_continues_across_manager_instances(tmp_path):
    CheckpointManager(tmp_path, every_steps=1, keep_last=2).save(1, {"step": 1})
    CheckpointManager(tmp_path, every_steps=1, keep_last=2).save(2, {"step": 2})
    CheckpointManager(tmp_path, every_steps=1, keep_last=2).save(3, {"step": 3})
    assert [p.name for p in checkpoint_files(tmp_path)] == [
        "step_000000000003.pt",
        "step_000000000002.pt",
    ]


def test_just_written_file_is_kept_even_when_lower(tmp_path):
    m = CheckpointManager(tmp_path, every_steps=1, keep_last=1)
    m.save(10, {"step": 10})
    m.save(2, {"step": 2})
    assert names(tmp_path) == ["latest.json", "step_000000000002.pt"]


def test_saving_the_same_step_twice_is_idempotent(tmp_path):
    m = CheckpointManager(tmp_path, every_steps=1, keep_last=3)
    m.save(1, {"step": 1})
    p1 = m.save(2, {"step": 2, "v": 1})
    pointer = m.pointer_path.read_text()
    p2 = m.save(2, {"step": 2, "v": 1})
    assert p1 == p2 and m.pointer_path.read_text() == pointer
    assert names(tmp_path) == ["latest.json", "step_000000000001.pt", "step_000000000002.pt"]


def test_failed_write_leaves_target_and_no_temp(tmp_path):
    target = tmp_path / "latest.json"
    atomic_json_dump({"step": 1}, target)
    with pytest.raises(TypeError):
        atomic_write_bytes("not bytes", target)
    assert json.loads(target.read_text()) == {"step": 1} and names(tmp_path) == ["latest.json"]


def test_copy_to_copies_newest_loadable(tmp_path):
    m = saved_manager(tmp_path / "ckpt", steps=(1, 2))
    m.path_for(2).write_bytes(b"")
    out = m.copy_to(tmp_path)
    assert out == tmp_path / "step_000000000001.pt" and load_checkpoint(out)["step"] == 1


# ---------------------------------------------------------------- a real crash mid-write (C4, C5)

CHILD = r"""
import sys, torch
from speedtronic.checkpoint import CheckpointManager
m = CheckpointManager(sys.argv[1], every_steps=1, keep_last=3)
m.save(1, {"step": 1, "w": torch.arange(10.0)})
big = {f"t{i}": torch.ones(5_000_000) for i in range(10)}   # ~200 MB
print("saved-1", flush=True)
m.save(2, {"step": 2, **big})
print("saved-2", flush=True)
"""


def test_sigkill_during_save_keeps_older_checkpoint(tmp_path):
    directory = tmp_path / "ckpt"
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(directory)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline().strip() == "saved-1", child.stderr.read()
        deadline, temp = time.monotonic() + 120, None
        while temp is None and time.monotonic() < deadline and child.poll() is None:
            temp = next(
                (p for p in directory.glob(".step_000000000002.pt.tmp-*") if p.stat().st_size > 0),
                None,
            )
        assert temp is not None, "the child never started writing step 2"
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    assert child.returncode == -signal.SIGKILL
    assert not (directory / "step_000000000002.pt").exists()
    assert temp.exists()  # a killed process cannot clean up ...

    m = CheckpointManager(directory, every_steps=1, keep_last=3)
    state = m.load_latest()
    assert state["step"] == 1 and torch.equal(state["w"], torch.arange(10.0)) and m.skipped == []
    assert json.loads(m.pointer_path.read_text())["step"] == 1
    m.save(3, {"step": 3})  # ... so the next save removes the dead writer's temp file
    assert names(directory) == ["latest.json", "step_000000000001.pt", "step_000000000003.pt"]


def test_nothing_loadable_names_each_file_once_without_pointless_advice(tmp_path):
    """The CLI's one line for a run whose every checkpoint is cut short: each file once, its whole
    reason, no 'older checkpoint'."""
    cfg = tiny_config(tmp_path, max_steps=4, every_steps=2, keep_last=None)
    assert run_cli("train", "--config", str(cfg), "--device", "cpu", cwd=tmp_path).returncode == 0
    files = checkpoint_files(tmp_path / "out" / "checkpoints")
    for f in files:
        f.write_bytes(f.read_bytes()[:3000])
    line = one_error_line(
        run_cli("train", "--config", str(cfg), "--device", "cpu", "--resume", cwd=tmp_path),
        "can be loaded",
        "Restore a good copy there, or start without resume",
    )
    for f in files:
        assert line.count(f.name) == 1 and f"{f.name} is truncated (3000 bytes" in line, line
    assert "older checkpoint" not in line, line


def test_a_folder_given_as_the_checkpoint_says_so(tmp_path):
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(tmp_path)
    assert (
        str(e.value)
        == f"checkpoint {tmp_path} is a folder, not a checkpoint file; name one of the "
        "step_<step>.pt files in it"
    )


# ---------------------------------------------------------------- a file named by hand: the same
# checks as load_latest


class Regressor(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)

    def forward(self, x, y):
        return ((self.lin(x).squeeze(-1) - y) ** 2).mean()


def regressor_trainer(manager=None, max_steps=2):
    from speedtronic.profiling import MetricLogger
    from speedtronic.trainer import Trainer

    torch.manual_seed(0)
    model = Regressor()
    batches = [(torch.randn(2, 4), torch.randn(2)) for _ in range(8)]
    return Trainer(
        model,
        torch.optim.AdamW(model.parameters(), lr=0.01),
        batches,
        device="cpu",
        max_steps=max_steps,
        logger=MetricLogger(stream=False),
        checkpoint_manager=manager,
    )


def test_resume_of_a_named_file_refuses_what_load_latest_skips(tmp_path):
    ours = CheckpointManager(
        tmp_path / "ours", every_steps=1, keep_last=None, run_id="run-a", logger=Warnings()
    )
    regressor_trainer(ours).fit()
    theirs = CheckpointManager(tmp_path / "theirs", every_steps=1, run_id="run-b")
    regressor_trainer(theirs, max_steps=5).fit()
    state = torch.load(ours.path_for(2), weights_only=True)
    for moments in state["optimizer"]["state"].values():
        moments["exp_avg"].fill_(float("nan"))
    torch.save(state, ours.path_for(3))  # a diverged optimizer state
    ours.path_for(4).write_bytes(ours.path_for(1).read_bytes())  # step 1 under step 4's name
    # another run's file in our folder
    ours.path_for(5).write_bytes(theirs.path_for(5).read_bytes())
    ours.path_for(6).symlink_to(theirs.path_for(5))  # another run's checkpoint linked in
    for step, reason in [
        (3, "the optimizer state holds NaN or infinity"),
        (4, "holds step 1, not step 4"),
        (5, "belongs to run run-b, not to run run-a"),
        (6, "is a link to"),
    ]:
        t = regressor_trainer()
        with pytest.raises(CheckpointError, match=reason):
            t.resume(ours.path_for(step))
        assert t.step == 0
    assert ours.load_latest()["step"] == 2  # the manager skips the same four
    assert [p.name for p, _ in ours.skipped] == [ours.path_for(s).name for s in (6, 5, 4, 3)]
    t = regressor_trainer(max_steps=3)
    t.resume(ours.path_for(2))
    assert t.fit().steps == 3


def _reachable_names(module, depth: int = 2):
    "Every dotted name reachable from `module` by attribute access, `depth` steps deep."
    frontier = [("", module)]
    for _ in range(depth):
        following = []
        for prefix, obj in frontier:
            try:
                names = list(vars(obj)) if hasattr(obj, "__dict__") else dir(obj)
            except TypeError:
                continue
            for name in names:
                try:
                    value = getattr(obj, name)
                except Exception:
                    continue
                dotted = f"{prefix}.{name}" if prefix else name
                yield dotted, value
                following.append((dotted, value))
        frontier = following


def _globals_a_real_index_names() -> set:
    """The (module, name) pairs in the `.metadata` torch.distributed.checkpoint writes for a model
    and its AdamW."""
    import pickle
    import tempfile
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    net = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 8))
    opt = torch.optim.AdamW(net.parameters())
    net(torch.tensor([[1, 2]])).sum().backward()
    opt.step()
    weights, moments = get_state_dict(net, opt)
    seen = set()

    class Recording(pickle.Unpickler):
        def find_class(self, module, name):
            seen.add((module, name))
            return super().find_class(module, name)

    with tempfile.TemporaryDirectory() as d:
        dcp.save({"model": weights, "optimizer": moments}, checkpoint_id=d, no_dist=True)
        with open(Path(d) / ".metadata", "rb") as f:
            Recording(f).load()
    assert ("torch.distributed.checkpoint.metadata", "Metadata") in seen, seen
    return seen


def test_the_sharded_index_reader_reaches_no_callable_but_the_index_records():
    """The corpus: every global reachable by a dotted path from each module the index reader allows
    (every module of its allowed pairs, torch for its dtypes, and every module a real index names),
    each through the real unpickler by both opcodes that name a global (protocol 4's STACK_GLOBAL
    and protocol 0's GLOBAL, whose names Python 2 compatibility maps). Only the exact records,
    sizes, dtypes and paths load."""
    import importlib
    import pickle
    from speedtronic.checkpoint import _INDEX_GLOBALS, _Forbidden, _IndexUnpickler

    text = lambda s: (
        b"\x8c" + bytes([len(s.encode())]) + s.encode()
        if len(s.encode()) < 256
        else b"\x8d" + len(s.encode()).to_bytes(8, "little") + s.encode()
    )
    opcodes = {
        "STACK_GLOBAL": lambda m, n: b"\x80\x04" + text(m) + text(n) + b"\x93.",
        "GLOBAL": lambda m, n: b"c" + m.encode() + b"\n" + n.encode() + b"\n.",
    }
    allowed_objects = {id(getattr(importlib.import_module(m), n)) for m, n in _INDEX_GLOBALS}
    allowed_modules = {m for m, _ in _INDEX_GLOBALS} | {"torch"}
    modules = sorted(
        allowed_modules
        | {m for m, _ in _globals_a_real_index_names()}
        | {"torch.distributed.checkpoint"}
    )
    tried, loaded = 0, Counter()
    for module_name in modules:
        module = importlib.import_module(module_name)
        for dotted, _ in _reachable_names(module):
            for opcode, payload in opcodes.items():
                if opcode == "GLOBAL" and "\n" in dotted:
                    continue  # a GLOBAL's name ends at its newline
                tried += 1
                try:
                    got = _IndexUnpickler(io.BytesIO(payload(module_name, dotted))).load()
                except _Forbidden:
                    continue
                loaded[opcode] += 1
                assert id(got) in allowed_objects or isinstance(got, torch.dtype), (
                    opcode,
                    module_name,
                    dotted,
                    got,
                )
                assert "." not in dotted and not (
                    callable(got) and id(got) not in allowed_objects
                ), (opcode, module_name, dotted)
    dtypes = sum(isinstance(v, torch.dtype) for v in vars(torch).values())
    expected = len(_INDEX_GLOBALS) + dtypes  # every allowed pair loads, by either opcode
    assert tried > 20_000 and loaded == {o: expected for o in opcodes}, (tried, loaded, expected)


def test_each_checkpoint_has_its_hash_record_and_retention_removes_it(tmp_path):
    "A saved file's sha256 and size sit beside it and go with it; a dead writer's temp goes."
    dead = 2**22 + 12345  # above any pid this machine gives out
    stale = tmp_path / f"..step_000000000001.pt.sha256.json.tmp-{dead}-abcdef12"
    stale.write_text("{")
    m = CheckpointManager(tmp_path, every_steps=1, keep_last=2)
    for step in (1, 2, 3):
        m.save(step, {"step": step, "w": torch.arange(100.0)})
    assert names(tmp_path) == ["latest.json", "step_000000000002.pt", "step_000000000003.pt"]
    assert not stale.exists()
    record = json.loads((tmp_path / ".step_000000000003.pt.sha256.json").read_text())
    data = m.path_for(3).read_bytes()
    assert record == {
        "file": "step_000000000003.pt",
        "size": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }
    assert not (tmp_path / ".step_000000000001.pt.sha256.json").exists()
    m.clear()
    assert names(tmp_path) == []
