"""What a DiLoCo worker trusts, each case as real `speedtronic train` processes over a shared
directory: it exits 0 only when every step it trained reached a published global, it checks a
global before installing it, and a second node with a node_id in use is refused at start."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
from datetime import datetime
from pathlib import Path

import pytest
from safetensors import safe_open
from safetensors.torch import save_file

from diloco_nodes import ended, error_line, hub_env, launch, node_config, wait_while_running

from conftest import jsonl_records


def _share(tmp: Path) -> str:
    return str(tmp / "share" / "repo")


def _version_file(repo: str) -> dict:
    return json.loads((Path(repo) / "global" / "step_count.json").read_text())


def _stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
        p.communicate()


# -- every trained step reaches a global, or the worker says which did not ---------------------
@pytest.mark.parametrize("counted", [False, True], ids=["worker-unset", "worker-expected_nodes"])
def test_a_worker_that_trains_on_after_its_master_ended_exits_2_naming_the_steps_no_global_holds(
    tmp_path, counted
):
    """The master trains 10 steps and waits half a second in its final round (a worker's final delta
    is waited for only that long); the worker trains 40: its last deltas reach no global. A worker
    whose own config sets distributed.expected_nodes is not pointed at that key, but at the bound
    of the master's wait (final_round_timeout)."""
    repo = _share(tmp_path)
    master = launch(
        node_config(
            tmp_path,
            "master",
            "master",
            repo=repo,
            transport="directory",
            steps=10,
            expected_nodes=2,
            boundary_wait=20,
            final_round_timeout=0.5,
        )
    )
    worker = launch(
        node_config(
            tmp_path,
            "w1",
            "worker",
            repo=repo,
            transport="directory",
            steps=40,
            boundary_wait=2,
            final_round_timeout=3,
            **({"expected_nodes": 2} if counted else {}),
        )
    )
    rc, err, out = ended(master)
    assert rc == 0, err[-3000:]
    rc, err, out = ended(worker)
    folded = _version_file(repo)["ledger"]["w1"]["sessions"]
    assert 0 <= max(folded.values()) < 40, folded  # some of its steps were folded, not the last
    line = error_line(rc, err, out, "of node 'w1' did not reach a global model", repo, "--resume")
    assert f"steps {max(folded.values()) + 1}-40" in line, line
    assert "expected_nodes" not in line.split("resume")[0], line
    if counted:
        assert "expected_nodes" not in line and "distributed.final_round_timeout" in line, line


def test_a_worker_trains_on_across_a_master_takeover_and_exits_0_with_every_step_folded(
    tmp_path,
):
    """The master trains 10 steps and ends; the worker trains on to 40 and waits for its steps to
    be folded. A second master takes the run over once the first one's lease ran out: the worker
    follows it (its version file names the master it took over from) and ends with every step in a
    global. The worker is held (SIGSTOP) from its first delta until the first master has ended: on a
    busy machine a master slow to train its 10 steps could otherwise fold all 40 of the worker's,
    and there would be nothing left to take over."""
    repo = _share(tmp_path)
    first = launch(
        node_config(
            tmp_path,
            "m1",
            "master",
            repo=repo,
            transport="directory",
            steps=10,
            final_round_timeout=0.5,
            lease_timeout=2,
        )
    )
    worker = launch(
        node_config(
            tmp_path,
            "w1",
            "worker",
            repo=repo,
            transport="directory",
            steps=40,
            final_round_timeout=120,
            lease_timeout=60,
        )
    )
    sent = tmp_path / "w1" / "metrics.jsonl"
    wait_while_running(
        lambda: jsonl_records(sent, "delta_uploaded") or first.poll() is not None,
        [worker],
        what="the worker's first delta",
        poll=0.05,
    )
    worker.send_signal(signal.SIGSTOP)
    try:
        rc, err, _ = ended(first)
    finally:
        worker.send_signal(signal.SIGCONT)
    assert rc == 0, err[-3000:]
    beat = datetime.fromisoformat(_version_file(repo)["master"]["heartbeat"]).timestamp()
    wait_while_running(
        lambda: time.time() - beat > 3, [worker], what="the first master's lease to run out"
    )
    cfg = node_config(
        tmp_path,
        "m2",
        "master",
        repo=repo,
        transport="directory",
        steps=10,
        final_round_timeout=60,
        lease_timeout=2,
    )
    second = launch(cfg, "--resume")
    try:
        rc, err, out = ended(second)
        assert rc == 0, err[-3000:]
        rc, err, out = ended(worker)
        assert rc == 0, (err + out)[-3000:]
    finally:
        _stop(second, worker)
    assert "refused the global model version" not in err + out, (err + out)[-3000:]
    assert "master 'm2' took over" in err + out, (err + out)[-3000:]
    version = _version_file(repo)
    assert version["master"]["node_id"] == "m2" and version["master"]["succeeds"] == ["m1"]
    assert max(version["ledger"]["w1"]["sessions"].values()) == 40, version["ledger"]


