"""Files that must not lie about what they are, end to end through the CLI.

A run records its `tokenizer.json` by content: another file at that path is refused by `train
--resume`, `generate` and `export` in one line naming the file and both hashes. An export replaces
the previous export in its folder whole (nothing stale beside the new model, the previous one intact
until the new one is complete), refuses a folder holding a user's files, and a push deletes from the
repository the export files the new export does not hold, in its one commit.
"""

import hashlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

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

pytest.importorskip("tokenizers")
TEXT = "the quick brown fox jumps over the lazy dog. " * 40
FIXTURES = V2_FIXTURES


def text_run(tmp: Path, *, tokenizer: bool = True, vocab: int = 320, steps: int = 4) -> Path:
    "The config of a small run on `TEXT`, trained `steps` steps by `speedtronic train`."
    (tmp / "text.txt").write_text(TEXT)
    data = {"text_path": str(tmp / "text.txt"), "synthetic": False, "block_size": 16}
    if tokenizer:
        bpe_tokenizer_file(tmp, TEXT)
        data["tokenizer"] = str(tmp / "tokenizer.json")
    config = tiny_config(
        tmp,
        max_steps=steps,
        model={"vocab_size": vocab, "n_kv_head": 2, "max_seq_len": 16},
        data=data,
    )
    ok(run_cli("train", "--config", str(config), "--device", "cpu", cwd=tmp))
    return config


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def export(run: Path, to: Path, *args: str, cwd: Path, **kw) -> subprocess.CompletedProcess:
    return run_cli("export", "--run", str(run), "--to", str(to), *args, cwd=cwd, **kw)


def contents(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() if p.is_file() else "folder" for p in sorted(folder.iterdir())}


def test_a_replaced_tokenizer_is_refused_by_resume_generate_and_export(tmp_path):
    config = text_run(tmp_path)
    tok = tmp_path / "tokenizer.json"
    trained, original = sha256(tok), tok.read_bytes()
    spec = json.loads(original)
    vocab = spec["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[-2:]  # two merged tokens trade ids: as many ids, other text
    vocab[a], vocab[b] = vocab[b], vocab[a]
    tok.write_text(json.dumps(spec))
    now = sha256(tok)
    assert now != trained
    needles = (str(tok), f"sha256 {trained}", f"sha256 {now}", "put back the tokenizer.json")
    resume_args = (
        "train",
        "--config",
        str(config),
        "--device",
        "cpu",
        "--resume",
        "--max-steps",
        "6",
    )
    resume = run_cli(*resume_args, cwd=tmp_path)
    one_error_line(resume, *needles, "start a fresh run")
    run = tmp_path / "out"
    generate = run_cli(
        "generate", "--run", str(run), "--prompt", "the", "--device", "cpu", cwd=tmp_path
    )
    one_error_line(generate, *needles)
    one_error_line(export(run, tmp_path / "llama", cwd=tmp_path), *needles)
    assert not (tmp_path / "llama").exists()
    tok.write_bytes(original)  # the file the run was trained with, put back: accepted
    ok(export(run, tmp_path / "llama", cwd=tmp_path))
    assert (tmp_path / "llama" / "tokenizer.json").read_bytes() == original
    ok(run_cli(*resume_args, cwd=tmp_path))


@needs_v2_fixtures
def test_a_2_0_checkpoint_without_a_tokenizer_hash_still_exports(tmp_path):
    newest = FIXTURES / "checkpoint-adamw" / "run" / "checkpoints" / "step_000000000008.pt"
    ok(run_cli("export", "--checkpoint", str(newest), "--to", str(tmp_path / "x"), cwd=tmp_path))
    assert (tmp_path / "x" / "config.json").is_file()


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """A run with a tokenizer.json (vocab 320) and a byte-tokenizer run of vocab 64 (exported
    without one)."""
    with_tok, byte64 = tmp_path_factory.mktemp("tok"), tmp_path_factory.mktemp("byte64")
    text_run(with_tok)
    text_run(byte64, tokenizer=False, vocab=64)
    return with_tok / "out", byte64 / "out"


def test_exporting_twice_leaves_nothing_of_the_first_export(two_runs, tmp_path):
    first, second = two_runs
    ok(export(first, tmp_path / "llama", cwd=first.parent))
    assert "tokenizer.json" in contents(tmp_path / "llama")
    ok(export(second, tmp_path / "alone", cwd=second.parent))
    ok(export(second, tmp_path / "llama", cwd=second.parent))
    assert contents(tmp_path / "llama") == contents(tmp_path / "alone")  # no tokenizer.json left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["alone", "llama"]  # no staging left


def test_a_folder_holding_a_users_files_is_refused_and_kept(two_runs, tmp_path):
    first, _ = two_runs
    ok(export(first, tmp_path / "llama", cwd=first.parent))
    before = contents(tmp_path / "llama")
    (tmp_path / "llama" / "README.md").write_text("my notes")
    (tmp_path / "llama" / "eval").mkdir()
    one_error_line(
        export(first, tmp_path / "llama", cwd=first.parent),
        str(tmp_path / "llama"),
        "README.md, eval",
        "move them out",
    )
    after = contents(tmp_path / "llama")
    assert after.pop("README.md") == b"my notes" and after.pop("eval") is not None
    assert after == before


def test_a_killed_export_leaves_the_previous_export_whole(two_runs, tmp_path):
    first, second = two_runs
    ok(export(second, tmp_path / "new", cwd=second.parent))
    new = contents(tmp_path / "new")
    ok(export(first, tmp_path / "llama", cwd=first.parent))
    old = contents(tmp_path / "llama")
    for delay in (0.5, 1.5, 2.5, 3.5, 5.0):  # kills at different moments of the export
        proc = spawn(
            [
                sys.executable,
                "-m",
                "speedtronic",
                "export",
                "--run",
                str(second),
                "--to",
                str(tmp_path / "llama"),
            ],
            cwd=second.parent,
            env=cli_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        now = contents(tmp_path / "llama")
        assert now in (old, new), sorted(now)  # one export whole, never a mix
        if now == new:  # start from the previous export again
            ok(export(first, tmp_path / "llama", cwd=first.parent))
    ok(export(second, tmp_path / "llama", cwd=second.parent))  # removes any killed staging
    assert contents(tmp_path / "llama") == new
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama", "new"]


TOKEN = "hf_export_write_token_0123456789"


def test_a_second_push_deletes_the_files_of_the_first_in_its_commit(two_runs, tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from hub_server import HUB_LIMITS, HubStandIn

    first, second = two_runs
    with HubStandIn(**HUB_LIMITS, tokens={TOKEN: "write"}) as hub:
        env = {"HF_ENDPOINT": hub.url, "HF_TOKEN": TOKEN, "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
        push = ("--push-to-hub", "org/tiny-llama")
        ok(export(first, tmp_path / "a", *push, cwd=first.parent, env=env))
        assert hub.files("org/tiny-llama") == contents(tmp_path / "a")
        hub.commit(
            hub.repos["org/tiny-llama"],
            parent=None,
            message="a user's readme",
            description="",
            added={"README.md": b"mine"},
            deleted=[],
        )
        ok(export(second, tmp_path / "b", *push, cwd=second.parent, env=env))
        repo = hub.repos["org/tiny-llama"]
        last = repo.commits[-1]
        assert sorted(last.deleted) == ["tokenizer.json", "tokenizer_config.json"]
        assert {"config.json", "model.safetensors"} <= set(last.added)  # one commit does both
        assert hub.files("org/tiny-llama") == {**contents(tmp_path / "b"), "README.md": b"mine"}
