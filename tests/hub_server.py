"""A loopback stand-in for the Hugging Face Hub, for tests and benchmarks.

It speaks the HTTP endpoints the real `huggingface_hub` client (2.x) calls for what Speedtronic uses
— `whoami` (each token's role, `read` or `write`),
repo create/info (with the private flag), tree listing, preupload, NDJSON commits with a
`parentCommit` check (412 on conflict) and file deletions, and `resolve` downloads at a revision —
and it can inject faults: status codes (5xx, 429, ...), timeouts, dropped connections, truncated
downloads and lost commit responses. Point a client at it with
`HfApi(endpoint=server.url)` or `HF_ENDPOINT=server.url`.

    server = HubStandIn(tokens={"tok-write": "write"}).start()
    server.fault("503", method="POST", path=r"/commit/", count=2)
    server.fault("507", method="POST", path=r"/commit/", count=10**9, after=1)
    # every commit after the first: a full disk
    ...
    server.stop()

It can also answer as the real Hub does under load, each limit off unless asked for:

    HubStandIn(scale=360.0,                 # an hour of the Hub passes in 10 s
               commits_per_window=128,
               # per repository, per `commit_window` Hub seconds (an hour):
                                            #   429 "exceeded the rate limit for repository commits"
               one_commit_at_a_time=True,   # a second concurrent commit on a repository: 409
               api_per_window=1000,         # per token, per `token_window` Hub seconds (5 minutes):
               resolve_per_window=5000,     #   429 on /api/ calls and /resolve/ downloads
               head_lag=5.0)                # repo_info answers the head of 5 Hub seconds ago

`HUB_LIMITS` holds the Hub's own numbers (scale 1.0); the tests' `hub` fixture starts with them.

Every 429 carries `Retry-After` (real seconds, rounded up) and a `RateLimit` header (`t=` the
seconds until the window resets), as the Hub sends them.

`python tests/hub_server.py --port 8765` runs one in the foreground (Ctrl-C stops it).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import re
import socket
import sys
import threading
import time
import math
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

KEEP_SNAPSHOTS = 64  # revisions kept readable (older commits keep their log entry only)

# The Hub's free-tier limits, in real time (scale 1.0): what every test that uses the stand-in for
# DiLoCo meets (`HubStandIn(**HUB_LIMITS, tokens=...)`; tests/conftest.py's `hub` fixture has them).
# A test of one limit with other numbers passes its own; a test that cannot run with one limit
# replaces that one by name, with a comment saying why.
HUB_LIMITS = dict(
    commits_per_window=128,  # commits per repository per hour
    commit_window=3600.0,
    one_commit_at_a_time=True,  # a second concurrent commit on a repository: 409
    api_per_window=1000,  # /api/ calls per token per 5 minutes
    resolve_per_window=5000,  # /resolve/ downloads per token per 5 minutes
    token_window=300.0,
    head_lag=2.0,  # repo_info answers the head of 2 seconds ago (the Hub's cache)
)


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Commit:
    oid: str
    parent: str | None
    message: str
    description: str
    added: list[str]
    deleted: list[str]
    time: float


@dataclass
class Repo:
    repo_id: str
    private: bool
    head: str
    files: dict[str, bytes] = field(default_factory=dict)
    snapshots: dict[str, dict[str, bytes]] = field(default_factory=dict)
    commits: list[Commit] = field(default_factory=list)
    committing: bool = False  # a commit is being made (one at a time, when asked)

    def size(self) -> int:
        "Bytes of the files at the head revision."
        return sum(len(v) for v in self.files.values())


@dataclass
class Fault:
    kind: str  # "503" (any status code), "timeout", "drop", "truncate", "lost_response"
    method: str | None
    path: re.Pattern | None
    count: int
    delay: float
    after: int = 0  # matching requests let through before the fault starts


class HubStandIn:
    """An in-memory Hub on 127.0.0.1 (a free port unless one is given), served from a background
    thread."""

    def __init__(
        self,
        *,
        tokens: dict[str, str] | None = None,
        port: int = 0,
        commit_delay: float = 0.0,
        scale: float = 1.0,
        commits_per_window: int | None = None,
        commit_window: float = 3600.0,
        one_commit_at_a_time: bool = False,
        api_per_window: int | None = None,
        resolve_per_window: int | None = None,
        token_window: float = 300.0,
        head_lag: float = 0.0,
    ):
        self.tokens = tokens  # None: no authentication; else token -> "read" | "write"
        self.port, self.commit_delay = port, commit_delay
        if scale <= 0:
            raise ValueError(f"scale must be positive, got {scale}")
        self.scale = (
            scale  # Hub seconds per real second; the windows and the lag below are Hub seconds
        )
        self.commits_per_window, self.commit_window = commits_per_window, commit_window
        self.one_commit_at_a_time = one_commit_at_a_time
        self.per_token = {"api": api_per_window, "resolve": resolve_per_window}
        self.token_window, self.head_lag = token_window, head_lag
        self.used: Counter = Counter()  # (what, who, window index) -> answers given in that window
        # "commits" | "api" | "resolve" | "busy" -> 429s / 409s sent
        self.refusals: Counter = Counter()
        self._t0 = time.monotonic()
        self.repos: dict[str, Repo] = {}
        self.faults: list[Fault] = []
        # (method, path, status) of every request served
        self.requests: list[tuple[str, str, int]] = []
        self.lock = threading.RLock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._counter = 0

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> "HubStandIn":
        handler = type("Handler", (_Handler,), {"hub": self})
        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="hub-stand-in", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- test controls -----------------------------------------------------------------------------
    def fault(
        self,
        kind: str,
        *,
        method: str | None = None,
        path: str | None = None,
        count: int = 1,
        delay: float = 30.0,
        after: int = 0,
    ) -> None:
        """Make the next `count` matching requests fail with `kind`, once `after` matching requests
        have gone through."""
        with self.lock:
            self.faults.append(
                Fault(str(kind), method, re.compile(path) if path else None, count, delay, after)
            )

    def clear_faults(self) -> None:
        with self.lock:
            self.faults.clear()

    def create(self, repo_id: str, *, private: bool = True) -> Repo:
        "Create a repository directly (as if someone made it on the website)."
        with self.lock:
            oid = self._new_oid()
            repo = Repo(
                repo_id,
                private,
                oid,
                {},
                {oid: {}},
                [Commit(oid, None, "initial commit", "", [], [], time.time())],
            )
            self.repos[repo_id] = repo
            return repo

    def files(self, repo_id: str) -> dict[str, bytes]:
        with self.lock:
            return dict(self.repos[repo_id].files)

    def _new_oid(self) -> str:
        self._counter += 1
        return hashlib.sha1(f"commit-{self._counter}-{time.time()}".encode()).hexdigest()

    # -- the Hub's limits --------------------------------------------------------------------------
    def _window(self, hub_seconds: float) -> tuple[int, float]:
        """The current fixed window of `hub_seconds` (Hub time): its index and the real seconds left
        in it."""
        real = hub_seconds / self.scale
        elapsed = time.monotonic() - self._t0
        index = int(elapsed // real)
        return index, (index + 1) * real - elapsed

    def _limit(
        self, what: str, who: str, limit: int | None, window: float, message: str, take=True
    ) -> None:
        "Count one `what` for `who` (unless not `take`); past `limit` in the window, the Hub's 429."
        if limit is None:
            return
        with self.lock:
            index, left = self._window(window)
            key = (what, who, index)
            if self.used[key] >= limit:
                self.refusals[what] += 1
                wait = max(1, math.ceil(left))
                raise _HTTPError(
                    429,
                    message,
                    headers={
                        "Retry-After": str(wait),
                        "RateLimit": f'"{what}";r=0;t={wait}',
                        "RateLimit-Policy": f'"fixed window";"{what}";q={limit};w={round(window)}',
                    },
                )
            self.used[key] += int(take)

    def _took(self, what: str, who: str, window: float) -> None:
        "Count one `what` for `who` after the fact (a commit counts once it is made)."
        with self.lock:
            self.used[(what, who, self._window(window)[0])] += 1

    def lagged_head(self, repo: Repo) -> str:
        """The head `repo_info` answers: the newest commit at least `head_lag` Hub seconds old (a
        cache)."""
        if not self.head_lag:
            return repo.head
        with self.lock:
            cutoff = time.time() - self.head_lag / self.scale
            kept = [c for c in repo.commits if c.oid in repo.snapshots]
            old = [c for c in kept if c.time <= cutoff]
            return (old or kept)[-1 if old else 0].oid if kept else repo.head

    def _take_fault(self, method: str, path: str) -> Fault | None:
        with self.lock:
            for f in self.faults:
                if (f.method is None or f.method == method) and (
                    f.path is None or f.path.search(path)
                ):
                    if f.after > 0:
                        f.after -= 1
                        return None
                    f.count -= 1
                    if f.count <= 0:
                        self.faults.remove(f)
                    return f
        return None

    # -- repository operations ---------------------------------------------------------------------
    def commit(
        self,
        repo: Repo,
        *,
        parent: str | None,
        message: str,
        description: str,
        added: dict[str, bytes],
        deleted: list[str],
    ) -> Commit:
        with self.lock:
            if parent is not None and not repo.head.startswith(parent):
                raise _HTTPError(412, "A commit has happened since. Please refresh and try again.")
            for p in deleted:
                if p not in repo.files and not any(
                    f.startswith(p.rstrip("/") + "/") for f in repo.files
                ):
                    raise _HTTPError(
                        404, f"A file with this name doesn't exist: {p}", "EntryNotFound"
                    )
            files = dict(repo.files)
            for p in deleted:
                files.pop(p, None)
                for f in [f for f in files if f.startswith(p.rstrip("/") + "/")]:
                    files.pop(f)
            files.update(added)
            oid = self._new_oid()
            commit = Commit(
                oid, repo.head, message, description, sorted(added), sorted(deleted), time.time()
            )
            repo.commits.append(commit)
            repo.files, repo.head = files, oid
            repo.snapshots[oid] = files
            while len(repo.snapshots) > KEEP_SNAPSHOTS:
                repo.snapshots.pop(next(iter(repo.snapshots)))
            return commit

    def snapshot(self, repo: Repo, revision: str) -> tuple[str, dict[str, bytes]]:
        with self.lock:
            if revision in ("main", repo.head):
                return repo.head, repo.files
            for oid, files in repo.snapshots.items():
                if oid.startswith(revision) and len(revision) >= 7:
                    return oid, files
        raise _HTTPError(404, f"Invalid rev id: {revision}", "RevisionNotFound")


class _HTTPError(Exception):
    def __init__(
        self, status: int, message: str, code: str | None = None, headers: dict | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, headers or {}


BUSY = "Another commit operation is in progress"  # the Hub's 409 for a second concurrent commit


_ROUTES = [
    ("GET", re.compile(r"^/api/whoami-v2$"), "whoami"),
    ("POST", re.compile(r"^/api/repos/create$"), "create"),
    ("GET", re.compile(r"^/api/models$"), "models"),
    ("GET", re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/refs$"), "refs"),
    (
        "GET",
        re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)(?:/revision/(?P<rev>[^/]+))?$"),
        "info",
    ),
    (
        "GET",
        re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/tree/(?P<rev>[^/]+)(?:/(?P<path>.+))?$"),
        "tree",
    ),
    (
        "POST",
        re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/preupload/(?P<rev>[^/]+)$"),
        "preupload",
    ),
    ("POST", re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/commit/(?P<rev>[^/]+)$"), "commit"),
    ("GET", re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$"), "resolve"),
    (
        "HEAD",
        re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$"),
        "resolve",
    ),
]


class _Handler(BaseHTTPRequestHandler):
    hub: HubStandIn
    protocol_version = "HTTP/1.1"
    # a response's header and body are separate writes: with Nagle, the body waits ~40 ms for an ACK
    disable_nagle_algorithm = True

    def log_message(self, *args):
        pass

    def do_GET(self):
        self._serve("GET")

    def do_HEAD(self):
        self._serve("HEAD")

    def do_POST(self):
        self._serve("POST")

    # -- plumbing ----------------------------------------------------------------------------------
    def _serve(self, method: str) -> None:
        raw_path = urlsplit(self.path).path
        body = self._body()
        fault = self.hub._take_fault(method, raw_path)
        if fault is not None and fault.kind != "truncate" and fault.kind != "lost_response":
            return self._fail(fault, method, raw_path)
        try:
            status, headers, payload = self._route(method, raw_path, body)
        except _HTTPError as e:
            status, payload = e.status, json.dumps({"error": e.message}).encode()
            headers = {"Content-Type": "application/json", "X-Error-Message": e.message}
            if e.code:
                headers["X-Error-Code"] = e.code
            headers.update(e.headers)
        with self.hub.lock:
            self.hub.requests.append((method, raw_path, status))
        if fault is not None and fault.kind == "lost_response":
            return self._drop()
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if method == "HEAD":
            return
        if fault is not None and fault.kind == "truncate" and len(payload) > 1:
            self.wfile.write(payload[: len(payload) // 2])
            self.wfile.flush()
            return self._drop()
        self.wfile.write(payload)

    def _body(self) -> bytes:
        n = int(self.headers.get("Content-Length") or 0)
        if n:
            return self.rfile.read(n)
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = b""
            while True:
                size = int(self.rfile.readline().strip() or b"0", 16)
                if size == 0:
                    self.rfile.readline()
                    return out
                out += self.rfile.read(size)
                self.rfile.readline()
        return b""

    def _drop(self) -> None:
        self.close_connection = True
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _fail(self, fault: Fault, method: str, path: str) -> None:
        with self.hub.lock:
            self.hub.requests.append(
                (method, path, 0 if not fault.kind.isdigit() else int(fault.kind))
            )
        if fault.kind == "drop":
            return self._drop()
        if fault.kind == "timeout":
            time.sleep(fault.delay)
            return self._drop()
        status = int(fault.kind)
        text = {409: BUSY, 429: "You have exceeded the rate limit"}.get(
            status, f"injected {status}"
        )
        body = json.dumps({"error": text}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("X-Error-Message", text)
        if status == 429:
            self.send_header("Retry-After", "0")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if method != "HEAD":
            self.wfile.write(body)

    def _json(self, value, status: int = 200, headers: dict | None = None):
        return (
            status,
            {"Content-Type": "application/json", **(headers or {})},
            json.dumps(value).encode(),
        )

    # -- authentication ----------------------------------------------------------------------------
    def _access(self) -> str | None:
        "The caller's access: None (anonymous), 'read' or 'write'; 401 for an unknown token."
        hub = self.hub
        auth = self.headers.get("Authorization", "")
        token = auth[7:].strip() if auth.lower().startswith("bearer ") else None
        if hub.tokens is None:
            return "write"
        if token is None:
            return None
        if token not in hub.tokens:
            raise _HTTPError(401, "Invalid credentials in Authorization header")
        return hub.tokens[token]

    def _repo(self, repo_id: str, *, write: bool = False) -> Repo:
        access = self._access()
        repo = self.hub.repos.get(repo_id)
        if repo is None or (repo.private and access is None):
            raise _HTTPError(401 if access is None else 404, "Repository not found", "RepoNotFound")
        if write and access != "write":
            raise _HTTPError(403, "You don't have the rights to create a commit in this repository")
        return repo

    # -- endpoints ---------------------------------------------------------------------------------
    def _route(self, method: str, path: str, body: bytes):
        what = "resolve" if "/resolve/" in path else "api" if path.startswith("/api/") else None
        if what is not None:
            auth = self.headers.get("Authorization", "")
            who = auth[7:].strip() if auth.lower().startswith("bearer ") else "anonymous"
            window = self.hub.token_window
            self.hub._limit(
                what,
                who,
                self.hub.per_token[what],
                window,
                f"Too Many Requests: you have reached your '{what}' rate limit "
                f"({self.hub.per_token[what]} per {window / 60:g} minutes)",
            )
        for m, pattern, name in _ROUTES:
            match = pattern.match(path) if m == method else None
            if match:
                args = {k: unquote(v) for k, v in match.groupdict().items() if v is not None}
                return getattr(self, f"_{name}")(body=body, **args)
        raise _HTTPError(404, f"no route for {method} {path}")

    def _whoami(self, body: bytes):
        "Who the token is and its role (`read` or `write`), as the Hub's `/api/whoami-v2` says it."
        access = self._access()
        if access is None:
            raise _HTTPError(401, "Invalid user token.")
        token = {"displayName": "stand-in", "role": access}
        return self._json(
            {"type": "user", "name": "user", "auth": {"type": "access_token", "accessToken": token}}
        )

    def _create(self, body: bytes):
        if self._access() != "write":
            raise _HTTPError(401 if self._access() is None else 403, "You must use a write token")
        data = json.loads(body or b"{}")
        repo_id = f"{data.get('organization') or 'user'}/{data['name']}"
        if data.get("type", "model") != "model":
            raise _HTTPError(400, "only model repos in the stand-in")
        url = f"{self.hub.url}/{repo_id}"
        with self.hub.lock:
            if repo_id in self.hub.repos:
                return self._json({"error": "You already created this model repo", "url": url}, 409)
            self.hub.create(repo_id, private=data.get("visibility", "public") == "private")
        return self._json({"url": url, "name": repo_id})

    def _info(self, body: bytes, repo: str, rev: str = "main"):
        r = self._repo(repo)
        oid, files = self.hub.snapshot(r, self.hub.lagged_head(r) if rev == "main" else rev)
        return self._json(
            {
                "id": repo,
                "modelId": repo,
                "sha": oid,
                "private": r.private,
                "siblings": [{"rfilename": p} for p in sorted(files)],
            }
        )

    def _models(self, body: bytes):
        """`list_models(author=, search=)`: the repositories of `author` whose name holds `search`,
        each with its head as `repo_info` would answer it (the same cache), one page."""
        access = self._access()
        query = parse_qs(urlsplit(self.path).query)
        author = query.get("author", [""])[0]
        search = query.get("search", [""])[0]
        with self.hub.lock:
            repos = sorted(self.hub.repos.items())
        found = [
            {
                "id": repo_id,
                "modelId": repo_id,
                "private": r.private,
                "sha": self.hub.lagged_head(r),
            }
            for repo_id, r in repos
            if (not author or repo_id.split("/")[0] == author)
            and search in repo_id.split("/")[1]
            and (access is not None or not r.private)
        ]
        return self._json(found)

    def _refs(self, body: bytes, repo: str):
        r = self._repo(repo)
        main = {"name": "main", "ref": "refs/heads/main", "targetCommit": r.head}
        return self._json({"branches": [main], "tags": [], "converts": []})

    def _tree(self, body: bytes, repo: str, rev: str, path: str = ""):
        r = self._repo(repo)
        query = parse_qs(urlsplit(self.path).query)
        recursive = query.get("recursive", ["False"])[0].lower() == "true"
        oid, files = self.hub.snapshot(r, rev)
        prefix = path.strip("/") + "/" if path.strip("/") else ""
        inside = [p for p in sorted(files) if p.startswith(prefix)]
        if prefix and not inside:
            raise _HTTPError(404, f"{path} does not exist", "EntryNotFound")
        entries, folders = [], set()
        for p in inside:
            rest = p[len(prefix) :]
            parts = rest.split("/")
            for i in range(1, len(parts)):
                folder = prefix + "/".join(parts[:i])
                if (recursive or i == 1) and folder not in folders:
                    folders.add(folder)
                    entries.append({"type": "directory", "path": folder, "oid": oid})
            if recursive or len(parts) == 1:
                entries.append(
                    {
                        "type": "file",
                        "path": p,
                        "size": len(files[p]),
                        "oid": git_blob_sha1(files[p]),
                    }
                )
        return self._json(entries)

    def _preupload(self, body: bytes, repo: str, rev: str):
        r = self._repo(repo, write=True)
        data = json.loads(body)
        out = [
            {
                "path": f["path"],
                "uploadMode": "regular",
                "shouldIgnore": False,
                "oid": git_blob_sha1(r.files[f["path"]]) if f["path"] in r.files else None,
            }
            for f in data["files"]
        ]
        return self._json({"files": out})

    def _commit(self, body: bytes, repo: str, rev: str):
        r = self._repo(repo, write=True)
        if rev != "main":
            raise _HTTPError(400, "the stand-in commits to main only")
        header, added, deleted = {}, {}, []
        for line in body.splitlines():
            if not line.strip():
                continue
            item = json.loads(line)
            key, value = item["key"], item["value"]
            if key == "header":
                header = value
            elif key == "file":
                added[value["path"]] = base64.b64decode(value["content"])
            elif key in ("deletedFile", "deletedFolder"):
                deleted.append(value["path"])
            else:
                raise _HTTPError(400, f"the stand-in does not support commit operation {key!r}")
        hub = self.hub
        with hub.lock:
            if hub.one_commit_at_a_time and r.committing:
                hub.refusals["busy"] += 1
                raise _HTTPError(409, BUSY)
            hub._limit(
                "commits",
                repo,
                hub.commits_per_window,
                hub.commit_window,
                "You have exceeded the rate limit for repository commits "
                f"({hub.commits_per_window} per {_per(hub.commit_window)}). "
                "Upload whole folders in one commit (upload_folder) rather than file by file.",
                take=False,
            )
            r.committing = True
        try:
            if hub.commit_delay:
                time.sleep(hub.commit_delay)
            c = hub.commit(
                r,
                parent=header.get("parentCommit"),
                message=header.get("summary", ""),
                description=header.get("description", ""),
                added=added,
                deleted=deleted,
            )
        finally:
            r.committing = False
        hub._took("commits", repo, hub.commit_window)
        return self._json(
            {"commitUrl": f"{self.hub.url}/{repo}/commit/{c.oid}", "commitOid": c.oid}
        )

    def _resolve(self, body: bytes, repo: str, rev: str, path: str):
        r = self._repo(repo)
        oid, files = self.hub.snapshot(r, rev)
        if path not in files:
            raise _HTTPError(404, "Entry not found", "EntryNotFound")
        data = files[path]
        headers = {
            "Content-Type": "application/octet-stream",
            "X-Repo-Commit": oid,
            "ETag": f'"{git_blob_sha1(data)}"',
        }
        return 200, headers, data


def _per(seconds: float) -> str:
    "A window in the Hub's words: 'hour', '5 minutes', '20 seconds'."
    if seconds == 3600:
        return "hour"
    if seconds % 60 == 0:
        return f"{seconds / 60:g} minutes"
    return f"{seconds:g} seconds"


def main() -> None:
    parser = argparse.ArgumentParser(
        description="Run a loopback Hugging Face Hub stand-in in the foreground."
    )
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--token", default=None, help="require this write token")
    parser.add_argument(
        "--stop-on-stdin-eof",
        action="store_true",
        help="exit when standard input closes (its parent died)",
    )
    args = parser.parse_args()
    hub = HubStandIn(tokens={args.token: "write"} if args.token else None, port=args.port).start()
    print(f"Hub stand-in at {hub.url} (HF_ENDPOINT={hub.url})", flush=True)
    try:
        if args.stop_on_stdin_eof:
            sys.stdin.read()
        else:
            while True:
                time.sleep(3600)
    except KeyboardInterrupt:
        pass
    hub.stop()


if __name__ == "__main__":
    main()
