"""`speedtronic train` in a real terminal (a pseudo-terminal): the progress bar shows, and log lines never
run into it — each log line starts at the beginning of a terminal line."""
import os, pty, re, subprocess, sys, time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

def run_in_terminal(args: list[str], cwd: Path, timeout: float = 180) -> str:
    leader, follower = pty.openpty()
    proc = subprocess.Popen(args, cwd=cwd, stdin=follower, stdout=follower, stderr=follower,
                            env={**os.environ, 'PYTHONPATH': str(ROOT), 'COLUMNS': '160'}, close_fds=True)
    os.close(follower)
    chunks, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        try: data = os.read(leader, 65536)
        except OSError: break                       # the child closed the terminal
        if not data: break
        chunks.append(data)
    proc.wait(timeout=30)
    os.close(leader)
    assert proc.returncode == 0, b''.join(chunks)[-2000:]
    return b''.join(chunks).decode('utf-8', 'replace')

def test_progress_bar_and_log_lines_share_the_terminal(tmp_path):
    cfg = tmp_path / 'run.yaml'
    cfg.write_text(f"run: {{max_steps: 12, output_dir: {tmp_path / 'out'}}}\n"
                   "model: {vocab_size: 64, max_seq_len: 16, n_layer: 1, n_head: 2, d_model: 16}\n"
                   "data: {num_tokens: 64, micro_batch_size: 2, target_batch_size: 2}\n"
                   "checkpoint: {every_steps: 5}\n"
                   "logging: {progress: auto, loss_plot: false}\n")
    out = run_in_terminal([sys.executable, '-m', 'speedtronic', 'train', '--config', str(cfg), '--device', 'cpu'], tmp_path)
    assert 'step 12/12 [' in out and '100%' in out                       # the bar reached the target
    segments = re.split(r'[\r\n]+', out)
    logs = [s for s in segments if '| INFO |' in s]
    assert len(logs) >= 12                                                # train_step lines + events
    stamp = re.compile(r'^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} \| INFO \| ')
    assert all(stamp.match(s) for s in logs), [s for s in logs if not stamp.match(s)][:3]
    assert segments[-2 if segments[-1] == '' else -1].startswith('completed steps=12 ')
