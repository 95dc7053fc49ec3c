"""A model-based test of a DiLoCo node's pure transitions (`speedtronic.distributed.diloco`):
hypothesis drives `NodeState` through random interleavings — training, boundaries (in float32,
bfloat16 and int8), uploads that succeed, fail or are still running at the next boundary, globals
that arrive newer, older or twice and hold this node's delta or not, boundary waits that end or run
out, checkpoints written through `torch.save`, and the node killed and restarted from its last
checkpoint — and checks after every rule:

- every step of training (across lives: a step number the repository holds counts once) is in
exactly one delta that was
  uploaded, is in flight, is carried, or is not sent yet (no step lost, none counted twice), by the
  step counts the deltas carry
  and by the progress their tensors hold;
- the installed version and the folded step only grow (a restart goes back to the checkpoint's, with
its weights);
- a node never sends a delta against a version it did not install;
- a node restarted from a checkpoint older than its deltas the repository kept (and the master
folded) never delivers a step
  number twice across its lives: the steps it retrains up to that fold are not new progress, and are
  never sent again;
- a delta covers at most the steps trained, and never a step it does not hold;
- a node stops waiting at boundaries only after a wait ran out, and waits again once a global holds
one of its deltas.

`SPEEDTRONIC_MODEL_EXAMPLES` sets the number of examples (default 2000, a few seconds; half as many
start just after a restart behind the node's own folds, which random rules reach rarely)."""

from __future__ import annotations

import io
import os
from dataclasses import replace

import torch
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from speedtronic.distributed.diloco import (
    NODE_STATE_FORMAT,
    NodeState,
    Upload,
    after_wait,
    at_boundary,
    node_checkpoint,
    node_state_from,
    on_global,
    on_upload_done,
    on_upload_failed,
    wait_target,
)
from speedtronic.distributed.tensors import decode_delta

ROUND = 5  # the round length (inner_steps)
EXAMPLES = int(os.environ.get("SPEEDTRONIC_MODEL_EXAMPLES", "2000"))
TOLERANCE = 1e-4  # float32 sums of a few hundred small increments


def weights(w: list[float], n: int = 7) -> dict[str, torch.Tensor]:
    "A tiny model's state: one float tensor and an integer buffer."
    return {"w": torch.tensor(w, dtype=torch.float32), "n": torch.tensor(n)}


def spread(seed: int, span: int) -> list[int]:
    """Three integers in [-span, span] from one drawn `seed` (one draw instead of three: hypothesis
    runs faster)."""
    return [(seed >> shift) % (2 * span + 1) - span for shift in (0, 6, 12)]


SEEDS = st.integers(0, 2**18 - 1)


def saved(entry: dict) -> bytes:
    "`entry` as the trainer's checkpoint holds it (`torch.save`)."
    buffer = io.BytesIO()
    torch.save(entry, buffer)
    return buffer.getvalue()


def earlier_entry(state: NodeState) -> dict:
    """The checkpoint entry our coordinator wrote before `NodeState` (2.0's keys plus `session`,
    `last_sent_step`, the carry)."""
    job = state.in_flight
    return {
        "node_id": "n",
        "role": "worker",
        "session": state.session,
        "last_global_step": state.version,
        "last_uploaded_step": state.uploaded_step,
        "last_dispatched_step": state.sent_step,
        "last_skipped_step": None,
        "local_step": state.step,
        "last_sent_step": state.base_step,
        "baseline_generation": 3,
        "baseline": dict(state.base),
        "carry": state.carry,
        "carry_steps": state.carry_steps,
        "pending_delta": None,
        "pending_delta_step": None,
        "outer": None,
        "pending_upload": None
        if job is None
        else {
            "step": job.step,
            "base_outer_step": job.base_outer_step,
            "generation": 3,
            "delta": dict(job.delta),
            "target_state": None,
            "inner_steps": job.steps,
            "final": job.final,
        },
    }


