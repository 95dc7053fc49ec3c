"""A DiLoCo worker killed after its delta was folded, resumed from an older checkpoint (issue 24):
it trains the folded steps again, and its next round starts from the global that holds them, so
the final global is the uninterrupted run's, tensor for tensor. Real `speedtronic train` processes
over a shared directory, whole rounds (`boundary_wait`, `expected_nodes: 2`), one thread each."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import torch
from diloco_nodes import ended, launch, node_config

from conftest import jsonl_records
from speedtronic.distributed.tensors import load_safetensors


def _configs(tmp: Path) -> tuple[Path, Path]:
    tmp.mkdir(parents=True, exist_ok=True)
    common = dict(
        repo=str(tmp / "repo"),
        transport="directory",
        steps=30,
        boundary_wait=200,  # the master's rounds wait up to 100 s for the restarted worker
        expected_nodes=2,
        final_round_timeout=200,
    )
    return (
        node_config(tmp, "master", "master", **common),
        node_config(tmp, "w1", "worker", **common),
    )


def _folded(repo: Path, node: str) -> int:
    "The newest step of `node` the repository's version holds (-1: none)."
    try:
        ledger = json.loads((repo / "global" / "step_count.json").read_text())["ledger"]
    except (OSError, ValueError, KeyError):
        return -1
    return max(ledger.get(node, {}).get("sessions", {}).values(), default=-1)


def _final(tmp: Path) -> dict[str, torch.Tensor]:
    return load_safetensors(tmp / "repo" / "global" / "latest.safetensors")


def _finish(*procs: subprocess.Popen) -> None:
    for p in procs:
        rc, err, _ = ended(p)
        assert rc == 0, err[-3000:]


def test_a_worker_resumed_behind_its_folded_steps_ends_on_the_uninterrupted_runs_global(
    tmp_path,
):
    whole = tmp_path / "whole"
    _finish(*[launch(cfg) for cfg in _configs(whole)])

    cut = tmp_path / "cut"
    master_cfg, worker_cfg = _configs(cut)
    master, worker = launch(master_cfg), launch(worker_cfg)
    metrics = cut / "w1" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not any(r["step"] == 15 for r in jsonl_records(metrics, "delta_uploaded")):
        assert worker.poll() is None and master.poll() is None, worker.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "no upload of w1's step 15"
        time.sleep(0.02)
    worker.send_signal(signal.SIGKILL)  # waiting for the fold of its step 15 (a whole round)
    worker.communicate()
    sent = [r["step"] for r in jsonl_records(metrics, "delta_upload_queued")]
    assert max(sent) == 15, sent  # the kill came before its next delta
    # its start (a node's run saves step 0) and step 10: behind the fold
    assert [r["step"] for r in jsonl_records(metrics, "checkpoint")] == [0, 10]
    _finish(launch(worker_cfg, "--resume"), master)
    assert _folded(cut / "repo", "w1") == 30
    ours, theirs = _final(cut), _final(whole)
    assert set(ours) == set(theirs)
    differ = [k for k in ours if not torch.equal(ours[k], theirs[k])]
    assert not differ, differ
