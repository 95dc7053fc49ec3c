"""Tokens/s of one process against a torchrun job of N processes, run side by side on the same config.

    python bench/bench_parallel.py                           # CPU: 1 vs 2 processes (gloo), a small model
    python bench/bench_parallel.py --device cuda --nproc 8   # GPU machine: 1 vs 8 GPUs (NCCL), a bigger model
    python bench/bench_parallel.py --device cuda --nproc 2 4 8 --preset large --steps 60

Every rank keeps the same micro batch and accumulation, so N processes train a global batch N times larger
(weak scaling, how data parallelism is used). Each run is `speedtronic train` (the 1-process run without torchrun,
the others under `python -m torch.distributed.run`); its tokens/s is read from rank 0's JSONL, which holds the
whole job's tokens, between the end of the warm-up steps and the last step (start-up, compile and the first
steps are left out). The table shows each job's tokens/s, its speed-up over one process and the scaling
efficiency `tokens/s(N) / (N x tokens/s(1))`.

On CPU the processes share the machine's cores, so expect little: the one process gets every core as
threads (OMP_NUM_THREADS = cores), each of N processes gets cores / N, so the jobs compute with the same cores
and the N-process job adds the gradient all-reduce (`--threads 1` instead gives every process one thread, so
the N-process job uses N times the cores; on a machine other jobs also load, OpenMP threads that wait for
each other can make the multi-threaded single process far slower, which says nothing about the trainer). The runs alternate for `--rounds` rounds and the table
shows the median, since a shared machine is noisy.
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
    "small": ({"vocab_size": 256, "max_seq_len": 64, "n_layer": 2, "n_head": 4, "n_kv_head": 2, "d_model": 128, "d_ff": 256},
              {"block_size": 64, "micro_batch_size": 8, "accumulation": 2}),
    "large": ({"vocab_size": 32768, "max_seq_len": 1024, "n_layer": 12, "n_head": 12, "n_kv_head": 4, "d_model": 768, "d_ff": 3072},
              {"block_size": 1024, "micro_batch_size": 8, "accumulation": 4}),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); return s.getsockname()[1]


def write_config(out: Path, nproc: int, args) -> Path:
    model, batch = PRESETS[args.preset]
    micro, accum = batch["micro_batch_size"], batch["accumulation"]
    raw = {"run": {"name": f"bench-{nproc}", "seed": 0, "max_steps": args.steps, "output_dir": str(out / f"run{nproc}")},
           "model": model,
           "data": {"synthetic": True, "num_tokens": max(4096, 4 * micro * accum * nproc * args.steps),
                    "block_size": batch["block_size"], "micro_batch_size": micro, "target_batch_size": micro * accum * nproc},
           "optimizer": {"lr": 3e-4}, "scheduler": {"warmup_steps": 1},
           "precision": {"mode": args.precision}, "compile": args.compile,
           "checkpoint": {"enabled": False},
           "logging": {"json_file": str(out / f"run{nproc}.jsonl"), "progress": False, "loss_plot": False, "level": "WARNING"}}
    path = out / f"run{nproc}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def run(cfg: Path, nproc: int, device: str, threads: int | None) -> None:
    train = ["-m", "speedtronic", "train", "--config", str(cfg), "--device", device]
    cmd = [sys.executable, *train] if nproc == 1 else \
          [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master-port", str(free_port()), *train]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if device == "cpu": env["OMP_NUM_THREADS"] = str(threads or max(1, (os.cpu_count() or 1) // nproc))  # default: same cores per job
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if res.returncode != 0: sys.exit(f"{' '.join(cmd)} failed:\n{res.stderr[-4000:]}")


def tokens_per_sec(jsonl: Path, warmup: int) -> float:
    steps = [r for r in map(json.loads, jsonl.read_text().splitlines()) if r.get("event") == "train_step"]
    a, b = steps[min(warmup, len(steps) - 2)], steps[-1]
    return (b["tokens"] - a["tokens"]) / (b["elapsed_s"] - a["elapsed_s"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--nproc", type=int, nargs="+", default=None, help="process counts to compare with 1 (default: 2 on CPU, every GPU)")
    p.add_argument("--preset", default=None, choices=sorted(PRESETS), help="model size (default: small on CPU, large on CUDA)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default: 30 on CPU, 60 on CUDA)")
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the rate")
    p.add_argument("--precision", default=None, help="fp32 on CPU, bf16 on CUDA by default")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds; the median is shown")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads of every process (default: cores / processes, the same cores for every job)")
    args = p.parse_args()
    cuda = args.device == "cuda"
    if cuda:
        import torch
        if not torch.cuda.is_available(): sys.exit("--device cuda: no GPU is visible here")
        gpus = torch.cuda.device_count()
    args.nproc = args.nproc or [gpus if cuda else 2]
    args.preset = args.preset or ("large" if cuda else "small")
    args.steps = args.steps or (60 if cuda else 30)
    args.precision = args.precision or ("bf16" if cuda else "fp32")
    seen: dict[int, list[float]] = {}
    with tempfile.TemporaryDirectory() as d:
        for _ in range(args.rounds):
            for n in [1, *[n for n in args.nproc if n != 1]]:
                run(write_config(Path(d), n, args), n, args.device, args.threads)
                seen.setdefault(n, []).append(tokens_per_sec(Path(d) / f"run{n}.jsonl", args.warmup))
    rates = {n: statistics.median(v) for n, v in seen.items()}
    threads = "" if cuda else f", {args.threads or 'cores / processes'} thread(s) per process"
    print(f"{args.device} {args.preset} model, {args.precision}, {args.steps} steps (first {args.warmup} left out), "
          f"same micro batch per rank{threads}, median of {args.rounds} round(s)")
    print(f"{'processes':>9} {'tokens/s':>12} {'speed-up':>9} {'efficiency':>10}")
    for n, r in rates.items():
        print(f"{n:>9} {r:>12.0f} {r / rates[1]:>8.2f}x {r / (n * rates[1]):>9.0%}")


if __name__ == "__main__":
    main()
