"""DumbDiLoCo at scale, simulated: N nodes through the Hub stand-in with the Hub's limits on.

The real node and master (`DumbDiLoCoCoordinator`, whose master runs the real `MasterOuterLoop`)
talk to the loopback Hub stand-in of tests/hub_server.py through the real `huggingface_hub` client,
each node with its own token (its own account), and the stand-in enforces the limits of the chosen
tier: commits per hour per repository, one commit at a time per repository, API calls and
`/resolve/` downloads per five-minute window per token. Nothing trains: each node holds a model of
`--params` float32 parameters and, on a schedule, moves it by a small random step (`--steps-per-
round` steps a round, each node at its own phase), so every boundary has a delta of the real size to
send. Time is scaled: `--scale` simulated seconds pass per real second (360: an hour in 10 s); every
duration the nodes and the stand-in are given (round length, polls, lease, retries, the Hub's
windows) is scaled alike.

Before the run it prints `HubBudget`'s plan and verdict for the same configuration; after it, one
table: per simulated hour, commits on the busiest repository, API calls and downloads of the busiest
token in its busiest five-minute window, the Hub's 429 and 409 answers, rounds completed (versions
published with deltas folded), deltas folded and their age when folded (from the boundary that made
the delta to the publication holding it, simulated seconds), and deltas lost (made that hour and in
no global by the end).

    python bench/sim_diloco.py --nodes 16 --hours 1
    python bench/sim_diloco.py --nodes 64 --hours 2 --round-seconds 300 --tier free
    python bench/sim_diloco.py --nodes 256 --hours 1 --scale 120    # an hour in 30 s
    python bench/sim_diloco.py --nodes 6 --layout per-node --boundary-wait 600 --join-round 4 \
        --pause-rounds 5:8    # whole rounds; the last worker joins at round 4, another is gone 5-8
    python bench/sim_diloco.py --nodes 8 --round-seconds 180 --layout per-node --scale 120 \
        --commit-limit 25     # a Hub that takes 25 commits an hour: the master keeps to 20

Two layouts, both the package's (`distributed.hub_layout`). `--layout one-repo` (the default,
2.0's): every delta and every publication is a commit on the run's one repository, N + 1 commits a
round. `--layout per-node` (`PerNodeHub`): each node commits its deltas to a repository of its own
(`sim/run-<node>`, made by the node at its start; one commit a delta, deleting its deltas already
folded in the same commit), the master finds what changed with one listing of all of them a poll,
fetches the deltas from there, and publishes the global in the run's repository.

A second of this machine is `--scale` simulated seconds: the real cost of each Hub call (tens of
milliseconds on two busy cores) is multiplied by it. When the master's rounds lag (many nodes, a
loaded machine), run again with a smaller `--scale`; the line under the table says the load.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from dataclasses import asdict, replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

import hub_server  # noqa: E402
from hub_server import HubStandIn  # noqa: E402
from speedtronic.distributed.budget import (  # noqa: E402
    DELTA_BYTES_PER_PARAM,
    HUB_TIERS,
    HubBudget,
    HubLimits,
    hub_limits,
)
from speedtronic.distributed import outer  # noqa: E402
from speedtronic.distributed.outer import still_waiting  # noqa: E402
from speedtronic.distributed.diloco import DumbDiLoCoCoordinator  # noqa: E402
from speedtronic.distributed.hub import HubClient, PerNodeHub  # noqa: E402
from speedtronic.distributed.transport import HubError  # noqa: E402

REPO = "sim/run"
LAYOUTS = {
    "one-repo": "one repository",  # the package's: every delta and publication a commit there
    "per-node": "a repository per node",  # PerNodeHub: each node's deltas in its own repository
}
HOUR = 3600.0
# the stand-in keeps 64 revisions readable; the Hub keeps every one, and 64 nodes commit 64 times in
# seconds of this clock: a node reading at a head it just listed must still find it
hub_server.KEEP_SNAPSHOTS = 1_000_000


class Usage(Exception):
    "A bad argument: one line, exit 2."


class Tiny(torch.nn.Module):
    "One vector of `n` parameters: deltas of the size asked for, and nothing to compute."

    def __init__(self, n: int):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(n))


class TimedHub(HubStandIn):
    "The stand-in, noting the simulated time of every answer it gives (for the per-hour table)."

    def __init__(self, **kw):
        super().__init__(**kw)
        self.answers: list[tuple[float, str, int]] = []  # (simulated s, path, status)
        self.requests = _Noted(self)

    def sim_now(self) -> float:
        "Simulated seconds since the stand-in started (its windows start there too)."
        return (time.monotonic() - self._t0) * self.scale


class _Noted(list):
    "The stand-in's request list; each entry is also noted with the simulated time it was answered."

    def __init__(self, hub: TimedHub):
        super().__init__()
        self.hub = hub

    def append(self, item) -> None:
        method, path, status = item
        self.hub.answers.append((self.hub.sim_now(), path, status))
        super().append(item)


class Recorder:
    "A node's logger: its events with their simulated time, its warnings and errors as lines."

    def __init__(self, name: str, clock, verbose: bool = False):
        self.name, self.clock, self.verbose = name, clock, verbose
        self.events: list[tuple[float, str, dict]] = []
        self.lines: list[str] = []
        self.said: list[tuple[float, str]] = []  # (simulated s, line) of every line

    def emit(self, event: str, payload: dict) -> None:
        self.events.append((self.clock(), event, dict(payload)))

    def _line(self, level: str, message: str) -> None:
        self.lines.append(f"{level}: {message}")
        self.said.append((self.clock(), message))
        if self.verbose:
            print(f"[{self.clock():8.0f} s] {level} {message}", file=sys.stderr, flush=True)

    def info(self, message: str) -> None:
        self.said.append((self.clock(), message))  # kept: the master's words on rounds are counted
        if self.verbose:
            print(f"[{self.clock():8.0f} s] info {message}", file=sys.stderr, flush=True)

    def debug(self, message: str) -> None:
        pass

    def warning(self, message: str) -> None:
        self._line("warning", message)

    def error(self, message: str) -> None:
        self._line("error", message)


def node_name(i: int) -> str:
    return "master" if i == 0 else f"node{i:03d}"


def limits_of(args) -> HubLimits:
    "The tier's limits, with `--commit-limit` in place of its commits per repository an hour."
    limits = hub_limits(args.tier)
    if args.commit_limit is None:
        return limits
    return replace(
        limits,
        name=f"{limits.name}, {args.commit_limit} commits an hour",
        commits_per_hour=float(args.commit_limit),
    )


def limits_mapping(limits: HubLimits) -> dict:
    "`distributed.hub_limits` as numbers: what the nodes are told of the limits simulated."
    return {k: v for k, v in asdict(limits).items() if k != "name"}


def budget_of(args) -> HubBudget:
    "`HubBudget` of the configuration simulated (the master trains too: it is one of the nodes)."
    return HubBudget(
        nodes=args.nodes,
        round_s=args.round_seconds,
        poll_interval=args.poll_seconds,
        delta_bytes=args.params * DELTA_BYTES_PER_PARAM[args.delta_dtype],
        global_bytes=args.params * 4,
        limits=limits_of(args),
        whole_rounds=args.boundary_wait > 0,
        per_node=args.layout == "per-node",
    )


def verdict_lines(budget: HubBudget) -> list[str]:
    "`verdict: fits`, or `verdict: refused` and then each problem on a line of its own."
    problems = budget.problems()
    if not problems:
        return ["verdict: fits"]
    return ["verdict: refused"] + [f"  - {p}" for p in problems]


def distributed_section(args, i: int, token: str, work: Path) -> dict:
    "Node `i`'s `distributed` keys, every duration in real seconds (simulated seconds / scale)."
    real = lambda sim_s: sim_s / args.scale
    return {
        "enabled": True,
        "role": "master" if i == 0 else "worker",
        "node_id": node_name(i),
        "repo_id": REPO,
        "token": token,
        "inner_steps": args.steps_per_round,
        "expected_nodes": args.nodes,  # the final round waits for every node's last delta
        "poll_interval": real(args.poll_seconds),
        "lease_timeout": real(args.lease_seconds),
        "final_round_timeout": real(args.final_seconds),
        "boundary_wait": real(args.boundary_wait),
        "retry_initial": real(1.0),
        "retry_max": real(60.0),
        "retry_attempts": 6,
        "delta_dtype": args.delta_dtype,
        "delta_upload_shutdown_timeout": real(args.final_seconds),
        "state_dir": str(work / "state"),
        "hub_limits": args.tier if args.commit_limit is None else limits_mapping(limits_of(args)),
        "hub_layout": args.layout,
        "late_share": args.late_share,
    }


class Node:
    "One simulated node: the real coordinator over a `Tiny` model, stepping on its own schedule."

    def __init__(self, args, i: int, hub: TimedHub, work: Path, token: str):
        self.i, self.name, self.hub, self.args = i, node_name(i), hub, args
        self.log = Recorder(self.name, hub.sim_now, args.verbose)
        self.model = Tiny(args.params)
        self.stop = threading.Event()
        kw = dict(
            token=token,
            endpoint=hub.url,
            cache_dir=work / self.name / "cache",
            retry_initial=1.0 / args.scale,
            retry_max=60.0 / args.scale,
            retry_attempts=6,
            stop=self.stop,
        )
        folded = lambda: self.coord.state.folded_step
        if args.layout == "one-repo":
            transport = HubClient(REPO, **kw)
        else:
            transport = PerNodeHub(REPO, node_id=self.name, folded=folded, **kw)
        self.coord = DumbDiLoCoCoordinator(
            distributed_section(args, i, token, work),
            self.model,
            hub=transport,
            state_dir=work / self.name,
            logger=self.log,
        )
        self.rng = torch.Generator().manual_seed(args.seed * 1000 + i)
        self.phase = random.Random(args.seed * 7919 + i).uniform(0, args.round_seconds)
        # made: step -> simulated time of its boundary
        self.step, self.error, self.made = (
            0,
            None,
            {},
        )
        self.pause: tuple[float, float] | None = None  # (from, to) simulated s: it leaves, is back
        self.left: tuple[float, float] | None = None  # the pause it had
        self.joined: tuple[float, int] | None = None  # (simulated s, the master's version then)

    def run(self, start_sim: float, steps: int) -> None:
        "`steps` steps on schedule from `start_sim` + phase (simulated s), then finish."
        args, coord = self.args, self.coord
        step_s = args.round_seconds / args.steps_per_round
        # as the trainer's fit does: the delta of the last step is marked as this node's last, so
        # the master's final round ends when every node's is in (not after final_round_timeout)
        coord.set_target(steps)
        try:
            while self.step < steps:
                if self.pause and self.hub.sim_now() >= self.pause[0]:  # gone, then back
                    (left, back), self.pause = self.pause, None
                    self.left = (left, back)
                    if self.stop.wait(max(0.0, back - self.hub.sim_now()) / args.scale):
                        return
                    start_sim += back - left  # its schedule resumes where it stopped
                due = start_sim + self.phase + (self.step + 1) * step_s
                wait = (due - self.hub.sim_now()) / args.scale
                if wait > 0 and self.stop.wait(wait):
                    return
                with torch.no_grad():
                    self.model.w.add_(torch.randn(args.params, generator=self.rng) * 1e-3)
                self.step += 1
                if self.step % args.steps_per_round == 0:
                    self.made[self.step] = self.hub.sim_now()
                coord.after_optimizer_step(self.model, self.step)
            if self.step % args.steps_per_round:
                self.made[self.step] = self.hub.sim_now()  # the last, partial round's delta
            coord.finish(self.model, self.step)
        except HubError as e:
            self.error = str(e)
        except Exception as e:  # a simulation that breaks says how, and the table still prints
            self.error = f"{type(e).__name__}: {e}"


def simulate(args) -> dict:
    "Run the simulation; what the table is made from."
    limits = limits_of(args)
    tokens = {f"hf_sim_{node_name(i)}_token": "write" for i in range(args.nodes)}
    hub = TimedHub(
        tokens=tokens,
        scale=args.scale,
        commits_per_window=int(limits.commits_per_hour),
        one_commit_at_a_time=True,
        api_per_window=int(limits.api_calls_per_5min),
        resolve_per_window=int(limits.downloads_per_5min),
        head_lag=args.head_lag,
    ).start()
    hub.create(REPO)  # each node of the per-node layout makes its own at its start
    work = Path(tempfile.mkdtemp(prefix="sim_diloco_"))
    names = list(tokens)
    nodes = [Node(args, i, hub, work, names[i]) for i in range(args.nodes)]
    t0 = time.monotonic()
    try:
        nodes[0].coord.start()  # the master publishes the first global; the workers start from it
        joiner = nodes[-1] if args.join_round else None
        starters = [
            threading.Thread(target=n.coord.start, daemon=True)
            for n in nodes[1:]
            if n is not joiner
        ]
        for t in starters:
            t.start()
        for t in starters:
            t.join()
        start_sim = hub.sim_now()
        # every node runs the same steps (a run's max_steps), each from its own phase in a round
        steps = max(1, round(args.hours * HOUR / args.round_seconds * args.steps_per_round))
        end_sim = start_sim + args.round_seconds + args.hours * HOUR
        if args.pause_rounds:
            leaver = nodes[-2] if joiner else nodes[-1]
            a, b = args.pause_rounds
            leaver.pause = (start_sim + a * args.round_seconds, start_sim + b * args.round_seconds)
        threads = [
            threading.Thread(target=n.run, args=(start_sim, steps), daemon=True)
            for n in nodes
            if n is not joiner
        ]
        if joiner is not None:
            joined_at = start_sim + args.join_round * args.round_seconds

            def join():  # starts from the global of its time, trains what is left of the run
                if joiner.stop.wait(max(0.0, joined_at - hub.sim_now()) / args.scale):
                    return
                joiner.joined = (hub.sim_now(), nodes[0].coord.state.version)
                joiner.coord.start()
                left = steps - args.join_round * args.steps_per_round
                joiner.run(joined_at, max(1, left))

            threads.append(threading.Thread(target=join, daemon=True))
        for t in threads[1:]:
            t.start()
        threads[0].start()
        limit = (end_sim - hub.sim_now()) / args.scale + 3 * args.final_seconds / args.scale + 60
        deadline = time.monotonic() + limit
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        hung = [t.name for t in threads if t.is_alive()]
        for n in nodes:
            n.stop.set()
        for n in nodes:
            try:
                n.coord.stop()
            except Exception as e:
                n.error = n.error or f"stop: {type(e).__name__}: {e}"
        end = hub.sim_now()
    finally:
        hub.stop()
        shutil.rmtree(work, ignore_errors=True)  # the nodes' state and scratch files
    return {
        "hub": hub,
        "nodes": nodes,
        "start": start_sim,
        "end": end,
        "hung": hung,
        "wall": time.monotonic() - t0,
    }


def table(run: dict, args) -> list[str]:
    "The per-hour table, and the lines under it."
    hub, nodes = run["hub"], run["nodes"]
    hours = max(1, math.ceil(run["end"] / HOUR))
    hour_of = lambda sim_s: min(int(sim_s // HOUR), hours - 1)
    commits = defaultdict(Counter)  # hour -> repository -> commits made
    per_window = defaultdict(lambda: defaultdict(Counter))  # hour -> what -> (token, window) -> n
    windows_per_hour = HOUR / hub.token_window
    for (what, who, index), n in hub.used.items():
        if what == "commits":
            commits[min(index, hours - 1)][who] += n
        else:
            per_window[min(int(index // windows_per_hour), hours - 1)][what][(who, index)] += n
    refused = defaultdict(Counter)  # hour -> status -> answers
    for t, _, status in hub.answers:
        if status in (409, 429):
            refused[hour_of(t)][status] += 1
    master = nodes[0].log.events
    # (node, step) -> simulated time of the publication holding it
    rounds, folded_at = (
        Counter(),
        {},
    )
    for t, event, p in master:
        if event == "outer_step" and p.get("deltas_included"):
            rounds[hour_of(t)] += 1
            for node, step in p.get("folded", []):
                folded_at.setdefault((node, int(step)), t)
    twice = sum(len(p.get("folded", [])) for _, e, p in master if e == "outer_step") - len(
        folded_at
    )
    covered = defaultdict(list)  # node -> [(step, simulated time)] of its folded deltas, by step
    for (node, step), t in sorted(folded_at.items()):
        covered[node].append((step, t))
    ages, lost, made, sent = defaultdict(list), Counter(), Counter(), Counter()
    for n in nodes:
        for t, event, p in n.log.events:
            if event == "delta_uploaded":
                sent[hour_of(t)] += 1
        for step, t in n.made.items():
            made[hour_of(t)] += 1
            # the work of this boundary reached the global with the first folded delta at or past it
            # (a delta not sent, or refused for now, travels with the node's next one)
            when = min((f for s, f in covered[n.name] if s >= step), default=None)
            if when is None:
                lost[hour_of(t)] += 1
            else:
                ages[hour_of(when)].append(when - t)
    head = (
        f"{'hour':>4} {'commits/repo':>12} {'API/5min':>8} {'dl/5min':>8} {'429s':>6} "
        f"{'409s':>5} {'rounds':>6} {'made':>5} {'sent':>5} {'folded':>6} {'age med s':>9} "
        f"{'age max s':>9} {'lost':>5}"
    )
    out = [head]
    for h in range(hours):
        a = ages[h]
        folded_h = sum(1 for t in folded_at.values() if hour_of(t) == h)
        out.append(
            f"{h:>4} {max(commits[h].values(), default=0):>12} "
            f"{max(per_window[h]['api'].values(), default=0):>8} "
            f"{max(per_window[h]['resolve'].values(), default=0):>8} "
            f"{refused[h][429]:>6} {refused[h][409]:>5} {rounds[h]:>6} {made[h]:>5} "
            f"{sent[h]:>5} {folded_h:>6} {statistics.median(a) if a else 0:>9.0f} "
            f"{max(a, default=0):>9.0f} {lost[h]:>5}"
        )
    kinds = defaultdict(list)  # an error's text with the node's name taken out -> the nodes
    for n in nodes:
        if n.error:
            kinds[n.error.replace(repr(n.name), "<node>").replace(hub.url, "<hub>")].append(n.name)
    out += [
        f"setup (the master's first global, then every worker's start) took "
        f"{run['start'] / 60:.0f} simulated minutes",
        f"deltas made {sum(made.values())}, sent {sum(sent.values())}, folded {len(folded_at)}, "
        f"folded twice {twice}, lost {sum(lost.values())}",
        f"rounds completed {sum(rounds.values())} in {(run['end'] - run['start']) / HOUR:.2f} "
        f"simulated hours (each node made a delta every {args.round_seconds:.0f} s for "
        f"{args.hours:g} h: {args.hours * HOUR / args.round_seconds:.0f} rounds); "
        f"wall {run['wall']:.0f} s",
        f"the master's commit budget held a publication back {held_back(nodes[0].log.said)} "
        "time(s) (commit_wait)",
        final_round_line(nodes[0], args.final_seconds),
    ]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    out.append(
        f"time: a real second is {args.scale:g} simulated seconds, so what a Hub call costs this "
        f"machine (load {load:.1f} on {os.cpu_count()} CPUs) is multiplied by it; a smaller "
        "--scale when rounds lag"
    )
    out += comings_and_goings(nodes, master)
    if run["hung"]:
        out.append(f"still running at the end (stopped): {', '.join(run['hung'])}")
    for text, who in kinds.items():
        out.append(
            f"{len(who)} node(s) ended with an error ({', '.join(who[:3])}"
            f"{', ...' if len(who) > 3 else ''}): {text[:400]}"
        )
    return out


def held_back(words: list[tuple[float, str]]) -> int:
    "How many times the master's lines say its commit budget held its next publication back."
    return sum(1 for _, line in words if "the next publication waits" in line)


def final_round_line(master: Node, final_seconds: float) -> str:
    """How the master's final round ended, by the rule its wait ends on (`still_waiting`, over its
    state at the end): when every node's last delta was in, or at its `final_round_timeout`
    without some."""
    loop = master.coord.outer
    state = loop.state
    if state.final_round < 0:
        return "the master's final round never began"
    missing, enough = still_waiting(state, loop.rules, state.final_round, master.name)
    if not missing and enough:
        return "the master's final round ended when every node's last delta was in"
    return (
        f"the master's final round ended at its timeout ({final_seconds:g} simulated s) without "
        f"the last deltas of {sorted(missing) or 'some of the expected nodes'}"
    )


def waited_for(line: str) -> set[str] | None:
    "The nodes a master's 'rounds wait only for [...]' line names (None for any other line)."
    head, _, names = line.partition("rounds wait only for ")
    try:
        return set(ast.literal_eval(names)) if head and names else None
    except (ValueError, SyntaxError):
        return None


def comings_and_goings(nodes: list, master: list) -> list[str]:
    """A line for the node that joined late (the version it started from, the version its first
    folded delta was trained from, its deltas refused) and one for the node that left and came back
    (the master's lines saying rounds go on without it, and its deltas folded after it was back)."""
    out, words = [], nodes[0].log.said
    norms = [p for _, e, p in master if e == "delta_norms"]
    for n in nodes:
        mine = [p for p in norms if p["node_id"] == n.name]
        refused = sum(
            1 for _, e, p in master if e == "delta_rejected" and p.get("node_id") == n.name
        )
        if n.joined is not None:
            first = min(mine, key=lambda p: p["step"])["base_outer_step"] if mine else None
            out.append(
                f"joined: {n.name} at {n.joined[0]:.0f} s, the global at version {n.joined[1]}; "
                f"its first folded delta trained from version {first}; {len(mine)} folded, "
                f"{refused} refused"
            )
        if n.left is not None:
            left, back = n.left
            others = {m.name for m in nodes if m is not n}
            said = [w for t, w in words if left <= t and waited_for(w) == others]
            after = [
                p
                for t, e, p in master
                if e == "delta_norms" and p["node_id"] == n.name and t > back
            ]
            out.append(
                f"left: {n.name} from {left:.0f} s to {back:.0f} s; the master said {len(said)} "
                f"time(s) since that rounds go on without it; {len(after)} of its deltas folded "
                f"after it was back, {refused} refused"
            )
    return out


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=16, help="nodes, the master included")
    p.add_argument("--round-seconds", type=float, default=300.0, help="simulated s per round")
    p.add_argument("--tier", default="free", help=f"one of {', '.join(HUB_TIERS)}")
    p.add_argument(
        "--commit-limit",
        type=int,
        default=None,
        help="commits per repository an hour, in place of the tier's 128 (stand-in and nodes)",
    )
    p.add_argument("--hours", type=float, default=1.0, help="simulated hours of training")
    p.add_argument("--scale", type=float, default=360.0, help="simulated s per real s")
    p.add_argument("--params", type=int, default=4096, help="model parameters (delta size)")
    p.add_argument("--steps-per-round", type=int, default=5)
    p.add_argument("--poll-seconds", type=float, default=60.0, help="simulated s between polls")
    p.add_argument("--lease-seconds", type=float, default=600.0)
    p.add_argument("--final-seconds", type=float, default=3600.0, help="final round's wait")
    p.add_argument("--boundary-wait", type=float, default=0.0, help="simulated s (whole rounds)")
    p.add_argument("--head-lag", type=float, default=5.0, help="repo_info's stale head, Hub s")
    p.add_argument("--delta-dtype", default="bfloat16", choices=sorted(DELTA_BYTES_PER_PARAM))
    p.add_argument("--layout", default="one-repo", choices=("one-repo", "per-node"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--late-share", type=float, default=None, help="distributed.late_share (whole rounds)"
    )
    p.add_argument(
        "--join-round",
        type=int,
        default=0,
        help="the last worker starts at this round (0: at once)",
    )
    p.add_argument(
        "--pause-rounds",
        type=lambda t: tuple(int(x) for x in t.split(":")),
        default=None,
        help="A:B: a worker leaves at round A and is back at round B (whole rounds drop it)",
    )
    p.add_argument("--verbose", action="store_true", help="the nodes' log lines on stderr")
    p.add_argument("--json", type=Path, help="also write what the stand-in holds here (for tests)")
    p.add_argument("--save", type=Path, help="also append the plan and the table to this file")
    args = p.parse_args(argv)
    if args.tier.strip().lower() not in HUB_TIERS:
        raise Usage(f"--tier {args.tier}: unknown tier; use one of {', '.join(HUB_TIERS)}")
    for name in ("nodes", "params", "steps_per_round"):
        if getattr(args, name) < (2 if name == "nodes" else 1):
            raise Usage(f"--{name.replace('_', '-')} {getattr(args, name)}: too small")
    if args.commit_limit is not None and args.commit_limit < 1:
        raise Usage(f"--commit-limit {args.commit_limit}: must be at least 1")
    for name in ("round_seconds", "hours", "scale", "poll_seconds", "lease_seconds"):
        if not getattr(args, name) > 0:
            raise Usage(f"--{name.replace('_', '-')} {getattr(args, name)}: must be positive")
    return args


def main(argv=None) -> None:
    try:
        args = parse(argv)
    except Usage as e:
        print(f"sim_diloco: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    torch.set_num_threads(1)
    # the two durations the master takes from module constants, not from its config, scaled like
    # every other: how long a publication retries while other commits move the head (60 s), and the
    # hour over which it counts its own commits against the Hub's limit (`commit_wait`)
    outer.PUBLISH_PATIENCE_S = outer.PUBLISH_PATIENCE_S / args.scale
    outer.COMMIT_WINDOW_S = outer.COMMIT_WINDOW_S / args.scale
    budget = budget_of(args)
    said = [
        f"sim_diloco: {args.nodes} nodes (a master and {args.nodes - 1} workers), rounds of "
        f"{args.round_seconds:.0f} s, {args.hours:g} simulated hour(s) at {args.scale:g}x, "
        f"{args.params} parameters, layout: {LAYOUTS[args.layout]}",
        *budget.lines(),
        *verdict_lines(budget),
    ]
    print("\n".join(said), flush=True)
    run = simulate(args)
    lines = table(run, args)
    said += lines
    print("\n".join(lines), flush=True)
    if args.save is not None:  # appended: one file holds the runs of several sizes
        with open(args.save, "a") as f:
            f.write(
                "\n".join(["$ python bench/sim_diloco.py " + " ".join(argv or sys.argv[1:])] + said)
                + "\n\n"
            )
    if args.json is not None:
        hub = run["hub"]
        held = {
            "commits": {r: len(repo.commits) - 1 for r, repo in hub.repos.items()},  # not the first
            "refusals": dict(hub.refusals),
            "files": sorted(hub.files(REPO)),
        }
        args.json.write_text(json.dumps(held, indent=1) + "\n")


if __name__ == "__main__":
    main()
