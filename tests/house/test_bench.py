"""bench/bench_trainer.py runs and says where the trainer's microseconds per step go (its figures
are not checked: they are measurements, and this machine is shared)."""

import re, shlex, subprocess, sys

from conftest import ROOT, cli_env, run_command, stand_in_python


def run_bench(script: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    "`python bench/<script> *args` from the repository root in the CLI's environment, captured."
    return run_command(
        [sys.executable, f"bench/{script}", *args],
        cwd=ROOT,
        # the DiLoCo benches' nodes are forked too (bench_diloco.NODE_PYTHON)
        env=cli_env(SPEEDTRONIC_BENCH_PYTHON=shlex.join(stand_in_python())),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


PARTS = [
    "move + count the batch",
    "autocast + gradient-sync contexts",
    "resolve the loss, keep it detached",
    "finite check (one scalar read)",
    "read the loss (beyond the plain .item())",
    "the train_step record and emit",
    "pending step, counters, lr, stop flag",
    "the rest (calls, the step and fit structure)",
]


def test_bench_trainer_prints_the_ratio_the_overhead_and_its_breakdown():
    res = run_bench("bench_trainer.py", "--rounds", "1", "--steps", "3", "--warmup", "1")
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout
    assert re.search(
        r"^cpu   fp32 compile=False  plain +\d+ tok/s  trainer +\d+ tok/s  ratio \d\.\d{3} "
        r"\(median of 1 rounds",
        out,
        re.M,
    ), out
    added = float(
        re.search(
            r"trainer adds (-?\d+) us per step over the plain loop; where it goes:", out
        ).group(1)
    )
    rows = {
        name: float(re.search(rf"^  {re.escape(name)} +(-?\d+\.\d) us$", out, re.M).group(1))
        for name in PARTS
    }
    # the rows account for the whole figure
    assert abs(sum(rows.values()) - added) <= 0.5 + 0.05 * len(rows), (
        added,
        rows,
    )
    assert re.search(
        r"^peak RSS \(CPU, own process\): plain [\d.]+ MB  trainer [\d.]+ MB", out, re.M
    ), out


def test_bench_recipe_prints_our_held_out_loss_and_cpu_seconds_beside_nanogpts(tmp_path):
    """bench/bench_recipe.py, 4 steps of nanoGPT's CPU recipe on a small prose file (the last tenth
    held out), prints the recipe's token count, our held-out loss and CPU-seconds, the same recipe
    run as a plain PyTorch loop beside it with the ratios, and the recorded reference; a missing
    text file is one line and exit 2."""
    words = "the quick brown fox jumps over a lazy dog while seven wise owls watch".split()
    text = tmp_path / "prose.txt"
    text.write_text(
        "\n".join(" ".join(words[(i * 7 + j) % len(words)] for j in range(11)) for i in range(600))
    )

    def bench(*args: str) -> subprocess.CompletedProcess:
        return run_bench("bench_recipe.py", *args)

    res = bench("--text", str(text), "--steps", "4")
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout
    assert re.search(
        r"^recipe: 4 steps x 12 x 64 = 3,072 tokens, adamw at lr \S+, 1 thread", out, re.M
    ), out
    loss = re.search(r"^speedtronic: held-out (\d+\.\d{3}) nats/char in ([\d.]+) CPU-s", out, re.M)
    assert loss and 0 < float(loss.group(1)) < 6.0, out  # below ln(256) = 5.55 plus noise
    # the bench's own measure of our model agrees with the trainer's held-out evaluation
    same = re.search(r"; (\d+\.\d{3}) measured as the baseline is\)$", out, re.M)
    assert same and same.group(1) == loss.group(1), out
    base = re.search(
        r"^baseline, the recipe in plain PyTorch \(GPT-2 blocks, AdamW\): held-out (\d+\.\d{3}) "
        r"nats/char in ([\d.]+) CPU-s",
        out,
        re.M,
    )
    assert base and 0 < float(base.group(1)) < 6.0, out
    ratio = re.search(r"^speedtronic / baseline: held-out loss (\d+\.\d{3})x, CPU time", out, re.M)
    assert ratio and abs(float(ratio.group(1)) - float(same.group(1)) / float(base.group(1))) < 2e-3
    # where ours took longer, ours again in the baseline's CPU-seconds: fewer steps, its own ratio
    budget = re.search(
        r"^speedtronic in the baseline's CPU time: (\d+) steps \(([\d,]+) tokens, the schedule "
        r"fitted to them\): held-out (\d+\.\d{3}) nats/char in [\d.]+ CPU-s "
        r"\((\d+\.\d{3}) measured",
        out,
        re.M,
    )
    ours_cpu, base_cpu = float(loss.group(2)), float(base.group(2))
    if abs(ours_cpu - base_cpu) > 0.1:  # the printed figures are rounded to a tenth
        assert (budget is not None) == (ours_cpu > base_cpu), out
    if budget:
        steps = int(budget.group(1))
        assert 1 <= steps < 4 and budget.group(2) == f"{steps * 12 * 64:,}", out
        assert budget.group(3) == budget.group(4), out
        equal = re.search(
            r"^speedtronic / baseline at equal CPU time: held-out loss (\d+\.\d{3})x, CPU time "
            r"[\d.]+x$",
            out,
            re.M,
        )
        ratio = float(budget.group(4)) / float(base.group(1))
        assert equal and abs(float(equal.group(1)) - ratio) < 2e-3, out
    assert "nanoGPT (recorded): held-out 1.570 nats/char in 165-177 CPU-s" in out, out
    missing = bench("--text", str(tmp_path / "nope.txt"), "--steps", "4")
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert missing.stderr.strip().splitlines() == [
        f"bench_recipe: --text {tmp_path / 'nope.txt'}: no such file; pass a text file"
    ]


def test_bench_compression_prints_bytes_per_round_and_the_summed_error_per_encoding():
    """bench/bench_compression.py, 2 rounds of 1 step of a d_model 64 model, prints one row per
    encoding: bytes of one round's delta file against float32's and the relative error of the summed
    deltas without and with error feedback; a bad argument is one line and exit 2."""

    def bench(*args: str) -> subprocess.CompletedProcess:
        return run_bench("bench_compression.py", *args)

    res = bench("--rounds", "2", "--inner-steps", "1", "--d-model", "64")
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout
    assert re.search(
        r"^deltas: 2 rounds of 1 AdamW steps \(batch 8 x 64 tokens\), seed 0", out, re.M
    )
    rows = {
        m["name"]: (
            int(m["bytes"].replace(",", "")),
            float(m["of"]),
            float(m["plain"]),
            float(m["fed"]),
        )
        for m in re.finditer(
            r"^(?P<name>float32|bfloat16|int8|topk [13]% [24]-bit) +(?P<bytes>[\d,]+)"
            r" +1/(?P<of>[\d.]+) +(?P<plain>\d\.\de[+-]\d\d) +(?P<fed>\d\.\de[+-]\d\d)$",
            out,
            re.M,
        )
    }
    names = ["float32", "bfloat16", "int8"] + [f"topk {d}% {b}-bit" for d in (3, 1) for b in (4, 2)]
    assert list(rows) == names, out
    assert rows["float32"][1:] == (1.0, 0.0, 0.0), out  # float32 is the unit and loses nothing
    assert rows["bfloat16"][1] == 2.0, out  # half of float32's bytes (the header aside)
    assert all(rows[n][0] < rows["int8"][0] for n in names[3:]), out
    bad = bench("--rounds", "0")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines() == ["bench_compression: --rounds 0: must be at least 1"]


def test_bench_sim_diloco_prints_the_budget_its_verdict_and_the_hourly_table():
    """bench/sim_diloco.py, 3 simulated nodes for a quarter of a simulated hour, prints the run,
    `HubBudget`'s plan and verdict, then the per-hour table and its totals; an unknown tier is one
    line and exit 2."""

    def bench(*args: str) -> subprocess.CompletedProcess:
        return run_bench("sim_diloco.py", *args)

    res = bench("--nodes", "3", "--hours", "0.25", "--params", "256")
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout
    assert out.startswith(
        "sim_diloco: 3 nodes (a master and 2 workers), rounds of 300 s, 0.25 simulated hour(s) at "
        "360x, 256 parameters, layout: one repository\n"
        "Hub budget (free tier, 3 nodes, rounds of 300 s, polls every 60 s):\n"
    ), out
    assert re.search(r"^verdict: (fits|refused)$", out, re.M), out
    assert re.search(
        r"^hour commits/repo +API/5min +dl/5min +429s +409s +rounds .* lost$", out, re.M
    )
    assert re.search(
        r"^ +0 +\d+ +\d+ +\d+ +\d+ +\d+ +\d+ +\d+ +\d+ +\d+ +\d+ +\d+ +\d+$", out, re.M
    )
    assert re.search(r"^deltas made \d+, sent \d+, folded \d+, folded twice 0, lost 0$", out, re.M)
    assert re.search(r"^rounds completed \d+ in [\d.]+ simulated hours", out, re.M), out
    assert re.search(
        r"^the master's commit budget held a publication back \d+ time\(s\)", out, re.M
    ), out
    unknown = bench("--tier", "gold")
    assert unknown.returncode == 2 and "Traceback" not in unknown.stderr
    assert unknown.stderr.strip().splitlines() == [
        "sim_diloco: --tier gold: unknown tier; use one of free, pro, team, enterprise"
    ]


def test_bench_diloco_encoding_rows_runs_only_the_rows_named(tmp_path):
    """--encodings --encoding-rows --inner-optimizer muon: only the rows named (a top-k row with its
    chunk size), each with Muon inside, no other rows, under the command that made them; a row that
    names no encoding is one line, exit 2."""
    save = tmp_path / "rows.txt"
    argv = "--encodings --seeds 1 --steps 20 --inner-steps 10 --nodes 2".split()
    rows = "float32,topk:0.08:2:0.9:256"
    res = run_bench(
        "bench_diloco.py", *argv, "--encoding-rows", rows, "--inner-optimizer", "muon",
        "--save", str(save),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    found = re.findall(r"^lockstep (.+?), (adamw|muon) inner +([\d.]+) ", res.stdout, re.M)
    assert [(name, inner) for name, inner, _ in found] == [
        ("float32", "muon"),
        ("topk 8% 2-bit chunk 256 + feedback 0.9", "muon"),
    ], res.stdout
    assert float(found[1][2]) < float(found[0][2]) / 4, found  # a sparse delta is smaller
    assert save.read_text().startswith(
        f"python bench/bench_diloco.py --encodings --encoding-rows {rows} --inner-optimizer muon "
        "--seeds 1 "
    ), save.read_text()[:300]
    for bad in ("int4", "topk:0.03:2,float32"):
        refused = run_bench("bench_diloco.py", *argv, "--encoding-rows", bad)
        assert refused.returncode != 0 and "Traceback" not in refused.stderr, refused.stderr
        assert refused.stderr.strip().splitlines()[-1].startswith("--encoding-rows"), refused.stderr


def test_bench_diloco_encodings_prints_and_saves_one_row_per_encoding(tmp_path):
    """bench/bench_diloco.py --encodings, 2 nodes x 20 steps of lockstep rounds: a row per delta
    encoding (and Muon's two), each delta's bytes and how many times smaller than float32's, the
    same table written to --save under the command that made it."""
    save = tmp_path / "encodings.txt"
    argv = "--encodings --seeds 1 --steps 20 --inner-steps 10 --nodes 2".split()
    res = run_bench("bench_diloco.py", *argv, "--save", str(save), timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [
        (m["name"], m["inner"], float(m["kb"]))
        for m in re.finditer(
            r"^lockstep (?P<name>.+?), (?P<inner>adamw|muon) inner +(?P<kb>[\d.]+) +[\d.]+x +\d",
            res.stdout,
            re.M,
        )
    ]
    assert [(name, inner) for name, inner, _ in rows] == [
        ("float32", "adamw"),
        ("bfloat16", "adamw"),
        ("bfloat16 + feedback", "adamw"),
        ("int8 + feedback", "adamw"),
        ("topk 3% 2-bit + feedback", "adamw"),
        ("topk 1% 2-bit + feedback", "adamw"),
        ("topk 3% 2-bit + feedback 0.9", "adamw"),
        ("topk 1% 2-bit + feedback 0.9", "adamw"),
        ("float32", "muon"),
        ("topk 3% 2-bit + feedback 0.9", "muon"),
    ], res.stdout
    kb = [k for _, _, k in rows]
    assert kb[5] < kb[4] < kb[3] < kb[1] < kb[0], res.stdout  # sparser, smaller
    assert kb[1] == kb[2] and kb[8] == kb[0], res.stdout
    assert kb[6] == kb[4] == kb[9] and kb[7] == kb[5], res.stdout  # the decay costs no byte
    saved = save.read_text()
    assert saved.startswith("python bench/bench_diloco.py --encodings --seeds 1 --steps 20 ")
    assert saved.split("\n", 1)[1] in res.stdout


def test_bench_diloco_fragments_prints_the_peak_upload_per_fragment_count(tmp_path):
    """bench/bench_diloco.py --fragments, 2 nodes x 24 steps of a 4-layer model: a row per fragment
    count and encoding (float32, top-k; each row named from what its run did) after the baseline's,
    and rows for whole deltas and four fragments with mixing 0.5, and four fragments with mixing
    whose globals arrive 2 steps late (--delay), each with its uploads' bytes; four fragments upload
    less at a time than whole deltas, as much per round; the table written to --save under the
    command."""
    save = tmp_path / "fragments.txt"
    argv = (
        "--fragments --seeds 1 --steps 24 --inner-steps 12 --nodes 2 --layers 4 --delay 2".split()
    )
    res = run_bench("bench_diloco.py", *argv, "--save", str(save), timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = {
        int(m["count"]): [float(x.rstrip("x")) for x in m["numbers"].split()]
        for m in re.finditer(
            r"^F = (?P<count>\d): topk 3% 2-bit \+ feedback 0.9 +(?P<numbers>[\d. x]+)$",
            res.stdout,
            re.M,
        )
    }
    assert sorted(rows) == [1, 2, 4], res.stdout
    # whole and with the most fragments, mixing 0.5 (--mixing's default) as well, in each encoding
    mixed = re.findall(
        r"^F = ([14]), α 0.5: (float32|topk 3% 2-bit \+ feedback 0.9) ", res.stdout, re.M
    )
    assert sorted(mixed) == [
        (f, e) for f in "14" for e in ("float32", "topk 3% 2-bit + feedback 0.9")
    ], res.stdout
    late = re.findall(
        r"^F = 4, α 0.5, τ 2: (float32|topk 3% 2-bit \+ feedback 0.9) ", res.stdout, re.M
    )
    assert sorted(late) == ["float32", "topk 3% 2-bit + feedback 0.9"], res.stdout
    # upload kB, round kB, peak kB, peak/F=1, last kB, held-out, vs sync, vs F=1, wall s
    upload, round_kb, peak, share, last = (rows[4][i] for i in range(5))
    assert len(re.findall(r"^F = \d: float32 ", res.stdout, re.M)) == 3, res.stdout
    assert peak < 0.5 * rows[1][2] and share < 0.5 and upload < rows[1][0], res.stdout
    assert abs(round_kb - rows[1][1]) < 0.25 * rows[1][1], res.stdout  # the model, once a round
    assert abs(last - rows[1][4]) < 0.25 * rows[1][4], res.stdout  # the last delta is whole
    assert rows[1][3] == 1.0 and all(r[5] > 0 for r in rows.values()), res.stdout
    assert re.search(r"^synchronous baseline", res.stdout, re.M), res.stdout
    saved = save.read_text()
    assert saved.startswith(
        "python bench/bench_diloco.py --fragments --fragment-counts 1,2,4 --mixing 0.5 --delay 2 "
    )
    assert saved.split("\n", 1)[1] in res.stdout


def test_bench_diloco_hub_limit_compares_the_layouts_under_a_commit_limit(tmp_path):
    """bench/bench_diloco.py --hub-limit, 3 nodes x 20 steps of whole rounds on the Hub stand-in:
    a row per layout asked for, each folding every delta its nodes uploaded, the per-node one under
    the limit meeting no refusal; the table written to --save under the command that made it."""
    save = tmp_path / "layouts.txt"
    argv = "--hub-limit 12/20 --seeds 1 --steps 20 --inner-steps 5 --nodes 3".split()
    argv += ["--layout-rows", "one-repo,per-node"]
    res = run_bench("bench_diloco.py", *argv, "--save", str(save), timeout=600)
    assert res.returncode == 0, res.stderr[-3000:] + res.stdout[-3000:]
    rows = {
        m["name"].strip(): [float(x.rstrip("x")) for x in m["numbers"].split()[:7]]
        for m in re.finditer(
            r"^(?P<name>hub .+? limit 12/20s) +(?P<numbers>[\d. x]+)$", res.stdout, re.M
        )
    }
    assert len(rows) == 2, res.stdout
    (one_name, one), (node_name, node) = rows.items()
    assert "per-node" not in one_name and "per-node" in node_name, rows
    for loss, ratio, folded, uploaded, commits, refused, api in rows.values():
        assert folded == uploaded > 0 and loss > 0, rows  # every uploaded delta folded once
    assert node[5] == 0, rows  # a repository per node: no 429 or 409
    saved = save.read_text()
    assert saved.startswith("python bench/bench_diloco.py --hub-limit 12/20 --nodes 3 ")
    assert saved.split("\n", 1)[1] in res.stdout


def test_bench_diloco_straggler_prints_the_rounds_with_a_throttled_node(tmp_path):
    """bench/bench_diloco.py --straggler 3, 3 nodes x 40 steps of whole rounds on a shared
    directory: the three rows (every node at full speed, the last worker throttled to a third, left
    out), each with its mean and longest round; the throttled worker's fewer deltas folded."""
    argv = "--straggler 3 --seeds 1 --steps 40 --inner-steps 5 --nodes 3".split()
    res = run_bench("bench_diloco.py", *argv, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:] + res.stdout[-3000:]
    found = {
        m["name"]: float(m["folded"])
        for m in re.finditer(
            r"^(?P<name>every node at full speed|the last worker at 1/3 speed|the last worker left "
            r"out) +[\d.]+ +[\d.]+x +(?P<folded>[\d.]+) ",
            res.stdout,
            re.M,
        )
    }
    assert list(found) == [
        "every node at full speed",
        "the last worker at 1/3 speed",
        "the last worker left out",
    ], res.stdout
    full, slow, without = found.values()
    assert full == 3 * 8 and without == 2 * 8, found  # 8 rounds of 5 steps, every delta folded
    assert without < slow < full, found  # the throttled worker's 40/3 steps: its fewer deltas
