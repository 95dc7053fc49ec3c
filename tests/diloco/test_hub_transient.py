"""The Hub as it really behaves (issues 24 and 26): a repository takes one commit at a time (a
second writer gets 409 "Another commit operation is in progress"), allows so many commits per hour
(429 with `Retry-After` and `RateLimit`), and `repo_info` may answer a head a few seconds stale.
None of these ends a node: it waits as told, reads the head afresh and tries again, and no delta is
dropped. A token the Hub refuses (401, 403) still ends the node at once with one line.

Everything goes through the real `huggingface_hub` client against the loopback stand-in
(tests/hub_server.py) with its limits turned on, and the run below is three real `speedtronic train`
processes."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import HUB_TOKEN, ROOT, cli_env, jsonl_records, one_error_line  # noqa: E402
from conftest import run_command
from hub_server import BUSY, HUB_LIMITS, HubStandIn  # noqa: E402
from test_diloco_launch import (  # noqa: E402,F401  (corpus is a fixture)
    NODES,
    corpus,
    env_of,
    finish,
    launch,
    node_configs,
)

from speedtronic.distributed.hub import HubClient
from speedtronic.distributed.tensors import GLOBAL_METADATA_PATH, GLOBAL_MODEL_PATH
from speedtronic.distributed.transport import HubError, PublishConflict

TOKEN, READ = "hf_transient_write_0123456789", "hf_transient_read_0123456789"


def client(hub: HubStandIn, repo: str, token: str = TOKEN, **kw) -> HubClient:
    "A `HubClient` on the stand-in with short backoffs: two attempts unless told otherwise."
    kw = {"retry_initial": 0.01, "retry_max": 0.05, "retry_attempts": 2, **kw}
    return HubClient(repo, token=token, endpoint=hub.url, **kw)


def statuses(hub: HubStandIn, fragment: str) -> list[int]:
    "The status of every request whose path holds `fragment`, in order."
    return [status for _, path, status in hub.requests if fragment in path]


@pytest.fixture
def files(tmp_path) -> dict[str, Path]:
    out = {}
    for name in ("a", "b", "c"):
        out[name] = tmp_path / f"{name}.bin"
        out[name].write_bytes(name.encode() * 100)
    return out


# -- a worker's delta commit -----------------------------------------------------------------------
def test_a_delta_commit_answered_409_then_429_is_sent_late_not_dropped(files):
    """Two 409s (another commit in progress), then the repository's commit limit: the commit is
    made, once."""
    # 2 commits per Hub hour, an hour lasting 3 real seconds: the third commit must wait ~3 s for
    # the next window, far longer than the client's own backoff (two attempts, 0.01 s apart) would
    # allow
    with HubStandIn(tokens={TOKEN: "write"}, scale=1200.0, commits_per_window=2) as hub:
        hub.create("org/run")
        worker = client(hub, "org/run")
        worker.upload({"nodes/w1/delta_10.safetensors": files["a"]})
        hub.fault("409", method="POST", path=r"/commit/", count=1)
        worker.upload({"nodes/w1/delta_20.safetensors": files["b"]})  # 409 once, then made
        hub.fault("409", method="POST", path=r"/commit/", count=1)
        worker.upload({"nodes/w1/delta_30.safetensors": files["c"]})  # 409, then 429 past the limit
        commits = statuses(hub, "/commit/")
        assert commits.count(409) == 2 and commits.count(429) >= 1, commits
        assert hub.refusals["commits"] >= 1
        assert sorted(hub.files("org/run")) == [
            f"nodes/w1/delta_{s}.safetensors" for s in (10, 20, 30)
        ]
        added = Counter(p for c in hub.repos["org/run"].commits for p in c.added)
        assert set(added.values()) == {1}  # each delta committed exactly once
        assert worker.counts.commits == 3


def test_a_429_says_when_to_come_back_as_the_hub_does(files):
    """The stand-in's 429: the Hub's text, `Retry-After` and `RateLimit`; the client reads the wait
    from them."""
    from huggingface_hub.errors import HfHubHTTPError

    from speedtronic.distributed.hub import _told, classify_hub_error

    with HubStandIn(tokens={TOKEN: "write"}, scale=1.0, commits_per_window=1) as hub:
        hub.create("org/run")
        client(hub, "org/run").upload({"nodes/w1/delta_10.safetensors": files["a"]})
        from huggingface_hub import CommitOperationAdd, HfApi

        api = HfApi(endpoint=hub.url, token=TOKEN)
        op = CommitOperationAdd("nodes/w1/delta_20.safetensors", str(files["b"]))
        with pytest.raises(HfHubHTTPError) as caught:  # huggingface_hub does not wait on a commit
            api.create_commit("org/run", [op], commit_message="second")
        answer = caught.value.response
        assert answer.status_code == 429
        assert "exceeded the rate limit for repository commits (1 per hour)" in str(caught.value)
        assert 3500 <= int(answer.headers["Retry-After"]) <= 3600
        assert classify_hub_error(caught.value) == "transient"
        assert _told(caught.value) == float(answer.headers["Retry-After"])


def test_a_commit_while_another_is_in_progress_gets_409(files):
    "One commit at a time per repository: a second writer during a slow commit gets the Hub's 409."
    import threading

    from huggingface_hub import CommitOperationAdd, HfApi
    from huggingface_hub.errors import HfHubHTTPError

    with HubStandIn(tokens={TOKEN: "write"}, one_commit_at_a_time=True, commit_delay=1.0) as hub:
        hub.create("org/run")
        api = HfApi(endpoint=hub.url, token=TOKEN)
        slow = threading.Thread(
            target=api.create_commit,
            args=("org/run", [CommitOperationAdd("a.bin", str(files["a"]))]),
            kwargs={"commit_message": "slow"},
        )
        slow.start()
        while not hub.repos["org/run"].committing:
            threading.Event().wait(0.01)
        with pytest.raises(HfHubHTTPError) as caught:
            api.create_commit(
                "org/run", [CommitOperationAdd("b.bin", str(files["b"]))], commit_message="second"
            )
        slow.join()
        assert caught.value.response.status_code == 409 and BUSY in str(caught.value)
        assert sorted(hub.files("org/run")) == ["a.bin"]


def test_per_token_api_and_download_windows_answer_429(files):
    "API calls and `/resolve/` downloads are counted per token per window; past the limit, 429."
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    with HubStandIn(tokens={TOKEN: "write", READ: "read"}, api_per_window=3) as hub:
        hub.create("org/run")
        reader, writer = HfApi(endpoint=hub.url, token=READ), HfApi(endpoint=hub.url, token=TOKEN)
        for _ in range(3):
            reader.list_repo_refs("org/run")
        with pytest.raises(HfHubHTTPError) as caught:
            reader.list_repo_refs("org/run")
        assert caught.value.response.status_code == 429
        assert "'api' rate limit (3 per 5 minutes)" in str(caught.value)
        assert caught.value.response.headers["RateLimit"].startswith('"api";r=0;t=')
        writer.list_repo_refs("org/run")  # another token has its own window


# -- the tests' stand-in ---------------------------------------------------------------------------
def test_the_hub_fixture_answers_with_the_hubs_limits_on(hub, files):
    """The `hub` fixture every Hub test uses is the Hub under its limits: a commit while another is
    in progress gets 409, and the 129th commit on a repository within the hour gets 429 with the
    Hub's text and a wait until the hour ends."""
    import threading

    from huggingface_hub import CommitOperationAdd, HfApi
    from huggingface_hub.errors import HfHubHTTPError

    hub.create("org/run")
    api = HfApi(endpoint=hub.url, token=HUB_TOKEN)

    def commit(name: str, results: list) -> None:
        try:
            api.create_commit("org/run", [CommitOperationAdd(name, b"x")], commit_message=name)
            results.append(200)
        except HfHubHTTPError as e:
            results.append(e.response.status_code)

    hub.commit_delay = 0.5  # a commit as slow as the Hub's: the second one comes during it
    slow, second = [], []
    first = threading.Thread(target=commit, args=("a.bin", slow))
    first.start()
    while first.is_alive() and not hub.repos["org/run"].committing:
        threading.Event().wait(0.01)
    commit("b.bin", second)
    first.join()
    assert (slow, second) == ([200], [409]), (slow, second)
    assert hub.refusals["busy"] == 1
    hub.commit_delay = 0.0
    made = [200]
    for n in range(127):  # 128 commits in all
        commit(f"c{n}.bin", made)
    assert made == [200] * 128, Counter(made)
    with pytest.raises(HfHubHTTPError) as caught:
        api.create_commit("org/run", [CommitOperationAdd("late.bin", b"x")], commit_message="late")
    answer = caught.value.response
    assert answer.status_code == 429 and hub.refusals["commits"] == 1
    assert "exceeded the rate limit for repository commits (128 per hour)" in str(caught.value)
    assert 3000 <= int(answer.headers["Retry-After"]) <= 3600
    assert len(hub.repos["org/run"].commits) == 1 + 128  # the initial commit and the 128


