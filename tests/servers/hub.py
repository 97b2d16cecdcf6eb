"""A small Hugging Face Hub on loopback, speaking exactly what `huggingface_hub` calls to push and to
download with HF_HUB_DISABLE_XET=1.

Push: POST /api/repos/create, POST /api/validate-yaml, POST /api/{type}s/{repo}/branch/{name},
POST /api/{type}s/{repo}/preupload/{rev}, POST /{prefix}{repo}.git/info/lfs/objects/batch,
PUT /lfs/upload/{oid}, POST /lfs/verify/{oid}, and the ndjson POST /api/{type}s/{repo}/commit/{rev}.
Download: GET /api/{type}s/{repo}[/revision/{rev}], GET /api/{type}s/{repo}/tree/{rev}[/{path}],
HEAD/GET /{prefix}{repo}/resolve/{rev}/{path} (with ranges).

State lives in memory: repos (branches pointing at commits, each commit a full tree) and LFS blobs by
sha256. Writes need `write_token`; `read_token` gets 403 on writes; no or another token gets 401.
`configure_faults(...)` fails a seeded share of requests (503, dropped connections, truncated GET
bodies), optionally only on paths containing given substrings; `log` records every request.
"""

from __future__ import annotations

import base64
import hashlib
import json
import random
import re
import socket
import struct
import threading
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

WRITE_TOKEN = "hf_testwritetoken0123456789abcdef"
READ_TOKEN = "hf_testreadtoken0123456789abcdef"

GITATTRIBUTES = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n*.bin filter=lfs diff=lfs merge=lfs -text\n"
_TYPES = {"models": "model", "datasets": "dataset", "spaces": "space"}
_PREFIX = {"model": "", "dataset": "datasets/", "space": "spaces/"}
_LFS_THRESHOLD = 64 * 1024


def git_blob_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass(frozen=True)
class StoredFile:
    size: int
    sha256: str
    git_oid: str
    lfs: bool


@dataclass
class Repo:
    repo_type: str
    repo_id: str
    private: bool
    branches: dict[str, str] = field(default_factory=dict)
    commits: dict[str, dict[str, StoredFile]] = field(default_factory=dict)
    commit_count: int = 0


@dataclass
class Faults:
    rate: float = 0.0
    kinds: tuple[str, ...] = ("503", "reset", "truncate")
    seed: int = 0
    max_faults: int | None = None
    only_paths: tuple[str, ...] = ()


