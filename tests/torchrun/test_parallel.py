"""`speedtronic train` under torchrun: real processes on CPU (gloo), started with `python -m
torch.distributed.run`.

- 2 ranks x micro batch 4 reproduce 1 process x micro batch 8 (same per-step losses, same final
  weights);
- kill -9 of one rank stops the job; resuming from the last checkpoint reproduces the uninterrupted
  run;
- SIGTERM to the job saves the last completed step once; resuming reproduces the uninterrupted run;
- a data error on one rank stops the job with that rank's error on the console;
- the job's configuration is checked before any process group is joined (the global batch);
- a DiLoCo node may be a torchrun job: rank 0 runs its coordinator, every rank ends on the same
  weights;
- the decisions the job takes together give one verdict and one message: a directory another job
  holds or another run's checkpoints are refused by rank 0 for every rank, a resume with a changed
  seed is refused by every rank, the run id is rank 0's, a NaN loss on one rank stops (or, within
  the budget, skips) on every rank at the same step.

The runs are tiny (a one-layer model, a few dozen steps) so the whole file stays around two minutes
on 2 cores.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from conftest import (
    ROOT,
    cli_env,
    communicate_or_dump,
    free_port,
    jsonl_records,
    one_error_line,
    run_command,
    spawn,
    tiny_config,
    torchrun_command,
)
from speedtronic.checkpoint import load_checkpoint
from speedtronic.cli import main
from speedtronic.tokens import TOKEN_FILE_FORMAT

STEPS = 12


def env() -> dict:
    return cli_env(PYTHONHASHSEED="0")


def write_config(
    tmp: Path, name: str, *, micro: int, data: dict, steps: int = STEPS, every: int = 2, **sections
) -> Path:
    raw = {
        "run": {"name": name, "seed": 7, "max_steps": steps, "output_dir": str(tmp / name)},
        "model": {
            "vocab_size": 64,
            "max_seq_len": 16,
            "n_layer": 1,
            "n_head": 2,
            "d_model": 32,
            "d_ff": 64,
            "dropout": 0.0,
        },
        "data": {"block_size": 8, "micro_batch_size": micro, "target_batch_size": 16, **data},
        # eps=1 keeps AdamW's update a smooth function of the gradient (about lr * m for these small
        # gradients): a last-bit difference in a gradient stays a last-bit difference in the weights
        # instead of being blown up to a full step by m / sqrt(v) of a near-zero gradient.
        "optimizer": {"lr": 1e-2, "weight_decay": 0.0, "eps": 1.0, "grad_clip": 1.0},
        "scheduler": {"warmup_steps": 2},
        "precision": {"mode": "fp32"},
        "checkpoint": {"every_steps": every, "keep_last": None},
        "logging": {"json_file": str(tmp / f"{name}.jsonl"), "progress": False, "loss_plot": False},
    }
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def token_file(tmp: Path, blocks: int = 200, bad_block: int | None = None) -> Path:
    """A token file of `blocks` blocks of 9 ids below 64 (its sidecar says vocabulary 64);
    `bad_block` holds id 100."""
    ids = np.random.default_rng(0).integers(0, 64, size=blocks * 9).astype(np.uint16)
    if bad_block is not None:
        ids[bad_block * 9 + 3] = 100
    path = tmp / ("bad.bin" if bad_block is not None else "tokens.bin")
    path.write_bytes(ids.tobytes())
    Path(str(path) + ".json").write_text(
        json.dumps(
            {
                "format": TOKEN_FILE_FORMAT,
                "version": 1,
                "dtype": "uint16",
                "num_tokens": int(ids.size),
                "vocab_size": 64,
            }
        )
    )
    return path


def one_process(cfg: Path, *extra: str) -> subprocess.Popen:
    return spawn(
        [
            sys.executable,
            "-m",
            "speedtronic",
            "train",
            "--config",
            str(cfg),
            "--device",
            "cpu",
            *extra,
        ],
        cwd=ROOT,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def torchrun(cfg: Path, *extra: str, nproc: int = 2) -> subprocess.Popen:
    cmd = torchrun_command(
        "-m", "speedtronic", "train", "--config", cfg, "--device", "cpu", *extra, nproc=nproc
    )
    return spawn(
        cmd, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def finish(proc: subprocess.Popen, timeout: float = 240) -> tuple[str, str]:
    out, err = communicate_or_dump(proc, timeout)
    assert proc.returncode == 0, out[-2000:] + err[-4000:]
    return out, err


records = jsonl_records


def losses_by_step(jsonl: Path) -> dict[int, list[float]]:
    by: dict[int, list[float]] = {}
    for r in records(jsonl):
        by.setdefault(r["step"], []).append(r["loss"])
    return by


def final_state(out: Path, step: int = STEPS) -> dict:
    return load_checkpoint(out / "checkpoints" / f"step_{step:012d}.pt")


def wait_for_step(proc: subprocess.Popen, jsonl: Path, step: int, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(r["step"] >= step for r in records(jsonl)):
            return
        if proc.poll() is not None:
            pytest.fail(f"the job ended before step {step}: {proc.stderr.read()[-3000:]}")
        time.sleep(0.005)
    proc.kill()
    pytest.fail(f"step {step} never appeared in {jsonl}")


def stop_at_step(job: subprocess.Popen, jsonl: Path, step: int) -> None:
    """SIGTERM to `job` once `step` is in `jsonl`; the test fails unless the job then ends within
    120 s."""
    wait_for_step(job, jsonl, step)
    job.send_signal(signal.SIGTERM)
    try:
        job.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        job.kill()
        pytest.fail("the job did not stop after SIGTERM")


def rank_pid(launcher: subprocess.Popen, rank: int) -> int:
    "The pid of the worker process torchrun started for `rank` (a direct child of the launcher)."
    for _ in range(200):
        for task in Path(f"/proc/{launcher.pid}/task").iterdir():
            for pid in (task / "children").read_text().split():
                try:
                    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                except OSError:
                    continue
                if f"RANK={rank}".encode() in environ:
                    return int(pid)
        time.sleep(0.05)
    pytest.fail(f"no worker process for rank {rank}")


# ---------------------------------------------------------------- 2 ranks x 4 == 1 process x 8


def test_two_ranks_reproduce_one_process(tmp_path):
    """Same samples per step: the per-step losses and final weights agree to fp32 reduction-order
    tolerance.

    Why a tolerance at all: one process sums the per-sample gradient contributions of 8 samples
    inside each matmul; two ranks sum 4 each and gloo adds (then DDP halves) the two partial
    gradients. Both are the same real number rounded in a different order, so gradients differ in
    their last bits (fp32: u = 2**-24 ~ 6e-8 relative, a few u per add over a few hundred terms,
    i.e. about 1e-6 of the gradient at worst). With lr = 1e-2, 12 steps and a clipped gradient norm
    <= 1, and AdamW's eps=1 making the update a 1-Lipschitz (times lr) function of the gradient, the
    weights can drift by at most ~12 * 1e-2 * 1e-6 ~ 1e-7 plus an ulp of the weight (~1e-8 here). We
    allow atol = 1e-6 on the weights and rtol = 1e-6 on the losses (about 8 fp32 ulps of a loss near
    4). A wrong split — a sample missing, read twice or given to the wrong step — moves a loss by
    ~1e-3 and the weights by ~1e-4, far outside.
    """
    # 40 samples: 2 steps and a dropped tail per pass
    data = {
        "synthetic": True,
        "num_tokens": 40,
        "shuffle": True,
    }
    one_cfg = write_config(tmp_path, "one", micro=8, data=data)
    two_cfg = write_config(tmp_path, "two", micro=4, data=data)
    one_out, _ = finish(one_process(one_cfg))
    two_out, _ = finish(torchrun(two_cfg))
    one_losses, two_losses = (
        losses_by_step(tmp_path / "one.jsonl"),
        losses_by_step(tmp_path / "two.jsonl"),
    )
    assert sorted(two_losses) == list(range(1, STEPS + 1))
    assert all(len(v) == 1 for v in two_losses.values()), "only rank 0 writes the JSONL"
    for step, (loss,) in two_losses.items():
        assert loss == pytest.approx(one_losses[step][0], rel=1e-6, abs=0), step
    a, b = final_state(tmp_path / "one"), final_state(tmp_path / "two")
    for name, tensor in a["model"].items():
        torch.testing.assert_close(b["model"][name], tensor, rtol=0, atol=1e-6, msg=name)
    assert (
        (b["samples"], b["tokens"]) == (a["samples"], a["tokens"]) == (STEPS * 16, STEPS * 16 * 8)
    )
    assert b["rng"]["world_size"] == 2 and len(b["rng"]["ranks"]) == 2  # every rank's RNG ...
    assert b["data"] == a["data"]  # ... and the job's data position: one process's
    assert two_out.count("completed steps=") == 1  # rank 0 prints the line
    assert (
        two_out.splitlines()[-1].split(" loss=")[0] == one_out.splitlines()[-1].split(" loss=")[0]
    )
    start = records(tmp_path / "two.jsonl", "train_start")[0]
    assert (start["world_size"], start["accumulation_steps"]) == (2, 2)


# ---------------------------------------------------------------- kill -9 and SIGTERM, then resume

TOKEN_STEPS = 16


@pytest.fixture(scope="module")
def token_runs(tmp_path_factory):
    """The uninterrupted 2-rank run on a shuffled token file read by 2 workers per rank: per-step
    losses and final model."""
    tmp = tmp_path_factory.mktemp("tokens")
    data = {
        "token_file": str(token_file(tmp)),
        "shuffle": True,
        "num_workers": 2,
        "synthetic": False,
    }
    ref = write_config(tmp, "ref", micro=4, data=data, steps=TOKEN_STEPS, every=TOKEN_STEPS)
    finish(torchrun(ref))
    losses = {s: v[-1] for s, v in losses_by_step(tmp / "ref.jsonl").items()}
    assert sorted(losses) == list(range(1, TOKEN_STEPS + 1))
    return tmp, data, losses, final_state(tmp / "ref", TOKEN_STEPS)["model"]


def assert_same_as_reference(tmp: Path, name: str, ref_losses: dict, ref_model: dict) -> None:
    got = losses_by_step(tmp / f"{name}.jsonl")
    assert sorted(got) == list(range(1, TOKEN_STEPS + 1))
    for step, values in got.items():  # the records of the stopped job and of the resumed one
        assert all(v == ref_losses[step] for v in values), (step, values, ref_losses[step])
    model = final_state(tmp / name, TOKEN_STEPS)["model"]
    for key, tensor in ref_model.items():
        assert torch.equal(model[key], tensor), key


def test_kill_one_rank_then_resume(token_runs):
    tmp, data, ref_losses, ref_model = token_runs
    cfg = write_config(tmp, "killed", micro=4, data=data, steps=TOKEN_STEPS, every=3)
    job = torchrun(cfg)
    wait_for_step(job, tmp / "killed.jsonl", 7)
    os.kill(rank_pid(job, 1), signal.SIGKILL)
    try:
        _, err = job.communicate(timeout=120)  # the job stops: no hung collective
    except subprocess.TimeoutExpired:
        job.kill()
        pytest.fail("the job did not stop after one rank was killed")
    assert job.returncode != 0
    assert "SIGKILL" in err or "Signal 9" in err, err[-3000:]
    saved = sorted(p.name for p in (tmp / "killed" / "checkpoints").glob("step_*.pt"))
    assert saved and saved[-1] < f"step_{TOKEN_STEPS:012d}.pt"
    finish(torchrun(cfg, "--resume"))
    assert_same_as_reference(tmp, "killed", ref_losses, ref_model)


def test_sigterm_saves_once_then_resume(token_runs):
    tmp, data, ref_losses, ref_model = token_runs
    cfg = write_config(tmp, "stopped", micro=4, data=data, steps=TOKEN_STEPS, every=100)
    job = torchrun(cfg)
    stop_at_step(job, tmp / "stopped.jsonl", 5)
    saves = records(tmp / "stopped.jsonl", "checkpoint")
    assert len(saves) == 1, saves  # once, by rank 0
    last = max(r["step"] for r in records(tmp / "stopped.jsonl"))
    assert saves[0]["step"] == last and last < TOKEN_STEPS  # the last completed step
    finish(torchrun(cfg, "--resume"))
    assert_same_as_reference(tmp, "stopped", ref_losses, ref_model)


# ---------------------------------------------------------------- a failure on one rank


def test_a_data_error_on_one_rank_stops_the_job(tmp_path):
    # groups of 8 blocks in order: rank 1 reads blocks 4-7 of each group; block 8 * 5 + 5 is read in
    # step 3
    bad = token_file(tmp_path, blocks=80, bad_block=45)
    cfg = write_config(tmp_path, "bad", micro=4, data={"token_file": str(bad), "synthetic": False})
    job = torchrun(cfg)
    try:
        _, err = job.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        job.kill()
        pytest.fail("the job did not stop after a rank failed")
    assert job.returncode != 0
    assert (
        "speedtronic: error: [rank 1 of 2] data.token_file" in err and "holds token id 100" in err
    ), err[-4000:]
    saved = sorted(p.name for p in (tmp_path / "bad" / "checkpoints").glob("step_*.pt"))
    assert saved == ["step_000000000002.pt"]  # saved work intact, nothing half-written


# ---------------------------------------------------------------- one verdict for the job


def job_errors(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("speedtronic: error:")]


def exit_codes(err: str) -> dict[int, str]:
    "Each failed rank's exit code, from torchrun's failure summary."
    return {
        int(rank): code
        for rank, code in re.findall(
            r"rank\s*:\s*(\d+) \(local_rank.*\n\s*exitcode\s*:\s*(-?\d+)", err
        )
    }


def refused(proc: subprocess.Popen) -> str:
    "The one error line of a job every rank of which stopped with exit code 2."
    _, err = proc.communicate(timeout=120)
    # 2: handled, not a traceback
    assert proc.returncode != 0 and exit_codes(err) == {0: "2", 1: "2"}, err[-4000:]
    (line,) = job_errors(err)
    return line


JOB_SCRIPT = """
import json, torch
from speedtronic.parallel import end_process, start_world, world_from_env
w = start_world(world_from_env(), torch.device("cpu"))
def outcome(fn):
    try: return ["ok", fn()]
    except Exception as e: return [type(e).__name__, str(e), getattr(e, "reporting_rank", None)]
