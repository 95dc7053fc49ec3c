"""The DiLoCo master trusts nothing it reads and never ends on a stale global (issue 24, "The Hub
and peers, as they really behave"): replayed and mislabelled deltas, a delta header that lies about
its size, a huge delta that does not fit the model, a full shared directory, a version file that
turns unreadable before the end, and a master killed during its final round. Real masters over a
real shared directory (real `speedtronic train` processes where the run's exit status is the
point); no mocks."""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import ROOT, communicate_or_dump  # noqa: E402
from diloco_nodes import launch, node_config, wait_for
from test_diloco_master_faults import Run  # noqa: E402

from speedtronic.distributed import HubUnavailable, SharedDirectory
from speedtronic.distributed.tensors import (
    GLOBAL_METADATA_PATH,
    delta_header,
    delta_path,
    encode_delta,
    save_safetensors,
)


def _commit(run: Run, node: str, step: int, tensors: dict, **header) -> Path:
    "Put `node`'s delta file at `step`: `tensors`, a header of this version (`header` overrides)."
    fields = dict(
        node_id=node,
        local_step=step,
        base_outer_step=max(run.master.outer_step, 0),
        inner_steps=10,
        encoding="float32",
        session="s",
    )
    fields.update(header)
    out = run.tmp / "out" / f"{node}-{step}-{time.monotonic_ns()}.safetensors"
    save_safetensors(tensors, out, delta_header(**fields))
    run.transport().upload({delta_path(node, step): out})
    return out


def _small(run: Run, scale: float = 1e-3, dtype: torch.dtype = torch.float32) -> dict:
    return {k: torch.full(v.shape, scale, dtype=dtype) for k, v in run.shapes.items()}


def _global(run: Run) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in run.master.global_state.items()}


# -- 1. replays and files that lie about their tensors ---------------------------------------------
def test_a_replayed_delta_restamped_one_step_later_is_refused_and_folded_once(tmp_path):
    run = Run(tmp_path)
    _commit(run, "w", 10, _small(run))
    _commit(run, "w", 20, _small(run, 2e-3))
    assert run.master.sync_once() == 1
    before = _global(run)
    _commit(run, "w", 21, _small(run, 2e-3))  # steps 11..20 again, stamped 12..21
    assert run.master.sync_once() == 1  # nothing folded
    assert run.rejected() == {("w", 21): "overlap"}
    assert all(torch.equal(before[k], v) for k, v in run.master.global_state.items())
    assert run.master.ledger.folded("w", "s", 20) and not run.master.ledger.folded("w", "s", 21)
    _commit(run, "w", 30, _small(run))  # the node's real next delta, 21..30, still follows on
    assert run.master.sync_once() == 2 and run.master.ledger.folded("w", "s", 30)


def test_a_replay_inside_one_pass_is_refused_too(tmp_path):
    run = Run(tmp_path)
    _commit(run, "w", 10, _small(run))
    _commit(run, "w", 11, _small(run))  # listed in the same pass as the delta it repeats
    assert run.master.sync_once() == 1
    assert run.rejected() == {("w", 11): "overlap"}
    assert [(n, s) for n, s in run.folded()] == [("w", 10)]


def test_a_header_saying_float32_over_float64_tensors_is_refused(tmp_path):
    run = Run(tmp_path)
    _commit(run, "w", 10, _small(run, dtype=torch.float64))  # header: encoding float32
    assert run.master.sync_once() == 0
    assert run.rejected() == {("w", 10): "dtype"}
    message = run.seen("delta_rejected")[0]["message"]
    assert "torch.float64" in message and "encoding='float32'" in message
    _commit(run, "w", 10, encode_delta(_small(run), "int8"), encoding="bfloat16")
    assert run.master.sync_once() == 0 and len(run.seen("delta_rejected")) == 2


# -- 2. huge or lying files cost the master neither memory nor disk --------------------------------
def test_a_header_claiming_a_terabyte_is_one_line_and_quarantined_as_a_record(tmp_path):
    run = Run(tmp_path)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes((10**12).to_bytes(8, "little") + bytes(range(128, 256)) * 64)
    run.transport().upload({delta_path("w", 10): bad})
    assert run.master.sync_once() == 0
    (refusal,) = run.seen("delta_rejected")
    assert refusal["reason"] == "unreadable"
    assert "1000000000000 bytes" in refusal["message"] and "\n" not in refusal["message"]
    assert "UnicodeDecodeError" not in refusal["message"]
    kept = list((tmp_path / "state" / "quarantine").iterdir())
    assert [p.name for p in kept] == ["nodes__w__delta_10.safetensors.json"]  # no copy
    record = json.loads(kept[0].read_text())
    assert record["path"] == "nodes/w/delta_10.safetensors" and record["node_id"] == "w"
    assert record["sha256"] == hashlib.sha256(bad.read_bytes()).hexdigest()
    assert record["size"] == bad.stat().st_size and record["reason"] == "unreadable"


