"""A DumbDiLoCo run launched the way clusters launch it: a master and two workers started at the
same moment (three `speedtronic train` processes in a row, no waits between them), on a repository
nobody created, with the distributed keys a Speedtronic 2.0 user writes and 2.0's defaults (outer lr
0.7, Nesterov momentum 0.9), each node on its own text file. Over the loopback Hub stand-in (the
real `huggingface_hub` client) and over a shared directory, with the workers or the master launched
first. Every node must finish, every delta any node uploaded must be folded into the final global
exactly once, and the final global's held-out loss (the library's own evaluation, on text no node
trained on) must be within 2.0's measured ratio of a synchronous single-process run on the same
tokens."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import ROOT, cli_env, jsonl_records, start_cli  # noqa: E402

from speedtronic.checkpoint import load_checkpoint
from speedtronic.config import SpeedtronicConfig
from speedtronic.distributed.tensors import (
    GLOBAL_METADATA_PATH,
    GLOBAL_MODEL_PATH,
    load_safetensors,
)
from speedtronic.evaluation import build_evaluator
from speedtronic.registry import build_model
from speedtronic.runtime import demo_corpus_text

# the held-out loss of asynchronous rounds depends on the nodes keeping pace with each other: no
# other test runs beside these (conftest's `cpu_share`). A node stopped for 3 s twice in a run of
# about 10 s moved this ratio from 1.03 to 1.12; in one suite run beside the other worker's tests it
# came to 1.24 and 1.15 (three busy loops beside them, but nothing else: 1.02 to 1.04)
pytestmark = pytest.mark.cpu_alone
TOKEN = "hf_launch_test_token_0123456789"
NODES = ("master", "worker1", "worker2")
STEPS, INNER = 200, 10  # the run 2.0 was measured on: 200 steps, 2.0's inner_steps 10
RATIO = 1.15  # 2.0's final global against the synchronous run, measured on this kind of run
WAIT = 900  # the most seconds a node may take here (a bound on a hang, not a timing check)


# -- the data: one text file per node, a synchronous run over all of them, and text nobody trains on
@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, Path]:
    """Real English (the standard library's docstrings): a file per node, their concatenation, and a
    held-out tail."""
    text = demo_corpus_text().encode("utf-8")
    folder = tmp_path_factory.mktemp("corpus")
    # 30% per node (at paragraphs), 10% held out
    cuts = [0] + [text.index(b"\n\n", len(text) * i // 10) + 2 for i in (3, 6, 9)]
    files = {name: folder / f"{name}.txt" for name in (*NODES, "all", "held_out")}
    for name, a, b in zip(NODES, cuts, cuts[1:]):
        files[name].write_bytes(text[a:b])
    files["all"].write_bytes(text[: cuts[-1]])
    files["held_out"].write_bytes(text[cuts[-1] :])
    return files


def base_config(out: Path, name: str, text: Path, *, batch: int) -> dict:
    """The run 2.0 was measured on (2 layers of width 64, batches of 8 x 64 bytes), on `text`: only
    keys 2.0 has."""
    return {
        "run": {
            "name": name,
            "seed": 1234,
            "device": "cpu",
            "max_steps": STEPS,
            "output_dir": str(out / name),
        },
        "model": {
            "vocab_size": 256,
            "max_seq_len": 64,
            "n_layer": 2,
            "d_model": 64,
            "n_head": 4,
            "n_kv_head": 2,
        },
        "data": {
            "text_path": str(text),
            "block_size": 64,
            "micro_batch_size": batch,
            "target_batch_size": batch,
        },
        "optimizer": {"name": "adamw", "lr": 3e-3},
        "scheduler": {"warmup_steps": 6},
        "precision": {"mode": "fp32"},
        "checkpoint": {"enabled": True, "every_steps": 100000, "keep_last": 1},
        "logging": {"json_file": str(out / name / "metrics.jsonl"), "every_steps": 20},
    }


def held_out_loss(raw: dict, state: dict, held_out: Path) -> float:
    "The library's held-out evaluation of `state` (a model of `raw`'s shape) on all of `held_out`."
    config = SpeedtronicConfig.from_dict({**raw, "eval": {"text_path": str(held_out)}})
    model = build_model(config.model)
    model.load_state_dict(state)
    return build_evaluator(config, device="cpu")(model).loss


def env_of(**extra: str) -> dict:
    return cli_env(faulthandler=False, HF_HUB_DISABLE_PROGRESS_BARS="1", **extra)


def launch(cfg: Path, env: dict) -> subprocess.Popen:
    """`speedtronic train --config cfg`, its output in `cfg`.log (a file: three chatty nodes cannot
    fill a pipe and stall)."""
    with open(cfg.with_suffix(".log"), "w") as log:
        # `env` is a whole environment (env_of's): over cli_env(faulthandler=False) it is itself
        return start_cli(
            "train",
            "--config",
            str(cfg),
            env=env,
            faulthandler=False,
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def finish(procs: dict[str, subprocess.Popen], work: Path) -> None:
    """Wait for every node; each must exit 0 (its log's tail otherwise). A node still running after
    the others is killed."""
    codes = {}
    try:
        for name, proc in procs.items():
            codes[name] = proc.wait(timeout=WAIT)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    logs = {n: (work / f"{n}.log").read_text() for n in procs}
    failed = {n: (c, logs[n][-3000:]) for n, c in codes.items() if c != 0 or "Traceback" in logs[n]}
    assert len(codes) == len(procs) and not failed, failed or "a node did not end"


@pytest.fixture(scope="module")
def synchronous_loss(corpus, tmp_path_factory) -> float:
    "One process reading every node's tokens: batches of 3 node batches, the same number of steps."
    work = tmp_path_factory.mktemp("synchronous")
    raw = base_config(work, "synchronous", corpus["all"], batch=8 * len(NODES))
    cfg = work / "synchronous.yaml"
    cfg.write_text(yaml.safe_dump(raw, sort_keys=False))
    finish({"synchronous": launch(cfg, env_of())}, work)
    ckpt = load_checkpoint(sorted((work / "synchronous" / "checkpoints").glob("step_*.pt"))[-1])
    assert ckpt["step"] == STEPS
    return held_out_loss(raw, ckpt["model"], corpus["held_out"])


# -- the launch ------------------------------------------------------------------------------------
def node_configs(
    work: Path, corpus: dict[str, Path], repo: str, transport: str | None
) -> dict[str, tuple[dict, Path]]:
    """Each node's config: 2.0's distributed keys (`transport` is ours, for the shared directory)
    and its own text file."""
    out = {}
    for name in NODES:
        raw = base_config(work, name, corpus[name], batch=8)
        raw["distributed"] = {
            "enabled": True,
            "mode": "dumb_diloco",
            "node_id": name,
            "role": "master" if name == "master" else "worker",
            "repo_id": repo,
            "inner_steps": INNER,
            "poll_interval": 1.0,
            "collaborators": [],
            "outer_lr": 0.7,
            "outer_momentum": 0.9,
            **({"transport": transport} if transport else {}),
        }
        path = work / f"{name}.yaml"
        path.write_text(yaml.safe_dump(raw, sort_keys=False))
        out[name] = raw, path
    return out


def test_the_nodes_write_the_distributed_keys_of_a_2_0_config(tmp_path):
    """The launch below runs what 2.0 ran: its nodes' distributed keys and values and its model are
    those of 2.0's own configs."""
    fixtures = ROOT.parent / "shared" / "fixtures" / "v2.0" / "diloco-repo"
    if not fixtures.is_dir():
        pytest.skip("needs ../shared/fixtures/v2.0 beside the checkout")
    files = dict.fromkeys(NODES, Path("all.txt"))
    ours = node_configs(tmp_path, files, "test/run", None)
    for name, theirs in (("master", "master-config.json"), ("worker1", "worker1-config.json")):
        v2 = json.loads((fixtures / theirs).read_text())
        assert ours[name][0]["distributed"] == v2["distributed"]
        assert ours[name][0]["model"] == v2["model"]


ORDERS = {
    "workers_first": ("worker1", "worker2", "master"),
    "master_first": ("master", "worker1", "worker2"),
}


def uploaded_deltas(work: Path) -> set[tuple[str, int]]:
    "Every (node, step) a node says it uploaded (its `delta_uploaded` events)."
    return {
        (n, e["step"])
        for n in NODES
        for e in jsonl_records(work / n / "metrics.jsonl", "delta_uploaded")
    }


def check_folded_exactly_once(work: Path, extras: dict) -> None:
    """The master folded each uploaded delta in exactly one version, nothing else, and the global's
    ledger holds each node's last."""
    uploaded = uploaded_deltas(work)
    folded = Counter(
        tuple(x)
        for e in jsonl_records(work / "master" / "metrics.jsonl", "outer_step")
        for x in e.get("folded", [])
    )
    assert not [k for k, n in folded.items() if n > 1], (
        f"folded more than once: {sorted(k for k, n in folded.items() if n > 1)}"
    )
    assert set(folded) == uploaded, (
        f"uploaded, never folded: {sorted(uploaded - set(folded))}; folded, never uploaded: "
        f"{sorted(set(folded) - uploaded)}"
    )
    for name in NODES:
        steps = sorted(s for n, s in uploaded if n == name)
        assert steps and steps[-1] == STEPS, (name, steps)  # every node sent its last round
        sessions = extras["ledger"][name]["sessions"]
        # one session, folded up to its last step
        assert list(sessions.values()) == [STEPS], (
            name,
            sessions,
        )
    assert not [
        e for n in NODES for e in jsonl_records(work / n / "metrics.jsonl", "delta_rejected")
    ]


@pytest.fixture
def hub_tokens():
    return {TOKEN: "write"}


def within_ratio(launch_once, synchronous_loss: float, what: str) -> None:
    """Run `launch_once(attempt)` (it checks that every delta was folded once and returns the final
    global's held-out loss) and hold that loss to `RATIO` x the synchronous run's. Asynchronous
    rounds fold what has arrived, so the loss depends on the pace the machine gives the three
    processes: a node stalled for seconds (a shared CI machine) moved the ratio from 1.03 to 1.19.
    A loss over the bound is launched again once, from nothing, and that second run must meet it;
    every run's accounting is checked, never retried."""
    losses = []
    for attempt in range(2):
        loss = launch_once(attempt)
        losses.append(loss)
        print(
            f"{what}: held-out loss {loss:.4f}, synchronous {synchronous_loss:.4f}, ratio "
            f"{loss / synchronous_loss:.3f}"
        )
        if loss <= RATIO * synchronous_loss:
            return
    ratios = [round(x / synchronous_loss, 3) for x in losses]
    pytest.fail(f"held-out loss over {RATIO}x the synchronous run's twice: ratios {ratios}")


@pytest.mark.parametrize("order", ORDERS)
def test_three_nodes_launched_together_on_a_hub_repo_nobody_created(
    tmp_path, hub, corpus, synchronous_loss, order
):
    def launch_once(attempt: int) -> float:
        work, repo = tmp_path / f"launch{attempt}", f"org/launched-together-{attempt}"
        work.mkdir()
        configs = node_configs(work, corpus, repo, None)
        env = env_of(HF_ENDPOINT=hub.url, HF_TOKEN=TOKEN)
        assert repo not in hub.repos
        # the same moment: no wait in between
        procs = {name: launch(configs[name][1], env) for name in ORDERS[order]}
        finish(procs, work)
        files = hub.files(repo)
        # every delta was removed by a publication
        assert sorted(files) == [
            GLOBAL_MODEL_PATH,
            GLOBAL_METADATA_PATH,
        ]
        extras = json.loads(files[GLOBAL_METADATA_PATH])
        check_folded_exactly_once(work, extras)
        # the repository's history: each uploaded delta committed once, and deleted once (by the
        # publication that folded it)
        commits = hub.repos[repo].commits
        added = Counter(p for c in commits for p in c.added if p.startswith("nodes/"))
        deleted = Counter(p for c in commits for p in c.deleted)
        assert set(added) == {f"nodes/{n}/delta_{s}.safetensors" for n, s in uploaded_deltas(work)}
        assert set(added.values()) == {1} and deleted == added
        final = work / "final.safetensors"
        final.write_bytes(files[GLOBAL_MODEL_PATH])
        return held_out_loss(configs["master"][0], load_safetensors(final), corpus["held_out"])

    within_ratio(launch_once, synchronous_loss, f"hub {order}")


@pytest.mark.parametrize("order", ORDERS)
def test_three_nodes_launched_together_on_a_shared_directory_nobody_created(
    tmp_path, corpus, synchronous_loss, order
):
    def launch_once(attempt: int) -> float:
        work = tmp_path / f"launch{attempt}"
        repo = work / "share" / "run"
        (work / "share").mkdir(parents=True)  # the share is mounted; the run's folder is not made
        configs = node_configs(work, corpus, str(repo), "directory")
        procs = {name: launch(configs[name][1], env_of()) for name in ORDERS[order]}
        finish(procs, work)
        assert not list(repo.glob("nodes/*/delta_*"))  # every delta was removed by a publication
        extras = json.loads((repo / GLOBAL_METADATA_PATH).read_text())
        check_folded_exactly_once(work, extras)
        return held_out_loss(
            configs["master"][0], load_safetensors(repo / GLOBAL_MODEL_PATH), corpus["held_out"]
        )

    within_ratio(launch_once, synchronous_loss, f"directory {order}")
