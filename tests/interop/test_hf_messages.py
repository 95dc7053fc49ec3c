"""Messages of `init_from`, `generate --checkpoint` and `export --push-to-hub` that name the file,
key or Hub answer and the fix (issue 24): real CLI subprocesses, real files, the real
`huggingface_hub` client against the loopback Hub stand-in."""

import json
import sys
from pathlib import Path

import pytest

from conftest import (
    ROOT,
    V2_FIXTURES,
    free_port,
    needs_v2_fixtures,
    one_error_line,
    run_cli,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hub_server import HUB_LIMITS, HubStandIn, _Handler  # noqa: E402

FIXTURES = V2_FIXTURES or Path("shared/fixtures/v2.0")  # a path that is missing when they are
CHECKPOINT = FIXTURES / "checkpoint-adamw" / "run" / "checkpoints" / "step_000000000008.pt"
TOKEN = "hf_messages_write_token_0123456789"
needs_fixture = needs_v2_fixtures


class _DeletingHandler(_Handler):
    "The stand-in's handler plus the Hub's `DELETE /api/repos/delete` (which the stand-in lacks)."

    def do_DELETE(self):
        body = json.loads(self._body() or b"{}")
        repo_id = f"{body.get('organization') or 'user'}/{body['name']}"
        with self.hub.lock:
            found = self.hub.repos.pop(repo_id, None) is not None
            self.hub.requests.append(("DELETE", repo_id, 200 if found else 404))
        self.send_response(200 if found else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()


class Hub(HubStandIn):
    "The loopback Hub stand-in, able to delete a repository as the Hub can."

    def start(self) -> "Hub":
        super().start()
        self._server.RequestHandlerClass = type("Handler", (_DeletingHandler,), {"hub": self})
        return self


def push(tmp: Path, endpoint: str, repo: str = "org/tiny"):
    return run_cli(
        "export",
        "--checkpoint",
        str(CHECKPOINT),
        "--to",
        str(tmp / "export"),
        "--push-to-hub",
        repo,
        cwd=tmp,
        env={"HF_ENDPOINT": endpoint, "HF_TOKEN": TOKEN, "HF_HUB_DISABLE_PROGRESS_BARS": "1"},
    )


@needs_fixture
def test_a_push_to_an_unreachable_hub_is_one_line(tmp_path):
    port = free_port()  # nothing listens there
    line = one_error_line(push(tmp_path, f"http://127.0.0.1:{port}"), "org/tiny", "reached")
    assert f"127.0.0.1:{port}" in line and "HF_ENDPOINT" in line
    assert (tmp_path / "export" / "config.json").is_file()  # the export itself stays


@needs_fixture
def test_a_dropped_connection_is_one_line_and_the_repo_it_made_is_deleted(tmp_path):
    with Hub(**HUB_LIMITS, tokens={TOKEN: "write"}) as hub:
        hub.fault("drop", method="POST", path=r"/commit/", count=10**9)
        line = one_error_line(push(tmp_path, hub.url), "org/tiny", "dropped the connection")
        assert "was deleted" in line and "org/tiny" not in hub.repos


@needs_fixture
def test_a_5xx_says_what_the_hub_answered_and_deletes_the_empty_repo(tmp_path):
    with Hub(**HUB_LIMITS, tokens={TOKEN: "write"}) as hub:
        hub.fault("503", method="POST", path=r"/commit/", count=10**9)
        line = one_error_line(push(tmp_path, hub.url), "HTTP 503", "injected 503", "/commit/")
        assert "network" not in line and "was deleted" in line
        assert "org/tiny" not in hub.repos


@needs_fixture
def test_a_failed_push_to_an_existing_repo_leaves_it_alone(tmp_path):
    with Hub(**HUB_LIMITS, tokens={TOKEN: "write"}) as hub:
        repo = hub.create("org/tiny")
        hub.commit(
            repo, parent=None, message="mine", description="", added={"README.md": b"x"}, deleted=[]
        )
        hub.fault("500", method="POST", path=r"/commit/", count=10**9)
        line = one_error_line(push(tmp_path, hub.url), "HTTP 500")
        assert "deleted" not in line and hub.files("org/tiny") == {"README.md": b"x"}


# -- generate --checkpoint: weights that do not fit the configuration they carry -------------------


@needs_fixture
def test_a_weights_config_mismatch_names_the_tensor_and_the_key(tmp_path):
    import torch

    state = torch.load(CHECKPOINT, map_location="cpu", weights_only=False)
    state["config"]["model"]["d_model"] = 48  # the weights were trained at 32
    torch.save(state, tmp_path / "step_000000000008.pt")
    proc = run_cli(
        "generate",
        "--checkpoint",
        str(tmp_path / "step_000000000008.pt"),
        "--prompt",
        "a",
        "--max-new-tokens",
        "2",
        "--device",
        "cpu",
        cwd=tmp_path,
    )
    line = one_error_line(proc, str(tmp_path / "step_000000000008.pt"), "model.d_model: 48")
    assert "[64, 32]" in line and "[64, 48]" in line and "check model.imports" not in line


# -- model.init_from: a sharded folder's index -----------------------------------------------


@pytest.mark.parametrize(
    "index, needles",
    [
        ({"metadata": {}}, ["has no 'weight_map'"]),
        ({"weight_map": {"lm": "model-00002-of-00002.safetensors"}}, ["absent", "00002"]),
        ({"weight_map": {"lm": "../outside.safetensors"}}, ["not a file directly in"]),
        ("{not json", ["is not valid JSON"]),
    ],
)
def test_a_malformed_safetensors_index_names_the_file_and_the_fault(tmp_path, index, needles):
    pytest.importorskip("transformers")
    import yaml
    from test_hf import init_config, llama_folder

    folder = llama_folder(tmp_path / "llama")
    shard = folder / "model-00001-of-00001.safetensors"
    (folder / "model.safetensors").rename(shard)
    (tmp_path / "outside.safetensors").write_bytes(shard.read_bytes())
    text = index if isinstance(index, str) else json.dumps(index)
    (folder / "model.safetensors.index.json").write_text(text)
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(init_config(tmp_path, folder)))
    proc = run_cli("train", "--config", str(tmp_path / "cfg.yaml"), "--device", "cpu", cwd=tmp_path)
    index_path = str(folder / "model.safetensors.index.json")
    one_error_line(proc, "model.init_from", index_path, *needles)
    assert not list((tmp_path / "out").glob("**/step_*.pt"))
