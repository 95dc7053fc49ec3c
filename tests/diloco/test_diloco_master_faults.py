"""DiLoCo master faults: a delta that lands while the master commits, wild first deltas, forged
steps, stray files at the end, a second master with a wrong clock, tied weights on the wire, and
2.0's own repository. Real files, the real `huggingface_hub` client against the loopback Hub
stand-in, real masters; time is the master's injectable clock where a test needs it, never a sleep.
"""

from __future__ import annotations

import io
import json
import shutil
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import HUB_TOKEN, ROOT  # noqa: E402
from hub_server import HubStandIn  # noqa: E402

from speedtronic.config import SpeedtronicConfig
from speedtronic.distributed import (
    HubClient,
    HubError,
    HubUnavailable,
    MasterOuterLoop,
    SharedDirectory,
)
from speedtronic.distributed.tensors import (
    GLOBAL_MODEL_PATH,
    TENSOR_ALIASES,
    compute_pseudo_gradient,
    cpu_state_dict,
    delta_header,
    delta_path,
    encode_delta,
    floating_state,
    load_delta,
    load_safetensors,
    read_metadata,
    save_safetensors,
    wire_bytes,
)
from speedtronic.distributed.transport import RetryPolicy
from speedtronic.profiling import MetricLogger
from speedtronic.registry import build_model

TOKEN = HUB_TOKEN  # what the `hub` fixture accepts
V2 = ROOT.parent / "shared" / "fixtures" / "v2.0"


class Run:
    """A shared-directory repository, a master of a small model on it, and nodes that send deltas as
    a node does."""

    def __init__(self, tmp: Path, **master):
        self.tmp, self.events, self.console = tmp, [], io.StringIO()
        self.logger = MetricLogger(
            stream=self.console, hooks=[lambda e, p: self.events.append((e, p))]
        )
        self.model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Linear(6, 3))
        self.shapes = floating_state(self.model.state_dict())
        self.last: dict = {}
        self.master = self.new_master(**master)
        self.master.start_master()

    def transport(self) -> SharedDirectory:
        return SharedDirectory(self.tmp / "repo", retry=RetryPolicy(0.001, 0.01, 2))

    def new_master(self, state: str = "state", node_id: str = "m", **kw) -> MasterOuterLoop:
        t = self.transport()
        t.open(create=True)
        return MasterOuterLoop(
            t,
            self.model.state_dict(),
            node_state_dir=self.tmp / state,
            node_id=node_id,
            inner_steps=10,
            logger=self.logger,
            **kw,
        )

    def send(
        self,
        node: str,
        step: int,
        scale: float = 1e-3,
        *,
        session: str = "s",
        inner: int | None = None,
        path: str | None = None,
        forged: bool = False,
        drop: tuple = (),
    ) -> None:
        """Commit `node`'s delta at `step` (each delta covers the steps since the node's previous
        one, unless `inner` says)."""
        inner = step - self.last.get((node, session), 0) if inner is None else inner
        if not forged:
            self.last[node, session] = step
        header = delta_header(
            node_id=node,
            local_step=step,
            base_outer_step=max(self.master.outer_step, 0),
            inner_steps=inner,
            encoding="float32",
            session=session,
        )
        out = self.tmp / "out" / f"{node}-{step}.safetensors"
        save_safetensors(
            encode_delta(
                {k: torch.full(v.shape, float(scale)) for k, v in self.shapes.items()}, "float32"
            ),
            out,
            {k: v for k, v in header.items() if k not in drop},
        )
        self.transport().upload({path or delta_path(node, step): out})

    def seen(self, event: str) -> list[dict]:
        self.logger.flush()
        return [p for e, p in self.events if e == event]

    def folded(self) -> list[tuple]:
        return [tuple(x) for p in self.seen("outer_step") for x in p.get("folded", [])]

    def rejected(self) -> dict[tuple, str]:
        return {(p["node_id"], p["step"]): p["reason"] for p in self.seen("delta_rejected")}

    def global_max(self) -> float:
        return max(
            float(v.abs().max())
            for v in load_safetensors(self.tmp / "repo" / GLOBAL_MODEL_PATH).values()
        )


