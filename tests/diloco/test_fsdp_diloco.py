"""A DiLoCo node that is an fsdp job: real processes on CPU (gloo), the shared-directory transport.

A 2-rank master under `parallel.strategy: fsdp` next to a one-process worker trains four whole
rounds (`boundary_wait`: each node waits at a boundary for the global holding its delta, so the run
is deterministic):

- every process exits 0, every delta of both nodes is folded once (the master's `outer_step`
  events, the ledger);
- both ranks end on the final global (each rank's shards gathered whole and compared);
- the final global equals what the same run gives with the master as a ddp job, to fp32 reduction
  order (float32 deltas, so no bfloat16 rounding can turn a last-bit difference into a visible
  one);
- the fsdp master's deltas carry the tied embedding and head once, as the ddp master's do.

The checkpoints fall on round boundaries, where the inner optimizer was just reset: a sharded save
must leave it fresh (`get_state_dict` gives an empty optimizer a state of one zero step), and a
resume from such a save starts it fresh too; a tiny sync scheme that resets every 4 steps shows both
without DiLoCo, and a master alone, stopped after round 2 and resumed (rank 0's coordinator gets its
checkpointed state back), ends on the global the same ddp node ends on.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, free_port, jsonl_records, spawn, torchrun_command
from test_parallel import env, finish, losses_by_step, one_process, write_config

STEPS, ROUND = 20, 5

DRIVER = r"""
import os, sys, torch, yaml
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from speedtronic.runtime import build_runtime, close_logger
from speedtronic.parallel import end_process
config = yaml.safe_load(open(sys.argv[1]))
trainer, _ = build_runtime(config, device="cpu", resume=sys.argv[3:] == ["resume"])
try: trainer.fit()
finally: close_logger(trainer.logger); trainer.run_claim.release()
model, world = trainer.model, trainer.world
full = StateDictOptions(full_state_dict=True)
whole = get_model_state_dict(model, options=full) if world.fsdp else model.state_dict()
whole = {k: v.detach().cpu() for k, v in whole.items()}
torch.save(whole, os.path.join(sys.argv[2], f"rank{world.rank}.pt"))
world.close()
end_process(0)
"""


def node(
    tmp: Path,
    name: str,
    role: str,
    index: int,
    micro: int,
    steps: int = STEPS,
    nodes: int = 2,
    fragments: int = 1,
    **sections,
) -> Path:
    return write_config(
        tmp,
        name,
        micro=micro,
        steps=steps,
        every=10,
        model={"n_layer": 2},
        data={"synthetic": True, "num_tokens": 400, "target_batch_size": 4},
        logging={"every_steps": 5},
        distributed={
            "enabled": True,
            "role": role,
            "node_id": name,
            "transport": "directory",
            "repo_id": str(tmp / "repo"),
            # with fragments: a fragment every ROUND steps
            "inner_steps": ROUND * fragments,
            "fragments": fragments,
            "poll_interval": 0.2,
            "shard_count": nodes,
            "shard_index": index,
            "expected_nodes": nodes,
            "final_round_timeout": 120,
            "boundary_wait": 60,
            "delta_dtype": "float32",
        },
        **sections,
    )


def run_nodes(tmp: Path, strategy: str, fragments: int = 1) -> dict:
    """The 2-rank master (`strategy`) and the one-process worker, started together; the final global
    and each rank's weights."""
    from speedtronic.distributed.tensors import GLOBAL_MODEL_PATH, load_safetensors

    parallel = {"strategy": strategy}
    master = node(tmp, "master", "master", 0, 2, fragments=fragments, parallel=parallel)
    worker = node(tmp, "worker", "worker", 1, micro=4, fragments=fragments)
    (tmp / "driver.py").write_text(DRIVER)
    job = spawn(
        torchrun_command(tmp / "driver.py", master, tmp),
        cwd=ROOT,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    alone = one_process(worker)  # waits (lease_timeout) for the master to create the repository
    finish(alone, timeout=240)
    finish(job, timeout=120)  # bounded: a hung collective fails the test
    return {
        "global": load_safetensors(tmp / "repo" / GLOBAL_MODEL_PATH),
        "ranks": [torch.load(tmp / f"rank{r}.pt") for r in (0, 1)],
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    return {
        strategy: (tmp := tmp_path_factory.mktemp(strategy), run_nodes(tmp, strategy))
        for strategy in ("fsdp", "ddp")
    }


def test_fsdp_master_folds_every_delta(runs):
    """Each node's deltas of steps 5, 10, 15, 20 are folded once, and the job really ran sharded on
    2 ranks."""
    from speedtronic.distributed import SharedDirectory

    tmp, _ = runs["fsdp"]
    folded = [
        tuple(x)
        for e in jsonl_records(tmp / "master.jsonl", "outer_step")
        for x in e.get("folded", [])
    ]
    assert folded and len(folded) == len(set(folded)), folded  # no delta folded twice
    ledger = SharedDirectory(tmp / "repo").state().extras["ledger"]
    for name in ("master", "worker"):
        uploaded = sorted(e["step"] for e in jsonl_records(tmp / f"{name}.jsonl", "delta_uploaded"))
        assert uploaded == list(range(ROUND, STEPS + 1, ROUND)), (name, uploaded)
        assert max(ledger[name]["sessions"].values()) == STEPS, (name, ledger[name])
        assert sum(1 for f in folded if name in f) == len(uploaded), (name, folded)
        waits = jsonl_records(tmp / f"{name}.jsonl", "boundary_wait")
        # whole rounds: each boundary got its fold
        assert waits and all(w["folded"] for w in waits), (
            name,
            waits,
        )
    start = jsonl_records(tmp / "master.jsonl", "train_start")[0]
    assert start["world_size"] == 2
    # sharded checkpoints: fsdp it was
    assert (tmp / "master" / "checkpoints" / f"step_{STEPS:012d}.dcp").is_dir()


def test_every_rank_ends_on_the_final_global(runs):
    _, got = runs["fsdp"]
    for key, tensor in got["global"].items():
        for rank, weights in enumerate(got["ranks"]):
            assert torch.equal(weights[key], tensor), (rank, key)
    assert got["ranks"][0].keys() == got["global"].keys()


def test_the_final_global_is_the_ddp_node_s(runs):
    """Same data, same whole rounds: the fsdp master's deltas equal the ddp master's to fp32
    reduction order, and so the globals."""
    (_, fsdp), (_, ddp) = runs["fsdp"], runs["ddp"]
    assert fsdp["global"].keys() == ddp["global"].keys()
    for key, tensor in ddp["global"].items():
        torch.testing.assert_close(fsdp["global"][key], tensor, rtol=0, atol=1e-6, msg=key)
    moved = max((ddp["global"][k] - ddp["ranks"][0][k]).abs().max().item() for k in ddp["global"])
    assert moved == 0.0  # the ddp ranks end on their final global too


def test_the_fsdp_node_sends_the_tied_embedding_and_head_once(runs):
    """The model ties its head to its embedding: each delta of the fsdp master is the ddp master's
    size, a head's bytes short of the float32 tensors with the pair counted twice."""
    (fsdp_dir, fsdp), (ddp_dir, _) = runs["fsdp"], runs["ddp"]
    sizes = {
        name: [e["bytes"] for e in jsonl_records(folder / "master.jsonl", "delta_uploaded")]
        for name, folder in (("fsdp", fsdp_dir), ("ddp", ddp_dir))
    }
    final = fsdp["global"]
    assert torch.equal(final["lm_head.weight"], final["transformer.wte.weight"])  # tied
    twice = sum(v.numel() * 4 for v in final.values() if v.is_floating_point())
    head = final["lm_head.weight"].numel() * 4
    assert sizes["fsdp"] == sizes["ddp"] and len(sizes["fsdp"]) == STEPS // ROUND, sizes
    assert all(b <= twice - head for b in sizes["fsdp"]), (sizes, twice, head)


RESETTING = r"""
import sys, yaml
from speedtronic.runtime import build_runtime, close_logger
from speedtronic.parallel import end_process
class ResetEvery4:
    '''A sync scheme that asks for a fresh inner optimizer every 4 steps, as DiLoCo's
    reset_inner_optimizer does at a boundary.'''
    def start(self): pass
    def after_optimizer_step(self, model, step): return step % 4 == 0
    def stop(self): pass
    def state_dict(self): return None
    def load_state_dict(self, state): pass
config = yaml.safe_load(open(sys.argv[1]))
trainer, _ = build_runtime(config, device="cpu", resume=sys.argv[2] == "resume")
trainer.coordinator = ResetEvery4()
try: trainer.fit()
finally: close_logger(trainer.logger); trainer.run_claim.release()
trainer.world.close()
end_process(0)
"""


def resetting_job(tmp: Path, name: str, strategy: str, steps: int, resume: bool = False) -> Path:
    """A 2-rank job of `steps` steps (the schedule's horizon 8 whatever `steps`), its optimizer
    reset every 4; its metrics file."""
    cfg = write_config(
        tmp,
        name,
        micro=4,
        steps=steps,
        every=4,
        model={"n_layer": 2},
        parallel={"strategy": strategy},
        data={"synthetic": True, "num_tokens": 400, "shuffle": True},
        scheduler={"max_steps": 8},
    )
    (tmp / "resetting.py").write_text(RESETTING)
    finish(
        spawn(
            torchrun_command(tmp / "resetting.py", cfg, "resume" if resume else "fresh"),
            cwd=ROOT,
            env=env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        ),
        timeout=180,
    )
    return tmp / f"{name}.jsonl"


def test_an_fsdp_node_sends_the_fragments_a_one_process_node_sends(tmp_path):
    """distributed.fragments with a tied model: the fsdp master plans its fragments on its replica,
    which keeps the head tied to the embedding as the worker's model does, so both cut the model
    alike: each sends a fragment every 5 steps and its last delta whole, and none is refused."""
    run_nodes(tmp_path, "fsdp", fragments=2)
    for name in ("master", "worker"):
        queued = jsonl_records(tmp_path / f"{name}.jsonl", "delta_upload_queued")
        sent = [(e["step"], e.get("fragment")) for e in queued]
        assert sent == [(5, "1/2"), (10, "0/2"), (15, "1/2"), (20, None)], (name, sent)
    assert not jsonl_records(tmp_path / "master.jsonl", "delta_rejected")
    folded = [e["folded"] for e in jsonl_records(tmp_path / "master.jsonl", "outer_step")]
    assert sorted(tuple(x) for f in folded for x in f) == [
        (n, s) for n in ("master", "worker") for s in (5, 10, 15, 20)
    ], folded


def test_a_reset_optimizer_stays_fresh_through_a_sharded_checkpoint(tmp_path):
    """fsdp with a save at each reset trains the ddp job's losses, and a resume from the save at
    step 4 goes on with them."""
    fsdp, ddp = (
        losses_by_step(resetting_job(tmp_path, "fsdp", "fsdp", 8)),
        losses_by_step(resetting_job(tmp_path, "ddp", "ddp", 8)),
    )
    assert sorted(fsdp) == list(range(1, 9))
    for step, (loss,) in fsdp.items():
        assert loss == pytest.approx(ddp[step][0], rel=1e-6, abs=0), step
    resetting_job(tmp_path, "again", "fsdp", 4)
    assert (tmp_path / "again" / "checkpoints" / f"step_{4:012d}.dcp").is_dir()
    resumed = losses_by_step(resetting_job(tmp_path, "again", "fsdp", 8, resume=True))
    for step in range(5, 9):
        assert resumed[step][-1] == pytest.approx(fsdp[step][0], rel=1e-6, abs=0), step


def alone(tmp: Path, strategy: str, steps: int, resume: bool = False) -> None:
    """A master with no other node (each round its own delta), `steps` steps of a schedule 20 long,
    as a 2-rank `strategy` job."""
    cfg = node(
        tmp,
        "master",
        "master",
        0,
        micro=2,
        steps=steps,
        nodes=1,
        parallel={"strategy": strategy},
        scheduler={"max_steps": STEPS},
    )
    (tmp / "driver.py").write_text(DRIVER)
    finish(
        spawn(
            torchrun_command(tmp / "driver.py", cfg, tmp, *(["resume"] if resume else [])),
            cwd=ROOT,
            env=env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        ),
        timeout=180,
    )


def resumed_alone(tmp: Path, strategy: str) -> dict:
    """The master alone, stopped at step 10 (a boundary: its inner optimizer just reset) and resumed
    to 20; its final global."""
    from speedtronic.distributed.tensors import GLOBAL_MODEL_PATH, load_safetensors

    tmp.mkdir()
    alone(tmp, strategy, 10)
    assert max(r["step"] for r in jsonl_records(tmp / "master.jsonl")) == 10
    alone(tmp, strategy, STEPS, resume=True)
    assert jsonl_records(tmp / "master.jsonl", "train_start")[-1]["start_step"] == 10  # it resumed
    folded = [
        tuple(x)
        for e in jsonl_records(tmp / "master.jsonl", "outer_step")
        for x in e.get("folded", [])
    ]
    assert [s for _, s in folded] == [5, 10, 15, 20], folded
    final = load_safetensors(tmp / "repo" / GLOBAL_MODEL_PATH)
    for rank in (0, 1):
        assert all(
            torch.equal(torch.load(tmp / f"rank{rank}.pt")[k], v) for k, v in final.items()
        ), rank
    return final


def test_a_resumed_fsdp_node_goes_on_as_a_ddp_one(tmp_path):
    """Rank 0's coordinator gets its checkpointed state back, folds rounds 3 and 4, and ends where
    the ddp node ends."""
    fsdp, ddp = resumed_alone(tmp_path / "fsdp", "fsdp"), resumed_alone(tmp_path / "ddp", "ddp")
    for key, tensor in ddp.items():
        torch.testing.assert_close(fsdp[key], tensor, rtol=0, atol=1e-6, msg=key)
