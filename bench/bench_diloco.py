"""DumbDiLoCo against synchronous training at equal tokens, on one machine.

A master and 3 workers run as separate `speedtronic train` processes and meet in a repository — a
shared directory, and the loopback Hub stand-in of tests/hub_server.py driven by the real
`huggingface_hub` client. Each node reads its own quarter of real English text (the standard
library's docstrings) in batches of B; the synchronous baseline is one process reading the same
batches together (batch 4·B, the same tokens in the same order) for the same number of steps. A
lockstep row runs DiLoCo synchronously in this process (the same nodes, shards and inner steps;
every round folds all nodes' deltas, none stale): the gap between it and the baseline is the
algorithm's, the gap between it and the DiLoCo runs is asynchrony's. Printed side by side: the
held-out loss of the final global model and of the baseline, the deltas uploaded and folded, the
versions published, bytes per delta and wall time. A "2.0 keys" row runs the nodes on the
distributed keys a Speedtronic 2.0 user writes (outer lr 0.7, Nesterov momentum 0.9, every newer key
at its default) with a contiguous part of the training text per node, as a 2.0 user shards. A
whole-round row with float32 deltas (directory) beside the bfloat16 one shows what the smaller wire
format costs. Wire rows give the bytes of one delta of this model in each delta dtype (the library's
own encoding). The one table printed at the end is the place the docs cite measured DiLoCo numbers
from.

    # baseline, directory and Hub runs, 3 seeds (tens of minutes on 2 cores)
    python bench/bench_diloco.py
    # also staleness policies and delta dtypes (directory)
    python bench/bench_diloco.py --compare
    python bench/bench_diloco.py --steps 400 --inner-steps 25
    # every row once per seed: single runs of a tiny model vary by several %
    python bench/bench_diloco.py --seeds 1,2,3,4,5
    # the fragments table (Streaming DiLoCo: distributed.fragments F = 1, 2, 4, the best encoding)
    python bench/bench_diloco.py --fragments --layers 4 --steps 600 --inner-steps 20 --width 128

    # the run 2.0 was measured on (master + 2 workers, 200 steps, inner_steps 10): plain
    # averaging, whole rounds and 2.0's keys on the Hub, one seed (about 5 minutes on 2 busy
    # cores; add --transports directory,hub for the directory rows)
    OMP_NUM_THREADS=1 python bench/bench_diloco.py --nodes 3 --steps 200 --inner-steps 10 \
        --transports hub --seeds 1234
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import shlex
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


def prepare_text(work: Path) -> tuple[Path, Path]:
    """The demo corpus split into a training file (90%) and a held-out file (10%, cut at a
    paragraph)."""
    text = demo_corpus_text().encode("utf-8")
    cut = text.index(b"\n\n", int(len(text) * 0.9)) + 2
    train, held = work / "train.txt", work / "held_out.txt"
    train.write_bytes(text[:cut])
    held.write_bytes(text[cut:])
    return train, held


def base_config(args, work: Path, name: str, train: Path, *, batch: int, target: int) -> dict:
    return {
        "run": {
            "name": name,
            "seed": args.seed,
            "device": "cpu",
            "max_steps": args.steps,
            "output_dir": str(work / name),
        },
        "model": {
            "name": "reference_transformer",
            "vocab_size": 256,
            "max_seq_len": args.block,
            "n_layer": args.layers,
            "n_head": 4,
            "n_kv_head": 2,
            "d_model": args.width,
            "d_ff": 3 * args.width,
        },
        "data": {
            "text_path": str(train),
            "block_size": args.block,
            "micro_batch_size": batch,
            "target_batch_size": target,
        },
        "optimizer": {"name": "adamw", "lr": args.lr, "weight_decay": 0.01, "grad_clip": 1.0},
        "scheduler": {
            "name": "cosine",
            "warmup_steps": max(1, args.steps // 10),
            "min_lr_ratio": 0.1,
        },
        "precision": {"mode": "fp32"},
        "checkpoint": {"every_steps": args.steps, "keep_last": 1},
        "logging": {
            "every_steps": max(1, args.steps // 4),
            "json_file": str(work / name / "metrics.jsonl"),
            "loss_plot": False,
            "progress": False,
        },
    }


def write(cfg: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


# the command that starts a node's Python: SPEEDTRONIC_BENCH_PYTHON where it is set (the test suite
# sets its stand-in for a forked interpreter, tests/forkrank.py), else this interpreter
NODE_PYTHON = shlex.split(os.environ.get("SPEEDTRONIC_BENCH_PYTHON", "")) or [sys.executable]


def launch(cfg: Path, env: dict | None = None) -> subprocess.Popen:
    full = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        **(env or {}),
    }
    log = open(cfg.with_suffix(".log"), "w")
    # training runs below the bench process, which serves the Hub stand-in: like the real Hub, the
    # repository does not compete with the nodes for this machine's cores (every training process,
    # the baseline too, gets the same priority)
    proc = subprocess.Popen(
        [*NODE_PYTHON, "-m", "speedtronic", "train", "--config", str(cfg)],
        cwd=ROOT,
        env=full,
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=(lambda: os.nice(5)) if hasattr(os, "nice") else None,
    )
    proc.log = Path(log.name)
    log.close()
    return proc


def wait(procs: list[subprocess.Popen], what: str) -> None:
    for p in procs:
        if p.wait() != 0:
            raise SystemExit(f"{what} failed:\n{p.log.read_text()[-3000:]}")


def wait_for_line(procs: list[subprocess.Popen], text: str, what: str) -> None:
    "Wait (up to 5 minutes) until every process has written `text` to its log."
    deadline = time.monotonic() + 300
    while not all(text in p.log.read_text() for p in procs):
        for p in procs:
            if p.poll() is not None:
                wait([p], what)
        if time.monotonic() > deadline:
            for p in procs:
                p.kill()
            raise SystemExit(
                f"{what} did not write {text!r} within 5 minutes; see "
                f"{', '.join(str(p.log) for p in procs)}"
            )
        time.sleep(0.05)


def events(path: Path, name: str) -> list[dict]:
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                item = json.loads(line)
            except ValueError:
                continue
            if item.get("event") == name:
                out.append(item)
    return out


def held_out_loss(cfg: dict, state: dict, held: Path) -> float:
    """The library's held-out evaluation (`speedtronic.evaluation`) of `state` on the held-out text
    file `held`."""
    from speedtronic.evaluation import build_evaluator

    config = SpeedtronicConfig.from_dict({**cfg, "eval": {"text_path": str(held)}})
    model = build_model(config.model)
    model.load_state_dict({k: v for k, v in state.items() if k in model.state_dict()}, strict=False)
    return build_evaluator(config, device="cpu")(model).loss


def run_baseline(args, work: Path, train: Path, held: Path) -> dict:
    cfg = base_config(
        args, work, "baseline", train, batch=args.batch, target=args.batch * args.nodes
    )
    start = time.perf_counter()
    wait([launch(write(cfg, work / "baseline.yaml"))], "the baseline")
    ckpt = load_checkpoint(sorted((work / "baseline" / "checkpoints").glob("step_*.pt"))[-1])
    return {
        "name": f"synchronous baseline (batch {args.batch * args.nodes})",
        "loss": held_out_loss(cfg, ckpt["model"], held),
        "wall": time.perf_counter() - start,
        "config": cfg,
        "state": ckpt["model"],
    }


def run_lockstep(
    args,
    work: Path,
    train: Path,
    held: Path,
    *,
    encoding: str | None = None,
    topk: tuple[float, int] | None = None,
    optimizer: str = "adamw",
    decay: float | None = 1.0,
    fragments: int = 1,
    mixing: float = 0.0,
    delay: int = 0,
) -> dict:
    """Synchronous DiLoCo in this process: the same nodes, shards and inner steps, every delta
    folded at once, none stale. Each node is the library's own node state (`at_boundary` sends,
    `on_global` installs): with an `encoding` its delta travels as a node sends it (its residual
    added, encoded, what the encoding lost kept for the next round, faded by `decay`
    (distributed.feedback_decay; None: no feedback)) and the fold gets what the master decodes;
    `topk` is (density, bits). With `fragments` above 1 a node sends one fragment of its model
    every inner_steps / fragments steps (`fragment_plan`), its last delta whole, and every
    fragment is folded and installed on its own. `mixing` is distributed.mixing (α): each install
    blends the global with the node's base. `delay` is Streaming DiLoCo's τ: each global arrives τ
    inner steps after the deltas it folds, and the nodes train on meanwhile (their progress kept on
    top of it)."""
    if optimizer not in ("adamw", "muon"):
        raise ValueError(f"run_lockstep: optimizer {optimizer!r} is neither 'adamw' nor 'muon'")
    from dataclasses import replace

    from speedtronic.distributed.compression import TopK
    from speedtronic.distributed.diloco import (
        NodeShard,
        NodeState,
        at_boundary,
        on_global,
        on_upload_done,
        upload_delta,
    )
    from speedtronic.distributed.outer import Contribution, OuterUpdate
    from speedtronic.distributed.tensors import (
        changed_at,
        changed_keys,
        cpu_state_dict,
        delta_header,
        fragment_due,
        fragment_plan,
        fragment_versions,
        safetensors_bytes,
    )
    from speedtronic.runtime import build_runtime

    start, nodes = time.perf_counter(), []
    for i in range(args.nodes):
        cfg = base_config(
            args, work / "lockstep", f"node{i}", train, batch=args.batch, target=args.batch
        )
        cfg["logging"] = {
            "level": "WARNING",
            "every_steps": args.steps,
            "loss_plot": False,
            "progress": False,
        }
        cfg["checkpoint"] = {"enabled": False}
        if optimizer == "muon":
            cfg["optimizer"] = {"name": "muon", "lr": args.muon_lr, "grad_clip": 1.0}
        trainer, _ = build_runtime(cfg)
        # the shard a DiLoCo node reads
        trainer.dataloader = NodeShard(trainer.dataloader, i, args.nodes)
        nodes.append(trainer)
    state = cpu_state_dict(nodes[0].model.state_dict())
    update = OuterUpdate(state, args.outer_lr, args.outer_momentum)
    spec = TopK(*topk) if topk else TopK()
    plan = fragment_plan(nodes[0].model.state_dict(), fragments) if fragments > 1 else ()
    every = args.inner_steps // max(1, len(plan))
    if not 0 <= delay < every:
        raise ValueError(
            f"run_lockstep: a delay of {delay} steps is not below the {every} between uploads"
        )
    wire = encoding or "float32"
    sent = [NodeState(f"node{i}", dict(state)) for i in range(len(nodes))]
    sizes, version = [[] for _ in nodes], 0  # each node's uploads' bytes
    moved_at: tuple[int, ...] = ()  # the version at which each fragment last changed, as a master
    for end in range(every, args.steps + every, every):
        end = min(end, args.steps)
        # this step's fragment; the last delta holds all that is left
        part = fragment_due(end, args.inner_steps, len(plan)) if plan and end < args.steps else None
        contributions = []
        for i, trainer in enumerate(nodes):
            trainer.fit(max_steps=end)
            weights = cpu_state_dict(trainer.model.state_dict())
            sent[i], up = at_boundary(
                sent[i],
                weights,
                end,
                wire,
                topk=spec,
                decay=1.0 if decay is None else decay,
                fragment=part,
                plan=plan,
            )
            sent[i] = on_upload_done(sent[i], up)
            if decay is None:  # no feedback: what the encoding lost is dropped
                sent[i] = replace(sent[i], carry=None)
            header = delta_header(
                node_id=f"node{i}",
                local_step=end,
                base_outer_step=version,
                inner_steps=up.steps,
                encoding=wire,
                extra=up.header,
            )
            sizes[i].append(len(safetensors_bytes(up.delta, header)))
            contributions.append(Contribution(upload_delta(up), up.steps / args.inner_steps))
        before = {k: v.clone() for k, v in state.items()} if plan else {}
        update.step(state, contributions, args.nodes)
        version += 1
        if plan:  # whole deltas: every key counts as changed (`changed_at` of no plan)
            moved_at = fragment_versions(plan, moved_at, changed_keys(before, state), version)
        for i, trainer in enumerate(nodes):
            if delay and end < args.steps:  # it trains on while the global travels
                trainer.fit(max_steps=end + delay)
            weights = cpu_state_dict(trainer.model.state_dict())
            sent[i], install = on_global(
                sent[i],
                version,
                state,
                end,
                weights,
                mixing=mixing,
                changed=changed_at(plan, moved_at),
            )
            trainer.model.load_state_dict({**weights, **install.weights})  # a key left alone: kept
            if args.reset_inner and install.reset:
                trainer.optimizer.state.clear()
        if end >= args.steps:
            break
    name = (
        "lockstep DiLoCo outer "
        f"{args.outer_lr:g}/{args.outer_momentum:g}{' reset' if args.reset_inner else ''} "
        "(in-process)"
    )
    if encoding is not None:
        name = f"lockstep {encoding_name(encoding, topk, decay)}, {optimizer} inner"
    if plan:
        name += f", {fragments} fragments"
    if mixing:
        name += f", mixing {mixing:g}"
    if delay:
        name += f", delay {delay}"
    every_upload = [b for node in sizes for b in node]
    # before its last delta (with fragments a whole one: what it had not sent yet)
    steady = [b for node in sizes for b in node[:-1]] or every_upload
    return {
        "name": name,
        # what this run did, for a table's row name (never the caller's idea of it)
        "settings": {
            "encoding": encoding,
            "topk": topk,
            "decay": decay,
            "optimizer": optimizer,
            "fragments": max(1, len(plan)),
            "mixing": mixing,
            "delay": delay,
        },
        "loss": held_out_loss(cfg, state, held),
        "wall": time.perf_counter() - start,
        **(
            {
                "delta_kb": sum(every_upload) / len(every_upload) / 1024,
                "round_kb": sum(steady) / len(steady) * max(1, len(plan)) / 1024,
                "peak_kb": max(steady) / 1024,
                "last_kb": sum(node[-1] for node in sizes) / len(sizes) / 1024,
            }
            if encoding is not None
            else {}
        ),
    }


def encoding_name(encoding: str, topk: tuple[float, int] | None, decay: float | None = 1.0) -> str:
    "A row's name for a delta encoding: `topk 3% 2-bit + feedback 0.9`, `bfloat16`, ..."
    name = encoding if encoding != "topk" else f"topk {topk[0] * 100:g}% {topk[1]}-bit"
    if encoding == "topk" and len(topk) > 2:
        name += f" chunk {topk[2]}"
    if decay is None or encoding == "float32":
        return name
    return name + " + feedback" + (f" {decay:g}" if decay != 1.0 else "")


# (encoding, topk (density, bits[, chunk]), feedback decay or None for none): the --encodings
# table's rows
ENCODING_ROWS = [
    ("float32", None, 1.0),
    ("bfloat16", None, None),
    ("bfloat16", None, 1.0),
    ("int8", None, 1.0),
    ("topk", (0.03, 2), 1.0),
    ("topk", (0.01, 2), 1.0),
    ("topk", (0.03, 2), 0.9),  # SparseLoCo's fading accumulator (distributed.feedback_decay)
    ("topk", (0.01, 2), 0.9),
]


def encoding_rows(text: str) -> list[tuple[str, tuple[float, int] | None, float | None]]:
    """`--encoding-rows`: comma-separated `float32`, `bfloat16`, `bfloat16+feedback`,
    `int8+feedback` or `topk:DENSITY:BITS[:DECAY[:CHUNK]]` (decay 1: plain feedback), float32
    first."""
    rows = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        name, _, feedback = item.partition("+")
        if name.startswith("topk:"):
            density, bits, *rest = name.split(":")[1:]
            spec = (float(density), int(bits), *(int(c) for c in rest[1:2]))  # a chunk, if given
            rows.append(("topk", spec, float(rest[0]) if rest else 1.0))
        elif name in ("float32", "bfloat16", "int8") and feedback in ("", "feedback"):
            rows.append((name, None, 1.0 if feedback or name == "float32" else None))
        else:
            raise SystemExit(f"--encoding-rows {item!r}: not an encoding (see --help)")
    if not rows or rows[0][0] != "float32":
        raise SystemExit("--encoding-rows: the first row must be float32 (the reference)")
    return rows


def run_encodings(args, work: Path, train: Path, held: Path, seeds: list[int]) -> None:
    """The encodings table: per seed the synchronous baseline, then lockstep DiLoCo with each
    row's delta encoding (`ENCODING_ROWS`, or `--encoding-rows`) and `--inner-optimizer`; then,
    without `--encoding-rows`, Muon as the inner optimizer, in float32 and in top-k 3% with
    feedback fading by 0.9."""
    rows: dict[str, list[dict]] = {}
    chosen = encoding_rows(args.encoding_rows) if args.encoding_rows else ENCODING_ROWS
    inner = args.inner_optimizer
    for seed in seeds:
        args.seed, here = seed, work / f"seed{seed}"
        base = run_baseline(args, here, train, held)
        runs = [
            run_lockstep(
                args, here / f"enc{i}", train, held, encoding=e, topk=k, decay=f, optimizer=inner
            )
            for i, (e, k, f) in enumerate(chosen)
        ]
        exact = {inner: runs[0]["loss"]}  # each optimizer's float32 run
        if not args.encoding_rows and inner == "adamw":
            runs.append(
                run_lockstep(
                    args, here / "muon32", train, held, encoding="float32", optimizer="muon"
                )
            )
            exact["muon"] = runs[-1]["loss"]
            runs.append(  # with the best adamw encoding
                run_lockstep(
                    args,
                    here / "muon",
                    train,
                    held,
                    encoding="topk",
                    topk=(0.03, 2),
                    optimizer="muon",
                    decay=0.9,
                )
            )
        for r in [base] + runs:
            # a Muon row against Muon's float32 run; any other row (the baseline too) against
            # the float32 run of --inner-optimizer
            own = exact["muon" if "muon" in r["name"] else inner]
            rows.setdefault(r["name"], []).append(
                {**r, "ratio": r["loss"] / base["loss"], "vs_f32": r["loss"] / own}
            )
            print(f"  seed {seed}: {r['name']} held-out {r['loss']:.4f}", flush=True)
    flags = "--encodings" + (f" --encoding-rows {args.encoding_rows}" if args.encoding_rows else "")
    flags += f" --inner-optimizer {inner}" if inner != "adamw" else ""
    heading = lockstep_heading(args, seeds, flags, f"--width {args.width}")
    show_table(lambda: _encodings_table(rows), args.save, heading)


# the fragments table's encodings, by --fragment-encodings name: float32, the best dense encoding
# that costs no loss in the encodings table (int8 + feedback), top-k 3% (the sparsest that stays
# near float32) and top-k 8% in chunks of 256 (under 1/32 of float32's bytes, at no loss there)
FRAGMENTS_ENCODINGS = {
    "float32": ("float32", None, 1.0),
    "int8": ("int8", None, 1.0),
    "topk": ("topk", (0.03, 2), 0.9),
    "topk8": ("topk", (0.08, 2, 256), 0.9),
}


def run_fragments(args, work: Path, train: Path, held: Path, seeds: list[int]) -> None:
    """The fragments table: per seed the synchronous baseline, then lockstep DiLoCo in each
    encoding of `args.fragment_encodings` (`FRAGMENTS_ENCODINGS`), each node sending its model
    whole (F = 1) and in each of `args.fragment_counts` fragments, then whole and in the most
    fragments at each `args.mixing` above 0, and with `args.delay` above 0 the most fragments at
    the first mixing with the globals arriving that many inner steps late (τ)."""
    rows: dict[str, list[dict]] = {}
    counts = [int(c) for c in args.fragment_counts.split(",") if c.strip()]
    names = [n.strip() for n in args.fragment_encodings.split(",") if n.strip()]
    if unknown := [n for n in names if n not in FRAGMENTS_ENCODINGS]:
        raise SystemExit(
            f"--fragment-encodings {unknown}: use some of {', '.join(FRAGMENTS_ENCODINGS)}"
        )
    if uneven := [c for c in counts if args.inner_steps % c]:
        raise SystemExit(
            f"--fragment-counts {uneven} do not divide --inner-steps {args.inner_steps}"
        )
    counts = sorted(set(counts) | {1})  # each encoding's whole run is its rows' reference
    mixings = [m for m in map(float, args.mixing.split(",")) if m > 0]
    # every count unmixed, then each mixing whole and in the most fragments
    settings = [(c, 0.0, 0) for c in counts] + [
        (c, m, 0) for m in mixings for c in dict.fromkeys((counts[0], counts[-1]))
    ]
    if args.delay:  # τ: the most fragments at the first mixing (none: unmixed)
        settings.append((counts[-1], (mixings or [0.0])[0], args.delay))
    for seed in seeds:
        args.seed, here = seed, work / f"seed{seed}"
        base = run_baseline(args, here, train, held)
        runs = [{**base, "ratio": 1.0}]
        for e, (encoding, topk, decay) in enumerate(FRAGMENTS_ENCODINGS[n] for n in names):
            mine = []
            for count, mixing, delay in settings:
                run = run_lockstep(
                    args,
                    here / f"e{e}f{count}m{mixing:g}d{delay}",
                    train,
                    held,
                    encoding=encoding,
                    topk=topk,
                    decay=decay,
                    fragments=count,
                    mixing=mixing,
                    delay=delay,
                )
                did = run["settings"]
                alpha = f", α {did['mixing']:g}" if did["mixing"] else ""
                alpha += f", τ {did['delay']}" if did["delay"] else ""
                run["name"] = (
                    f"F = {did['fragments']}{alpha}: "
                    f"{encoding_name(did['encoding'], did['topk'], did['decay'])}"
                )
                mine.append(run)
            for run in mine:  # against the same encoding's whole deltas
                run["vs_whole"] = run["loss"] / mine[0]["loss"]
                run["peak_share"] = run["peak_kb"] / mine[0]["peak_kb"]
                run["ratio"] = run["loss"] / base["loss"]
            runs += mine
        for r in runs:
            rows.setdefault(r["name"], []).append(r)
            print(f"  seed {seed}: {r['name']} held-out {r['loss']:.4f}", flush=True)
    flags = f"--fragments --fragment-counts {args.fragment_counts} --mixing {args.mixing}"
    if names != ["float32", "topk"]:
        flags += f" --fragment-encodings {','.join(names)}"
    flags += f" --delay {args.delay}" if args.delay else ""
    heading = lockstep_heading(args, seeds, flags, f"--width {args.width} --layers {args.layers}")
    show_table(lambda: _fragments_table(rows), args.save, heading)


def _fragments_table(rows: dict[str, list[dict]]) -> None:
    has_bytes = lambda runs: "peak_kb" in runs[0]
    columns = [
        ("upload kB", 9, mean_cell("delta_kb", "9.1f", shown=has_bytes)),
        ("round kB", 8, mean_cell("round_kb", "8.1f", shown=has_bytes)),
        ("peak kB", 7, mean_cell("peak_kb", "7.1f", shown=has_bytes)),
        ("peak/F=1", 8, mean_cell("peak_share", "8.2f", shown=has_bytes)),
        ("last kB", 7, mean_cell("last_kb", "7.1f", shown=has_bytes)),
        ("held-out", 8, mean_cell("loss", "8.4f")),
        ("vs sync", 7, mean_cell("ratio", "6.3f", "x")),
        ("range", 13, lambda m, r: f"{spread(r, 'ratio'):>13s}"),
        ("vs F=1", 7, mean_cell("vs_whole", "6.3f", "x", has_bytes)),
        ("range", 13, lambda m, r: f"{spread(r, 'vs_whole') if has_bytes(r) else '':>13s}"),
        ("wall s", 6, mean_cell("wall", "6.0f")),
    ]
    runs_table(
        rows,
        44,
        columns,
        "upload kB = one delta file (safetensors with its header), the mean over a run's uploads; "
        "round kB = what one node uploads per round of inner steps; peak kB = its largest upload "
        "before its last, peak/F=1 = against the same encoding's whole deltas; last kB = its last "
        "delta, which holds all it has not sent (with fragments, every fragment's steps since its "
        "last turn: once a run); held-out = the final global's loss; vs sync = against the same "
        "seed's synchronous baseline; vs F=1 = against the same seed's run in the same encoding "
        "sending whole deltas; ranges over the seeds. F fragments: a node sends one fragment of "
        "its model (whole layers, distributed.fragments) every inner_steps / F steps, each folded "
        "and installed on its own; its last delta is whole. Lockstep = every fold takes every "
        "node's delta (one process).",
    )


def lockstep_heading(args, seeds: list[int], flags: str, model: str) -> str:
    """The line a saved lockstep table (--encodings, --fragments) starts with: the command that
    made it (`flags`, then the seeds, steps, rounds and `model` flags), then the setting."""
    return (
        f"python bench/bench_diloco.py {flags} --seeds {','.join(map(str, seeds))} --steps "
        f"{args.steps} --inner-steps {args.inner_steps} {model}: {args.nodes} nodes, node batch "
        f"{args.batch} x {args.block} bytes, outer lr {args.outer_lr:g} momentum "
        f"{args.outer_momentum:g}\n"
    )


def show_table(print_table, save: str | None, heading: str) -> None:
    """Print the table `print_table()` prints; with `save`, also write it to that file under
    `heading` (the command that made it: the DiLoCo chapters print those files)."""
    with contextlib.redirect_stdout(io.StringIO()) as table:
        print_table()
    print(table.getvalue(), end="")
    if save:
        Path(save).parent.mkdir(parents=True, exist_ok=True)
        Path(save).write_text(heading + table.getvalue().lstrip("\n"))


def runs_table(rows: dict[str, list[dict]], name_width: int, columns: list, note: str) -> None:
    """Print `rows` (a row name -> its runs) as a table: a line per row, the row's name then each
    column's cell, then `note`. A column is `(title, width, cell)`; `cell(mean, runs)` gives its
    text, or None for a blank (a row without that number); `mean(key)` is the mean of `key` over
    the row's runs. The name column is `name_width` wide, or as wide as the longest name."""
    name_width = max([name_width, *map(len, rows)])
    print()
    print(
        " ".join([f"{'run':{name_width}s}", *(f"{title:>{width}s}" for title, width, _ in columns)])
    )
    for name, runs in rows.items():
        mean = lambda key: sum(r.get(key, 0) for r in runs) / len(runs)
        cells = [cell(mean, runs) for _, _, cell in columns]
        line = [
            f"{name:{name_width}s}",
            *(c if c is not None else " " * w for c, (_, w, _) in zip(cells, columns)),
        ]
        print(" ".join(line).rstrip())
    print("\n" + note)


