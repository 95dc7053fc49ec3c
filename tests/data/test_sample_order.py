"""One sample order for every job size: 2 ranks x micro batch 4 train exactly as 1 process x micro
batch 8.

Real processes under torchrun on CPU (gloo), the real CLI, for every kind of source: real English
prose (a text stream read front to back), a prepared token file (random access, shuffled), synthetic
tokens (map-style, shuffled), and a `datasets` dataset saved to disk, in memory and streamed. The
2-rank job reads with `data.num_workers` 0 and 2; the one process reads with none: the order depends
on neither.

Why a tolerance at all (see tests/test_parallel.py for the arithmetic): the ranks add the same
gradient contributions in another order, so losses agree to rtol 1e-6 and the weights to atol 1e-6;
one sample given to the wrong step moves a loss by ~1e-3. The runs are tiny (one layer, 12 steps)
and read less than one pass, so no microbatch holds a source's short last block: a padded
microbatch's loss is the mean over its own tokens, which the ranks' equal-weight average does not
reproduce.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from conftest import ROOT, cli_env, free_port, jsonl_records
from conftest import spawn, torchrun_command
from speedtronic.checkpoint import load_checkpoint
from speedtronic.tokens import TOKEN_FILE_FORMAT

STEPS = 12

PROSE = """\
The river rises in the hills above the town, where the snow lies late into spring and the first
thaw comes down the valley as a cold, fast stream. By the time it reaches the old mill it has
slowed and widened, and in summer children wade across it at the ford below the church, holding
their shoes above their heads. The miller's family kept the weir in repair for three generations,
and when the mill closed the town council took it over, though nobody quite knew what to do with it.

In the autumn the water turns brown with the leaves of the beech woods, and the fishermen say that
is the best time for trout. They stand along the bank in the early morning, when the mist still
hangs over the meadows, and they do not talk much. A heron usually stands with them, a little way
downstream, as patient as any of them and rather more successful.

Winter floods are another matter. Twice in living memory the river has come over the embankment
and into the lower streets, and the marks on the wall of the inn show how high it reached. The
older people remember carrying furniture upstairs by candlelight, and the smell of the mud that
the water left behind, which lingered in the cellars until the following summer. After the second
flood the council built a new wall and planted willows along the bank to hold the soil.

The market is held on Thursdays in the square by the bridge. Farmers bring eggs, cheese, honey and
vegetables, and in the season there are strawberries and plums from the orchards on the south
slope. A man from the coast sells smoked fish from the back of a van, and a woman who lives alone
at the top of the valley brings baskets she weaves from the willow she cuts along the river. By
noon most of the stalls are packed away, and the square belongs to the pigeons again.

Visitors come for the walking. A path follows the river from the town up to its source, past the
ruined chapel and the quarry, and over the ridge to the next valley. It is an easy walk in good
weather and a hard one in bad, and the mountain rescue team, who are all volunteers, are called out
several times a year to find people who set off too late or without a map. They meet in a room
above the post office, and on the wall there is a photograph of every one of them since the team
was founded, fifty years ago, in the winter of the great snow.

The school has sixty pupils and two teachers, and every year there is talk of closing it and
sending the children by bus to the larger school in the market town down the valley. Every year
the parents write letters and hold meetings, and every year the school stays open. The children
keep a weather diary, and their records of rainfall, taken with a copper gauge in the playground,
go back further than those of the national weather service for this part of the country.

In the evenings the light goes slowly from the valley. The hills to the east stay bright for a
long time after the town is in shadow, and then they too turn grey, and the first lamps come on in
the farmhouses. The river can be heard more clearly then, over the weir and under the bridge, and
it is the last thing many people in the town hear before they sleep.
"""


def env() -> dict:
    return cli_env(faulthandler=False, PYTHONHASHSEED="0")


def write_config(
    tmp: Path,
    name: str,
    *,
    micro: int,
    data: dict,
    steps: int = STEPS,
    target: int = 16,
    **sections,
) -> Path:
    "A one-layer fp32 CPU run of `steps` steps (global batch `target`), checkpointed at its end."
    raw = {
        "run": {"name": name, "seed": 7, "max_steps": steps, "output_dir": str(tmp / name)},
        "model": {
            "vocab_size": 256,
            "max_seq_len": 16,
            "n_layer": 1,
            "n_head": 2,
            "d_model": 32,
            "d_ff": 64,
            "dropout": 0.0,
        },
        "data": {"block_size": 16, "micro_batch_size": micro, "target_batch_size": target, **data},
        # eps=1 keeps AdamW's update a smooth function of the gradient (tests/test_parallel.py says
        # why)
        "optimizer": {"lr": 1e-2, "weight_decay": 0.0, "eps": 1.0, "grad_clip": 1.0},
        "scheduler": {"warmup_steps": 2, "max_steps": STEPS},
        "precision": {"mode": "fp32"},
        "checkpoint": {"every_steps": STEPS, "keep_last": None},
        "logging": {"json_file": str(tmp / f"{name}.jsonl"), "progress": False, "loss_plot": False},
    }
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def train(cfg: Path, *extra: str, nproc: int = 1) -> subprocess.Popen:
    "`speedtronic train` on CPU: one process, or a torchrun job of `nproc`."
    rank = ["-m", "speedtronic", "train", "--config", str(cfg), "--device", "cpu", *extra]
    cmd = torchrun_command(*rank, nproc=nproc) if nproc > 1 else [sys.executable, *rank]
    # its own process group, ended whole if it hangs
    return spawn(
        cmd,
        cwd=ROOT,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def finish(proc: subprocess.Popen, timeout: float = 300) -> str:
    """The stderr of `proc`, which must exit 0 within `timeout` seconds (else it and its ranks are
    killed and the test fails)."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # torchrun passes SIGTERM to its ranks (each in a session of its own), then kills them
        proc.terminate()
        try:
            out, err = proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        pytest.fail(f"the run did not end within {timeout} s:\n{out[-3000:]}\n{err[-6000:]}")
    assert proc.returncode == 0, out[-2000:] + err[-4000:]
    return err