def loaded(data: bytes) -> dict:
    """A checkpoint entry read back with the trainer's safe loader (`weights_only`: tensors and
    plain data only)."""
    return torch.load(io.BytesIO(data), weights_only=True)


class Timeline:
    """What the test knows of one run of the node, besides its state: a value a checkpoint copies
    and a restart brings back."""

    def __init__(self, live: dict[str, torch.Tensor]):
        self.live = live  # the model's weights
        # the progress of every step trained (sum of base − weights over the steps)
        self.trained = torch.zeros(3)
        # the deltas the repository took, with the steps each holds
        self.uploaded: list[tuple[Upload, frozenset[int]]] = []
        self.delivered = torch.zeros(3)  # the progress those deltas hold (their decoded sum)
        self.in_flight: frozenset[int] = frozenset()  # the steps of the delta in flight
        self.carried: frozenset[int] = frozenset()  # the steps the carry holds
        # the progress of steps the repository already held, trained again since the base
        self.retrained = torch.zeros(3)
        self.installed = {-1}  # the versions installed (-1: the node's own starting weights)
        self.timed_out = False  # a boundary wait ran out since the last new fold
        # this run restarted behind its own folds (needs this code: no earlier checkpoint format)
        self.behind = False

    def newest(self) -> int:
        """The newest step the repository holds a delta of (0: none): a delta of a step not after it
        is a duplicate the master refuses."""
        return max([0] + [job.step for job, _ in self.uploaded])

    def copy(self) -> "Timeline":
        other = Timeline(dict(self.live))
        other.__dict__.update(
            {
                k: (list(v) if isinstance(v, list) else set(v) if isinstance(v, set) else v)
                for k, v in self.__dict__.items()
                if k != "live"
            }
        )
        return other