def test_the_quarantine_keeps_records_of_the_newest_20_refusals_only(tmp_path):
    run = Run(tmp_path)
    for step in range(1, 31):
        _commit(run, "w", step, _small(run, float("nan")), inner_steps=1)
        run.master.sync_once()
    kept = sorted(p.name for p in (tmp_path / "state" / "quarantine").iterdir())
    assert len(kept) == 20 and all(name.endswith(".json") for name in kept)


HUGE_MASTER = textwrap.dedent(
    """
    import json, resource, sys
    from pathlib import Path
    import torch
    from speedtronic.distributed import MasterOuterLoop, SharedDirectory
    from speedtronic.distributed.transport import RetryPolicy

    tmp = Path(sys.argv[1])
    t = SharedDirectory(tmp / "repo", retry=RetryPolicy(0.001, 0.01, 2))
    t.open(create=True)
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Linear(6, 3))
    m = MasterOuterLoop(t, model.state_dict(), node_state_dir=tmp / "state", node_id="m")
    m.start_master()
    big = Path(sys.argv[2])
    (tmp / "repo" / "nodes" / "w").mkdir(parents=True, exist_ok=True)
    big.rename(tmp / "repo" / "nodes" / "w" / "delta_10.safetensors")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    m.sync_once()
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    quarantine = sum(p.stat().st_size for p in (tmp / "state").rglob("*") if p.is_file())
    print(json.dumps({"grew_kb": after - before, "state_bytes": quarantine}))
    """
)


