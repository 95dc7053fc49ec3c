"""The DiLoCo area's helpers: a small CPU node's config, launching it as a real `speedtronic train`
process, waiting on it, and reading what it did. Every DiLoCo test module imports them from here
(the Hub stand-in and the CLI runners every area uses are in tests/conftest.py and
tests/hub_server.py)."""

from __future__ import annotations

import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml

from conftest import HUB_TOKEN, communicate_or_dump, jsonl_records, start_cli
from hub_server import HubStandIn

from speedtronic.distributed import HubClient, SharedDirectory

TOKEN = HUB_TOKEN  # what the `hub` fixture accepts

events = jsonl_records


def node_config(
    tmp: Path,
    name: str,
    role: str,
    *,
    repo: str,
    transport: str,
    steps: int,
    index: int | None = None,
    count: int | None = None,
    bigger: bool = False,
    model: dict | None = None,
    **distributed,
) -> Path:
    """A one-layer CPU node of a DiLoCo run, written to `tmp/<name>.yaml`. Given `count`, it is node
    `index` of a run of `count` nodes, each training its own shard of the data; `bigger` makes it
    slow enough (tens of ms per step) that a test can kill it mid-run; `model` and `distributed`
    replace keys of those sections."""
    raw = {
        "run": {
            "name": name,
            "seed": 1,
            "max_steps": steps,
            "output_dir": str(tmp / name),
            "device": "cpu",
        },
        "model": {
            "vocab_size": 64,
            "max_seq_len": 16,
            "n_layer": 1,
            "n_head": 2,
            "n_kv_head": 1,
            "d_model": 16,
            "d_ff": 32,
        },
        "data": {
            "num_tokens": 4096,
            "block_size": 16,
            "micro_batch_size": 4,
            "target_batch_size": 4,
        },
        "optimizer": {"lr": 3e-3},
        "scheduler": {"warmup_steps": 2},
        "precision": {"mode": "fp32"},
        "checkpoint": {"every_steps": 10, "keep_last": 2},
        "logging": {
            "every_steps": 10,
            "json_file": str(tmp / name / "metrics.jsonl"),
            "loss_plot": False,
            "progress": False,
        },
        "distributed": {
            "enabled": True,
            "role": role,
            "node_id": name,
            "transport": transport,
            "repo_id": repo,
            "inner_steps": 5,
            "poll_interval": 0.2,
            "final_round_timeout": 180,  # a bound on a hang; a test that waits on it sets it
            "retry_initial": 0.05,
            "retry_max": 0.5,
            "request_timeout": 5,
        },
    }
    if count is not None:
        raw["distributed"].update(shard_count=count, shard_index=index, expected_nodes=count)
    if bigger:
        raw["model"].update(max_seq_len=32, n_layer=2, d_model=64, d_ff=128, n_head=4, n_kv_head=2)
        raw["data"].update(block_size=32, micro_batch_size=16, target_batch_size=16)
    raw["model"].update(model or {})
    raw["distributed"].update(distributed)
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def hub_env(hub: HubStandIn, token: str = TOKEN) -> dict:
    "The environment a node needs to reach the Hub stand-in `hub` with `token`."
    return {
        "HF_ENDPOINT": hub.url,
        "HF_TOKEN": token,
        "HF_HUB_DOWNLOAD_TIMEOUT": "5",
        "HF_HUB_ETAG_TIMEOUT": "5",
    }


def repo_of(kind: str, tmp: Path, hub: HubStandIn | None) -> tuple[str, dict]:
    """(repo_id, environment) of a fresh repository nobody has created, on the Hub stand-in or as a
    directory path."""
    return (
        ("org/launched-together", hub_env(hub))
        if kind == "hub"
        else (str(tmp / "share" / "repo"), {})
    )


def transport_of(kind: str, repo: str, hub: HubStandIn | None):
    "A client of `repo` for reading what the nodes left there."
    return (
        HubClient(repo, token=TOKEN, endpoint=hub.url, retry_attempts=2)
        if kind == "hub"
        else SharedDirectory(repo)
    )


