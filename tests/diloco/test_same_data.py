"""Nodes that read the same data in file order (issue 26): two real `speedtronic train` nodes over a
shared directory, each reading a text file unshuffled and without shards. Nodes with their own
files warn nothing; nodes on the same file get exactly one warning, from the master, naming both."""

from __future__ import annotations

from pathlib import Path

import yaml
from diloco_nodes import launch, node_config, wait_for

from conftest import communicate_or_dump, jsonl_records

NAMES = ("master", "w1")
SAME = "read the same data in the same order"


def run_two_nodes(tmp: Path, texts: dict[str, Path]) -> dict[str, str]:
    """Run a master and a worker to the end, node `n` reading `texts[n]` in file order; each
    node's stdout and stderr."""
    configs = []
    for i, name in enumerate(NAMES):
        path = node_config(
            tmp,
            name,
            "master" if i == 0 else "worker",
            repo=str(tmp / "repo"),
            transport="directory",
            index=i,
            count=len(NAMES),
            steps=20,
            shard_count=None,
            shard_index=None,
        )
        raw = yaml.safe_load(path.read_text())
        raw["model"]["vocab_size"] = 256  # the byte tokenizer's
        raw["data"] = {**raw["data"], "text_path": str(texts[name]), "shuffle": False}
        path.write_text(yaml.safe_dump(raw, sort_keys=False))
        configs.append(path)
    procs = [launch(configs[0])]  # the master first: it creates the repository
    wait_for(
        lambda: (
            jsonl_records(tmp / NAMES[0] / "metrics.jsonl", "train_start")
            or procs[0].poll() is not None
        ),
        what="the master",
    )
    procs.append(launch(configs[1]))
    outputs = {}
    for name, proc in zip(NAMES, procs):
        out, err = communicate_or_dump(proc, 600)
        assert proc.returncode == 0, (name, out[-2000:], err[-3000:])
        outputs[name] = out + err
    for name in NAMES:  # both nodes trained and sent deltas the master read
        assert jsonl_records(tmp / name / "metrics.jsonl", "delta_uploaded"), name
    return outputs


def text_file(path: Path, words: str) -> Path:
    path.write_text((words + "\n") * 300)
    return path


def test_nodes_each_on_its_own_file_in_file_order_warn_nothing(tmp_path):
    texts = {
        "master": text_file(tmp_path / "master.txt", "the master reads these words in order"),
        "w1": text_file(tmp_path / "w1.txt", "and the worker reads another text of its own"),
    }
    outputs = run_two_nodes(tmp_path, texts)
    for name, output in outputs.items():
        assert "in file order" not in output and SAME not in output, (name, output[-3000:])


def test_nodes_on_the_same_file_in_file_order_get_one_warning_from_the_master(tmp_path):
    shared = text_file(tmp_path / "shared.txt", "every node reads these very same words")
    outputs = run_two_nodes(tmp_path, {"master": shared, "w1": shared})
    said = [line for line in outputs["master"].splitlines() if SAME in line]
    assert len(said) == 1, outputs["master"][-3000:]
    assert "'master'" in said[0] and "'w1'" in said[0] and "distributed.shard_count" in said[0]
    assert SAME not in outputs["w1"] and "in file order" not in outputs["w1"]