class NodeMachine(RuleBasedStateMachine):
    @initialize(dtype=st.sampled_from(["float32", "bfloat16", "int8"]))
    def start(self, dtype: str) -> None:
        self.dtype = dtype
        self.t = Timeline(weights([0.5, -0.25, 1.0]))
        self.state = NodeState("s1", dict(self.t.live))
        self.saved: tuple[dict, Timeline] | None = None
        self.entry: dict | None = None  # the checkpoint's entry once read back

    # -- training and boundaries -------------------------------------------------------------------
    @rule(steps=st.integers(1, 3 * ROUND), seed=SEEDS)
    def train(self, steps: int, seed: int) -> None:
        """`steps` optimizer steps; each one moves the weights, and a step that ends a round is a
        boundary."""
        sizes = torch.tensor(spread(seed, 8), dtype=torch.float32) / 64
        for _ in range(steps):
            step = self.state.step + 1
            move = sizes * (1 + step % 3)
            self.t.live = {"w": self.t.live["w"] + move, "n": self.t.live["n"]}
            if step > self.t.newest():
                self.t.trained = self.t.trained - move
            else:
                self.t.retrained = self.t.retrained - move  # the repository holds this step already
            self.state = replace(self.state, step=step)
            if step % ROUND == 0:
                self.boundary(step)

    def boundary(self, step: int) -> None:
        before = self.state
        unsent = self.unsent()
        self.state, out = at_boundary(before, self.t.live, step, self.dtype)
        assert self.state.reset_due
        if out == "already_folded":  # retrained steps the global holds: dropped
            assert (
                step <= before.folded_step
                and not self.t.carried
                and all(s <= self.t.newest() for s in unsent)
            ), (step, sorted(unsent))
            assert (
                self.state.base_step == step
                and self.state.carry is None
                and torch.equal(self.state.base["w"], self.t.live["w"])
            )
            assert self.state.in_flight is before.in_flight
            self.t.retrained = torch.zeros(3)
            return
        if isinstance(out, str):
            # finite weights: only an upload in flight skips
            assert out == "upload_in_flight" and before.in_flight is not None, out
            assert self.state.in_flight is before.in_flight and self.state.base is before.base
            return
        assert before.in_flight is None and self.state.in_flight is out
        holds = self.t.carried | unsent
        assert (
            out.steps == len(holds)
            and out.step == step == self.state.sent_step == self.state.base_step
        ), (out.steps, sorted(holds))
        # a base it installed
        assert out.base_outer_step == before.version and out.base_outer_step in self.t.installed
        stale = out.step <= self.t.newest()  # a duplicate the master refuses: its steps are held
        self.t.in_flight, self.t.carried = frozenset() if stale else frozenset(holds), frozenset()
        self.t.retrained = torch.zeros(3)

    def unsent(self) -> frozenset[int]:
        return frozenset(range(self.state.base_step + 1, self.state.step + 1))

    # -- the repository's answers ------------------------------------------------------------------
    @precondition(lambda self: self.state.in_flight is not None)
    @rule()
    def upload_succeeds(self) -> None:
        job = self.state.in_flight
        self.state = on_upload_done(self.state, job)
        if job.step > self.t.newest():  # (the master refuses a duplicate: not folded)
            self.t.uploaded.append((job, self.t.in_flight))
            self.t.delivered = self.t.delivered + decode_delta(job.delta)["w"]
        self.t.in_flight = frozenset()
        assert self.state.in_flight is None and self.state.uploaded_step == job.step

    @precondition(lambda self: self.state.in_flight is not None)
    @rule()
    def upload_fails(self) -> None:
        job = self.state.in_flight
        self.state = on_upload_failed(self.state, job)
        self.t.carried, self.t.in_flight = self.t.carried | self.t.in_flight, frozenset()
        assert self.state.in_flight is None and (
            self.state.carry is not None or job.step <= self.state.folded_step
        )

    @precondition(lambda self: self.entry is not None and self.entry["in_flight"] is not None)
    @rule()
    def an_answer_from_before_the_restart(self) -> None:
        "The answer about an upload of the checkpoint's state (not this one) changes nothing."
        stale = node_state_from(self.entry, self.t.live, "x", ROUND).in_flight
        assert (
            on_upload_done(self.state, stale) is self.state
            and on_upload_failed(self.state, stale) is self.state
        )

    @precondition(lambda self: self.t.uploaded)
    @rule(seed=SEEDS)
    def the_master_folds_its_newest_delta(self, seed: int) -> None:
        "The usual next global: one version on, holding the newest delta this node uploaded."
        self.global_arrives(1, True, seed)

    @rule(ahead=st.integers(-2, 2), holds=st.booleans(), seed=SEEDS)
    def global_arrives(self, ahead: int, holds: bool, seed: int) -> None:
        """A global `ahead` versions from the installed one (older, the same, newer), holding one of
        this node's uploaded deltas or not."""
        version = max(0, self.state.version + ahead)
        mine = [job.step for job, _ in self.t.uploaded] if holds else []
        folded = max(mine) if mine else -1
        self.install(version, weights([v / 8 for v in spread(seed, 16)], seed % 10), folded)

    def install(self, version: int, g: dict[str, torch.Tensor], folded: int) -> None:
        """`on_global` of global `version` (`g`, holding this node's deltas up to `folded`) over the
        model, and what it must do."""
        before, progress = self.state, self.state.base["w"] - self.t.live["w"]
        self.state, out = on_global(before, version, g, folded, self.t.live)
        if version <= before.version:
            assert out is None and self.state is before  # older, or the same twice: nothing
            return
        if folded > before.step:  # it holds steps past ours: our progress is in it
            assert (
                self.state.carry is None
                and self.state.base_step == before.step
                and not self.t.carried
            )
            progress = self.t.retrained = torch.zeros(3)
        assert out.reset == before.reset_due and not self.state.reset_due
        assert self.state.version == version > before.version and self.state.folded_step == max(
            before.folded_step, folded
        )
        self.t.live = dict(out.weights)
        assert torch.equal(self.t.live["n"], g["n"]) and torch.equal(self.state.base["w"], g["w"])
        # the unsent progress is kept
        assert torch.allclose(self.state.base["w"] - self.t.live["w"], progress, atol=1e-6)
        self.t.installed.add(version)
        if folded > before.folded_step:
            self.t.timed_out = False
        assert self.state.waits or self.t.timed_out

    # -- boundary waits ----------------------------------------------------------------------------
    @precondition(lambda self: wait_target(self.state) is not None)
    @rule(out_of_time=st.booleans(), stopped=st.booleans())
    def boundary_wait(self, out_of_time: bool, stopped: bool) -> None:
        target, before = wait_target(self.state), self.state
        self.state, ended = after_wait(before, target, out_of_time=out_of_time, stopped=stopped)
        if before.folded_step >= target:
            assert ended == "folded"
        elif before.in_flight is None and (before.uploaded_step or -1) < target:
            assert ended == "lost"
        elif stopped:
            assert ended == "stopped"
        else:
            assert ended == ("timeout" if out_of_time else None)
        if ended == "timeout":
            self.t.timed_out = True
            assert not self.state.waits and wait_target(self.state) is None
        else:
            assert self.state is before

    # -- checkpoints and restarts ------------------------------------------------------------------
    @rule()
    def checkpoint(self) -> None:
        # written (torch.save) when it is read back
        self.saved, self.entry = (
            (node_checkpoint(self.state), self.t.copy()),
            None,
        )

    @precondition(lambda self: self.saved is not None)
    @rule(seed=SEEDS, earlier=st.booleans())
    def killed_and_restarted(self, seed: int, earlier: bool) -> None:
        """The process dies; a new one builds its model (other weights), loads the checkpoint's
        weights and its coordinator entry."""
        entry, timeline = self.saved
        # (an earlier version of ours never resumed behind)
        earlier = earlier and not timeline.behind
        if earlier:  # a checkpoint an earlier version of ours wrote
            entry = earlier_entry(node_state_from(entry, self.t.live, "x", ROUND))
            timeline = timeline.copy()
            timeline.timed_out = False  # its waits were not saved: they wait again
        self.entry = entry = loaded(saved(entry))
        assert entry.get("format", NODE_STATE_FORMAT) == NODE_STATE_FORMAT and (
            earlier or "format" in entry
        )
        self.t = timeline.copy()
        # the new process's model before the resume
        constructed = weights([v / 4 for v in spread(seed, 4)])
        self.state = node_state_from(entry, constructed, "s2", ROUND)
        assert self.state.session == "s1"  # the same session: the master's ledger knows it
        assert self.state.version == max(self.t.installed) and torch.equal(
            self.state.base["w"], entry.get("base", entry.get("baseline"))["w"]
        )
        if earlier:
            self.entry = None  # (the stale-answer rule reads our format)

    @precondition(lambda self: self.saved is not None and self.t.newest() > self.saved[0]["step"])
    @rule(seed=SEEDS)
    def killed_after_the_repository_kept_its_uploads(self, seed: int) -> None:
        """The process dies after deltas it uploaded since its checkpoint; the master folded them,
        and the restart installs that global."""
        entry, timeline = self.saved
        kept = self.t.uploaded[len(timeline.uploaded) :]  # the repository forgets nothing
        self.entry = entry = loaded(saved(entry))
        version, delivered = max(self.t.installed) + 1, self.t.delivered
        self.t = timeline.copy()
        self.t.uploaded += kept
        self.t.delivered = self.t.trained = (
            delivered  # the progress the global holds of this node: all counted
        )
        self.t.in_flight = frozenset()  # the checkpoint's upload: its steps are held (a duplicate)
        self.t.carried = frozenset()  # the checkpoint's carry went into a kept delta
        self.t.behind = True
        self.state = node_state_from(entry, weights([v / 4 for v in spread(seed, 4)]), "s2", ROUND)
        assert self.state.session == "s1" and self.state.step < self.t.newest()
        assert self.state.in_flight is None or self.state.in_flight.step <= self.t.newest()
        self.install(
            version, weights([v / 8 for v in spread(seed, 16)], seed % 10), self.t.newest()
        )
        # exactly the global: nothing of ours kept on top
        assert torch.equal(self.t.live["w"], self.state.base["w"])

    # -- invariants --------------------------------------------------------------------------------
    @invariant()
    def holds(self) -> None:
        "Every invariant, after every rule (one call: hypothesis's overhead is per invariant)."
        self.every_step_is_in_exactly_one_delta()
        self.the_deltas_hold_all_the_progress_once()
        self.versions_and_folds_only_grow()

    def every_step_is_in_exactly_one_delta(self) -> None:
        s, t = self.state, self.t
        newest = t.newest()
        # not a duplicate of a delta the repository holds
        live = s.in_flight is not None and s.in_flight.step > newest
        # (steps up to `newest` trained again are not new)
        fresh = frozenset(i for i in self.unsent() if i > newest)
        pieces = [ids for _, ids in t.uploaded] + [t.in_flight, t.carried, fresh]
        top = max(s.step, newest)
        assert sum(len(p) for p in pieces) == top and frozenset().union(*pieces) == frozenset(
            range(1, top + 1)
        ), pieces
        assert (
            sum(job.steps for job, _ in t.uploaded)
            + (s.in_flight.steps if live else 0)
            + s.carry_steps
            + s.step
            - max(s.base_step, min(s.step, newest))
            == top
        )
        assert live == bool(t.in_flight) and s.carry_steps == len(t.carried)

    def the_deltas_hold_all_the_progress_once(self) -> None:
        s, t = self.state, self.t
        held = t.delivered + s.base["w"] - t.live["w"] - t.retrained
        if s.in_flight is not None and s.in_flight.step > t.newest():
            held = held + decode_delta(s.in_flight.delta)["w"]
        if s.carry is not None:
            held = held + s.carry["w"]
        assert torch.allclose(held, t.trained, atol=TOLERANCE), (held, t.trained)

    def versions_and_folds_only_grow(self) -> None:
        s, t = self.state, self.t
        assert s.version == max(t.installed) and s.folded_step <= max(
            [-1] + [job.step for job, _ in t.uploaded]
        )
        assert s.waits or t.timed_out
        for job, ids in t.uploaded:
            assert job.steps == len(ids) <= job.step and max(ids) <= job.step
        if s.in_flight is not None:
            assert s.in_flight.step == s.sent_step and s.in_flight.steps <= s.step


