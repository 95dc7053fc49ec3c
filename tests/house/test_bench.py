"""bench/bench_trainer.py runs and says where the trainer's microseconds per step go (its figures are not checked:
they are measurements, and this machine is shared)."""

import re, subprocess, sys

from conftest import ROOT, cli_env

PARTS = [
    "move + count the batch",
    "autocast + gradient-sync contexts",
    "resolve the loss, keep it detached",
    "finite check (one scalar read)",
    "read the loss (beyond the plain .item())",
    "the train_step record and emit",
    "pending step, counters, lr, stop flag",
    "the rest (calls, the step and fit structure)",
]


def test_bench_trainer_prints_the_ratio_the_overhead_and_its_breakdown():
    res = subprocess.run(
        [
            sys.executable,
            "bench/bench_trainer.py",
            "--rounds",
            "1",
            "--steps",
            "3",
            "--warmup",
            "1",
        ],
        cwd=ROOT,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout
    assert re.search(
        r"^cpu   fp32 compile=False  plain +\d+ tok/s  trainer +\d+ tok/s  ratio \d\.\d{3} \(median of 1 rounds",
        out,
        re.M,
    ), out
    added = float(
        re.search(
            r"trainer adds (-?\d+) us per step over the plain loop; where it goes:", out
        ).group(1)
    )
    rows = {
        name: float(re.search(rf"^  {re.escape(name)} +(-?\d+\.\d) us$", out, re.M).group(1))
        for name in PARTS
    }
    assert abs(sum(rows.values()) - added) <= 0.5 + 0.05 * len(rows), (
        added,
        rows,
    )  # the rows account for the whole figure
    assert re.search(
        r"^peak RSS \(CPU, own process\): plain [\d.]+ MB  trainer [\d.]+ MB", out, re.M
    ), out
