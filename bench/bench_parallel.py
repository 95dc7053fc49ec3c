"""Tokens/s and peak memory per rank of one process against torchrun jobs of N processes, ddp and
fsdp side by side.

    python bench/bench_parallel.py
    # CPU: 1 process vs 2 ranks, ddp and fsdp (gloo), a small model
    python bench/bench_parallel.py --preset medium --steps 6 # CPU: a model whose state outweighs
    the interpreter (memory ratio)
    python bench/bench_parallel.py --device cuda --nproc 8
    # GPU machine: 1 vs 8 GPUs (NCCL), a bigger model
    python bench/bench_parallel.py --device cuda --nproc 2 4 8 --preset large --steps 60 --strategy
    fsdp

Every rank keeps the same micro batch and accumulation, so N processes train a global batch N times
larger (weak scaling, how data parallelism is used). Each run trains the config through this script
(`--worker`: `build_runtime` and `fit`, as `speedtronic train` does; the 1-process run without
torchrun, the others under `python -m torch.distributed.run`), and every rank writes its memory
numbers to a JSON file; a run's tokens/s is read from rank 0's JSONL, which holds the whole job's
tokens, between the end of the warm-up steps and the last step (start-up, compile and the first
steps are left out). The table shows each job's tokens/s, its speed-up over one process and the
scaling efficiency `tokens/s(N) / (N x tokens/s(1))`, then the training state of its largest rank
(weights, gradients and optimizer state: the shards under fsdp) and its peak memory, each also as a
fraction of the ddp job's with the same number of processes (`fsdp/ddp`). The peak is, on CUDA
`torch.cuda.max_memory_allocated()` of the training (weights, gradients, optimizer state,
activations); on CPU the rank's peak resident memory (`resource` max RSS) above what it held once
its modules were imported, so the interpreter and torch's own libraries are left out (it also counts
activations, communication buffers and what the allocator keeps, so on CPU it says less than the
state column).

On CPU the processes share the machine's cores, so expect little: the one process gets every core as
threads (OMP_NUM_THREADS = cores), each of N processes gets cores / N, so the jobs compute with the
same cores and the N-process job adds the gradient all-reduce (`--threads 1` instead gives every
process one thread, so the N-process job uses N times the cores; on a machine other jobs also load,
OpenMP threads that wait for each other can make the multi-threaded single process far slower, which
says nothing about the trainer). The runs alternate for `--rounds` rounds and the table shows the
median, since a shared machine is noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]

PRESETS = {  # model and per-rank batch
    "small": (
        {
            "vocab_size": 256,
            "max_seq_len": 64,
            "n_layer": 2,
            "n_head": 4,
            "n_kv_head": 2,
            "d_model": 128,
            "d_ff": 256,
        },
        {"block_size": 64, "micro_batch_size": 8, "accumulation": 2},
    ),
    "medium": (
        {
            "vocab_size": 8192,
            "max_seq_len": 64,
            "n_layer": 4,
            "n_head": 8,
            "n_kv_head": 4,
            "d_model": 512,
            "d_ff": 2048,
        },
        {"block_size": 64, "micro_batch_size": 2, "accumulation": 1},
    ),
    "large": (
        {
            "vocab_size": 32768,
            "max_seq_len": 1024,
            "n_layer": 12,
            "n_head": 12,
            "n_kv_head": 4,
            "d_model": 768,
            "d_ff": 3072,
        },
        {"block_size": 1024, "micro_batch_size": 8, "accumulation": 4},
    ),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_config(out: Path, nproc: int, strategy: str, args) -> Path:
    model, batch = PRESETS[args.preset]
    name = f"run{nproc}-{strategy}"
    micro, accum = batch["micro_batch_size"], batch["accumulation"]
    raw = {
        "run": {
            "name": f"bench-{name}",
            "seed": 0,
            "max_steps": args.steps,
            "output_dir": str(out / name),
        },
        "model": model,
        "data": {
            "synthetic": True,
            "num_tokens": max(4096, 4 * micro * accum * nproc * args.steps),
            "block_size": batch["block_size"],
            "micro_batch_size": micro,
            "target_batch_size": micro * accum * nproc,
        },
        "optimizer": {"lr": 3e-4},
        "scheduler": {"warmup_steps": 1},
        "precision": {"mode": args.precision},
        "compile": args.compile,
        "checkpoint": {"enabled": False},
        "parallel": {"strategy": strategy},
        "logging": {
            "json_file": str(out / f"{name}.jsonl"),
            "progress": False,
            "loss_plot": False,
            "level": "WARNING",
        },
    }
    path = out / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def run(cfg: Path, nproc: int, device: str, threads: int | None) -> list[dict]:
    "Train `cfg` with `nproc` processes; every rank's peak memory record."
    train = [str(Path(__file__).resolve()), "--worker", str(cfg), "--device", device]
    cmd = (
        [sys.executable, *train]
        if nproc == 1
        else [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(nproc),
            "--master-port",
            str(free_port()),
            *train,
        ]
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if device == "cpu":
        # default: same cores per job
        env["OMP_NUM_THREADS"] = str(threads or max(1, (os.cpu_count() or 1) // nproc))
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if res.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{res.stderr[-4000:]}")
    return [json.loads(p.read_text()) for p in sorted(cfg.parent.glob(f"{cfg.stem}.rank*.json"))]


def rss_bytes() -> int:
    "This process's peak resident memory so far (Linux reports KiB, macOS bytes)."
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def local_bytes(tensor) -> int:
    "Bytes this rank holds of `tensor` (its shard of a sharded `DTensor`)."
    t = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return t.numel() * t.element_size()


def training_state_bytes(model, optimizer) -> int:
    """This rank's weights, gradients (one per weight, alive from the backward to the update) and
    optimizer state."""
    import torch

    params = sum(local_bytes(p) for p in model.parameters())
    moments = sum(
        local_bytes(v)
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor) and v.ndim > 0
    )
    return 2 * params + moments


def worker(cfg: Path, device: str) -> None:
    """One rank of a benchmark job: train `cfg`, then write this rank's training state and peak
    memory beside it."""
    import torch

    # noqa: F401  (their code is not the run's memory)
    import torch.distributed.checkpoint, torch.distributed.fsdp
    from speedtronic.config import load_config
    from speedtronic.parallel import end_process
    from speedtronic.runtime import build_runtime, close_logger

    rank, cuda = int(os.environ.get("RANK", "0")), device == "cuda"
    base = rss_bytes()
    if cuda:
        torch.cuda.reset_peak_memory_stats(int(os.environ.get("LOCAL_RANK", "0")))
    trainer, _ = build_runtime(load_config(str(cfg)), device=device)
    trainer.fit()
    peak = torch.cuda.max_memory_allocated() if cuda else rss_bytes() - base
    record = {
        "rank": rank,
        "peak_bytes": peak,
        "state_bytes": training_state_bytes(trainer.model, trainer.optimizer),
    }
    (cfg.parent / f"{cfg.stem}.rank{rank}.json").write_text(json.dumps(record))
    close_logger(trainer.logger)
    trainer.run_claim.release()
    trainer.world.close()
    end_process(0)


def tokens_per_sec(jsonl: Path, warmup: int) -> float:
    steps = [
        r for r in map(json.loads, jsonl.read_text().splitlines()) if r.get("event") == "train_step"
    ]
    a, b = steps[min(warmup, len(steps) - 2)], steps[-1]
    return (b["tokens"] - a["tokens"]) / (b["elapsed_s"] - a["elapsed_s"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # one rank of a job this script started
    p.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument(
        "--strategy",
        nargs="+",
        default=["ddp", "fsdp"],
        choices=("ddp", "fsdp"),
        help="how the N-process jobs hold the model (default: both, side by side)",
    )
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument(
        "--nproc",
        type=int,
        nargs="+",
        default=None,
        help="process counts to compare with 1 (default: 2 on CPU, every GPU)",
    )
    p.add_argument(
        "--preset",
        default=None,
        choices=sorted(PRESETS),
        help="model size (default: small on CPU, large on CUDA)",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="optimizer steps per run (default: 30 on CPU, 60 on CUDA)",
    )
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the rate")
    p.add_argument("--precision", default=None, help="fp32 on CPU, bf16 on CUDA by default")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds; the median is shown")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads of every process (default: cores / processes, the same cores for every "
        "job)",
    )
    args = p.parse_args()
    if args.worker is not None:
        return worker(args.worker, args.device)
    cuda = args.device == "cuda"
    if cuda:
        import torch

        if not torch.cuda.is_available():
            sys.exit("--device cuda: no GPU is visible here")
        gpus = torch.cuda.device_count()
    args.nproc = args.nproc or [gpus if cuda else 2]
    args.preset = args.preset or ("large" if cuda else "small")
    args.steps = args.steps or (60 if cuda else 30)
    args.precision = args.precision or ("bf16" if cuda else "fp32")
    jobs = [(1, "ddp")] + [(n, s) for n in args.nproc if n != 1 for s in args.strategy]
    seen: dict[tuple[int, str], list[float]] = {}
    peaks: dict[tuple[int, str], list[int]] = {}
    states: dict[tuple[int, str], int] = {}
    with tempfile.TemporaryDirectory() as d:
        for _ in range(args.rounds):
            for n, strategy in jobs:
                ranks = run(write_config(Path(d), n, strategy, args), n, args.device, args.threads)
                seen.setdefault((n, strategy), []).append(
                    tokens_per_sec(Path(d) / f"run{n}-{strategy}.jsonl", args.warmup)
                )
                peaks.setdefault((n, strategy), []).append(max(r["peak_bytes"] for r in ranks))
                states[(n, strategy)] = max(r["state_bytes"] for r in ranks)
    rates = {job: statistics.median(v) for job, v in seen.items()}
    memory = {job: statistics.median(v) for job, v in peaks.items()}
    one = rates[(1, "ddp")]
    threads = "" if cuda else f", {args.threads or 'cores / processes'} thread(s) per process"
    print(
        f"{args.device} {args.preset} model, {args.precision}, {args.steps} steps (first "
        f"{args.warmup} left out), "
        f"same micro batch per rank{threads}, median of {args.rounds} round(s)"
    )
    what = "peak allocated" if cuda else "peak RSS"
    print(
        f"{'processes':>9} {'strategy':>8} {'tokens/s':>10} {'speed-up':>9} {'efficiency':>10} "
        f"{'state/rank':>12} {'fsdp/ddp':>8} {what + '/rank':>19} {'fsdp/ddp':>8}"
    )
    for (n, strategy), r in rates.items():
        fsdp = strategy == "fsdp" and (n, "ddp") in memory
        state_ratio = f"{states[(n, strategy)] / states[(n, 'ddp')]:>8.2f}" if fsdp else f"{'':>8}"
        peak_ratio = f"{memory[(n, strategy)] / memory[(n, 'ddp')]:>8.2f}" if fsdp else f"{'':>8}"
        print(
            f"{n:>9} {strategy if n > 1 else '-':>8} {r:>10.0f} {r / one:>8.2f}x "
            f"{r / (n * one):>9.0%} "
            f"{states[(n, strategy)] / 2**20:>8.1f} MiB {state_ratio} "
            f"{memory[(n, strategy)] / 2**20:>15.1f} MiB {peak_ratio}"
        )
    print(
        "state/rank: this rank's weights + gradients + optimizer state (its shards under fsdp); "
        + (
            "peak allocated: torch.cuda.max_memory_allocated() of the run"
            if cuda
            else "peak RSS: the rank's peak resident memory above its start (after imports), "
            "which also counts activations, "
            "communication buffers and what the allocator keeps"
        )
    )


if __name__ == "__main__":
    main()