# -- a global is checked before it is installed ---------------------------------------------
@pytest.fixture(scope="module")
def published(tmp_path_factory) -> Path:
    "A repository whose master trained alone to the end (its last version file and global)."
    tmp = tmp_path_factory.mktemp("published")
    repo = _share(tmp)
    cfg = node_config(tmp, "master", "master", repo=repo, transport="directory", steps=10)
    rc, err, _ = ended(launch(cfg))
    assert rc == 0, err[-3000:]
    return Path(repo)


def _forge(weights: Path, kind: str) -> None:
    "Rewrite the global's weights: a NaN in the first float tensor, or a publication id of its own."
    with safe_open(str(weights), "pt") as f:
        meta, tensors = dict(f.metadata() or {}), {k: f.get_tensor(k) for k in f.keys()}
    if kind == "nan":
        name = next(k for k, v in tensors.items() if v.is_floating_point())
        poisoned = tensors[name].clone()
        poisoned.view(-1)[0] = float("nan")
        tensors[name] = poisoned
    else:
        meta["publication"] = "f0f0f0f0f0f0f0f0"
    save_file(tensors, str(weights), metadata=meta)


@pytest.mark.parametrize("kind", ["nan", "publication"])
def test_a_worker_refuses_a_global_that_fails_its_checks_in_one_line_and_never_installs_it(
    tmp_path, published, kind
):
    repo = tmp_path / "share" / "repo"
    shutil.copytree(published, repo)
    version = _version_file(str(repo))["outer_step"]
    _forge(repo / "global" / "latest.safetensors", kind)
    worker = launch(
        node_config(
            tmp_path,
            "w1",
            "worker",
            repo=str(repo),
            transport="directory",
            steps=10,
            lease_timeout=3,
            final_round_timeout=2,
        )
    )
    rc, err, out = ended(worker)
    said = [line for line in (err + out).splitlines() if "refused the global model version" in line]
    assert len(said) == 1, (err + out)[-3000:]
    reason = "non-finite values" if kind == "nan" else "publication 'f0f0f0f0f0f0f0f0'"
    assert f"version {version}" in said[0] and reason in said[0], said[0]
    assert "diverged" not in err + out
    records = jsonl_records(tmp_path / "w1" / "metrics.jsonl", "global_refused")
    assert [r["outer_step"] for r in records] == [version], records
    assert not jsonl_records(tmp_path / "w1" / "metrics.jsonl", "global_installed")
    error_line(rc, err, out, "none of the training of node 'w1'", "refused")


# -- one node id, one node -----------------------------------------------------------------
def test_a_second_worker_with_a_node_id_in_use_is_refused_at_start_naming_it(tmp_path):
    repo = _share(tmp_path)
    master = launch(
        node_config(tmp_path, "master", "master", repo=repo, transport="directory", steps=10**6)
    )
    first = launch(
        node_config(tmp_path, "w1", "worker", repo=repo, transport="directory", steps=10**6)
    )
    try:
        wait_while_running(
            lambda: (
                (Path(repo) / "global" / "step_count.json").exists()
                and "w1" in _version_file(repo).get("ledger", {})
            ),
            [master, first],
            what="a fold of w1's delta",
        )
        sessions = dict(_version_file(repo)["ledger"]["w1"]["sessions"])
        second = launch(
            node_config(
                tmp_path,
                "w1b",
                "worker",
                repo=repo,
                transport="directory",
                steps=20,
                node_id="w1",
                final_round_timeout=5,
            )
        )
        rc, err, out = ended(second)
        error_line(rc, err, out, "distributed.node_id 'w1' is in use by another live node", repo)
        assert not jsonl_records(tmp_path / "w1b" / "metrics.jsonl", "delta_uploaded")
        assert list(_version_file(repo)["ledger"]["w1"]["sessions"]) == list(sessions)
        assert master.poll() is None and first.poll() is None  # the first two train on
    finally:
        _stop(master, first)


