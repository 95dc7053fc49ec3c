"""nanoGPT's CPU recipe through our trainer (bench/bench_recipe.py): shuffled blocks from a prepared
token file, the same held-out tenth as the text file read in order."""

import importlib.util
import re
import subprocess
import sys

import numpy as np

from conftest import ROOT, cli_env, run_command
from speedtronic.data import TextFileTokenDataset, TokenFileDataset
from speedtronic.evaluation import holdout_split


def _bench_module():
    spec = importlib.util.spec_from_file_location("bench_recipe", ROOT / "bench/bench_recipe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _prose(tmp_path):
    words = "the quick brown fox jumps over a lazy dog while seven wise owls watch".split()
    text = tmp_path / "prose.txt"
    text.write_text(
        "\n".join(" ".join(words[(i * 7 + j) % len(words)] for j in range(11)) for i in range(600))
    )
    return text


def test_shuffled_recipe_holds_out_the_text_files_last_tenth_and_trains_shuffled(tmp_path):
    """The bench's prepared token file holds out exactly the blocks the text file holds out, and
    its training blocks are read shuffled (the recipe draws random windows), not in file order."""
    bench, text = _bench_module(), _prose(tmp_path)
    raw = bench.recipe(text, tmp_path, 20, "adamw", 1337)
    src = raw["data"]
    assert src["shuffle"] is True and "text_path" not in src
    prepared = TokenFileDataset(src["token_file"], 64, shuffle=True, seed=1337)
    by_file = holdout_split(TextFileTokenDataset(text, 64), 0.1)
    by_tokens = holdout_split(prepared, 0.1)
    np.testing.assert_array_equal(by_tokens.held_out.tokens, by_file.held_out.tokens)
    np.testing.assert_array_equal(by_tokens.train.tokens, by_file.train.tokens)
    order = by_tokens.train.block_order(0)
    assert sorted(order.tolist()) == list(range(by_file.train.num_blocks))
    assert order.tolist() != sorted(order.tolist())
    assert bench.recipe(text, tmp_path, 20, "adamw", 1337, "file")["data"]["text_path"] == str(text)


def test_bench_recipe_names_the_block_order_it_ran(tmp_path):
    "`--order shuffled` (the default) and `--order file` each print the order and a held-out loss."
    text = _prose(tmp_path)
    for args, order in (((), "shuffled"), (("--order", "file"), "file")):
        res = run_command(
            [sys.executable, "bench/bench_recipe.py", "--text", str(text), "--steps", "2", *args],
            cwd=ROOT,
            env=cli_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert res.returncode == 0, res.stderr[-3000:]
        assert re.search(
            rf"^recipe: 2 steps .* 1 thread\(s\), {order} blocks, prose.txt$", res.stdout, re.M
        )
        assert re.search(r"^speedtronic: held-out \d+\.\d{3} nats/char", res.stdout, re.M)
