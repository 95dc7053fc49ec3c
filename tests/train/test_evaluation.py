"""Held-out evaluation in real runs: it never changes training (bit for bit, also across kill -9 and
resume), the held-out blocks are never trained on, a torchrun job splits the held-out batches and
reduces them once, and bad `eval` settings give one clear line."""

from __future__ import annotations

import json
import math
import random
import signal

import numpy as np
import pytest
import torch
import yaml

from conftest import ROOT, jsonl_records, one_error_line, run_cli, tiny_config
from speedtronic.checkpoint import load_checkpoint
from speedtronic.progress import ProgressBar, TerminalLines
from speedtronic.runtime import build_runtime, train_from_config
from test_parallel import final_state, token_file, torchrun, write_config as job_config
from test_parallel import finish as finish_job
from test_parallel import one_process
from test_resume import STEPS, corpus, finish, kill_at, losses_by_step, start
from test_resume import write_config as resume_config


def with_eval(cfg, **section) -> None:
    "Add an `eval` section to the YAML config at `cfg`."
    raw = yaml.safe_load(cfg.read_text())
    raw["eval"] = section
    cfg.write_text(yaml.safe_dump(raw, sort_keys=False))


def held_text(path):
    "A held-out text of other sentences than the training corpus."
    rng = random.Random(1)
    words = "a held out page of prose that the run never trains on but reads to measure the loss"
    words = words.split()
    path.write_text(
        "\n".join(" ".join(rng.choice(words) for _ in range(10)) for _ in range(60)) + "\n"
    )
    return path