# -- 1. nothing waits on a timeout that a poll would end -------------------------------------------
def hub_master(tmp: Path, hub: HubStandIn, repo: str, start: bool = True, **master):
    """A master of a small model on a new Hub repo, its transport, and `send(step)`: node w commits
    a delta."""
    client = lambda: HubClient(
        repo, token=TOKEN, endpoint=hub.url, retry_initial=0.01, retry_max=0.05, retry_attempts=3
    )
    t = client()
    t.open(create=True)
    model = torch.nn.Linear(4, 4)
    shapes = floating_state(model.state_dict())

    def send(step: int) -> None:
        out = tmp / f"d{step}.safetensors"
        save_safetensors(
            encode_delta({k: torch.full(v.shape, 1e-3) for k, v in shapes.items()}),
            out,
            delta_header(
                node_id="w",
                local_step=step,
                base_outer_step=0,
                inner_steps=10,
                encoding="bfloat16",
                session="s",
            ),
        )
        client().upload({delta_path("w", step): out})

    m = MasterOuterLoop(
        t, model.state_dict(), node_state_dir=tmp / "state", node_id="m", inner_steps=10, **master
    )
    if start:
        m.start_master()
    return t, m, send


def test_a_delta_in_the_repository_before_the_masters_first_commit_is_folded_by_its_first_round(
    tmp_path, hub
):
    """A node (resumed with a delta still to send) commits before the master bootstraps: the
    bootstrap's commit holds that delta, which the master never listed. Its first round must list it
    (taking its own commit for what it had seen hid the delta until the next commit came: at the end
    of a run, for the whole final_round_timeout)."""
    t, m, send = hub_master(tmp_path, hub, "org/early", start=False, expected_nodes=1)
    send(10)
    assert m.start_master().outer_step == 0 and t.list_deltas() == [delta_path("w", 10)]
    assert m.sync_once() == 1 and t.list_deltas() == []


def test_a_delta_committed_while_the_master_bootstraps_is_folded_and_the_master_goes_on(
    tmp_path, hub
):
    """A node commits between the master's first read and its bootstrap commit: the bootstrap is
    retried, not taken for another master."""
    t, m, send = hub_master(tmp_path, hub, "org/boot-race", start=False, expected_nodes=1)
    publish = t.publish

    def racing_publish(*args, **kw):
        t.publish = publish
        send(10)
        return publish(*args, **kw)

    t.publish = racing_publish
    assert m.start_master().outer_step == 0 and t.list_deltas() == [delta_path("w", 10)]
    assert m.sync_once() == 1 and t.list_deltas() == []


def test_the_final_round_folds_a_held_round_at_once(tmp_path, hub):
    """Whole rounds: a round waiting for a node that has finished is folded by the final round, not
    after its wait runs out."""
    now = [0.0]
    t, m, send = hub_master(
        tmp_path, hub, "org/held-final", expected_nodes=2, round_wait=1000.0, clock=lambda: now[0]
    )
    send(10)
    assert m.sync_once() == 0 and list(m.held) == [delta_path("w", 10)]
    console = io.StringIO()
    m.logger = MetricLogger(stream=console)
    assert m.finish(10, timeout=5.0, interval=0.01) == 1  # the clock never reaches the round's wait
    assert "final round: no last delta" not in console.getvalue() and t.list_deltas() == []


