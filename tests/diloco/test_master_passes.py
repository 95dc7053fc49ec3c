"""The DiLoCo master's passes and its final round (found by bench/sim_diloco.py at scale): one pass
of the master at a time, even when the final round begins while the loop thread is mid-pass, and a
final round that waits for each worker's *final* delta, not for the master's own last step number.

Real files: a real master on a real shared-directory repository; a download made slow by a
transport that waits, after writing the file, until someone else publishes (or the master says it
waits for the pass). No sleeps decide an outcome."""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path

import pytest
import torch

from speedtronic.distributed import MasterOuterLoop, SharedDirectory
from speedtronic.distributed.tensors import (
    delta_header,
    delta_path,
    encode_delta,
    floating_state,
    save_safetensors,
)
from speedtronic.distributed.transport import HubUnavailable, RetryPolicy


class Lines:
    "A logger for the master: keeps its lines and events, and calls `on_line` with each line."

    def __init__(self):
        self.lines: list[str] = []
        self.events: list[tuple[str, dict]] = []
        self.on_line = lambda line: None

    def _line(self, level: str, message: str) -> None:
        self.lines.append(f"{level}: {message}")
        self.on_line(message)

    def info(self, message: str) -> None:
        self._line("info", message)

    def warning(self, message: str) -> None:
        self._line("warning", message)

    def error(self, message: str) -> None:
        self._line("error", message)

    def emit(self, event: str, payload: dict) -> None:
        self.events.append((event, payload))

    def folded(self) -> list[tuple]:
        return [tuple(x) for e, p in self.events if e == "outer_step" for x in p.get("folded", [])]

    def rejected(self) -> list[dict]:
        return [p for e, p in self.events if e == "delta_rejected"]


class SlowFetch(SharedDirectory):
    """A shared directory whose first delta download, once armed, writes the file and then waits
    until `gate` is set: by a publication from another pass, or by the test."""

    def __init__(self, root: Path, gate: threading.Event):
        super().__init__(root, retry=RetryPolicy(0.001, 0.01, 2))
        self.gate, self.armed, self.held = gate, False, threading.Event()

    def fetch(self, path, local, revision=None):
        out = super().fetch(path, local, revision=revision)
        if self.armed and path.startswith("nodes/") and not self.held.is_set():
            self.held.set()  # the pass is now in its download
            self.gate.wait(120)
        return out

    def publish(self, *args, **kw):
        if self.armed:
            self.gate.set()  # another pass publishes: the held download goes on
        return super().publish(*args, **kw)


MODEL = torch.nn.Linear(4, 3)
SHAPES = floating_state(MODEL.state_dict())


def send(repo: Path, node: str, step: int, inner: int, base: int, final: bool = False) -> None:
    "Commit `node`'s delta at `step` to the shared directory `repo`, as a node does."
    header = delta_header(
        node_id=node,
        local_step=step,
        base_outer_step=base,
        inner_steps=inner,
        encoding="float32",
        session="s-" + node,
        final=final,
    )
    out = repo.parent / "out" / f"{node}-{step}.safetensors"
    save_safetensors(
        encode_delta({k: torch.full(v.shape, 1e-3) for k, v in SHAPES.items()}, "float32"),
        out,
        header,
    )
    SharedDirectory(repo).upload({delta_path(node, step): out})


def master(tmp: Path, transport: SharedDirectory, log: Lines, **kw) -> MasterOuterLoop:
    transport.open(create=True)
    m = MasterOuterLoop(
        transport,
        MODEL.state_dict(),
        node_state_dir=tmp / "state",
        node_id="m",
        inner_steps=10,
        poll_interval=0.01,
        logger=log,
        **kw,
    )
    m.start_master()
    return m


def test_final_round_waits_for_a_pass_in_progress(tmp_path):
    "The final round begins while the loop thread is in a slow download: it waits, never races."
    gate, log = threading.Event(), Lines()
    log.on_line = lambda line: gate.set() if "waiting for that pass" in line else None
    transport = SlowFetch(tmp_path / "repo", gate)
    m = master(tmp_path, transport, log)
    transport.armed = True
    send(tmp_path / "repo", "a", 10, inner=10, base=0, final=True)
    m.start()
    assert transport.held.wait(60), "the loop thread never downloaded the delta"
    version = m.finish(10, timeout=5.0, interval=0.01)
    assert m.error is None, m.error
    assert log.rejected() == [], log.rejected()  # no 'No such file': nobody deleted its download
    assert not [x for x in log.lines if "another master" in x], log.lines
    assert log.folded() == [("a", 10)]  # folded once
    assert version == 1 and m.ledger.nodes["a"]["sessions"] == {"s-a": 10}
    assert [x for x in log.lines if "waiting for that pass" in x] != [], log.lines
    assert len([x for x in log.lines if "waiting for that pass" in x]) == 1
    assert SharedDirectory(tmp_path / "repo").state().outer_step == 1


