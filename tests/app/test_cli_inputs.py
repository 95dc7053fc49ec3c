"""Bad inputs a user really types, through the real CLI in subprocesses: one clear line, exit 2,
nothing lost."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_command

ROOT = Path(__file__).resolve().parents[2]
CONSOLE = Path(sys.executable).parent / "speedtronic"


def cli(*args: str, cwd: Path, console: bool = False) -> subprocess.CompletedProcess:
    entry = (
        [str(CONSOLE)] if console and CONSOLE.exists() else [sys.executable, "-m", "speedtronic"]
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    env.pop("SPEEDTRONIC_DEBUG", None)
    return run_command(
        [*entry, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=180
    )


def one_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-1500:], proc.stderr[-1500:])
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("speedtronic: error: "), proc.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


@pytest.mark.parametrize(
    "name,content,needles",
    [
        (
            "list.yaml",
            "- run\n- model\n",
            ["list.yaml: configuration root must be a mapping", "got a list"],
        ),
        ("scalar.yaml", "hello\n", ["scalar.yaml: configuration root must be a mapping"]),
        ("tabs.yaml", "run:\n\tname: x\n", ["tabs.yaml: invalid YAML at line 2, column 1"]),
        ("binary.yaml", "\xff\xfe\x00binary", ["binary.yaml: not UTF-8 text"]),
        ("huge.yaml", "run:\n  seed: 99999999999999999999999999\n", ["run.seed", "out of range"]),
        ("list.json", "[1, 2]", ["list.json: configuration root must be a mapping"]),
    ],
)
def test_bad_config_files_give_one_line(tmp_path, name, content, needles):
    path = tmp_path / name
    path.write_bytes(content.encode("latin-1"))
    one_error(cli("validate", "--config", str(path), cwd=tmp_path), *needles)


def test_directory_empty_and_json_configs(tmp_path):
    one_error(
        cli("validate", "--config", str(tmp_path), cwd=tmp_path),
        "is a directory, not a config file",
    )
    (tmp_path / "empty.yaml").write_text("")
    assert cli("validate", "--config", "empty.yaml", cwd=tmp_path).returncode == 0
    (tmp_path / "c.json").write_text('{"run": {"name": "from-json", "max_steps": 5}}')
    proc = cli("validate", "--config", "c.json", cwd=tmp_path)
    assert (proc.returncode, proc.stderr) == (0, "") and "name: from-json" in proc.stdout


def test_duplicate_key_loads_with_one_warning_line(tmp_path):
    (tmp_path / "dup.yaml").write_text(
        "model:\n  n_layer: 8\nrun:\n  name: a\nmodel:\n  d_model: 64\n"
    )
    proc = cli("validate", "--config", "dup.yaml", cwd=tmp_path, console=True)
    # 2.0 behaviour: the last block wins
    assert proc.returncode == 0 and "n_layer: 4" in proc.stdout
    assert proc.stderr.splitlines() == [
        "speedtronic: warning: dup.yaml: key 'model' at line 5 repeats a key of the same "
        "mapping; the last value is used, remove the other one"
    ]


def test_output_dir_that_is_a_file_fails_before_training(tmp_path):
    (tmp_path / "taken").write_text("keep me\n")
    proc = cli(
        "train",
        "--config",
        str(ROOT / "configs" / "smoke.yaml"),
        "--device",
        "cpu",
        "--output-dir",
        "taken",
        cwd=tmp_path,
    )
    one_error(proc, "--output-dir: taken is a file, not a directory")
    assert "train_step" not in proc.stdout and (tmp_path / "taken").read_text() == "keep me\n"
    (tmp_path / "run.yaml").write_text("run:\n  output_dir: taken/sub\n")
    proc = cli("validate", "--deep", "--device", "cpu", "--config", "run.yaml", cwd=tmp_path)
    one_error(proc, "run.output_dir: taken/sub cannot be created because taken is a file")


def test_device_flags(tmp_path):
    smoke = str(ROOT / "configs" / "smoke.yaml")
    proc = cli("train", "--config", smoke, "--device", "", cwd=tmp_path)
    assert (
        proc.returncode == 2
        and "argument --device: must not be empty" in proc.stderr
        and "Traceback" not in proc.stderr
    )
    one_error(
        cli("train", "--config", smoke, "--device", "garbage", "--output-dir", "o", cwd=tmp_path),
        "garbage",
        "--device cpu",
    )
    assert not (tmp_path / "o").exists()


def test_prepare_refuses_to_overwrite_its_source(tmp_path):
    (tmp_path / "notes.txt").write_text("precious text\n")
    one_error(
        cli("prepare", "notes.txt", "notes.txt", cwd=tmp_path),
        "would overwrite the source 'notes.txt'",
    )
    (tmp_path / "notes.json").write_text("precious json text\n")
    one_error(cli("prepare", "notes.json", "notes", cwd=tmp_path), "sidecar notes.json")
    assert (tmp_path / "notes.txt").read_text() == "precious text\n"
    assert (tmp_path / "notes.json").read_text() == "precious json text\n"
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("abc\n")
    one_error(
        cli("prepare", "corpus", "corpus/tokens.bin", cwd=tmp_path), "inside the source directory"
    )
    assert sorted(p.name for p in (tmp_path / "corpus").iterdir()) == ["a.txt"]


def test_prepare_bad_outputs_and_sources(tmp_path):
    (tmp_path / "t.txt").write_text("some text\n")
    (tmp_path / "outdir").mkdir()
    one_error(cli("prepare", "t.txt", "outdir", cwd=tmp_path), "'outdir' is a directory")
    (tmp_path / "afile").write_text("x")
    one_error(
        cli("prepare", "t.txt", "afile/x.bin", cwd=tmp_path), "'afile' is a file, not a directory"
    )
    one_error(cli("prepare", "missing.txt", "x.bin", cwd=tmp_path), "'missing.txt' does not exist")
    (tmp_path / "empty").mkdir()
    one_error(cli("prepare", "empty", "x.bin", cwd=tmp_path), "has no non-empty files")
    proc = cli("prepare", "t.txt", "x.bin", "--vocab-size", "0", cwd=tmp_path)
    assert proc.returncode == 2 and "--vocab-size: must be a positive integer" in proc.stderr
    proc = cli("prepare", "t.txt", "new/dir/x.bin", "--no-progress", cwd=tmp_path)
    assert proc.returncode == 0 and (tmp_path / "new" / "dir" / "x.bin").is_file()
    assert sorted(p.name for p in (tmp_path / "outdir").iterdir()) == []


def test_library_warning_is_one_line(tmp_path):
    (tmp_path / "latin.txt").write_bytes(b"caf\xe9 au lait\n")
    proc = cli("prepare", "latin.txt", "x.bin", "--no-progress", cwd=tmp_path)
    assert proc.returncode == 0
    warnings = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(warnings) == 1 and warnings[0].startswith("speedtronic: warning: latin.txt:"), (
        proc.stderr
    )


def test_no_command_help_and_version(tmp_path):
    proc = cli(cwd=tmp_path)
    assert (
        proc.returncode == 2
        and "required: COMMAND" in proc.stderr
        and "Traceback" not in proc.stderr
    )
    proc = cli("--help", cwd=tmp_path, console=True)
    assert proc.returncode == 0 and all(c in proc.stdout for c in ("validate", "train", "prepare"))
    for console in (False, True):
        proc = cli("--version", cwd=tmp_path, console=console)
        assert (proc.returncode, proc.stdout.strip()) == (0, "speedtronic 2.1.0")


@pytest.mark.parametrize("name", ["bom.json", "bom.yaml"])
def test_a_config_saved_with_a_byte_order_mark_loads(tmp_path, name):
    # Windows editors save UTF-8 with a byte-order mark; JSON and YAML are read alike.
    (tmp_path / name).write_bytes(
        "\ufeff".encode() + b'{"run": {"name": "from-windows", "max_steps": 5}}\n'
    )
    proc = cli("validate", "--config", name, cwd=tmp_path)
    assert (proc.returncode, proc.stderr) == (0, ""), proc.stderr
    assert "name: from-windows" in proc.stdout


def test_prepare_refuses_to_replace_a_json_file_it_was_not_given(tmp_path):
    (tmp_path / "src.txt").write_text("some text to tokenize\n" * 20)
    (tmp_path / "out").mkdir()
    notes = tmp_path / "out" / "x.json"
    notes.write_text('{"my": "notes"}\n')
    line = one_error(
        cli("prepare", "src.txt", "out/x", "--no-progress", cwd=tmp_path), "x.json", "--overwrite"
    )
    assert "not a Speedtronic token sidecar" in line, line
    # nothing written
    assert notes.read_text() == '{"my": "notes"}\n' and not (tmp_path / "out" / "x").exists()
    proc = cli("prepare", "src.txt", "out/x", "--no-progress", "--overwrite", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert '"format": "speedtronic-tokens"' in notes.read_text()
    # its own sidecar: replaced with the file
    again = cli("prepare", "src.txt", "out/x", "--no-progress", cwd=tmp_path)
    assert again.returncode == 0, again.stderr


def test_a_text_file_saved_with_a_byte_order_mark_trains_on_its_text_only(tmp_path):
    # The mark names the encoding; it is not text: neither prepare nor a text_path dataset makes
    # tokens of it.
    import json

    import numpy as np

    from speedtronic.data import TextFileTokenDataset

    text = "a line of text from a Windows editor\n" * 4
    (tmp_path / "src.txt").write_bytes("\ufeff".encode() + text.encode())
    proc = cli("prepare", "src.txt", "tokens.bin", "--no-progress", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    meta = json.loads((tmp_path / "tokens.bin.json").read_text())
    tokens = np.fromfile(tmp_path / "tokens.bin", dtype=meta["dtype"])
    assert (meta["num_tokens"], bytes(tokens.tolist()).decode()) == (len(text), text)
    blocks = list(TextFileTokenDataset(tmp_path / "src.txt", block_size=15))
    assert bytes(blocks[0]["input_ids"][:3].tolist()) == b"a l", blocks[0]
