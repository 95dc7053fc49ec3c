"""Bytes per round and the error of the accumulated delta, per delta encoding, on a small GPT's
real pseudo-gradients.

A small reference transformer trains on the demo corpus (bytes, AdamW, one process); the change of
its floating weights over each round of --inner-steps steps is that round's pseudo-gradient, as one
DiLoCo node computes it (no outer step: the deltas are real, the base is the node's own weights).
For each encoding (float32, bfloat16 and int8 from the wire format's `encode_delta`; top-k at
densities 0.03 and 0.01 in 4 and 2 bits from speedtronic.distributed.compression) it prints the
bytes of one round's delta file (safetensors with the delta header, a tied tensor once) against
float32's, and the relative error |sum sent - sum intended| / |sum intended| of the deltas summed
over all rounds, without and with error feedback (the residual carried into the next round).
Nothing here is timed.

    python bench/bench_compression.py                         # 20 rounds of 10 steps, d_model 128
    python bench/bench_compression.py --rounds 40 --inner-steps 25 --d-model 256
    python bench/bench_compression.py --rounds 2 --inner-steps 1 --d-model 64   # a quick look
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from speedtronic.distributed.compression import (  # noqa: E402
    TopK,
    decode_wire,
    encode_wire,
    send_with_feedback,
)
from speedtronic.distributed.tensors import (  # noqa: E402
    compute_pseudo_gradient,
    delta_header,
    floating_state,
    safetensors_bytes,
)
from speedtronic.registry import build_model  # noqa: E402
from speedtronic.runtime import demo_corpus_text  # noqa: E402

ENCODINGS = [
    ("float32", "float32", None),
    ("bfloat16", "bfloat16", None),
    ("int8", "int8", None),
    ("topk 3% 4-bit", "topk", (0.03, 4)),
    ("topk 3% 2-bit", "topk", (0.03, 2)),
    ("topk 1% 4-bit", "topk", (0.01, 4)),
    ("topk 1% 2-bit", "topk", (0.01, 2)),
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=20, help="rounds (deltas) to sum")
    p.add_argument("--inner-steps", type=int, default=10, help="training steps per round")
    p.add_argument("--d-model", type=int, default=128, help="model width (a multiple of 4)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--block", type=int, default=64, help="tokens per sequence")
    p.add_argument("--chunk", type=int, default=4096, help="top-k chunk, entries")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("rounds", "inner_steps", "layers", "batch", "block", "chunk"):
        if getattr(args, name) < 1:
            p.exit(
                2,
                f"bench_compression: --{name.replace('_', '-')} {getattr(args, name)}: "
                "must be at least 1\n",
            )
    if args.d_model < 4 or args.d_model % 4:
        p.exit(
            2, f"bench_compression: --d-model {args.d_model}: must be a positive multiple of 4\n"
        )
    try:
        TopK(0.01, 2, args.chunk)
    except ValueError as e:
        p.exit(2, f"bench_compression: --chunk {args.chunk}: {e}\n")
    return args


def real_deltas(args) -> tuple[list[dict[str, torch.Tensor]], int, int]:
    "`(one pseudo-gradient per round, parameters, tensors)` of a small model training on real text."
    torch.manual_seed(args.seed)
    model = build_model(
        {
            "vocab_size": 256,
            "max_seq_len": args.block,
            "n_layer": args.layers,
            "n_head": 4,
            "n_kv_head": 2,
            "d_model": args.d_model,
            "d_ff": 2 * args.d_model,
        }
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    text = torch.tensor(list(demo_corpus_text().encode("utf-8")), dtype=torch.long)
    g = torch.Generator().manual_seed(args.seed)
    deltas = []
    for _ in range(args.rounds):
        before = {k: v.clone() for k, v in floating_state(model.state_dict()).items()}
        for _ in range(args.inner_steps):
            at = torch.randint(0, text.numel() - args.block - 1, (args.batch, 1), generator=g)
            rows = text[at + torch.arange(args.block + 1)]
            loss = model(input_ids=rows[:, :-1], labels=rows[:, 1:])["loss"]
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        deltas.append(compute_pseudo_gradient(before, floating_state(model.state_dict())))
    state = floating_state(model.state_dict())
    return deltas, sum(p.numel() for p in model.parameters()), len(state)


def file_bytes(tensors: dict, header: dict, round_: int) -> int:
    "Bytes of the delta file a node would write for `tensors` with its encoding's `header`."
    meta = delta_header(
        node_id="node-0",
        local_step=round_,
        base_outer_step=round_ - 1,
        inner_steps=1,
        encoding=header["encoding"],
        extra=header,
    )
    return len(safetensors_bytes(tensors, meta))


def sum_error(deltas, encoding: str, topk: TopK, feedback: bool) -> tuple[float, int]:
    "`(relative error of the summed deltas as sent, bytes of the last round's file)`."
    shapes = {k: tuple(v.shape) for k, v in deltas[0].items()}
    sent = {k: torch.zeros(s) for k, s in shapes.items()}
    intended = {k: torch.zeros(s) for k, s in shapes.items()}
    residual, size = None, 0
    for r, delta in enumerate(deltas, 1):
        if feedback:
            tensors, header, residual = send_with_feedback(delta, residual, encoding, topk)
        else:
            tensors, header = encode_wire(delta, encoding, topk)
        for k, v in decode_wire(tensors, header, shapes).items():
            sent[k] += v
            intended[k] += delta[k]
        size = file_bytes(tensors, header, r)
    miss = sum(float((sent[k] - intended[k]).pow(2).sum()) for k in shapes) ** 0.5
    total = sum(float(intended[k].pow(2).sum()) for k in shapes) ** 0.5
    return miss / total, size


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    deltas, params, tensors = real_deltas(args)
    print(
        f"model: reference_transformer, {args.layers} layers, d_model {args.d_model}: "
        f"{params / 1e6:.2f}M parameters, {tensors} floating tensors"
    )
    print(
        f"deltas: {args.rounds} rounds of {args.inner_steps} AdamW steps "
        f"(batch {args.batch} x {args.block} tokens), seed {args.seed}; top-k chunk {args.chunk}"
    )
    print()
    print(
        f"{'encoding':<15} {'bytes/round':>12} {'of float32':>11}  "
        f"{'sum error, no feedback':>22} {'with feedback':>14}"
    )
    base = None
    for name, encoding, opts in ENCODINGS:
        topk = TopK(*(opts or (0.03, 2)), args.chunk)
        plain, size = sum_error(deltas, encoding, topk, feedback=False)
        fed, _ = sum_error(deltas, encoding, topk, feedback=True)
        base = base or size
        print(f"{name:<15} {size:>12,} {f'1/{base / size:.1f}':>11}  {plain:>22.1e} {fed:>14.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