# -- the master's publication ----------------------------------------------------------------------
def test_a_publish_on_a_stale_head_retries_on_a_fresh_head(files):
    """repo_info answers a head an hour (of Hub time) old: a 412 is followed by a fresh read, and
    the retry lands."""
    with HubStandIn(tokens={TOKEN: "write"}, head_lag=3600.0) as hub:
        hub.create("org/run")
        master, worker = client(hub, "org/run"), client(hub, "org/run")
        first = master.state()
        master.publish({"global/x.bin": files["a"]}, [], parent=first, owner="m")
        # moves the head under the master
        worker.upload({"nodes/w1/delta_10.safetensors": files["b"]})
        # the master's parent is its own publication: now stale
        with pytest.raises(PublishConflict):
            master.publish(
                {"global/x.bin": files["b"]},
                [],
                parent=master.state(hub.repos["org/run"].commits[1].oid),
                owner="m",
            )
        fresh = master.state()  # what the master loop reads after a conflict
        assert fresh.revision == hub.repos["org/run"].head
        assert master.head_revision() == hub.repos["org/run"].head
        master.publish(
            {"global/x.bin": files["c"]}, ["nodes/w1/delta_10.safetensors"], parent=fresh, owner="m"
        )
        assert hub.files("org/run") == {"global/x.bin": files["c"].read_bytes()}
        # the stand-in's repo_info still answers the stale head: the client did not read it
        from huggingface_hub import HfApi

        stale = HfApi(endpoint=hub.url, token=TOKEN).repo_info("org/run").sha
        assert stale != hub.repos["org/run"].head


