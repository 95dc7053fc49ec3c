"""A checkpoint of a job of N processes resumes exactly on M: 2 -> 1, 1 -> 2, 2 -> 4 on CPU (gloo).

Each case trains to step 5 with N processes, then resumes with M to step 12 (`--resume`, the same
output directory); the per-step losses of both parts equal those of one uninterrupted run (rtol
1e-6) and the final weights agree (atol 1e-6), because the data position in a checkpoint is the
job's place in the one sample order (tests/test_sample_order.py) and the global batch stays
`data.target_batch_size`: micro batch 2 with 4, 2 or 1 processes accumulates 1, 2 or 4 microbatches
per step. The model has no dropout: on a resize each rank's RNG is derived from the run seed, the
step and the rank, so a run with dropout continues reproducibly but not with the masks the
uninterrupted run drew.

The source is real prose read as a text stream (read front to back: the hardest position to carry
over). `strategy` is a parameter so that other ways of spreading the model over the ranks join the
same cases.
"""

from __future__ import annotations

import pytest

from test_sample_order import (
    STEPS,
    assert_same_training,
    final_state,
    finish,
    losses,
    source,
    train,
    write_config,
)

STOP = 5  # the first job stops here; the second resumes from its checkpoint
CASES = [
    ("ddp", 2, 1),
    ("ddp", 1, 2),
    ("ddp", 2, 4),
    ("fsdp", 2, 1),
    ("fsdp", 1, 2),
    ("fsdp", 2, 4),
]


def settings(strategy: str) -> dict:
    "The config sections that choose `strategy` (DDP is the default: none)."
    return {} if strategy == "ddp" else {"parallel": {"strategy": strategy}}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    "One uninterrupted 12-step run of one process on the prose (micro batch 2, global batch 8)."
    tmp = tmp_path_factory.mktemp("elastic")
    data = source("text", tmp)
    finish(train(write_config(tmp, "ref", micro=2, target=8, data=data)))
    return tmp, data


@pytest.mark.parametrize("strategy,before,after", CASES, ids=[f"{s}-{n}to{m}" for s, n, m in CASES])
def test_resume_on_another_number_of_processes(reference, strategy, before, after):
    tmp, data = reference
    name = f"{strategy}-{before}to{after}"
    finish(
        train(
            write_config(tmp, name, micro=2, target=8, data=data, steps=STOP, **settings(strategy)),
            nproc=before,
        )
    )
    assert sorted(losses(tmp / f"{name}.jsonl")) == list(range(1, STOP + 1))
    saved = final_state(tmp / name, STOP)
    err = finish(
        train(
            write_config(tmp, name, micro=2, target=8, data=data, **settings(strategy)),
            "--resume",
            nproc=after,
        )
    )
    assert_same_training(tmp, name, "ref")
    assert final_state(tmp / name)["data"] == final_state(tmp / "ref")["data"]
    assert saved["data"]["samples"] == STOP * 8  # the job's position: 5 steps of 8 samples
    assert "Traceback" not in err, err[-3000:]
