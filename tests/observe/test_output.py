"""One voice on every output: what `speedtronic train` prints piped to a file (`| tee`, nohup, CI),
with `--verbose`, in a real terminal (a pseudo-terminal 100 columns wide), and from the two nodes of
a DiLoCo run. A pipe gets one progress line per `logging.every_steps` and the closing summary; the
internals (the optimizer's settings, a DiLoCo round's events) stay in the metrics file unless
`--verbose` asks for them."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import yaml

from conftest import ROOT, cli_env, communicate_or_dump, jsonl_records, ok, run_cli
from conftest import spawn
from test_terminal import COLUMNS, run_in_terminal

STEP = re.compile(
    r"step +(\d+)/(\d+)  loss +\d+\.\d{4}  lr \S+ +\S+ tok/s  ETA \d\d:\d\d(  held-out "
    r"(\d+\.\d{4}))?"
)
COMPLETED = re.compile(r"completed steps=\d+ samples=\d+ tokens=\d+ loss=\d\S*")
INTERNALS = ("| INFO |", "optimizer name=", "fused_reason", "train_start", "elapsed_s=", "sample")


def demo_copy(tmp: Path, *, log_every: int = 5, eval_every: int = 10) -> Path:
    """The README's demo config in `tmp`, logging every `log_every` steps and evaluating every
    `eval_every`."""
    raw = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    raw["logging"]["every_steps"] = log_every
    raw["eval"]["every_steps"] = eval_every
    raw["scheduler"]["warmup_steps"] = 5  # runs of 10 steps here
    path = tmp / "demo.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def test_a_pipe_gets_one_progress_line_per_logged_step_and_the_summary(tmp_path):
    demo_copy(tmp_path)
    proc = ok(run_cli("train", "--config", "demo.yaml", "--max-steps", "20", cwd=tmp_path))
    lines = proc.stdout.splitlines()
    steps = [i for i, line in enumerate(lines) if STEP.fullmatch(line)]
    assert [int(STEP.fullmatch(lines[i])[1]) for i in steps] == [5, 10, 15, 20], proc.stdout
    assert steps == list(range(steps[0], steps[0] + 4)), proc.stdout  # nothing between them
    # before them only the one note on the held-out split (a message, not an event)
    assert [line.split(":")[0] for line in lines[: steps[0]]] == ["eval.holdout_fraction"], lines
    done, *files, completed = lines[steps[-1] + 1 :]
    assert re.fullmatch(
        r"done: step 20 in \d\d:\d\d \| loss \d+\.\d{4} \| held-out loss \d+\.\d{4}", done
    ), done
    assert files and all(line.startswith("  ") for line in files), files
    assert COMPLETED.fullmatch(completed), completed
    assert not [line for line in lines[:-1] if any(raw in line for raw in INTERNALS)], proc.stdout
    # the newest held-out loss rides on the step lines after the evaluation at step 10
    demo = tmp_path / "runs" / "demo"
    (at_10, *_) = jsonl_records(demo / "metrics.jsonl", "eval")
    held = [STEP.fullmatch(lines[i])[4] for i in steps]
    assert held == [None, None, f"{at_10['val_loss']:.4f}", f"{at_10['val_loss']:.4f}"], held
    # the internals are in the metrics file
    for event in ("optimizer", "train_start", "sample", "train_end"):
        assert jsonl_records(demo / "metrics.jsonl", event), event

    again = ok(
        run_cli("train", "--config", "demo.yaml", "--max-steps", "20", "--resume", cwd=tmp_path)
    )
    said = again.stdout.splitlines()
    assert "loss=None" not in again.stdout + again.stderr and not any(
        line.startswith("completed ") for line in said
    ), again.stdout
    assert any(line.startswith("resumed from ") for line in said), said
    assert any(re.match(r"done: step 20 in \d\d:\d\d \| no update made", line) for line in said), (
        said
    )


def test_verbose_shows_the_internals_too(tmp_path):
    demo_copy(tmp_path)
    args = ("train", "--config", "demo.yaml", "--max-steps", "10", "--verbose")
    proc = ok(run_cli(*args, cwd=tmp_path))
    out = proc.stdout
    assert re.search(r"\| INFO \| optimizer name=\w+ .*fused_reason=", out), out[-3000:]
    assert re.search(r"\| INFO \| train_step step=5 loss=\S+ lr=\S+ steps_per_sec=", out)
    assert "| INFO | eval step=10 val_loss=" in out and "| INFO | sample step=10 index=0" in out
    assert COMPLETED.fullmatch(out.splitlines()[-1]), out[-1000:]


def test_a_terminal_gets_the_live_line_and_short_lines_within_100_columns(tmp_path):
    demo_copy(tmp_path, log_every=5, eval_every=5)
    out = run_in_terminal(
        [
            sys.executable,
            "-m",
            "speedtronic",
            "train",
            "--config",
            "demo.yaml",
            "--max-steps",
            "10",
        ],
        tmp_path,
    )
    assert "\rstep 10/10 [####################] 100%" in out, out[-2000:]  # the live line
    segments = [s for s in re.split(r"[\r\n]+", out) if s.strip()]
    assert max(len(s.rstrip()) for s in segments) <= COLUMNS, max(segments, key=len)
    assert not any(raw in out for raw in ("| INFO |", "fused_reason", "completed steps="))
    steps = [s for s in segments if s.startswith("step ") and "  loss " in s]
    assert (
        len(steps) == 2
        and "held-out" not in steps[0]
        and re.search(r"  held-out \d+\.\d{4}$", steps[1])
    ), steps
    assert [s.split("  ")[0] for s in segments if s.startswith("sample")] == ["sample"] * 2


# -- a DiLoCo run: a master and a worker over a shared directory, their output piped ---------------
NODES = ("master", "worker-1")


def node_config(tmp: Path, name: str, index: int, text: Path) -> Path:
    "A small node of a two-node run: 20 steps in rounds of 5, a line every round, a held-out loss."
    raw = {
        "run": {"name": name, "seed": 1, "max_steps": 20, "output_dir": name, "device": "cpu"},
        "model": {"vocab_size": 256, "max_seq_len": 16, "n_layer": 1, "n_head": 2, "d_model": 16},
        "data": {"text_path": str(text), "block_size": 16, "micro_batch_size": 4},
        "optimizer": {"lr": 3e-3},
        "scheduler": {"warmup_steps": 2},
        "precision": {"mode": "fp32"},
        "checkpoint": {"every_steps": 10, "keep_last": 1},
        "eval": {"holdout_fraction": 0.1, "max_batches": 2},
        "logging": {"every_steps": 5, "json_file": f"{name}/metrics.jsonl", "loss_plot": False},
        "distributed": {
            "enabled": True,
            "role": "master" if index == 0 else "worker",
            "node_id": name,
            "transport": "directory",
            "repo_id": "repo",
            "inner_steps": 5,
            "outer_momentum": 0.0,
            "poll_interval": 0.2,
            "boundary_wait": 300,  # whole rounds, however slow a node is to start here
            "expected_nodes": 2,
            "shard_count": 2,
            "shard_index": index,
            "final_round_timeout": 180,
        },
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def start(tmp: Path, cfg: Path) -> subprocess.Popen:
    return spawn(
        [sys.executable, "-m", "speedtronic", "train", "--config", str(cfg)],
        cwd=tmp,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_diloco_nodes_say_one_line_a_round_under_their_name_and_end_with_the_global_model(
    tmp_path,
):
    text = tmp_path / "text.txt"
    text.write_text(
        "the node trains on its own share of the text and sends what it learned\n" * 400
    )
    configs = [node_config(tmp_path, name, i, text) for i, name in enumerate(NODES)]
    procs = [start(tmp_path, configs[0])]  # the master first: it creates the repository
    deadline = time.monotonic() + 300
    while not jsonl_records(tmp_path / "master" / "metrics.jsonl", "train_start"):
        assert procs[0].poll() is None and time.monotonic() < deadline, procs[0].stderr.read()
        time.sleep(0.1)
    procs.append(start(tmp_path, configs[1]))
    outputs = {}
    for name, proc in zip(NODES, procs):
        out, err = communicate_or_dump(proc, 600)
        assert proc.returncode == 0, (out[-2000:], err[-3000:])
        outputs[name] = out
    for name, out in outputs.items():
        lines = out.splitlines()
        assert lines and all(line.startswith(f"[{name}] ") for line in lines), out
        said = [line[len(name) + 3 :] for line in lines]
        rounds = [s for s in said if s.startswith("step ")]
        assert [int(re.match(r"step +(\d+)/20", s)[1]) for s in rounds] == [5, 10, 15, 20], out
        assert all(
            re.search(rf"  round {n}: delta sent, global v\d+$", s) for n, s in enumerate(rounds, 1)
        )
        # a start message, the completed line, the last line
        assert len(lines) <= len(rounds) + 4, out
        assert not any(
            raw in out
            for raw in ("delta_upload_queued", "outer_update_norms", "layers=", "| INFO |")
        )
        last = re.fullmatch(
            r"done: step 20 \| loss \d+\.\d{4} \| held-out loss \d+\.\d{4} \| final global model: "
            r"(\S+)",
            said[-1],
        )
        assert last, said[-1]
        assert (tmp_path / last[1]).is_file() and last[1] == "repo/global/latest.safetensors", last[
            1
        ]
        assert jsonl_records(tmp_path / name / "metrics.jsonl", "delta_upload_queued")
    assert jsonl_records(tmp_path / "master" / "metrics.jsonl", "outer_update_norms")
