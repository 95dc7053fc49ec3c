"""Forward+backward time of the reference model against a plain PyTorch transformer of the same
shape.

Both models have the same architecture (RoPE, grouped-query attention through SDPA, SwiGLU, RMSNorm,
tied embeddings), the same dims and the same batch. Runs alternate inside one process (warm-up
first, then rounds of several iterations, ours and plain in turn), and the script prints the median
ms/iter of each and the ratio ours/plain (on CPU also process-CPU time, which a busy shared machine
disturbs less than wall time). On CUDA it also measures bf16 autocast, and ours with an all-ones
`attention_mask` (the masked SDPA path a padded batch takes there).

    python bench/bench_model.py                 # CPU, fp32, 2 threads
    python bench/bench_model.py --device cuda   # adds bf16 autocast
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from speedtronic.model import ReferenceTransformer, swiglu_hidden  # noqa: E402


class PlainBlock(nn.Module):
    "A straightforward pre-norm block: RMSNorm, GQA attention with RoPE via SDPA, SwiGLU."

    def __init__(self, d: int, n_head: int, n_kv: int, hidden: int):
        super().__init__()
        self.n_head, self.n_kv, self.hd = n_head, n_kv, d // n_head
        self.n1, self.n2 = nn.Parameter(torch.ones(d)), nn.Parameter(torch.ones(d))
        self.q = nn.Linear(d, d, bias=False)
        self.k = nn.Linear(d, n_kv * self.hd, bias=False)
        self.v = nn.Linear(d, n_kv * self.hd, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.gate = nn.Linear(d, hidden, bias=False)
        self.up = nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    @staticmethod
    def norm(x, w):
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5).to(x.dtype) * w

    @staticmethod
    def rope(x, cos, sin):
        a, b = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-b, a), dim=-1) * sin

    def forward(self, x, cos, sin):
        B, T, C = x.shape
        h = self.norm(x, self.n1)
        q = self.q(h).view(B, T, self.n_head, self.hd).transpose(1, 2)
        k = self.k(h).view(B, T, self.n_kv, self.hd).transpose(1, 2)
        v = self.v(h).view(B, T, self.n_kv, self.hd).transpose(1, 2)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
        rep = self.n_head // self.n_kv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(B, T, C))
        h = self.norm(x, self.n2)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class PlainTransformer(nn.Module):
    "The same architecture written plainly, with the RoPE table precomputed as buffers."

    def __init__(
        self, vocab: int, d: int, n_layer: int, n_head: int, n_kv: int, d_ff: int, seq: int
    ):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(
            PlainBlock(d, n_head, n_kv, swiglu_hidden(d_ff, n_head)) for _ in range(n_layer)
        )
        self.nf = nn.Parameter(torch.ones(d))
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight
        hd = d // n_head
        inv = 1.0 / (10000.0 ** (torch.arange(0, hd, 2).float() / hd))
        ang = torch.outer(torch.arange(seq).float(), inv)
        ang = torch.cat((ang, ang), dim=-1)
        self.register_buffer("cos", ang.cos(), persistent=False)
        self.register_buffer("sin", ang.sin(), persistent=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, 0.02)

    def forward(self, input_ids, labels):
        T = input_ids.shape[1]
        x = self.wte(input_ids)
        for blk in self.blocks:
            x = blk(x, self.cos[:T], self.sin[:T])
        logits = self.head(PlainBlock.norm(x, self.nf))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def step_fn(model, batch, autocast):
    "One forward+backward; returns a callable for the timer."
    ours = isinstance(model, ReferenceTransformer)

    def step():
        with autocast():
            loss = model(**batch)["loss"] if ours else model(batch["input_ids"], batch["labels"])
        loss.backward()
        for p in model.parameters():
            p.grad = None

    return step


def timed(step, iters: int, device: torch.device) -> tuple[float, float]:
    "Wall and process-CPU milliseconds per iteration over `iters` calls of `step`."
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(iters):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) * 1000 / iters, (time.process_time() - c0) * 1000 / iters


def compare(
    steps: dict, rounds: int, iters: int, warmup: int, device: torch.device
) -> dict[str, tuple[float, float]]:
    "Median (wall, CPU) ms/iter of each step, measured in alternating rounds after a warm-up."
    for step in steps.values():
        for _ in range(warmup):
            step()
    samples = {name: [] for name in steps}
    for r in range(rounds):
        order = list(steps) if r % 2 == 0 else list(steps)[::-1]
        for name in order:
            samples[name].append(timed(steps[name], iters, device))
    return {
        name: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v))
        for name, v in samples.items()
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-head", type=int, default=8)
    ap.add_argument("--n-kv-head", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument(
        "--mask", action="store_true", help="also time ours with an all-ones attention_mask"
    )
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    d_ff = 4 * a.d_model
    torch.manual_seed(0)
    ours = (
        ReferenceTransformer(
            vocab_size=a.vocab,
            max_seq_len=a.seq,
            n_layer=a.n_layer,
            n_head=a.n_head,
            n_kv_head=a.n_kv_head,
            d_model=a.d_model,
            d_ff=d_ff,
        )
        .to(device)
        .train()
    )
    plain = (
        PlainTransformer(a.vocab, a.d_model, a.n_layer, a.n_head, a.n_kv_head, d_ff, a.seq)
        .to(device)
        .train()
    )
    n_ours = sum(p.numel() for p in ours.parameters())
    assert n_ours == sum(p.numel() for p in plain.parameters()), "models differ in size"
    ids = torch.randint(0, a.vocab, (a.batch, a.seq), device=device)
    batch = {"input_ids": ids, "labels": ids.roll(-1, 1)}
    padded = {**batch, "attention_mask": torch.ones_like(ids)}
    print(
        f"torch {torch.__version__}, device {device}, threads {torch.get_num_threads()}, "
        f"d_model {a.d_model}, layers {a.n_layer}, heads {a.n_head}/{a.n_kv_head} kv, seq {a.seq}, "
        f"batch {a.batch}, {n_ours:,} parameters; {a.rounds} rounds x {a.iters} iters"
    )
    modes = [("fp32", contextlib.nullcontext)]
    if device.type == "cuda":
        modes.append(("bf16 autocast", lambda: torch.autocast("cuda", dtype=torch.bfloat16)))
    for label, autocast in modes:
        steps = {"ours": step_fn(ours, batch, autocast), "plain": step_fn(plain, batch, autocast)}
        if a.mask or device.type == "cuda":
            steps["ours, mask of ones"] = step_fn(ours, padded, autocast)
        med = compare(steps, a.rounds, a.iters, a.warmup, device)
        print(
            f"[{label}] forward+backward median wall ms/iter: "
            + ", ".join(f"{k} {w:.2f}" for k, (w, _) in med.items())
            + f"; ratio ours/plain {med['ours'][0] / med['plain'][0]:.3f}"
        )
        if device.type == "cpu":  # CPU time is steadier than wall time on a shared machine
            print(
                f"[{label}] median process-CPU ms/iter: "
                + ", ".join(f"{k} {c:.2f}" for k, (_, c) in med.items())
                + f"; ratio ours/plain {med['ours'][1] / med['plain'][1]:.3f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
