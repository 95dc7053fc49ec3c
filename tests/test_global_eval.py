"""The DiLoCo master's held-out loss of every global model it publishes: a master and a worker, each a real
`speedtronic train` process over a shared directory, both with an `eval` source; the master writes one
`global_eval` per published version, the last equal to `evaluate` on the published file loaded on its own,
and the worker writes none."""
from __future__ import annotations

import math

import pytest
import torch
import yaml

from conftest import jsonl_records
from test_diloco_node_faults import ended, launch, node_config
from test_evaluation import held_text
from test_resume import corpus

from speedtronic.config import SpeedtronicConfig
from speedtronic.distributed.tensors import load_safetensors
from speedtronic.evaluation import build_evaluator, evaluate
from speedtronic.registry import build_model


def with_text(cfg, text, held) -> None:
    "Train on the text `text`, evaluate on `held` every 5 steps (a byte vocabulary)."
    raw = yaml.safe_load(cfg.read_text())
    raw["model"]["vocab_size"] = 256
    raw["data"] = {"text_path": str(text), "block_size": 16, "micro_batch_size": 4, "target_batch_size": 4}
    raw["eval"] = {"text_path": str(held), "every_steps": 5, "max_batches": 3}
    cfg.write_text(yaml.safe_dump(raw, sort_keys=False))


def test_master_evaluates_every_published_global_and_workers_do_not(tmp_path):
    text, held = corpus(tmp_path / "corpus.txt"), held_text(tmp_path / "held.txt")
    repo = str(tmp_path / "share" / "repo")
    cfgs = {n: node_config(tmp_path, n, n if n == "master" else "worker", repo=repo, transport="directory", steps=20,
                           expected_nodes=2) for n in ("master", "worker")}
    for cfg in cfgs.values(): with_text(cfg, text, held)
    procs = {n: launch(cfg) for n, cfg in cfgs.items()}
    for n, p in procs.items():
        rc, err, _ = ended(p)
        assert rc == 0, (n, err[-3000:])
    metrics = tmp_path / "master" / "metrics.jsonl"
    evals = jsonl_records(metrics, "global_eval")
    published = [0] + [r["outer_step"] for r in jsonl_records(metrics, "outer_step") if r.get("deltas_included")]
    assert len(published) > 2, published
    assert [r["outer_step"] for r in evals] == published               # each version once, in order, the last too
    assert jsonl_records(tmp_path / "worker" / "metrics.jsonl", "global_eval") == []
    assert jsonl_records(tmp_path / "worker" / "metrics.jsonl", "eval")  # the worker evaluates its own weights only

    config = SpeedtronicConfig.load(cfgs["master"])                   # the published global, loaded on its own
    model = build_model(config.model)
    model.load_state_dict(load_safetensors(tmp_path / "share" / "repo" / "global" / "latest.safetensors"))
    torch.set_num_threads(1)
    expected = evaluate(model, build_evaluator(config, device="cpu").loader, max_batches=3, device="cpu", bytes_per_token=1.0)
    last = evals[-1]
    assert last["global_val_loss"] == expected.loss                   # the same batches, the same CPU arithmetic
    assert last["global_val_ppl"] == pytest.approx(math.exp(last["global_val_loss"]))
    assert last["global_val_bpb"] == pytest.approx(last["global_val_loss"] / math.log(2))
    assert last["val_batches"] == 3
    inner = jsonl_records(metrics, "eval")[-1]                          # the master's own evaluation at its end
    assert inner["step"] == 20 and math.isfinite(inner["val_loss"])
