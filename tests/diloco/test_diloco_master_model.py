"""A model-based test of the DiLoCo master's pure transitions (`speedtronic.distributed.outer`).

A hypothesis `RuleBasedStateMachine` plays a repository (delta files, published versions with their
ledger, a head that changes only by compare-and-swap), honest nodes, a corrupting node, a forger, a
clock, and one or two masters made only of the pure transitions: `listed`, `check`, `rejected`,
`judge_newcomers`, `fold`, `on_published`, `conflict_verdict`, `state_record`/`restored`, `resumed`,
`adopted`, `lease_holder`. Masters are killed and restarted from what they persisted at any point
(also between saving `.next` and committing, and between committing and promoting), a second master
takes over once the lease ran out, and whole-round waits time out on the clock.

After every rule: each accepted delta is folded exactly once; no honest delta is lost (it is in the
repository or in a published version) or refused; published versions only grow; the head's global
equals the outer update of exactly the deltas its ledger names, recomputed here independently (outer
lr 1, momentum 0, two nodes per outer step: the global is the initial one minus the sum of those
deltas over two); a whole round that did not time out holds every node it waits for; the repository
holds nothing the master has decided on but not yet deleted.

Examples: `SPEEDTRONIC_MODEL_EXAMPLES` (default 2000, seconds; e.g. 20000 for a long run)."""

from __future__ import annotations

import os
from dataclasses import replace
from datetime import datetime, timezone

import torch
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from speedtronic.distributed.outer import (
    Ledger,
    MasterRules,
    adopted,
    bootstrap,
    check,
    cleanup,
    conflict_verdict,
    fold,
    heartbeat,
    heartbeat_due,
    judge_newcomers,
    lease_holder,
    listed,
    master_state,
    on_published,
    rejected,
    restored,
    resumed,
    round_complete,
    state_record,
    wait_ran_out,
)
from speedtronic.distributed.tensors import DeltaRejected, parse_delta_path

EXAMPLES = int(os.environ.get("SPEEDTRONIC_MODEL_EXAMPLES", "2000"))
RULES = MasterRules(
    round_steps=10, lr=1.0, momentum=0.0, expected_nodes=2, round_wait=5.0, lease_timeout=60.0
)
INIT = {"w": torch.ones(3)}
HONEST = ("a", "b")


def delta_file(
    node: str, step: int, value, *, covered: int, base: int, session: str = "s", shape=(3,)
):
    path = f"nodes/{node}/delta_{step}.safetensors"
    header = {
        "node_id": node,
        "local_step": str(step),
        "base_outer_step": str(base),
        "inner_steps": str(covered),
        "session": session,
    }
    return path, {"w": torch.full(shape, float(value))}, header


class Master:
    """One master process: its state, what it persisted (promoted) and prepared (`.next`), and
    whether it still runs."""

    def __init__(self, node_id: str):
        self.node_id, self.state, self.saved, self.prepared, self.alive = (
            node_id,
            master_state(INIT),
            None,
            None,
            True,
        )


