"""DiLoCo node faults, each as real `speedtronic train` processes: nodes launched together on a
repository nobody created yet, a worker with another model, a run none of whose work reached the
global model, SIGTERM while a worker waits for the first global, and a shared directory that
disappears mid-run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import warnings
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import jsonl_records  # noqa: E402
from diloco_nodes import (  # noqa: E402
    TOKEN,
    Lines,
    ended,
    error_line,
    hub_env,
    launch,
    node_config,
    repo_of,
    transport_of,
)

from speedtronic.distributed import HubClient, SharedDirectory


# -- nodes launched together -----------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["hub", "directory"])
def test_nodes_launched_together_on_a_repository_nobody_created_finish_with_every_delta_folded(
    tmp_path, kind, request
):
    hub = request.getfixturevalue("hub") if kind == "hub" else None
    repo, env = repo_of(kind, tmp_path, hub)
    names = ("w1", "w2", "master")  # the workers are even launched first
    procs = {
        n: launch(
            node_config(
                tmp_path,
                n,
                "master" if n == "master" else "worker",
                repo=repo,
                transport=kind,
                steps=20,
                expected_nodes=3,
            ),
            env=env,
        )
        for n in names
    }
    results = {n: ended(p) for n, p in procs.items()}
    for n, (rc, err, _) in results.items():
        assert rc == 0, (n, err[-3000:])
    for n in ("w1", "w2"):
        said = results[n][2].count("waiting for the master to")
        # said once at most (the master may have been first)
        assert said <= 1, results[n][2][-3000:]
    state = transport_of(kind, repo, hub).state()
    ledger = state.extras["ledger"]
    folded = Counter(
        tuple(x)
        for e in jsonl_records(tmp_path / "master" / "metrics.jsonl", "outer_step")
        for x in e.get("folded", [])
    )
    assert not [k for k, c in folded.items() if c > 1], folded
    for n in names:
        uploaded = {
            e["step"] for e in jsonl_records(tmp_path / n / "metrics.jsonl", "delta_uploaded")
        }
        assert uploaded and {(n, s) for s in uploaded} <= set(folded), (
            n,
            sorted(uploaded),
            sorted(folded),
        )
        assert max(ledger[n]["sessions"].values()) == 20, (n, ledger[n])


def test_a_worker_waits_for_a_hub_repository_that_does_not_exist_yet_and_says_so_once(
    tmp_path, hub
):
    """The worker is started alone; the test creates the master only once the worker has said it is
    waiting."""
    worker = launch(
        node_config(
            tmp_path, "w1", "worker", repo="org/later", transport="hub", steps=10, expected_nodes=2
        ),
        env=hub_env(hub),
    )
    said = Lines(worker, "waiting for the master to create")
    try:
        assert said.seen(), (said.text(), worker.stderr.read()[-3000:])
    finally:
        if worker.poll() is None and not said.count():
            worker.kill()
    master = launch(
        node_config(
            tmp_path,
            "master",
            "master",
            repo="org/later",
            transport="hub",
            steps=10,
            expected_nodes=2,
        ),
        env=hub_env(hub),
    )
    rc, err, _ = ended(master)
    assert rc == 0, err[-3000:]
    assert worker.wait(300) == 0, worker.stderr.read()[-3000:]
    said.thread.join(30)
    assert said.count() == 1, said.text()
    assert jsonl_records(tmp_path / "w1" / "metrics.jsonl", "global_installed"), said.text()


def test_a_worker_whose_repository_never_appears_stops_after_lease_timeout_naming_it(tmp_path, hub):
    worker = launch(
        node_config(
            tmp_path, "w1", "worker", repo="org/typo", transport="hub", steps=10, lease_timeout=2
        ),
        env=hub_env(hub),
    )
    error_line(*ended(worker), "org/typo", "HTTP 404", "lease_timeout=2")


# -- a worker with another model -------------------------------------------------------------------
def test_a_worker_with_another_model_shape_stops_at_the_first_global_naming_the_tensor(tmp_path):
    repo = str(tmp_path / "repo")
    rc, err, _ = ended(
        launch(
            node_config(
                tmp_path,
                "master",
                "master",
                repo=repo,
                transport="directory",
                steps=5,
                expected_nodes=1,
            )
        )
    )
    assert rc == 0, err[-3000:]
    worker = launch(
        node_config(
            tmp_path,
            "w1",
            "worker",
            repo=repo,
            transport="directory",
            steps=10,
            model={"d_model": 32, "d_ff": 64},
        )
    )
    line = error_line(*ended(worker), "does not fit this node's model", "here and", "in the global")
    # the first tensor: the token embedding
    assert "(64, 32) here and (64, 16) in the global" in line, line
    assert not jsonl_records(tmp_path / "w1" / "metrics.jsonl", "global_installed")
    assert not jsonl_records(tmp_path / "w1" / "metrics.jsonl", "train_step")


# -- a run none of whose work reached the global ---------------------------------------------------
@pytest.mark.parametrize("then", ["full", "gone"])
def test_a_run_whose_hub_takes_nothing_after_version_0_ends_non_zero_on_every_node(
    tmp_path, hub, then
):
    """The stand-in takes the master's first publication (version 0), then answers every commit 507
    as a full disk would; with `gone` it also goes away for good once both nodes train."""
    hub.fault("507", method="POST", path=r"/commit/", count=10**9, after=1)
    repo, env = "org/full", hub_env(hub)
    master = launch(
        node_config(
            tmp_path,
            "master",
            "master",
            repo=repo,
            transport="hub",
            steps=10,
            expected_nodes=2,
            final_round_timeout=3,
            retry_attempts=2,
        ),
        env=env,
    )
    worker = launch(
        node_config(
            tmp_path,
            "w1",
            "worker",
            repo=repo,
            transport="hub",
            steps=10,
            final_round_timeout=3,
            retry_attempts=2,
        ),
        env=env,
    )
    if then == "gone":
        started = lambda: all(
            jsonl_records(tmp_path / n / "metrics.jsonl", "train_start") for n in ("master", "w1")
        )
        done = threading.Event()
        while not (started() or master.poll() is not None or worker.poll() is not None):
            done.wait(0.1)
        assert started()
        hub.stop()
    for name, proc in (("master", master), ("w1", worker)):
        error_line(
            *ended(proc),
            f"none of the training of node '{name}' reached the global model",
            "org/full",
        )
    if then == "full":
        assert HubClient(repo, token=TOKEN, endpoint=hub.url).state().outer_step == 0
    for name in ("master", "w1"):  # the trained weights are kept in the node's own checkpoint
        assert sorted((tmp_path / name / "checkpoints").glob("step_*.pt"))[-1].name.endswith(
            "10.pt"
        ), name


# -- SIGTERM while waiting -------------------------------------------------------------------------
def _stops_on_sigterm(worker: subprocess.Popen, needle: str) -> None:
    "Once `worker` says `needle`, SIGTERM ends it promptly with exit 143 and the CLI's one line."
    waiting = Lines(worker, needle)
    try:
        assert waiting.seen(), (waiting.text(), worker.stderr.read()[-3000:])
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(60) == 143, waiting.text()
    finally:
        if worker.poll() is None:
            worker.kill()
    waiting.thread.join(30)
    err = worker.stderr.read()
    assert "speedtronic: error: terminated (SIGTERM)" in err and "Traceback" not in err, err[-3000:]


@pytest.mark.parametrize("kind", ["hub", "directory"])
def test_sigterm_stops_a_worker_waiting_for_the_first_global(tmp_path, kind, request):
    hub = request.getfixturevalue("hub") if kind == "hub" else None
    repo, env = repo_of(kind, tmp_path, hub)
    _stops_on_sigterm(
        launch(
            node_config(
                tmp_path, "w1", "worker", repo=repo, transport=kind, steps=10, lease_timeout=600
            ),
            env=env,
        ),
        "waiting for the master to",
    )


def test_sigterm_stops_a_worker_waiting_at_the_end_for_its_first_fold(tmp_path):
    """The master has come and gone; the worker's only delta is its last, and it waits for a fold
    that will not come."""
    repo = str(tmp_path / "repo")
    rc, err, _ = ended(
        launch(
            node_config(
                tmp_path,
                "master",
                "master",
                repo=repo,
                transport="directory",
                steps=5,
                expected_nodes=1,
            )
        )
    )
    assert rc == 0, err[-3000:]
    worker = launch(
        node_config(
            tmp_path,
            "w1",
            "worker",
            repo=repo,
            transport="directory",
            steps=5,
            final_round_timeout=600,
        )
    )
    _stops_on_sigterm(worker, "waiting up to 600 s for a global model")
    # its training is saved
    assert sorted((tmp_path / "w1" / "checkpoints").glob("step_*.pt"))[-1].name.endswith("5.pt")


def test_sigterm_stops_a_master_waiting_in_its_final_round(tmp_path):
    """The master expects a second node that never comes: SIGTERM ends its final round at once, its
    last step saved."""
    repo = str(tmp_path / "repo")
    master = launch(
        node_config(
            tmp_path,
            "master",
            "master",
            repo=repo,
            transport="directory",
            steps=5,
            expected_nodes=2,
            final_round_timeout=600,
        )
    )
    _stops_on_sigterm(master, "final round: waiting up to 600 s")
    assert sorted((tmp_path / "master" / "checkpoints").glob("step_*.pt"))[-1].name.endswith("5.pt")


# -- a shared directory that disappears ------------------------------------------------------------
def test_a_shared_directory_unmounted_mid_run_stops_every_node_and_is_not_recreated(tmp_path):
    """The share goes away under the running nodes and leaves its empty mount point: nothing is
    published into that."""
    repo = tmp_path / "share" / "repo"
    master = launch(
        node_config(
            tmp_path,
            "master",
            "master",
            repo=str(repo),
            transport="directory",
            steps=400,
            expected_nodes=2,
            final_round_timeout=5,
        )
    )
    worker = launch(
        node_config(
            tmp_path,
            "w1",
            "worker",
            repo=str(repo),
            transport="directory",
            steps=400,
            final_round_timeout=5,
        )
    )
    metrics = tmp_path / "w1" / "metrics.jsonl"
    seen = threading.Event()
    while not seen.is_set() and worker.poll() is None:
        if jsonl_records(metrics, "global_installed"):
            seen.set()
        else:
            seen.wait(0.1)
    assert seen.is_set(), worker.communicate()[1][-3000:]
    # unmounted: the path now shows an empty folder
    os.rename(repo, tmp_path / "share" / "elsewhere")
    repo.mkdir()
    for proc in (master, worker):
        error_line(*ended(proc), f"shared directory {repo} has disappeared")
    assert list(repo.iterdir()) == []  # nothing was recreated in the mount point


# -- symbolic links in the repository --------------------------------------------------------------
def test_the_master_never_reads_a_delta_through_a_symbolic_link(tmp_path):
    """A link named like a delta, and a node folder that is a link: neither is read, quarantined nor
    deleted; each is named once."""
    import torch
    from speedtronic.distributed import MasterOuterLoop
    from speedtronic.distributed.tensors import (
        delta_header,
        delta_path,
        encode_delta,
        floating_state,
        save_safetensors,
    )
    from speedtronic.distributed.transport import RetryPolicy

    repo = SharedDirectory(tmp_path / "repo", retry=RetryPolicy(0.001, 0.01, 2))
    repo.open(create=True)
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Linear(6, 3))
    master = MasterOuterLoop(
        repo, model.state_dict(), node_state_dir=tmp_path / "state", node_id="m", inner_steps=10
    )
    master.start_master()
    secret = tmp_path / "outside" / "passwd"
    secret.parent.mkdir()
    secret.write_bytes(b"root:x:0:0:root:/root:/bin/bash\n")
    (tmp_path / "repo" / "nodes" / "evil").mkdir()
    (tmp_path / "repo" / delta_path("evil", 10)).symlink_to(secret)
    (tmp_path / "repo" / "nodes" / "linked").symlink_to(secret.parent)
    good = {k: torch.full(v.shape, 1e-3) for k, v in floating_state(master.global_state).items()}
    out = save_safetensors(
        encode_delta(good, "bfloat16"),
        tmp_path / "ok.safetensors",
        delta_header(
            node_id="ok",
            local_step=10,
            base_outer_step=0,
            inner_steps=10,
            encoding="bfloat16",
            session="s",
        ),
    )
    repo.upload({delta_path("ok", 10): out})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        master.sync_once()
        master.sync_once()
    said = [str(w.message) for w in caught if "refusing" in str(w.message)]
    assert master.outer_step == 1 and master.ledger.folded("ok", "s", 10)
    stored = [p for p in (tmp_path / "state").rglob("*") if p.is_file()]
    # nothing of the target was copied
    assert not any(p.read_bytes().startswith(b"root:x") for p in stored), stored
    assert (tmp_path / "repo" / delta_path("evil", 10)).is_symlink() and secret.exists()
    assert sorted(m.split(": refusing ")[1].split(":")[0] for m in said) == [
        delta_path("evil", 10),
        "nodes/linked",
    ], said
