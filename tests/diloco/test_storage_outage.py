"""A run's last deltas under a storage outage and under slow uploads, each as real
`speedtronic train` processes: a worker exits 0 only once its last trained step is in the final
global, and no step of any node is folded twice."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from diloco_nodes import TOKEN, ended, hub_env, launch, node_config, wait_while_running
from test_master_trust import _mount_tmpfs

from conftest import jsonl_records
from hub_server import HUB_LIMITS, HubStandIn


def _steps(metrics: Path, event: str) -> list[int]:
    return [r["step"] for r in jsonl_records(metrics, event)]


def _folded_once(master_metrics: Path, ledger: dict, names, steps: int) -> None:
    """Every step 1..`steps` of each node is covered by exactly one folded delta (the master's
    `delta_norms` records: a delta's last step and the inner steps it covers), and the ledger holds
    each node's last step."""
    for name in names:
        covered = [
            s
            for r in jsonl_records(master_metrics, "delta_norms")
            if r["node_id"] == name
            for s in range(r["step"] - r["inner_steps"] + 1, r["step"] + 1)
        ]
        assert sorted(covered) == list(range(1, steps + 1)), (name, sorted(covered))
        assert max(ledger[name]["sessions"].values()) == steps, ledger


def _remount(where: Path, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", str(where)], check=True, capture_output=True)


# -- a shared directory read-only around the end of the run ----------------------------------------
def test_a_last_delta_that_failed_on_a_read_only_share_is_sent_again_and_reaches_the_final_global(
    tmp_path,
):
    """The share turns read-only once w1's step-30 delta is in (two rounds before its last) and
    stays so until w1's last delta (step 40) has failed, and 3 s more: both nodes exit 0 with all
    40 steps of each in the final global, each step folded once."""
    share = tmp_path / "share"
    _mount_tmpfs(share, "64m")
    master = worker = None
    try:
        repo = str(share / "repo")
        common = dict(
            repo=repo,
            transport="directory",
            steps=40,
            boundary_wait=5,
            retry_attempts=2,
            final_round_timeout=60,
        )
        master = launch(node_config(tmp_path, "master", "master", expected_nodes=2, **common))
        worker = launch(node_config(tmp_path, "w1", "worker", **common))
        metrics = tmp_path / "w1" / "metrics.jsonl"
        wait_while_running(
            lambda: 30 in _steps(metrics, "delta_uploaded"),
            [master, worker],
            what="w1's delta of step 30",
            poll=0.01,  # a trigger: the share goes read-only right after that upload
        )
        _remount(share, "ro")
        try:
            wait_while_running(
                lambda: 40 in _steps(metrics, "delta_upload_failed"),
                [master, worker],
                what="a failed upload of w1's last delta",
                poll=0.01,
            )
            time.sleep(3)  # the outage lasts on a while: the nodes keep retrying
        finally:
            _remount(share, "rw")
        rc, err, _ = ended(worker)
        assert rc == 0, err[-3000:]
        assert 40 in _steps(metrics, "delta_uploaded"), err[-3000:]  # sent again, after the outage
        rc, err, _ = ended(master)
        assert rc == 0, err[-3000:]
        ledger = json.loads((Path(repo) / "global" / "step_count.json").read_text())["ledger"]
        _folded_once(tmp_path / "master" / "metrics.jsonl", ledger, ("master", "w1"), 40)
    finally:
        for p in (master, worker):
            if p is not None and p.poll() is None:
                p.kill()
                p.communicate()
        subprocess.run(["umount", "-l", str(share)], check=False)


# -- a last delta that comes while the one before it is still uploading ---------------------------
def test_a_last_delta_due_while_the_previous_upload_is_in_flight_is_sent_after_it_and_folded(
    tmp_path,
):
    """Every commit takes 2 s and w1 trains 23 steps (5 per round): its last delta, due at step 23,
    comes while an earlier one is still uploading. It is sent once that upload has ended, and w1
    exits 0 only with step 23 in the final global."""
    with HubStandIn(**HUB_LIMITS, tokens={TOKEN: "write"}, commit_delay=2.0) as hub:
        repo, env = "org/slow", hub_env(hub)
        # one commit at a time, each 2 s: a node's retries must outlast the other node's run of
        # back-to-back commits (the master's two deltas and first two publications, ~8 s of 409s
        # for w1). The module's 0.05-0.5 s backoff gives up within ~3 s, 10 attempts up to 2.5 s
        # apart within ~7.7 s (seen: w1's step-5 delta failed "after 10 attempts: HTTP 409");
        # 30 attempts wait out ~70 s, as the product's default backoff (1-60 s, 6 attempts) ~31 s
        common = dict(
            repo=repo,
            transport="hub",
            steps=23,
            final_round_timeout=60,
            retry_max=2.5,
            retry_attempts=30,
        )
        master = launch(
            node_config(tmp_path, "master", "master", expected_nodes=2, **common), env=env
        )
        worker = launch(node_config(tmp_path, "w1", "worker", **common), env=env)
        rc, err, _ = ended(worker)
        assert rc == 0, err[-3000:]
        rc, err, _ = ended(master)
        assert rc == 0, err[-3000:]
        ledger = json.loads(hub.files(repo)["global/step_count.json"])["ledger"]
    records = [json.loads(line) for line in (tmp_path / "w1" / "metrics.jsonl").open()]
    order = [(r["event"], r.get("step")) for r in records]
    # w1 trained its last step before its first upload had ended: the last delta came while that
    # one was in flight
    assert order.index(("train_step", 23)) < order.index(("delta_uploaded", 5)), order
    assert [s for e, s in order if e == "delta_uploaded"] == [5, 23], order
    _folded_once(tmp_path / "master" / "metrics.jsonl", ledger, ("master", "w1"), 23)
