"""DumbDiLoCo against synchronous training at equal tokens, on one machine.

A master and 3 workers run as separate `speedtronic train` processes and meet in a repository — a shared
directory, and the loopback Hub stand-in of tests/hub_server.py driven by the real `huggingface_hub` client.
Each node reads its own quarter of real English text (the standard library's docstrings) in batches of B; the
synchronous baseline is one process reading the same batches together (batch 4·B, the same tokens in the same
order) for the same number of steps. A lockstep row runs DiLoCo synchronously in this process (the same nodes, shards
and inner steps; every round folds all nodes' deltas, none stale): the gap between it and the baseline is the
algorithm's, the gap between it and the DiLoCo runs is asynchrony's. Printed side by side: the held-out loss of the
final global model and of the baseline, bytes and commits per round, wall time.

    python bench/bench_diloco.py                  # baseline, directory and Hub runs (a few minutes on 2 cores)
    python bench/bench_diloco.py --compare        # also staleness policies and delta dtypes (directory)
    python bench/bench_diloco.py --steps 400 --inner-steps 25
    python bench/bench_diloco.py --seeds 1,2,3,4,5    # every row once per seed: single runs of a tiny model vary by several %
    # 2.0's DiLoCo settings, asynchronous (a few minutes):
    python bench/bench_diloco.py --nodes 3 --steps 200 --inner-steps 10 --transports hub --boundary-wait 0 --outer-lr 0.7 --outer-momentum 0.9 --reset-inner
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from hub_server import HubStandIn  # noqa: E402
from speedtronic.checkpoint import load_checkpoint  # noqa: E402
from speedtronic.config import SpeedtronicConfig  # noqa: E402
from speedtronic.distributed.tensors import GLOBAL_MODEL_PATH, load_safetensors  # noqa: E402
from speedtronic.registry import build_model  # noqa: E402
from speedtronic.runtime import demo_corpus_text  # noqa: E402

TOKEN = "hf_bench_token"


def prepare_text(work: Path) -> tuple[Path, bytes]:
    "The demo corpus split into a training file (90%) and held-out bytes (10%, cut at a paragraph)."
    text = demo_corpus_text().encode("utf-8")
    cut = text.index(b"\n\n", int(len(text) * 0.9)) + 2
    train = work / "train.txt"
    train.write_bytes(text[:cut])
    return train, text[cut:]


def base_config(args, work: Path, name: str, train: Path, *, batch: int, target: int) -> dict:
    return {"run": {"name": name, "seed": args.seed, "device": "cpu", "max_steps": args.steps, "output_dir": str(work / name)},
            "model": {"name": "reference_transformer", "vocab_size": 256, "max_seq_len": args.block, "n_layer": 2,
                      "n_head": 4, "n_kv_head": 2, "d_model": args.width, "d_ff": 3 * args.width},
            "data": {"text_path": str(train), "block_size": args.block, "micro_batch_size": batch, "target_batch_size": target},
            "optimizer": {"name": "adamw", "lr": args.lr, "weight_decay": 0.01, "grad_clip": 1.0},
            "scheduler": {"name": "cosine", "warmup_steps": max(1, args.steps // 10), "min_lr_ratio": 0.1},
            "precision": {"mode": "fp32"},
            "checkpoint": {"every_steps": args.steps, "keep_last": 1},
            "logging": {"every_steps": max(1, args.steps // 4), "json_file": str(work / name / "metrics.jsonl"),
                        "loss_plot": False, "progress": False}}


def write(cfg: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def launch(cfg: Path, env: dict | None = None) -> subprocess.Popen:
    full = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", **(env or {})}
    log = open(cfg.with_suffix(".log"), "w")
    # training runs below the bench process, which serves the Hub stand-in: like the real Hub, the repository does not
    # compete with the nodes for this machine's cores (every training process, the baseline too, gets the same priority)
    proc = subprocess.Popen([sys.executable, "-m", "speedtronic", "train", "--config", str(cfg)], cwd=ROOT, env=full,
                            stdout=log, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=(lambda: os.nice(5)) if hasattr(os, "nice") else None)
    proc.log = Path(log.name)
    log.close()
    return proc


def wait(procs: list[subprocess.Popen], what: str) -> None:
    for p in procs:
        if p.wait() != 0: raise SystemExit(f"{what} failed:\n{p.log.read_text()[-3000:]}")


def wait_for_line(procs: list[subprocess.Popen], text: str, what: str) -> None:
    "Wait (up to 5 minutes) until every process has written `text` to its log."
    deadline = time.monotonic() + 300
    while not all(text in p.log.read_text() for p in procs):
        for p in procs:
            if p.poll() is not None: wait([p], what)
        if time.monotonic() > deadline:
            for p in procs: p.kill()
            raise SystemExit(f"{what} did not write {text!r} within 5 minutes; see {', '.join(str(p.log) for p in procs)}")
        time.sleep(0.05)


def events(path: Path, name: str) -> list[dict]:
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            try: item = json.loads(line)
            except ValueError: continue
            if item.get("event") == name: out.append(item)
    return out


@torch.no_grad()
def held_out_loss(cfg: dict, state: dict, held: bytes) -> float:
    "Mean next-byte cross-entropy of `state` on non-overlapping blocks of the held-out bytes."
    model = build_model(SpeedtronicConfig.from_dict(cfg).model)
    model.load_state_dict({k: v for k, v in state.items() if k in model.state_dict()}, strict=False)
    model.eval()
    block = cfg["data"]["block_size"]
    ids = torch.tensor(list(held), dtype=torch.long)
    n = (len(ids) - 1) // block
    x, y = ids[: n * block].view(n, block), ids[1: n * block + 1].view(n, block)
    total = 0.0
    for i in range(0, n, 64):
        out = model(x[i:i + 64], y[i:i + 64])
        loss = out["loss"] if isinstance(out, dict) else out[0]
        total += float(loss) * len(x[i:i + 64])
    return total / n


def run_baseline(args, work: Path, train: Path, held: bytes) -> dict:
    cfg = base_config(args, work, "baseline", train, batch=args.batch, target=args.batch * args.nodes)
    start = time.perf_counter()
    wait([launch(write(cfg, work / "baseline.yaml"))], "the baseline")
    ckpt = load_checkpoint(sorted((work / "baseline" / "checkpoints").glob("step_*.pt"))[-1])
    return {"name": f"synchronous baseline (batch {args.batch * args.nodes})", "loss": held_out_loss(cfg, ckpt["model"], held),
            "wall": time.perf_counter() - start}


def run_lockstep(args, work: Path, train: Path, held: bytes) -> dict:
    "Synchronous DiLoCo in this process: the same nodes, shards and inner steps, every delta folded at once, none stale."
    from speedtronic.distributed.diloco import NodeShard
    from speedtronic.distributed.outer import Contribution, OuterUpdate
    from speedtronic.distributed.tensors import compute_pseudo_gradient, cpu_state_dict
    from speedtronic.runtime import build_runtime
    start, nodes = time.perf_counter(), []
    for i in range(args.nodes):
        cfg = base_config(args, work / "lockstep", f"node{i}", train, batch=args.batch, target=args.batch)
        cfg["logging"] = {"level": "WARNING", "every_steps": args.steps, "loss_plot": False, "progress": False}
        cfg["checkpoint"] = {"enabled": False}
        trainer, _ = build_runtime(cfg)
        trainer.dataloader = NodeShard(trainer.dataloader, i, args.nodes)   # the shard a DiLoCo node reads
        nodes.append(trainer)
    state = cpu_state_dict(nodes[0].model.state_dict())
    update = OuterUpdate(state, args.outer_lr, args.outer_momentum)
    for end in range(args.inner_steps, args.steps + args.inner_steps, args.inner_steps):
        for trainer in nodes: trainer.fit(max_steps=min(end, args.steps))
        update.step(state, [Contribution(compute_pseudo_gradient(state, cpu_state_dict(t.model.state_dict()))) for t in nodes],
                    args.nodes)
        for trainer in nodes:
            trainer.model.load_state_dict(state)
            if args.reset_inner: trainer.optimizer.state.clear()
    return {"name": f"lockstep DiLoCo outer {args.outer_lr:g}/{args.outer_momentum:g}{' reset' if args.reset_inner else ''} (in-process)",
            "loss": held_out_loss(cfg, state, held), "wall": time.perf_counter() - start}


def run_diloco(args, work: Path, train: Path, held: bytes, *, transport: str, staleness: str = "delayed_nesterov",
               dtype: str = "bfloat16", outer: tuple[float, float] | None = None, reset: bool | None = None,
               boundary_wait: float = 0.0) -> dict:
    outer = (args.outer_lr, args.outer_momentum) if outer is None else outer
    reset = args.reset_inner if reset is None else reset
    tag = f"{transport}-{staleness}-{dtype}-{outer[0]:g}-{outer[1]:g}-{int(reset)}-{boundary_wait:g}"
    run = work / tag
    hub = HubStandIn(tokens={TOKEN: "write"}).start() if transport == "hub" else None
    repo = "bench/diloco" if hub else str(run / "repo")
    env = {"HF_ENDPOINT": hub.url, "HF_TOKEN": TOKEN} if hub else None
    configs = []
    for i in range(args.nodes):
        name = "master" if i == 0 else f"worker{i}"
        cfg = base_config(args, run, name, train, batch=args.batch, target=args.batch)
        cfg["distributed"] = {"enabled": True, "role": "master" if i == 0 else "worker", "node_id": name, "transport": transport,
                              "repo_id": repo, "inner_steps": args.inner_steps, "poll_interval": args.poll, "expected_nodes": args.nodes,
                              "shard_count": args.nodes, "shard_index": i, "delta_dtype": dtype, "staleness": staleness,
                              "final_round_timeout": 1800, "retry_initial": 0.2, "retry_max": 5.0,
                              "reset_inner_optimizer": reset, "outer_lr": outer[0], "outer_momentum": outer[1],
                              "boundary_wait": boundary_wait}
        configs.append((cfg, write(cfg, run / f"{name}.yaml")))
    try:
        if hub: hub.create(repo, private=True)                          # made on the website before the run
        start = time.perf_counter()
        # the workers start first and wait for the master's first global: on a 10-second run, the seconds a process takes
        # to start would otherwise let one node train alone for most of it
        procs = [launch(path, env) for _, path in configs[1:]]
        wait_for_line(procs, "waiting for the master", f"the {tag} workers")
        procs.insert(0, launch(configs[0][1], env))
        wait(procs, f"the {tag} run")
        wall = time.perf_counter() - start
        if hub:
            weights = hub.files(repo)[GLOBAL_MODEL_PATH]
            commits = len(hub.repos[repo].commits) - 1
        else:
            weights = (Path(repo) / GLOBAL_MODEL_PATH).read_bytes()
            commits = None
        final = load_safetensors_bytes(weights)
    finally:
        if hub: hub.stop()
    master = run / "master" / "metrics.jsonl"
    rounds = [e for e in events(master, "outer_step") if e.get("deltas_included")]
    uploads = [e for i in range(args.nodes) for e in events(run / ("master" if i == 0 else f"worker{i}") / "metrics.jsonl", "delta_uploaded")]
    skipped = sum(len(events(run / ("master" if i == 0 else f"worker{i}") / "metrics.jsonl", "delta_upload_skipped")) for i in range(args.nodes))
    versions = max((e["outer_step"] for e in rounds), default=0)
    node_commits, master_commits = len(uploads), (commits - len(uploads) if commits is not None else versions + 1)
    global_bytes = len(weights)
    return {"name": f"{transport} {staleness} {dtype} outer {outer[0]:g}/{outer[1]:g}{' reset' if reset else ''}"
                    f"{f' wait {boundary_wait:g}s' if boundary_wait else ''}", "loss": held_out_loss(configs[0][0], final, held), "wall": wall,
            "versions": versions, "node_commits": node_commits, "master_commits": master_commits,
            "delta_kb": sum(e["bytes"] for e in uploads) / max(1, len(uploads)) / 1024, "skipped": skipped,
            "folded": sum(e["deltas_included"] for e in rounds), "global_kb": global_bytes / 1024}


def load_safetensors_bytes(data: bytes) -> dict:
    "The tensors of a global file's bytes, read by our own loader (it restores tied tensors stored once)."
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "global.safetensors"
        path.write_bytes(data)
        return load_safetensors(path)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps of every node and of the baseline")
    parser.add_argument("--inner-steps", type=int, default=20)
    parser.add_argument("--nodes", type=int, default=4, help="the master and nodes-1 workers")
    parser.add_argument("--batch", type=int, default=8, help="each node's batch (the baseline uses nodes x batch)")
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--width", type=int, default=64, help="d_model of the 2-layer model")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--poll", type=float, default=0.5, help="distributed.poll_interval")
    parser.add_argument("--transports", default="directory,hub")
    parser.add_argument("--boundary-wait", type=float, default=30.0,
                        help="distributed.boundary_wait of the extra waiting runs of each transport (0: no such runs)")
    parser.add_argument("--compare", action="store_true", help="also staleness none/weighted and float32/int8 deltas (directory)")
    parser.add_argument("--outer-lr", type=float, default=1.0, help="distributed.outer_lr of the main runs")
    parser.add_argument("--outer-momentum", type=float, default=0.0, help="distributed.outer_momentum of the main runs")
    parser.add_argument("--reset-inner", action="store_true", help="reset_inner_optimizer: true in the main runs")
    parser.add_argument("--repeats", type=int, default=1, help="runs per DiLoCo variant and seed (timing makes async runs vary)")
    parser.add_argument("--seeds", default="1234,1,2", help="comma-separated run.seed values: every row runs once per seed (init and "
                        "data order), each DiLoCo run compared with the baseline of its own seed")
    parser.add_argument("--keep", default=None, help="keep the runs in this folder")
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench-diloco-"))
    work.mkdir(parents=True, exist_ok=True)
    train, held = prepare_text(work)
    print(f"{args.nodes} nodes x {args.steps} steps, inner_steps {args.inner_steps}, node batch {args.batch} x {args.block} bytes; "
          f"{train.stat().st_size / 1e3:.0f} kB training text, {len(held) / 1e3:.0f} kB held out; seeds {seeds}", flush=True)
    plan = [dict(transport=t) for t in args.transports.split(",") if t]
    if args.boundary_wait: plan += [dict(transport=t, boundary_wait=args.boundary_wait) for t in args.transports.split(",") if t]
    defaults = dict(outer=(0.7, 0.9), reset=True)                 # DiLoCo's outer Nesterov and 2.0's inner reset
    if "directory" in args.transports: plan.append(dict(transport="directory", **defaults))
    if args.compare:
        plan += [dict(transport="directory", staleness=s) for s in ("weighted", "none")]
        plan += [dict(transport="directory", staleness="none", **defaults)]
        plan += [dict(transport="directory", dtype=d) for d in ("float32", "int8")]
    rows: dict[str, list[dict]] = {}                                  # row name -> its runs, each with `ratio` to its seed's baseline
    for seed in seeds:
        args.seed, here = seed, work / f"seed{seed}"
        base = run_baseline(args, here, train, held)
        lockstep = run_lockstep(args, here, train, held)
        print(f"  seed {seed}: baseline {base['loss']:.4f} ({base['wall']:.0f} s), lockstep {lockstep['loss']:.4f}", flush=True)
        for r in (base, lockstep): rows.setdefault(r["name"], []).append({**r, "ratio": r["loss"] / base["loss"]})
        for spec in plan:
            for i in range(args.repeats):
                r = run_diloco(args, here / f"repeat{i}", train, held, **spec)
                r["ratio"] = r["loss"] / base["loss"]
                rows.setdefault(r["name"], []).append(r)
                print(f"  seed {seed}: {r['name']} held-out loss {r['loss']:.4f} ({100 * (r['ratio'] - 1):+.2f}%, {r['wall']:.0f} s)",
                      flush=True)
    print_table(rows)
    if not args.keep: shutil.rmtree(work, ignore_errors=True)


def print_table(rows: dict[str, list[dict]]) -> None:
    "One line per row: means over its runs (seeds x repeats); the held-out loss relative to each run's own baseline, and its range."
    print()
    print(f"{'run':52s} {'held-out':>8s} {'vs base':>8s} {'range':>17s} {'rounds':>6s} {'commits/rd':>10s} {'delta kB':>8s} "
          f"{'global kB':>9s} {'wall s':>6s}")
    for name, runs in rows.items():
        mean = lambda key: sum(r[key] for r in runs) / len(runs)
        ratios = [100 * (r["ratio"] - 1) for r in runs]
        spread = f"{min(ratios):+.1f} .. {max(ratios):+.1f}%" if len(runs) > 1 else ""
        extra = f"{'':6s} {'':10s} {'':8s} {'':9s}"
        if "versions" in runs[0]:
            per_round = (mean("node_commits") + mean("master_commits")) / max(1, mean("versions"))
            extra = f"{mean('versions'):6.0f} {per_round:10.2f} {mean('delta_kb'):8.1f} {mean('global_kb'):9.1f}"
        print(f"{name:52s} {mean('loss'):8.4f} {sum(ratios) / len(ratios):+7.2f}% {spread:>17s} {extra} {mean('wall'):6.0f}")
    print("\nvs base = mean over the row's runs (one per seed, and per repeat for the DiLoCo runs) of (held-out loss / the same "
          "seed's baseline - 1); range = the lowest and highest of them. rounds = published global versions; commits/rd = (node deltas + master publications) per round; delta kB = "
          "one delta on the wire (a round folds about nodes x inner-steps worth of them); global kB = the weights published each "
          "round (each node downloads it); outer a/b = outer_lr/outer_momentum; reset = reset_inner_optimizer")


if __name__ == "__main__":
    main()
