"""`speedtronic generate` end to end: a run trained by the CLI continues a prompt, in a fresh
process.

The text the command prints is the prompt followed by exactly what `speedtronic.generation.generate`
writes in process from the same checkpoint; bad input is one `speedtronic: error:` line and exit 2.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import (
    spawn,
    ROOT,
    V2_FIXTURES,
    bpe_tokenizer_file,
    cli_env,
    needs_v2_fixtures,
    ok,
    one_error_line,
    run_cli,
    tiny_config,
)
from speedtronic.generation import generate
from speedtronic.hf import load_trained

FIXTURES = V2_FIXTURES
TEXT = "the quick brown fox jumps over the lazy dog. " * 40


def trained_run(tmp: Path, **sections) -> Path:
    """A byte-level reference run trained 4 steps by `speedtronic train` on a small text; returns
    its output folder."""
    (tmp / "text.txt").write_text(TEXT)
    model = {"vocab_size": 256, "n_head": 4, "n_kv_head": 2, **sections.pop("model", {})}
    data = {"text_path": str(tmp / "text.txt"), "synthetic": False, **sections.pop("data", {})}
    cfg = tiny_config(tmp, model=model, data=data, **sections)
    ok(run_cli("train", "--config", str(cfg), "--device", "cpu", cwd=tmp))
    return tmp / "out"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return trained_run(tmp_path_factory.mktemp("gen"))


def expected(where: dict, prompt: str, **sampling) -> str:
    trained = load_trained(**where)
    return prompt + generate(trained.model, trained.tokenizer, prompt, **sampling) + "\n"


def test_greedy_text_of_a_run_and_of_its_checkpoint(run_dir):
    args = ["--prompt", "the qu", "--temperature", "0", "--max-new-tokens", "30", "--device", "cpu"]
    out = ok(run_cli("generate", "--run", str(run_dir), *args, cwd=run_dir.parent)).stdout
    assert out == expected({"run": run_dir}, "the qu", max_new_tokens=30, temperature=0)
    assert len(out) > len("the qu\n")
    newest = sorted((run_dir / "checkpoints").glob("step_*.pt"))[-1]
    again = ok(run_cli("generate", "--checkpoint", str(newest), *args, cwd=run_dir.parent)).stdout
    assert again == out


def test_the_text_streams_while_the_model_is_still_writing(run_dir):
    """Asked for 200,000 tokens (minutes of work), the command has printed the prompt and the first
    30 generated ones (generate's) while it still runs."""
    first = (
        expected({"run": run_dir}, "the qu", max_new_tokens=30, temperature=0)
        .removesuffix("\n")
        .encode()
    )
    proc = spawn(
        [
            sys.executable,
            "-m",
            "speedtronic",
            "generate",
            "--run",
            str(run_dir),
            "--prompt",
            "the qu",
            "--temperature",
            "0",
            "--max-new-tokens",
            "200000",
            "--device",
            "cpu",
        ],
        cwd=run_dir.parent,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        got = b""
        while len(got) < len(first) and (chunk := os.read(proc.stdout.fileno(), 4096)):
            got += chunk
        assert proc.poll() is None  # 200,000 tokens are far from written
        assert got[: len(first)] == first
    finally:
        proc.kill()
        proc.wait(timeout=60)
        proc.stdout.close()


def test_a_seed_gives_the_same_sampled_text(run_dir):
    args = [
        "generate",
        "--run",
        str(run_dir),
        "--prompt",
        "fox",
        "--seed",
        "5",
        "--top-k",
        "40",
        "--top-p",
        "0.9",
        "--max-new-tokens",
        "40",
        "--device",
        "cpu",
    ]
    first = ok(run_cli(*args, cwd=run_dir.parent)).stdout
    assert ok(run_cli(*args, cwd=run_dir.parent)).stdout == first
    assert first == expected(
        {"run": run_dir}, "fox", max_new_tokens=40, seed=5, top_k=40, top_p=0.9
    )


@pytest.mark.parametrize(
    "args, needles",
    [
        (["--run", "{tmp}/nowhere"], ["nowhere", "does not exist"]),
        (["--run", "{tmp}"], ["no checkpoint in", "--checkpoint"]),
        (["--checkpoint", "{tmp}/notes.pt"], ["notes.pt", "corrupt"]),
        (["--run", "{run}", "--temperature", "-1"], ["temperature must be a number >= 0"]),
        (["--run", "{run}", "--top-p", "2"], ["top_p must be in (0, 1]"]),
        (["--run", "{run}", "--top-k", "0"], ["top_k must be a positive"]),
        (["--run", "{run}", "--max-new-tokens", "-3"], ["max_new_tokens"]),
    ],
)
def test_bad_input_is_one_error_line(run_dir, tmp_path, args, needles):
    (tmp_path / "notes.pt").write_text("not a checkpoint")
    args = [a.format(tmp=tmp_path, run=run_dir) for a in args]
    proc = run_cli("generate", *args, "--prompt", "x", "--device", "cpu", cwd=tmp_path)
    one_error_line(proc, *needles)
    assert proc.stdout == ""


def test_an_empty_prompt_is_refused(run_dir):
    one_error_line(
        run_cli(
            "generate", "--run", str(run_dir), "--prompt", "", "--device", "cpu", cwd=run_dir.parent
        ),
        "prompt is empty",
    )


def test_a_tokenizer_json_run_and_its_missing_tokenizer_file(tmp_path):
    bpe_tokenizer_file(tmp_path, TEXT)
    run = trained_run(
        tmp_path, model={"vocab_size": 320}, data={"tokenizer": str(tmp_path / "tokenizer.json")}
    )
    args = [
        "generate",
        "--run",
        str(run),
        "--prompt",
        "the lazy",
        "--temperature",
        "0",
        "--max-new-tokens",
        "12",
        "--device",
        "cpu",
    ]
    out = ok(run_cli(*args, cwd=tmp_path)).stdout
    assert out == expected({"run": run}, "the lazy", max_new_tokens=12, temperature=0)
    (tmp_path / "tokenizer.json").unlink()
    one_error_line(run_cli(*args, cwd=tmp_path), "tokenizer.json", "does not exist")


CUSTOM_MODEL = """
from torch import nn
from speedtronic.model import causal_lm_loss
from speedtronic.registry import register_model

class Bigram(nn.Module):
    "A model without a KV cache whose forward refuses more than its window."
    def __init__(self, vocab_size, block_size, **_):
        super().__init__()
        self.max_seq_len = block_size
        self.table = nn.Embedding(vocab_size, vocab_size)

    def forward(self, input_ids, labels=None, **_):
        if input_ids.shape[1] > self.max_seq_len:
            raise ValueError(f"{input_ids.shape[1]} tokens: too long")
        logits = self.table(input_ids)
        if labels is None:
            return {"logits": logits}
        return {"logits": logits, "loss": causal_lm_loss(logits, labels)}

register_model("bigram", lambda **kw: Bigram(**kw))
"""


def test_a_model_without_a_cache_generates_past_its_window(tmp_path):
    (tmp_path / "bigram_models.py").write_text(CUSTOM_MODEL)
    run = trained_run(tmp_path, model={"name": "bigram", "imports": ["bigram_models"]})
    sys.path.insert(0, str(tmp_path))
    try:
        text = expected({"run": run}, "the quick brown fox", max_new_tokens=40, temperature=0)
    finally:
        sys.path.remove(str(tmp_path))
    assert len(text) == len("the quick brown fox") + 40 + 1  # 16-token window, 59 tokens in all
    out = ok(
        run_cli(
            "generate",
            "--run",
            str(run),
            "--prompt",
            "the quick brown fox",
            "--temperature",
            "0",
            "--max-new-tokens",
            "40",
            "--device",
            "cpu",
            cwd=tmp_path,
        )
    ).stdout
    assert out == text


@needs_v2_fixtures
def test_a_checkpoint_written_by_2_0_generates(tmp_path):
    newest = FIXTURES / "checkpoint-adamw" / "run" / "checkpoints" / "step_000000000008.pt"
    out = ok(
        run_cli(
            "generate",
            "--checkpoint",
            str(newest),
            "--prompt",
            "ab",
            "--temperature",
            "0",
            "--max-new-tokens",
            "20",
            "--device",
            "cpu",
            cwd=tmp_path,
        )
    ).stdout
    assert out == expected({"checkpoint": newest}, "ab", max_new_tokens=20, temperature=0)


@pytest.mark.parametrize(
    "fault, needles",
    [
        ("nan", ["step_", "unusable", "diverged"]),
        ("renamed", ["holds step", "as its name says"]),
    ],
)
def test_generate_and_export_refuse_a_checkpoint_no_run_would_continue_from(
    run_dir, tmp_path, fault, needles
):
    """`--checkpoint FILE` gets the checks a resume makes: a file with NaN weights, or one holding
    another step than its name."""
    files = sorted(
        (run_dir / "checkpoints").glob("step_*.pt"), key=lambda p: int(p.stem.split("_")[1])
    )
    state = torch.load(files[-1], map_location="cpu", weights_only=False)
    if fault == "nan":
        next(iter(state["model"].values())).fill_(float("nan"))
    else:
        state["step"] = state["step"] + 1
    bad = tmp_path / files[-1].name
    torch.save(state, bad)
    one_error_line(
        run_cli(
            "generate", "--checkpoint", str(bad), "--prompt", "the", "--device", "cpu", cwd=tmp_path
        ),
        *needles,
    )
    proc = run_cli("export", "--checkpoint", str(bad), "--to", str(tmp_path / "hf"), cwd=tmp_path)
    one_error_line(proc, *needles)
    assert not (tmp_path / "hf").exists()
