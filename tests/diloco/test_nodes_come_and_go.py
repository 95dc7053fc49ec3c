"""Nodes that come and go in whole rounds, through real processes on a shared directory: a node
that joins a running DiLoCo run starts from the current global and its deltas are judged like any
other; a node that leaves (killed) stalls one round by its deadline, is dropped from the rounds with
one line, and folded again when it comes back (`--resume`)."""

import signal

from diloco_nodes import check_exactly_once, events, finish, launch, node_config, wait_for

from speedtronic.distributed import SharedDirectory


def versions(log) -> int:
    "The newest version the master published with deltas in it (0 before any)."
    return max((e["outer_step"] for e in events(log, "outer_step") if e.get("folded")), default=0)


def test_a_node_joins_late_leaves_and_comes_back(tmp_path):
    names, repo = ("master", "w1", "w2"), tmp_path / "repo"
    configs = {
        n: node_config(
            tmp_path,
            n,
            "master" if i == 0 else "worker",
            repo=str(repo),
            transport="directory",
            index=i,
            count=3,
            steps=200,
            bigger=True,
            inner_steps=10,
            boundary_wait=6,
        )
        for i, n in enumerate(names)
    }
    master = tmp_path / "master" / "metrics.jsonl"
    procs = {"master": launch(configs["master"])}
    wait_for(lambda: events(master, "train_start"), what="the master")
    procs["w1"] = launch(configs["w1"])
    wait_for(lambda: versions(master) >= 4, what="version 4")  # w2 joins a running run
    joined_at = versions(master)
    procs["w2"] = launch(configs["w2"])
    folded = lambda node: [e for e in events(master, "delta_norms") if e["node_id"] == node]
    wait_for(lambda: folded("w2"), what="w2's first delta folded")
    procs["w1"].send_signal(signal.SIGKILL)  # w1 leaves without a word
    procs["w1"].wait()
    left_at = versions(master)
    wait_for(lambda: versions(master) >= left_at + 3, what="three versions without w1")
    procs["w1"] = launch(configs["w1"], "--resume")  # and comes back
    outputs = {n: finish(p) for n, p in procs.items()}

    state = SharedDirectory(repo).state()
    ledger = state.extras["ledger"]
    check_exactly_once(tmp_path, names, ledger)
    assert not events(master, "delta_rejected")
    # the joiner started from the global of its time, not from version 0
    first = min(folded("w2"), key=lambda e: e["step"])
    assert first["base_outer_step"] >= joined_at, (first, joined_at)
    # the leaver: one line, naming who the rounds wait for while it is gone
    without_w1 = [
        line
        for line in outputs["master"].splitlines()
        if "rounds wait only for ['master', 'w2']" in line
    ]
    assert len(without_w1) == 1, outputs["master"][-4000:]
    # rounds went on without it, and its deltas after it came back are folded
    back = [e for e in folded("w1") if e["outer_step"] > left_at + 3]
    assert back and max(ledger["w1"]["sessions"].values()) == 200
    assert all(max(ledger[n]["sessions"].values()) == 200 for n in names)
