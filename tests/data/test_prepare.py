"""`prepare_token_file` end to end: real text files, real Hugging Face tokenizers, memory-mapped
read-back."""

import json
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from speedtronic.data import (
    CharTokenizer,
    DataError,
    DataWarning,
    TokenFileDataset,
    build_dataloader,
    load_tokenizer,
    prepare_token_file,
)

WORDS = [
    "alpha",
    "beta",
    "gamma",
    "naïve",
    "café",
    "日本語",
    "☃",
    "🚀",
    "привет",
    "the",
    "of",
    "and",
    "data",
    "token",
]


def corpus(path, n_lines, seed=0):
    rng = random.Random(seed)
    text = "".join(
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12))) + "\n"
        for _ in range(n_lines)
    )
    path.write_text(text, encoding="utf-8")
    return text


def read_back(path, block_size=31):
    ds = TokenFileDataset(path, block_size)
    return sum((s["input_ids"].tolist() + s["labels"][-1:].tolist() for s in ds), [])


def test_byte_tokenizer_directory_round_trip(tmp_path):
    src = tmp_path / "docs"
    (src / "sub").mkdir(parents=True)
    texts = [corpus(src / "a.txt", 3000, 1), corpus(src / "sub" / "b.md", 500, 2)]
    (src / ".hidden").write_text("skip me")
    result = prepare_token_file(src, tmp_path / "out" / "train.bin", progress=False)
    expected = CharTokenizer().encode("".join(texts))
    assert read_back(result.path) == expected
    meta = json.loads((tmp_path / "out" / "train.bin.json").read_text())
    assert (
        meta["dtype"] == "uint16"
        and meta["num_tokens"] == len(expected)
        and meta["vocab_size"] == 256
    )
    assert meta["tokenizer"] == "byte" and [p.split("/")[-1] for p in meta["sources"]] == [
        "a.txt",
        "b.md",
    ]
    assert meta["format"] == "speedtronic-tokens" and meta["version"] == 1
    line = str(result)
    assert (
        "2 files" in line
        and f"{len(expected):,} tokens" in line
        and "uint16" in line
        and str(result.path) in line
    )
    assert not [p for p in (tmp_path / "out").iterdir() if ".tmp-" in p.name]


def _train_bpe(tmp_path, text, vocab_size=300):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        text.splitlines(), trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["[UNK]"])
    )
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return path, tok


def test_hf_tokenizer_large_file_round_trip(tmp_path):
    text = corpus(tmp_path / "big.txt", 60_000, 3)  # > 1 MiB: several segments
    assert len(text.encode()) > 2**20
    tok_path, tok = _train_bpe(tmp_path, text)
    result = prepare_token_file(
        tmp_path / "big.txt", tmp_path / "big.bin", tokenizer=str(tok_path), progress=False
    )
    direct = tok.encode(text, add_special_tokens=False).ids
    assert result.num_tokens == len(direct) and result.dtype == "uint16"
    assert read_back(result.path, 127) == direct
    assert result.tokenizer == str(tok_path)
    # the loader checks the file's vocabulary against the model's
    cfg = SimpleNamespace(
        token_file=str(result.path), block_size=32, micro_batch_size=2, target_batch_size=2
    )
    assert next(iter(build_dataloader(cfg, vocab_size=result.vocab_size)))["input_ids"].shape == (
        2,
        32,
    )
    with pytest.raises(DataError, match="model vocabulary is 40"):
        build_dataloader(cfg, vocab_size=40)


def test_large_vocabulary_uses_uint32(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(70_000)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "wl.json"))
    words = [f"w{i}" for i in (5, 65_535, 65_536, 69_999, 123)] * 20
    (tmp_path / "w.txt").write_text(" ".join(words) + "\n")
    result = prepare_token_file(
        tmp_path / "w.txt",
        tmp_path / "w.bin",
        tokenizer=load_tokenizer(str(tmp_path / "wl.json")),
        progress=False,
    )
    assert result.dtype == "uint32" and result.vocab_size == 70_001
    assert read_back(result.path, 7) == [int(w[1:]) + 1 for w in words]


def test_progress_line_on_stderr(tmp_path, capfd):
    corpus(tmp_path / "t.txt", 2000)
    prepare_token_file(tmp_path / "t.txt", tmp_path / "t.bin")
    err = capfd.readouterr().err
    assert "\rprepare:" in err and "100.0%" in err and err.endswith("\n")
    prepare_token_file(tmp_path / "t.txt", tmp_path / "t2.bin", progress=False)
    assert capfd.readouterr().err == ""


class _FailingTokenizer:
    "A tokenizer that breaks on its second call (a real failure during a write)."

    vocab_size, spec = 256, "failing"

    def __init__(self):
        self.calls = 0

    def encode(self, text):
        self.calls += 1
        if self.calls > 1:
            raise RuntimeError("tokenizer crashed")
        return list(text.encode())


def test_failed_prepare_keeps_the_old_file(tmp_path):
    corpus(tmp_path / "a.txt", 100)
    corpus(tmp_path / "b.txt", 100, 5)
    good = prepare_token_file(tmp_path / "a.txt", tmp_path / "out.bin", progress=False)
    before = good.path.read_bytes()
    import shutil

    (tmp_path / "src").mkdir()
    shutil.copy(tmp_path / "a.txt", tmp_path / "src")
    shutil.copy(tmp_path / "b.txt", tmp_path / "src")
    with pytest.raises(RuntimeError, match="tokenizer crashed"):
        prepare_token_file(
            tmp_path / "src", tmp_path / "out.bin", tokenizer=_FailingTokenizer(), progress=False
        )
    assert good.path.read_bytes() == before
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_bad_inputs(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        prepare_token_file(tmp_path / "none", tmp_path / "x.bin", progress=False)
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(DataError, match="no non-empty files"):
        prepare_token_file(tmp_path / "emptydir", tmp_path / "x.bin", progress=False)
    with pytest.raises(DataError, match="tokenizer file"):
        prepare_token_file(
            tmp_path / "emptydir",
            tmp_path / "x.bin",
            tokenizer=str(tmp_path / "missing.json"),
            progress=False,
        )
    (tmp_path / "bad.txt").write_bytes(b"abc\xffdef\n" * 10)
    with pytest.warns(DataWarning, match="byte offset 3"):
        result = prepare_token_file(tmp_path / "bad.txt", tmp_path / "bad.bin", progress=False)
    assert result.num_tokens == len(("abc\ufffddef\n" * 10).encode())
