"""A worker on a transport that offers only 2.0's transport calls
(`../shared/spec/distributed-v2.md` §3: `global_metadata`, `download_global`, `upload_delta`,
`read_json`, `upload(local, remote)`, …), one of them with a `state` attribute that is a dict, as
2.0's test hubs kept the state they hand out. The worker joins the run, sends its deltas and
installs the master's global through those calls; the master is a real one on the same folder
through a `SharedDirectory`."""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from speedtronic.distributed import MasterOuterLoop, SharedDirectory
from speedtronic.distributed.tensors import GlobalMetadata, read_metadata
from speedtronic.distributed.transport import RetryPolicy
from test_master_passes import worker_node

STEP_COUNT, WEIGHTS = "global/step_count.json", "global/latest.safetensors"


class V2Folder:
    """2.0's `HubClient` calls over a local folder, nothing of ours subclassed or wrapped; each call
    counted in `calls`."""

    def __init__(self, root: Path, state_attribute: bool):
        self.root, self.repo_id, self.calls = Path(root), str(root), Counter()
        self.cache = self.root.parent / "v2-cache"
        if state_attribute:
            self.state = {"weight": torch.zeros(3, 4)}  # what a 2.0 test hub handed out

    def _count(self, name: str) -> None:
        self.calls[name] += 1

    def create_repo(self, private: bool = True) -> None:
        self._count("create_repo")
        self.root.mkdir(parents=True, exist_ok=True)

    def add_collaborator(self, user: str, permission: str = "write") -> None:
        self._count("add_collaborator")

    def list_files(self) -> list[str]:
        self._count("list_files")
        return sorted(
            p.relative_to(self.root).as_posix() for p in self.root.rglob("*") if p.is_file()
        )

    def file_exists(self, path: str) -> bool:
        return path in self.list_files()

    def upload(self, local, remote: str) -> None:
        self._count("upload")
        dest = self.root / remote
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(local, dest.with_name(dest.name + ".tmp"))
        os.replace(dest.with_name(dest.name + ".tmp"), dest)  # one commit: whole or not at all

    def download(self, remote: str, local=None) -> Path:
        self._count("download")
        dest = Path(local) if local is not None else self.cache / "downloads" / remote
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(self.root / remote, dest)
        return dest

    def read_json(self, remote: str, default=None):
        self._count("read_json")
        if not self.file_exists(remote):
            return default
        return json.loads(self.download(remote, self.cache / "json" / remote).read_text())

    def write_json(self, remote: str, value) -> None:
        out = self.cache / "outgoing" / remote
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")
        self.upload(out, remote)

    def global_metadata(self) -> GlobalMetadata | None:
        self._count("global_metadata")
        data = self.read_json(STEP_COUNT)
        return None if data is None else GlobalMetadata.from_dict(data)

    def download_global(self, local_path, metadata: GlobalMetadata | None = None) -> Path:
        self._count("download_global")
        metadata = metadata or self.global_metadata()
        return self.download(metadata.model_file if metadata else WEIGHTS, local_path)

    def publish_global(self, state, *, outer_step, work_dir=None, updated_at=None, **kw):
        raise AssertionError("a worker never publishes")

    def upload_delta(
        self, state, *, node_id, local_step, base_outer_step, work_dir=None, metadata=None
    ) -> str:
        self._count("upload_delta")
        header = {
            "node_id": node_id,
            "local_step": str(int(local_step)),
            "base_outer_step": str(int(base_outer_step)),
            **{k: str(v) for k, v in (metadata or {}).items()},
        }
        local = (
            Path(work_dir or self.cache / "outgoing") / f"{node_id}_delta_{local_step}.safetensors"
        )
        local.parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in state.items()}, str(local), metadata=header)
        remote = f"nodes/{node_id}/delta_{local_step}.safetensors"
        self.upload(local, remote)
        return remote

    def delta_paths(self) -> list[str]:
        return [
            p for p in self.list_files() if p.startswith("nodes/") and p.endswith(".safetensors")
        ]


@pytest.mark.parametrize("state_attribute", [True, False], ids=["state-is-a-dict", "no-state"])
def test_a_worker_on_a_transport_of_2_0s_calls_joins_sends_and_installs(tmp_path, state_attribute):
    """Start, two rounds, the final delta: through `read_json`/`global_metadata`,
    `download_global` and `upload_delta` only, each delta carrying the node's own header."""
    repo = tmp_path / "repo"
    model = torch.nn.Linear(4, 3)
    directory = SharedDirectory(repo, retry=RetryPolicy(0.001, 0.01, 2))
    directory.open(create=True)
    m = MasterOuterLoop(
        directory,
        model.state_dict(),
        node_state_dir=tmp_path / "m-state",
        node_id="m",
        inner_steps=2,
        poll_interval=0.01,
    )
    assert m.start_master().outer_step == 0
    hub = V2Folder(repo, state_attribute)
    worker = worker_node(repo, tmp_path / "w-state", model, hub=hub, async_global_poll=False)
    worker.set_target(4)
    worker.start()
    try:
        assert worker.state.version == 0 and worker.state.run_id == m.state.run_id
        for step in (1, 2):
            with torch.no_grad():
                model.weight.add_(1e-3)
            worker.after_optimizer_step(model, step)
        header = read_metadata(repo / "nodes/w/delta_2.safetensors")
        assert header["session"] == worker.state.session and header["inner_steps"] == "2"
        assert set(load_file(str(repo / "nodes/w/delta_2.safetensors"))) == {"weight", "bias"}
        assert m.sync_once(full_rounds=False) == 1
        for step in (3, 4):
            with torch.no_grad():
                model.weight.add_(1e-3)
            worker.after_optimizer_step(model, step)
        assert worker.state.version == 1  # installed at the boundary of step 4
        torch.testing.assert_close(
            worker.state.base["bias"], load_file(str(repo / WEIGHTS))["bias"]
        )
        assert read_metadata(repo / "nodes/w/delta_4.safetensors").get("final") == "true"
        assert m.finish(4, timeout=60.0, interval=0.01) == 2
    finally:
        worker.stop()
        m.stop()
    assert m.ledger.nodes["w"]["final"]
    assert m.ledger.nodes["w"]["sessions"] == {worker.state.session: 4}
    assert hub.calls["upload_delta"] == 2 and hub.calls["download_global"] >= 2
    if state_attribute:
        assert set(hub.state) == {"weight"}  # the attribute is left as it was