NodeMachine.TestCase.settings = settings(
    max_examples=EXAMPLES,
    stateful_step_count=15,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_node_transitions = NodeMachine.TestCase


class BehindMachine(NodeMachine):
    """The same machine started (mostly) just after a restart behind the node's own folds: a
    checkpoint, uploads, the kill."""

    @initialize(
        dtype=st.sampled_from(["float32", "bfloat16", "int8"]),
        before=st.integers(0, 2 * ROUND),
        after=st.integers(1, 3 * ROUND),
        seed=SEEDS,
        answered=st.booleans(),
    )
    def start(self, dtype: str, before: int, after: int, seed: int, answered: bool) -> None:
        super().start(dtype)
        if before:
            self.train(before, seed)
        self.checkpoint()
        if answered and self.state.in_flight is not None:
            self.upload_succeeds()  # the checkpoint's upload, after it
        self.train(after, seed >> 1)
        if self.state.in_flight is not None:
            self.upload_succeeds()
        if self.t.newest() > self.saved[0]["step"]:
            self.killed_after_the_repository_kept_its_uploads(seed)


BehindMachine.TestCase.settings = settings(
    max_examples=max(1, EXAMPLES // 2),
    stateful_step_count=10,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_node_resumed_behind_its_folds = BehindMachine.TestCase