def test_a_delta_that_lands_while_the_master_commits_is_folded_by_the_next_round(tmp_path, hub):
    """The master's heartbeat commit goes through, its answer is lost, and a node commits a delta
    before the client tries again. However the retry ends (here: the client retries with the
    additions it uploaded, and the Hub refuses the stale parent), the head after a publication is
    not what the master listed: the next round lists it."""
    now = [0.0]
    t, m, send = hub_master(tmp_path, hub, "org/lost", expected_nodes=1, clock=lambda: now[0])
    send(10)
    assert m.sync_once() == 1
    assert m.sync_once() == 1  # nothing new
    real = t.api.create_commit

    def commit(*args, **kw):  # huggingface_hub's call, around the stand-in's lost answer
        try:
            return real(*args, **kw)
        except Exception:
            t.api.create_commit = real
            send(20)  # the node's delta lands before the client tries again
            raise

    t.api.create_commit = commit
    hub.fault("lost_response", method="POST", path=r"/commit/")
    now[0] += 1000.0  # idle for a third of the lease: a heartbeat is due
    assert m.sync_once() == 1 and not hub.faults and t.api.create_commit is real
    assert t.list_deltas() == [delta_path("w", 20)]
    assert m.sync_once() == 2 and t.list_deltas() == []  # folded at once, not after the next commit
    assert m.ledger.nodes["w"]["sessions"] == {"s": 20}


def test_a_publication_whose_answer_is_lost_in_an_outage_is_the_masters_own(tmp_path, hub):
    """The master's publication goes through, its answer is lost, and the retries meet an outage:
    the round fails (HubUnavailable). The next round finds a version it did not hear about, with its
    own publication id: it continues from it instead of stopping as if another master were
    publishing."""
    t, m, send = hub_master(tmp_path, hub, "org/outage", expected_nodes=1)
    send(10)
    hub.fault("lost_response", method="POST", path=r"/commit/")
    hub.fault("503", method="POST", path=r"/commit/", count=2)
    with pytest.raises(HubUnavailable):
        m.sync_once()
    # it did go through
    assert m.outer_step == 0 and t.state().outer_step == 1 and t.list_deltas() == []
    send(20)
    assert m.sync_once() == 2 and m.ledger.nodes["w"]["sessions"] == {"s": 20} and m.error is None
    assert t.state().extras["master"]["node_id"] == "m"


# -- 2. a wild delta never becomes the global ------------------------------------------------------
def test_a_wild_first_delta_is_refused_and_the_nodes_go_on(tmp_path):
    run = Run(tmp_path)
    m = run.master
    run.send("worker", 10, 1e3)
    m.sync_once()  # the run's very first delta, 1e3 per element: no history at all
    run.send("other", 10, 3e38)
    m.sync_once()  # 3e38: its norm overflows
    assert run.rejected() == {("worker", 10): "too_large", ("other", 10): "too_large"}
    assert "the global model's own norm" in run.seen("delta_rejected")[0]["message"]
    run.send("m", 10)
    run.send("late", 10, 0.5)
    m.sync_once()  # first deltas side by side: the wild one is refused
    assert (
        run.rejected()[("late", 10)] == "too_large"
        and "new node" in run.seen("delta_rejected")[-1]["message"]
    )
    for step in (20, 30, 40):  # the master's and the worker's honest deltas are folded
        run.send("m", step)
        run.send("worker", step)
        m.sync_once()
    assert run.folded() == [("m", 10)] + [(n, s) for s in (20, 30, 40) for n in ("m", "worker")]
    assert m.outer_step == 4 and run.global_max() < 1.0 and len(run.rejected()) == 3
    assert m.transport.list_deltas() == []


def test_a_fold_that_would_publish_a_non_finite_global_publishes_nothing(tmp_path):
    """With the size checks off, two finite deltas that overflow together: nothing is published,
    both are refused."""
    run = Run(tmp_path, max_delta_norm_ratio=0.0)
    run.send("a", 10, 3e38)
    run.send("b", 10, 3e38)
    assert run.master.sync_once() == 0 and run.folded() == []
    assert run.rejected() == {("a", 10): "not_finite", ("b", 10): "not_finite"}
    # removed with a cleanup commit
    assert run.master.sync_once() == 0 and run.master.transport.list_deltas() == []
    assert all(
        bool(torch.isfinite(v).all())
        for v in load_safetensors(tmp_path / "repo" / GLOBAL_MODEL_PATH).values()
    )
    run.send("a", 20)
    run.send("b", 20)
    assert run.master.sync_once() == 1


