"""A broken line or bytes that are not UTF-8 in a local `data.hf_dataset` file: one error line
naming the file, the line or byte offset, and the fix (issue 24); `train` run as a user runs it."""

from pathlib import Path

import pytest

from conftest import one_error_line, run_cli, tiny_config

pytest.importorskip("datasets")
ROWS = [f'{{"text": "row {i} of the quick brown fox"}}\n' for i in range(40)]


def train(tmp: Path, data: Path, streaming: bool = False):
    hf = {"path": str(data), "streaming": streaming}
    config = tiny_config(tmp, data={"hf_dataset": hf, "synthetic": False, "block_size": 16})
    return run_cli("train", "--config", str(config), "--device", "cpu", cwd=tmp)


@pytest.mark.parametrize("streaming", [False, True])
def test_a_broken_json_line_is_named_with_its_file_and_number(tmp_path, streaming):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(ROWS[:7] + ['{"text": "cut off\n'] + ROWS[7:]))
    line = one_error_line(train(tmp_path, data, streaming), str(data), "line 8", "not valid JSON")
    assert "fix or remove that line" in line


@pytest.mark.parametrize("suffix", [".jsonl", ".txt"])
@pytest.mark.parametrize("streaming", [False, True])
def test_bytes_that_are_not_utf8_are_named_with_their_offset_and_the_fix(
    tmp_path, suffix, streaming
):
    data = tmp_path / f"rows{suffix}"
    head = "".join(ROWS[:3]).encode() if suffix == ".jsonl" else b"plain text line\n" * 3
    body = b'{"text": "caf\xe9"}\n' if suffix == ".jsonl" else b"caf\xe9\n"
    data.write_bytes(head + body + ("".join(ROWS[3:]).encode() if suffix == ".jsonl" else head))
    offset = len(head) + body.index(b"\xe9")
    line = one_error_line(
        train(tmp_path, data, streaming), str(data), f"byte offset {offset}", "line 4"
    )
    assert "re-encode the file as UTF-8" in line


def test_a_tiny_holdout_fraction_is_not_told_to_go_lower():
    import numpy as np

    from speedtronic.data import DataError, TokenArrayDataset
    from speedtronic.evaluation import holdout_split

    one_block = TokenArrayDataset(np.arange(17), 16, name="tokens")
    with pytest.raises(DataError) as e:
        holdout_split(one_block, 0.0001)
    assert "lower eval.holdout_fraction" not in str(e.value)
    assert "at least one block is held out" in str(e.value) and "use more data" in str(e.value)
