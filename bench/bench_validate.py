"""How long `speedtronic validate` takes next to a bare `import torch` (fixes L3: validate loads no
torch).

Runs both as fresh subprocesses, alternating, N rounds each, and prints both medians and their
ratio.
    python bench/bench_validate.py [--rounds 7] [--config configs/smoke.yaml]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def wall_time(cmd: list[str]) -> float:
    "Seconds one subprocess takes from start to exit; it must succeed."
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    proc = subprocess.run(
        cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: {proc.stderr.strip()[-500:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--config", default="configs/smoke.yaml")
    args = parser.parse_args()
    validate = [sys.executable, "-m", "speedtronic", "validate", "--config", args.config]
    torch = [sys.executable, "-c", "import torch"]
    wall_time(validate)
    wall_time(torch)  # warm the file cache once, untimed
    times: dict[str, list[float]] = {"validate": [], "import torch": []}
    for _ in range(args.rounds):
        times["validate"].append(wall_time(validate))
        times["import torch"].append(wall_time(torch))
    v, t = statistics.median(times["validate"]), statistics.median(times["import torch"])
    print(f"rounds={args.rounds} config={args.config}")
    print(f"speedtronic validate  median {v * 1000:7.1f} ms")
    print(f"python -c 'import torch' median {t * 1000:7.1f} ms")
    print(f"ratio validate / import torch = {v / t:.2f}")


if __name__ == "__main__":
    main()