# -- 3. steps a node could not have reached --------------------------------------------------------
def test_a_forged_step_of_a_real_session_is_refused_and_the_session_goes_on(tmp_path):
    run = Run(tmp_path)
    m = run.master
    for step in (10, 20):
        run.send("worker", step)
        m.sync_once()
    run.send(
        "worker",
        999_999_999_999,
        inner=10,
        forged=True,
        path="nodes/worker/delta_000000999999999999.safetensors",
    )
    # a session without inner_steps: not a node of ours
    run.send("worker", 10**6, forged=True, drop=("inner_steps",))
    m.sync_once()
    assert run.rejected() == {
        ("worker", 999_999_999_999): "unreachable",
        ("worker", 10**6): "header",
    }
    run.send("worker", 30)
    m.sync_once()
    run.send("worker", 40, float("nan"))
    m.sync_once()  # refused for its content: the node goes on
    run.send("worker", 50)
    m.sync_once()
    run.send("worker", 90, inner=40)
    run.send("worker", 100)
    m.sync_once()  # one pass, listed as delta_100 before delta_90
    assert run.folded() == [("worker", s) for s in (10, 20, 30, 50, 90, 100)] and not run.seen(
        "delta_duplicate"
    )
    assert run.rejected()[("worker", 40)] == "not_finite" and m.ledger.nodes["worker"][
        "sessions"
    ] == {"s": 100}
    message = [p["message"] for p in run.seen("delta_rejected") if p["reason"] == "unreachable"][0]
    assert "reached step 20" in message and "forged or stray" in message
    # a warning, not INFO
    assert (
        "rejected delta nodes/worker/delta_000000999999999999.safetensors" in run.console.getvalue()
    )


def test_a_refused_delta_of_a_session_first_folded_in_the_same_round_still_counts_as_reached(
    tmp_path,
):
    """A node's first delta and its next one (NaN) are listed in one pass: the refusal is of a
    session the ledger learns
    only from that round's fold. The node carries on after the refused delta; its next one must not
    look unreachable."""
    run = Run(tmp_path)
    m = run.master
    run.send("worker", 10)
    run.send("worker", 20, float("nan"))
    m.sync_once()
    assert run.folded() == [("worker", 10)] and run.rejected() == {("worker", 20): "not_finite"}
    run.send("worker", 30)
    m.sync_once()  # steps 21..30: continues after the refused 20
    assert run.folded() == [("worker", 10), ("worker", 30)] and len(run.rejected()) == 1


# -- 4. the final round waits only for nodes in the global -----------------------------------------
def test_the_final_round_does_not_wait_for_a_node_whose_only_file_was_refused(tmp_path):
    run = Run(tmp_path)
    m = run.master
    junk = tmp_path / "junk"
    junk.write_bytes(b"not a delta")
    # a stray file: the only "delta" of ghost
    run.transport().upload({"nodes/ghost/delta_5.safetensors": junk})
    run.send("worker", 10)
    run.send("m", 10)
    m.sync_once()
    run.send("worker", 20)
    run.send("m", 20)
    assert m.finish(20, timeout=5.0, interval=0.01) == 2
    assert run.rejected() == {("ghost", 5): "unreadable"}
    # it did not wait out the 5 s for ghost
    assert "final round: no last delta" not in run.console.getvalue()


# -- 5. the lease does not trust another host's clock ----------------------------------------------
def test_a_master_whose_clock_is_off_by_an_hour_does_not_take_a_live_masters_lease(tmp_path):
    run = Run(tmp_path, node_id="m1", lease_timeout=5.0, poll_interval=0.05)
    live = run.master
    live.start()  # idle: it renews its heartbeat every lease_timeout / 3
    try:
        for skew in (3600.0, -3600.0):  # its heartbeat looks an hour old, or an hour in the future
            second = run.new_master(
                "second",
                node_id="m2",
                lease_timeout=5.0,
                poll_interval=0.05,
                wall_clock=lambda skew=skew: time.time() + skew,
            )
            with pytest.raises(HubError, match="belongs to master 'm1'"):
                second.start_master()
    finally:
        live.stop()
    assert live.error is None and live._thread is not None and not live._thread.is_alive()
    assert run.transport().state().extras["master"]["node_id"] == "m1"
    # the live master is gone: after a lease of silence on its own clock, the second one takes over
    successor = run.new_master(
        "second",
        node_id="m2",
        lease_timeout=0.5,
        poll_interval=0.05,
        wall_clock=lambda: time.time() + 3600,
    )
    assert successor.start_master().outer_step == 0 and "watching it" in run.console.getvalue()
    run.send("w", 10)
    assert successor.sync_once() == 1
    took = run.transport().state().extras["master"]
    assert took["node_id"] == "m2" and took["succeeds"] == ["m1"]  # its workers follow it


