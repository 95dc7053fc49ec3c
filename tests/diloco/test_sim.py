"""DiLoCo at scale, simulated (issue 26): bench/sim_diloco.py runs the real node and master shells
for many nodes against the Hub stand-in with the free tier's limits on, time scaled so a
simulated hour lasts seconds. What it prints is checked here: the verdict `HubBudget` gives for
the same configuration, the commits per repository per hour (never past the Hub's 128, and adding
up to the commits the stand-in holds), the 429s met, the rounds completed, and no delta lost.

16 nodes in 20-minute rounds fit the free tier on the one-repository layout, and the run meets no
429; 64 nodes in 5-minute rounds do not fit (N + 1 commits a round), the budget refuses them up
front with the numbers, and the run shows why: the repository's commits at the Hub's limit, no
more, 429s met, far fewer rounds than scheduled, and still no delta lost. With a repository per
node (`distributed.hub_layout: per-node`) the same 64 nodes fit, and the run shows it.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from conftest import ROOT, cli_env, run_command

from speedtronic.distributed.budget import HUB_TIERS, HubBudget

PARAMS = 2048  # a small model: the deltas are 4 KiB in bfloat16
# a simulated minute a real second (or more): no other such test beside one (conftest)
pytestmark = pytest.mark.usefixtures("cpu_to_itself")


def run_bench(tmp_path, *args: str) -> tuple[str, dict]:
    "bench/sim_diloco.py with `args`: its stdout and what the stand-in held at the end."
    held = tmp_path / "held.json"
    res = run_command(
        [
            sys.executable,
            "bench/sim_diloco.py",
            "--params",
            str(PARAMS),
            "--json",
            str(held),
            *args,
        ],
        cwd=ROOT,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout, json.loads(held.read_text())


def rows(out: str) -> list[dict]:
    "The per-hour table as dicts of ints (the age columns in simulated seconds)."
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("hour "))
    names = [
        "hour",
        "commits",
        "api",
        "downloads",
        "429",
        "409",
        "rounds",
        "made",
        "sent",
        "folded",
        "age_med",
        "age_max",
        "lost",
    ]
    table = []
    for line in lines[head + 1 :]:
        if not re.match(r"^ *\d+ ", line):
            break
        table.append(dict(zip(names, map(int, line.split()))))
    return table


def expected_verdict(nodes: int, round_s: float, per_node: bool = False) -> list[str]:
    "The verdict lines for the bench's configuration, from `HubBudget` itself."
    budget = HubBudget(
        nodes=nodes,
        round_s=round_s,
        poll_interval=60.0,
        delta_bytes=PARAMS * 2,
        global_bytes=PARAMS * 4,
        limits=HUB_TIERS["free"],
        per_node=per_node,
    )
    problems = budget.problems()
    lines = ["verdict: refused"] + [f"  - {p}" for p in problems] if problems else ["verdict: fits"]
    return budget.lines() + lines


FINAL_ROUND_DONE = "the master's final round ended when every node's last delta was in"


def summary(out: str) -> dict:
    m = re.search(
        r"^deltas made (\d+), sent (\d+), folded (\d+), folded twice (\d+), lost (\d+)$", out, re.M
    )
    assert m, out
    return dict(zip(["made", "sent", "folded", "twice", "lost"], map(int, m.groups())))


def test_16_nodes_in_20_minute_rounds_fit_the_free_tier_and_lose_nothing(tmp_path):
    "The budget says it fits; the run meets no 429, completes rounds and folds every delta once."
    # at 240x a fresh suite run at load 10 failed it: the master's publications, retried for 60
    # simulated s (a quarter of a real second) while 15 nodes commit, were postponed for two
    # simulated hours, so it polled too little for the plan's API calls (the simulated final-round
    # hour had hidden that)
    out, held = run_bench(
        tmp_path, "--nodes", "16", "--round-seconds", "1200", "--hours", "1", "--scale", "120"
    )
    lines = out.splitlines()
    plan = expected_verdict(16, 1200.0)
    assert plan[-1] == "verdict: fits"
    start = lines.index(plan[0])
    assert lines[start : start + len(plan)] == plan, out
    table = rows(out)
    assert all(0 < r["commits"] <= 128 for r in table if r["rounds"]), table
    assert sum(r["commits"] for r in table) == held["commits"]["sim/run"], (table, held)
    assert all(r["429"] == 0 for r in table), table  # a plan that fits meets no refusal
    assert held["refusals"].get("commits", 0) == 0, held
    # rounds were completed (how many depends on how busy this machine is: a second of it is minutes
    # of simulated time), and every delta sent is in one
    assert sum(r["rounds"] for r in table) >= 1, table
    s = summary(out)
    assert s["lost"] == 0 and s["twice"] == 0 and s["folded"] == s["sent"] > 0, out[-4000:]
    # every node's last delta marked as its last (the trainer's `set_target`): no wait for more
    assert FINAL_ROUND_DONE in out.splitlines(), out[-3000:]
    assert all(r["lost"] == 0 for r in table), table
    assert "ended with an error" not in out, out
    assert [f for f in held["files"] if f.startswith("nodes/")] == [], held  # all folded
    # the plan's API calls and downloads of the busiest account (the master's, or for downloads a
    # worker's) are what the stand-in counted in the busiest window of any account, within what
    # uneven arrivals of deltas make of a window: every download is a HEAD and a GET, every pass
    # that finds the head moved reads the ref and the listing
    master = re.search(r"master per 5 min: (\d+) API calls of \d+, (\d+) downloads of", out)
    worker = re.search(r"each worker per 5 min: (\d+) API calls, (\d+) downloads", out)
    api, downloads = (max(int(a), int(b)) for a, b in zip(master.groups(), worker.groups()))
    seen_api, seen_downloads = max(r["api"] for r in table), max(r["downloads"] for r in table)
    assert 0.5 * api <= seen_api <= 1.75 * api, (api, seen_api, table)
    assert 0.5 * downloads <= seen_downloads <= 1.75 * downloads, (downloads, seen_downloads, table)


def test_64_nodes_in_5_minute_rounds_are_refused_up_front_and_the_run_shows_why(tmp_path):
    """The budget refuses 64 nodes x 12 rounds an hour with the numbers; the run spends the
    repository's 128 commits an hour and no more, meets 429s, completes far fewer rounds than
    scheduled, and loses no delta."""
    # The last deltas meet an hour's commits already spent, so they wait for the next hour: a
    # final round of 2 hours holds a whole window of the Hub's. With the default of 1 hour the
    # nodes that started first have only (setup time) past the window's reset to send their last
    # delta and see it folded; on a loaded machine one of 63 did not (CI, stop 40: "lost 1").
    # At 360x (an hour in 10 s) a loaded machine (load 7.8, a fresh suite run after stop 42) did not
    # make 128 commits in any hour, so the limit it shows was never met; at 180x four busy loops
    # beside it still did.
    out, held = run_bench(
        tmp_path,
        *("--nodes", "64", "--round-seconds", "300", "--hours", "1", "--final-seconds", "7200"),
        *("--scale", "180"),
    )
    lines = out.splitlines()
    plan = expected_verdict(64, 300.0)
    assert plan[-2:] == [
        "verdict: refused",
        "  - 64 nodes x 12.0 rounds an hour need 870 commits an hour on the run's repository; the "
        "Hub allows 128 (plan for 102): make rounds at least 4620 s long "
        "(distributed.inner_steps), or run at most 4 nodes at this round length, or give each "
        "node a repository of its own (distributed.hub_layout: per-node), or fold whole rounds "
        "(distributed.boundary_wait)",
    ]
    start = lines.index(plan[0])
    assert lines[start : start + len(plan)] == plan, out
    table = rows(out)
    assert all(r["commits"] <= 128 for r in table), table  # the Hub's limit held every hour
    # and an hour spent all of it (the first, unless setup took much of it on a busy machine)
    assert any(r["commits"] == 128 for r in table), table
    assert sum(r["commits"] for r in table) == held["commits"]["sim/run"], (table, held)
    assert sum(r["429"] for r in table) > 0 and held["refusals"]["commits"] > 0, (table, held)
    assert sum(r["rounds"] for r in table) < 12, table  # 12 scheduled in the hour
    s = summary(out)
    assert s["lost"] == 0 and s["twice"] == 0 and s["folded"] == s["sent"] > 0, out[-4000:]
    # every node's last delta marked as its last (the trainer's `set_target`): no wait for more
    assert FINAL_ROUND_DONE in out.splitlines(), out[-3000:]
    assert all(r["lost"] == 0 for r in table), table


def test_64_nodes_in_5_minute_rounds_fit_the_free_tier_with_a_repository_per_node(tmp_path):
    """`distributed.hub_layout: per-node` (`PerNodeHub`): 64 nodes in 5-minute rounds for half an
    hour, each committing its deltas to a repository it makes itself, the master publishing in the
    run's. The budget says it fits; no repository is refused a commit or passes 128 in the hour,
    each node's repository takes at most a commit a round (and one for the last, partial round),
    every token stays inside its API and download windows, rounds complete and no delta is lost."""
    # half a simulated minute per real second: 64 node threads share this process, and the master's
    # pass over 64 repositories must take less than a poll of simulated time. At 60x it took
    # several polls on a quiet machine (deltas folded 20 minutes after their boundary), and on a
    # loaded one (CI, stop 42) a node's last delta missed the hour its final round waits
    out, held = run_bench(
        tmp_path,
        *("--nodes", "64", "--round-seconds", "300", "--hours", "0.5", "--layout", "per-node"),
        *("--scale", "30"),
    )
    assert "layout: a repository per node" in out.splitlines()[0], out
    plan = expected_verdict(64, 300.0, per_node=True)
    assert plan[-1] == "verdict: fits"
    lines = out.splitlines()
    start = lines.index(plan[0])
    assert lines[start : start + len(plan)] == plan, out
    commits = held["commits"]
    own = {r: n for r, n in commits.items() if r != "sim/run"}
    assert sorted(own) == ["sim/run-master"] + [f"sim/run-node{i:03d}" for i in range(1, 64)]
    assert all(1 <= n <= 6 + 1 for n in own.values()), own  # 6 rounds in the half hour
    assert commits["sim/run"] <= 128, commits
    assert held["refusals"].get("commits", 0) == 0, held
    table = rows(out)
    assert all(r["429"] == 0 for r in table), table
    assert all(r["api"] <= 1000 and r["downloads"] <= 5000 for r in table), table
    assert sum(r["rounds"] for r in table) >= 1, table
    s = summary(out)
    assert s["lost"] == 0 and s["twice"] == 0 and s["folded"] == s["sent"] > 0, out[-4000:]
    # every node's last delta marked as its last (the trainer's `set_target`): no wait for more
    assert FINAL_ROUND_DONE in out.splitlines(), out[-3000:]
    assert "ended with an error" not in out, out


def test_a_node_that_joins_late_and_one_that_leaves_and_comes_back_in_whole_rounds(tmp_path):
    """6 per-node nodes in whole rounds: the last worker starts at round 4 and its first delta is
    trained from a global at least as new as the one of its time, none refused; another is gone
    from round 5 to round 8, the master says once that rounds go on without it, and its deltas after
    it is back are folded. No delta is lost or folded twice."""
    out, _ = run_bench(
        tmp_path,
        *("--nodes", "6", "--hours", "1", "--layout", "per-node", "--scale", "120"),
        *("--boundary-wait", "600", "--join-round", "4", "--pause-rounds", "5:8"),
    )
    joined = re.search(
        r"^joined: node005 at \d+ s, the global at version (\d+); its first folded delta trained "
        r"from version (\d+); (\d+) folded, (\d+) refused$",
        out,
        re.M,
    )
    assert joined, out
    version, first, folded, refused = map(int, joined.groups())
    assert first >= version and folded > 0 and refused == 0, joined.group(0)
    left = re.search(
        r"^left: node004 from \d+ s to \d+ s; the master said (\d+) time\(s\) since that rounds go "
        r"on without it; (\d+) of its deltas folded after it was back, (\d+) refused$",
        out,
        re.M,
    )
    assert left, out
    said, after, refused = map(int, left.groups())
    assert said == 1 and after > 0 and refused == 0, left.group(0)
    s = summary(out)
    assert s["lost"] == 0 and s["twice"] == 0 and s["folded"] == s["sent"] > 0, out[-4000:]
    # every node's last delta marked as its last (the trainer's `set_target`): no wait for more
    assert FINAL_ROUND_DONE in out.splitlines(), out[-3000:]
    assert "ended with an error" not in out, out


def test_a_master_whose_nodes_send_more_than_the_hub_takes_keeps_to_its_commit_budget(tmp_path):
    """8 nodes in 3-minute rounds on a repository per node, where the Hub takes 25 commits an hour
    on a repository (`--commit-limit`: the stand-in enforces it and the nodes are told it), send 160
    deltas an hour. A master that published whenever it found one would commit 27 to 40 times an
    hour (fewer on a busier machine) and meet a 429, then wait out the Hub's window. It keeps to 80%
    of the limit (`commit_wait`), folding what came meanwhile together: at most 20 commits an hour
    on the run's repository, no 429, every delta folded once, none lost. (In 2-minute rounds under a
    limit of 40, the budget of 32 was about the master's own cadence on a loaded machine: the budget
    did not always have to act, and the check that it did failed in CI. At 120x on CI's machine at
    load 5.4, stop 42, its passes alone made 18 commits an hour: at 60x a pass takes half the
    simulated time.)"""
    out, held = run_bench(
        tmp_path,
        *("--nodes", "8", "--round-seconds", "180", "--hours", "1", "--layout", "per-node"),
        *("--scale", "60", "--commit-limit", "25"),
    )
    assert "verdict: fits" in out.splitlines(), out
    table = rows(out)
    assert all(r["commits"] <= 20 for r in table), table  # 0.8 * 25
    assert all(r["429"] == 0 for r in table) and held["refusals"].get("commits", 0) == 0, held
    assert sum(r["rounds"] for r in table) >= 15, table
    held_back = re.search(
        r"^the master's commit budget held a publication back (\d+) time", out, re.M
    )
    assert held_back and int(held_back.group(1)) > 0, out[-3000:]  # the budget was at work
    s = summary(out)
    assert s["lost"] == 0 and s["twice"] == 0 and s["folded"] == s["sent"] == s["made"], out[-4000:]
    assert FINAL_ROUND_DONE in out.splitlines(), out[-3000:]
    assert "ended with an error" not in out, out