out = {"rank": w.rank, "share": w.share(f"id-of-rank-{w.rank}"),
       "writer_fails": outcome(lambda: w.on_writer(lambda: int("x"))),
       "rank1_fails": outcome(lambda: w.on_every_rank(lambda: 1 / (w.rank - 1))),
       "all_fail": outcome(lambda: w.on_every_rank(lambda: [][w.rank])),
       "none_fail": outcome(lambda: w.on_every_rank(lambda: w.rank))}
import os, pathlib
# one file per rank: lines on a shared stdout can interleave
pathlib.Path(os.environ["RANK_OUT"], f"rank{w.rank}.json").write_text(json.dumps(out))
w.close()
# a process that started a gloo group ends without C++ teardown (see the Parallel chapter)
end_process(0)
"""


def test_raise_together_gives_every_rank_one_verdict(tmp_path):
    """Between two real processes: the lowest failing rank raises (and reports) its own error, the
    others a JobError."""
    script = tmp_path / "job.py"
    script.write_text(JOB_SCRIPT)
    cmd = torchrun_command(script)
    proc = run_command(
        cmd,
        cwd=ROOT,
        env={**env(), "RANK_OUT": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["share"] for r in ranks] == ["id-of-rank-0", "id-of-rank-0"]
    assert ranks[0]["writer_fails"][0::2] == ["ValueError", 0] and ranks[1]["writer_fails"][
        0::2
    ] == ["JobError", 0]
    assert ranks[1]["writer_fails"][1].startswith("rank 0 stopped the job: invalid literal")
    assert ranks[0]["rank1_fails"] == ["JobError", "rank 1 stopped the job: division by zero", 1]
    assert ranks[1]["rank1_fails"] == ["ZeroDivisionError", "division by zero", 1]
    assert [r["all_fail"][0::2] for r in ranks] == [["IndexError", 0], ["IndexError", 0]]
    assert [r["none_fail"] for r in ranks] == [["ok", 0], ["ok", 1]]


def test_a_used_directory_is_refused_once_for_the_job(tmp_path):
    data = {"synthetic": True, "num_tokens": 40}
    busy = write_config(tmp_path, "busy", micro=4, data=data, steps=100_000, every=100_000)
    first = torchrun(busy)
    try:
        wait_for_step(first, tmp_path / "busy.jsonl", 2)
        run_id = records(tmp_path / "busy.jsonl")[0]["run_id"]
        line = refused(torchrun(busy))  # a second job on the same directory
        assert (
            line.startswith("speedtronic: error: [rank 0 of 2] run.output_dir")
            and "is in use by another training process" in line
        )
        assert f"run {run_id} (pid " in line, line
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=120)
    jsonl, ck = tmp_path / "busy.jsonl", tmp_path / "busy" / "checkpoints"
    lines = [json.loads(l) for l in jsonl.read_text().splitlines()]
    assert {r["run_id"] for r in lines} == {run_id}  # one run id, nothing of the refused job
    # SIGTERM: the last completed step, once
    assert len([r for r in lines if r["event"] == "checkpoint"]) == 1
    assert json.loads((ck / "latest.json").read_text())["run_id"] == run_id
    assert not (tmp_path / "busy" / ".speedtronic.lock").exists()  # released on exit

    short = write_config(tmp_path, "busy", micro=4, data=data, steps=4, every=2).rename(
        tmp_path / "short.yaml"
    )
    line = refused(torchrun(short))  # a fresh job into the used directory
    assert (
        f"already holds checkpoints of run {run_id}" in line
        and "--resume" in line
        and "--overwrite" in line
    ), line
    reseeded = write_config(tmp_path, "busy", micro=4, data=data, run={"seed": 8})
    line = refused(torchrun(reseeded, "--resume"))  # a resume every rank refuses
    assert "run.seed: saved 7, now 8" in line, line
    assert {r["run_id"] for r in records(jsonl)} == {run_id}  # the refused jobs wrote nothing


NAN_MODEL = """
import os, torch
from torch import nn
from speedtronic.registry import register_model