def test_final_round_waits_for_a_longer_workers_final_delta(tmp_path):
    """A worker whose max_steps exceeds the master's: its delta at the master's last step is no
    sign it is done; the final round folds its final delta too."""
    repo, log = tmp_path / "repo", Lines()
    m = master(tmp_path, SharedDirectory(repo, retry=RetryPolicy(0.001, 0.01, 2)), log)
    send(repo, "a", 10, inner=10, base=0)
    assert m.sync_once() == 1 and log.folded() == [("a", 10)]

    def worker_goes_on(line: str) -> None:  # the worker trains on while the master waits
        if line.startswith("final round: waiting") and not (repo / delta_path("a", 20)).exists():
            send(repo, "a", 20, inner=10, base=1, final=True)

    log.on_line = worker_goes_on
    version = m.finish(10, timeout=30.0, interval=0.01)
    assert version == 2 and log.folded() == [("a", 10), ("a", 20)]
    assert m.ledger.nodes["a"]["sessions"] == {"s-a": 20} and m.ledger.nodes["a"]["final"]
    assert SharedDirectory(repo).state().outer_step == 2
    assert not [x for x in log.lines if "not in the final global" in x], log.lines


def test_final_round_names_a_worker_whose_final_delta_never_came(tmp_path):
    """The round's deadline passes without a worker's final delta: one warning names it and its
    steps."""
    repo, log = tmp_path / "repo", Lines()
    m = master(tmp_path, SharedDirectory(repo, retry=RetryPolicy(0.001, 0.01, 2)), log)
    send(repo, "a", 10, inner=10, base=0)
    assert m.sync_once() == 1
    assert m.finish(10, timeout=0.5, interval=0.01) == 1
    warned = [x for x in log.lines if "not in the final global" in x]
    assert len(warned) == 1 and "'a'" in warned[0] and "after step 10" in warned[0], log.lines


class RateLimited(SharedDirectory):
    "A shared directory that answers the next `refuse` commits as a 429 does; it counts downloads."

    def __init__(self, root: Path):
        super().__init__(root, retry=RetryPolicy(0.001, 0.01, 2))
        self.refuse, self.fetched = 0, Counter()

    def fetch(self, path, local, revision=None):
        self.fetched[path] += 1
        return super().fetch(path, local, revision=revision)

    def publish(self, *args, **kw):
        if self.refuse:
            self.refuse -= 1
            raise HubUnavailable("429 Too Many Requests: the repository's commits for this hour")
        return super().publish(*args, **kw)


def test_a_refused_publication_keeps_its_deltas_checked(tmp_path):
    """While its commit is refused (429), the master keeps what it checked: the next pass downloads
    only the new delta and publishes both in one version."""
    repo, log = tmp_path / "repo", Lines()
    transport = RateLimited(repo)
    m = master(tmp_path, transport, log)
    send(repo, "a", 10, inner=10, base=0)
    transport.refuse = 1
    with pytest.raises(HubUnavailable):
        m.sync_once()
    assert m.outer_step == 0 and set(m.held) == {delta_path("a", 10)}
    send(repo, "b", 10, inner=10, base=0)
    assert m.sync_once() == 1  # the window opened: one commit
    assert sorted(log.folded()) == [("a", 10), ("b", 10)]
    assert transport.fetched == {delta_path("a", 10): 1, delta_path("b", 10): 1}
    assert SharedDirectory(repo).list_deltas() == []  # both folded and removed


def worker_node(repo: Path, state_dir: Path, model: torch.nn.Module, hub=None, **config):
    """Worker `w` of the run in `repo`: 2 inner steps, float32 deltas uploaded on the caller's
    thread; `config` adds or replaces `distributed` settings, `hub` is the transport (else the
    directory `repo`)."""
    from speedtronic.config import DistributedConfig
    from speedtronic.distributed import DumbDiLoCoCoordinator

    settings = dict(
        enabled=True,
        role="worker",
        node_id="w",
        transport="directory",
        repo_id=str(repo),
        inner_steps=2,
        poll_interval=0.05,
        async_delta_upload=False,
        delta_dtype="float32",
    )
    return DumbDiLoCoCoordinator(
        DistributedConfig(**{**settings, **config}), model, hub=hub, state_dir=state_dir
    )


def test_a_worker_whose_last_step_ends_a_round_sends_that_delta_as_its_last(tmp_path):
    """A worker trained to a step that ends a round sends the delta of that step marked final (the
    trainer gives the coordinator its target), so the master's final round ends at once instead of
    waiting `final_round_timeout` for a final delta that would never come."""
    from speedtronic.distributed.tensors import read_metadata

    repo, log = tmp_path / "repo", Lines()
    m = master(tmp_path, SharedDirectory(repo, retry=RetryPolicy(0.001, 0.01, 2)), log)
    m.start()
    model = torch.nn.Linear(4, 3)
    worker = worker_node(repo, tmp_path / "w-state", model)
    worker.set_target(4)
    worker.start()
    try:
        for step in range(1, 5):
            with torch.no_grad():
                model.weight.add_(1e-3)
            worker.after_optimizer_step(model, step)
        assert read_metadata(repo / delta_path("w", 4)).get("final") == "true"
        assert read_metadata(repo / delta_path("w", 2)).get("final") != "true"
        assert m.finish(4, timeout=60.0, interval=0.01) >= 1
    finally:
        worker.stop()
        m.stop()
    assert not [x for x in log.lines if "final round: waiting" in x], log.lines
    assert not [x for x in log.lines if "not in the final global" in x], log.lines
    assert m.ledger.nodes["w"]["final"] and m.ledger.nodes["w"]["sessions"] == {
        worker.state.session: 4
    }
