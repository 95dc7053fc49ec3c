"""Every code path only a GPU exercises, in one go (a few minutes on one H200), printed as one
table.

    python bench/gpu_check.py                   # one GPU: every row
    python bench/gpu_check.py --only fsdp ddp   # some rows
    python bench/gpu_check.py --peak-tflops 989 # the bf16 dense peak MFU divides by (default: from
    the device name)

Rows: bf16 autocast training, fp16 with the GradScaler, fused AdamW, `torch.compile`, the
out-of-order backprop streams, NCCL DDP and NCCL FSDP with one GPU (a process group of world 1
through `speedtronic.parallel.World`, so DDP's and FSDP2's CUDA paths run, with a checkpoint written
and loaded back; tests/test_fsdp.py runs the same function on the CPU with gloo), generation
tokens/s with the KV cache, and the MFU of a bf16 training run (6 x parameters + attention FLOPs per
token, over the GPU's dense bf16 peak). Each row trains through the real trainer
(`train_from_config` or a `Trainer` on a `World`) and reads what the run logged. Without CUDA every
row says `skipped: no CUDA` and the script exits 0 (CI runs it so); a row that fails prints `FAIL`
with the reason, and the script then exits 1.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

PEAK_BF16_TFLOPS = {
    "H200": 989.0,
    "H100": 989.0,
    "A100": 312.0,
    "L40S": 362.0,
    "L4": 121.0,
    "A10": 125.0,
    "4090": 165.0,
}
SMALL = {
    "vocab_size": 512,
    "max_seq_len": 128,
    "n_layer": 2,
    "n_head": 4,
    "n_kv_head": 2,
    "d_model": 128,
    "d_ff": 512,
}
LARGE = {
    "vocab_size": 32768,
    "max_seq_len": 1024,
    "n_layer": 12,
    "n_head": 16,
    "n_kv_head": 4,
    "d_model": 1024,
    "d_ff": 4096,
}


def config(
    tmp: Path, name: str, *, model: dict = SMALL, steps: int = 12, micro: int = 8, **extra
) -> dict:
    "A config dict of a short synthetic run in `tmp/name` (its JSONL at `tmp/name.jsonl`)."
    block = model["max_seq_len"]
    raw = {
        "run": {"name": name, "seed": 0, "max_steps": steps, "output_dir": str(tmp / name)},
        "model": model,
        "data": {
            "synthetic": True,
            "num_tokens": 64 * micro * steps,
            "block_size": block,
            "micro_batch_size": micro,
            "target_batch_size": micro,
        },
        "optimizer": {"lr": 3e-4, "grad_clip": 1.0},
        "scheduler": {"warmup_steps": 2},
        "precision": {"mode": "bf16"},
        "checkpoint": {"enabled": False},
        "logging": {
            "json_file": str(tmp / f"{name}.jsonl"),
            "progress": False,
            "loss_plot": False,
            "level": "WARNING",
        },
    }
    for key, value in extra.items():
        raw[key] = {**raw[key], **value} if isinstance(value, dict) and key in raw else value
    return raw


def events(tmp: Path, name: str, event: str) -> list[dict]:
    path = tmp / f"{name}.jsonl"
    return (
        [r for r in map(json.loads, path.read_text().splitlines()) if r.get("event") == event]
        if path.exists()
        else []
    )


def rate(records: list[dict], skip: int = 3) -> float:
    "Tokens/s between the record after `skip` warm-up steps and the last one."
    a, b = records[min(skip, len(records) - 2)], records[-1]
    return (b["tokens"] - a["tokens"]) / max(b["elapsed_s"] - a["elapsed_s"], 1e-9)


def train(tmp: Path, name: str, **kw) -> tuple[list[dict], Path]:
    "Train a config through `train_from_config`; its finite `train_step` records."
    from speedtronic.config import SpeedtronicConfig
    from speedtronic.runtime import train_from_config

    train_from_config(SpeedtronicConfig.from_dict(config(tmp, name, **kw)), device="cuda")
    steps = events(tmp, name, "train_step")
    if not steps or not all(math.isfinite(r["loss"]) for r in steps):
        raise RuntimeError(f"losses are not finite: {steps[-3:]}")
    return steps, tmp / name


def check_bf16(tmp):
    steps, _ = train(tmp, "bf16")
    return f"loss {steps[0]['loss']:.3f} -> {steps[-1]['loss']:.3f}, {rate(steps):,.0f} tokens/s"


def check_fp16(tmp):
    steps, _ = train(tmp, "fp16", precision={"mode": "fp16"})
    skipped = events(tmp, "fp16", "optimizer_step_skipped")
    return f"GradScaler: {len(steps)} updates, {len(skipped)} skipped, loss {steps[-1]['loss']:.3f}"


def check_fused(tmp):
    train(tmp, "fused", optimizer={"fused": True})
    chosen = events(tmp, "fused", "optimizer")
    fused = chosen[0].get("fused") if chosen else None
    if fused is not True:
        raise RuntimeError(f"optimizer.fused: true, but the optimizer event says fused={fused!r}")
    return "fused AdamW stepped"


def check_compile(tmp):
    eager, _ = train(tmp, "eager", steps=20)
    steps, _ = train(tmp, "compiled", steps=20, compile=True)
    said = events(tmp, "compiled", "compile")
    if not said or said[-1].get("enabled") is not True:
        raise RuntimeError(f"compile events: {said}")
    return f"compiled, {rate(steps, 8) / rate(eager, 8):.2f}x eager tokens/s"


def check_ooo(tmp):
    base, _ = train(tmp, "in_order", steps=16)
    steps, _ = train(tmp, "ooo", steps=16, ooo_backprop=True, ooo_streams=4)
    said = events(tmp, "ooo", "ooo_backprop")
    if not said or said[0].get("enabled") is False:
        raise RuntimeError(f"ooo_backprop events: {said}")
    return f"4 streams, {rate(steps) / rate(base):.2f}x in-order tokens/s"


def world_of_one(strategy: str, device: torch.device):
    """A process group of world 1 (NCCL on CUDA, gloo on the CPU), as the `World` a torchrun job of
    one device would join."""
    import torch.distributed as dist
    from speedtronic.config import ParallelConfig
    from speedtronic.parallel import World, backend_for

    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
        dist.init_process_group(backend_for(device), store=store, rank=0, world_size=1)
    return World(
        size=1,
        device=device,
        backend=dist.get_backend(),
        control=dist.group.WORLD,
        parallel=ParallelConfig(strategy=strategy),
    )


def train_on_world(tmp: Path, name: str, strategy: str, device: str = "cuda:0") -> str:
    """A few steps through `Trainer(world=...)` on an NCCL world of one, then a checkpoint saved and
    resumed."""
    from speedtronic.checkpoint import CheckpointManager, load_sharded
    from speedtronic.config import SpeedtronicConfig
    from speedtronic.data import build_dataloader
    from speedtronic.optimizers import build_optimizer
    from speedtronic.precision import resolve_precision
    from speedtronic.registry import build_model
    from speedtronic.trainer import Trainer

    device = torch.device(device)
    cfg = SpeedtronicConfig.from_dict(
        config(tmp, name, steps=6, **({} if device.type == "cuda" else {"precision": "fp32"}))
    )
    world = world_of_one(strategy, device)
    plan = resolve_precision(cfg.precision, device)

    def trainer():
        model = world.shard(build_model(cfg.model).to(device), plan)
        manager = CheckpointManager(tmp / name / "checkpoints", every_steps=3)
        return Trainer(
            model,
            build_optimizer(model, cfg, device),
            build_dataloader(cfg.data),
            device=device,
            config=cfg,
            precision=plan,
            world=world,
            checkpoint_manager=manager,
            max_steps=6,
        )

    first = trainer()
    result = first.fit()
    # the weights back from the newest checkpoint (a folder under fsdp, a file under ddp)
    again = trainer()
    state = again.checkpoint_manager.load_latest()
    if state.get("sharded"):
        load_sharded(state["sharded"], again.model, again.optimizer)
    else:
        again.model.load_state_dict(state["model"])
    with torch.no_grad():
        same = all(
            torch.equal(_whole(a), _whole(b))
            for a, b in zip(first.model.parameters(), again.model.parameters())
        )
    if not same:
        raise RuntimeError(
            f"the weights loaded from {again.checkpoint_manager.loaded_path} differ from the "
            "trained ones"
        )
    kind = type(next(first.model.parameters())).__name__
    return (
        f"{kind} params, {result.steps} steps, loss {result.final_loss:.3f}; "
        f"{again.checkpoint_manager.loaded_path.name} loads back"
    )


def _whole(tensor):
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def check_ddp(tmp):
    return train_on_world(tmp, "ddp", "ddp")


def check_fsdp(tmp):
    return train_on_world(tmp, "fsdp", "fsdp")


def check_generate(tmp):
    from speedtronic.generation import generate_ids
    from speedtronic.registry import build_model
    from speedtronic.config import ModelConfig

    model = build_model(ModelConfig(**{**SMALL, "max_seq_len": 512})).to("cuda").eval()
    list(generate_ids(model, [1, 2, 3], max_new_tokens=16, temperature=0))  # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    made = len(list(generate_ids(model, [1, 2, 3], max_new_tokens=256, temperature=0)))
    torch.cuda.synchronize()
    return f"{made / (time.perf_counter() - t0):,.0f} tokens/s (greedy, batch 1, {made} tokens)"


def flops_per_token(model: dict) -> float:
    """Training FLOPs per token: 6 x parameters of the blocks and head, plus attention's 12 x layers
    x width x sequence."""
    from speedtronic.config import ModelConfig
    from speedtronic.registry import build_model

    with torch.device("meta"):
        params = sum(p.numel() for p in build_model(ModelConfig(**model)).parameters())
    return 6 * params + 12 * model["n_layer"] * model["d_model"] * model["max_seq_len"]


def check_mfu(tmp, peak_tflops: float | None):
    name = torch.cuda.get_device_name(0)
    peak = peak_tflops or next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
    steps, _ = train(tmp, "mfu", model=LARGE, steps=14, micro=8)
    achieved = rate(steps, 4) * flops_per_token(LARGE)
    if peak is None:
        return f"{achieved / 1e12:.0f} TFLOP/s (no peak known for {name}: pass --peak-tflops)"
    return (
        f"{achieved / 1e12:.0f} TFLOP/s of {peak:.0f} on {name}: MFU {achieved / (peak * 1e12):.0%}"
    )


CHECKS = {
    "bf16": ("bf16 autocast", check_bf16),
    "fp16": ("fp16 + GradScaler", check_fp16),
    "fused": ("fused AdamW", check_fused),
    "compile": ("torch.compile", check_compile),
    "ooo": ("out-of-order streams", check_ooo),
    "ddp": ("NCCL DDP, world 1", check_ddp),
    "fsdp": ("NCCL FSDP2, world 1", check_fsdp),
    "generate": ("generation tokens/s", check_generate),
    "mfu": ("MFU (bf16 training)", check_mfu),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", nargs="+", choices=sorted(CHECKS), help="run only these rows")
    p.add_argument(
        "--peak-tflops", type=float, default=None, help="the GPU's dense bf16 peak, for MFU"
    )
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    rows, failed = [], False
    with tempfile.TemporaryDirectory() as d:
        for key in args.only or CHECKS:
            label, check = CHECKS[key]
            if not cuda:
                rows.append((label, "skipped: no CUDA", 0.0))
                continue
            t0 = time.perf_counter()
            try:
                detail = "ok: " + (
                    check(Path(d), args.peak_tflops) if key == "mfu" else check(Path(d))
                )
            except Exception as e:
                failed = True
                detail = f"FAIL: {type(e).__name__}: {' '.join(str(e).split())[:300]}"
                traceback.print_exc(file=sys.stderr)
            rows.append((label, detail, time.perf_counter() - t0))
    where = torch.cuda.get_device_name(0) if cuda else "no CUDA device"
    print(f"speedtronic GPU check on {where} (torch {torch.__version__})")
    width = max(len(r[0]) for r in rows)
    for label, detail, seconds in rows:
        print(f"{label:<{width}}  {seconds:>6.1f} s  {detail}")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