def launch(cfg: Path, *extra: str, env: dict | None = None) -> subprocess.Popen:
    "`speedtronic train --config cfg *extra` started, its stdout and stderr piped."
    return start_cli(
        "train",
        "--config",
        str(cfg),
        *extra,
        env={"HF_HUB_DISABLE_PROGRESS_BARS": "1", **(env or {})},
        faulthandler=False,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def finish(proc: subprocess.Popen, timeout: float = 600) -> str:
    "The stdout of `proc` run to its end; the test fails with its log when it exits non-zero."
    out, err = communicate_or_dump(proc, timeout)
    if proc.returncode != 0:  # in full: an assertion's repr would cut the middle of the log out
        pytest.fail(
            f"{proc.args[-3:]} exited {proc.returncode}\n--- its stderr, last 8000 characters:\n"
            f"{err[-8000:]}\n--- its stdout, last 2000 characters:\n{out[-2000:]}",
            pytrace=False,
        )
    return out


def ended(proc: subprocess.Popen, timeout: float = 600) -> tuple[int, str, str]:
    "(exit status, stderr, stdout) of `proc` run to its end."
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, err, out


def error_line(rc: int, err: str, out: str, *needles: str) -> str:
    """The one `speedtronic: error:` line of a node that exited 2 without a traceback; it holds
    every one of `needles`."""
    assert rc == 2, (rc, err[-3000:])
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("speedtronic: error:")]
    assert len(lines) == 1, err[-3000:]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def wait_for(predicate, timeout: float = 300, what: str = "condition") -> None:
    "Ask `predicate` every 0.1 s until it holds; fail when `timeout` s pass first."
    wait_while_running(predicate, (), timeout, what, poll=0.1)


def wait_while_running(
    predicate, procs, timeout: float = 300, what: str = "condition", poll: float = 0.2
) -> None:
    "Ask `predicate` every `poll` s until it holds; fail when a node ends first or time runs out."
    deadline = time.monotonic() + timeout
    while not predicate():
        for p in procs:
            assert p.poll() is None, f"{what}: a node ended early: {p.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(poll)


class Lines:
    """A process's stdout read on a thread: its lines, and an event set once `needle` shows up or
    the stream ends."""

    def __init__(self, proc: subprocess.Popen, needle: str):
        self.lines, self.needle, self.event = [], needle, threading.Event()
        self.thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self.thread.start()

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            self.lines.append(line)
            if self.needle in line:
                self.event.set()
        self.event.set()

    def seen(self, timeout: float = 300) -> bool:
        "Whether `needle` showed up (waits for it, or for the end of the stream)."
        self.event.wait(timeout)
        return self.count() > 0

    def count(self) -> int:
        return sum(self.needle in line for line in self.lines)

    def text(self) -> str:
        return "".join(self.lines)[-3000:]


def run_nodes(
    tmp: Path,
    *,
    repo: str,
    transport: str,
    names=("master", "w1", "w2"),
    steps: int = 40,
    env=None,
    **distributed,
) -> dict[str, str]:
    "Run a master and workers to the end; returns each node's output."
    configs = [
        node_config(
            tmp,
            n,
            "master" if i == 0 else "worker",
            repo=repo,
            transport=transport,
            index=i,
            count=len(names),
            steps=steps,
            **distributed,
        )
        for i, n in enumerate(names)
    ]
    procs = [launch(configs[0], env=env)]  # the master first: it creates the repository
    wait_for(
        lambda: (
            events(tmp / names[0] / "metrics.jsonl", "train_start") or procs[0].poll() is not None
        ),
        what="the master",
    )
    procs += [launch(c, env=env) for c in configs[1:]]
    return {name: finish(p) for name, p in zip(names, procs)}


def check_exactly_once(tmp: Path, names, ledger: dict) -> None:
    "Every delta a node uploaded is in the global model exactly once, and nothing is pending."
    folded = Counter(
        tuple(x)
        for e in events(tmp / names[0] / "metrics.jsonl", "outer_step")
        for x in e.get("folded", [])
    )
    assert not [k for k, n in folded.items() if n > 1], (
        f"folded twice: {[k for k, n in folded.items() if n > 1]}"
    )
    for name in names:
        uploaded = {e["step"] for e in events(tmp / name / "metrics.jsonl", "delta_uploaded")}
        top = max(ledger[name]["sessions"].values())
        assert uploaded and max(uploaded) == top, (name, sorted(uploaded), ledger[name])
