"""The outer rule that keeps 2.0's DiLoCo config (outer lr 0.7, Nesterov momentum 0.9, no waiting at
boundaries) from overshooting when deltas arrive late: delayed Nesterov, whose momentum is fed only
the deltas computed from a global at least as new as the momentum's last step (a late delta is
applied at the outer learning rate, without momentum). Pinned on a real master over a shared
directory with real delta files, against plain PyTorch `SGD(nesterov=True)` over the
pseudo-gradients, across a restart of the master."""

from __future__ import annotations

from pathlib import Path

import torch

from speedtronic.distributed import MasterOuterLoop, SharedDirectory
from speedtronic.distributed.tensors import (
    delta_header,
    delta_path,
    encode_delta,
    floating_state,
    save_safetensors,
)
from speedtronic.distributed.transport import RetryPolicy

LR, MU, NODES = 0.7, 0.9, 2


def master(tmp: Path, model: torch.nn.Module) -> MasterOuterLoop:
    """A master of `model` (2.0's outer defaults, two nodes) over the shared directory `tmp/repo`,
    its state in `tmp/state`."""
    transport = SharedDirectory(tmp / "repo", retry=RetryPolicy(0.001, 0.01, 2))
    transport.open(create=True)
    loop = MasterOuterLoop(
        transport,
        model.state_dict(),
        node_state_dir=tmp / "state",
        node_id="a",
        inner_steps=10,
        outer_lr=LR,
        outer_momentum=MU,
        expected_nodes=NODES,
    )
    loop.start_master()
    return loop


def send(
    tmp: Path,
    loop: MasterOuterLoop,
    node: str,
    step: int,
    base: int,
    delta: dict[str, torch.Tensor],
) -> None:
    "Commit `node`'s delta of 10 inner steps ending at `step`, computed from global version `base`."
    header = delta_header(
        node_id=node,
        local_step=step,
        base_outer_step=base,
        inner_steps=10,
        encoding="float32",
        session="s",
    )
    out = tmp / "out" / f"{node}-{step}.safetensors"
    save_safetensors(encode_delta(delta, "float32"), out, header)
    loop.transport.upload({delta_path(node, step): out})


def test_a_delta_older_than_the_last_momentum_step_does_not_feed_the_momentum(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    shapes = floating_state(model.state_dict())
    deltas = {
        (node, step): {k: torch.randn(v.shape) * 1e-3 for k, v in shapes.items()}
        for node in "ab"
        for step in (10, 20, 30)
    }
    loop = master(tmp_path, model)
    # round 1: both nodes from version 0, in one fold (version 1)
    send(tmp_path, loop, "a", 10, 0, deltas["a", 10])
    send(tmp_path, loop, "b", 10, 0, deltas["b", 10])
    assert loop.sync_once() == 1
    # round 2: a from version 1 (version 2), then b still from version 0, one outer step behind
    # (version 3)
    send(tmp_path, loop, "a", 20, 1, deltas["a", 20])
    assert loop.sync_once() == 2
    send(tmp_path, loop, "b", 20, 0, deltas["b", 20])
    assert loop.sync_once() == 3
    # the master restarts from its state directory; round 3: a from version 2 (one outer step
    # behind), b from version 3
    loop = master(tmp_path, model)
    assert loop.outer_step == 3
    send(tmp_path, loop, "a", 30, 2, deltas["a", 30])
    send(tmp_path, loop, "b", 30, 3, deltas["b", 30])
    assert loop.sync_once() == 4

    # plain PyTorch: per round, Nesterov SGD with the momentum's gradient (the round's deltas that
    # were computed from the momentum's last step or later, summed / nodes); the rest of the round's
    # average is applied at the outer lr alone
    weights = {k: torch.nn.Parameter(v.detach().clone().float()) for k, v in shapes.items()}
    sgd = torch.optim.SGD(weights.values(), lr=LR, momentum=MU, nesterov=True)
    rounds = [
        ((("a", 10), 1.0), (("b", 10), 1.0)),
        ((("a", 20), 1.0), (("b", 20), 0.0)),
        ((("a", 30), 0.0), (("b", 30), 1.0)),
    ]
    for parts in rounds:
        for k, p in weights.items():
            p.grad = sum(w * deltas[key][k] for key, w in parts) / NODES
        sgd.step()
        with torch.no_grad():
            for k, p in weights.items():
                p -= LR * (sum(deltas[key][k] for key, _ in parts) / NODES - p.grad)
    for k, p in weights.items():
        torch.testing.assert_close(
            loop.global_state[k].float(), p.detach(), rtol=0, atol=1e-6, msg=k
        )