def mean_cell(value, fmt: str, suffix: str = "", shown=None):
    """A `runs_table` cell: the mean of key `value` (or `value(mean)`, a number derived from the
    means) in `fmt`, then `suffix`; blank in a row whose runs `shown(runs)` rejects."""
    number = value if callable(value) else lambda mean: mean(value)
    return lambda mean, runs: (
        f"{number(mean):{fmt}}{suffix}" if shown is None or shown(runs) else None
    )


def spread(runs: list[dict], key: str = "ratio") -> str:
    "The lowest and highest of `key` over `runs` ('' for one run)."
    values = [r[key] for r in runs]
    return f"{min(values):.3f}..{max(values):.3f}" if len(runs) > 1 else ""


def _encodings_table(rows: dict[str, list[dict]]) -> None:
    # the first float32 row (AdamW's, or the only inner optimizer's)
    float32 = rows[next(n for n in rows if n.startswith("lockstep float32,"))][0]["delta_kb"]
    has_bytes = lambda runs: "delta_kb" in runs[0]
    columns = [
        ("delta kB", 8, mean_cell("delta_kb", "8.1f", shown=has_bytes)),
        ("vs f32", 7, mean_cell(lambda m: float32 / m("delta_kb"), "6.1f", "x", has_bytes)),
        ("held-out", 8, mean_cell("loss", "8.4f")),
        ("vs sync", 7, mean_cell("ratio", "6.3f", "x")),
        ("vs f32 run", 10, mean_cell("vs_f32", "9.3f", "x")),
        ("range", 13, lambda m, r: f"{spread(r, 'vs_f32'):>13s}"),
        ("wall s", 6, mean_cell("wall", "6.0f")),
    ]
    runs_table(
        rows,
        52,
        columns,
        "delta kB = one node's delta file per round (safetensors with its header); vs f32 = how "
        "many times smaller than float32's; held-out = the final global's loss; vs sync = against "
        "the same seed's synchronous baseline; vs f32 run = against the same seed's float32 "
        "lockstep run with the same inner optimizer, range over the seeds; feedback = the node's "
        "residual (what its encoding lost) added to its next delta, feedback 0.9 = faded by 0.9 "
        "a round first (distributed.feedback_decay, SparseLoCo's accumulator). Every delta is one "
        "whole round of inner steps; lockstep = every round folds every node's delta (whole "
        "rounds, in one process).",
    )


