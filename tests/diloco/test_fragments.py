"""Streaming DiLoCo's fragments (distributed.fragments) end to end: real `speedtronic train` nodes
send one fragment of their model at a time, the master folds and publishes each as it comes, and
every step of every node reaches the global model once, with each install mixed into the node's own
weights (distributed.mixing)."""

from __future__ import annotations

import torch

from diloco_nodes import TOKEN, check_exactly_once, events, hub_env, run_nodes

from speedtronic.checkpoint import load_checkpoint
from speedtronic.distributed import HubClient
from speedtronic.distributed.tensors import GLOBAL_MODEL_PATH, fragment_plan, load_safetensors
from speedtronic.registry import build_model
from speedtronic.config import SpeedtronicConfig


def test_nodes_send_one_fragment_at_a_time_and_every_step_is_folded_once(tmp_path, hub):
    names = ("master", "w1")
    run_nodes(
        tmp_path,
        repo="org/diloco-fragments",
        transport="hub",
        names=names,
        steps=40,
        env=hub_env(hub),
        inner_steps=10,
        fragments=2,
        mixing=0.5,  # what a node keeps of its own is never sent again: the ledger shows it
        boundary_wait=60,
    )
    for name in names:
        queued = events(tmp_path / name / "metrics.jsonl", "delta_upload_queued")
        # every 5 steps one half of the model, fragment 1 first; the last delta holds what is left
        assert [(e["step"], e.get("fragment")) for e in queued] == [
            (5, "1/2"),
            (10, "0/2"),
            (15, "1/2"),
            (20, "0/2"),
            (25, "1/2"),
            (30, "0/2"),
            (35, "1/2"),
            (40, None),
        ], (name, queued)
        whole = queued[-1]["bytes"]
        halves = [e["bytes"] for e in queued[:-1]]
        assert max(halves) < 0.75 * whole, (name, halves, whole)  # the largest upload: about half
        pairs = [a + b for a, b in zip(halves[0::2], halves[1::2])]
        assert all(abs(p - whole) < 0.1 * whole for p in pairs), (pairs, whole)
    repo = HubClient("org/diloco-fragments", token=TOKEN, endpoint=hub.url, retry_attempts=2)
    state = repo.state()
    check_exactly_once(tmp_path, names, state.extras["ledger"])
    # the version file says when each fragment last changed (a mixing node blends only those); the
    # last deltas are whole, so the final version moved both
    assert state.extras["fragment_versions"] == [state.outer_step] * 2, state.extras
    # each fragment is folded and published on its own: a version for every fragment of the run
    master = tmp_path / "master" / "metrics.jsonl"
    folded = [sorted(map(tuple, e["folded"])) for e in events(master, "outer_step") if e["folded"]]
    assert [r for r in folded if r[0][1] < 40] == [
        [("master", s), ("w1", s)] for s in range(5, 40, 5)
    ], folded
    # the final global is the master's model, and its tied head is still its embedding
    final = load_safetensors(repo.fetch(GLOBAL_MODEL_PATH, tmp_path / "final.safetensors"))
    ckpt = load_checkpoint(sorted((tmp_path / "master" / "checkpoints").glob("step_*.pt"))[-1])
    assert ckpt["step"] == 40 and all(torch.equal(ckpt["model"][k], v) for k, v in final.items())


def test_the_plan_keeps_a_tied_head_with_its_embedding():
    model = {"n_layer": 4, "d_model": 32, "n_head": 2, "tie_weights": True}
    state = build_model(SpeedtronicConfig.from_dict({"model": model}).model).state_dict()
    assert state["lm_head.weight"].data_ptr() == state["transformer.wte.weight"].data_ptr()
    floating = sorted(k for k, v in state.items() if v.is_floating_point())
    for count in (2, 3, 4, 6):
        plan = fragment_plan(state, count)
        assert len(plan) == count and sorted(k for f in plan for k in f) == floating, plan
        assert {"transformer.wte.weight", "lm_head.weight"} <= set(plan[0]), (count, plan)
        assert "transformer.ln_f.weight" in plan[-1], (count, plan)