# -- a failed last delta is sent again while the run's bounds allow --------------------------------
def test_a_last_delta_that_failed_during_an_outage_is_sent_again_and_reaches_the_final_global(
    tmp_path, hub
):
    """Every commit fails for 12 s from the fold of w1's step-15 delta on: its last delta (step 20)
    fails first."""
    repo, env = "org/outage", hub_env(hub)
    common = dict(repo=repo, transport="hub", steps=20, boundary_wait=5, retry_attempts=2)
    master = launch(
        node_config(
            tmp_path, "master", "master", expected_nodes=2, final_round_timeout=60, **common
        ),
        env=env,
    )
    worker = launch(
        node_config(tmp_path, "w1", "worker", final_round_timeout=60, **common), env=env
    )
    metrics = tmp_path / "w1" / "metrics.jsonl"
    wait_while_running(
        lambda: any(r["step"] == 15 for r in jsonl_records(metrics, "delta_uploaded")),
        [master, worker],
        what="w1's delta of step 15",
    )
    hub.fault("503", method="POST", path=r"/commit/", count=10**9)
    time.sleep(12)
    hub.clear_faults()
    rc, err, _ = ended(worker)
    failed = [r["step"] for r in jsonl_records(metrics, "delta_upload_failed")]
    assert 20 in failed, (failed, err[-3000:])  # the outage did take its last delta
    assert rc == 0, err[-3000:]
    rc, err, _ = ended(master)
    assert rc == 0, err[-3000:]
    ledger = json.loads(hub.files(repo)["global/step_count.json"])["ledger"]
    for name in ("master", "w1"):  # every trained step of both nodes is in the final global
        assert max(ledger[name]["sessions"].values()) == 20, ledger


# -- a token that can only read is found at start -----------------------------------------------
READ_TOKEN = "hf_test_read_token_0123456789"


@pytest.mark.parametrize("role", ["worker", "master"])
def test_a_node_with_a_read_only_token_stops_at_start_in_one_line_before_training(tmp_path, role):
    from hub_server import HUB_LIMITS, HubStandIn

    server = HubStandIn(**HUB_LIMITS, tokens={READ_TOKEN: "read"}).start()
    try:
        server.create("org/ro")
        node = launch(
            node_config(
                tmp_path, "n1", role, repo="org/ro", transport="hub", steps=20, lease_timeout=3
            ),
            env={**hub_env(server), "HF_TOKEN": READ_TOKEN},
        )
        rc, err, out = ended(node)
    finally:
        server.stop()
    error_line(rc, err, out, "read-only token", "org/ro", "HF_TOKEN", "write access")
    assert not jsonl_records(tmp_path / "n1" / "metrics.jsonl")  # not one step trained


# -- distributed.collaborators: 2.0's grant at the master's start ---------------------------------
def test_a_master_that_cannot_grant_its_collaborators_warns_once_and_trains_on(tmp_path, hub):
    "huggingface_hub's HfApi has no add_collaborator: one warning names the users and the way out."
    master = launch(
        node_config(
            tmp_path,
            "m",
            "master",
            repo="org/collab",
            transport="hub",
            steps=10,
            collaborators=["ana", "bo"],
        ),
        env=hub_env(hub),
    )
    rc, err, out = ended(master)
    assert rc == 0, err[-3000:]
    said = [line for line in (out + err).splitlines() if "distributed.collaborators" in line]
    assert len(said) == 1, said
    assert "ana, bo not granted" in said[0] and "has no add_collaborator" in said[0], said
    assert "Traceback" not in err
