"""Optimizers on real text: held-out loss at equal tokens, each at its best learning rate and at one
shared rate, plus the time per training step of each next to AdamW's.

    python bench/bench_optimizers.py
    # default: about 10-15 minutes on 2 CPU cores
    python bench/bench_optimizers.py --steps 60 --lrs 5e-3
    # quicker: fewer steps, one learning rate

Every run trains the README demo model (configs/demo.yaml: 3 layers, 96 wide, byte vocabulary,
batches of 16 x 64 tokens, warmup then cosine) through the real runtime
(`speedtronic.runtime.build_runtime`) on the standard-library docstring corpus
(`speedtronic.runtime.demo_corpus_text`), from the same initial weights and in the same data order,
for the same number of steps. The last 10% of the corpus is held out; the loss reported is the mean
cross-entropy (nats per byte) on fixed held-out windows after training. `--shared-lr` (default: the
demo config's 5e-3) is the "one config lr for every optimizer" column; the sweep picks each
optimizer's best lr. Muon with 2.0's update scale is run at the shared lr only, to show what 2.0's
default did. Step times are measured side by side afterwards: the variants take turns, a few steps
each, over several rounds, and the median of each is divided by AdamW's.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import yaml  # noqa: E402

from speedtronic.data import CharTokenizer  # noqa: E402
from speedtronic.optimizers import build_optimizer  # noqa: E402
from speedtronic.runtime import build_runtime, close_logger, demo_corpus_text  # noqa: E402

SHARED_ONLY = ("muon (2.0 scale)",)
VARIANTS = {
    "adamw": {"name": "adamw"},
    "muon": {"name": "muon"},
    "muon (2.0 scale)": {"name": "muon", "muon_scale": "original"},
    "muon+": {"name": "muon", "muon_plus": True},
    "cautious adamw": {"name": "adamw", "cautious": True},
    "cautious muon": {"name": "muon", "cautious": True},
}


def demo_config(train_file: Path, out: Path, optimizer: dict, lr: float, steps: int) -> dict:
    """configs/demo.yaml with the bench's corpus, optimizer, lr and step count; no checkpoints,
    quiet logging."""
    raw = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    raw["run"].update(max_steps=steps, output_dir=str(out))
    raw["data"]["text_path"] = str(train_file)
    raw["optimizer"] = {**raw["optimizer"], **optimizer, "lr": lr}
    raw["scheduler"]["warmup_steps"] = min(raw["scheduler"]["warmup_steps"], steps // 5)
    raw["checkpoint"] = {"enabled": False}
    raw["logging"] = {
        "level": "WARNING",
        "every_steps": steps,
        "progress": False,
        "loss_plot": False,
    }
    return raw


def held_out_batches(text: str, count: int = 48, block: int = 64, seed: int = 0) -> torch.Tensor:
    "Fixed windows of `block + 1` bytes from the held-out text."
    ids = torch.tensor(CharTokenizer(256).encode(text), dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(ids) - block - 1, (count,), generator=g)
    return torch.stack([ids[s : s + block + 1] for s in starts.tolist()])


@torch.no_grad()
def held_out_loss(model, windows: torch.Tensor) -> float:
    model.eval()
    losses = [model(w[:, :-1], labels=w[:, 1:])["loss"].item() for w in windows.split(16)]
    model.train()
    return sum(losses) / len(losses)


def train(
    train_file: Path, windows: torch.Tensor, optimizer: dict, lr: float, steps: int, out: Path
) -> dict:
    trainer, _ = build_runtime(demo_config(train_file, out, optimizer, lr, steps), device="cpu")
    try:
        start = time.perf_counter()
        result = trainer.fit()
        elapsed = time.perf_counter() - start
    finally:
        close_logger(trainer.logger)
    train_tail = [r["loss"] for r in result.metrics][-1:] if result.metrics else [float("nan")]
    loss = held_out_loss(trainer.model, windows)
    return {
        "held_out": loss if math.isfinite(loss) else float("inf"),
        "train": train_tail[-1],
        "tokens": result.tokens,
        "seconds": elapsed,
    }


def step_times(train_file: Path, lr: float, rounds: int, steps: int) -> dict[str, float]:
    """Median seconds per training step of each variant, measured in turns on the same model and
    batch."""
    trainers = {}
    for name, optimizer in VARIANTS.items():
        trainer, _ = build_runtime(
            demo_config(train_file, Path(tempfile.mkdtemp()), optimizer, lr, 10_000), device="cpu"
        )
        close_logger(trainer.logger)
        trainers[name] = trainer
    batch = next(iter(trainers["adamw"].dataloader))
    times = {name: [] for name in VARIANTS}
    for _ in range(rounds + 1):  # the first round warms up and is dropped
        for name, trainer in trainers.items():
            model, opt = trainer.model, trainer.optimizer
            start = time.perf_counter()
            for _ in range(steps):
                opt.zero_grad(set_to_none=True)
                model(batch["input_ids"], labels=batch["labels"])["loss"].backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
            times[name].append((time.perf_counter() - start) / steps)
    return {name: statistics.median(t[1:]) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--steps", type=int, default=400, help="optimizer steps per run (tokens = steps x 1024)"
    )
    parser.add_argument(
        "--lrs",
        type=float,
        nargs="+",
        default=[6.25e-4, 1.25e-3, 2.5e-3, 5e-3, 1e-2, 2e-2, 4e-2],
        help="learning-rate sweep",
    )
    parser.add_argument(
        "--shared-lr",
        type=float,
        default=5e-3,
        help="the one config lr every optimizer is also run at",
    )
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument(
        "--timing-rounds", type=int, default=5, help="0 skips the step-time measurement"
    )
    parser.add_argument("--timing-steps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    lrs = sorted(set(args.lrs) | {args.shared_lr})
    text = demo_corpus_text()
    cut = int(len(text) * 0.9)
    work = Path(tempfile.mkdtemp(prefix="bench_optimizers_"))
    train_file = work / "train.txt"
    train_file.write_text(text[:cut], encoding="utf-8")
    windows = held_out_batches(text[cut:])
    print(
        f"corpus: {len(text):,} characters ({cut:,} train, {len(text) - cut:,} held out); "
        f"{args.steps} steps of "
        f"16 x 64 tokens = {args.steps * 1024:,} tokens per run; lrs {lrs}; torch "
        f"{torch.__version__}, "
        f"{torch.get_num_threads()} threads"
    )
    results: dict[str, dict[float, dict]] = {}
    for name in args.variants:
        results[name] = {}
        for lr in lrs if name not in SHARED_ONLY else [args.shared_lr]:
            r = train(
                train_file,
                windows,
                VARIANTS[name],
                lr,
                args.steps,
                work / f"{name}-{lr}".replace(" ", "_"),
            )
            results[name][lr] = r
            print(
                f"  {name:<18} lr {lr:<8g} held-out {r['held_out']:.4f}  train {r['train']:.4f}  "
                f"({r['seconds']:.0f} s)",
                flush=True,
            )
    times = (
        step_times(train_file, args.shared_lr, args.timing_rounds, args.timing_steps)
        if args.timing_rounds
        else {}
    )
    timing = lambda name: (
        f"{times[name] * 1e3:.1f} | {times[name] / times['adamw']:.2f}x" if times else "- | -"
    )
    print()
    header = (
        "| optimizer | best lr | held-out loss at best lr | held-out loss at lr "
        f"{args.shared_lr:g} | "
        f"step time (ms) | vs AdamW |"
    )
    print(header)
    print("|---|---|---|---|---|---|")
    for name in args.variants:
        shared = results[name][args.shared_lr]["held_out"]
        if name in SHARED_ONLY:
            best_lr, best = "-", "-"
        else:
            best_lr = min(results[name], key=lambda lr: results[name][lr]["held_out"])
            best_lr, best = f"{best_lr:g}", f"{results[name][best_lr]['held_out']:.4f}"
        print(f"| {name} | {best_lr} | {best} | {shared:.4f} | {timing(name)} |")
    print()
    print("held-out loss by lr:")
    print("| optimizer | " + " | ".join(f"{lr:g}" for lr in lrs) + " |")
    print("|---|" + "---|" * len(lrs))
    for name in args.variants:
        print(
            f"| {name} | "
            + " | ".join(
                f"{results[name][lr]['held_out']:.4f}" if lr in results[name] else "-" for lr in lrs
            )
            + " |"
        )


if __name__ == "__main__":
    main()
