"""Data pipeline checks that need real files of several MB, worker processes or whole epochs.

Fast unit checks live in nbs/03_data.ipynb; these use real files, real `DataLoader` workers (fork)
and real tokenizers, no mocks.
"""

import json
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from speedtronic.data import (
    CharTokenizer,
    DataError,
    StreamStart,
    SyntheticTokenDataset,
    TextFileTokenDataset,
    TokenFileDataset,
    build_dataloader,
    infinite_batches,
    prepare_token_file,
    text_segments,
)

WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "naïve",
    "café",
    "über",
    "Straße",
    "日本語",
    "テキスト",
    "☃",
    "🚀",
    "emoji🙂",
    "Ωμέγα",
    "привет",
    "données",
    "x",
    "the",
    "of",
    "and",
]


def write_corpus(path, target_bytes, seed=0, long_lines=False):
    """A varied UTF-8 text file of about `target_bytes` with multi-byte characters and lines of many
    lengths."""
    rng = random.Random(seed)
    parts, size = [], 0
    while size < target_bytes:
        n = rng.randint(200, 20_000) if long_lines and rng.random() < 0.05 else rng.randint(0, 30)
        line = " ".join(rng.choice(WORDS) for _ in range(n)) + "\n"
        parts.append(line)
        size += len(line.encode())
    path.write_text("".join(parts), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def big_text(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("data") / "big.txt", 4 * 2**20, long_lines=True)


@pytest.fixture(scope="module")
def small_text(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("data") / "small.txt", 300_000, seed=1)


def as_lists(items):
    "Collate tagged samples into plain lists (cheap to send from a worker)."
    return [(tag, s["input_ids"].tolist() + s["labels"][-1:].tolist()) for tag, s in items]


def tagged_samples(dataset, num_workers, batch=512):
    """Every sample of one pass through a real DataLoader with `num_workers`, in the order handed
    out, with its (samples, unit, index) tag."""
    dataset._loader_start = StreamStart(tagged=True, micro=batch)
    try:
        loader = DataLoader(dataset, batch_size=batch, num_workers=num_workers, collate_fn=as_lists)
        it = iter(loader)
    finally:
        dataset._loader_start = None
    return [(tuple(int(x) for x in tag), block) for batch in it for tag, block in batch]


def test_segments_cover_file_at_safe_boundaries(big_text):
    raw = big_text.read_bytes()
    segs = text_segments(big_text)
    assert len(segs) >= 4
    assert segs[0][0] == 0 and segs[-1][1] == len(raw)
    assert all(a == b for (_, a), (b, _) in zip(segs, segs[1:]))
    for start, _ in segs[1:]:
        assert raw[start - 1 : start] == b"\n" or (raw[start] & 0xC0) != 0x80


def test_two_workers_yield_exactly_the_single_process_stream(big_text):
    ds = TextFileTokenDataset(big_text, block_size=128, segment_bytes=256 * 1024)
    single = tagged_samples(ds, 0)
    double = tagged_samples(ds, 2)
    assert len(ds.segments) >= 16
    assert len(single) > 30_000
    # the same blocks in the same order, and every block tagged with the position after its batch
    assert [b for _, b in double] == [b for _, b in single]
    assert [t for t, _ in double] == [t for t, _ in single]
    assert [t[0] for t, _ in single[511::512]] == list(range(512, len(single) + 1, 512))
    # and the blocks are the text's tokens: within a segment, consecutive blocks are consecutive
    # tokens
    raw = big_text.read_bytes()
    start, end = ds.segments[3]
    seg_blocks = [
        s["input_ids"].tolist() + s["labels"][-1:].tolist() for s in ds.unit_samples(0, 3, 0)
    ]
    joined = sum(seg_blocks, [])
    assert joined == list(raw[start : start + len(joined)])
    # the sequence: segment 0's blocks, then 1's, ...
    before = sum(len(list(ds.unit_samples(0, u, 0))) for u in range(3))
    assert [b for _, b in single[before : before + len(seg_blocks)]] == seg_blocks


def test_stream_loses_at_most_one_block_per_segment(small_text):
    ds = TextFileTokenDataset(small_text, block_size=32, segment_bytes=64 * 1024)
    tokens = sum(len(s["input_ids"]) + 1 for s in ds)
    total = len(small_text.read_bytes())
    assert total - 33 * len(ds.segments) <= tokens <= total


def _consume(loader, n, state=None):
    if state is not None:
        loader.load_state_dict(state)
    it = infinite_batches(loader)
    return [next(it) for _ in range(n)]


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert sorted(x) == sorted(y)
        for k in x:
            assert torch.equal(x[k], y[k]), k


@pytest.fixture(scope="module")
def token_file(tmp_path_factory, small_text):
    return prepare_token_file(
        small_text, tmp_path_factory.mktemp("tok") / "small.bin", progress=False
    ).path


SOURCES = {
    "synthetic-shuffled": lambda paths, w: build_dataloader(
        SimpleNamespace(
            block_size=16,
            micro_batch_size=8,
            target_batch_size=8,
            num_tokens=300,
            shuffle=True,
            seed=3,
            num_workers=w,
        ),
        vocab_size=100,
    ),
    "text": lambda paths, w: build_dataloader(
        SimpleNamespace(micro_batch_size=16, target_batch_size=16, num_workers=w, seed=0),
        dataset=TextFileTokenDataset(paths["text"], 64, segment_bytes=40_000),
    ),
    "token-file-shuffled": lambda paths, w: build_dataloader(
        SimpleNamespace(
            token_file=str(paths["tokens"]),
            block_size=64,
            micro_batch_size=16,
            target_batch_size=16,
            shuffle=True,
            seed=11,
            num_workers=w,
        ),
        vocab_size=256,
    ),
    "token-file": lambda paths, w: build_dataloader(
        SimpleNamespace(
            token_file=str(paths["tokens"]),
            block_size=128,
            micro_batch_size=8,
            target_batch_size=8,
            num_workers=w,
        ),
        vocab_size=256,
    ),
}


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("source", list(SOURCES))
def test_resume_continues_with_exactly_the_next_batches(
    source, num_workers, small_text, token_file
):
    paths = {"text": small_text, "tokens": token_file}
    make = lambda: SOURCES[source](paths, num_workers)
    probe = make()
    per_epoch = sum(1 for _ in probe)  # batches in one pass
    assert per_epoch > 10
    total = per_epoch + per_epoch // 2  # crosses one epoch boundary
    reference = _consume(make(), total)
    for k in (per_epoch // 3, per_epoch - 2, per_epoch, per_epoch + 3):
        first_run = make()
        head = _consume(first_run, k)
        _same(head, reference[:k])
        state = json.loads(json.dumps(first_run.state_dict()))  # plain data only
        batch = reference[0]["input_ids"].shape[0]
        assert (state["epoch"], state["samples"]) == (
            (0, k * batch) if k <= per_epoch else (1, (k - per_epoch) * batch)
        )
        _same(_consume(make(), total - k, state), reference[k:])
    # the second epoch of a shuffled source is a new order
    if "shuffled" in source:
        a = torch.cat([b["input_ids"] for b in reference[: per_epoch // 2]])
        b = torch.cat([b["input_ids"] for b in reference[per_epoch : per_epoch + per_epoch // 2]])
        assert not torch.equal(a, b)


@pytest.mark.parametrize("workers", [(2, 0), (0, 2)])
def test_stream_state_continues_with_another_worker_count(small_text, workers):
    make = lambda w: build_dataloader(
        SimpleNamespace(
            micro_batch_size=4,
            target_batch_size=4,
            num_workers=w,
            text_path=str(small_text),
            block_size=32,
        )
    )
    reference = _consume(make(0), 12)
    loader = make(workers[0])
    _same(_consume(loader, 5), reference[:5])
    _same(_consume(make(workers[1]), 7, loader.state_dict()), reference[5:])


def test_equal_length_batches_have_no_attention_mask(small_text):
    loader = build_dataloader(
        SimpleNamespace(
            text_path=str(small_text),
            block_size=32,
            micro_batch_size=4,
            target_batch_size=4,
            drop_last=False,
        )
    )
    batches = list(loader)
    assert all("attention_mask" not in b for b in batches[:-1])
    last = batches[-1]
    if last["input_ids"].shape[1] != 32 or len(last["input_ids"]) == 1:  # the file's tail block
        assert all(b["input_ids"].shape[1] == 32 for b in batches[:-1])


class _Boom:
    def __reduce__(self):
        import os

        return (os.mkdir, (self.target,))


def test_pickled_dataset_is_not_unpickled_without_opt_in(tmp_path):
    marker = tmp_path / "code-ran"
    boom = _Boom()
    boom.target = str(marker)
    torch.save({"payload": boom}, tmp_path / "evil.pt")
    cfg = SimpleNamespace(dataset=str(tmp_path / "evil.pt"), block_size=8)
    with pytest.raises(DataError, match="trust_pickle") as err:
        build_dataloader(cfg)
    assert "evil.pt" in str(err.value)
    assert not marker.exists()


def test_tensor_files_load_under_weights_only(tmp_path):
    ids = torch.randint(0, 50, (2000,))
    torch.save(ids, tmp_path / "ids.pt")
    loader = build_dataloader(
        SimpleNamespace(dataset=str(tmp_path / "ids.pt"), block_size=9, micro_batch_size=1),
        vocab_size=50,
    )
    got = torch.cat([torch.cat([b["input_ids"][0], b["labels"][0, -1:]]) for b in loader])
    assert torch.equal(got, ids[: len(got)]) and len(got) >= 2000 - 10
    with pytest.raises(DataError, match="model vocabulary is 10"):
        build_dataloader(
            SimpleNamespace(dataset=str(tmp_path / "ids.pt"), block_size=9), vocab_size=10
        )


def test_text_with_invalid_utf8_warns_with_offset(tmp_path):
    path = tmp_path / "mixed.txt"
    path.write_bytes(b"good text " * 20 + b"\xff\xfe" + b" more text" * 20)
    with pytest.warns(UserWarning, match=r"byte offset 200"):
        ds = TextFileTokenDataset(path, 16)
        blocks = list(ds)
    assert sum(len(b["input_ids"]) + 1 for b in blocks) == len(
        ("good text " * 20 + "\ufffd\ufffd" + " more text" * 20).encode()
    )
