"""`--resume` with a changed YAML: a changed setting is applied and reported, or refused with the
key, the saved and the new value; other data (another file, or the same path with new content) is
refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import run_command

ROOT = Path(__file__).resolve().parents[2]
WORDS = "the quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun".split()


def corpus(path: Path, seed: int = 0) -> Path:
    import random

    rng = random.Random(seed)
    path.write_text(
        "\n".join(" ".join(rng.choice(WORDS) for _ in range(10)) for _ in range(300)) + "\n"
    )
    return path


def write(tmp: Path, name: str = "cfg.yaml", **sections) -> Path:
    raw = {
        "run": {"name": "tiny", "seed": 3, "max_steps": 2, "output_dir": str(tmp / "out")},
        "model": {
            "vocab_size": 256,
            "max_seq_len": 16,
            "n_layer": 1,
            "n_head": 2,
            "d_model": 32,
            "d_ff": 64,
        },
        "data": {
            "text_path": str(tmp / "a.txt"),
            "block_size": 16,
            "micro_batch_size": 2,
            "target_batch_size": 2,
        },
        "optimizer": {"lr": 1e-3},
        "scheduler": {"name": "constant", "warmup_steps": 0},
        "precision": "fp32",
        "checkpoint": {"every_steps": 2, "keep_last": 3},
        "logging": {"progress": False, "loss_plot": False, "json_file": str(tmp / "metrics.jsonl")},
    }
    for k, v in sections.items():
        raw[k] = {**raw.get(k, {}), **v}
    path = tmp / name
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return run_command(
        [sys.executable, "-m", "speedtronic", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def ok(proc):
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def error_line(proc) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("speedtronic: error:")]
    assert len(errors) == 1, proc.stderr
    return errors[0]


def steps(jsonl: Path) -> list[dict]:
    return [
        r for r in map(json.loads, jsonl.read_text().splitlines()) if r["event"] == "train_step"
    ]


@pytest.fixture
def first_run(tmp_path):
    corpus(tmp_path / "a.txt")
    ok(cli("train", "--config", str(write(tmp_path)), "--device", "cpu", cwd=tmp_path))
    return tmp_path


def test_a_new_learning_rate_is_applied_and_reported(first_run):
    tmp = first_run
    changed = write(tmp, "lr.yaml", optimizer={"lr": 2e-3, "grad_clip": 0.5}, run={"max_steps": 4})
    proc = ok(cli("train", "--config", str(changed), "--device", "cpu", "--resume", cwd=tmp))
    assert [r["lr"] for r in steps(tmp / "metrics.jsonl")] == [1e-3, 1e-3, 2e-3, 2e-3]
    assert "settings changed since the checkpoint, applied from step 3" in proc.stdout
    assert (
        "optimizer.lr 0.001 -> 0.002" in proc.stdout
        and "optimizer.grad_clip None -> 0.5" in proc.stdout
    )
    event = [
        json.loads(l)
        for l in (tmp / "metrics.jsonl").read_text().splitlines()
        if '"settings_changed"' in l
    ]
    assert event and event[0]["changed"]["optimizer.lr"] == [1e-3, 2e-3]


def test_a_new_schedule_is_applied_and_reported(first_run):
    tmp = first_run
    changed = write(
        tmp,
        "sched.yaml",
        scheduler={"name": "cosine", "warmup_steps": 0, "max_steps": 4, "min_lr_ratio": 0.5},
        run={"max_steps": 4},
    )
    proc = ok(cli("train", "--config", str(changed), "--device", "cpu", "--resume", cwd=tmp))
    assert "scheduler.name 'constant' -> 'cosine'" in proc.stdout
    lrs = [r["lr"] for r in steps(tmp / "metrics.jsonl")][2:]
    assert lrs == pytest.approx(
        [1e-3 * (0.5 + 0.5 * 0.5 * (1 + c)) for c in (0.0, -0.7071067811865476)]
    )


def test_another_data_file_is_refused(first_run):
    tmp = first_run
    corpus(tmp / "b.txt", seed=1)
    line = error_line(
        cli(
            "train",
            "--config",
            str(write(tmp, "b.yaml", data={"text_path": str(tmp / "b.txt")}, run={"max_steps": 4})),
            "--device",
            "cpu",
            "--resume",
            cwd=tmp,
        )
    )
    assert (
        f"data.text_path: saved '{tmp / 'a.txt'}', now '{tmp / 'b.txt'}'" in line
        and "content: saved" in line
    ), line
    assert sorted(p.name for p in (tmp / "out" / "checkpoints").glob("step_*.pt")) == [
        "step_000000000002.pt"
    ]


def test_the_same_path_with_other_content_is_refused(first_run):
    tmp = first_run
    corpus(tmp / "a.txt", seed=7)  # same name, same size, new text
    line = error_line(
        cli(
            "train",
            "--config",
            str(write(tmp, run={"max_steps": 4})),
            "--device",
            "cpu",
            "--resume",
            cwd=tmp,
        )
    )
    assert "content: saved" in line and "data.text_path:" not in line, line


def test_a_moved_data_file_is_fine(first_run):
    tmp = first_run
    (tmp / "a.txt").rename(tmp / "moved.txt")
    ok(
        cli(
            "train",
            "--config",
            str(write(tmp, data={"text_path": str(tmp / "moved.txt")}, run={"max_steps": 4})),
            "--device",
            "cpu",
            "--resume",
            cwd=tmp,
        )
    )
    assert [r["step"] for r in steps(tmp / "metrics.jsonl")] == [1, 2, 3, 4]


@pytest.mark.parametrize(
    "section,key,value",
    [("data", "block_size", 8), ("optimizer", "weight_decay_on", "all"), ("run", "seed", 4)],
)
def test_settings_the_saved_state_cannot_follow_are_refused(first_run, section, key, value):
    tmp = first_run
    over = {"run": {"max_steps": 4}}
    over.setdefault(section, {})[key] = value
    line = error_line(
        cli(
            "train",
            "--config",
            str(write(tmp, "x.yaml", **over)),
            "--device",
            "cpu",
            "--resume",
            cwd=tmp,
        )
    )
    assert f"{section}.{key}: saved" in line and f"now {value!r}" in line, line


def test_another_optimizer_family_is_refused_in_one_message(first_run):
    tmp = first_run
    line = error_line(
        cli(
            "train",
            "--config",
            str(write(tmp, "muon.yaml", optimizer={"name": "muon"}, run={"max_steps": 4})),
            "--device",
            "cpu",
            "--resume",
            cwd=tmp,
        )
    )
    assert (
        "optimizer.name: saved 'adamw', now 'muon'" in line
        and "Muon keeps one momentum matrix per hidden weight" in line
    ), line
    assert sorted(p.name for p in (tmp / "out" / "checkpoints").glob("step_*.pt")) == [
        "step_000000000002.pt"
    ]


def test_new_muon_settings_are_applied_and_reported(tmp_path):
    corpus(tmp_path / "a.txt")
    ok(
        cli(
            "train",
            "--config",
            str(write(tmp_path, optimizer={"name": "muon"})),
            "--device",
            "cpu",
            cwd=tmp_path,
        )
    )
    changed = write(
        tmp_path,
        "muon.yaml",
        optimizer={"name": "muon", "muon_lr": 0.02, "muon_momentum": 0.9, "muon_scale": "original"},
        run={"max_steps": 4},
    )
    proc = ok(cli("train", "--config", str(changed), "--device", "cpu", "--resume", cwd=tmp_path))
    assert (
        "optimizer.muon_lr None -> 0.02" in proc.stdout
        and "optimizer.muon_momentum 0.95 -> 0.9" in proc.stdout
    )
    assert "optimizer.muon_scale 'match_rms_adamw' -> 'original'" in proc.stdout
    assert "optimizer settings are kept" not in proc.stdout + proc.stderr
    # the Muon group's rate is logged
    assert [r["lr"] for r in steps(tmp_path / "metrics.jsonl")] == [
        1e-3,
        1e-3,
        0.02,
        0.02,
    ]


def test_a_resumed_runs_history_holds_only_its_own_records(first_run):
    # Run A (2 steps, in out/) and then run B (3 steps, in other/) append to the same metrics file;
    # A resumes to 4.
    from speedtronic.runtime import train_from_config
    from speedtronic.config import SpeedtronicConfig

    jsonl = first_run / "metrics.jsonl"
    a_steps = [(r["step"], r["loss"]) for r in steps(jsonl)]
    ok(
        cli(
            "train",
            "--config",
            str(
                write(
                    first_run,
                    "b.yaml",
                    run={"seed": 9, "max_steps": 3, "output_dir": str(first_run / "other")},
                    optimizer={"lr": 5e-3},
                )
            ),
            "--device",
            "cpu",
            cwd=first_run,
        )
    )
    assert len({r["run_id"] for r in steps(jsonl)}) == 2
    config = SpeedtronicConfig.load(write(first_run, run={"max_steps": 4}))
    result = train_from_config(config, resume=True, device="cpu")
    assert [m["step"] for m in result.metrics] == [1, 2, 3, 4]
    # A's own steps 1-2, not B's
    assert [(m["step"], m["loss"]) for m in result.metrics[:2]] == a_steps


# ---------------------------------------------------------------- a resume keeps the target it was
# given

PRESS = """
import os, signal
from torch.optim.optimizer import register_optimizer_step_pre_hook

