"""Out-of-order backprop (speedtronic.scheduling): the same gradients with and without the CUDA
stream scheduler.

The GPU tests run wherever CUDA exists and skip cleanly elsewhere; the CPU tests check that the
scheduler is an honest no-op off CUDA, through the real trainer.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch import nn

from speedtronic.model import ReferenceTransformer
from speedtronic.runtime import train_from_config
from speedtronic.scheduling import StageStreamScheduler

cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the stream scheduler is only active on CUDA"
)


class Branches(nn.Module):
    "Four independent branches on the same input, summed: the shape the scheduler can overlap."

    def __init__(self, width: int = 256, branches: int = 4):
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.branches = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
            for _ in range(branches)
        )
        self.out = nn.Linear(width, 1)

    def forward(self, x):
        h = self.inp(x)
        return self.out(sum(b(h) for b in self.branches)).square().mean()


def reference(device="cuda"):
    torch.manual_seed(0)
    return ReferenceTransformer(
        vocab_size=128, block_size=32, n_layer=2, n_head=4, n_kv_head=2, d_model=64, d_ff=128
    ).to(device)


def loss_and_grads(model, batch, scheduler=None, autocast=False):
    model.zero_grad(set_to_none=True)
    if scheduler is not None:
        scheduler.begin()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        out = model(**batch) if isinstance(batch, dict) else model(batch)
    loss = out["loss"] if isinstance(out, dict) else out
    if scheduler is not None:
        scheduler.finish()
    loss.backward()
    return loss.detach().float().item(), {
        n: p.grad.detach().clone() for n, p in model.named_parameters()
    }


@cuda
@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("streams", [2, 4, 8])
def test_reference_model_same_gradients(streams, autocast):
    model = reference()
    ids = torch.randint(0, 128, (8, 32), device="cuda")
    batch = {"input_ids": ids, "labels": ids}
    loss_a, grads_a = loss_and_grads(model, batch, autocast=autocast)
    sched = StageStreamScheduler(model, "cuda", num_streams=streams)
    assert sched.enabled and sched.reason == "enabled" and sched.as_dict()["streams"] == streams
    for _ in range(3):  # repeated forwards: records are per forward
        loss_b, grads_b = loss_and_grads(model, batch, sched, autocast=autocast)
        assert loss_b == pytest.approx(loss_a, rel=1e-6)
        for n in grads_a:
            torch.testing.assert_close(
                grads_b[n], grads_a[n], rtol=1e-5 if not autocast else 1e-2, atol=1e-6, msg=n
            )
    sched.dispose()
    assert not sched.enabled
    assert sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()) == 0


@cuda
def test_branches_same_gradients_and_stage_list():
    torch.manual_seed(0)
    model = Branches().cuda()
    x = torch.randn(64, 256, device="cuda")
    loss_a, grads_a = loss_and_grads(model, x)
    model.ooo_stage_names = [f"branches.{i}" for i in range(4)]
    sched = StageStreamScheduler(model, "cuda", num_streams=4)
    assert [s.name for s in sched.stages] == model.ooo_stage_names
    assert [s.stream_index for s in sched.stages] == [0, 1, 2, 3]
    loss_b, grads_b = loss_and_grads(model, x, sched)
    sched.dispose()
    assert loss_b == pytest.approx(loss_a, rel=1e-6)
    for n in grads_a:
        torch.testing.assert_close(grads_b[n], grads_a[n], rtol=1e-5, atol=1e-6, msg=n)


@cuda
def test_bad_stage_list_disables_with_a_reason():
    model = Branches().cuda()
    model.ooo_stage_names = ["branches", "branches.0"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sched = StageStreamScheduler(model, "cuda")
    assert not sched.enabled and sched.reason.startswith(
        "stream scheduling setup failed: ooo_stage_names nests"
    )
    assert any("setup failed" in str(w.message) for w in caught)
    assert sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()) == 0
    one = StageStreamScheduler(nn.Sequential(nn.Linear(4, 4)).cuda(), "cuda")
    assert not one.enabled and one.reason == "fewer than two independent module stages were found"


@cuda
def test_an_error_inside_a_stage_leaves_the_streams_clean():
    class Fails(nn.Module):
        def forward(self, x):
            raise RuntimeError("boom")

    model = nn.Sequential(nn.Linear(4, 4), Fails()).cuda()
    sched = StageStreamScheduler(model, "cuda", num_streams=2)
    ambient = torch.cuda.current_stream()
    sched.begin()
    with pytest.raises(RuntimeError, match="boom"):
        model(torch.randn(2, 4, device="cuda"))
    sched.dispose()
    assert torch.cuda.current_stream() == ambient


def run_config(tmp_path, name, ooo):
    return {
        "run": {"name": name, "seed": 3, "max_steps": 4, "output_dir": str(tmp_path / name)},
        "model": {
            "vocab_size": 64,
            "max_seq_len": 16,
            "n_layer": 1,
            "n_head": 4,
            "n_kv_head": 2,
            "d_model": 32,
            "d_ff": 64,
        },
        "data": {
            "synthetic": True,
            "num_tokens": 32,
            "block_size": 16,
            "micro_batch_size": 2,
            "target_batch_size": 4,
        },
        "optimizer": {"name": "muon", "lr": 3e-3},
        "precision": {"mode": "fp32"},
        "checkpoint": {"enabled": False},
        "logging": {
            "progress": False,
            "loss_plot": False,
            "json_file": str(tmp_path / f"{name}.jsonl"),
        },
        "ooo_backprop": ooo,
        "ooo_streams": 4,
    }


def events(path, name):
    return [r for r in map(json.loads, path.read_text().splitlines()) if r.get("event") == name]


def test_trainer_off_cuda_is_an_honest_no_op(tmp_path):
    plain = train_from_config(run_config(tmp_path, "plain", False), device="cpu")
    scheduled = train_from_config(run_config(tmp_path, "ooo", True), device="cpu")
    assert [r["loss"] for r in scheduled.metrics] == [r["loss"] for r in plain.metrics]
    (event,) = events(tmp_path / "ooo.jsonl", "ooo_backprop")
    assert (event["enabled"], event["reason"], event["streams"], event["stages"]) == (
        False,
        "device cpu has no supported CUDA stream scheduler",
        0,
        [],
    )
    assert events(tmp_path / "ooo.jsonl", "train_start")[0]["ooo_backprop"] is False
    assert events(tmp_path / "plain.jsonl", "ooo_backprop") == []


@cuda
def test_trainer_on_cuda_trains_the_same(tmp_path):
    plain = train_from_config(run_config(tmp_path, "plain", False), device="cuda")
    scheduled = train_from_config(run_config(tmp_path, "ooo", True), device="cuda")
    (event,) = events(tmp_path / "ooo.jsonl", "ooo_backprop")
    assert event["enabled"] is True and event["streams"] == 4 and len(event["stages"]) > 4
    assert [r["loss"] for r in scheduled.metrics] == pytest.approx(
        [r["loss"] for r in plain.metrics], rel=1e-5
    )