# -- 6. tied weights travel once -------------------------------------------------------------------
def _tied_model() -> torch.nn.Module:
    cfg = SpeedtronicConfig.from_dict(
        {
            "model": {
                "vocab_size": 256,
                "max_seq_len": 32,
                "n_layer": 2,
                "d_model": 64,
                "n_head": 4,
                "n_kv_head": 2,
                "d_ff": 96,
            }
        }
    )
    torch.manual_seed(0)
    return build_model(cfg.model)


def test_tied_weights_travel_once_and_every_reader_gets_every_key(tmp_path):
    model = _tied_model()
    assert model.lm_head.weight is model.transformer.wte.weight
    baseline = cpu_state_dict(model.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 256, (2, 33))
    for _ in range(3):
        out = model(tokens[:, :-1], tokens[:, 1:])
        (
            out["loss"]
            if isinstance(out, dict)
            else out[0]
            if isinstance(out, (tuple, list))
            else out
        ).backward()
        opt.step()
        opt.zero_grad()
    delta = compute_pseudo_gradient(baseline, cpu_state_dict(model.state_dict()))
    # fp32, the tied tensor once
    unique_fp32 = 4 * sum(v.numel() for k, v in delta.items() if k != "lm_head.weight")
    wire = encode_delta(delta, "bfloat16")
    path = save_safetensors(
        wire,
        tmp_path / "delta.safetensors",
        delta_header(
            node_id="n",
            local_step=3,
            base_outer_step=0,
            inner_steps=3,
            encoding="bfloat16",
            session="s",
        ),
    )
    copy = 2 * model.lm_head.weight.numel()
    assert (
        wire_bytes(wire) == unique_fp32 // 2
        and wire_bytes(wire) == 2 * sum(v.numel() for v in wire.values()) - copy
    )
    assert path.stat().st_size <= 0.5 * unique_fp32 + 4096  # half the fp32 size, plus the header
    assert json.loads(read_metadata(path)[TENSOR_ALIASES]) == {
        "lm_head.weight": "transformer.wte.weight"
    }
    tensors, header = load_delta(path)
    assert set(tensors) == set(wire) and torch.equal(
        tensors["lm_head.weight"], tensors["transformer.wte.weight"]
    )
    assert tensors["lm_head.weight"].data_ptr() != tensors["transformer.wte.weight"].data_ptr()
    # the master folds it and publishes a global that stores the tied tensor once too, and a node
    # reads every key
    t = SharedDirectory(tmp_path / "repo")
    t.open(create=True)
    rounds = []
    logger = MetricLogger(
        stream=False, hooks=[lambda e, p: rounds.append(p) if e == "outer_step" else None]
    )
    m = MasterOuterLoop(
        t,
        model.state_dict(),
        node_state_dir=tmp_path / "state",
        node_id="m",
        inner_steps=3,
        logger=logger,
    )
    m.start_master()
    t.upload({delta_path("n", 3): path})
    assert m.sync_once() == 1
    logger.flush()
    logger.close()
    assert rounds[-1]["bytes_received"] < unique_fp32 // 2 + 4096  # bytes the master downloaded
    published = tmp_path / "repo" / GLOBAL_MODEL_PATH
    assert published.stat().st_size < unique_fp32 + 4096 and TENSOR_ALIASES in read_metadata(
        published
    )
    state = load_safetensors(published)
    assert set(state) == set(model.state_dict()) and torch.equal(
        state["lm_head.weight"], state["transformer.wte.weight"]
    )
    fresh = _tied_model()
    fresh.load_state_dict(state)