# -- refusals stay fatal ---------------------------------------------------------------------------
def test_a_token_the_hub_refuses_still_ends_at_once_with_one_line(files):
    """403 (a read token committing) and 401 (an unknown token) are fatal: no wait, one line, no
    token in it."""
    with HubStandIn(**HUB_LIMITS, tokens={TOKEN: "write", READ: "read"}) as hub:
        hub.create("org/run")
        reader = client(hub, "org/run", token=READ, retry_attempts=6, retry_initial=30.0)
        with pytest.raises(HubError) as caught:
            reader.upload({"nodes/w1/delta_10.safetensors": files["a"]})
        text = str(caught.value)
        assert "HTTP 403" in text and "write access" in text and READ not in text
        assert len(text.splitlines()) == 1
        assert statuses(hub, "/commit/") + statuses(hub, "/preupload/") == [403]
        with pytest.raises(HubError, match="HTTP 401, the token is missing, invalid or expired"):
            client(hub, "org/run", token="hf_unknown_token_000").state()


def test_a_worker_with_an_unknown_token_exits_2_with_one_line(tmp_path, corpus):
    "The CLI: a worker whose token the Hub does not know stops with exit 2 and one error line."
    with HubStandIn(**HUB_LIMITS, tokens={TOKEN: "write"}) as hub:
        hub.create("org/run")
        _, cfg = node_configs(tmp_path, corpus, "org/run", None)["worker1"]
        proc = run_command(
            [sys.executable, "-m", "speedtronic", "train", "--config", str(cfg)],
            cwd=ROOT,
            env=cli_env(HF_ENDPOINT=hub.url, HF_TOKEN="hf_unknown_token_000"),
            capture_output=True,
            text=True,
            timeout=300,
        )
        one_error_line(proc, "HTTP 401", "org/run")
        assert "hf_unknown_token_000" not in proc.stdout + proc.stderr


# -- a whole run through the Hub's limits ----------------------------------------------------------
STEPS, INNER = 30, 10


def test_a_small_run_through_a_tight_commit_limit_folds_every_delta(tmp_path, corpus):
    """Master + 2 workers, 30 steps in rounds of 10, through a stand-in where an hour lasts 4 s: 2
    commits per repository per hour, one commit at a time (each takes 0.2 s), and repo_info an hour
    stale. Every node exits 0 and every delta a node uploaded is folded exactly once
    (distributed.expected_nodes: 3)."""
    hub = HubStandIn(
        tokens={TOKEN: "write"},
        scale=900.0,
        commits_per_window=2,
        one_commit_at_a_time=True,
        commit_delay=0.2,
        head_lag=3600.0,
    ).start()
    try:
        repo = "org/limited"
        configs = node_configs(tmp_path, corpus, repo, None)
        for name, (raw, path) in configs.items():
            raw["run"]["max_steps"] = STEPS
            raw["distributed"]["inner_steps"] = INNER
            # the master waits for all three: a worker whose first commit waits out the limit is
            # not a worker that never came (the launch race itself is test_diloco_launch's)
            raw["distributed"]["expected_nodes"] = len(NODES)
            path.write_text(yaml.safe_dump(raw, sort_keys=False))
        env = env_of(HF_ENDPOINT=hub.url, HF_TOKEN=TOKEN)
        finish({name: launch(configs[name][1], env) for name in NODES}, tmp_path)
        files = hub.files(repo)
        commits = hub.repos[repo].commits
        refusals = dict(hub.refusals)
    finally:
        hub.stop()
    assert sorted(files) == [GLOBAL_MODEL_PATH, GLOBAL_METADATA_PATH]
    uploaded = {
        (n, e["step"])
        for n in NODES
        for e in jsonl_records(tmp_path / n / "metrics.jsonl", "delta_uploaded")
    }
    folded = Counter(
        tuple(x)
        for e in jsonl_records(tmp_path / "master" / "metrics.jsonl", "outer_step")
        for x in e.get("folded", [])
    )
    assert set(folded.values()) == {1}, folded  # none twice
    assert set(folded) == uploaded, (sorted(uploaded - set(folded)), sorted(set(folded) - uploaded))
    for name in NODES:
        assert max(s for n, s in uploaded if n == name) == STEPS, (name, sorted(uploaded))
    added = Counter(p for c in commits for p in c.added if p.startswith("nodes/"))
    assert set(added.values()) == {1}  # each delta committed once
    ledger = json.loads(files[GLOBAL_METADATA_PATH])["ledger"]
    assert {n: list(ledger[n]["sessions"].values()) for n in NODES} == {n: [STEPS] for n in NODES}
    print(f"refusals met by the run: {refusals}")
    assert refusals.get("commits", 0) > 0  # the limit was met, and waited out