class HubServer:
    """`HubServer().start()`; `url` is the endpoint to give `HfApi`."""

    def __init__(self) -> None:
        self.repos: dict[tuple[str, str], Repo] = {}
        self.blobs: dict[str, bytes] = {}
        self.lock = threading.Lock()
        self.log: list[tuple[str, str, int | str]] = []
        self.faults = Faults()
        self.fault_counts: Counter = Counter()
        self._rng = random.Random(0)
        hub = self

        class Handler(_Handler):
            server_state = hub

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def start(self) -> HubServer:
        threading.Thread(target=self._httpd.serve_forever, name="hubserver", daemon=True).start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def reset(self) -> None:
        with self.lock:
            self.repos.clear()
            self.blobs.clear()
            self.log.clear()
            self.fault_counts.clear()
            self.faults = Faults()

    def configure_faults(self, **faults: object) -> None:
        with self.lock:
            self.faults = Faults(**faults)  # type: ignore[arg-type]
            self._rng = random.Random(self.faults.seed)
            self.fault_counts.clear()

    def requests(self, method: str, contains: str = "") -> list[str]:
        """Paths of logged requests with `method` whose path contains `contains`, faults left out."""
        return [path for m, path, status in self.log if m == method and contains in path and isinstance(status, int)]

    def seed(self, repo_id: str, files: dict[str, bytes], *, repo_type: str = "model", revision: str = "main") -> None:
        """Commit `files` straight into the repo's `revision` (repo and branch created when missing), as
        a push before the test's would have: regular files, no request logged."""
        with self.lock:
            repo = self.repos.setdefault((repo_type, repo_id), Repo(repo_type, repo_id, private=False))
            self.blobs[hashlib.sha256(GITATTRIBUTES).hexdigest()] = GITATTRIBUTES
            head = repo.branches.get(revision) or repo.branches.get("main")
            tree = dict(repo.commits[head]) if head else {".gitattributes": _stored(GITATTRIBUTES, lfs=False)}
            for path, data in files.items():
                self.blobs[hashlib.sha256(data).hexdigest()] = data
                tree[path] = _stored(data, lfs=False)
            repo.branches[revision] = _new_commit(repo, tree, "seeded")

    def file_bytes(self, repo_id: str, path: str, *, revision: str = "main", repo_type: str = "model") -> bytes:
        repo = self.repos[(repo_type, repo_id)]
        return self._content(repo.commits[repo.branches[revision]][path])

    def _content(self, stored: StoredFile) -> bytes:
        return self.blobs[stored.sha256]

    def _decide_fault(self, method: str, path: str) -> str | None:
        with self.lock:
            plan = self.faults
            if plan.rate <= 0 or (plan.only_paths and not any(p in path for p in plan.only_paths)):
                return None
            if plan.max_faults is not None and sum(self.fault_counts.values()) >= plan.max_faults:
                return None
            if self._rng.random() >= plan.rate:
                return None
            fault = self._rng.choice(plan.kinds)
            if fault == "truncate" and method != "GET":
                fault = "503"
            self.fault_counts[fault] += 1
            return fault


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_state: HubServer

    def log_message(self, format: str, *args: object) -> None:  # quiet
        pass

    # Dispatch.

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def _dispatch(self, method: str) -> None:
        hub = self.server_state
        url = urlsplit(self.path)
        path = url.path
        self.query = parse_qs(url.query)
        self.body = self._read_body()
        self._truncate = False
        fault = hub._decide_fault(method, path)
        if fault == "reset":
            with hub.lock:
                hub.log.append((method, path, "reset"))
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_connection = True
            return
        if fault == "503":
            with hub.lock:
                hub.log.append((method, path, "503"))
            return self._json(503, {"error": "injected: service unavailable"})
        self._truncate = fault == "truncate"
        status = self._route(method, path)
        with hub.lock:
            hub.log.append((method, path, "truncate" if self._truncate else status))

    def _route(self, method: str, path: str) -> int:
        m = re.fullmatch(r"/api/(models|datasets|spaces)/([^/]+/[^/]+)/(preupload|commit|revision|tree|branch)/"
                         r"([^/]+)(/.*)?", path)
        if m:
            repo_type, repo_id, action, rev, rest = _TYPES[m[1]], m[2], m[3], unquote(m[4]), (m[5] or "").lstrip("/")
            handler = {
                ("POST", "preupload"): self._preupload,
                ("POST", "commit"): self._commit,
                ("POST", "branch"): self._branch,
                ("GET", "revision"): self._revision,
                ("GET", "tree"): self._tree,
            }.get((method, action))
            if handler is not None:
                return handler(repo_type, repo_id, rev, unquote(rest))
        m = re.fullmatch(r"/api/(models|datasets|spaces)/([^/]+/[^/]+)", path)
        if method == "GET" and m:
            return self._revision(_TYPES[m[1]], m[2], "main", "")
        if method == "POST" and path == "/api/repos/create":
            return self._create_repo()
        if method == "POST" and path == "/api/validate-yaml":
            return self._json(200, {"errors": [], "warnings": []})
        m = re.fullmatch(r"/(datasets/|spaces/)?([^/]+/[^/]+)\.git/info/lfs/objects/batch", path)
        if method == "POST" and m:
            return self._lfs_batch({"datasets/": "dataset", "spaces/": "space"}.get(m[1] or "", "model"), m[2])
        m = re.fullmatch(r"/lfs/(upload|verify)/([0-9a-f]{64})", path)
        if m and (method, m[1]) in (("PUT", "upload"), ("POST", "verify")):
            return self._lfs_upload(m[2]) if m[1] == "upload" else self._lfs_verify(m[2])
        m = re.fullmatch(r"/(datasets/|spaces/)?([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if method in ("GET", "HEAD") and m:
            repo_type = {"datasets/": "dataset", "spaces/": "space"}.get(m[1] or "", "model")
            return self._resolve(method, repo_type, m[2], unquote(m[3]), unquote(m[4]))
        return self._json(404, {"error": f"no route for {method} {path}"})

    # Auth.

    def _token(self) -> str | None:
        auth = self.headers.get("Authorization", "")
        return auth[len("Bearer "):] if auth.startswith("Bearer ") else None

    def _can_write(self) -> int | None:
        """None when allowed, else the status to answer with (after answering)."""
        token = self._token()
        if token == WRITE_TOKEN:
            return None
        if token == READ_TOKEN:
            return self._json(403, {"error": "You don't have the rights to write to this repository"})
        return self._json(401, {"error": "Invalid username or password."})

    def _repo_for_read(self, repo_type: str, repo_id: str) -> Repo | int:
        repo = self.server_state.repos.get((repo_type, repo_id))
        if repo is None or (repo.private and self._token() not in (WRITE_TOKEN, READ_TOKEN)):
            return self._json(404, {"error": "Repository not found"}, error_code="RepoNotFound")
        return repo

    # Endpoints.

    def _create_repo(self) -> int:
        if (denied := self._can_write()) is not None:
            return denied
        payload = json.loads(self.body)
        repo_type = payload.get("type") or "model"
        repo_id = f"{payload['organization']}/{payload['name']}" if payload.get("organization") else payload["name"]
        url = f"{self._base()}/{_PREFIX[repo_type]}{repo_id}"
        hub = self.server_state
        with hub.lock:
            if (repo_type, repo_id) in hub.repos:
                return self._json(409, {"error": "You already created this repo", "url": url})
            repo = Repo(repo_type, repo_id, private=payload.get("visibility") == "private"
                        or bool(payload.get("private")))
            hub.blobs[hashlib.sha256(GITATTRIBUTES).hexdigest()] = GITATTRIBUTES
            initial = {".gitattributes": _stored(GITATTRIBUTES, lfs=False)}
            repo.branches["main"] = _new_commit(repo, initial, "initial commit")
            hub.repos[(repo_type, repo_id)] = repo
        return self._json(200, {"url": url, "name": repo_id, "id": repo_id})

    def _branch(self, repo_type: str, repo_id: str, branch: str, _: str) -> int:
        if (denied := self._can_write()) is not None:
            return denied
        repo = self._repo_for_read(repo_type, repo_id)
        if isinstance(repo, int):
            return repo
        start = json.loads(self.body or b"{}").get("startingPoint") or "main"
        with self.server_state.lock:
            if branch in repo.branches:
                return self._json(409, {"error": "Reference already exists"})
            repo.branches[branch] = repo.branches.get(start, start)
        return self._json(200, {})

    def _preupload(self, repo_type: str, repo_id: str, rev: str, _: str) -> int:
        if (denied := self._can_write()) is not None:
            return denied
        repo = self._repo_for_read(repo_type, repo_id)
        if isinstance(repo, int):
            return repo
        tree = repo.commits.get(repo.branches.get(rev, ""), {})
        files = []
        for item in json.loads(self.body)["files"]:
            sample = base64.b64decode(item["sample"])
            lfs = item["size"] > _LFS_THRESHOLD or b"\0" in sample
            existing = tree.get(item["path"])
            oid = None if existing is None else (existing.sha256 if existing.lfs else existing.git_oid)
            files.append({"path": item["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False,
                          "oid": oid})
        return self._json(200, {"files": files, "commitOid": repo.branches.get(rev)})

    def _lfs_batch(self, repo_type: str, repo_id: str) -> int:
        if (denied := self._can_write()) is not None:
            return denied
        repo = self._repo_for_read(repo_type, repo_id)
        if isinstance(repo, int):
            return repo
        objects = []
        for obj in json.loads(self.body)["objects"]:
            entry = {"oid": obj["oid"], "size": obj["size"], "authenticated": True}
            if obj["oid"] not in self.server_state.blobs:
                entry["actions"] = {
                    "upload": {"href": f"{self._base()}/lfs/upload/{obj['oid']}", "header": {}},
                    "verify": {"href": f"{self._base()}/lfs/verify/{obj['oid']}", "header": {}},
                }
            objects.append(entry)
        return self._json(200, {"transfer": "basic", "objects": objects}, content_type="application/vnd.git-lfs+json")

    def _lfs_upload(self, oid: str) -> int:
        if hashlib.sha256(self.body).hexdigest() != oid:
            return self._json(400, {"error": "sha256 of the body does not match the oid"})
        with self.server_state.lock:
            self.server_state.blobs[oid] = self.body
        return self._json(200, {})

    def _lfs_verify(self, oid: str) -> int:
        payload = json.loads(self.body)
        blob = self.server_state.blobs.get(oid)
        if blob is None or len(blob) != payload.get("size"):
            return self._json(404, {"error": "object not found"})
        return self._json(200, {})

    def _commit(self, repo_type: str, repo_id: str, rev: str, _: str) -> int:
        if (denied := self._can_write()) is not None:
            return denied
        repo = self._repo_for_read(repo_type, repo_id)
        if isinstance(repo, int):
            return repo
        hub = self.server_state
        lines = [json.loads(line) for line in self.body.splitlines() if line.strip()]
        header = next(line["value"] for line in lines if line["key"] == "header")
        with hub.lock:
            if rev not in repo.branches:
                return self._json(404, {"error": f"Invalid rev id: {rev}"}, error_code="RevisionNotFound")
            tree = dict(repo.commits[repo.branches[rev]])
            for line in lines:
                key, value = line["key"], line["value"]
                if key == "file":
                    data = base64.b64decode(value["content"])
                    hub.blobs[hashlib.sha256(data).hexdigest()] = data
                    tree[value["path"]] = _stored(data, lfs=False)
                elif key == "lfsFile":
                    blob = hub.blobs.get(value["oid"])
                    if blob is None:
                        return self._json(422, {"error": f"LFS object {value['oid']} was never uploaded"})
                    tree[value["path"]] = _stored(blob, lfs=True)
                elif key == "deletedFile":
                    tree.pop(value["path"], None)
                elif key == "deletedFolder":
                    prefix = value["path"].rstrip("/") + "/"
                    tree = {p: f for p, f in tree.items() if not p.startswith(prefix)}
            sha = _new_commit(repo, tree, header.get("summary", ""))
            repo.branches[rev] = sha
        prefix = _PREFIX[repo_type]
        return self._json(200, {"success": True, "commitOid": sha,
                                "commitUrl": f"{self._base()}/{prefix}{repo_id}/commit/{sha}"})

    def _revision(self, repo_type: str, repo_id: str, rev: str, _: str) -> int:
        repo = self._repo_for_read(repo_type, repo_id)
        if isinstance(repo, int):
            return repo
        sha = repo.branches.get(rev, rev if rev in repo.commits else None)
        if sha is None:
            return self._json(404, {"error": f"Invalid rev id: {rev}"}, error_code="RevisionNotFound")
        tree = repo.commits[sha]
        return self._json(200, {
            "id": repo_id, "modelId": repo_id, "sha": sha, "private": repo.private, "tags": [],
            "siblings": [{"rfilename": p} for p in sorted(tree)],
        })

    def _tree(self, repo_type: str, repo_id: str, rev: str, sub: str) -> int:
        repo = self._repo_for_read(repo_type, repo_id)
        if isinstance(repo, int):
            return repo
        sha = repo.branches.get(rev, rev if rev in repo.commits else None)
        if sha is None:
            return self._json(404, {"error": f"Invalid rev id: {rev}"}, error_code="RevisionNotFound")
        prefix = sub.rstrip("/") + "/" if sub else ""
        entries = []
        for path, stored in sorted(repo.commits[sha].items()):
            if not path.startswith(prefix):
                continue
            entry = {"type": "file", "path": path, "size": stored.size, "oid": stored.git_oid}
            if stored.lfs:
                entry["lfs"] = {"oid": stored.sha256, "size": stored.size, "pointerSize": 134}
            entries.append(entry)
        return self._json(200, entries)

    def _resolve(self, method: str, repo_type: str, repo_id: str, rev: str, path: str) -> int:
        repo = self._repo_for_read(repo_type, repo_id)
        if isinstance(repo, int):
            return repo
        sha = repo.branches.get(rev, rev if rev in repo.commits else None)
        stored = repo.commits.get(sha or "", {}).get(path)
        if stored is None:
            return self._json(404, {"error": "Entry not found"}, error_code="EntryNotFound")
        data = self.server_state._content(stored)
        etag = f'"{stored.sha256 if stored.lfs else stored.git_oid}"'
        status, start, end = 200, 0, len(data)
        ranged = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        if ranged:
            start = int(ranged[1])
            end = min(len(data), int(ranged[2]) + 1) if ranged[2] else len(data)
            status = 206
        self.send_response(status)
        self.send_header("X-Repo-Commit", sha)
        self.send_header("ETag", etag)
        if stored.lfs:
            self.send_header("X-Linked-Etag", etag)
            self.send_header("X-Linked-Size", str(stored.size))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
        self.send_header("Content-Length", str(end - start))
        self.send_header("Content-Type", "application/octet-stream")
        self.end_headers()
        if method == "GET":
            self._send_body(data[start:end])
        return status

    # Plumbing.

    def _base(self) -> str:
        return f"http://{self.headers.get('Host')}"

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    self.rfile.readline()
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _json(self, status: int, payload: object, *, content_type: str = "application/json",
              error_code: str | None = None) -> int:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        if error_code:
            self.send_header("X-Error-Code", error_code)
        if status >= 400 and isinstance(payload, dict) and "error" in payload:
            self.send_header("X-Error-Message", str(payload["error"]))
        self.end_headers()
        if self.command != "HEAD":
            self._send_body(body)
        return status

    def _send_body(self, body: bytes) -> None:
        if self._truncate and len(body) > 1:
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_connection = True
            return
        self.wfile.write(body)


def _stored(data: bytes, *, lfs: bool) -> StoredFile:
    return StoredFile(size=len(data), sha256=hashlib.sha256(data).hexdigest(), git_oid=git_blob_oid(data), lfs=lfs)


def _new_commit(repo: Repo, tree: dict[str, StoredFile], summary: str) -> str:
    repo.commit_count += 1
    listing = json.dumps(sorted((p, f.sha256) for p, f in tree.items()))
    sha = hashlib.sha1(f"{repo.repo_id}\n{repo.commit_count}\n{summary}\n{listing}".encode()).hexdigest()
    repo.commits[sha] = tree
    return sha