def v2_repo(tmp_path: Path) -> tuple[Path, torch.nn.Module]:
    "A writable copy of 2.0's DiLoCo repository fixture, and a fresh model of its shape."
    repo = tmp_path / "repo"
    shutil.copytree(V2 / "diloco-repo", repo)
    for p in [repo, *repo.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    cfg = SpeedtronicConfig.from_dict(
        {
            "model": {
                "vocab_size": 256,
                "max_seq_len": 64,
                "n_layer": 2,
                "d_model": 64,
                "n_head": 4,
                "n_kv_head": 2,
            }
        }
    )
    return repo, build_model(cfg.model)


@pytest.mark.skipif(
    not (V2 / "diloco-repo").is_dir(), reason="the 2.0 fixtures (shared/fixtures/v2.0) are not here"
)
def test_a_2_0_repository_is_read_and_its_deltas_are_folded(tmp_path):
    repo, model = v2_repo(tmp_path)
    # 2.0's global: every key, as 2.0 wrote it
    model.load_state_dict(load_safetensors(repo / GLOBAL_MODEL_PATH))
    for node in ("master", "worker1", "worker2"):
        tensors, header = load_delta(repo / "nodes" / node / "delta_200.safetensors")
        assert set(tensors) == set(model.state_dict()) and TENSOR_ALIASES not in header
    events = []
    logger = MetricLogger(stream=False, hooks=[lambda e, p: events.append((e, p))])
    m = MasterOuterLoop(
        SharedDirectory(repo),
        model.state_dict(),
        node_state_dir=tmp_path / "state",
        node_id="master",
        inner_steps=10,
        logger=logger,
    )
    assert m.start_master().outer_step == 4
    assert m.sync_once() == 5
    logger.flush()
    logger.close()
    assert not [p for e, p in events if e == "delta_rejected"]
    assert sorted(
        tuple(x) for e, p in events if e == "outer_step" for x in p.get("folded", [])
    ) == [("master", 200), ("worker1", 200), ("worker2", 200)]
    state = load_safetensors(repo / GLOBAL_MODEL_PATH)
    assert set(state) == set(model.state_dict()) and torch.equal(
        state["lm_head.weight"], state["transformer.wte.weight"]
    )


# -- a delta that cannot be fetched ----------------------------------------------------------------
class VanishingDirectory(SharedDirectory):
    """A shared directory where the listed deltas in `vanish` are removed the moment before the
    master fetches them."""

    vanish: set[str] = set()

    def fetch(self, path, local, revision=None):
        if path in self.vanish:
            (self.root / path).unlink(missing_ok=True)
        return super().fetch(path, local, revision)


def test_a_delta_gone_before_its_fetch_leaves_the_others_folded_and_the_master_running(tmp_path):
    run = Run(tmp_path)
    run.send("a", 10)
    run.send("b", 10)
    gone = VanishingDirectory(tmp_path / "repo", retry=RetryPolicy(0.001, 0.01, 2))
    gone.vanish = {delta_path("a", 10)}
    run.master.transport = gone
    run.master.sync_once()  # raised HubError before: the master loop stopped
    assert run.folded() == [("b", 10)] and not run.seen("delta_rejected")
    assert run.console.getvalue().count(f"delta {delta_path('a', 10)} could not be fetched") == 1
    run.send("a", 20)
    run.send("b", 20)  # the node goes on: its next delta is folded
    run.master.sync_once()
    assert sorted(run.folded()[1:]) == [("a", 20), ("b", 20)]


def test_a_master_whose_model_does_not_fit_the_repositorys_global_stops_naming_the_tensor(tmp_path):
    """Restarted elsewhere with another model, the master adopts nothing: it names the first tensor
    that differs."""
    run = Run(tmp_path)
    run.send("a", 10)
    run.master.sync_once()
    other = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Linear(8, 3))
    t = run.transport()
    t.open()
    master = MasterOuterLoop(
        t, other.state_dict(), node_state_dir=tmp_path / "elsewhere", node_id="m", inner_steps=10
    )
    with pytest.raises(
        HubError,
        match=r"does not fit this master's model: tensor '0.weight' has shape \(8, 6\) here and "
        r"\(6, 6\) in the global",
    ):
        master.start_master()
    assert master.outer_step == -1 and torch.equal(
        master.global_state["0.weight"], other.state_dict()["0.weight"]
    )