def node_texts(train: Path, nodes: int) -> list[Path]:
    """`train` cut at paragraphs into `nodes` contiguous files of about equal size: a 2.0 user's one
    file per node."""
    text, cuts = train.read_bytes(), [0]
    for i in range(1, nodes):
        cuts.append(text.index(b"\n\n", len(text) * i // nodes) + 2)
    cuts.append(len(text))
    paths = [train.with_name(f"{train.stem}-node{i}.txt") for i in range(nodes)]
    for path, a, b in zip(paths, cuts, cuts[1:]):
        path.write_bytes(text[a:b])
    return paths


def v2_distributed(args, name: str, role: str, repo: str) -> dict:
    """The distributed section a 2.0 user writes (2.0's outer defaults 0.7 / 0.9 spelled out, as
    2.0's docs do)."""
    return {
        "enabled": True,
        "mode": "dumb_diloco",
        "role": role,
        "node_id": name,
        "repo_id": repo,
        "collaborators": [],
        "inner_steps": args.inner_steps,
        "poll_interval": args.poll,
        "outer_lr": 0.7,
        "outer_momentum": 0.9,
    }


def run_diloco(
    args,
    work: Path,
    train: Path,
    held: Path,
    *,
    transport: str,
    staleness: str = "delayed_nesterov",
    dtype: str = "bfloat16",
    outer: tuple[float, float] | None = None,
    reset: bool | None = None,
    boundary_wait: float = 0.0,
    v2_keys: bool = False,
    layout: str = "one-repo",
    limit: tuple[int, float] | None = None,
    slow: float = 1.0,  # the last worker runs at 1/slow of its speed, slow times fewer steps
    late_share: float | None = None,  # distributed.late_share
    leave_out_last: bool = False,  # the last worker does not run (its shard unread)
) -> dict:
    outer = (
        (0.7, 0.9) if v2_keys else (args.outer_lr, args.outer_momentum) if outer is None else outer
    )
    reset = True if v2_keys else args.reset_inner if reset is None else reset
    tag = (
        f"{transport}-2.0-keys"
        if v2_keys
        else f"{transport}-{staleness}-{dtype}-{outer[0]:g}-{outer[1]:g}-{int(reset)}"
        f"-{boundary_wait:g}-{layout}{f'-{limit[0]}per{limit[1]:g}' if limit else ''}"
        f"-slow{slow:g}-{int(leave_out_last)}"
    )
    count = args.nodes - 1 if leave_out_last else args.nodes  # the nodes that run
    run = work / tag
    texts = node_texts(train, args.nodes) if v2_keys else [train] * args.nodes
    hub = (
        HubStandIn(tokens={TOKEN: "write"}, **hub_limits(limit)).start()
        if transport == "hub"
        else None
    )
    repo = "bench/diloco" if hub else str(run / "repo")
    env = {"HF_ENDPOINT": hub.url, "HF_TOKEN": TOKEN} if hub else None
    configs = []
    for i in range(count):
        name = "master" if i == 0 else f"worker{i}"
        cfg = base_config(args, run, name, texts[i], batch=args.batch, target=args.batch)
        if slow > 1 and i == args.nodes - 1:  # as many rounds' time, a slow-th of the steps
            steps = max(
                args.inner_steps, round(args.steps / slow / args.inner_steps) * args.inner_steps
            )
            cfg["run"]["max_steps"] = steps
            cfg["scheduler"]["warmup_steps"] = max(1, steps // 10)
        if v2_keys:
            if transport != "hub":
                raise SystemExit(
                    "the 2.0 keys row runs on the Hub (2.0 has no directory transport)"
                )
            cfg["distributed"] = v2_distributed(args, name, "master" if i == 0 else "worker", repo)
            configs.append((cfg, write(cfg, run / f"{name}.yaml")))
            continue
        cfg["distributed"] = {
            "enabled": True,
            "role": "master" if i == 0 else "worker",
            "node_id": name,
            "transport": transport,
            "repo_id": repo,
            "inner_steps": args.inner_steps,
            "poll_interval": args.poll,
            "expected_nodes": count,
            "shard_count": args.nodes,
            "shard_index": i,
            "delta_dtype": dtype,
            "staleness": staleness,
            "final_round_timeout": 1800,
            "retry_initial": 0.2,
            "retry_max": 5.0,
            "reset_inner_optimizer": reset,
            "outer_lr": outer[0],
            "outer_momentum": outer[1],
            "boundary_wait": boundary_wait,
            "hub_layout": layout,
            "late_share": late_share,
        }
        configs.append((cfg, write(cfg, run / f"{name}.yaml")))
    try:
        if hub:
            hub.create(repo, private=True)  # made on the website before the run
        start = time.perf_counter()
        # the workers start first and wait for the master's first global: on a 10-second run, the
        # seconds a process takes to start would otherwise let one node train alone for most of it
        procs = [launch(path, env) for _, path in configs[1:]]
        wait_for_line(procs, "waiting for the master", f"the {tag} workers")
        procs.insert(0, launch(configs[0][1], env))
        if slow > 1:
            throttle(procs[-1], slow)
        wait(procs, f"the {tag} run")
        wall = time.perf_counter() - start
        if hub:
            weights = hub.files(repo)[GLOBAL_MODEL_PATH]
            ours = [
                r for name, r in hub.repos.items() if name == repo or name.startswith(repo + "-")
            ]
            commits = sum(len(r.commits) - 1 for r in ours)  # each repository's first is its own
            refused = hub.refusals["commits"] + hub.refusals["busy"]
            api = sum(1 for _, path, _ in hub.requests if path.startswith("/api/"))
            downloads = sum(1 for _, path, _ in hub.requests if "/resolve/" in path)
        else:
            weights = (Path(repo) / GLOBAL_MODEL_PATH).read_bytes()
            commits, refused, api, downloads = None, 0, 0, 0
        final = load_safetensors_bytes(weights)
    finally:
        if hub:
            hub.stop()
    master = run / "master" / "metrics.jsonl"
    rounds = [e for e in events(master, "outer_step") if e.get("deltas_included")]
    uploads = [
        e
        for i in range(count)
        for e in events(
            run / ("master" if i == 0 else f"worker{i}") / "metrics.jsonl", "delta_uploaded"
        )
    ]
    skipped = sum(
        len(
            events(
                run / ("master" if i == 0 else f"worker{i}") / "metrics.jsonl",
                "delta_upload_skipped",
            )
        )
        for i in range(count)
    )
    versions = max((e["outer_step"] for e in rounds), default=0)
    node_commits, master_commits = (
        len(uploads),
        (commits - len(uploads) if commits is not None else versions + 1),
    )
    global_bytes = len(weights)
    name = (
        f"{transport} 2.0 keys: outer 0.7/0.9 reset, a file per node"
        if v2_keys
        else f"{transport} {staleness} {dtype} outer "
        f"{outer[0]:g}/{outer[1]:g}{' reset' if reset else ''}"
        f"{f' wait {boundary_wait:g}s' if boundary_wait else ''}"
        f"{' per-node' if layout == 'per-node' else ''}"
        f"{f' limit {limit[0]}/{limit[1]:g}s' if limit else ''}"
    )
    times = [e["elapsed_s"] for e in rounds]
    gaps = [b - a for a, b in zip(times, times[1:-1])]  # the final round waits: not counted
    return {
        "name": name,
        "round_s": sum(gaps) / len(gaps) if gaps else float("nan"),
        "longest_s": max(gaps, default=float("nan")),
        "loss": held_out_loss(configs[0][0], final, held),
        "wall": wall,
        "versions": versions,
        "node_commits": node_commits,
        "master_commits": master_commits,
        "uploaded": len(uploads),
        "delta_kb": sum(e["bytes"] for e in uploads) / max(1, len(uploads)) / 1024,
        "skipped": skipped,
        "folded": sum(e["deltas_included"] for e in rounds),
        "global_kb": global_bytes / 1024,
        "refused": refused,
        "api": api,
        "downloads": downloads,
    }


def throttle(proc: subprocess.Popen, slow: float, period: float = 0.06) -> None:
    """Run `proc` at 1/`slow` of its speed: stopped (SIGSTOP) for all but a slow-th of every
    `period` seconds, until it exits (a machine that slow, as far as its rounds can tell)."""
    import signal
    import threading

    def cycle():
        while proc.poll() is None:
            time.sleep(period / slow)
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGSTOP)
            time.sleep(period * (1 - 1 / slow))
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)

    threading.Thread(target=cycle, daemon=True).start()


def run_stragglers(args, work: Path, train: Path, held: Path, seeds: list[int]) -> None:
    """`--straggler F`: whole rounds on the shared directory with every node at full speed, with
    the last worker at 1/F of its speed (and F times fewer steps: it ends when the others do), and
    without it; the median round's time and the final global's held-out loss side by side."""
    plan = [
        ("every node at full speed", dict()),
        (f"the last worker at 1/{args.straggler:g} speed", dict(slow=args.straggler)),
        ("the last worker left out", dict(leave_out_last=True)),
    ]
    rows: dict[str, list[dict]] = {}
    for seed in seeds:
        args.seed, here = seed, work / f"seed{seed}"
        base = run_baseline(args, here, train, held)
        first = None
        for label, spec in plan:
            r = run_diloco(
                args,
                here,
                train,
                held,
                transport="directory",
                boundary_wait=args.boundary_wait,
                staleness=args.staleness,
                late_share=args.late_share,
                **spec,
            )
            r["name"], r["ratio"] = label, r["loss"] / base["loss"]
            first = first or r
            r["round_vs"] = r["round_s"] / first["round_s"]
            rows.setdefault(label, []).append(r)
            print(
                f"  seed {seed}: {label}: held-out {r['loss']:.4f} ({r['ratio']:.3f}x sync), "
                f"rounds {r['round_s']:.2f} s ({r['round_vs']:.2f}x, longest "
                f"{r['longest_s']:.1f} s)"
                f", {r['wall']:.0f} s",
                flush=True,
            )
    heading = (
        f"python bench/bench_diloco.py --straggler {args.straggler:g} --staleness "
        f"{args.staleness} --late-share {args.late_share:g} --nodes {args.nodes} "
        f"--seeds {','.join(map(str, seeds))} --steps {args.steps} --inner-steps "
        f"{args.inner_steps}: whole rounds (boundary_wait {args.boundary_wait:g} s) on a shared "
        f"directory, node batch {args.batch} x {args.block} bytes\n"
    )
    show_table(lambda: _stragglers_table(rows), args.save, heading)


def _stragglers_table(rows: dict[str, list[dict]]) -> None:
    columns = [
        ("held-out", 8, mean_cell("loss", "8.4f")),
        ("vs sync", 7, mean_cell("ratio", "6.3f", "x")),
        ("range", 13, lambda m, r: f"{spread(r):>13s}"),
        ("folded", 6, mean_cell("folded", "6.1f")),
        ("versions", 8, mean_cell("versions", "8.1f")),
        ("round s", 7, mean_cell("round_s", "7.2f")),
        ("vs full", 7, mean_cell("round_vs", "6.2f", "x")),
        ("longest", 7, mean_cell("longest_s", "7.2f")),
        ("wall s", 6, mean_cell("wall", "6.0f")),
    ]
    runs_table(
        rows,
        44,
        columns,
        "round s = the mean time between two of the master's publications, longest = the "
        "longest (the final round, which waits for every node's last delta, not counted); "
        "vs full = over the run with every node at full speed, same seed; vs sync = held-out loss "
        "over the same seed's synchronous baseline of all the nodes' batches; the slow worker "
        "does a slow-th of the steps, so it ends when the others do",
    )


def hub_limits(limit: tuple[int, float] | None) -> dict:
    """The stand-in's keywords for `limit` (commits, seconds): that many commits per repository per
    window, one commit at a time, repo_info's cache lag shrunk as the hour is; none for None."""
    if limit is None:
        return {}
    commits, seconds = limit
    return dict(
        commits_per_window=commits,
        commit_window=seconds,
        one_commit_at_a_time=True,
        head_lag=2.0 * seconds / 3600.0,
    )


def parse_limit(text: str) -> tuple[int, float]:
    "`--hub-limit 12/20`: 12 commits per repository per 20 s."
    commits, _, seconds = text.partition("/")
    try:
        return int(commits), float(seconds.rstrip("s"))
    except ValueError:
        raise SystemExit(f"--hub-limit: {text!r} is not COMMITS/SECONDS, such as 12/20") from None


def run_layouts(args, work: Path, train: Path, held: Path, seeds: list[int]) -> None:
    """`--hub-limit`: whole rounds on the Hub without a limit, then under it on each layout; the
    table's last column is each run's wall time over the first row's run of its seed (the unlimited
    one-repository run unless --layout-rows says otherwise)."""
    limit = parse_limit(args.hub_limit)
    rows_of = {
        "unlimited": dict(layout="one-repo", limit=None),
        "one-repo": dict(layout="one-repo", limit=limit),
        "per-node": dict(layout="per-node", limit=limit),
        "per-node-unlimited": dict(layout="per-node", limit=None),
    }
    asked = [r.strip() for r in args.layout_rows.split(",") if r.strip()]
    if unknown := [r for r in asked if r not in rows_of]:
        raise SystemExit(f"--layout-rows: {unknown[0]!r} is not one of {', '.join(rows_of)}")
    plan = [rows_of[r] for r in asked]
    rows: dict[str, list[dict]] = {}
    for seed in seeds:
        args.seed, here = seed, work / f"seed{seed}"
        base = run_baseline(args, here, train, held)
        rows.setdefault(base["name"], []).append({**base, "ratio": 1.0})
        unlimited = None
        for spec in plan:
            r = run_diloco(
                args, here, train, held, transport="hub", boundary_wait=args.boundary_wait, **spec
            )
            r["ratio"] = r["loss"] / base["loss"]
            unlimited = unlimited or r["wall"]
            r["slowdown"] = r["wall"] / unlimited
            rows.setdefault(r["name"], []).append(r)
            print(
                f"  seed {seed}: {r['name']} held-out {r['loss']:.4f} ({r['ratio']:.3f}x sync), "
                f"{r['wall']:.0f} s ({r['slowdown']:.2f}x unlimited), {r['refused']} refusals",
                flush=True,
            )
    heading = (
        f"python bench/bench_diloco.py --hub-limit {args.hub_limit} --nodes {args.nodes} --seeds "
        f"{','.join(map(str, seeds))} --steps {args.steps} --inner-steps {args.inner_steps}: "
        f"whole rounds (boundary_wait {args.boundary_wait:g} s), node batch {args.batch} x "
        f"{args.block} bytes\n"
    )
    show_table(lambda: _layouts_table(rows, limit), args.save, heading)


def _layouts_table(rows: dict[str, list[dict]], limit: tuple[int, float]) -> None:
    diloco = lambda runs: "slowdown" in runs[0]  # the baseline row has loss and wall only
    commits = lambda m: m("node_commits") + m("master_commits")
    columns = [
        ("held-out", 8, mean_cell("loss", "8.4f")),
        ("vs sync", 7, lambda m, r: f"{m('ratio') if diloco(r) else 1.0:6.3f}x"),
        ("folded", 6, mean_cell("folded", "6.1f", shown=diloco)),
        ("uploaded", 8, mean_cell("uploaded", "8.1f", shown=diloco)),
        ("commits", 7, mean_cell(commits, "7.0f", shown=diloco)),
        ("429/409", 7, mean_cell("refused", "7.0f", shown=diloco)),
        ("API", 6, mean_cell("api", "6.0f", shown=diloco)),
        ("dl", 6, mean_cell("downloads", "6.0f", shown=diloco)),
        ("wall s", 6, mean_cell("wall", "6.0f")),
        ("vs first", 8, mean_cell("slowdown", "7.2f", "x", diloco)),
    ]
    runs_table(
        rows,
        72,
        columns,
        f"limit {limit[0]}/{limit[1]:g}s = the stand-in answers 429 past {limit[0]} commits per "
        f"repository per {limit[1]:g} s (the Hub's 128 an hour, scaled) and 409 to a second "
        "concurrent commit; per-node = distributed.hub_layout: per-node; vs first = wall time "
        "over the first DiLoCo row's run of the same seed; 429/409 = the refusals the nodes "
        "met; commits = on the run's repository and the nodes' (a node's deltas, the master's "
        "publications); API, dl = the /api/ calls and /resolve/ downloads the stand-in answered, "
        "all nodes together",
    )


def wire_rows(cfg: dict, trained: dict) -> list[dict]:
    """The bytes of one delta file of this model (init minus `trained`) in each delta dtype, as a
    node writes it."""
    from speedtronic.distributed.tensors import (
        delta_header,
        encode_delta,
        floating_state,
        safetensors_bytes,
    )

    torch.manual_seed(cfg["run"]["seed"])
    init = floating_state(build_model(SpeedtronicConfig.from_dict(cfg).model).state_dict())
    delta = {k: v.float() - trained[k].float() for k, v in init.items()}
    size = {
        d: len(
            safetensors_bytes(
                encode_delta(delta, d),
                delta_header(
                    node_id="node", local_step=1, base_outer_step=0, inner_steps=1, encoding=d
                ),
            )
        )
        for d in ("float32", "bfloat16", "int8")
    }
    return [
        {
            "name": f"wire: one delta in {d} ({size[d] / size['float32']:.2f}x float32)",
            "delta_kb": size[d] / 1024,
        }
        for d in size
    ]


def load_safetensors_bytes(data: bytes) -> dict:
    """The tensors of a global file's bytes, read by our own loader (it restores tied tensors stored
    once)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "global.safetensors"
        path.write_bytes(data)
        return load_safetensors(path)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--steps", type=int, default=300, help="optimizer steps of every node and of the baseline"
    )
    parser.add_argument("--inner-steps", type=int, default=20)
    parser.add_argument("--nodes", type=int, default=4, help="the master and nodes-1 workers")
    parser.add_argument(
        "--batch", type=int, default=8, help="each node's batch (the baseline uses nodes x batch)"
    )
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--width", type=int, default=64, help="d_model of the model")
    parser.add_argument("--layers", type=int, default=2, help="n_layer of the model")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--poll", type=float, default=0.5, help="distributed.poll_interval")
    parser.add_argument("--transports", default="directory,hub")
    parser.add_argument(
        "--boundary-wait",
        type=float,
        default=30.0,
        help="distributed.boundary_wait of the extra waiting runs of each transport (0: no such "
        "runs)",
    )
    parser.add_argument(
        "--compare",
        action="store_true",
        help="also staleness none/weighted and float32/int8 deltas (directory)",
    )
    parser.add_argument(
        "--outer-lr", type=float, default=1.0, help="distributed.outer_lr of the main runs"
    )
    parser.add_argument(
        "--outer-momentum",
        type=float,
        default=0.0,
        help="distributed.outer_momentum of the main runs",
    )
    parser.add_argument(
        "--reset-inner", action="store_true", help="reset_inner_optimizer: true in the main runs"
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs per DiLoCo variant and seed (timing makes async runs vary)",
    )
    parser.add_argument(
        "--seeds",
        default="1234,1,2",
        help="comma-separated run.seed values: every row runs once per seed (init and "
        "data order), each DiLoCo run compared with the baseline of its own seed",
    )
    parser.add_argument(
        "--encodings",
        action="store_true",
        help="only the delta-encodings table (lockstep whole rounds, every seed)",
    )
    parser.add_argument(
        "--encoding-rows",
        default=None,
        help="--encodings: only these rows, e.g. float32,int8+feedback,topk:0.06:2:0.9 "
        "(topk:DENSITY:BITS[:FEEDBACK_DECAY[:CHUNK]]; float32 first; no Muon rows)",
    )
    parser.add_argument(
        "--inner-optimizer",
        choices=("adamw", "muon"),
        default="adamw",
        help="--encodings: the nodes' inner optimizer for the encodings' rows (muon: no extra "
        "Muon rows)",
    )
    parser.add_argument(
        "--fragments",
        action="store_true",
        help="only the fragments table (lockstep whole rounds, the best encoding, every seed)",
    )
    parser.add_argument(
        "--fragment-counts", default="1,2,4", help="--fragments: the fragment counts compared"
    )
    parser.add_argument(
        "--fragment-encodings",
        default="float32,topk",
        help="--fragments: the encodings compared, some of float32, int8 (+ feedback), topk (3%% "
        "2-bit + feedback 0.9), topk8 (8%% 2-bit in chunks of 256 + feedback 0.9)",
    )
    parser.add_argument(
        "--mixing",
        default="0.5",
        help="--fragments: distributed.mixing values (α) also run whole and in the most fragments",
    )
    parser.add_argument(
        "--delay",
        type=int,
        default=0,
        help="--fragments: also the most fragments at the first mixing with globals this many "
        "inner steps late (Streaming DiLoCo's τ)",
    )
    parser.add_argument("--muon-lr", type=float, default=8e-3, help="lr of the Muon rows")
    parser.add_argument(
        "--save",
        default=None,
        help="--encodings, --fragments, --hub-limit: also write the table to this file",
    )
    parser.add_argument(
        "--hub-limit",
        default=None,
        help="COMMITS/SECONDS: only the layouts table, whole rounds on the Hub unlimited and "
        "under this per-repository commit limit, one repository and one per node",
    )
    parser.add_argument(
        "--staleness",
        default="delayed_nesterov",
        help="--straggler: distributed.staleness of its runs",
    )
    parser.add_argument(
        "--late-share",
        type=float,
        default=0.25,
        help="--straggler: distributed.late_share of its runs",
    )
    parser.add_argument(
        "--layout-rows",
        default="unlimited,one-repo,per-node,per-node-unlimited",
        help="--hub-limit: the rows to run (vs unlimited is over the first)",
    )
    parser.add_argument(
        "--straggler",
        type=float,
        default=0.0,
        help="F: only the stragglers table, whole rounds with the last worker at 1/F speed",
    )
    parser.add_argument("--keep", default=None, help="keep the runs in this folder")
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench-diloco-"))
    work.mkdir(parents=True, exist_ok=True)
    train, held = prepare_text(work)
    print(
        f"{args.nodes} nodes x {args.steps} steps, inner_steps {args.inner_steps}, node batch "
        f"{args.batch} x {args.block} bytes; "
        f"{train.stat().st_size / 1e3:.0f} kB training text, {held.stat().st_size / 1e3:.0f} kB "
        f"held out; seeds {seeds}",
        flush=True,
    )
    if args.straggler:
        run_stragglers(args, work, train, held, seeds)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        return
    if args.hub_limit:
        run_layouts(args, work, train, held, seeds)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        return
    if args.fragments:
        run_fragments(args, work, train, held, seeds)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        return
    if args.encodings:
        run_encodings(args, work, train, held, seeds)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        return
    plan = [dict(transport=t) for t in args.transports.split(",") if t]
    if args.boundary_wait:
        plan += [
            dict(transport=t, boundary_wait=args.boundary_wait)
            for t in args.transports.split(",")
            if t
        ]
    # whole rounds with exact deltas: what bfloat16 costs
    if args.boundary_wait and "directory" in args.transports:
        plan.append(dict(transport="directory", dtype="float32", boundary_wait=args.boundary_wait))
    defaults = dict(outer=(0.7, 0.9), reset=True)  # DiLoCo's outer Nesterov and 2.0's inner reset
    if "directory" in args.transports:
        plan.append(dict(transport="directory", **defaults))
    if args.compare:
        plan += [dict(transport="directory", staleness=s) for s in ("weighted", "none")]
        plan += [dict(transport="directory", staleness="none", **defaults)]
        plan += [dict(transport="directory", dtype=d) for d in ("float32", "int8")]
    if "hub" in args.transports:
        plan.append(dict(transport="hub", v2_keys=True))  # what a 2.0 user's config gets
    # row name -> its runs, each with `ratio` to its seed's baseline
    rows: dict[str, list[dict]] = {}
    for seed in seeds:
        args.seed, here = seed, work / f"seed{seed}"
        base = run_baseline(args, here, train, held)
        lockstep = run_lockstep(args, here, train, held)
        print(
            f"  seed {seed}: baseline {base['loss']:.4f} ({base['wall']:.0f} s), lockstep "
            f"{lockstep['loss']:.4f}",
            flush=True,
        )
        for r in (base, lockstep):
            rows.setdefault(r["name"], []).append({**r, "ratio": r["loss"] / base["loss"]})
        if seed == seeds[0]:
            wire = wire_rows(base["config"], base["state"])
        for spec in plan:
            for i in range(args.repeats):
                r = run_diloco(args, here / f"repeat{i}", train, held, **spec)
                r["ratio"] = r["loss"] / base["loss"]
                rows.setdefault(r["name"], []).append(r)
                print(
                    f"  seed {seed}: {r['name']} held-out loss {r['loss']:.4f} ({r['ratio']:.3f}x "
                    f"the baseline, {r['wall']:.0f} s)",
                    flush=True,
                )
    for r in wire:
        rows[r["name"]] = [r]
    print_table(rows)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


def print_table(rows: dict[str, list[dict]]) -> None:
    "The one table of measured numbers: a line per row, means over its runs (seeds x repeats)."
    trained = lambda runs: "loss" in runs[0]  # a wire row has bytes only
    rounds = lambda runs: trained(runs) and "versions" in runs[0]
    per_version = lambda m: (m("node_commits") + m("master_commits")) / max(1, m("versions"))
    columns = [
        ("held-out", 8, mean_cell("loss", "8.4f", shown=trained)),
        ("vs sync", 7, mean_cell("ratio", "6.3f", "x", trained)),
        ("range", 13, lambda m, r: f"{spread(r):>13s}" if trained(r) else None),
        ("uploaded", 8, mean_cell("uploaded", "8.1f", shown=rounds)),
        ("folded", 6, mean_cell("folded", "6.1f", shown=rounds)),
        ("versions", 8, mean_cell("versions", "8.1f", shown=rounds)),
        ("commits/v", 9, mean_cell(per_version, "9.2f", shown=rounds)),
        ("delta kB", 8, mean_cell("delta_kb", "8.1f", shown=lambda r: rounds(r) or not trained(r))),
        ("global kB", 9, mean_cell("global_kb", "9.1f", shown=rounds)),
        ("wall s", 6, mean_cell("wall", "6.0f", shown=trained)),
    ]
    runs_table(
        rows,
        56,
        columns,
        "vs sync = mean over the row's runs (one per seed, and per repeat for the DiLoCo runs) of "
        "held-out loss / the same seed's synchronous baseline; range = the lowest and highest of "
        "them. uploaded = deltas the nodes uploaded; folded = deltas the master folded into a "
        "published global; versions = published global versions; commits/v = (node deltas + "
        "master publications) per version; delta kB = one delta on the wire; global kB = the "
        "weights published each version (each node downloads it); outer a/b = "
        "outer_lr/outer_momentum; reset = reset_inner_optimizer; wait = distributed.boundary_wait "
        "(whole rounds); 2.0 keys = only the distributed keys of a 2.0 config, the rest at "
        "defaults",
    )


if __name__ == "__main__":
    main()
