"""A DiLoCo run's identity in its repository (issues 24 and 27), each case as real `speedtronic
train` processes over a shared directory: every global names its run in its own weights, a master
resumed with `--resume` is the same run, a master started with `--overwrite` is a new one whose
globals the old run's workers refuse in one line, and `--overwrite` starts the README's example over
from step 0 and version 0 with one run in each metrics file."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from safetensors import safe_open
from diloco_nodes import ended, launch, node_config, wait_while_running

from conftest import ROOT, cli_env, jsonl_records, ok, run_cli
from conftest import spawn


def _version_file(repo: Path) -> dict:
    try:
        return json.loads((repo / "global" / "step_count.json").read_text())
    except (OSError, ValueError):
        return {}


def _header(repo: Path) -> dict:
    with safe_open(str(repo / "global" / "latest.safetensors"), "pt") as f:
        return dict(f.metadata() or {})


def _kill(*procs: subprocess.Popen) -> list[str]:
    "Kill what still runs; the stdout and stderr of each, together."
    said = []
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
        said.append("".join(p.communicate()))
    return said


def _run_ids(metrics: Path) -> set[str]:
    ids = set()
    for line in metrics.read_text().splitlines():
        try:
            ids.add(json.loads(line).get("run_id"))
        except ValueError:
            continue
    return ids - {None}


# -- 1. the run id is in every global's weights; --resume keeps it ------------------------------
def test_a_master_resumed_is_the_same_run_and_every_global_carries_its_id_in_its_weights(tmp_path):
    repo = tmp_path / "share" / "repo"
    common = dict(repo=str(repo), transport="directory", boundary_wait=20, final_round_timeout=120)
    master_cfg = node_config(tmp_path, "master", "master", steps=40, expected_nodes=2, **common)
    master = launch(master_cfg)
    worker = launch(node_config(tmp_path, "w1", "worker", steps=40, **common))
    try:
        wait_while_running(
            lambda: (
                _version_file(repo).get("outer_step", -1) >= 2
                and (tmp_path / "master" / "checkpoints" / "latest.json").exists()
            ),
            [master, worker],
            what="version 2 and a checkpoint of the master",
        )
        before = _version_file(repo)
        run_id = before["run_id"]
        header = _header(repo)
        assert header["run_id"] == run_id and header["outer_step"] == str(before["outer_step"])
        assert header["publication"] == before["global_publication"], (header, before)
        master.send_signal(signal.SIGKILL)
        master.communicate()
        resumed = launch(master_cfg, "--resume")
        rc, err, out = ended(worker)
        assert rc == 0, err[-3000:]
        rc, err, _ = ended(resumed)
        assert rc == 0, err[-3000:]
    finally:
        _kill(master, worker)
    after = _version_file(repo)
    assert after["run_id"] == run_id and after["outer_step"] > before["outer_step"]
    assert _header(repo)["run_id"] == run_id
    assert "refused the global model" not in err + out
    assert not jsonl_records(tmp_path / "w1" / "metrics.jsonl", "global_refused")


# -- 2. a master started over with --overwrite is another run ----------------------------------
def test_a_worker_of_the_old_run_refuses_the_new_runs_globals_in_one_line_naming_both(tmp_path):
    repo = tmp_path / "share" / "repo"
    common = dict(repo=str(repo), transport="directory")
    master_cfg = node_config(tmp_path, "master", "master", steps=10**6, **common)
    master = launch(master_cfg)
    worker = launch(node_config(tmp_path, "w1", "worker", steps=10**6, **common))
    new = None
    metrics = tmp_path / "w1" / "metrics.jsonl"
    try:
        wait_while_running(
            lambda: "w1" in _version_file(repo).get("ledger", {}),
            [master, worker],
            what="a fold of w1's delta",
        )
        old_run = _version_file(repo)["run_id"]
        master.send_signal(signal.SIGKILL)
        master.communicate()
        new = launch(master_cfg, "--overwrite")
        wait_while_running(
            lambda: jsonl_records(metrics, "global_refused"), [new, worker], what="a refusal"
        )
        new_run = _version_file(repo)["run_id"]
        assert new_run != old_run
        installed = len(jsonl_records(metrics, "global_installed"))
        wait_while_running(  # the worker trains on, and the new run publishes on
            lambda: (
                _version_file(repo).get("outer_step", -1) >= 2
                and jsonl_records(metrics, "delta_uploaded")[-1]["step"] >= 40
            ),
            [new, worker],
            what="the new run's version 2 while the old worker trains on",
        )
        ledger = _version_file(repo)["ledger"]
    finally:
        said = _kill(*[p for p in (master, worker, new) if p is not None])[1]
    lines = [line for line in said.splitlines() if "refused the global model" in line]
    assert len(lines) == 1 and old_run in lines[0] and new_run in lines[0], said[-3000:]
    refusals = jsonl_records(metrics, "global_refused")
    assert len(refusals) == 1, refusals  # one line for the new run, not one per version
    reason = refusals[0]["reason"]
    assert f"run {new_run}, not run {old_run}" in reason and "--overwrite" in reason, reason
    assert len(jsonl_records(metrics, "global_installed")) == installed  # none of the new run's
    assert "w1" not in ledger, ledger  # its deltas of the old run are refused by the new master


# -- 3. --overwrite starts over everywhere -------------------------------------------------------
def test_train_overwrite_leaves_one_run_in_its_metrics_file(tmp_path):
    cfg = tmp_path / "single.yaml"
    cfg.write_text(
        json.dumps(
            {
                "run": {"max_steps": 4, "output_dir": str(tmp_path / "run"), "device": "cpu"},
                "model": {
                    "vocab_size": 64,
                    "max_seq_len": 16,
                    "n_layer": 1,
                    "n_head": 2,
                    "d_model": 16,
                    "d_ff": 32,
                },
                "data": {"synthetic": True, "num_tokens": 4096, "block_size": 16},
                "checkpoint": {"every_steps": 2},
                "logging": {"json_file": str(tmp_path / "run" / "metrics.jsonl")},
            }
        )
    )
    ok(run_cli("train", "--config", str(cfg), cwd=tmp_path))
    first = _run_ids(tmp_path / "run" / "metrics.jsonl")
    ok(run_cli("train", "--config", str(cfg), "--overwrite", cwd=tmp_path))
    second = _run_ids(tmp_path / "run" / "metrics.jsonl")
    assert len(first) == len(second) == 1 and first != second, (first, second)


def _readme_example(tmp: Path, *extra: str) -> None:
    "The README's two commands (master in the background), each with `extra` arguments."
    master = spawn(
        [sys.executable, "-m", "speedtronic", "train", "--config"]
        + ["examples/diloco_local_master.yaml", *extra],
        cwd=tmp,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        worker = run_cli(
            "train", "--config", "examples/diloco_local_worker.yaml", *extra, cwd=tmp, timeout=600
        )
    finally:
        out, err = master.communicate(timeout=600)
    ok(worker)
    assert master.returncode == 0, err[-3000:]


def test_the_readme_diloco_example_rerun_with_overwrite_starts_from_step_0_and_version_0(
    tmp_path,
):
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    run = tmp_path / "runs" / "diloco-local"
    _readme_example(tmp_path, "--max-steps", "50")
    first = _version_file(run / "repo")
    assert first["outer_step"] >= 2, first
    _readme_example(tmp_path, "--max-steps", "50", "--overwrite")
    second = _version_file(run / "repo")
    assert second["run_id"] != first["run_id"]
    assert second["outer_step"] == first["outer_step"], (first, second)  # counted from 0 again
    for node in ("master", "worker"):
        metrics = run / node / "metrics.jsonl"
        assert len(_run_ids(metrics)) == 1, node  # the earlier run's records went
        steps = [r["step"] for r in jsonl_records(metrics)]
        assert steps == sorted(steps) and steps[0] <= 25 and steps[-1] == 50, (node, steps)
    installs = [
        r["outer_step"] for r in jsonl_records(run / "worker" / "metrics.jsonl", "global_installed")
    ]
    assert installs[0] == 0 and installs == sorted(installs), installs  # from version 0