def test_eval_with_kill9_and_resume_trains_bit_identically_to_no_eval(tmp_path, tmp_path_factory):
    """A run with evaluation every 3 steps (dropout 0.1, so a model left in eval mode or a used
    random generator would show), killed with SIGKILL and resumed, has the losses and final weights
    of a run without evaluation, to the bit."""
    ref_dir = tmp_path_factory.mktemp("no-eval")
    ref = resume_config(ref_dir, "ref", workers=0, text=True, every=STEPS)
    finish(start(ref))
    ref_losses = {s: v[-1] for s, v in losses_by_step(ref_dir / "ref.jsonl").items()}
    cfg = resume_config(tmp_path, "run", workers=0, text=True, every=4)
    with_eval(cfg, text_path=str(held_text(tmp_path / "held.txt")), every_steps=3, max_batches=4)
    jsonl = tmp_path / "run.jsonl"
    proc = start(cfg)
    kill_at(proc, jsonl, 13)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    finish(start(cfg, "--resume"))
    got = losses_by_step(jsonl)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step, values in got.items():
        assert all(v == ref_losses[step] for v in values), (step, values, ref_losses[step])
    a = load_checkpoint(ref_dir / "ref" / "checkpoints" / f"step_{STEPS:012d}.pt")["model"]
    b = load_checkpoint(tmp_path / "run" / "checkpoints" / f"step_{STEPS:012d}.pt")["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    evals = jsonl_records(jsonl, "eval")
    assert {r["step"] for r in evals} == set(range(3, STEPS + 1, 3))
    last = evals[-1]
    assert last["step"] == STEPS and last["val_batches"] == 4 and last["val_tokens"] == 4 * 2 * 16
    assert last["val_ppl"] == pytest.approx(math.exp(last["val_loss"]))
    # the byte tokenizer: one token per byte
    assert last["val_bpb"] == pytest.approx(last["val_loss"] / math.log(2))
    by_step = {}
    for r in evals:
        by_step.setdefault(r["step"], []).append(r["val_loss"])
    # an evaluation repeated after the resume agrees
    assert all(len(set(v)) == 1 for v in by_step.values()), by_step


def test_holdout_blocks_are_never_trained_on(tmp_path):
    """The training loader reads the first blocks of the token file, the evaluator the last ones;
    together the file."""
    path = token_file(tmp_path, blocks=200)
    cfg = job_config(
        tmp_path,
        "split",
        micro=4,
        data={"token_file": str(path), "shuffle": True},
        steps=4,
        eval={"holdout_fraction": 0.1, "every_steps": 2},
        logging={"file": str(tmp_path / "split.log")},
    )
    raw = yaml.safe_load(cfg.read_text())
    trainer, _ = build_runtime(raw, device="cpu")
    try:
        train, held = trainer.dataloader.dataset, trainer.evaluator.loader.dataset
        assert (train.num_blocks, held.num_blocks) == (180, 20)
        ids = np.fromfile(path, dtype=np.uint16)
        assert np.array_equal(np.concatenate([train.tokens, held.tokens]), ids)
        # every block a shuffled pass visits
        seen = {int(b) for epoch in range(3) for b in train.block_order(epoch)}
        assert seen == set(range(180))
        result = trainer.fit()
    finally:
        trainer.logger.close()
        trainer.run_claim.release()
    assert [r["step"] for r in result.evals] == [2, 4]
    assert result.val_loss == result.evals[-1]["val_loss"]
    assert result.evals[-1]["val_tokens"] == 20 * 8  # the 20 held-out blocks, 8 targets each
    assert (
        "180 training blocks (1,620 tokens) and 20 held-out blocks (180 tokens)"
        in (tmp_path / "split.log").read_text()
    )


def test_text_holdout_end_to_end(tmp_path):
    """`holdout_fraction` of a text file: a run's result, JSONL and closing line carry the held-out
    loss."""
    text = corpus(tmp_path / "corpus.txt")
    cfg = tiny_config(
        tmp_path,
        max_steps=4,
        data={"synthetic": False, "text_path": str(text)},
        model={"vocab_size": 256},
        eval={"holdout_fraction": 0.2, "max_batches": 3},
        logging={"loss_plot": True},
    )
    result = train_from_config(yaml.safe_load(cfg.read_text()), device="cpu")
    assert [r["step"] for r in result.evals] == [4]  # no cadence: once, at the end
    (record,) = jsonl_records(tmp_path / "metrics.jsonl", "eval")
    assert record["val_loss"] == result.val_loss and record["val_batches"] == 3
    assert f"held-out loss {result.val_loss:.4f}" in result.closing()
    assert (tmp_path / "loss_curve.png").stat().st_size > 0 and result.loss_png()


def test_eval_records_reach_the_live_chart_and_the_terminal():
    """The notebook chart gets the held-out loss as an `eval` point; a terminal shows one short
    `eval` line."""
    pytest.importorskip("ipywidgets")
    pytest.importorskip("matplotlib")  # the `widgets` extra, not our module
    from speedtronic import widgets

    record = {
        "step": 10,
        "val_loss": 2.5,
        "val_ppl": math.exp(2.5),
        "val_bpb": 2.5 / math.log(2),
        "val_tokens": 4096,
        "val_batches": 8,
        "eval_s": 0.25,
    }
    view = widgets.TrainingView()
    bar = ProgressBar(enabled=True, notebook=True)
    bar.view = view
    bar.on_event("eval", record)
    assert view.evals == [(10, 2.5)]
    line = TerminalLines().line("eval", record)
    assert line == "eval  step 10  val_loss   2.5000  ppl 12.18  bpb 3.6067" and len(line) <= 100


def test_the_terminal_progress_line_ends_with_the_newest_held_out_loss(tmp_path):
    """`speedtronic train` with the progress bar on: after an evaluation the bar's line shows `val
    <loss>` (here: the final one's)."""
    cfg = tiny_config(
        tmp_path,
        max_steps=4,
        data={"synthetic": False, "text_path": str(corpus(tmp_path / "corpus.txt"))},
        model={"vocab_size": 256},
        eval={"holdout_fraction": 0.1, "every_steps": 2, "max_batches": 2},
        logging={"progress": True},
    )
    proc = run_cli("train", "--config", str(cfg), "--device", "cpu", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, last = jsonl_records(tmp_path / "metrics.jsonl", "eval")
    drawn = [
        line for line in proc.stderr.replace("\r", "\n").splitlines() if line.startswith("step ")
    ]
    # none before the first
    assert not any("| val" in line for line in drawn if line.startswith(("step 1/", "step 2/")))
    assert drawn[-1].startswith("step 4/4") and drawn[-1].endswith(
        f"| val {last['val_loss']:.4g}"
    ), drawn[-3:]


def test_a_resumed_run_shows_the_held_out_curve_of_the_whole_run(tmp_path):
    """A run stopped at step 4 and resumed to 8: the result and the loss plot carry evaluations 2,
    4, 6, 8, equal to the uninterrupted run's."""
    text = corpus(tmp_path / "corpus.txt")
    sections = dict(
        max_steps=8,
        every_steps=2,
        data={"synthetic": False, "text_path": str(text)},
        model={"vocab_size": 256},
        eval={"holdout_fraction": 0.2, "every_steps": 2, "max_batches": 2},
    )
    (tmp_path / "whole").mkdir()
    whole = train_from_config(
        yaml.safe_load(tiny_config(tmp_path / "whole", **sections).read_text()), device="cpu"
    )
    raw = yaml.safe_load(tiny_config(tmp_path, **sections).read_text())
    trainer, _ = build_runtime(raw, device="cpu")
    try:
        first = trainer.fit(4)  # stopped at step 4 (its schedule is the 8-step run's)
    finally:
        trainer.logger.close()
        trainer.run_claim.release()
    assert [r["step"] for r in first.evals] == [2, 4]
    resumed = train_from_config(raw, device="cpu", resume=True)
    assert [(r["step"], r["val_loss"]) for r in resumed.evals] == [
        (r["step"], r["val_loss"]) for r in whole.evals
    ]
    assert [r["step"] for r in resumed.evals] == [2, 4, 6, 8] and resumed.val_loss == whole.val_loss
    assert [r["step"] for r in resumed.metrics] == list(range(1, 9))


def test_a_resumed_runs_earlier_evaluations_reach_the_live_chart():
    widgets = pytest.importorskip("speedtronic.widgets")
    try:
        view = widgets.TrainingView()
    except ImportError as e:
        pytest.skip(f"the notebook view needs its extra: {e}")
    bar = ProgressBar(enabled=True, notebook=True, make_view=lambda: view)
    bar.earlier, bar.earlier_evals = [(1, 3.0), (2, 2.8)], [(2, 2.9)]
    bar.on_event("train_start", {"start_step": 2, "target_step": 4})
    bar.on_event("eval", {"step": 4, "val_loss": 2.5})
    assert (view.train, view.evals) == ([(1, 3.0), (2, 2.8)], [(2, 2.9), (4, 2.5)])
    bar.close()


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_split_the_held_out_batches_and_agree_with_one_process(tmp_path, strategy):
    """2 ranks x eval batch 4 read the held-out blocks one process reads in batches of 8: the same
    targets in all, and the same loss up to fp32 reduction order (the weights themselves agree to
    ~1e-7, see test_parallel.test_two_ranks_reproduce_one_process). Under fsdp every rank runs the
    sharded forward on its share."""
    data = {"token_file": str(token_file(tmp_path, blocks=120))}
    held = {"holdout_fraction": 0.2, "every_steps": 4}
    one = job_config(tmp_path, "one", micro=8, data=data, steps=8, eval=held)
    two = job_config(
        tmp_path, "two", micro=4, data=data, steps=8, eval=held, parallel={"strategy": strategy}
    )
    finish_job(one_process(one))
    finish_job(torchrun(two))
    a, b = (
        jsonl_records(tmp_path / "one.jsonl", "eval"),
        jsonl_records(tmp_path / "two.jsonl", "eval"),
    )
    assert [r["step"] for r in b] == [4, 8]  # rank 0 writes, once per evaluation
    for x, y in zip(a, b, strict=True):
        assert (x["val_tokens"], x["val_batches"] * 2) == (y["val_tokens"], y["val_batches"])
        assert y["val_loss"] == pytest.approx(x["val_loss"], rel=1e-5)


@pytest.mark.parametrize(
    "section,needles",
    [
        ({"every_steps": "often", "holdout_fraction": 0.1}, ["eval.every_steps", "expected"]),
        ({"every_steps": 100}, ["eval.every_steps", "no held-out source"]),
        (
            {"holdout_fraction": 0.2, "text_path": "x.txt"},
            ["eval.holdout_fraction", "choose one held-out source"],
        ),
        (
            {"holdout_fraction": 0.2},
            ["eval.holdout_fraction", "data.text_path, data.token_file or data.hf_dataset"],
        ),
        (
            {"every_step": 5, "holdout_fraction": 0.1},
            ["eval.every_step: unknown key", "eval.every_steps"],
        ),
    ],
)
def test_bad_eval_settings_are_one_line(tmp_path, section, needles):
    cfg = tiny_config(tmp_path, eval=section)
    one_error_line(run_cli("validate", "--config", str(cfg), cwd=tmp_path), *needles)


def test_missing_or_too_small_held_out_data_is_one_line(tmp_path):
    cfg = tiny_config(tmp_path, eval={"token_file": str(tmp_path / "missing.bin")})
    one_error_line(
        run_cli("validate", "--deep", "--config", str(cfg), cwd=tmp_path),
        "eval.token_file",
        "missing.bin",
    )
    one_error_line(run_cli("train", "--config", str(cfg), cwd=tmp_path), "eval.token_file")
    (tmp_path / "short.txt").write_text("too short")
    short = tiny_config(tmp_path, "short.yaml", eval={"text_path": str(tmp_path / "short.txt")})
    line = one_error_line(
        run_cli("train", "--config", str(short), cwd=tmp_path),
        "eval.text_path",
        "short.txt",
        "block",
    )
    assert "data.text_path" not in line, line
    small = tiny_config(
        tmp_path,
        "small.yaml",
        data={"synthetic": False, "token_file": str(token_file(tmp_path, blocks=2))},
        model={"vocab_size": 64},
        eval={"holdout_fraction": 0.9},
    )
    one_error_line(
        run_cli("train", "--config", str(small), cwd=tmp_path),
        "eval.holdout_fraction",
        "leaves no block to train on",
    )


def test_a_diloco_node_shuffles_its_training_side_with_its_own_seed(tmp_path):
    """Without shards each DiLoCo node reads the data in its own order; a held-out split keeps that
    order per node."""
    from speedtronic.parallel import World
    from speedtronic.runtime import _holdout, _loader
    from speedtronic.config import SpeedtronicConfig

    path = token_file(tmp_path, blocks=100)

    def order(node: str, fraction: float):
        cfg = SpeedtronicConfig.from_dict(
            {
                "model": {"vocab_size": 64},
                "data": {"token_file": str(path), "shuffle": True, "block_size": 8},
                "eval": {"holdout_fraction": fraction},
                "distributed": {
                    "enabled": True,
                    "transport": "directory",
                    "repo_id": str(tmp_path / "repo"),
                    "node_id": node,
                },
            }
        )
        split = _holdout(cfg, 64)
        loader = _loader(
            cfg, torch.nn.Linear(1, 1), torch.device("cpu"), World(), dataset=split.train
        )
        return loader.dataset.block_order(0).tolist()

    a, b = order("a", 0.1), order("b", 0.1)
    assert sorted(a) == sorted(b) == list(range(90)) and a != b


def test_validate_deep_says_how_many_tokens_each_side_gets(tmp_path):
    path = token_file(tmp_path, blocks=40)  # 360 ids: 21 blocks of 17 and a last one of 3
    cfg = tiny_config(
        tmp_path,
        data={"synthetic": False, "token_file": str(path)},
        model={"vocab_size": 64},
        eval={"holdout_fraction": 0.25},
    )
    proc = run_cli("validate", "--deep", "--config", str(cfg), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "16 training blocks (272 tokens) and 6 held-out blocks (88 tokens)" in proc.stderr, (
        proc.stderr
    )


def test_bits_per_byte_with_a_tokenizer_json(tmp_path):
    """With a `tokenizer.json` each token stands for the bytes it decodes to: here a word and its
    space, 4 bytes."""
    tokenizers = pytest.importorskip("tokenizers")
    from speedtronic.config import SpeedtronicConfig
    from speedtronic.evaluation import build_evaluator
    from speedtronic.registry import build_model

    tok = tokenizers.Tokenizer(
        tokenizers.models.WordLevel(
            vocab={"[UNK]": 0, "the": 1, "cat": 2, "sat": 3}, unk_token="[UNK]"
        )
    )
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "words.json"))
    (tmp_path / "held.txt").write_text("the cat sat\n" * 300)
    cfg = SpeedtronicConfig.from_dict(
        {
            "model": {
                "vocab_size": 64,
                "max_seq_len": 16,
                "n_layer": 1,
                "n_head": 2,
                "d_model": 32,
                "d_ff": 64,
            },
            "data": {"tokenizer": str(tmp_path / "words.json"), "micro_batch_size": 4},
            "eval": {"text_path": str(tmp_path / "held.txt"), "max_batches": 2},
        }
    )
    evaluator = build_evaluator(cfg, device="cpu", vocab_size=64)
    assert evaluator.bytes_per_token == pytest.approx(4.0, abs=0.01)
    torch.manual_seed(0)
    result = evaluator(build_model(cfg.model))
    assert result.tokens == 2 * 4 * 16
    assert result.bpb == pytest.approx(result.loss / math.log(2) / evaluator.bytes_per_token)


def test_tensorboard_gets_the_held_out_scalars(tmp_path):
    """A run's `eval` events reach TensorBoard as `eval/val_loss`, `eval/val_ppl`, `eval/val_bpb` at
    their steps."""
    pytest.importorskip("tensorboard")  # the optional `logging` extra
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = tiny_config(
        tmp_path,
        max_steps=4,
        data={"synthetic": False, "text_path": str(corpus(tmp_path / "corpus.txt"))},
        model={"vocab_size": 256},
        eval={"holdout_fraction": 0.1, "every_steps": 2, "max_batches": 2},
        logging={"tensorboard_dir": str(tmp_path / "tb")},
    )
    result = train_from_config(yaml.safe_load(cfg.read_text()), device="cpu")
    acc = EventAccumulator(str(tmp_path / "tb")).Reload()
    assert {"eval/val_loss", "eval/val_ppl", "eval/val_bpb", "eval/val_tokens"} <= set(
        acc.Tags()["scalars"]
    )
    assert [(e.step, e.value) for e in acc.Scalars("eval/val_loss")] == [
        (r["step"], pytest.approx(r["val_loss"])) for r in result.evals
    ]
    assert [r["step"] for r in result.evals] == [2, 4]


def wandb_rows(folder):
    """The logged rows of the one offline W&B run under `folder`, read from its `.wandb` file (a
    record log of protobuf records)."""
    from wandb.proto import wandb_internal_pb2

    (path,) = folder.glob("wandb/offline-run-*/run-*.wandb")
    # a 7-byte file header, then 32 KiB blocks
    data, pos, pending, rows = (
        path.read_bytes(),
        7,
        b"",
        [],
    )
    while pos + 7 <= len(data):
        if (left := 32768 - pos % 32768) < 7:
            pos += left
            continue  # a block's tail too short for a header is padding
        # crc32, length, full/first/middle/last
        length, kind = (
            int.from_bytes(data[pos + 4 : pos + 6], "little"),
            data[pos + 6],
        )
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                rows.append(
                    {
                        i.key or "/".join(i.nested_key): json.loads(i.value_json)
                        for i in record.history.item
                    }
                )
    return rows


def test_wandb_gets_the_held_out_metrics_and_the_samples(tmp_path):
    """An offline W&B run of `speedtronic train` holds each `eval` (val_loss, val_ppl, val_bpb at
    its step) and each `sample` text."""
    pytest.importorskip("wandb")
    cfg = tiny_config(
        tmp_path,
        max_steps=4,
        data={"synthetic": False, "text_path": str(corpus(tmp_path / "corpus.txt"))},
        model={"vocab_size": 256},
        eval={
            "holdout_fraction": 0.1,
            "every_steps": 2,
            "max_batches": 2,
            "sample_prompts": ["the "],
            "sample_tokens": 8,
        },
        logging={"wandb": {"project": "held-out", "mode": "offline", "dir": str(tmp_path / "wb")}},
    )
    proc = run_cli(
        "train", "--config", str(cfg), "--device", "cpu", cwd=tmp_path, env={"WANDB_SILENT": "true"}
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = wandb_rows(tmp_path / "wb")
    keys = ("step", "val_loss", "val_ppl", "val_bpb", "val_tokens")
    assert [{k: r[k] for k in keys} for r in rows if r.get("event") == "eval"] == [
        {k: r[k] for k in keys} for r in jsonl_records(tmp_path / "metrics.jsonl", "eval")
    ]
    assert [(r["step"], r["text"]) for r in rows if r.get("event") == "sample"] == [
        (r["step"], r["text"]) for r in jsonl_records(tmp_path / "metrics.jsonl", "sample")
    ]
    assert [r["step"] for r in rows if r.get("event") == "eval"] == [2, 4]