class MasterModel(RuleBasedStateMachine):
    @initialize()
    def setup(self):
        self.now, self.revision = 1.7e9, 0
        self.repo: dict[str, tuple] = {}  # delta files: path -> (tensors, header)
        self.head = None  # (version, global, ledger json, publication, master id, heartbeat)
        self.versions: list[int] = []
        # (node, session, step) -> the delta an honest node sent
        self.honest: dict[tuple, torch.Tensor] = {}
        self.sent: dict[tuple, tuple] = {}  # the same -> (path, tensors, header) of its file
        self.forged: set[str] = set()
        self.folded: list[tuple] = []  # every delta id folded by a publication, in order
        self.last = {n: 0 for n in HONEST}
        self.bad_step, self.since_listing = 0, set()
        self.master = Master("m1")
        self.zombie: Master | None = None
        self.commit(self.master, bootstrap(self.master.state))

    # -- the repository ----------------------------------------------------------------------------
    def upload(self, path: str, tensors, header) -> None:
        self.repo[path] = (tensors, header)
        self.since_listing.add(path)
        self.revision += 1

    def commit(
        self,
        master: Master,
        pub,
        *,
        crash: str | None = None,
        full_rounds: bool = True,
        before=None,
    ) -> bool:
        """`master` commits `pub` (compare-and-swap on the head's publication id); `crash`: killed
        before/after the commit."""
        prepared = replace(
            pub.state, publication=f"{master.node_id}-{self.revision}-{len(self.versions)}"
        )
        master.prepared = state_record(prepared)  # saved as .next before the commit
        if crash == "before":
            return False
        head_pub = None if self.head is None else self.head[3]
        if self.head is not None and head_pub != master.state.publication:
            verdict = conflict_verdict(
                master.state.outer_step,
                master.node_id,
                prepared.publication,
                self.head[0],
                {"publication": head_pub, "master": {"node_id": self.head[4]}},
            )
            assert verdict == "stop", verdict  # only another master moves the head's publication
            master.alive = False
            return False
        version = prepared.outer_step
        if pub.weights:
            assert not self.versions or version > self.versions[-1], (version, self.versions)
            self.versions.append(version)
            ids = [(d.node_id, d.session, d.step) for d in pub.folded]
            self.folded += ids
            # a whole round
            if full_rounds and before is not None and not wait_ran_out(before, RULES, self.now):
                assert round_complete(before, RULES, list(pub.folded), self.now)
                waits_for = before.punctual or set()
                assert len({d.node_id for d in pub.folded}) >= (
                    len(waits_for) if waits_for else RULES.expected_nodes
                )
        else:
            assert version == self.head[0]
        glob = prepared.global_state if pub.weights else self.head[1]
        self.head = (
            version,
            glob,
            prepared.ledger.to_json(),
            prepared.publication,
            master.node_id,
            self.now,
        )
        for p in pub.deletes:
            self.repo.pop(p, None)
        self.revision += 1
        if crash == "after":
            return True
        master.saved, master.prepared = master.prepared, None  # promoted
        master.state = on_published(prepared, pub.deletes, self.now)
        return True

    # -- honest and dishonest nodes ----------------------------------------------------------------
    @rule(
        node=st.sampled_from(HONEST),
        scale=st.floats(0.5, 2.0),
        stale=st.booleans(),
        skip=st.booleans(),
    )
    def send(self, node, scale, stale, skip):
        """A node's next delta (covering the steps since its previous one; `skip`: a send failed,
        this one covers two rounds)."""
        step = self.last[node] + (20 if skip else 10)
        base = max(0, self.head[0] - (2 if stale else 0))
        path, tensors, header = delta_file(
            node, step, 0.01 * scale, covered=step - self.last[node], base=base
        )
        self.last[node] = step
        self.honest[node, "s", step] = tensors["w"]
        self.sent[node, "s", step] = (path, tensors, header)
        self.upload(path, tensors, header)

    @precondition(lambda self: self.honest)
    @rule(data=st.data())
    def send_again(self, data):
        "A node restarted from an older checkpoint sends a delta again (the same file)."
        self.upload(*self.sent[data.draw(st.sampled_from(sorted(self.honest)))])

    @rule(kind=st.sampled_from(["nan", "shape", "huge", "header", "garbage"]))
    def send_corrupt(self, kind):
        "A broken node's file: never folded."
        self.bad_step += 10
        path, tensors, header = delta_file(
            "bad",
            self.bad_step,
            {"nan": float("nan"), "huge": 1e6}.get(kind, 0.01),
            covered=10,
            base=0,
            session="z",
            shape=(4,) if kind == "shape" else (3,),
        )
        if kind == "header":
            header = {**header, "node_id": "someone-else"}
        if kind == "garbage":
            tensors = {}
        self.upload(path, tensors, header)

    @rule(node=st.sampled_from(HONEST))
    def send_broken_own(self, node):
        """An honest node's delta that came out NaN: refused for its content; the node carries on
        after it."""
        step = self.last[node] + 10
        path, tensors, header = delta_file(node, step, float("nan"), covered=10, base=self.head[0])
        self.last[node] = step
        self.upload(path, tensors, header)

    @precondition(
        lambda self: (
            self.master.alive
            and any(self.master.state.ledger.reach(n, "s") is not None for n in HONEST)
        )
    )
    @rule(node=st.sampled_from(HONEST))
    def forge(self, node):
        "A file claiming a step the node's session could not have reached."
        if self.master.state.ledger.reach(node, "s") is None:
            return
        path, tensors, header = delta_file(node, 10**9 + self.revision, 0.01, covered=10, base=0)
        self.forged.add(path)
        self.upload(path, tensors, header)

    @precondition(lambda self: not any(p.startswith("nodes/stranger/") for p in self.repo))
    @rule(step=st.integers(1, 50).map(lambda n: n * 10))
    def unknown_node(self, step):
        """A node nobody has heard of joins with an honest delta of a new session (it may start
        anywhere)."""
        session = f"x{step}"
        if any(k[0] == "stranger" and k[1] == session for k in self.honest):
            return
        path, tensors, header = delta_file(
            "stranger", step, 0.01, covered=10, base=self.head[0], session=session
        )
        self.honest["stranger", session, step] = tensors["w"]
        self.sent["stranger", session, step] = (path, tensors, header)
        self.upload(path, tensors, header)

    # -- the master --------------------------------------------------------------------------------
    def owned(self, master: Master) -> bool:
        """Whether the head is `master`'s (or its prepared publication, whose answer was lost); else
        it stops."""
        version, _, _, publication = self.head[:4]
        if (version, publication) == (master.state.outer_step, master.state.publication):
            return True
        prepared = None if master.prepared is None else restored(master.state, *master.prepared)
        if prepared is not None and resumed(None, prepared, version, publication) is prepared:
            master.saved, master.prepared, master.state = (
                master.prepared,
                None,
                on_published(prepared, (), self.now),
            )
            return True
        master.alive = False  # another master published: this one stops
        if self.zombie is not None and self.zombie.alive:  # the old master it was racing goes on
            self.master, self.zombie, self.since_listing = self.zombie, None, set(self.repo)
        return False

    def one_pass(self, master: Master, full_rounds: bool, crash: str | None = None) -> None:
        "What `MasterOuterLoop.sync_once` does, with the repository above."
        if not self.owned(master):
            return
        s = listed(master.state, set(self.repo))
        self.since_listing = set()
        held = {d.path for d in s.held}
        accepted, reached = list(s.held), {}
        for d in accepted:
            reached[d.node_id, d.session] = max(d.step, reached.get((d.node_id, d.session), -1))
        for path in sorted(
            (p for p in self.repo if p not in s.drop and p not in held), key=parse_delta_path
        ):
            tensors, header = self.repo[path]
            try:
                if not tensors:
                    raise DeltaRejected("unreadable", f"{path}: not a safetensors file")
                d = check(s, RULES, path, tensors, header, reached)
            except DeltaRejected as e:
                s = rejected(s, path, e.reason, header.get("session"))
                continue
            if s.ledger.folded(d.node_id, d.session, d.step):
                s = rejected(s, path, "duplicate")
                continue
            accepted.append(d)
            reached[d.node_id, d.session] = max(d.step, reached.get((d.node_id, d.session), -1))
        accepted, refused = judge_newcomers(s, RULES, accepted)
        for d, reason, _ in refused:
            s = rejected(s, d.path, reason, d.session)
        self.no_honest_refused(s)
        master.state = s
        if not accepted:
            if s.drop:
                self.commit(master, cleanup(s), crash=crash)
            elif heartbeat_due(s, RULES, self.now):
                self.commit(master, heartbeat(s), crash=crash)
            return
        before = s
        s, pub, refused = fold(s, RULES, accepted, self.now, full_rounds)
        assert not refused  # tiny honest deltas always publish
        master.state = s
        if pub is not None:
            self.commit(master, pub, crash=crash, full_rounds=full_rounds, before=before)

    def no_honest_refused(self, s) -> None:
        for path, why in s.drop.items():
            node, step = parse_delta_path(path)
            header = self.repo[path][1] if path in self.repo else {}
            key = (node, header.get("session", "s"), step)
            if key in self.honest and path not in self.forged:
                assert why == "duplicate" and key in self.folded, (path, why)

    @precondition(lambda self: self.master.alive)
    @rule(full_rounds=st.booleans())
    def poll(self, full_rounds):
        "One round of the live master (the final round: `full_rounds=False`)."
        self.one_pass(self.master, full_rounds)

    @precondition(lambda self: self.master.alive)
    @rule(went_through=st.booleans())
    def killed_while_publishing(self, went_through):
        """The master dies after saving `.next`, before its commit or after it (before promoting),
        and is restarted."""
        self.one_pass(self.master, True, crash="after" if went_through else "before")
        self.restart()

    @rule()
    def restart(self):
        "The master is killed now and restarted from what it persisted."
        old = self.master
        if not old.alive:
            return
        m = Master(old.node_id)
        load = lambda record: None if record is None else restored(m.state, *record)
        local, prepared = load(old.saved), load(old.prepared)
        version, glob, ledger, publication = self.head[:4]
        chosen = resumed(local, prepared, version, publication)
        if chosen is prepared and prepared is not None:
            m.saved = old.prepared
        m.state = (
            chosen
            if chosen is not None
            else adopted(local or m.state, glob, version, Ledger.from_json(ledger), publication)
        )
        if chosen is None:
            m.saved = state_record(m.state)
        self.master = m
        self.since_listing = set(self.repo)  # what it held or meant to delete, it finds again

    @rule(seconds=st.sampled_from([0.5, 2.0, 5.0, 30.0, 61.0]))
    def tick(self, seconds):
        self.now += seconds

    @rule()
    def second_master(self):
        """Another node starts as master: refused while the lease holds, else it takes over (the old
        one becomes a zombie)."""
        beat = datetime.fromtimestamp(self.head[5], timezone.utc).isoformat()
        extras = {
            "master": {"node_id": self.head[4], "heartbeat": beat},
            "publication": self.head[3],
        }
        other = "m2" if self.master.node_id == "m1" else "m1"
        if lease_holder(extras, other, RULES.lease_timeout, now=self.now) is not None:
            return  # refused: nothing changes
        new = Master(other)
        version, glob, ledger, publication = self.head[:4]
        new.state = adopted(new.state, glob, version, Ledger.from_json(ledger), publication)
        new.saved = state_record(new.state)
        self.zombie, self.master = (self.master if self.master.alive else None), new
        self.since_listing = set(self.repo)

    @precondition(lambda self: self.zombie is not None)
    @rule()
    def zombie_publishes(self):
        """The master whose lease ran out wakes up and commits: the compare-and-swap refuses it and
        it stops."""
        zombie, before = self.zombie, self.head
        # the new master has published
        if self.head[4] != zombie.node_id and self.head[3] != zombie.state.publication:
            assert not self.commit(zombie, heartbeat(zombie.state))
            assert not zombie.alive and self.head == before
            self.zombie = None
        else:
            # it got there first: the new master stops at its next round
            assert self.commit(zombie, heartbeat(zombie.state))

    # -- invariants --------------------------------------------------------------------------------
    @invariant()
    def folded_exactly_once(self):
        assert len(self.folded) == len(set(self.folded)), self.folded
        assert not any(k[0] == "bad" for k in self.folded)
        assert not any(
            (k[0], k[2]) in {parse_delta_path(p) for p in self.forged} for k in self.folded
        )

    @invariant()
    def nothing_honest_lost(self):
        for (node, session, step), value in self.honest.items():
            path = f"nodes/{node}/delta_{step}.safetensors"
            assert (node, session, step) in self.folded or path in self.repo, (node, session, step)

    @invariant()
    def the_global_is_the_deltas_its_ledger_names(self):
        ledger = Ledger.from_json(self.head[2])
        # the ledger keeps each node's newest sessions only (_SESSIONS_KEPT): it names exactly the
        # folded deltas of those
        kept = lambda k: k[1] in ledger.nodes.get(k[0], {}).get("sessions", {})
        assert set(k for k in self.honest if ledger.folded(*k)) == set(
            k for k in self.folded if k in self.honest and kept(k)
        )
        folded = [v for k, v in self.honest.items() if k in self.folded]
        expected = INIT["w"] - sum(folded, torch.zeros(3)) / RULES.expected_nodes
        assert float((self.head[1]["w"] - expected).abs().max()) <= 1e-5, (
            self.head[1]["w"],
            expected,
        )

    @invariant()
    def the_repository_stays_bounded(self):
        if not self.master.alive:
            return
        s = self.master.state
        assert set(self.repo) <= {d.path for d in s.held} | set(s.drop) | self.since_listing, (
            sorted(set(self.repo) - {d.path for d in s.held} - set(s.drop) - self.since_listing)
        )


TestMasterModel = MasterModel.TestCase
TestMasterModel.settings = settings(
    max_examples=EXAMPLES,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
