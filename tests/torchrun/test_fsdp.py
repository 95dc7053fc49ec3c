"""`parallel.strategy: fsdp` under torchrun: real processes on CPU (gloo), started with `python -m
torch.distributed.run`.

- 2 fsdp ranks reproduce 2 ddp ranks on the same config (per-step losses, held-out losses, final
weights), with
  clipping and accumulation (2 microbatches per update: FSDP's `set_requires_gradient_sync(False)`
  for the first);
  `reshard_after_forward: false` trains the same losses;
- SIGTERM saves the agreed step once and a NaN loss on one rank stops every rank with one message,
as under ddp;
- checkpoints are `step_<N>.dcp` folders written by every rank, `latest.json` pointing at the newest
only
  once it is complete; kill -9 of one rank, then `--resume`, reproduces the uninterrupted run
  exactly;
- a sharded checkpoint converts to one file (`speedtronic consolidate`) that `load_checkpoint` and
  `speedtronic export` read, and `export` reads the folder itself;
- a ddp job's checkpoint file resumes as fsdp and a fsdp folder as ddp (the losses go on as the ddp
run's);
- a sharded checkpoint of 2 ranks loads into 1 process, and one of 1 process (sharded or a single
file) into
  2 sharded ranks: model and optimizer state equal the saved ones;
- what a shard cannot do (Muon) is refused before the job joins, and cpu_offload on the CPU, in one
line naming the key;
- bench/gpu_check.py runs on the CPU (every row skipped) and its world-of-one DDP/FSDP code runs
with gloo.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, dotted_payload, free_port, jsonl_records
from conftest import run_command, spawn, torchrun_command
from test_parallel import (
    NAN_MODEL,
    env,
    finish,
    losses_by_step,
    one_process,
    rank_pid,
    refused,
    stop_at_step,
    token_file,
    torchrun,
    wait_for_step,
    write_config,
)
from speedtronic.checkpoint import consolidate_checkpoint, load_checkpoint, load_sharded

STEPS = 8
DATA = {"synthetic": True, "num_tokens": 400, "shuffle": True}
MODEL = {"n_layer": 2}  # two blocks: each sharded on its own, then the root
FSDP = {"strategy": "fsdp"}


def folder(out: Path, step: int) -> Path:
    return out / "checkpoints" / f"step_{step:012d}.dcp"


def assert_state_equal(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(got[key], value), (what, key)
        elif isinstance(value, dict):
            assert_state_equal(got[key], value, f"{what}.{key}")
        else:
            assert got[key] == value, (what, key)


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    """The uninterrupted 2-rank fsdp run (a checkpoint every 2 steps) and the same config under ddp,
    both evaluated every 4 steps."""
    tmp = tmp_path_factory.mktemp("fsdp")
    held_out = {"every_steps": 4, "max_batches": 3, "token_file": str(token_file(tmp, blocks=40))}
    cfg = write_config(
        tmp,
        "fsdp",
        micro=4,
        data=DATA,
        steps=STEPS,
        every=2,
        model=MODEL,
        parallel=FSDP,
        eval=held_out,
    )
    ddp = write_config(
        tmp, "ddp", micro=4, data=DATA, steps=STEPS, every=STEPS, model=MODEL, eval=held_out
    )
    finish(torchrun(cfg))
    finish(torchrun(ddp))
    return tmp


def test_fsdp_matches_ddp(fsdp_run):
    """Same gradients, averaged the same way: FSDP reduce-scatters what DDP all-reduces, so the
    losses and weights agree to fp32 reduction order (the tolerance argued in test_parallel's 2-vs-1
    test)."""
    tmp = fsdp_run
    got, want = losses_by_step(tmp / "fsdp.jsonl"), losses_by_step(tmp / "ddp.jsonl")
    assert sorted(got) == list(range(1, STEPS + 1)) and all(len(v) == 1 for v in got.values())
    for step, (loss,) in got.items():
        assert loss == pytest.approx(want[step][0], rel=1e-6, abs=0), step
    start = jsonl_records(tmp / "fsdp.jsonl", "train_start")[0]
    assert (start["world_size"], start["accumulation_steps"]) == (2, 2)
    evals, ddp_evals = (
        jsonl_records(tmp / "fsdp.jsonl", "eval"),
        jsonl_records(tmp / "ddp.jsonl", "eval"),
    )
    # every rank runs the sharded forward
    assert [e["step"] for e in evals] == [e["step"] for e in ddp_evals] == [4, 8]
    for e, d in zip(evals, ddp_evals):
        assert (
            e["val_loss"] == pytest.approx(d["val_loss"], rel=1e-6, abs=0)
            and e["val_tokens"] == d["val_tokens"]
        )
    final = load_checkpoint(folder(tmp / "fsdp", STEPS))  # the folder gathered whole
    ddp = load_checkpoint(tmp / "ddp" / "checkpoints" / f"step_{STEPS:012d}.pt")
    for name, tensor in ddp["model"].items():
        torch.testing.assert_close(final["model"][name], tensor, rtol=0, atol=1e-6, msg=name)
    assert (final["step"], final["samples"]) == (ddp["step"], ddp["samples"])


def test_sharded_checkpoint_folders(fsdp_run):
    checkpoints = fsdp_run / "fsdp" / "checkpoints"
    names = sorted(p.name for p in checkpoints.iterdir())
    # no temp folder left
    assert names == ["latest.json"] + [f"step_{s:012d}.dcp" for s in (2, 4, 6, 8)], names
    assert sorted(p.name for p in folder(fsdp_run / "fsdp", 2).iterdir()) == [
        ".metadata",
        ".sha256.json",  # every file's sha256 and size, both ranks' shards included
        "__0_0.distcp",
        "__1_0.distcp",
        "state.pt",
    ]
    record = json.loads((folder(fsdp_run / "fsdp", 2) / ".sha256.json").read_text())
    assert sorted(record["files"]) == [".metadata", "__0_0.distcp", "__1_0.distcp", "state.pt"]
    pointer = json.loads((checkpoints / "latest.json").read_text())
    assert (pointer["file"], pointer["step"]) == (f"step_{STEPS:012d}.dcp", STEPS)


def test_kill_one_rank_then_resume(fsdp_run, tmp_path):
    """kill -9 of rank 1 mid-run; `--resume` continues from the last complete folder and reproduces
    the uninterrupted run."""
    cfg = write_config(
        tmp_path, "fsdp", micro=4, data=DATA, steps=STEPS, every=2, model=MODEL, parallel=FSDP
    )
    job = torchrun(cfg)
    wait_for_step(job, tmp_path / "fsdp.jsonl", 5)
    os.kill(rank_pid(job, 1), signal.SIGKILL)
    try:
        job.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        job.kill()
        pytest.fail("the job did not stop after one rank was killed")
    assert job.returncode != 0
    checkpoints = tmp_path / "fsdp" / "checkpoints"
    done = sorted(p.name for p in checkpoints.glob("step_*.dcp"))
    assert done and done[-1] < f"step_{STEPS:012d}.dcp"
    dead = 2**22 + 4321  # a half-written checkpoint: a dead writer's temp folder
    half = checkpoints / f".step_{STEPS - 1:012d}.dcp.tmp-{dead}-0badc0de"
    half.mkdir()
    (half / "__0_0.distcp").write_bytes(b"cut")
    finish(torchrun(cfg, "--resume"))
    ref = {s: v[0] for s, v in losses_by_step(fsdp_run / "fsdp.jsonl").items()}
    got = losses_by_step(tmp_path / "fsdp.jsonl")
    assert sorted(got) == list(range(1, STEPS + 1))
    for step, values in got.items():
        assert all(v == ref[step] for v in values), (step, values, ref[step])
    assert_state_equal(
        load_checkpoint(folder(tmp_path / "fsdp", STEPS))["model"],
        load_checkpoint(folder(fsdp_run / "fsdp", STEPS))["model"],
        "model",
    )
    assert not half.exists()  # the next save removed it


def test_sigterm_saves_once_then_resume(fsdp_run, tmp_path):
    """SIGTERM to the job: every rank stops after the same step, which the job saves once (a
    folder); --resume reproduces the run."""
    cfg = write_config(
        tmp_path, "fsdp", micro=4, data=DATA, steps=STEPS, every=100, model=MODEL, parallel=FSDP
    )
    job = torchrun(cfg)
    stop_at_step(job, tmp_path / "fsdp.jsonl", 3)
    saves = jsonl_records(tmp_path / "fsdp.jsonl", "checkpoint")
    last = max(r["step"] for r in jsonl_records(tmp_path / "fsdp.jsonl"))
    assert [s["step"] for s in saves] == [last] and last < STEPS, saves
    assert saves[0]["path"].endswith(f"step_{last:012d}.dcp")
    finish(torchrun(cfg, "--resume"))
    ref = {s: v[0] for s, v in losses_by_step(fsdp_run / "fsdp.jsonl").items()}
    for step, values in losses_by_step(tmp_path / "fsdp.jsonl").items():
        assert all(v == ref[step] for v in values), step
    assert_state_equal(
        load_checkpoint(folder(tmp_path / "fsdp", STEPS))["model"],
        load_checkpoint(folder(fsdp_run / "fsdp", STEPS))["model"],
        "model",
    )


def test_a_nan_loss_on_one_rank_stops_every_rank(tmp_path):
    """The non-finite rule on the job's loss under fsdp: rank 1's NaN stops both ranks at step 3
    with one message; step 2 is saved."""
    # a model without repeated blocks: sharded as a whole
    (tmp_path / "nan_models.py").write_text(NAN_MODEL)
    cfg = write_config(
        tmp_path,
        "nan",
        micro=4,
        data={"synthetic": True, "num_tokens": 40},
        steps=6,
        every=2,
        model={"name": "nan_on_one_rank", "imports": ["nan_models"]},
        parallel=FSDP,
    )
    cmd = torchrun_command("-m", "speedtronic", "train", "--config", cfg, "--device", "cpu")
    job = spawn(
        cmd,
        cwd=ROOT,
        env={**env(), "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}", "NAN_CALLS": "5"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = refused(job)
    assert line.startswith("speedtronic: error: [rank 0 of 2] step 3: the loss is nan"), line
    assert [s["step"] for s in jsonl_records(tmp_path / "nan.jsonl", "checkpoint")] == [2]
    saved = load_checkpoint(folder(tmp_path / "nan", 2))
    assert saved["step"] == 2 and all(torch.isfinite(t).all() for t in saved["model"].values())


@pytest.mark.parametrize("first,then", [("ddp", "fsdp"), ("fsdp", "ddp")])
def test_resume_with_the_other_strategy(fsdp_run, tmp_path, first, then):
    """A ddp job's checkpoint file resumes as fsdp (each rank keeps its shards of it), a fsdp folder
    as ddp: the run goes on as before."""
    cfg = write_config(
        tmp_path,
        "switch",
        micro=4,
        data=DATA,
        steps=STEPS,
        every=4,
        model=MODEL,
        parallel={"strategy": first},
    )
    finish(torchrun(cfg))
    checkpoints = tmp_path / "switch" / "checkpoints"
    last = checkpoints / f"step_{STEPS:012d}.{'pt' if first == 'ddp' else 'dcp'}"
    subprocess.run(["rm", "-r", str(last)], check=True)  # as if the job had stopped after step 4
    cfg = write_config(
        tmp_path,
        "switch",
        micro=4,
        data=DATA,
        steps=STEPS,
        every=4,
        model=MODEL,
        parallel={"strategy": then},
    )
    out, _ = finish(torchrun(cfg, "--resume"))
    ref = {s: v[0] for s, v in losses_by_step(fsdp_run / "ddp.jsonl").items()}
    got = {s: v[-1] for s, v in losses_by_step(tmp_path / "switch.jsonl").items()}
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in range(5, STEPS + 1):
        assert got[step] == pytest.approx(ref[step], rel=1e-6, abs=0), step
    # the changed setting is said, by rank 0
    assert out.count(f"parallel.strategy {first!r} -> {then!r}") == 1, out[-3000:]
    resumed = [
        r for r in jsonl_records(tmp_path / "switch.jsonl", "checkpoint") if r["step"] == STEPS
    ]
    assert resumed[-1]["path"].endswith(f"step_{STEPS:012d}.{'dcp' if then == 'fsdp' else 'pt'}")


def test_consolidate_and_export(fsdp_run, tmp_path):
    source = folder(fsdp_run / "fsdp", STEPS)
    out = tmp_path / "whole.pt"
    proc = run_command(
        [sys.executable, "-m", "speedtronic", "consolidate", str(source), "--output", str(out)],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert str(out) in proc.stdout
    whole = load_checkpoint(out)
    assert_state_equal(whole["model"], load_checkpoint(source)["model"], "model")
    assert whole["step"] == STEPS and isinstance(
        whole["optimizer"]["state"][0]["exp_avg"], torch.Tensor
    )
    for checkpoint in (out, source):  # the file, and the folder itself
        to = tmp_path / f"hf-{checkpoint.suffix[1:]}"
        proc = run_command(
            [
                sys.executable,
                "-m",
                "speedtronic",
                "export",
                "--checkpoint",
                str(checkpoint),
                "--to",
                str(to),
            ],
            cwd=ROOT,
            env=env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert (to / "model.safetensors").is_file() and (to / "config.json").is_file()
    bad = run_command(
        [sys.executable, "-m", "speedtronic", "consolidate", str(out)],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert [l for l in bad.stderr.splitlines() if l.startswith("speedtronic: error:")] == [
        f"speedtronic: error: {out} is not a sharded checkpoint (a step_<step>.dcp folder holding "
        ".metadata, written by "
        "parallel.strategy: fsdp); give such a folder"
    ]


def _model_and_optimizer(cfg: Path):
    from speedtronic.config import load_config
    from speedtronic.optimizers import build_optimizer
    from speedtronic.registry import build_model
    from speedtronic.schedules import build_scheduler

    config = load_config(str(cfg))
    model = build_model(config.model)
    optimizer = build_optimizer(model, config, torch.device("cpu"))
    build_scheduler(optimizer, config)
    return model, optimizer


def test_two_ranks_load_into_one_process(fsdp_run):
    """DCP reshards: the 2-rank folder loads into one unsharded process, model and optimizer equal
    to the gathered file."""
    model, optimizer = _model_and_optimizer(fsdp_run / "fsdp.yaml")
    load_sharded(folder(fsdp_run / "fsdp", 4), model, optimizer)
    saved = load_checkpoint(folder(fsdp_run / "fsdp", 4))
    assert_state_equal(model.state_dict(), saved["model"], "model")
    assert_state_equal(optimizer.state_dict()["state"], saved["optimizer"]["state"], "optimizer")


LOAD_IN_JOB = r"""
import json, sys, torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from speedtronic.checkpoint import is_sharded, load_checkpoint, load_sharded, load_whole
from speedtronic.config import load_config
from speedtronic.optimizers import build_optimizer
from speedtronic.parallel import end_process, start_world, world_from_env
from speedtronic.registry import build_model
from speedtronic.schedules import build_scheduler
cfg, source, out = sys.argv[1:]
config = load_config(cfg)
world = world_from_env(); world.parallel = config.parallel
start_world(world, torch.device("cpu"))
model = world.shard(build_model(config.model))
optimizer = build_optimizer(model, config, torch.device("cpu"))
# as the runtime does: the groups carry `initial_lr`, as the saved ones do
build_scheduler(optimizer, config)
if is_sharded(source): load_sharded(source, model, optimizer)
else: load_whole(load_checkpoint(source), model, optimizer)
shards = [type(p).__name__ for p in model.parameters()]
full = StateDictOptions(full_state_dict=True, cpu_offload=True)
weights, moments = get_state_dict(model, optimizer, options=full)
if world.writes: torch.save({"model": weights, "optimizer": moments, "shards": shards}, out)
world.close()
# a process that started a gloo group ends without C++ teardown (see the Parallel chapter)
end_process(0)
"""


@pytest.mark.parametrize("kind", ["sharded", "file"])
def test_one_process_loads_into_two_sharded_ranks(tmp_path, kind):
    """A one-process checkpoint (an fsdp folder, or a single file) loads into a 2-rank sharded job:
    same weights and moments."""
    parallel = FSDP if kind == "sharded" else {"strategy": "ddp"}
    cfg = write_config(
        tmp_path, "one", micro=8, data=DATA, steps=2, every=2, model=MODEL, parallel=parallel
    )
    finish(one_process(cfg))
    source = (
        tmp_path / "one" / "checkpoints" / f"step_{2:012d}.{'dcp' if kind == 'sharded' else 'pt'}"
    )
    script, out = tmp_path / "load.py", tmp_path / "loaded.pt"
    script.write_text(LOAD_IN_JOB)
    job = run_command(
        torchrun_command(
            script,
            write_config(tmp_path, "two", micro=4, data=DATA, model=MODEL, parallel=FSDP),
            source,
            out,
        ),
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert job.returncode == 0, job.stderr[-4000:]
    loaded, saved = torch.load(out, weights_only=True), load_checkpoint(source)
    assert set(loaded["shards"]) == {"DTensor"}
    assert_state_equal(loaded["model"], saved["model"], "model")
    names = [n for g in loaded["optimizer"]["param_groups"] for n in g["params"]]
    for i, name in enumerate(names):
        assert_state_equal(loaded["optimizer"]["state"][name], saved["optimizer"]["state"][i], name)


def test_reshard_after_forward_false_trains_the_same(fsdp_run, tmp_path):
    """Keeping each block's gathered weights from forward to backward changes memory and traffic,
    not the numbers."""
    cfg = write_config(
        tmp_path,
        "kept",
        micro=4,
        data=DATA,
        steps=STEPS,
        every=STEPS,
        model=MODEL,
        parallel={**FSDP, "reshard_after_forward": False},
    )
    finish(torchrun(cfg))
    ref = losses_by_step(fsdp_run / "fsdp.jsonl")
    for step, (loss,) in losses_by_step(tmp_path / "kept.jsonl").items():
        assert loss == pytest.approx(ref[step][0], rel=1e-6, abs=0)


def test_cpu_offload_on_the_cpu_is_refused_once(tmp_path):
    cfg = write_config(
        tmp_path,
        "offload",
        micro=4,
        data=DATA,
        steps=2,
        model=MODEL,
        parallel={**FSDP, "cpu_offload": True},
    )
    line = refused(torchrun(cfg))
    assert line.startswith(
        "speedtronic: error: [rank 0 of 2] parallel.cpu_offload: moves a GPU's shards to the CPU, "
        "and this "
        "job trains on cpu; set parallel.cpu_offload: false"
    ), line


def test_muon_is_refused_before_the_job_joins(tmp_path):
    cfg = write_config(
        tmp_path, "muon", micro=4, data=DATA, steps=2, optimizer={"name": "muon"}, parallel=FSDP
    )
    out, err = torchrun(cfg).communicate(timeout=240)
    errors = [l for l in err.splitlines() if "speedtronic: error:" in l]
    assert errors and all(
        l.startswith("speedtronic: error: [rank")
        and "optimizer.name: muon orthogonalises each whole weight matrix" in l
        for l in errors
    ), err[-3000:]
    assert not (tmp_path / "muon" / "checkpoints").exists()


# ---------------------------------------------------------------- bench/gpu_check.py: ready for a
# GPU, smoke-tested here


def test_gpu_check_skips_every_row_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: run bench/gpu_check.py itself")
    proc = subprocess.run(
        [sys.executable, "bench/gpu_check.py"],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("speedtronic GPU check on no CUDA device")
    rows = lines[1:]
    assert len(rows) == 9 and all(r.endswith("skipped: no CUDA") for r in rows), proc.stdout
    assert [r.split("  ")[0] for r in rows][:2] == ["bf16 autocast", "fp16 + GradScaler"]


def test_gpu_check_world_of_one_runs_on_the_cpu(tmp_path):
    """The DDP/FSDP rows' code (a process group of world 1, Trainer on it, checkpoint written and
    loaded back) with gloo."""
    code = (
        "import sys; sys.path.insert(0, 'bench'); from pathlib import Path; import gpu_check\n"
        f"print(gpu_check.train_on_world(Path({str(tmp_path)!r}), 'fsdp', 'fsdp', 'cpu'))\n"
        f"print(gpu_check.train_on_world(Path({str(tmp_path)!r}), 'ddp', 'ddp', 'cpu'))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the runs' own log lines aside
    fsdp, ddp = [line for line in proc.stdout.splitlines() if " | INFO | " not in line]
    assert fsdp.startswith("DTensor params, 6 steps") and fsdp.endswith(
        "step_000000000006.dcp loads back"
    ), fsdp
    assert ddp.startswith("Parameter params, 6 steps") and ddp.endswith(
        "step_000000000006.pt loads back"
    ), ddp


def test_a_sharded_index_that_runs_code_is_refused_by_every_reader(fsdp_run, tmp_path):
    """A crafted `.metadata` (a dotted global, then the real index): resume on 2 ranks, generate,
    export, consolidate never run it."""
    import shutil

    out = tmp_path / "fsdp"
    shutil.copytree(fsdp_run / "fsdp", out)
    cfg = write_config(
        tmp_path, "fsdp", micro=4, data=DATA, steps=STEPS + 2, every=2, model=MODEL, parallel=FSDP
    )
    newest = folder(out, STEPS)
    marker = tmp_path / "marker"
    (newest / ".metadata").write_bytes(
        dotted_payload((newest / ".metadata").read_bytes(), f"touch {marker}")
    )
    runs = {
        "consolidate": ["consolidate", str(newest)],
        "export": ["export", "--checkpoint", str(newest), "--to", str(tmp_path / "hf")],
        "generate": [
            "generate",
            "--checkpoint",
            str(newest),
            "--prompt",
            "a",
            "--max-new-tokens",
            "2",
        ],
    }
    for what, args in runs.items():
        proc = run_command(
            [sys.executable, "-m", "speedtronic", *args],
            cwd=ROOT,
            env=env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, (what, proc.stderr[-2000:])
        assert "is unsafe to load" in proc.stderr and "os.system" in proc.stderr, (
            what,
            proc.stderr[-2000:],
        )
        assert not marker.exists(), what
    job_out, job_err = torchrun(cfg, "--resume").communicate(timeout=240)
    assert not marker.exists(), job_err[-3000:]
    assert "is unsafe to load" in job_out + job_err, job_err[-3000:]
