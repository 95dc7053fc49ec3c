"""Multi-process and process-exit behaviour of `speedtronic.profiling.MetricLogger` (spec §9.2,
O1/O3/O4/O8)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_python

ROOT = Path(__file__).resolve().parents[2]


BARE_ENV = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}  # a child's whole environment


WRITER = """
import sys, threading
from speedtronic.profiling import MetricLogger
proc, path, text = sys.argv[1], sys.argv[2], sys.argv[3]
log = MetricLogger(stream=False, json_file=path, file=text)
def work(t):
    for i in range(1000):
        pad = "x" * (9000 if i % 50 == 0 else 100)   # some lines far beyond PIPE_BUF
        log.emit("train_step", {"step": i, "proc": proc, "thread": t, "pad": pad})
threads = [threading.Thread(target=work, args=(t,)) for t in range(3)]
for t in threads: t.start()
for t in threads: t.join()
log.close()
"""


def test_jsonl_and_text_lines_stay_whole_across_processes_and_threads(tmp_path):
    jsonl, text = tmp_path / "metrics.jsonl", tmp_path / "train.log"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, str(p), str(jsonl), str(text)],
            cwd=ROOT,
            env=BARE_ENV,
        )
        for p in range(2)
    ]
    for p in procs:
        assert p.wait(timeout=300) == 0
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert len(records) == 2 * 3 * 1000
    counts = {}
    for r in records:
        counts[(r["proc"], r["thread"])] = counts.get((r["proc"], r["thread"]), 0) + 1
    assert counts == {(str(p), t): 1000 for p in range(2) for t in range(3)}
    lines = text.read_text().splitlines()
    assert len(lines) == 6000
    # every text line is a complete event line: it starts with a timestamp and ends with elapsed_s
    assert all(
        line[:4].isdigit() and " | INFO | train_step step=" in line and " elapsed_s=" in line
        for line in lines
    )


def test_unclosed_logger_flushes_hooks_at_exit(tmp_path):
    out = tmp_path / "hook.txt"
    result = run_python(
        """
        import sys, time
        from speedtronic.profiling import MetricLogger
        path = sys.argv[1]
        def slow(event, payload):
            time.sleep(0.005)
            with open(path, "a") as f: f.write(f"{payload['step']}\\n")
        log = MetricLogger(stream=False, hooks=[slow])
        for s in range(40): log.emit("train_step", {"step": s})
        # no close(): the atexit handler must let the hook see every event
    """,
        str(out),
        env=BARE_ENV,
    )
    assert result.returncode == 0, result.stderr
    assert out.read_text().split() == [str(s) for s in range(40)]


def test_console_and_file_both_get_lines_and_hook_failures_are_reported(tmp_path):
    log_file = tmp_path / "train.log"
    result = run_python(
        """
        import sys
        from speedtronic.profiling import MetricLogger
        def broken(event, payload): raise ValueError("no backend")
        with MetricLogger(file=sys.argv[1], hooks=[broken]) as log:
            for s in range(1, 4): log.emit("train_step", {"step": s, "loss": 0.5})
    """,
        str(log_file),
        env=BARE_ENV,
    )
    assert result.returncode == 0, result.stderr
    stdout = result.stdout.splitlines()
    assert [l.split(" | ", 2)[2].split(" elapsed_s")[0] for l in stdout if "| INFO |" in l] == [
        f"train_step step={s} loss=0.5" for s in range(1, 4)
    ]
    warnings = [l for l in stdout if "| WARNING |" in l]
    assert (
        len(warnings) == 2 and "metric hook failed: broken: ValueError('no backend')" in warnings[0]
    )
    assert "3 failed call(s)" in warnings[1]
    assert log_file.read_text().splitlines() == stdout


def test_loggers_in_one_process_never_share_files(tmp_path):
    result = run_python(
        """
        import gc, sys
        from pathlib import Path
        from speedtronic.profiling import MetricLogger
        d = Path(sys.argv[1])
        for i in range(20):                      # 2.0 keyed loggers by id(); dead ids get reused
            log = MetricLogger(file=d / f"{i}.log", stream=False)
            log.emit("train_step", {"step": i})
            if i % 2: log.close()
            del log; gc.collect()
    """,
        str(tmp_path),
        env=BARE_ENV,
    )
    assert result.returncode == 0, result.stderr
    for i in range(20):
        lines = (tmp_path / f"{i}.log").read_text().splitlines()
        assert len(lines) == 1 and f"step={i} " in lines[0]


def test_memory_bytes_reports_the_trainer_device():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from speedtronic.profiling import MetricLogger, memory_usage_bytes
    import io

    device = torch.device("cuda", torch.cuda.device_count() - 1)
    keep = torch.empty(1 << 20, device=device)
    assert memory_usage_bytes(device) == torch.cuda.memory_allocated(device) >= keep.numel() * 4
    records = []
    with MetricLogger(
        stream=io.StringIO(), device=device, every_steps=2, hooks=[lambda e, p: records.append(p)]
    ) as log:
        for s in range(1, 5):
            log.emit("train_step", {"step": s})
    assert [r["step"] for r in records] == [2, 4]
    assert all(r["memory_bytes"] >= keep.numel() * 4 for r in records)


def test_jsonl_is_strict_json_with_nan_loss_unicode_and_long_values(tmp_path):
    """A diverging run's NaN/inf values, unicode and a 100 kB value: every JSONL line parses as
    strict JSON."""
    from speedtronic.profiling import MetricLogger

    path = tmp_path / "new" / "dir" / "m.jsonl"
    with MetricLogger(stream=False, json_file=path) as log:
        log.emit(
            "train_step",
            {
                "step": 1,
                "loss": float("nan"),
                "lr": float("inf"),
                "note": "héllo ☃ 日本",
                "long": "x" * 100_000,
                "grads": [1.0, float("-inf")],
                "by": {(0, 1): 2},
            },
        )

    def reject(token):
        raise AssertionError(f"non-JSON token {token} in the JSONL")

    (record,) = [
        json.loads(line, parse_constant=reject)
        for line in path.read_text(encoding="utf-8").splitlines()
    ]
    assert record["loss"] is None and record["lr"] is None and record["grads"] == [1.0, None]
    assert (
        record["note"] == "héllo ☃ 日本"
        and len(record["long"]) == 100_000
        and record["by"] == {"(0, 1)": 2}
    )


def test_unwritable_log_paths_name_the_key(tmp_path):
    "A log path whose folder is a file: a ConfigError naming logging.file / logging.json_file."
    from speedtronic.config import ConfigError
    from speedtronic.profiling import MetricLogger

    blocker = tmp_path / "a_file"
    blocker.write_text("keep me")
    for key in ("file", "json_file"):
        with pytest.raises(ConfigError, match=f"logging.{key}: cannot open"):
            MetricLogger(stream=False, **{key: blocker / "sub" / "log"})
    assert blocker.read_text() == "keep me"
