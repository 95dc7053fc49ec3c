"""The per-node layout (`distributed.hub_layout: per-node`) through real processes and the real
`huggingface_hub` client, against the loopback Hub stand-in with the Hub's limits on
(`HUB_LIMITS`): each node's deltas in a repository of its own, the run's repository holding only
the master's publications."""

from collections import Counter

from hub_server import HUB_LIMITS, HubStandIn
from diloco_nodes import (
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
from speedtronic.distributed.tensors import GLOBAL_METADATA_PATH, parse_delta_path, parse_step_count


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


def test_an_auto_master_moves_a_run_past_one_repository_to_a_repository_per_node(tmp_path):
    """`hub_layout: auto` (the default): the first round's plan, for the 256 nodes the run expects
    and its 6 rounds, needs 257 commits a round of one repository (1542 in all) and 6 of each
    repository per node; under the limit the config gives (100 an hour, planned to 80) only the
    per-node plan fits, whatever the pace, so the master says so and its next publication moves
    every node's deltas to a repository of its own. The workers are waiting when the master starts,
    so the first round (which waits its 10 s for the nodes that never come) holds all three, and
    later rounds wait for those three."""
    names = ("master", "w1", "w2")
    run = "org/grows"
    with HubStandIn(tokens={TOKEN: "write"}, **HUB_LIMITS) as hub:
        hub.create(run, private=True)
        paths = [
            node_config(
                tmp_path,
                n,
                "master" if i == 0 else "worker",
                repo=run,
                transport="hub",
                index=i,
                count=3,
                steps=30,
                boundary_wait=20,
                expected_nodes=256,  # the run's plan; three of them come
                hub_limits={"commits_per_hour": 100},
                final_round_timeout=10,  # the final round waits this long for the 253 missing
            )
            for i, n in enumerate(names)
        ]
        procs = [launch(p, env=hub_env(hub)) for p in paths[1:]] + [
            launch(paths[0], env=hub_env(hub))
        ]
        outputs = dict(zip(names[1:] + names[:1], (finish(p) for p in procs)))
        run_added = [p for c in hub.repos[run].commits for p in c.added if p.startswith("nodes/")]
        own = {n: hub.repos.get(node_repo_id(run, n)) for n in names}
        own_added = {
            n: [p for c in r.commits for p in c.added if p.startswith("nodes/")]
            for n, r in own.items()
            if r is not None
        }
        files = hub.files(run)
    said = [l for l in outputs["master"].splitlines() if "Hub layout auto:" in l]
    assert len(said) == 1 and "a repository of its own" in said[0], outputs["master"][-3000:]
    _, extras = parse_step_count(files[GLOBAL_METADATA_PATH])
    assert extras["delta_layout"] == "per-node"
    check_exactly_once(tmp_path, names, extras["ledger"])
    # the first round's deltas went to the run's repository, every later one to its node's own
    assert run_added, "before the move, deltas travel as on 2.0's layout"
    for name in ("w1", "w2"):
        assert own_added.get(name), (name, sorted(own_added))
        uploaded = [e["step"] for e in events(tmp_path / name / "metrics.jsonl", "delta_uploaded")]
        mine = [p for p in run_added if p.startswith(f"nodes/{name}/")] + own_added[name]
        assert sorted(mine) == sorted(f"nodes/{name}/delta_{s}.safetensors" for s in uploaded)
        first_own = min(parse_delta_path(p)[1] for p in own_added[name])
        assert all(parse_delta_path(p)[1] < first_own for p in run_added if f"/{name}/" in p)
