"""The per-node layout (`distributed.hub_layout: per-node`) through real processes and the real
`huggingface_hub` client, against the loopback Hub stand-in with the Hub's limits on
(`HUB_LIMITS`): each node's deltas in a repository of its own, the run's repository holding only
the master's publications."""

from collections import Counter

from hub_server import HUB_LIMITS, HubStandIn
from test_diloco import (
    TOKEN,
    check_exactly_once,
    events,
    finish,
    hub_env,
    launch,
    node_config,
    run_nodes,
    wait_for,
)

from speedtronic.distributed.hub import node_repo_id
from speedtronic.distributed.tensors import GLOBAL_METADATA_PATH, parse_step_count


def test_per_node_nodes_fold_every_delta_once_and_commit_once_a_round_each(tmp_path):
    names = ("master", "w1", "w2")
    run = "org/spread"
    with HubStandIn(tokens={TOKEN: "write"}, **HUB_LIMITS) as hub:
        hub.create(run, private=True)  # made on the website; each node makes its own repository
        # two of w1's commits go through and their answers are lost: the retry must not delete what
        # the first try deleted already
        hub.fault("lost_response", method="POST", path=r"/org/spread-w1/commit/", count=2, after=2)
        outputs = run_nodes(
            tmp_path,
            repo=run,
            transport="hub",
            names=names,
            steps=30,
            env=hub_env(hub),
            boundary_wait=60,
            hub_layout="per-node",
        )
        repos = {name: hub.repos.get(node_repo_id(run, name)) for name in names}
        files = hub.files(run)
        run_commits = list(hub.repos[run].commits)
        node_files = {n: hub.files(r) for n, r in ((n, node_repo_id(run, n)) for n in names)}
        faults = list(hub.faults)
    meta, extras = parse_step_count(files[GLOBAL_METADATA_PATH])
    assert extras["delta_layout"] == "per-node"
    check_exactly_once(tmp_path, names, extras["ledger"])
    # every node made its repository, private, and sent each delta there in one commit of its own
    for name in names:
        assert repos[name] is not None and repos[name].private, name
        sent = [p for c in repos[name].commits for p in c.added if p.startswith("nodes/")]
        uploaded = [e["step"] for e in events(tmp_path / name / "metrics.jsonl", "delta_uploaded")]
        assert sent == [f"nodes/{name}/delta_{s}.safetensors" for s in uploaded], (name, sent)
        assert Counter(sent).most_common(1)[0][1] == 1
        # a node deletes what the global holds with its next delta: only the newest may be left
        left = [p for p in node_files[name] if p.startswith("nodes/")]
        assert len(left) <= 1, (name, left)
    # the run's repository: the master's publications only (no delta ever committed there)
    assert not [p for c in run_commits for p in c.added if p.startswith("nodes/")]
    rounds = [
        e for e in events(tmp_path / "master" / "metrics.jsonl", "outer_step") if e.get("folded")
    ]
    assert sum(len(e["folded"]) for e in rounds) == 3 * 6 and meta.outer_step >= len(rounds)
    assert "Hub budget" in outputs["master"] and "one per node" in outputs["master"]
    assert not faults, "both lost answers were hit"


def test_a_worker_on_the_one_repository_layout_still_reaches_a_per_node_master(tmp_path):
    "A 2.0 worker (no hub_layout) sends to the run's repository, which the master still lists."
    names = ("master", "w1")
    run = "org/mixed"
    with HubStandIn(tokens={TOKEN: "write"}, **HUB_LIMITS) as hub:
        hub.create(run, private=True)
        configs_layout = {"master": "per-node", "w1": "one-repo"}
        paths = [
            node_config(
                tmp_path,
                n,
                "master" if i == 0 else "worker",
                repo=run,
                transport="hub",
                index=i,
                count=2,
                steps=20,
                boundary_wait=60,
                hub_layout=configs_layout[n],
            )
            for i, n in enumerate(names)
        ]
        procs = [launch(paths[0], env=hub_env(hub))]
        wait_for(
            lambda: (
                events(tmp_path / "master" / "metrics.jsonl", "train_start")
                or procs[0].poll() is not None
            ),
            what="the master",
        )
        procs.append(launch(paths[1], env=hub_env(hub)))
        for p in procs:
            finish(p)
        files = hub.files(run)
        added = [p for c in hub.repos[run].commits for p in c.added if p.startswith("nodes/")]
        worker_repo = hub.repos.get(node_repo_id(run, "w1"))
    _, extras = parse_step_count(files[GLOBAL_METADATA_PATH])
    check_exactly_once(tmp_path, names, extras["ledger"])
    assert added and all(p.startswith("nodes/w1/") for p in added)
    assert worker_repo is None  # a one-repo node makes no repository of its own
