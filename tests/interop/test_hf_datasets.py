"""`data.hf_dataset` end to end: kill -9 of a CLI run and `--resume` give the uninterrupted run's
losses, bad input is one line."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

datasets = pytest.importorskip("datasets")

from conftest import ROOT, cli_env, jsonl_records, one_error_line, run_cli, start_cli
from conftest import spawn, torchrun_command

STEPS = 30
WORDS = (
    "a loader that knows where it is hands out the same batches after a crash as before it so the "
    "resumed run is the run that was never stopped"
).split()


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    "The same rows as a parquet file, a folder of two JSON lines files, and a few broken datasets."
    d = tmp_path_factory.mktemp("hf")
    rng = random.Random(0)
    rows = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 16))) for _ in range(300)]
    table = datasets.Dataset.from_dict({"text": rows, "id": list(range(len(rows)))})
    table.to_parquet(d / "rows.parquet")
    (d / "parts").mkdir()
    table.select(range(150)).to_json(d / "parts" / "a.jsonl")
    table.select(range(150, 300)).to_json(d / "parts" / "b.jsonl")
    datasets.Dataset.from_dict(
        {"text": []}, features=datasets.Features({"text": datasets.Value("string")})
    ).to_parquet(d / "empty.parquet")
    return d


def env(tmp: Path) -> dict:
    "The `datasets` cache in the test's folder; the Hub never asked."
    return {"HF_DATASETS_CACHE": str(tmp / "hf-cache"), "HF_HUB_OFFLINE": "1"}


def write_config(
    tmp: Path, name: str, hf_dataset, *, workers: int = 0, every: int = 2, **data
) -> Path:
    raw = {
        "run": {"name": name, "seed": 7, "max_steps": STEPS, "output_dir": str(tmp / name)},
        "model": {
            "vocab_size": 256,
            "max_seq_len": 16,
            "n_layer": 1,
            "n_head": 4,
            "n_kv_head": 2,
            "d_model": 32,
            "d_ff": 64,
            "dropout": 0.1,
        },
        "data": {
            "hf_dataset": hf_dataset,
            "micro_batch_size": 2,
            "target_batch_size": 4,
            "num_workers": workers,
            "block_size": 16,
            **data,
        },
        "optimizer": {"lr": 3e-3, "weight_decay": 0.01, "grad_clip": 1.0},
        "scheduler": {"warmup_steps": 3},
        "precision": {"mode": "fp32"},
        "checkpoint": {"every_steps": every, "keep_last": None},
        "logging": {
            "json_file": str(tmp / f"{name}.jsonl"),
            "every_steps": 1,
            "progress": False,
            "loss_plot": False,
        },
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def start(cfg: Path, tmp: Path, *extra: str) -> subprocess.Popen:
    return start_cli(
        "train",
        "--config",
        str(cfg),
        "--device",
        "cpu",
        *extra,
        env=env(tmp),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def finish(proc: subprocess.Popen) -> None:
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]


def losses(jsonl: Path) -> dict[int, list[float]]:
    by = {}
    for r in jsonl_records(jsonl):
        by.setdefault(r["step"], []).append(r["loss"])
    return by


def kill_at(proc: subprocess.Popen, jsonl: Path, step: int) -> None:
    """SIGKILL `proc` once its metrics file shows `step`; the file is read as lines are appended (no
    fixed sleeps)."""
    import time

    while proc.poll() is None:
        if any(r["step"] >= step for r in jsonl_records(jsonl)):
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.005)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, (
        f"the run ended before step {step}: {proc.stderr.read()[-2000:]}"
    )


SOURCES = {
    "parquet-shuffled-workers2": (lambda d: str(d / "rows.parquet"), {"shuffle": True}, 2),
    "parquet-workers0": (lambda d: {"path": str(d / "rows.parquet"), "text_field": "text"}, {}, 0),
    "jsonl-streaming-workers2": (lambda d: {"path": str(d / "parts"), "streaming": True}, {}, 2),
}


@pytest.mark.parametrize("source", list(SOURCES))
def test_kill9_and_resume_gives_the_uninterrupted_losses(tmp_path, data_dir, source):
    spec, data, workers = SOURCES[source]
    ref = write_config(tmp_path, "ref", spec(data_dir), workers=workers, every=STEPS, **data)
    finish(start(ref, tmp_path))
    expected = {s: v[-1] for s, v in losses(tmp_path / "ref.jsonl").items()}
    assert sorted(expected) == list(range(1, STEPS + 1))

    cfg = write_config(tmp_path, "run", spec(data_dir), workers=workers, **data)
    proc = start(cfg, tmp_path)
    kill_at(proc, tmp_path / "run.jsonl", random.Random(source).randint(3, 15))
    assert not jsonl_records(tmp_path / "run.jsonl", "train_end")
    finish(start(cfg, tmp_path, "--resume"))
    got = losses(tmp_path / "run.jsonl")
    assert sorted(got) == list(range(1, STEPS + 1))
    for step, values in got.items():  # the killed process's records and the resumed one's
        assert all(v == expected[step] for v in values), (step, values, expected[step])


def test_resume_on_other_rows_is_refused(tmp_path, data_dir):
    rows = tmp_path / "rows.parquet"
    rows.write_bytes((data_dir / "rows.parquet").read_bytes())
    cfg = write_config(tmp_path, "run", str(rows))
    finish(start(cfg, tmp_path))
    datasets.Dataset.from_dict({"text": ["other rows, same place"] * 100}).to_parquet(rows)
    cfg.write_text(cfg.read_text().replace(f"max_steps: {STEPS}", f"max_steps: {STEPS + 4}"))
    proc = run_cli(
        "train",
        "--config",
        str(cfg),
        "--device",
        "cpu",
        "--resume",
        cwd=tmp_path,
        env=env(tmp_path),
    )
    one_error_line(proc, "the data differs", "content")


BAD = {
    "missing-path": (lambda d: str(d / "nope.parquet"), "data.hf_dataset.path", "does not exist"),
    "missing-column": (
        lambda d: {"path": str(d / "rows.parquet"), "text_field": "body"},
        "data.hf_dataset.text_field 'body'",
        "is not a column",
        "columns: text, id",
    ),
    "non-text-column": (
        lambda d: {"path": str(d / "rows.parquet"), "text_field": "id"},
        "data.hf_dataset.text_field 'id'",
        "holds int64 values, not text",
    ),
    "empty-split": (lambda d: str(d / "empty.parquet"), "holds no rows", "data.hf_dataset.split"),
    "unknown-split": (
        lambda d: {"path": str(d / "rows.parquet"), "split": "dev"},
        "cannot be loaded",
        "data.hf_dataset.path, split",
    ),
    "unknown-key": (
        lambda d: {"path": str(d / "rows.parquet"), "column": "text"},
        "data.hf_dataset.column: unknown key",
    ),
    "wrong-type": (
        lambda d: {"path": str(d / "rows.parquet"), "streaming": "yes"},
        "data.hf_dataset.streaming: expected true or false",
    ),
    "streamed-missing-column": (
        lambda d: {"path": str(d / "parts"), "streaming": True, "text_field": "body"},
        "data.hf_dataset.text_field 'body'",
        "is not a column",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_dataset_is_one_line_and_exit_2(tmp_path, data_dir, case):
    spec, *needles = BAD[case]
    cfg = write_config(tmp_path, "bad", spec(data_dir))
    one_error_line(
        run_cli("train", "--config", str(cfg), "--device", "cpu", cwd=tmp_path, env=env(tmp_path)),
        *needles,
    )
    assert not (tmp_path / "bad" / "checkpoints").exists() or not any(
        (tmp_path / "bad" / "checkpoints").iterdir()
    )


def test_validate_deep_reports_the_column(tmp_path, data_dir):
    cfg = write_config(
        tmp_path, "bad", {"path": str(data_dir / "rows.parquet"), "text_field": "body"}
    )
    one_error_line(
        run_cli("validate", "--deep", "--config", str(cfg), cwd=tmp_path, env=env(tmp_path)),
        "data.hf_dataset.text_field 'body'",
    )


@pytest.mark.parametrize("command", ["train", "validate --deep"])
def test_without_datasets_installed_the_error_names_the_extra(tmp_path, data_dir, command):
    """`datasets` made unimportable the way a missing package is (`sys.modules[name] = None`), then
    the real CLI."""
    cfg = write_config(tmp_path, "run", str(data_dir / "rows.parquet"))
    code = (
        "import sys; sys.modules['datasets'] = None; from speedtronic.cli import main; "
        f"sys.exit(main([*{command.split()!r}, '--config', {str(cfg)!r}, '--device', 'cpu']))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=cli_env(**env(tmp_path)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    one_error_line(proc, "data.hf_dataset needs datasets", "pip install 'speedtronic[datasets]'")


def test_import_speedtronic_data_does_not_import_datasets():
    code = (
        "import sys, speedtronic, speedtronic.data, speedtronic.cli, speedtronic.runtime; "
        "print('datasets' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.stdout.strip() == "False", out.stderr[-2000:]


def one_process_and_two_ranks_agree(
    tmp_path: Path, one: Path, two: Path, *, eval_micro: bool = False
) -> None:
    """Train `one` in one process and `two` under 2 torchrun ranks (8 steps, no dropout, AdamW eps 1
    without weight decay; `eval_micro`: the held-out micro batch as the training one) and check
    their per-step losses agree."""
    from conftest import free_port

    for cfg in (one, two):
        raw = yaml.safe_load(cfg.read_text())
        raw["model"]["dropout"] = 0.0
        raw["run"]["max_steps"] = 8
        raw["optimizer"].update(eps=1.0, weight_decay=0.0)
        if eval_micro:
            raw["eval"]["micro_batch_size"] = raw["data"]["micro_batch_size"]
        cfg.write_text(yaml.safe_dump(raw, sort_keys=False))
    finish(start(one, tmp_path))
    cmd = torchrun_command("-m", "speedtronic", "train", "--config", two, "--device", "cpu")
    finish(
        spawn(
            cmd,
            cwd=ROOT,
            env=cli_env(**env(tmp_path)),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
    )
    a, b = losses(tmp_path / "one.jsonl"), losses(tmp_path / "two.jsonl")
    assert sorted(b) == sorted(a) == list(range(1, 9))
    for step, (loss,) in b.items():
        assert loss == pytest.approx(a[step][0], rel=1e-6, abs=0), step


def test_two_torchrun_ranks_read_what_one_process_reads(tmp_path, data_dir):
    """Two ranks with micro batches of 4 against one process with 8: the same per-step losses (see
    test_parallel for the tolerance)."""
    spec = str(data_dir / "rows.parquet")
    one = write_config(
        tmp_path, "one", spec, every=STEPS, shuffle=True, micro_batch_size=8, target_batch_size=8
    )
    two = write_config(
        tmp_path, "two", spec, every=STEPS, shuffle=True, micro_batch_size=4, target_batch_size=8
    )
    one_process_and_two_ranks_agree(tmp_path, one, two)


def test_diloco_node_shards_split_the_batches_and_resume(tmp_path, data_dir, monkeypatch):
    """Two DiLoCo nodes' shards of one dataset take alternate batches; a shard restored from its
    state goes on exactly."""
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    from speedtronic.config import DataConfig, DistributedConfig
    from speedtronic.data import build_dataloader
    from speedtronic.distributed import shard_loader

    conf = DataConfig(
        hf_dataset=str(data_dir / "rows.parquet"),
        block_size=16,
        micro_batch_size=2,
        shuffle=True,
        seed=3,
    )
    node = lambda i: shard_loader(
        build_dataloader(conf, vocab_size=256),
        DistributedConfig(
            enabled=True,
            repo_id=str(tmp_path / "repo"),
            transport="directory",
            shard_count=2,
            shard_index=i,
        ),
    )

    def take(loader, n):
        it = iter(loader)
        return [next(it)["input_ids"] for _ in range(n)]

    every = take(build_dataloader(conf, vocab_size=256), 20)
    shards = [take(node(i), 10) for i in (0, 1)]
    assert all(x.equal(y) for x, y in zip(shards[0] + shards[1], every[0::2] + every[1::2]))
    first = node(1)
    take(first, 4)
    resumed = node(1)
    resumed.load_state_dict(first.state_dict())
    assert all(x.equal(y) for x, y in zip(take(resumed, 6), every[9::2]))


def test_validate_deep_reports_a_missing_tokenizers_package_too(tmp_path):
    """The same class: `data.tokenizer` needs `tokenizers`; `validate --deep` names the extra
    instead of passing."""
    (tmp_path / "corpus.txt").write_text("some text to read\n" * 50)
    (tmp_path / "tokenizer.json").write_text("{}")
    cfg = write_config(
        tmp_path,
        "run",
        None,
        text_path=str(tmp_path / "corpus.txt"),
        tokenizer=str(tmp_path / "tokenizer.json"),
    )
    code = (
        "import sys; sys.modules['tokenizers'] = None; from speedtronic.cli import main; "
        f"sys.exit(main(['validate', '--deep', '--config', {str(cfg)!r}]))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    one_error_line(proc, "needs tokenizers", "pip install 'speedtronic[tokenizers]'")


def test_prepare_reads_a_dataset_and_keeps_an_unrelated_json(tmp_path, data_dir):
    """`speedtronic prepare --hf-dataset` writes the tokens the in-memory source reads, and refuses
    to replace a JSON it was not given."""
    from speedtronic.hf_datasets import prepare_hf_dataset

    out = tmp_path / "tok.bin"
    run = run_cli(
        "prepare",
        "--hf-dataset",
        str(data_dir / "rows.parquet"),
        str(out),
        cwd=tmp_path,
        env=env(tmp_path),
    )
    assert run.returncode == 0, run.stderr[-2000:]
    prepare_hf_dataset(str(data_dir / "rows.parquet"), tmp_path / "direct.bin")
    assert out.read_bytes() == (tmp_path / "direct.bin").read_bytes() and out.stat().st_size > 0
    mine = tmp_path / "notes.bin.json"
    mine.write_text('{"mine": true}\n')
    refused = run_cli(
        "prepare",
        "--hf-dataset",
        str(data_dir / "rows.parquet"),
        str(tmp_path / "notes.bin"),
        cwd=tmp_path,
        env=env(tmp_path),
    )
    one_error_line(refused, "notes.bin.json", "--overwrite")
    assert mine.read_text() == '{"mine": true}\n' and not (tmp_path / "notes.bin").exists()


HOLDOUTS = {
    "in-memory": lambda d: str(d / "rows.parquet"),
    "streamed": lambda d: {"path": str(d / "parts"), "streaming": True},
}


def with_holdout(cfg: Path, fraction: float = 0.1, every: int = 5) -> Path:
    raw = yaml.safe_load(cfg.read_text())
    raw["eval"] = {"holdout_fraction": fraction, "every_steps": every, "max_batches": 4}
    cfg.write_text(yaml.safe_dump(raw, sort_keys=False))
    return cfg


@pytest.mark.parametrize("kind", list(HOLDOUTS))
def test_a_held_out_fraction_of_a_dataset_is_never_trained_on(
    tmp_path, data_dir, monkeypatch, kind
):
    """The training and held-out sides of a dataset (in memory or streamed) are disjoint and
    together every block."""
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    from speedtronic.config import SpeedtronicConfig
    from speedtronic.data import select_dataset
    from speedtronic.runtime import build_runtime

    cfg = with_holdout(write_config(tmp_path, "run", HOLDOUTS[kind](data_dir)), fraction=0.25)
    raw = yaml.safe_load(cfg.read_text())
    raw["data"]["shuffle"] = False
    trainer, _ = build_runtime(raw, device="cpu")
    try:
        train, held = trainer.dataloader.dataset, trainer.evaluator.loader.dataset
        whole = select_dataset(SpeedtronicConfig.from_dict(raw).data, vocab_size=256)
        block = lambda s: tuple(s["input_ids"].tolist() + s["labels"].tolist()[-1:])
        every, a, b = [block(s) for s in whole], [block(s) for s in train], [block(s) for s in held]
        assert sorted(a + b) == sorted(every) and len(b) >= len(every) // 5
        assert not set(a) & set(b)  # no block on both sides
        result = trainer.fit()
    finally:
        trainer.logger.close()
        trainer.run_claim.release()
    assert [r["step"] for r in result.evals] == [5, 10, 15, 20, 25, 30]
    assert result.evals[-1]["val_bpb"] is not None  # the byte tokenizer knows its bytes


@pytest.mark.parametrize("kind", list(HOLDOUTS))
def test_kill9_and_resume_with_a_held_out_fraction_gives_the_uninterrupted_run(
    tmp_path, data_dir, kind
):
    ref = with_holdout(write_config(tmp_path, "ref", HOLDOUTS[kind](data_dir), every=STEPS))
    finish(start(ref, tmp_path))
    expected = {s: v[-1] for s, v in losses(tmp_path / "ref.jsonl").items()}
    held = {r["step"]: r["val_loss"] for r in jsonl_records(tmp_path / "ref.jsonl", "eval")}
    assert sorted(held) == [5, 10, 15, 20, 25, 30]
    cfg = with_holdout(write_config(tmp_path, "run", HOLDOUTS[kind](data_dir)))
    proc = start(cfg, tmp_path)
    kill_at(proc, tmp_path / "run.jsonl", random.Random(kind).randint(6, 14))
    finish(start(cfg, tmp_path, "--resume"))
    got = losses(tmp_path / "run.jsonl")
    assert sorted(got) == list(range(1, STEPS + 1))
    for step, values in got.items():
        assert all(v == expected[step] for v in values), (step, values, expected[step])
    for r in jsonl_records(tmp_path / "run.jsonl", "eval"):
        assert r["val_loss"] == held[r["step"]], r


@pytest.mark.parametrize(
    "kind, needle",
    [
        ("in-memory", "training blocks ("),
        ("streamed", "is streamed, so the tokens each side gets are not known"),
    ],
)
def test_validate_deep_says_what_each_side_of_a_dataset_gets(tmp_path, data_dir, kind, needle):
    cfg = with_holdout(write_config(tmp_path, "run", HOLDOUTS[kind](data_dir)))
    proc = run_cli("validate", "--deep", "--config", str(cfg), cwd=tmp_path, env=env(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "eval.holdout_fraction: data.hf_dataset" in proc.stderr and needle in proc.stderr, (
        proc.stderr
    )


def test_two_torchrun_ranks_split_a_streamed_held_out_side_as_one_process_reads_it(
    tmp_path, data_dir
):
    """A streamed dataset with a held-out fraction: 2 ranks x 4 give one process's (x 8) losses and
    held-out losses, each rank its share."""
    spec = {"path": str(data_dir / "parts"), "streaming": True}
    one = with_holdout(
        write_config(tmp_path, "one", spec, every=STEPS, micro_batch_size=8, target_batch_size=8),
        every=4,
    )
    two = with_holdout(
        write_config(tmp_path, "two", spec, every=STEPS, micro_batch_size=4, target_batch_size=8),
        every=4,
    )
    one_process_and_two_ranks_agree(tmp_path, one, two, eval_micro=True)
    x, y = (
        jsonl_records(tmp_path / "one.jsonl", "eval"),
        jsonl_records(tmp_path / "two.jsonl", "eval"),
    )
    assert [r["step"] for r in x] == [r["step"] for r in y] == [4, 8]
    for p, q in zip(x, y):
        assert (p["val_tokens"], p["val_batches"] * 2) == (q["val_tokens"], q["val_batches"])
        assert q["val_loss"] == pytest.approx(p["val_loss"], rel=1e-5)


def test_an_arrow_file_and_a_save_to_disk_folder_train_as_the_parquet_of_the_same_rows(
    tmp_path, data_dir
):
    """The same 300 rows as parquet, as the arrow file of a saved Dataset, and as a saved
    DatasetDict's split: the same losses."""
    table = datasets.Dataset.from_parquet(
        str(data_dir / "rows.parquet"), cache_dir=str(tmp_path / "hf-cache")
    )
    table.save_to_disk(tmp_path / "one")
    datasets.DatasetDict({"train": table, "test": table.select(range(10))}).save_to_disk(
        tmp_path / "saved"
    )
    (arrow,) = (tmp_path / "one").glob("*.arrow")
    specs = {
        "parquet": str(data_dir / "rows.parquet"),
        "arrow": str(arrow),
        "saved": {"path": str(tmp_path / "saved"), "split": "train"},
    }
    got = {}
    for name, spec in specs.items():
        finish(start(write_config(tmp_path, name, spec, every=STEPS, shuffle=True), tmp_path))
        got[name] = losses(tmp_path / f"{name}.jsonl")
    assert sorted(got["parquet"]) == list(range(1, STEPS + 1))
    assert got["arrow"] == got["parquet"] == got["saved"]
