"""Held-out evaluation's cost per training step: the same run with and without `eval`, side by side.

Both runs train the README demo's model (configs/demo.yaml: its text, its tenth held out) for
`--steps` steps; the one with `eval` evaluates every `--every` steps on `--batches` held-out batches
(and once at the end). Runs alternate inside one process after a warm-up. The script prints the
median seconds per training step of each, what evaluation adds per step in all (its batches
included) and outside its own batches (the evaluator's set-up, the loader reset, the RNG
save/restore: the total minus the `eval_s` the records report), and checks the two runs' training
losses are bit-identical.

    OMP_NUM_THREADS=1 python bench/bench_eval.py                 # CPU, about a minute
    python bench/bench_eval.py --device cuda --steps 200
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import yaml  # noqa: E402

from speedtronic.runtime import build_runtime  # noqa: E402


def config(folder: Path, steps: int, every: int | None, batches: int) -> dict:
    """The demo config in `folder`: `steps` steps, no checkpoints or log files; `eval` every `every`
    steps (None: no eval)."""
    raw = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    raw["run"].update(max_steps=steps, output_dir=str(folder / "run"))
    raw["data"]["text_path"] = str(folder / "stdlib_docs.txt")  # written once, on first use
    raw["checkpoint"] = {"enabled": False}
    raw["logging"] = {"level": "WARNING", "progress": False, "loss_plot": False}
    if every is None:
        raw["eval"] = {}
    else:
        raw["eval"] = {
            "holdout_fraction": raw["eval"]["holdout_fraction"],
            "every_steps": every,
            "max_batches": batches,
        }
    return raw


def timed(raw: dict, device: str) -> tuple[float, float, list[float]]:
    "Seconds of `fit`, seconds its evaluations report (`eval_s`), and the training losses."
    trainer, _ = build_runtime(raw, device=device, overwrite=True)
    try:
        start = time.perf_counter()
        result = trainer.fit()
        seconds = time.perf_counter() - start
    finally:
        trainer.logger.close()
        trainer.run_claim.release()
    return seconds, sum(r["eval_s"] for r in result.evals), [r["loss"] for r in result.metrics]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument(
        "--batches", type=int, default=4, help="held-out batches per evaluation (eval.max_batches)"
    )
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(
        f"torch {torch.__version__}, {args.device}, {torch.get_num_threads()} threads "
        "(OMP_NUM_THREADS="
        f"{os.environ.get('OMP_NUM_THREADS', 'unset')}); demo model, {args.steps} steps, eval "
        f"every {args.every} "
        f"steps on {args.batches} held-out batches of 16 x 64 tokens"
    )
    with tempfile.TemporaryDirectory() as d:
        runs = {
            "no eval": config(Path(d) / "a", args.steps, None, args.batches),
            "eval": config(Path(d) / "b", args.steps, args.every, args.batches),
        }
        for raw in runs.values():
            # warm-up, the text written
            timed({**raw, "run": {**raw["run"], "max_steps": 20}}, args.device)
        seconds, inside, losses = {k: [] for k in runs}, [], {}
        for _ in range(args.rounds):
            for key, raw in runs.items():
                s, e, losses[key] = timed(raw, args.device)
                seconds[key].append(s)
                if key == "eval":
                    inside.append(e)
    assert losses["eval"] == losses["no eval"], "evaluation changed the training losses"
    plain, with_eval, evals = (
        statistics.median(seconds["no eval"]),
        statistics.median(seconds["eval"]),
        statistics.median(inside),
    )
    n = args.steps
    print(f"{'run':10} {'s/step':>10}")
    print(f"{'no eval':10} {plain / n * 1e3:8.2f}ms")
    print(
        f"{'eval':10} {with_eval / n * 1e3:8.2f}ms   ({n // args.every + (n % args.every != 0)} "
        "evaluations, "
        f"{evals * 1e3:.1f} ms inside them in all)"
    )
    print(
        f"evaluation adds {(with_eval - plain) / n * 1e3:.2f} ms per training step with its "
        "batches "
        f"({(with_eval / plain - 1) * 100:.1f}%), {(with_eval - evals - plain) / n * 1e3:.3f} ms "
        "without them; "
        "training losses bit-identical"
    )


if __name__ == "__main__":
    main()