# -- a transport of 2.0's contract, and 2.0's checkpoint -------------------------------------------
class ContractOnly:
    """A transport written against 2.0's contract: state, list_deltas, fetch, upload, publish(files,
    deletes, parent, owner, message)."""

    def __init__(self, root: Path):
        self.inner = SharedDirectory(root, retry=RetryPolicy(0.001, 0.01, 2))

    def state(self):
        return self.inner.state()

    def list_deltas(self, revision=None):
        return self.inner.list_deltas(revision)

    def fetch(self, path, local, revision=None):
        return self.inner.fetch(path, local, revision=revision)

    def upload(self, files, message=""):
        return self.inner.upload(files, message)

    def publish(self, files, deletes, parent, owner, message=""):
        return self.inner.publish(files, deletes, parent=parent, owner=owner, message=message)


def test_a_master_works_on_a_transport_of_2_0s_contract(tmp_path):
    """No open, describe, head_revision, counts, nor publish's newer keywords: the master
    bootstraps, folds, deletes and resumes."""
    run = Run(tmp_path)  # its nodes send the deltas; its master is replaced
    shutil.rmtree(tmp_path / "repo")
    SharedDirectory(tmp_path / "repo").open(create=True)
    plain = MasterOuterLoop(
        ContractOnly(tmp_path / "repo"),
        run.model.state_dict(),
        node_state_dir=tmp_path / "plain",
        node_id="m",
        inner_steps=10,
        logger=run.logger,
    )
    assert plain.start_master().outer_step == 0
    run.send("w", 10)
    run.send("w", 20, float("nan"))
    assert (
        plain.sync_once() == 1
        and run.folded() == [("w", 10)]
        and run.rejected() == {("w", 20): "not_finite"}
    )
    assert plain.transport.list_deltas() == []
    again = MasterOuterLoop(
        ContractOnly(tmp_path / "repo"),
        run.model.state_dict(),
        node_state_dir=tmp_path / "plain",
        node_id="m",
        inner_steps=10,
    )
    assert again.start_master().outer_step == 1 and again.ledger == plain.ledger
    torch.testing.assert_close(again.state.outer.momentum, plain.state.outer.momentum)


@pytest.mark.skipif(
    not (V2 / "diloco-repo").is_dir(), reason="the 2.0 fixtures (shared/fixtures/v2.0) are not here"
)
def test_a_2_0_checkpoints_outer_state_is_continued_and_its_processed_deltas_are_not_folded_again(
    tmp_path,
):
    """2.0's checkpoint shape (processed_deltas as [node, step, base] triples, momentum,
    global_state) comes in through the translator."""
    repo, model = v2_repo(tmp_path)
    v2_global = load_safetensors(repo / GLOBAL_MODEL_PATH)
    momentum = {k: torch.full(v.shape, 1e-4) for k, v in floating_state(v2_global).items()}
    checkpoint = {
        "outer_step": 4,
        "processed_deltas": [[n, 200, 3] for n in ("master", "worker1", "worker2")],
        "momentum": momentum,
        "global_state": v2_global,
    }
    m = MasterOuterLoop(
        SharedDirectory(repo),
        model.state_dict(),
        node_state_dir=tmp_path / "state",
        node_id="master",
        inner_steps=10,
    )
    m.load_state_dict(checkpoint)
    assert m.start_master().outer_step == 4
    torch.testing.assert_close(m.state.outer.momentum, momentum)  # continued, not restarted at zero
    # 2.0 had folded them: dropped as duplicates
    assert m.sync_once() == 4 and SharedDirectory(repo).list_deltas() == []