def test_a_huge_delta_that_does_not_fit_the_model_is_refused_from_its_header(tmp_path):
    "200 MB declared for a tensor the model lacks: the body is never read, nothing of it is kept."
    size = 200_000_000
    header = json.dumps(
        {
            "__metadata__": {"node_id": "w", "local_step": "10", "encoding": "float32"},
            "0.weight": {"dtype": "F32", "shape": [size // 4], "data_offsets": [0, size]},
        }
    ).encode()
    big = tmp_path / "big.safetensors"
    with big.open("wb") as f:
        f.write(len(header).to_bytes(8, "little") + header)
        f.truncate(8 + len(header) + size)  # sparse: no disk needed for the body
    proc = subprocess.run(
        [sys.executable, "-c", HUGE_MASTER, str(tmp_path), str(big)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["grew_kb"] < 50_000, seen  # a whole read would add 200 MB
    assert seen["state_bytes"] < 100_000, seen  # a record, not a 200 MB copy
    record = json.loads(
        (tmp_path / "state" / "quarantine" / "nodes__w__delta_10.safetensors.json").read_text()
    )
    assert record["reason"] == "keys" and record["size"] == 8 + len(header) + size


def _mount_tmpfs(where: Path, size: str) -> None:
    where.mkdir(parents=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small filesystem here: {done.stderr.decode()[-200:]}")


def test_a_full_shared_directory_is_retried_and_named_not_a_raw_os_error(tmp_path):
    repo = tmp_path / "repo"
    _mount_tmpfs(repo, "512k")
    try:
        run = Run(tmp_path)
        _commit(run, "w", 10, _small(run))
        filler = repo / "filler"
        with filler.open("wb", buffering=0) as f:
            with pytest.raises(OSError):  # the disk is full from here on
                while True:
                    f.write(b"\0" * 4096)
        with pytest.raises(HubUnavailable) as caught:
            run.master.sync_once()
        assert ".claim-1" in str(caught.value) and "No space left" in str(caught.value)
        assert not (repo / "global" / ".claim-1").exists()  # no empty claim blocks the retry
        filler.unlink()  # space again: the same master publishes
        assert run.master.sync_once() == 1
    finally:
        subprocess.run(["umount", "-l", str(repo)], check=False)


def test_a_master_killed_at_random_moments_while_claiming_leaves_whole_claims_or_none(tmp_path):
    """A claim names its master, so the master recognises it when it comes back after a crash. One
    left empty (killed between creating the file and writing its name) was nobody's: the master
    coming back was refused its own version for ten minutes, and its run lost the steps since
    (seen once in a fresh full-suite run). A forked process that does nothing but claim is
    SIGKILLed at random moments; every claim it leaves holds its owner."""
    repo = tmp_path / "repo"
    folder = SharedDirectory(repo)
    folder.open(create=True)
    rng, checked = random.Random(3), 0
    for kill in range(20):
        ready, told = os.pipe()
        child = os.fork()
        if child == 0:  # the claimer: claims, one version after another, until killed
            try:
                os.write(told, b"x")
                for version in itertools.count(kill * 1_000_000):
                    folder._folder.claim(version, "master")
            finally:
                os._exit(1)
        os.close(told)
        assert os.read(ready, 1) == b"x"
        os.close(ready)
        time.sleep(rng.uniform(0.01, 0.05))
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        claims = list((repo / "global").glob(".claim-*"))
        empty = [p.name for p in claims if p.read_text() != "master"]
        assert not empty, empty
        checked += len(claims)
        for p in claims:
            p.unlink()
    assert checked > 100, checked  # it did claim, many times, before each kill


# -- 3. a run never ends on a stale global ---------------------------------------------------------
def test_a_master_whose_version_file_turns_unreadable_exits_2_naming_the_missing_steps(tmp_path):
    repo = tmp_path / "repo"
    cfg = node_config(
        tmp_path,
        "master",
        "master",
        repo=str(repo),
        transport="directory",
        index=0,
        count=1,
        steps=300,
        bigger=True,
        final_round_timeout=3,
    )
    proc = launch(cfg)
    version = repo / GLOBAL_METADATA_PATH

    def published_one() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"the master ended first: {proc.communicate()[1][-2000:]}")
        try:
            return json.loads(version.read_text())["outer_step"] >= 1
        except (OSError, ValueError, KeyError):
            return False

    wait_for(published_one, what="version 1")
    # unreadable from now to the end (a publication in flight may undo one write)
    while proc.poll() is None:
        version.write_text("{ not json")
        time.sleep(0.2)
    out, err = communicate_or_dump(proc, 600)
    assert proc.returncode == 2, (out[-2000:], err[-3000:])
    assert "Traceback" not in err, err[-3000:]
    last = [line for line in err.splitlines() if "lacks" in line]
    assert len(last) == 1 and "of the master's own node 'master'" in last[0], err[-3000:]
    assert "..300" in last[0] and "--resume" in last[0], last


# -- 4. a master killed during its final round runs it when restarted ------------------------------
def test_a_master_restarted_after_dying_in_its_final_round_folds_what_is_waiting(tmp_path):
    run = Run(tmp_path, session="s")
    _commit(run, "w", 10, _small(run))
    _commit(run, "m", 10, _small(run))
    assert run.master.sync_once() == 1
    _commit(run, "m", 20, _small(run), final=True)  # the master's own last delta
    ended = threading.Event()
    ended.set()  # SIGTERM: the final round folds what is there and ends at once, unfinished
    assert run.master.finish(20, timeout=5.0, stop=ended) == 2
    _commit(run, "w", 20, _small(run), final=True)  # the worker's last delta, still waiting
    restarted = run.new_master(session="s")
    restarted.final_round_timeout = 20.0
    restarted.start_master()
    assert restarted.outer_step == 2
    restarted.stop()  # the end of a resumed run that had no step left to train
    assert restarted.outer_step == 3 and restarted.ledger.folded("w", "s", 20)
    assert run.transport().list_deltas() == []
    _commit(run, "w", 30, _small(run))  # arrives after the run ended
    again = run.new_master(session="s")
    again.start_master()
    assert again.final_due is None  # finished: a further restart runs no final round
    again.stop()
    assert again.outer_step == 3 and run.transport().list_deltas() == [delta_path("w", 30)]


def test_a_master_killed_in_its_final_round_and_resumed_folds_the_workers_last_delta(tmp_path):
    "The CLI: `train --resume` of a master with its checkpoint at its target runs the final round."
    repo = tmp_path / "repo"
    master_cfg, worker_cfg = (
        node_config(
            tmp_path,
            name,
            role,
            repo=str(repo),
            transport="directory",
            index=i,
            count=2,
            steps=40,
            final_round_timeout=90,
        )
        for i, (name, role) in enumerate([("master", "master"), ("w1", "worker")])
    )
    master = launch(master_cfg)

    def ledger() -> dict:
        try:
            return json.loads((repo / GLOBAL_METADATA_PATH).read_text())["ledger"]
        except (OSError, ValueError, KeyError):
            return {}

    def own_steps_folded() -> bool:
        if max(ledger().get("master", {}).get("sessions", {}).values(), default=0) >= 40:
            return True
        if master.poll() is not None:
            raise AssertionError(f"the master ended first: {master.communicate()[1][-2000:]}")
        return False

    def in_final_round() -> bool:  # the master's local state says its final round began
        for f in (tmp_path / "master").rglob("outer_state.json"):
            with contextlib.suppress(OSError, ValueError):
                if json.loads(f.read_text()).get("final_round") == 40:
                    return True
        return False

    wait_for(own_steps_folded, what="the master's own 40 steps in a version")
    with contextlib.suppress(AssertionError):  # it is in its final round (waiting for w1) by now
        wait_for(in_final_round, timeout=20, what="the master's final round on record")
    master.send_signal(signal.SIGKILL)  # killed while its final round waits for the second node
    master.wait()
    worker = launch(worker_cfg)
    wait_for(
        lambda: (repo / delta_path("w1", 40)).exists() or worker.poll() is not None,
        what="w1's last delta",
    )
    assert (repo / delta_path("w1", 40)).exists()  # sent, not folded: its master is dead
    resumed = launch(master_cfg, "--resume")
    for proc in (resumed, worker):
        out, err = communicate_or_dump(proc, 600)
        assert proc.returncode == 0, (out[-2000:], err[-3000:])
    assert max(ledger()["w1"]["sessions"].values()) == 40  # the worker's last steps are in
    assert SharedDirectory(repo).list_deltas() == []