class NanOnOneRank(nn.Module):
    '''A tiny language model whose loss is NaN on rank 1 at the forward calls in $NAN_CALLS, with
    finite gradients.'''
    def __init__(self, vocab_size=64, **_):
        super().__init__()
        self.emb, self.head, self.calls = nn.Embedding(vocab_size, 16), nn.Linear(16, vocab_size), 0
        calls = {int(c) for c in os.environ.get("NAN_CALLS", "").split(",") if c}
        self.bad = calls if os.environ.get("RANK") == "1" else set()
    def forward(self, input_ids, labels=None, **_):
        self.calls += 1
        logits = self.head(self.emb(input_ids))
        targets = labels if labels is not None else input_ids
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return {"loss": loss + float("nan") if self.calls in self.bad else loss}

register_model("nan_on_one_rank", lambda **kw: NanOnOneRank(**kw))
"""


def nan_job(
    tmp_path: Path, name: str, nan_calls: str, **optimizer
) -> tuple[Path, subprocess.Popen]:
    (tmp_path / "nan_models.py").write_text(NAN_MODEL)
    cfg = write_config(
        tmp_path,
        name,
        micro=4,
        data={"synthetic": True, "num_tokens": 40},
        steps=6,
        every=100,
        model={"name": "nan_on_one_rank", "imports": ["nan_models"]},
        optimizer=optimizer,
    )
    cmd = torchrun_command("-m", "speedtronic", "train", "--config", cfg, "--device", "cpu")
    job_env = {**env(), "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}", "NAN_CALLS": nan_calls}
    return cfg, spawn(
        cmd, cwd=ROOT, env=job_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def test_a_nan_loss_on_one_rank_stops_every_rank_with_one_message(tmp_path):
    # 2 microbatches per rank and update: forward call 5 of rank 1 is in step 3; its gradients stay
    # finite
    _, job = nan_job(tmp_path, "nan", "5")
    try:
        line = refused(job)
    except subprocess.TimeoutExpired:
        job.kill()
        pytest.fail("the job hung after a NaN loss on one rank")
    # the job's loss, on rank 0
    assert line.startswith("speedtronic: error: [rank 0 of 2] step 3: the loss is nan"), line
    assert "optimizer.max_nonfinite_skips" in line
    assert sorted(losses_by_step(tmp_path / "nan.jsonl")) == [1, 2]
    saves = records(tmp_path / "nan.jsonl", "checkpoint")
    assert [s["step"] for s in saves] == [2]  # the last good step, saved once by the job
    state = final_state(tmp_path / "nan", 2)
    assert all(torch.isfinite(t).all() for t in state["model"].values())


def test_a_nan_loss_on_one_rank_is_skipped_by_every_rank_within_the_budget(tmp_path):
    _, job = nan_job(tmp_path, "skip", "5", max_nonfinite_skips=1)
    try:
        out, _ = finish(job, timeout=120)
    except subprocess.TimeoutExpired:
        job.kill()
        pytest.fail("the ranks disagreed about a NaN update and the job hung")
    skipped = records(tmp_path / "skip.jsonl", "optimizer_step_skipped")
    assert [(r["step"], r["reason"]) for r in skipped] == [(3, "nonfinite_loss")]
    assert (
        sorted(losses_by_step(tmp_path / "skip.jsonl")) == list(range(1, 7))
        and out.count("completed steps=6") == 1
    )


# -------------------------------------------------------------- the job is checked before it starts


def as_rank(monkeypatch, rank: int = 0, size: int = 2) -> None:
    for key, value in {
        "WORLD_SIZE": size,
        "RANK": rank,
        "LOCAL_RANK": rank,
        "LOCAL_WORLD_SIZE": size,
    }.items():
        monkeypatch.setenv(key, str(value))


def test_global_batch_that_does_not_divide(tmp_path, monkeypatch, capsys):
    cfg = write_config(
        tmp_path, "odd", micro=3, data={"synthetic": True, "num_tokens": 40, "target_batch_size": 9}
    )
    as_rank(monkeypatch)
    assert main(["train", "--config", str(cfg), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert (
        "[rank 0 of 2] data.target_batch_size (9) is the global batch" in err
        and "(3 × 2 = 6)" in err
    ), err
    assert not (tmp_path / "odd").exists()
    assert main(["validate", "--deep", "--config", str(cfg), "--device", "cpu"]) == 2
    out, err = capsys.readouterr()
    assert "data.target_batch_size (9)" in err and "micro_batch_size: 3" in out
    as_rank(monkeypatch, rank=1)
    assert main(["validate", "--deep", "--config", str(cfg), "--device", "cpu"]) == 2
    assert capsys.readouterr() == ("", "")  # rank 0 speaks for the job


def summary_of(err: str) -> str:
    "torchrun's failure summary: from its `... FAILED` title to the end of stderr."
    start = err.find(" FAILED\n")
    assert start >= 0, err[-4000:]
    return err[start:]


def test_a_batch_that_does_not_divide_under_torchrun_says_so_once_per_rank(tmp_path):
    """Real torchrun, 2 ranks: each rank says the error in one line at most, exits 2, and torchrun's
    summary holds no traceback of ours."""
    cfg = write_config(
        tmp_path, "odd", micro=3, data={"synthetic": True, "num_tokens": 40, "target_batch_size": 9}
    )
    job = torchrun(cfg)
    _, err = communicate_or_dump(job, 120)
    codes = exit_codes(err)
    # the rank that finds it first exits 2; torchrun then ends a rank still starting (SIGTERM, 143)
    refusing = list(codes.values()).count("2")
    assert job.returncode != 0 and refusing >= 1, err[-4000:]
    assert set(codes.values()) <= {"2", "143"}, err[-4000:]
    lines = job_errors(err)  # the check comes before the ranks meet: each rank finds it alone
    ranks = [re.match(r"speedtronic: error: \[rank (\d) of 2\] (.*)", l) for l in lines]
    assert all(ranks) and len({m[1] for m in ranks}) == len(lines) >= 1, lines
    for rank, what in {int(m[1]): m[2] for m in ranks}.items():
        if codes[rank] == "2":  # a rank that refused says why
            assert "data.target_batch_size (9) is the global batch" in what, (rank, codes, lines)
        else:  # one torchrun ended first (143) may only say that it was
            assert what == "terminated (SIGTERM)", (rank, codes, lines)
    summary = summary_of(err)
    # each failed rank's entry: its message, once
    assert summary.count("data.target_batch_size (9) is the global batch") == refusing, summary
    ours = str(ROOT / "speedtronic")
    assert ours not in err and "ConfigError" not in err, summary  # no frame or type name of ours
    assert not (tmp_path / "odd").exists()


DRIVER = """
import os, sys, torch, yaml
from speedtronic.runtime import build_runtime, close_logger
from speedtronic.parallel import end_process
trainer, _ = build_runtime(yaml.safe_load(open(sys.argv[1])), device="cpu")
try: trainer.fit()
finally: close_logger(trainer.logger); trainer.run_claim.release()
torch.save(trainer.model.state_dict(), os.path.join(sys.argv[2], f"rank{trainer.world.rank}.pt"))
trainer.world.close()
end_process(0)
"""


def diloco_node(tmp: Path, name: str, role: str, index: int, micro: int) -> Path:
    return write_config(
        tmp,
        name,
        micro=micro,
        steps=20,
        every=10,
        data={"synthetic": True, "num_tokens": 400, "target_batch_size": 4},
        logging={"every_steps": 5},
        distributed={
            "enabled": True,
            "role": role,
            "node_id": name,
            "transport": "directory",
            "repo_id": str(tmp / "repo"),
            "inner_steps": 5,
            "poll_interval": 0.2,
            "shard_count": 2,
            "shard_index": index,
            "expected_nodes": 2,
            "final_round_timeout": 120,
        },
    )


def test_a_diloco_node_can_be_a_torchrun_job(tmp_path):
    """A 2-rank DiLoCo master next to a one-process worker: every delta folded once, both ranks end
    on the same weights."""
    from speedtronic.distributed import SharedDirectory
    from speedtronic.distributed.tensors import GLOBAL_MODEL_PATH, load_safetensors

    master, worker = (
        diloco_node(tmp_path, "master", "master", 0, micro=2),
        diloco_node(tmp_path, "worker", "worker", 1, micro=4),
    )
    (tmp_path / "driver.py").write_text(DRIVER)
    job = spawn(
        torchrun_command(tmp_path / "driver.py", master, tmp_path),
        cwd=ROOT,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 90
    while (
        not records(tmp_path / "master.jsonl", "train_start")
        and job.poll() is None
        and time.monotonic() < deadline
    ):
        time.sleep(0.1)  # the master creates the repository
    finish(one_process(worker), timeout=90)
    finish(job, timeout=60)  # bounded: a hung collective fails the test
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    final = load_safetensors(tmp_path / "repo" / GLOBAL_MODEL_PATH)
    for key, tensor in final.items():  # the final global, on both ranks
        assert torch.equal(rank0[key], tensor) and torch.equal(rank1[key], tensor), key
    assert all(
        torch.equal(rank0[k], v) for k, v in final_state(tmp_path / "master", 20)["model"].items()
    )
    folded = [
        tuple(x)
        for e in records(tmp_path / "master.jsonl", "outer_step")
        for x in e.get("folded", [])
    ]
    assert folded and len(folded) == len(set(folded)), folded  # no delta folded twice
    ledger = SharedDirectory(tmp_path / "repo").state().extras["ledger"]
    for name in ("master", "worker"):
        uploaded = {e["step"] for e in records(tmp_path / f"{name}.jsonl", "delta_uploaded")}
        assert max(uploaded) == max(ledger[name]["sessions"].values()) == 20, (
            name,
            uploaded,
            ledger[name],
        )
    assert records(tmp_path / "master.jsonl", "train_start")[0]["world_size"] == 2


def test_one_process_checkpoint_is_resumed_by_a_job(tmp_path):
    """A job continues a one-process run where it stopped: the data position is the job's
    (tests/test_elastic_resume.py: exactly)."""
    data = {"synthetic": True, "num_tokens": 40}
    single = write_config(tmp_path, "single", micro=8, data=data, steps=3)
    finish(one_process(single))
    # the same output directory, micro 4 per rank
    job_cfg = write_config(tmp_path, "single", micro=4, data=data, steps=6)
    finish(torchrun(job_cfg, "--resume"))
    assert sorted(losses_by_step(tmp_path / "single.jsonl")) == list(range(1, 7))
    state = final_state(tmp_path / "single", 6)
    assert (state["samples"], state["rng"]["world_size"]) == (6 * 16, 2)


# -------------------------------------------------- loaders of ranks x workers (no torchrun needed)


def test_token_file_ranks_with_workers_split_the_single_loader_batches(tmp_path):
    """2 ranks x 2 workers x micro 4 hold, batch for batch, the halves of 1 process x micro 8
    without workers (shuffled, past an epoch)."""
    from speedtronic.data import ResumableDataLoader, TokenFileDataset, infinite_batches

    path = token_file(tmp_path, blocks=200)

    def loader(micro, rank, world):
        return ResumableDataLoader(
            TokenFileDataset(path, 8, shuffle=True, seed=3),
            batch_size=micro,
            num_workers=2 if world > 1 else 0,
            rank=rank,
            world_size=world,
        )

    def head(lo, n):
        it = infinite_batches(lo)
        return [next(it)["input_ids"] for _ in range(n)]

    n = 30  # 25 batches of 8 per pass: crosses into the next
    single = head(loader(8, 0, 1), n)
    ranks = [head(loader(4, r, 2), n) for r in (0, 1)]
    for i in range(n):
        assert torch.equal(torch.cat([ranks[0][i], ranks[1][i]]), single[i]), i


def test_text_ranks_with_workers_split_the_single_loader_batches(tmp_path):
    """A text stream of several segments read by 2 ranks x 2 workers x micro 2: batch for batch the
    halves of 1 process x micro 4."""
    from speedtronic.data import ResumableDataLoader, TextFileTokenDataset

    text = tmp_path / "corpus.txt"
    text.write_text(
        "".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(400))
    )

    def batches(micro, rank, world, workers):
        ds = TextFileTokenDataset(text, 16, segment_bytes=2000)
        assert len(ds.segments) > 4
        lo = ResumableDataLoader(
            ds, batch_size=micro, num_workers=workers, rank=rank, world_size=world
        )
        return [b["input_ids"] for b in lo]

    single = batches(4, 0, 1, 0)
    r0, r1 = batches(2, 0, 2, 2), batches(2, 1, 2, 2)
    assert len(r0) == len(r1) == len(single) > 100
    for i, (a, b) in enumerate(zip(r0, r1)):
        assert torch.equal(torch.cat([a, b]), single[i]), i


# ------------------------------------------ torchrun's variables without torchrun, a rank that dies


def stray_env(tmp: Path, rank: int, port: int, **extra: str) -> dict:
    "The environment of a process that has a torchrun job's variables but no torchrun."
    base = {
        k: v
        for k, v in env().items()
        if k
        not in (
            "WORLD_SIZE",
            "RANK",
            "LOCAL_RANK",
            "LOCAL_WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
            "TORCHELASTIC_RUN_ID",
            "TORCHELASTIC_USE_AGENT_STORE",
        )
    }
    return {
        **base,
        "WORLD_SIZE": "2",
        "RANK": str(rank),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        **extra,
    }


def stray_train(tmp: Path, environ: dict, steps: int = 4) -> subprocess.Popen:
    cfg = tiny_config(tmp, max_steps=steps, every_steps=1000, data={"target_batch_size": 4})
    return spawn(
        [sys.executable, "-m", "speedtronic", "train", "--config", str(cfg), "--device", "cpu"],
        cwd=tmp,
        env=environ,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.parametrize(
    "rank,waits_for", [(1, "is waiting for rank 0 at 127.0.0.1:"), (0, "is waiting at 127.0.0.1:")]
)
def test_stray_torchrun_variables_give_up_with_one_error(tmp_path, rank, waits_for):
    port = free_port()
    proc = stray_train(tmp_path, stray_env(tmp_path, rank, port, SPEEDTRONIC_CONNECT_TIMEOUT="4"))
    out, err = proc.communicate(timeout=120)
    result = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    line = one_error_line(
        result, f"127.0.0.1:{port}", "unset WORLD_SIZE, RANK, MASTER_ADDR, MASTER_PORT", "4 s"
    )
    assert (
        [l for l in err.splitlines() if "is waiting" in l]
        == [l for l in err.splitlines() if waits_for in l]
        != []
    ), err
    assert len([l for l in err.splitlines() if "is waiting" in l]) == 1 and "frame #" not in err, (
        err[-3000:]
    )
    assert not (tmp_path / "out").exists(), line  # refused before any directory was made


def test_stray_world_size_without_master_addr(tmp_path):
    environ = stray_env(tmp_path, 1, 1)
    del environ["MASTER_ADDR"]
    proc = stray_train(tmp_path, environ)
    out, err = proc.communicate(timeout=120)
    one_error_line(
        subprocess.CompletedProcess(proc.args, proc.returncode, out, err),
        "$MASTER_ADDR is not set",
        "$WORLD_SIZE=2",
        "unset WORLD_SIZE, RANK, MASTER_PORT",
    )


def test_stray_variables_behind_a_batch_that_cannot_split_are_named(tmp_path):
    # The default global batch cannot split over the 2 "processes" a stray WORLD_SIZE makes: the
    # message says to unset them.
    cfg = tiny_config(tmp_path, max_steps=2)
    proc = run_command(
        [sys.executable, "-m", "speedtronic", "train", "--config", str(cfg), "--device", "cpu"],
        cwd=tmp_path,
        env=stray_env(tmp_path, 1, free_port()),
        capture_output=True,
        text=True,
        timeout=120,
    )
    line = one_error_line(
        proc,
        "data.target_batch_size (2) is the global batch",
        "$WORLD_SIZE=2 was not set by torchrun",
        "unset WORLD_SIZE, RANK, MASTER_ADDR, MASTER_PORT (left in this environment)",
    )
    assert not (tmp_path / "out").exists(), line


@pytest.mark.parametrize(
    "rank,sig,code,said",
    [
        (1, signal.SIGTERM, 143, None),
        (0, signal.SIGTERM, 143, "[rank 0 of 2] terminated (SIGTERM)"),
        (0, signal.SIGINT, 130, "[rank 0 of 2] interrupted"),
    ],
)
def test_a_signal_ends_the_wait_to_join(tmp_path, rank, sig, code, said):
    "SIGTERM and Ctrl-C end the wait at once (rank 0 prints for the job; another rank only exits)."
    # the default wait: minutes
    proc = stray_train(tmp_path, stray_env(tmp_path, rank, free_port()))
    for line in proc.stderr:  # blocks until the process says it waits
        if "is waiting" in line:
            break
    else:
        pytest.fail(f"no waiting line; exit {proc.wait()}")
    proc.send_signal(sig)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"{sig.name} did not end the wait")
    err = proc.stderr.read()  # the rest, after the lines read above
    assert proc.returncode == code and "Traceback" not in err, (proc.returncode, err[-3000:])
    if said:
        assert err.splitlines() == [f"speedtronic: error: {said}"], err[-3000:]


def test_a_rank_that_dies_is_named_by_the_survivor(tmp_path):
    port = free_port()
    ranks = [
        stray_train(tmp_path / str(r), stray_env(tmp_path, r, port), steps=100000)
        for r in (0, 1)
        if (tmp_path / str(r)).mkdir() is None
    ]
    wait_for_step(ranks[0], tmp_path / "0" / "metrics.jsonl", 3)
    ranks[1].kill()
    ranks[1].communicate(timeout=60)
    try:
        out, err = ranks[0].communicate(timeout=120)
    except subprocess.TimeoutExpired:
        ranks[0].kill()
        pytest.fail("rank 0 did not stop after rank 1 died")
    one_error_line(
        subprocess.CompletedProcess(ranks[0].args, ranks[0].returncode, out, err),
        "[rank 0 of 2]",
        "rank 1 of this torchrun job died or lost its connection",
        "--resume continues",
    )
    assert "pair.cc" not in err and "GLHF" not in err, err[-3000:]


def test_stray_rank_0_on_a_busy_port(tmp_path):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = stray_train(tmp_path, stray_env(tmp_path, 0, port, SPEEDTRONIC_CONNECT_TIMEOUT="4"))
        out, err = proc.communicate(timeout=120)
    one_error_line(
        subprocess.CompletedProcess(proc.args, proc.returncode, out, err),
        f"rank 0 cannot listen at 127.0.0.1:{port} ($MASTER_ADDR:$MASTER_PORT): the port is in use",
        "unset WORLD_SIZE",
    )
