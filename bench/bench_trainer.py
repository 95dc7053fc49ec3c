"""Trainer overhead against a plain PyTorch loop: same model, same batches, same AdamW, accumulation
and clipping.

    python bench/bench_trainer.py
    # CPU fp32: alternating rounds + peak RSS of each loop
    python bench/bench_trainer.py --rounds 15 --steps 20

CPU loops are timed by the process's CPU time, so other processes on a shared machine do not count;
CUDA loops by wall time. Prints tokens/s of each loop per round, their ratio (trainer / plain;
target >= 0.99, the median of the rounds), the microseconds the trainer adds per step on a model
that costs almost nothing (target <= 25) with a breakdown of where they go (each piece timed on its
own; the rest is Python calls and the loop's structure), and the peak resident memory of each loop
measured in its own subprocess (target: trainer adds < 10%). Where CUDA is available it also
compares bf16 autocast with and without torch.compile.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from speedtronic.config import SpeedtronicConfig  # noqa: E402
from speedtronic.precision import resolve_precision  # noqa: E402
from speedtronic.profiling import MetricLogger  # noqa: E402
from speedtronic.registry import build_model  # noqa: E402
from speedtronic.precision import autocast_context  # noqa: E402
from speedtronic.trainer import (
    Trainer,
    _PendingStep,
    batch_size_and_tokens,
    move_batch,
    read_pending,  # noqa: E402
    resolve_loss,
    update_is_finite,
)

MODEL = {
    "vocab_size": 256,
    "max_seq_len": 64,
    "n_layer": 2,
    "n_head": 4,
    "n_kv_head": 2,
    "d_model": 128,
    "d_ff": 256,
}
MICRO, ACCUM, BLOCK, CLIP, LR = 8, 2, 64, 1.0, 1e-3


def make_config(precision: str, compile_: bool) -> SpeedtronicConfig:
    return SpeedtronicConfig.from_dict(
        {
            "model": MODEL,
            "data": {
                "block_size": BLOCK,
                "micro_batch_size": MICRO,
                "target_batch_size": MICRO * ACCUM,
            },
            "optimizer": {"lr": LR, "grad_clip": CLIP},
            "precision": precision,
            "compile": compile_,
            "checkpoint": {"enabled": False},
            "shape_validation": {"enabled": False},
        }
    ).validate()


def make_batches(n: int, device: torch.device) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        t = torch.randint(0, MODEL["vocab_size"], (MICRO, BLOCK + 1), generator=g)
        out.append({"input_ids": t[:, :-1].to(device), "labels": t[:, 1:].to(device)})
    return out


def make_model(device: torch.device):
    torch.manual_seed(0)
    model = build_model(MODEL).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)


class PlainLoop:
    "What a careful user writes by hand: accumulate, clip, step, one loss read per step."

    def __init__(self, device: torch.device, batches: list[dict], precision: str, compile_: bool):
        self.device, self.batches, self.i = device, batches, 0
        self.model, self.opt = make_model(device)
        self.run_model = torch.compile(self.model) if compile_ else self.model
        self.plan = resolve_precision(precision, device)

    def steps(self, n: int) -> float:
        losses = []
        for _ in range(n):
            total = torch.zeros((), device=self.device)
            for _ in range(ACCUM):
                batch = self.batches[self.i % len(self.batches)]
                self.i += 1
                with torch.autocast(
                    self.device.type, dtype=self.plan.dtype, enabled=self.plan.autocast_enabled
                ):
                    loss = self.run_model(**batch)["loss"]
                total += loss.detach()
                (loss / ACCUM).backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            losses.append((total / ACCUM).item())
        return losses[-1]


class TrainerLoop:
    def __init__(self, device: torch.device, batches: list[dict], precision: str, compile_: bool):
        model, opt = make_model(device)
        cfg = make_config(precision, compile_)
        self.trainer = Trainer(
            model,
            opt,
            batches,
            device=device,
            config=cfg,
            logger=MetricLogger(stream=False),
            max_steps=1,
            shape_report=False,
        )

    def steps(self, n: int) -> float:
        return self.trainer.fit(self.trainer.step + n).final_loss


def clock(device: torch.device):
    """The clock a loop is timed with: on CPU the process's CPU time (other processes on a shared
    machine do not count), on CUDA wall time (the GPU works while the process waits)."""
    return time.process_time if device.type == "cpu" else time.perf_counter


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def compare(
    device: torch.device, precision: str, compile_: bool, rounds: int, steps: int, warmup: int
) -> dict:
    """Rounds of `steps` steps of each loop, back to back (who goes first alternates); the median of
    the per-round ratios."""
    batches = make_batches(64, device)
    loops = {
        "plain": PlainLoop(device, batches, precision, compile_),
        "trainer": TrainerLoop(device, batches, precision, compile_),
    }
    for loop in loops.values():
        loop.steps(warmup)
    tokens = steps * ACCUM * MICRO * BLOCK
    rates, now = {name: [] for name in loops}, clock(device)
    for r in range(rounds):
        order = list(loops) if r % 2 == 0 else list(reversed(loops))  # alternate who goes first
        for name in order:
            sync(device)
            t0 = now()
            loops[name].steps(steps)
            sync(device)
            rates[name].append(tokens / (now() - t0))
    # each round's pair ran under the same load
    ratios = [t / p for t, p in zip(rates["trainer"], rates["plain"])]
    return {
        "device": str(device),
        "precision": precision,
        "compile": compile_,
        "rounds": rounds,
        "steps": steps,
        "plain_tok_s": statistics.median(rates["plain"]),
        "trainer_tok_s": statistics.median(rates["trainer"]),
        "ratio": statistics.median(ratios),
        "per_round_ratio": ratios,
    }


class _Tiny(torch.nn.Module):
    "A model so small that a step is mostly loop overhead."

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 1)

    def forward(self, input_ids, labels):
        return {"loss": (self.lin(input_ids).squeeze(-1) - labels).pow(2).mean()}


def loop_overhead_us(steps: int = 500, rounds: int = 9) -> float:
    """Extra microseconds per step of the Trainer over the plain loop, on a model that costs almost
    nothing."""
    batches = [{"input_ids": torch.randn(4, 8), "labels": torch.randn(4)} for _ in range(16)]
    m1, m2 = _Tiny(), _Tiny()
    o1, o2 = torch.optim.AdamW(m1.parameters()), torch.optim.AdamW(m2.parameters())
    trainer = Trainer(m1, o1, batches, device="cpu", logger=MetricLogger(stream=False), max_steps=1)

    def plain(n, i=[0]):
        for _ in range(n):
            b = batches[i[0] % len(batches)]
            i[0] += 1
            loss = m2(**b)["loss"]
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m2.parameters(), CLIP)
            o2.step()
            o2.zero_grad(set_to_none=True)
            loss.item()

    trainer.fit(10)
    plain(10)
    diffs = []
    for r in range(rounds):
        timed = {}
        # alternate who goes first
        for name in ("trainer", "plain") if r % 2 == 0 else ("plain", "trainer"):
            t0 = time.process_time()
            trainer.fit(trainer.step + steps) if name == "trainer" else plain(steps)
            timed[name] = time.process_time() - t0
        diffs.append((timed["trainer"] - timed["plain"]) / steps * 1e6)
    return statistics.median(diffs)


def per_call_us(fn, n: int = 5000, rounds: int = 3) -> float:
    "Median microseconds of one call of `fn`."
    times = []
    for _ in range(rounds):
        t0 = time.process_time()
        for _ in range(n):
            fn()
        times.append((time.process_time() - t0) / n * 1e6)
    return statistics.median(times)


def overhead_parts() -> dict[str, float]:
    """Microseconds per step of each piece the Trainer adds to the plain loop (tiny model, CPU, one
    microbatch)."""
    batch = {"input_ids": torch.randn(4, 8), "labels": torch.randn(4)}
    model = _Tiny()
    trainer = Trainer(
        model,
        torch.optim.AdamW(model.parameters()),
        [batch],
        device="cpu",
        logger=MetricLogger(stream=False),
        max_steps=1,
    )
    out = model(**batch)
    loss = out["loss"]
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    held = loss.detach().float()
    dev, plan, world = trainer.device, trainer.precision, trainer.world

    def contexts():
        with world.gradient_sync(trainer.synced_model, sync=True), autocast_context(plan, dev):
            pass

    record = {
        "step": 1,
        "loss": 1.0,
        "lr": 1e-3,
        "steps_per_sec": 1.0,
        "samples_per_sec": 4.0,
        "tokens_per_sec": 32.0,
        "samples": 4,
        "tokens": 32,
        "micro_batches": 1,
    }
    pending = [_PendingStep(1, held, 32, 4, 1, 1e-3, 0.0)]
    item = per_call_us(held.item)
    return {
        "move + count the batch": per_call_us(
            lambda: (move_batch(batch, dev), batch_size_and_tokens(batch))
        ),
        "autocast + gradient-sync contexts": per_call_us(contexts),
        "resolve the loss, keep it detached": per_call_us(
            lambda: (resolve_loss(out, batch), loss.detach().float(), loss.requires_grad)
        ),
        "finite check (one scalar read)": per_call_us(lambda: update_is_finite(held, norm)),
        "read the loss (beyond the plain .item())": max(
            0.0, per_call_us(lambda: read_pending(pending)) - item
        ),
        "the train_step record and emit": per_call_us(
            lambda: trainer.logger.emit("train_step", dict(record))
        ),
        "pending step, counters, lr, stop flag": per_call_us(
            lambda: (
                _PendingStep(1, held, 32, 4, 1, 1e-3, time.perf_counter()),
                float(trainer.optimizer.param_groups[0]["lr"]),
                world.agree_stop(None),
            )
        ),
    }


def rss_child(mode: str, steps: int) -> None:
    device = torch.device("cpu")
    loop = (PlainLoop if mode == "plain" else TrainerLoop)(
        device, make_batches(64, device), "fp32", False
    )
    loop.steps(steps)
    print(
        json.dumps({"mode": mode, "max_rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss})
    )


def peak_rss(steps: int) -> dict:
    out = {}
    for mode in ("plain", "trainer"):
        proc = subprocess.run(
            [sys.executable, __file__, "--rss-child", mode, "--steps", str(steps)],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        out[mode] = json.loads(proc.stdout.strip().splitlines()[-1])["max_rss_kb"] / 1024
    return {
        "plain_mb": out["plain"],
        "trainer_mb": out["trainer"],
        "increase": out["trainer"] / out["plain"] - 1,
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rss-child", choices=("plain", "trainer"))
    args = ap.parse_args(argv)
    if args.rss_child:
        return rss_child(args.rss_child, args.steps)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    cases = [(torch.device("cpu"), "fp32", False)]
    if torch.cuda.is_available():
        cases += [(torch.device("cuda"), "bf16", False), (torch.device("cuda"), "bf16", True)]
    for device, precision, compile_ in cases:
        r = compare(device, precision, compile_, args.rounds, args.steps, args.warmup)
        print(
            f"{r['device']:5} {r['precision']} compile={str(r['compile']):5}  plain "
            f"{r['plain_tok_s']:9.0f} tok/s  "
            f"trainer {r['trainer_tok_s']:9.0f} tok/s  ratio {r['ratio']:.3f} (median of "
            f"{r['rounds']} rounds: "
            f"{', '.join(f'{x:.3f}' for x in r['per_round_ratio'])})"
        )
    added, parts = loop_overhead_us(), overhead_parts()
    print(
        f"loop overhead (tiny model, CPU): trainer adds {added:.0f} us per step over the plain "
        "loop; where it goes:"
    )
    for name, us in parts.items():
        print(f"  {name:<42} {us:5.1f} us")
    print(
        f"  {'the rest (calls, the step and fit structure)':<42} "
        f"{added - sum(parts.values()):5.1f} us"
    )
    m = peak_rss(args.steps)
    print(
        f"peak RSS (CPU, own process): plain {m['plain_mb']:.1f} MB  trainer "
        f"{m['trainer_mb']:.1f} MB  "
        f"(+{100 * m['increase']:.1f}%)"
    )


if __name__ == "__main__":
    main()
