"""What a 2.0 user already has on disk keeps working: real files written by Speedtronic 2.0.0.

The fixtures (`shared/fixtures/v2.0`, README there) were written by the published 2.0.0, not by this
project's code: two checkpoint runs (AdamW and 2.0's hybrid Muon, stopped at step 8 of a 12-step
schedule) and the final state of a 2.0 DiLoCo repository. Each test copies what it needs to a
temporary folder and leaves the fixtures as they are. The expected values come from the fixture
files themselves, read with plain `torch.load` / `safetensors` and checked against plain PyTorch,
never from our own writers.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load as safetensors_load, load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import (
    run_command,  # noqa: E402
    run_command,
    ROOT,
    V2_FIXTURES,
    cli_env,
    jsonl_records,
    needs_v2_fixtures,
    newton_schulz64,
)
from hub_server import HubStandIn  # noqa: E402

from speedtronic.config import SpeedtronicConfig
from speedtronic.distributed import (
    HubClient,
    MasterOuterLoop,
    SharedDirectory,
    load_delta,
    load_safetensors,
)
from speedtronic.model import reference_state_dict_shapes
from speedtronic.profiling import MetricLogger
from speedtronic.registry import build_model
from speedtronic.runtime import build_runtime, close_logger, train_from_config


FIXTURES = V2_FIXTURES
pytestmark = needs_v2_fixtures

RUNS = {"adamw": ("checkpoint-adamw", "run"), "muon": ("checkpoint-muon", "run-muon")}


def tree_digest(root: Path) -> dict[str, str]:
    "sha256 of every file under `root`, by relative path."
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module", autouse=True)
def fixtures_stay_untouched():
    "No test writes into the fixtures (they are the 2.0 user's files)."
    before = tree_digest(FIXTURES)
    yield
    assert tree_digest(FIXTURES) == before


def copy_fixture(name: str, tmp: Path) -> Path:
    "A writable copy of fixture folder `name` in `tmp` (the fixtures are read-only files)."
    dest = tmp / name
    shutil.copytree(FIXTURES / name, dest)
    for p in [dest, *dest.rglob("*")]:
        p.chmod(p.stat().st_mode | stat.S_IWUSR)
    return dest


def read_v2_checkpoint(path: Path) -> dict:
    """A 2.0 `.pt` file read by plain torch with the allow-list of the NumPy globals its RNG state
    needs."""
    allowed = [np.dtype, np.ndarray, np._core.multiarray._reconstruct, type(np.dtype(np.uint32))]
    with torch.serialization.safe_globals(allowed):
        return torch.load(path, weights_only=True)


def with_max_steps(config: Path, steps: int) -> None:
    """Set the run's top-level `max_steps` in a 2.0 config file (the schedule's own `max_steps: 12`
    is kept)."""
    raw = yaml.safe_load(config.read_text())
    raw["max_steps"] = steps
    config.write_text(yaml.safe_dump(raw, sort_keys=False))


def cosine_lr(
    step: int, *, lr: float = 0.003, warmup: int = 2, horizon: int = 12, floor: float = 0.1
) -> float:
    """2.0's cosine schedule as its docs state it, the LR of the update after `step` completed
    updates."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / (horizon - warmup))
    return lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def v2_parameter_order(model: torch.nn.Module, optimizer: str) -> list[str]:
    """The parameter names, in 2.0's optimizer-state order: 2.0's Muon held the hidden matrices
    (group 0) then the embeddings and norms (group 1); its default AdamW held only the embeddings
    and norms."""
    names = [n for n, _ in model.named_parameters()]
    hidden = [n for n, p in model.named_parameters() if p.ndim == 2 and ".h." in n]
    rest = [n for n in names if n not in hidden]
    return hidden + rest if optimizer == "muon" else rest


