"""Out-of-order backprop on a GPU: forward+backward time with and without the CUDA stream stage
scheduler.

    python bench/bench_ooo.py                  # needs CUDA; prints a note and exits 0 elsewhere
    python bench/bench_ooo.py --rounds 5 --steps 30 --streams 2 4 8

Models: the reference transformer (mostly a chain: little to overlap) and a four-branch MLP
(independent branches fed by one input: the case stream scheduling is for), each in fp32 and bf16
autocast. Rounds alternate between the plain and the scheduled loop on the same model and batch; the
ratio of their median step times is printed (>1 means the scheduler is faster). Gradients are
checked equal before timing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from speedtronic.model import ReferenceTransformer  # noqa: E402
from speedtronic.scheduling import StageStreamScheduler  # noqa: E402


class Branches(nn.Module):
    "Independent branches on one input, summed."

    def __init__(self, width: int = 1024, branches: int = 4):
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.branches = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
            for _ in range(branches)
        )
        self.ooo_stage_names = [f"branches.{i}" for i in range(branches)]
        self.out = nn.Linear(width, 1)

    def forward(self, x):
        h = self.inp(x)
        return self.out(sum(b(h) for b in self.branches)).square().mean()


def models():
    torch.manual_seed(0)
    ref = ReferenceTransformer(
        vocab_size=512, block_size=256, n_layer=4, n_head=8, n_kv_head=2, d_model=512
    ).cuda()
    ids = torch.randint(0, 512, (16, 256), device="cuda")
    yield "reference transformer 4x512", ref, (lambda m: m(ids, labels=ids)["loss"])
    torch.manual_seed(0)
    branches = Branches().cuda()
    x = torch.randn(256, 1024, device="cuda")
    yield "four-branch MLP 1024", branches, (lambda m: m(x))


def step_time(model, loss_of, steps: int, scheduler=None, autocast=False) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.begin()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = loss_of(model)
        if scheduler is not None:
            scheduler.finish()
        loss.backward()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def grads(model, loss_of, scheduler=None):
    model.zero_grad(set_to_none=True)
    if scheduler is not None:
        scheduler.begin()
    loss = loss_of(model)
    if scheduler is not None:
        scheduler.finish()
    loss.backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--streams", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(
            "bench_ooo: CUDA is not available here; the stream scheduler is a no-op off CUDA, "
            "nothing to measure"
        )
        return
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(
        f"{'model':<30}{'precision':>10}{'streams':>8}{'plain ms':>10}{'ooo ms':>10}"
        f"{'plain/ooo':>11}"
    )
    for name, model, loss_of in models():
        for streams in args.streams:
            sched = StageStreamScheduler(model, "cuda", num_streams=streams)
            if not sched.enabled:
                print(f"{name:<30} scheduler off: {sched.reason}")
                continue
            for a, b in zip(grads(model, loss_of), grads(model, loss_of, sched)):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
            for autocast in (False, True):
                step_time(model, loss_of, 3, None, autocast)
                step_time(model, loss_of, 3, sched, autocast)  # warm-up
                plain, ooo = [], []
                for _ in range(args.rounds):
                    plain.append(step_time(model, loss_of, args.steps, None, autocast))
                    ooo.append(step_time(model, loss_of, args.steps, sched, autocast))
                p, o = statistics.median(plain), statistics.median(ooo)
                print(
                    f"{name:<30}{'bf16' if autocast else 'fp32':>10}{streams:>8}"
                    f"{p * 1e3:>10.2f}{o * 1e3:>10.2f}{p / o:>11.3f}"
                )
            sched.dispose()


if __name__ == "__main__":
    main()
