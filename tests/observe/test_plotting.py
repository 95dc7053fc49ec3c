"""The loss chart of a real resumed run, drawn from its metrics file (speedtronic.plotting, Agg).

`speedtronic train` writes the file: six steps, then `--resume` to ten, then the same folder started
over with `--overwrite`. The chart is one titled curve of one run: the resumed run's ten steps once,
continuous across the resume, with its held-out losses as dots; the run started over is a chart of
its own, never mixed with the first.
"""

import random

import pytest

from conftest import jsonl_records, ok, run_cli

CONFIG = """\
run: {name: chart, seed: 1, max_steps: 6, output_dir: out, device: cpu}
model: {vocab_size: 256, max_seq_len: 16, n_layer: 1, n_head: 2, d_model: 32, d_ff: 64}
data: {text_path: text.txt, block_size: 16, micro_batch_size: 2, target_batch_size: 2}
checkpoint: {every_steps: 2}
logging: {every_steps: 1, json_file: out/metrics.jsonl, loss_plot: false}
eval: {every_steps: 2, holdout_fraction: 0.1}
"""


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory):
    "A run of 6 steps resumed to 10 by the CLI; its metrics file."
    folder = tmp_path_factory.mktemp("chart")
    rng, words = random.Random(0), "the cat sat on a mat and ran to the red door".split()
    (folder / "text.txt").write_text(" ".join(rng.choice(words) for _ in range(20_000)))
    (folder / "run.yaml").write_text(CONFIG)
    ok(run_cli("train", "--config", "run.yaml", cwd=folder))
    ok(run_cli("train", "--config", "run.yaml", "--resume", "--max-steps", "10", cwd=folder))
    return folder


def test_a_resumed_run_is_one_titled_curve(resumed_run):
    from speedtronic.plotting import metrics_figure

    metrics = resumed_run / "out" / "metrics.jsonl"
    steps = jsonl_records(metrics)
    starts = jsonl_records(metrics, "train_start")
    assert [r["start_step"] for r in starts] == [0, 6]  # two invocations wrote the file
    assert len({r["run_id"] for r in steps}) == 1
    fig = metrics_figure(metrics)
    (ax,) = fig.axes
    assert ax.get_title() == "training loss"
    assert [line.get_label() for line in ax.lines] == ["train", "eval"]
    train, held = ax.lines
    assert list(train.get_xdata()) == list(range(1, 11))
    assert list(train.get_ydata()) == [r["loss"] for r in steps]
    evals = jsonl_records(metrics, "eval")
    assert list(held.get_xdata()) == [2, 4, 6, 8, 10] == [r["step"] for r in evals]
    assert list(held.get_ydata()) == [r["val_loss"] for r in evals]
    png = resumed_run / "chart.png"
    fig.savefig(png, dpi=100)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_run_started_over_is_a_chart_of_its_own(resumed_run):
    from speedtronic.plotting import metrics_figure, read_records

    metrics = resumed_run / "out" / "metrics.jsonl"
    first = jsonl_records(metrics)[0]["run_id"]
    ok(run_cli("train", "--config", "run.yaml", "--overwrite", "--max-steps", "3", cwd=resumed_run))
    newest = [r for r in read_records(metrics) if r.get("event") == "train_step"][-1]
    assert newest["run_id"] != first
    (ax,) = metrics_figure(metrics).axes
    assert list(ax.lines[0].get_xdata()) == [1, 2, 3]
    if any(r.get("run_id") == first for r in read_records(metrics)):  # the old run's records kept
        (old,) = metrics_figure(metrics, run_id=first).axes
        assert list(old.lines[0].get_xdata()) == list(range(1, 11))
