"""Generation speed: tokens/s with the reference model's KV cache against full forwards, side by
side.

Both runs use the same model, prompt and greedy decoding through
`speedtronic.generation.generate_ids`; the uncached run wraps the model so it has no `new_cache`
(the path a custom model takes: a full forward over the last `max_seq_len` tokens per new token).
Runs alternate inside one process after a warm-up; the script prints the median tokens/s of each,
the ratio cached/uncached, and checks both wrote the same tokens.

    OMP_NUM_THREADS=1 python bench/bench_generate.py  # CPU: demo model and a 512-token one
    python bench/bench_generate.py --device cuda --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from speedtronic.generation import generate_ids  # noqa: E402
from speedtronic.model import ReferenceTransformer  # noqa: E402

SHAPES = {  # name -> (model keywords, prompt tokens, new tokens)
    "demo (configs/demo.yaml)": (
        dict(
            vocab_size=256, max_seq_len=64, n_layer=3, n_head=4, n_kv_head=2, d_model=96, d_ff=256
        ),
        16,
        48,
    ),
    "512-token, 6x256": (
        dict(vocab_size=512, max_seq_len=512, n_layer=6, n_head=8, n_kv_head=2, d_model=256),
        64,
        256,
    ),
}


class NoCache(nn.Module):
    "The same model behind a forward without a cache."

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner, self.config = inner, inner.config

    def forward(self, input_ids):
        return self.inner(input_ids)


def timed(
    model: nn.Module, prompt: list[int], new: int, device: torch.device
) -> tuple[float, list[int]]:
    "Seconds to write `new` greedy tokens, and the tokens."
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    tokens = list(generate_ids(model, prompt, max_new_tokens=new, temperature=0))
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    device = torch.device(args.device)
    print(f"torch {torch.__version__}, {device}, {torch.get_num_threads()} threads, greedy, fp32")
    print(
        f"{'model':28} {'prompt+new':>10} {'cached tok/s':>13} {'uncached tok/s':>15} {'ratio':>7}"
    )
    for name, (kwargs, n_prompt, new) in SHAPES.items():
        torch.manual_seed(0)
        model = ReferenceTransformer(**kwargs).to(device).eval()
        prompt = torch.randint(0, kwargs["vocab_size"], (n_prompt,)).tolist()
        runs = {"cached": model, "uncached": NoCache(model)}
        for m in runs.values():
            timed(m, prompt, 4, device)  # warm-up
        seconds, tokens = {k: [] for k in runs}, {}
        for _ in range(args.rounds):
            for key, m in runs.items():
                s, tokens[key] = timed(m, prompt, new, device)
                seconds[key].append(s)
        assert tokens["cached"] == tokens["uncached"], "cached and uncached greedy tokens differ"
        rate = {k: new / statistics.median(v) for k, v in seconds.items()}
        print(
            f"{name:28} {f'{n_prompt}+{new}':>10} {rate['cached']:13.1f} {rate['uncached']:15.1f} "
            f"{rate['cached'] / rate['uncached']:6.2f}x"
        )


if __name__ == "__main__":
    main()