def test_the_fixture_describes_what_2_0_trained():
    """The premises the tests below rest on, read from the files: 2.0's AdamW moved only the 4
    embedding/norm tensors."""
    s4, s8 = (
        read_v2_checkpoint(
            FIXTURES / "checkpoint-adamw/run/checkpoints" / f"step_00000000000{k}.pt"
        )
        for k in (4, 8)
    )
    moved = [k for k in s8["model"] if not torch.equal(s4["model"][k], s8["model"][k])]
    # lm_head is tied to wte
    assert moved == [
        "transformer.wte.weight",
        "transformer.h.0.ln1.weight",
        "transformer.h.0.ln2.weight",
        "transformer.ln_f.weight",
        "lm_head.weight",
    ]
    model = build_model(SpeedtronicConfig.load(FIXTURES / "checkpoint-adamw/config.yaml").model)
    assert v2_parameter_order(model, "adamw") == moved[:4]
    saved = s8["optimizer"]["state"]
    assert [tuple(saved[i]["exp_avg"].shape) for i in range(4)] == [
        tuple(s8["model"][n].shape) for n in moved[:4]
    ]
    muon = read_v2_checkpoint(
        FIXTURES / "checkpoint-muon/run-muon/checkpoints/step_000000000008.pt"
    )
    order = v2_parameter_order(model, "muon")
    groups = muon["optimizer"]["param_groups"]
    assert [g["algorithm"] for g in groups] == ["muon", "adamw"] and groups[0]["params"] == list(
        range(7)
    )
    for i, name in enumerate(order):
        buffer = muon["optimizer"]["state"][i].get(
            "momentum_buffer", muon["optimizer"]["state"][i].get("exp_avg")
        )
        assert tuple(buffer.shape) == tuple(muon["model"][name].shape), name


def test_the_reference_model_has_2_0_names_and_shapes():
    """Our reference model and the table of what 2.0 writes (`reference_state_dict_shapes`) agree
    with 2.0's real files."""
    cases = [
        (
            SpeedtronicConfig.load(FIXTURES / "checkpoint-adamw/config.yaml").model,
            read_v2_checkpoint(FIXTURES / "checkpoint-adamw/run/checkpoints/step_000000000008.pt")[
                "model"
            ],
        ),
        (
            SpeedtronicConfig.from_dict(
                {
                    "model": json.loads((FIXTURES / "diloco-repo/master-config.json").read_text())[
                        "model"
                    ]
                }
            ).model,
            load_file(FIXTURES / "diloco-repo/global/latest.safetensors"),
        ),
    ]
    for section, theirs in cases:
        model = build_model(section)
        shapes = {k: tuple(v.shape) for k, v in theirs.items()}
        assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == shapes
        assert reference_state_dict_shapes(model.config) == shapes


