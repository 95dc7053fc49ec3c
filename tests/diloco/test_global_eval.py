"""The DiLoCo master's held-out loss of every global model it publishes: a master and a worker, each
a real `speedtronic train` process over a shared directory, both with an `eval` source; the master
writes one `global_eval` per published version, the last equal to `evaluate` on the published file
loaded on its own, and the worker writes none."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import yaml

from conftest import jsonl_records
from diloco_nodes import ended, launch, node_config
from test_evaluation import held_text
from test_resume import corpus

from speedtronic.config import SpeedtronicConfig
from speedtronic.distributed.tensors import load_safetensors
from speedtronic.data import select_dataset
from speedtronic.evaluation import build_evaluator, evaluate, holdout_split
from speedtronic.registry import build_model


def with_text(cfg, text, held) -> None:
    """Train on the text `text`, evaluate every 5 steps on `held` (a text file, or the fraction of
    `text` held out; a byte vocabulary)."""
    raw = yaml.safe_load(cfg.read_text())
    raw["model"]["vocab_size"] = 256
    raw["data"] = {
        "text_path": str(text),
        "block_size": 16,
        "micro_batch_size": 4,
        "target_batch_size": 4,
    }
    source = {"holdout_fraction": held} if isinstance(held, float) else {"text_path": str(held)}
    raw["eval"] = {**source, "every_steps": 5, "max_batches": 3}
    cfg.write_text(yaml.safe_dump(raw, sort_keys=False))


@pytest.mark.parametrize("source", ["text_path", "holdout_fraction"])
def test_master_evaluates_every_published_global_and_workers_do_not(tmp_path, source):
    text = corpus(tmp_path / "corpus.txt")
    held = held_text(tmp_path / "held.txt") if source == "text_path" else 0.1
    repo = str(tmp_path / "share" / "repo")
    cfgs = {
        n: node_config(
            tmp_path,
            n,
            n if n == "master" else "worker",
            repo=repo,
            transport="directory",
            steps=20,
            expected_nodes=2,
        )
        for n in ("master", "worker")
    }
    for cfg in cfgs.values():
        with_text(cfg, text, held)
    procs = {n: launch(cfg) for n, cfg in cfgs.items()}
    for n, p in procs.items():
        rc, err, _ = ended(p)
        assert rc == 0, (n, err[-3000:])
    metrics = tmp_path / "master" / "metrics.jsonl"
    evals = jsonl_records(metrics, "global_eval")
    published = [0] + [
        r["outer_step"] for r in jsonl_records(metrics, "outer_step") if r.get("deltas_included")
    ]
    assert len(published) > 2, published
    # each version once, in order, the last too
    assert [r["outer_step"] for r in evals] == published
    assert jsonl_records(tmp_path / "worker" / "metrics.jsonl", "global_eval") == []
    # the worker evaluates its own weights only
    assert jsonl_records(tmp_path / "worker" / "metrics.jsonl", "eval")

    config = SpeedtronicConfig.load(cfgs["master"])  # the published global, loaded on its own
    model = build_model(config.model)
    model.load_state_dict(
        load_safetensors(tmp_path / "share" / "repo" / "global" / "latest.safetensors")
    )
    torch.set_num_threads(1)
    split = (
        holdout_split(select_dataset(config.data, vocab_size=256), held).held_out
        if source == "holdout_fraction"
        else None
    )
    expected = evaluate(
        model,
        build_evaluator(config, device="cpu", held_out=split).loader,
        max_batches=3,
        device="cpu",
        bytes_per_token=1.0,
    )
    last = evals[-1]
    assert last["global_val_loss"] == expected.loss  # the same batches, the same CPU arithmetic
    assert last["global_val_ppl"] == pytest.approx(math.exp(last["global_val_loss"]))
    assert last["global_val_bpb"] == pytest.approx(last["global_val_loss"] / math.log(2))
    assert last["val_batches"] == 3
    inner = jsonl_records(metrics, "eval")[-1]  # the master's own evaluation at its end
    assert inner["step"] == 20 and math.isfinite(inner["val_loss"])


def test_the_global_evaluator_reads_its_own_copy_of_the_held_out_side(tmp_path):
    """A loader keeps the start of its pass on the dataset it reads (`_loader_start`), and the
    master's global evaluator
    reads on its own thread while training evaluates: the two loaders must not share one held-out
    dataset object (they share its tokens)."""
    from speedtronic.runtime import build_runtime

    cfg = node_config(
        tmp_path, "master", "master", repo=str(tmp_path / "repo"), transport="directory", steps=10
    )
    with_text(cfg, corpus(tmp_path / "corpus.txt"), 0.1)
    trainer, _ = build_runtime(yaml.safe_load(cfg.read_text()))
    try:
        watcher = trainer.coordinator.global_watcher
        ours, theirs = trainer.evaluator.loader.dataset, watcher.evaluator.loader.dataset
        assert ours is not theirs and np.shares_memory(ours.tokens, theirs.tokens)
        assert (
            trainer.evaluator(trainer.model).loss
            == evaluate(
                trainer.model,
                watcher.evaluator.loader,
                max_batches=3,
                device="cpu",
                bytes_per_token=1.0,
            ).loss
        )
    finally:
        getattr(trainer.coordinator.global_watcher, "close", lambda: None)()
        trainer.logger.close()
        trainer.run_claim.release()
