"""`speedtronic train` in a real terminal (a pseudo-terminal 100 columns wide): the progress bar, a
setup line, one short aligned line per logged step and the closing lines, none wider than the
terminal, and log lines never run into the bar; the files keep every field."""

import fcntl, json, os, pty, re, struct, subprocess, sys, termios, time
from pathlib import Path
from conftest import spawn

ROOT = Path(__file__).resolve().parents[2]
COLUMNS = 100


def run_in_terminal(
    args: list[str], cwd: Path, timeout: float = 180, columns: int = COLUMNS
) -> str:
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    proc = spawn(
        args,
        cwd=cwd,
        stdin=follower,
        stdout=follower,
        stderr=follower,
        env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": str(columns)},
        close_fds=True,
    )
    os.close(follower)
    chunks, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            data = os.read(leader, 65536)
        except OSError:
            break  # the child closed the terminal
        if not data:
            break
        chunks.append(data)
    proc.wait(timeout=30)
    os.close(leader)
    assert proc.returncode == 0, b"".join(chunks)[-2000:]
    return b"".join(chunks).decode("utf-8", "replace")


def test_what_a_terminal_shows(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        "run: {max_steps: 12, output_dir: out}\n"
        "model: {vocab_size: 64, max_seq_len: 16, n_layer: 1, n_head: 2, d_model: 16}\n"
        "data: {num_tokens: 64, micro_batch_size: 2, target_batch_size: 2}\n"
        "checkpoint: {every_steps: 5}\n"
        "logging: {progress: auto, every_steps: 4, json_file: out/metrics.jsonl, file: "
        "out/train.log}\n"
    )
    out = run_in_terminal(
        [sys.executable, "-m", "speedtronic", "train", "--config", str(cfg), "--device", "cpu"],
        tmp_path,
    )
    assert "step 12/12 [" in out and "100%" in out  # the bar reached the target
    segments = [s for s in re.split(r"[\r\n]+", out) if s.strip()]
    assert max(len(s.rstrip()) for s in segments) <= COLUMNS, max(segments, key=len)
    assert not any(
        raw in out for raw in ("| INFO |", "steps_per_sec=", "fused_reason", "completed steps=")
    )
    setup = [s for s in segments if s.startswith("model ")]
    assert setup == [
        "model 4.11k params | cpu fp32 | adamw lr 3.00e-04 | batch 2 x 16 tokens | steps 0 -> 12"
    ], setup
    steps = [s for s in segments if re.match(r"step +\d+/12  loss ", s)]
    assert [int(re.match(r"step +(\d+)", s).group(1)) for s in steps] == [4, 8, 12]
    assert len({len(s) for s in steps}) == 1 and all(
        re.search(r"  lr \d\.\d\de-\d\d +\S+ tok/s  ETA \d\d:\d\d$", s) for s in steps
    )
    assert [s for s in segments if s.startswith("checkpoint")] == [
        f"checkpoint  step {n}: step_{n:012d}.pt" for n in (5, 10, 12)
    ]
    *_, done, ckpts, metrics, curve = segments
    assert re.fullmatch(r"done: step 12 in \d\d:\d\d \| loss \d+\.\d{4}", done), done
    assert (ckpts, metrics, curve) == (
        "  checkpoints  out/checkpoints",
        "  metrics      out/metrics.jsonl",
        "  loss curve   out/loss_curve.png",
    )
    records = [
        json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
    ]
    last = [r for r in records if r["event"] == "train_step"][-1]
    assert {"steps_per_sec", "samples_per_sec", "micro_batches", "elapsed_s"} <= set(last) and last[
        "step"
    ] == 12
    assert f"loss {last['loss']:.4f}" in done  # the closing loss is the last record's
    assert [r["event"] for r in records][:2] == ["optimizer", "train_start"]
    logged = (tmp_path / "out" / "train.log").read_text()
    assert re.search(r"\| INFO \| optimizer name=adamw .*fused_reason=", logged)
    assert re.search(r"\| INFO \| train_step step=4 loss=\S+ lr=\S+ steps_per_sec=", logged)
    assert (tmp_path / "out" / "loss_curve.png").exists()


def test_validate_deep_fits_its_lines_to_the_terminal(tmp_path):
    (tmp_path / "a.txt").write_text("a line of text to train on and to hold out\n" * 200)
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        "run: {output_dir: out}\n"
        "model: {vocab_size: 256, max_seq_len: 16, n_layer: 1, n_head: 2, d_model: 16}\n"
        f"data: {{text_path: {tmp_path / 'a.txt'}, block_size: 16}}\neval: {{holdout_fraction: "
        f"0.1}}\n"
    )
    out = run_in_terminal(
        [
            sys.executable,
            "-m",
            "speedtronic",
            "validate",
            "--deep",
            "--config",
            str(cfg),
            "--device",
            "cpu",
        ],
        tmp_path,
    )
    lines = [s for s in re.split(r"[\r\n]+", out) if s.strip()]
    note = [i for i, s in enumerate(lines) if s.startswith("eval.holdout_fraction: ")]
    assert (
        len(note) == 1 and lines[note[0] + 1 :][:1] != [] and lines[note[0] + 1].startswith("  ")
    ), out[-2000:]
    assert max(len(s.rstrip()) for s in lines) <= COLUMNS, max(lines, key=len)