updates = 0
def press(optimizer, args, kwargs):
    '''Ctrl-C inside this process's update number $PRESS_AT_UPDATE (held by the trainer until the
    step is complete).'''
    global updates
    updates += 1
    if str(updates) == os.environ.get("PRESS_AT_UPDATE"):
        os.kill(os.getpid(), signal.SIGINT)

register_optimizer_step_pre_hook(press)
"""


def run_in(tmp: Path, *args: str, press_at: int | None = None) -> subprocess.CompletedProcess:
    "`speedtronic train --config cfg.yaml --device cpu ARGS` in `tmp`, as a user types it there."
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp), str(ROOT)]),
        "OMP_NUM_THREADS": "1",
    }
    if press_at is not None:
        env["PRESS_AT_UPDATE"] = str(press_at)
    return run_command(
        [
            sys.executable,
            "-m",
            "speedtronic",
            "train",
            "--config",
            "cfg.yaml",
            "--device",
            "cpu",
            *args,
        ],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture
def cosine_run(tmp_path):
    "A finished 4-step run with a cosine schedule (warmup 1, horizon = target) and a Ctrl-C hook."
    corpus(tmp_path / "a.txt")
    (tmp_path / "press_hook.py").write_text(PRESS)
    write(
        tmp_path,
        model={"imports": ["press_hook"]},
        run={"max_steps": 4},
        scheduler={"name": "cosine", "warmup_steps": 1, "min_lr_ratio": 0.1},
        eval={"holdout_fraction": 0.1, "max_batches": 2},  # a held-out loss at the end of each run
    )
    ok(run_in(tmp_path))
    return tmp_path


def test_a_plain_resume_trains_on_to_the_target_it_was_given(cosine_run):
    "--resume --max-steps 10 stopped at 6, then a plain --resume: on to 10 on the 10-step schedule."
    from speedtronic.schedules import lr_multiplier

    tmp = cosine_run
    stopped = run_in(tmp, "--resume", "--max-steps", "10", press_at=2)  # Ctrl-C in step 6
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    said = stopped.stderr.strip().splitlines()
    assert said[-1] == "speedtronic: error: interrupted" and "Traceback" not in stopped.stderr
    assert said[-2] == (
        "speedtronic: to continue: speedtronic train --config cfg.yaml --device cpu "
        "--max-steps 10 --resume"
    ), said[-3:]
    assert said[-3].startswith("speedtronic: Training stopped after step 6 of 10"), said[-3:]
    stretched = [l for l in stopped.stdout.splitlines() + said if "is stretched" in l]
    record = {r["step"]: r["lr"] for r in steps(tmp / "metrics.jsonl")}
    assert len(stretched) == 1 and f"to {record[5]:.2e} at step 5" in stretched[0], stretched
    assert "schedule is stretched to end at step 10" in stretched[0], stretched

    resumed = ok(run_in(tmp, "--resume"))
    assert "nothing to train" not in resumed.stdout + resumed.stderr, resumed.stderr[-2000:]
    assert resumed.stdout.strip().splitlines()[-1].startswith("completed steps=10 ")
    assert "training on to step 10, the target the run was given" in resumed.stdout
    lrs = {r["step"]: r["lr"] for r in steps(tmp / "metrics.jsonl")}
    assert sorted(lrs) == list(range(1, 11)), sorted(lrs)
    for step in range(5, 11):  # one 10-step cosine from step 5 on, across the stop
        want = 1e-3 * lr_multiplier(step - 1, warmup_steps=1, max_steps=10, min_lr_ratio=0.1)
        assert abs(lrs[step] - want) < 1e-12, (step, lrs[step], want)


def test_a_stretched_schedule_says_how_to_keep_the_old_horizon(tmp_path):
    """A finished 4-step cosine extended with --max-steps 10: the note names the stretch and
    the config that keeps the old horizon (run.max_steps: 10, scheduler.max_steps: 4, no
    --max-steps, which sets both); a run resumed so trains steps 5-10 at the floor (1e-3 x 0.1)
    and gets no note."""
    runs = {}
    for name in ("stretched", "kept"):
        tmp = tmp_path / name
        tmp.mkdir()
        corpus(tmp / "a.txt")
        (tmp / "press_hook.py").write_text(PRESS)
        cosine = {"name": "cosine", "warmup_steps": 1, "min_lr_ratio": 0.1}
        write(tmp, model={"imports": ["press_hook"]}, run={"max_steps": 4}, scheduler=cosine)
        ok(run_in(tmp))
        runs[name] = tmp
    proc = ok(run_in(runs["stretched"], "--resume", "--max-steps", "10"))
    said = [line for line in (proc.stdout + proc.stderr).splitlines() if "is stretched" in line]
    assert len(said) == 1, proc.stdout + proc.stderr
    assert said[0].endswith(
        "to keep the old horizon instead, resume without --max-steps from a config with "
        "run.max_steps: 10 and scheduler.max_steps: 4 (the rate then stays at its floor, "
        "1.00e-04, after step 4)"
    ), said

    tmp = runs["kept"]
    kept = {"name": "cosine", "warmup_steps": 1, "min_lr_ratio": 0.1, "max_steps": 4}
    write(tmp, model={"imports": ["press_hook"]}, run={"max_steps": 10}, scheduler=kept)
    proc = ok(run_in(tmp, "--resume"))  # as the note says
    assert "is stretched" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    lrs = {r["step"]: r["lr"] for r in steps(tmp / "metrics.jsonl")}
    assert sorted(lrs) == list(range(1, 11)), sorted(lrs)
    assert all(abs(lrs[s] - 1e-4) < 1e-12 for s in range(5, 11)), lrs


def in_a_terminal(tmp: Path, *args: str) -> str:
    "What a terminal shows of `speedtronic train --config cfg.yaml --device cpu ARGS` run in `tmp`."
    import pty

    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "speedtronic",
            "train",
            "--config",
            "cfg.yaml",
            "--device",
            "cpu",
            *args,
        ],
        cwd=tmp,
        stdin=follower,
        stdout=follower,
        stderr=follower,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp), str(ROOT)])},
        close_fds=True,
    )
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(leader)
    assert proc.wait(timeout=120) == 0, b"".join(chunks)[-2000:]
    return b"".join(chunks).decode("utf-8", "replace")


def test_nothing_to_train_names_the_flag(cosine_run):
    """A plain --resume of a finished run: the warning names --max-steps N; no YAML key, no old
    held-out loss."""
    proc = ok(run_in(cosine_run, "--resume"))
    said = proc.stdout + proc.stderr
    assert "nothing to train: the run is already at step 4 and its target is step 4" in said, said
    assert "--max-steps 8 trains 4 more steps" in said and "max_steps: " not in said, said
    # a pipe gets the closing lines (no update made), never a `loss=None`
    assert "no update made" in proc.stdout and "loss=None" not in proc.stdout, proc.stdout
    # a person: no loss and no held-out loss of step 4
    shown = in_a_terminal(cosine_run, "--resume")
    assert "--max-steps 8 trains 4 more steps" in shown, shown
    assert "nothing trained: the run is at step 4, its target" in shown, shown
    assert "held-out loss" not in shown and "loss=None" not in shown, shown