@pytest.mark.parametrize("optimizer", RUNS)
def test_a_2_0_run_resumes_from_the_cli_at_step_9(tmp_path, optimizer):
    """`speedtronic train --resume` with `max_steps: 12` goes on from 2.0's step 8: step 9 has the
    LR 2.0 would have used next, the counters continue 2.0's, the 2.0 moments keep counting (step 12
    in the final checkpoint), and 2.0's files and log lines are kept as they were."""
    folder, out = RUNS[optimizer]
    work = copy_fixture(folder, tmp_path)
    with_max_steps(work / "config.yaml", 12)
    saved = read_v2_checkpoint(work / out / "checkpoints" / "step_000000000008.pt")
    v2_log = (work / out / "metrics.jsonl").read_bytes()
    res = run_command(
        [
            sys.executable,
            "-m",
            "speedtronic",
            "train",
            "--config",
            "config.yaml",
            "--device",
            "cpu",
            "--resume",
        ],
        cwd=work,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert (
        res.stdout.strip()
        .splitlines()[-1]
        .startswith("completed steps=12 samples=96 tokens=1536 loss=")
    )
    log = (work / out / "metrics.jsonl").read_bytes()
    assert log.startswith(v2_log)  # 2.0's lines untouched, ours appended
    ours = jsonl_records(work / out / "metrics.jsonl")[8:]
    assert [r["step"] for r in ours] == [9, 10, 11, 12]
    # where 2.0 stopped
    assert ours[0]["lr"] == pytest.approx(saved["optimizer"]["param_groups"][0]["lr"], rel=1e-12)
    assert [r["lr"] for r in ours] == pytest.approx([cosine_lr(s) for s in range(8, 12)], rel=1e-9)
    assert [(r["samples"], r["tokens"]) for r in ours] == [
        (saved["samples"] + 8 * k, saved["tokens"] + 128 * k) for k in (1, 2, 3, 4)
    ]
    assert all(math.isfinite(r["loss"]) for r in ours)
    for k in (4, 8):  # nothing already saved is lost
        name = f"step_00000000000{k}.pt"
        assert (work / out / "checkpoints" / name).read_bytes() == (
            FIXTURES / folder / out / "checkpoints" / name
        ).read_bytes()
    final = read_v2_checkpoint(work / out / "checkpoints" / "step_000000000012.pt")
    assert (final["step"], final["samples"], final["tokens"]) == (12, 96, 1536)
    counts = sorted(
        (tuple(s[k].shape), int(s["step"]))
        for s in final["optimizer"]["state"].values()
        for k in ("exp_avg", "momentum_buffer")
        if k in s
    )
    carried = sorted(
        (tuple(s[k].shape), 12)
        for s in saved["optimizer"]["state"].values()
        for k in ("exp_avg", "momentum_buffer")
        if k in s
    )
    # 2.0's 4 tensors went on from its 8 updates; the 7 it never trained started at 9
    if optimizer == "adamw":
        hidden = sorted(
            (tuple(p.shape), 4) for n, p in final["model"].items() if ".h." in n and p.ndim == 2
        )
        assert counts == sorted(carried + hidden)
    else:
        assert counts == carried


def reference_step(
    w8: torch.Tensor, theirs: dict, mine: dict, group: dict, lr: float
) -> torch.Tensor:
    """The weights after one plain-PyTorch update from 2.0's weights `w8` and 2.0's optimizer state
    `theirs` at LR `lr`, with the gradient our state `mine` implies (our moment after the step minus
    2.0's, decayed): data-free, and it holds only if our step 9 started from 2.0's weights and
    moments."""
    w = torch.nn.Parameter(w8.clone())
    if "exp_avg" in theirs:  # AdamW: torch.optim.AdamW itself
        b1, b2 = group["betas"]
        w.grad = (mine["exp_avg"] - b1 * theirs["exp_avg"]) / (1 - b1)
        adamw = torch.optim.AdamW(
            [w], lr=lr, betas=(b1, b2), eps=group["eps"], weight_decay=group["weight_decay"]
        )
        adamw.load_state_dict(
            {
                "state": {
                    0: {k: v.clone() if torch.is_tensor(v) else v for k, v in theirs.items()}
                },
                "param_groups": [{**adamw.param_groups[0], "params": [0]}],
            }
        )
        adamw.step()
        return w.detach()
    mu, buf8, buf9 = (
        group["momentum"],
        theirs["momentum_buffer"].double(),
        mine["momentum_buffer"].double(),
    )
    # torch.optim.Muon: buf = mu*buf + (1-mu)*g, Nesterov g + mu*(buf-g)
    grad = (buf9 - mu * buf8) / (1 - mu)
    update = newton_schulz64(torch.lerp(grad, buf9, mu), group["ns_steps"])
    assert group["scale"] == "match_rms_adamw"
    scale = 0.2 * max(w8.shape) ** 0.5
    return (w8.double() * (1 - lr * group["weight_decay"]) - lr * scale * update).float()


@pytest.mark.parametrize("optimizer", RUNS)
def test_resuming_installs_2_0_weights_moments_and_schedule(tmp_path, monkeypatch, optimizer):
    """Right after `resume`, before any step: the model holds 2.0's weights, the optimizer 2.0's
    moments, the schedule 2.0's position; and step 9 is the update plain PyTorch makes from exactly
    those."""
    folder, out = RUNS[optimizer]
    work = copy_fixture(folder, tmp_path)
    with_max_steps(work / "config.yaml", 12)
    saved = read_v2_checkpoint(work / out / "checkpoints" / "step_000000000008.pt")
    monkeypatch.chdir(work)
    trainer, _ = build_runtime(SpeedtronicConfig.load("config.yaml"), resume=True, device="cpu")
    try:
        assert trainer.step == 8
        ours = trainer.model.state_dict()
        assert set(ours) == set(saved["model"])
        for name, tensor in saved["model"].items():
            assert torch.equal(ours[name], tensor), name
        params = dict(trainer.model.named_parameters())
        order = v2_parameter_order(trainer.model, optimizer)
        for i, name in enumerate(order):
            theirs, mine = saved["optimizer"]["state"][i], trainer.optimizer.state[params[name]]
            for key, value in theirs.items():
                if torch.is_tensor(value) and value.ndim:
                    assert torch.equal(mine[key], value), (name, key)
                else:
                    assert float(mine[key]) == float(value), (name, key)
        fresh = [n for n in params if n not in order]
        # never trained by 2.0: no moments yet
        assert all(not trainer.optimizer.state.get(params[n]) for n in fresh), fresh
        lr = saved["optimizer"]["param_groups"][0]["lr"]
        assert [g["lr"] for g in trainer.optimizer.param_groups] == pytest.approx(
            [lr] * len(trainer.optimizer.param_groups), rel=1e-12
        )
        trainer.fit(max_steps=9)
        group_of = {id(p): g for g in trainer.optimizer.param_groups for p in g["params"]}
        for i, name in enumerate(order):
            w9, w8 = params[name].detach(), saved["model"][name]
            expected = reference_step(
                w8,
                saved["optimizer"]["state"][i],
                trainer.optimizer.state[params[name]],
                group_of[id(params[name])],
                lr,
            )
            moved = (w9 - w8).norm()
            # measured <= 7e-6; 0.35 or more from fresh moments
            assert moved > 0 and ((w9 - expected).norm() / moved).item() < 1e-4, name
    finally:
        close_logger(trainer.logger)
        trainer.run_claim.release()


def test_the_2_0_metrics_file_is_read_into_the_resumed_result(tmp_path, monkeypatch):
    "`train_from_config(resume=True)` puts 2.0's eight logged steps in front of its own four."
    folder, out = RUNS["adamw"]
    work = copy_fixture(folder, tmp_path)
    with_max_steps(work / "config.yaml", 12)
    v2_steps = [
        json.loads(line) for line in (work / out / "metrics.jsonl").read_text().splitlines()
    ]
    v2_steps = [r for r in v2_steps if r["event"] == "train_step"]
    monkeypatch.chdir(work)
    result = train_from_config(SpeedtronicConfig.load("config.yaml"), resume=True, device="cpu")
    assert [r["step"] for r in result.metrics] == list(range(1, 13))
    assert [r["loss"] for r in result.metrics[:8]] == [r["loss"] for r in v2_steps]
    assert [r["lr"] for r in result.metrics[:8]] == [r["lr"] for r in v2_steps]


# -- a 2.0 DiLoCo repository -----------------------------------------------------------------------
TOKEN = "hf_fixture_write_token_0123456789"
REPO_FILES = [
    "global/latest.safetensors",
    "global/step_count.json",
    "nodes/master/delta_200.safetensors",
    "nodes/worker1/delta_200.safetensors",
    "nodes/worker2/delta_200.safetensors",
]


def diloco_node_config(work: Path, transport: str, repo_id: str, name: str, steps: int) -> Path:
    """2.0's worker1 config as it is, on `transport` at `repo_id`, with synthetic data (2.0's text
    is not included)."""
    raw = json.loads((FIXTURES / "diloco-repo" / "worker1-config.json").read_text())
    raw["run"].update(max_steps=steps, output_dir=str(work / name))
    raw["data"] = {
        "synthetic": True,
        "num_tokens": 4096,
        "block_size": 64,
        "micro_batch_size": 4,
        "target_batch_size": 8,
    }
    raw["checkpoint"]["every_steps"] = steps
    raw["logging"].update(
        json_file=str(work / name / "metrics.jsonl"), progress=False, loss_plot=False
    )
    raw["distributed"].update(
        node_id=name,
        transport=transport,
        repo_id=repo_id,
        poll_interval=0.2,
        retry_initial=0.05,
        retry_max=0.5,
        request_timeout=5,
    )
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


@pytest.fixture
def hub_tokens():
    return {TOKEN: "write"}


@pytest.mark.parametrize("transport", ["directory", "hub"])
def test_a_node_starts_from_the_2_0_global_model(tmp_path, transport, request):
    """A worker of ours installs 2.0's `global/latest.safetensors` (outer step 4) and sends a delta
    measured from it: from the repository copied as a shared directory, and from a Hub repository
    holding 2.0's files (uploaded with the real `huggingface_hub` client to the loopback stand-in).
    """
    v2_global = load_file(FIXTURES / "diloco-repo" / "global" / "latest.safetensors")
    env = cli_env()
    if transport == "directory":
        repo = copy_fixture("diloco-repo", tmp_path)
        cfg = diloco_node_config(tmp_path, transport, str(repo), "ours", steps=10)
    else:
        hub = request.getfixturevalue("hub")
        hub_with_v2_repo(hub, "org/v2-run")
        env.update(
            HF_ENDPOINT=hub.url,
            HF_TOKEN=TOKEN,
            HF_HUB_DOWNLOAD_TIMEOUT="5",
            HF_HUB_ETAG_TIMEOUT="5",
            HF_HUB_DISABLE_PROGRESS_BARS="1",
        )
        cfg = diloco_node_config(tmp_path, transport, "org/v2-run", "ours", steps=10)
    res = run_command(
        [sys.executable, "-m", "speedtronic", "train", "--config", str(cfg)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    installed = jsonl_records(tmp_path / "ours" / "metrics.jsonl", "global_installed")
    assert [(e["outer_step"], e["step"]) for e in installed] == [(4, 0)]
    if transport == "hub":
        files = hub.files("org/v2-run")
        repo = tmp_path / "from-hub"
        for path in ("nodes/ours/delta_10.safetensors", "nodes/worker1/delta_200.safetensors"):
            (repo / path).parent.mkdir(parents=True, exist_ok=True)
            (repo / path).write_bytes(files[path])
    with safe_open(repo / "nodes" / "ours" / "delta_10.safetensors", "pt") as f:
        assert f.metadata()["base_outer_step"] == "4"
    # our reader: a tied tensor travels once
    tensors, _ = load_delta(repo / "nodes" / "ours" / "delta_10.safetensors")
    delta = {k: v.float() for k, v in tensors.items()}
    local = read_v2_checkpoint(tmp_path / "ours" / "checkpoints" / "step_000000000010.pt")["model"]
    assert set(delta) == set(v2_global)
    for k, start in v2_global.items():  # delta = 2.0's global - this node's weights after 10 steps
        torch.testing.assert_close(delta[k], start - local[k], rtol=1e-2, atol=1e-5, msg=k)
    # it did train
    assert max((start - local[k]).abs().max().item() for k, start in v2_global.items()) > 1e-3
    assert (repo / "nodes" / "worker1" / "delta_200.safetensors").read_bytes() == (
        FIXTURES / "diloco-repo" / "nodes" / "worker1" / "delta_200.safetensors"
    ).read_bytes()


def hub_with_v2_repo(hub: HubStandIn, repo_id: str) -> None:
    """Commit 2.0's repository files to `repo_id` on the stand-in, with the real huggingface_hub
    client."""
    from huggingface_hub import CommitOperationAdd, HfApi

    api = HfApi(endpoint=hub.url, token=TOKEN)
    api.create_repo(repo_id, private=True)
    api.create_commit(
        repo_id,
        operations=[CommitOperationAdd(p, str(FIXTURES / "diloco-repo" / p)) for p in REPO_FILES],
        commit_message="the 2.0 repository",
    )


@pytest.mark.parametrize(
    "transport, staleness",
    [("directory", "none"), ("directory", "delayed_nesterov"), ("hub", "none")],
)
def test_a_master_folds_the_2_0_deltas(tmp_path, transport, staleness, request):
    """A master of ours over 2.0's repository (a copied directory, or 2.0's files on the Hub
    stand-in) adopts its global (outer step 4) and folds the three 2.0 deltas into outer step 5
    (2.0's deltas say nothing of their inner steps or session); with 2.0's staleness rule (`none`)
    the result is plain PyTorch's Nesterov SGD step on their mean."""
    if transport == "directory":
        repo = copy_fixture("diloco-repo", tmp_path)
        client, files = (
            SharedDirectory(repo),
            lambda: {p: (repo / p).read_bytes() for p in REPO_FILES[:2]},
        )
    else:
        hub = request.getfixturevalue("hub")
        hub_with_v2_repo(hub, "org/v2-run")
        client = HubClient(
            "org/v2-run",
            token=TOKEN,
            endpoint=hub.url,
            cache_dir=tmp_path / "cache",
            retry_initial=0.01,
            retry_max=0.05,
            retry_attempts=3,
        )
        files = lambda: hub.files("org/v2-run")
    raw = json.loads((FIXTURES / "diloco-repo" / "master-config.json").read_text())
    v2_global = load_file(FIXTURES / "diloco-repo" / "global" / "latest.safetensors")
    deltas = [
        load_file(FIXTURES / "diloco-repo" / "nodes" / n / "delta_200.safetensors")
        for n in ("master", "worker1", "worker2")
    ]
    # fresh weights: the repository's win
    model = build_model(SpeedtronicConfig.from_dict({"model": raw["model"]}).model)
    seen = []
    logger = MetricLogger(
        stream=False, hooks=[lambda event, payload: seen.append((event, payload))]
    )
    d = raw["distributed"]
    master = MasterOuterLoop(
        client,
        model.state_dict(),
        node_state_dir=tmp_path / "state",
        node_id="master",
        inner_steps=d["inner_steps"],
        outer_lr=d["outer_lr"],
        outer_momentum=d["outer_momentum"],
        staleness=staleness,
        logger=logger,
    )
    try:
        master.start_master()
        assert master.outer_step == 4
        master.sync_once()
        logger.flush()
    finally:
        logger.close()
    assert not [p for e, p in seen if e == "delta_rejected"], seen
    (step,) = [p for e, p in seen if e == "outer_step"]
    assert step["outer_step"] == 5 and sorted(map(tuple, step["folded"])) == [
        ("master", 200),
        ("worker1", 200),
        ("worker2", 200),
    ]
    repo_files = files()
    meta = json.loads(repo_files["global/step_count.json"])
    # what a 2.0 reader needs
    assert meta["outer_step"] == 5 and meta["model_file"] == "global/latest.safetensors"
    assert client.list_deltas() == []
    (tmp_path / "published.safetensors").write_bytes(repo_files["global/latest.safetensors"])
    # our reader: a tied tensor travels once
    published = load_safetensors(tmp_path / "published.safetensors")
    assert set(published) == set(v2_global) and any(
        not torch.equal(published[k], v) for k, v in v2_global.items()
    )
    stored = safetensors_load(repo_files["global/latest.safetensors"])
    # lm_head is wte's alias, not a second copy
    assert set(stored) == set(v2_global) - {"lm_head.weight"}
    torch.testing.assert_close(
        published["lm_head.weight"], published["transformer.wte.weight"], rtol=0, atol=0
    )
    if staleness != "none":
        return
    # plain PyTorch: SGD(momentum, nesterov) on the weights with the mean delta as the gradient
    weights = {k: torch.nn.Parameter(v.clone()) for k, v in v2_global.items()}
    sgd = torch.optim.SGD(
        weights.values(), lr=d["outer_lr"], momentum=d["outer_momentum"], nesterov=True
    )
    for k, w in weights.items():
        w.grad = sum(x[k] for x in deltas) / len(deltas)
    sgd.step()
    for k, w in weights.items():
        torch.testing.assert_close(published[k], w.detach(), rtol=1e-5, atol=1e-6, msg=k)