def losses(jsonl: Path) -> dict[int, list[float]]:
    by: dict[int, list[float]] = {}
    for r in jsonl_records(jsonl):
        by.setdefault(r["step"], []).append(r["loss"])
    return by


def final_state(out: Path, step: int = STEPS) -> dict:
    "The checkpoint of `step`: a file, or the folder of shards an fsdp job writes."
    stem = out / "checkpoints" / f"step_{step:012d}"
    return load_checkpoint(
        next(
            (p for p in (stem.with_suffix(".dcp"), stem.with_suffix(".pt")) if p.exists()),
            stem.with_suffix(".pt"),
        )
    )


def assert_same_training(
    tmp: Path, name: str, ref: str, steps: range = range(1, STEPS + 1)
) -> None:
    """Run `name` took, step for step, the losses of run `ref` (rtol 1e-6) and ended on its weights
    (atol 1e-6)."""
    got, want = losses(tmp / f"{name}.jsonl"), losses(tmp / f"{ref}.jsonl")
    assert sorted(got) == list(steps), sorted(got)
    for step, values in got.items():
        for value in values:
            assert value == pytest.approx(want[step][-1], rel=1e-6, abs=0), (
                step,
                values,
                want[step],
            )
    a, b = final_state(tmp / ref, steps[-1]), final_state(tmp / name, steps[-1])
    for key, tensor in a["model"].items():
        torch.testing.assert_close(b["model"][key], tensor, rtol=0, atol=1e-6, msg=key)
    assert (b["samples"], b["tokens"]) == (a["samples"], a["tokens"])


def token_file(tmp: Path, blocks: int = 400) -> Path:
    """A prepared token file of `blocks` blocks of 17 ids below 256 (its sidecar says vocabulary
    256)."""
    ids = np.random.default_rng(0).integers(0, 256, size=blocks * 17).astype(np.uint16)
    path = tmp / "tokens.bin"
    path.write_bytes(ids.tobytes())
    Path(str(path) + ".json").write_text(
        json.dumps(
            {
                "format": TOKEN_FILE_FORMAT,
                "version": 1,
                "dtype": "uint16",
                "num_tokens": int(ids.size),
                "vocab_size": 256,
            }
        )
    )
    return path


def saved_dataset(tmp: Path) -> Path:
    """The prose as a `datasets` dataset of one row per paragraph, saved to disk in 2 shards (skips
    without `datasets`)."""
    datasets = pytest.importorskip("datasets")
    path = tmp / "prose_dataset"
    rows = [p for p in PROSE.split("\n\n") if p.strip()]
    datasets.Dataset.from_dict({"text": rows}).save_to_disk(str(path), num_shards=2)
    return path


def source(kind: str, tmp: Path) -> dict:
    "The `data` settings of each kind of source."
    if kind == "text":
        (tmp / "prose.txt").write_text(PROSE, encoding="utf-8")
        return {"text_path": str(tmp / "prose.txt"), "synthetic": False}
    if kind == "token-file":
        return {"token_file": str(token_file(tmp)), "shuffle": True, "seed": 5, "synthetic": False}
    if kind == "synthetic":
        return {"synthetic": True, "num_tokens": 200, "shuffle": True}
    if kind == "datasets":
        return {"hf_dataset": {"path": str(saved_dataset(tmp))}, "synthetic": False}
    if kind == "datasets-streamed":
        return {
            "hf_dataset": {"path": str(saved_dataset(tmp)), "streaming": True},
            "synthetic": False,
        }
    raise ValueError(kind)


SOURCES = ["text", "token-file", "synthetic", "datasets", "datasets-streamed"]


@pytest.mark.parametrize("kind", SOURCES)
def test_two_ranks_train_as_one_process_with_twice_the_micro_batch(tmp_path, kind):
    data = source(kind, tmp_path)
    finish(train(write_config(tmp_path, "one", micro=8, data=data)))
    for workers in (0, 2):
        name = f"two-w{workers}"
        finish(
            train(
                write_config(tmp_path, name, micro=4, data={**data, "num_workers": workers}),
                nproc=2,
            )
        )
        assert_same_training(tmp_path, name, "one")
        assert all(len(v) == 1 for v in losses(tmp_path / f"{name}.jsonl").values()), (
            "only rank 0 writes the JSONL"
        )
        # the saved data position is the job's, and the one the single process saved
        assert final_state(tmp_path / name)["data"] == final_state(tmp_path / "one")["data"]
