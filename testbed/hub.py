"""The testbed's "internet", part 1: a Hugging Face Hub stand-in that the real `hf` CLI downloads from.

The head is the only node declared `internet: true`; this server runs in the head's network namespace on its
loopback (`HF_ENDPOINT`, set by the head's sshd), so the head reaches it and no other node does, as with the
real Hub. It serves the testbed's own model repos (`testorg/tiny-moe` rev 1111..., `testorg/tiny-dense`
rev 2222..., byte-identical to what `testbed/weights.py` lays out on the head, and `testorg/tiny-llama`
rev 3333... once `python -m testbed real-vllm` has published it) from a store under
/var/lib/spark-testbed/hub, kept across `down`/`up` like the docker data roots.

Modelled on huggingface_hub 2.4.0's own client (the pin in testbed/hf-requirements.txt), what it really asks:

* `hf download REPO --revision SHA` (cli/download.py `download`) calls `snapshot_download`
  (_snapshot_download.py). A revision that is a commit hash skips `HfApi.repo_info`; the file list comes from
  `HfApi.list_repo_tree` -> GET /api/models/REPO/tree/REV?recursive=True&expand=False (hf_api.py
  `_iter_repo_tree_pages`, pages followed by the `Link: rel="next"` header, utils/_pagination.py). A branch
  (`main`, or no --revision) first asks GET /api/models/REPO/revision/REV (`HfApi.model_info`) for `sha`, and
  then writes refs/REV = sha; a commit-hash revision writes no ref (file_download.py
  `_cache_commit_hash_for_specific_revision`).
* Each file: `hf_hub_download` -> `get_hf_file_metadata` (file_download.py): HEAD /REPO/resolve/REV/PATH with
  `Accept-Encoding: identity`, redirects followed only while they stay on the same origin
  (utils/_http.py `_httpx2_follow_hub_redirects_with_backoff`, `_is_same_or_hub_host`). It needs
  `X-Repo-Commit` (else FileMetadataError "does not seem to be served by a Hugging Face Hub endpoint"),
  `X-Linked-Etag` or `ETag` (the blob's name in the cache: sha256 for LFS files, the git blob sha1 otherwise),
  `X-Linked-Size` or `Content-Length` (the expected size: a body of another length is "Consistency check
  failed"), and `Location` on a redirect (where the GET goes). No `X-Xet-Hash`
  (utils/_xet.py `parse_xet_file_data_from_response`), so `_download_to_tmp_and_move` uses plain HTTP
  (`http_get`), which resumes a dropped body with `Range: bytes=N-` and expects 206 + `Content-Range`.
* LFS files (`*.safetensors`, as in testbed/weights.py) answer as the Hub's do: 302 to a "CDN" on another origin
  (127.0.0.1:CDN_PORT; another port is another origin to the client), carrying the metadata headers itself; the
  client then GETs the CDN URL without the Authorization header. Other files answer 200 directly.
* Errors as `hf_raise_for_status` (utils/_http.py) reads them: `X-Error-Code` RepoNotFound (401 without a token,
  404 with one), RevisionNotFound (404), EntryNotFound (404, with X-Repo-Commit so the client caches `.no_exist`),
  GatedRepo (401: a gated repo's files without `Authorization: Bearer <token>`), and 401 with
  `X-Error-Message: Invalid credentials in Authorization header` for an unknown token.

For tests: a runtime config (JSON, re-read when it changes: `configure()`) gates repos and names the accepted
tokens, throttles all bodies together to N bytes/s (a test can watch a download's progress), and can drop a
body after N bytes K times (the client's resume). Every request is appended to a JSON-lines log (`requests()`),
and GET /_testbed/stats on the Hub's origin answers the counts.
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

HUB_PORT = 8480
CDN_PORT = 8481
HF_ENDPOINT = f"http://127.0.0.1:{HUB_PORT}"
HUB_TOKEN = "hf_sparktestbedGatedRepoReadToken"   # accepted for gated repos unless configure() names others
LFS_PATTERNS = ("*.safetensors",)                  # what the stand-in repos keep in LFS (testbed/weights.py)
CHUNK = 64 << 10
DATE = "2025-01-01T00:00:00.000Z"
PID_NAME = "hub"
_SHA1 = re.compile(r"^[0-9a-f]{40}$")


# ---------------------------------------------------------------------------------------------- the repo store

def is_lfs(path: str) -> bool:
    return any(fnmatch.fnmatch(path.rsplit("/", 1)[-1], p) for p in LFS_PATTERNS)


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    """The pointer file git keeps for an LFS object (its git sha1 is the tree entry's `oid`)."""
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


def _sha256_file(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def file_entry(path: str, p: Path) -> dict[str, Any]:
    """A file as the Hub lists it: size, git oid, and for LFS files the object's sha256 and pointer size."""
    size = p.stat().st_size
    if is_lfs(path):
        sha = _sha256_file(p)
        pointer = lfs_pointer(sha, size)
        return {"size": size, "oid": git_blob_sha1(pointer),
                "lfs": {"oid": sha, "size": size, "pointerSize": len(pointer)}}
    return {"size": size, "oid": git_blob_sha1(p.read_bytes()), "lfs": None}


#: One repo of the store as its JSON database records it (revision, dir, files, stamp, key): see `repo_entry`.
Repo = dict[str, Any]
#: The stand-in's behaviour (gated, tokens, throttle, redirect_lfs, drop_after, drop_times): see `configure`.
HubConfig = dict[str, Any]
#: A request's query string as `parse_qs` reads it.
Query = dict[str, list[str]]
#: (mtime_ns, size, inode) of a file the stand-in re-reads when it changes.
FileStamp = tuple[int, int, int]
#: One answered request as the stand-in logs it (t, method, path, status, kind, bytes, range, auth, ...).
RequestRecord = dict[str, Any]

def _stamp(d: Path) -> dict[str, list[int]]:
    return {str(p.relative_to(d)): [p.stat().st_size, p.stat().st_mtime_ns]
            for p in sorted(d.rglob("*")) if p.is_file() and not p.name.startswith(".")}


def repo_entry(model_id: str, revision: str, directory: Path, *, key: Any = None,
               old: Repo | None = None) -> Repo:
    """The store's record of one repo at one revision, served from *directory* (hashes reused from *old* when
    the files' sizes and mtimes did not change)."""
    directory = Path(directory)
    stamp = _stamp(directory)
    if old and old.get("stamp") == stamp and old.get("revision") == revision and old.get("dir") == str(directory):
        return {**old, "key": key}
    files = {rel: file_entry(rel, directory / rel) for rel in stamp}
    return {"revision": revision, "dir": str(directory), "files": files, "stamp": stamp, "key": key}


def load_db(db: Path) -> dict[str, Repo]:
    try:
        repos: dict[str, Repo] = json.loads(Path(db).read_text())
        return repos
    except (OSError, ValueError):
        return {}


def save_db(db: Path, repos: dict[str, Repo]) -> None:
    db = Path(db)
    db.parent.mkdir(parents=True, exist_ok=True)
    tmp = db.with_suffix(".tmp")
    tmp.write_text(json.dumps(repos, indent=1, sort_keys=True))
    tmp.replace(db)


def store_root() -> Path:
    from .layout import DATA_ROOT
    return DATA_ROOT / "hub"


def db_file() -> Path:
    return store_root() / "repos.json"


def ensure_testbed_repos(weights_size: int, root: Path | None = None) -> dict[str, Repo]:
    """The stand-in repos of the testbed's two models, generated as testbed/weights.py generates them on the head
    (same shard plan, so the same bytes): regenerated only when the size asked for or a file changed."""
    from . import weights
    from .layout import MODELS
    from .scenarios import shard_plan
    root = Path(root or store_root())
    db = root / "repos.json"
    repos = load_db(db)
    changed = False
    for model_id, rev in MODELS.items():
        shards, shard_bytes = shard_plan(weights_size, model_id)
        key = {"shards": shards, "shard_bytes": shard_bytes}
        d = weights.model_dir(root / "repos", model_id, rev, "plain")
        old = repos.get(model_id)
        if old and old.get("key") == key and d.is_dir() and old.get("stamp") == _stamp(d):
            continue
        weights.generate(root / "repos", model_id, rev, "plain", shards, shard_bytes)
        repos[model_id] = repo_entry(model_id, rev, d, key=key, old=old)
        changed = True
    if changed or not db.exists():
        save_db(db, repos)
    return repos


def publish(model_id: str, revision: str, files: dict[str, bytes], root: Path | None = None) -> Repo:
    """Put a repo on the Hub stand-in (e.g. the real vLLM's tiny Llama): its files under the store, its record in
    the store's db (the running server re-reads it)."""
    from . import weights
    root = Path(root or store_root())
    d = weights.model_dir(root / "repos", model_id, revision, "plain")
    d.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        p = d / name
        if not (p.is_file() and p.read_bytes() == data):
            p.parent.mkdir(parents=True, exist_ok=True)
            tmp = p.with_name(f".tmp-{p.name}")
            tmp.write_bytes(data)
            tmp.replace(p)
    db = root / "repos.json"
    repos = load_db(db)
    repos[model_id] = repo_entry(model_id, revision, d, key="published", old=repos.get(model_id))
    save_db(db, repos)
    return repos[model_id]


# ---------------------------------------------------------------------------------------------- the server

class _Throttle:
    """One bucket for every body the server sends (both origins), like one link: `rate` bytes/s, 0 = unlimited."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = 0.0

    def take(self, n: int, rate: int) -> None:
        if rate <= 0:
            return
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next)
            self._next = start + n / rate
            wait = self._next - now
        if wait > 0:
            time.sleep(wait)


class Hub:
    """The Hub stand-in: the Hub's origin on (host, port), the "CDN" origin on (host, cdn_port). Port 0: the
    kernel's choice (tests). `start()` serves from threads; `serve_forever()` blocks (the testbed's process)."""

    def __init__(self, db: Path, config: Path | None = None, log: Path | None = None, *, host: str = "127.0.0.1",
                 port: int = HUB_PORT, cdn_port: int = CDN_PORT) -> None:
        self.db_path = Path(db)
        self.config_path = Path(config) if config else None
        self.log_path = Path(log) if log else None
        if self.log_path is not None:  # the first request's line needs it: nothing else may have made it yet
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._db: dict[str, Repo] = {}
        self._db_stamp: FileStamp | None = None
        self._config: dict[str, Any] = {}
        self._config_stamp: FileStamp | None = None
        self._override: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._throttle = _Throttle()
        self._drops_done = 0
        self.counts: dict[str, int] = {}
        self.bytes_sent = 0
        self.in_flight = 0
        self._log_lock = threading.Lock()
        self.hub = ThreadingHTTPServer((host, port), self._handler("hub"))
        self.cdn = ThreadingHTTPServer((host, cdn_port), self._handler("cdn"))
        for s in (self.hub, self.cdn):
            s.daemon_threads = True
        self.url = f"http://{host}:{self.hub.server_address[1]}"
        self.cdn_url = f"http://{host}:{self.cdn.server_address[1]}"
        self._threads: list[threading.Thread] = []

    # -- lifecycle
    def start(self) -> Hub:
        for s in (self.hub, self.cdn):
            t = threading.Thread(target=s.serve_forever, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def serve_forever(self) -> None:
        threading.Thread(target=self.cdn.serve_forever, daemon=True).start()
        self.hub.serve_forever()

    def stop(self) -> None:
        for s in (self.hub, self.cdn):
            s.shutdown()
            s.server_close()

    # -- state
    def set_config(self, **kw: Any) -> None:
        """In-process override of the config file's keys (tests that run the Hub in their own process)."""
        with self._lock:
            self._override.update(kw)
            self._drops_done = 0

    def config(self) -> dict[str, Any]:
        cfg: dict[str, Any] = {"gated": [], "tokens": [HUB_TOKEN], "throttle": 0, "redirect_lfs": True,
                               "drop_after": 0, "drop_times": 0}
        if self.config_path is not None:
            try:
                st = self.config_path.stat()
                stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
            except OSError:
                stamp = None
            with self._lock:
                if stamp != self._config_stamp:
                    try:
                        self._config = json.loads(self.config_path.read_text()) if stamp else {}
                    except (OSError, ValueError):
                        self._config = {}
                    self._config_stamp = stamp
                    self._drops_done = 0
        cfg.update(self._config)
        cfg.update(self._override)
        return cfg

    def repos(self) -> dict[str, Repo]:
        try:
            st = self.db_path.stat()
            stamp: FileStamp | None = (st.st_mtime_ns, st.st_size, st.st_ino)
        except OSError:
            stamp = None
        with self._lock:
            if stamp != self._db_stamp:
                self._db = load_db(self.db_path) if stamp else {}
                self._db_stamp = stamp
            return self._db

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"counts": dict(self.counts), "bytes_sent": self.bytes_sent, "in_flight": self.in_flight}

    def _count(self, kind: str, n: int = 1) -> None:
        with self._lock:
            self.counts[kind] = self.counts.get(kind, 0) + n

    def _sent(self, n: int) -> None:
        with self._lock:
            self.bytes_sent += n

    def _flight(self, d: int) -> None:
        with self._lock:
            self.in_flight += d

    def _take_drop(self, length: int) -> int:
        """Bytes after which to drop this body of *length* bytes (0: send it whole)."""
        cfg = self.config()
        with self._lock:
            if 0 < cfg["drop_after"] < length and self._drops_done < cfg["drop_times"]:
                self._drops_done += 1
                return int(cfg["drop_after"])
        return 0

    def log(self, rec: dict[str, Any]) -> None:
        if self.log_path is None:
            return
        line = json.dumps(rec, sort_keys=True) + "\n"
        with self._log_lock, open(self.log_path, "a") as f:
            f.write(line)

    def _handler(self, origin: str) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(_Handler):
            pass

        Handler.hub = hub
        Handler.origin = origin
        return Handler


class _HubError(Exception):
    def __init__(self, status: int, code: str | None, message: str, commit: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.commit = status, code, message, commit


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "spark-testbed-hub/1"
    hub: Hub
    origin: str

    def log_message(self, *args: object) -> None:
        pass

    def do_HEAD(self) -> None:
        self._serve(head=True)

    def do_GET(self) -> None:
        self._serve(head=False)

    # -- plumbing
    def _serve(self, head: bool) -> None:
        t0 = time.time()
        self._status, self._body_bytes, self._kind = 0, 0, "other"
        self.hub._flight(1)
        try:
            try:
                if self.origin == "cdn":
                    self._cdn(head)
                else:
                    self._route(head)
            except _HubError as e:
                self._error(e, head)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        finally:
            self.hub._flight(-1)
            self.hub._count(f"{self.command} {self._kind}")
            self.hub.log({"t": round(t0, 3), "dt": round(time.time() - t0, 3), "origin": self.origin,
                          "method": self.command, "path": self.path, "status": self._status, "kind": self._kind,
                          "bytes": self._body_bytes, "range": self.headers.get("Range"),
                          "auth": self.headers.get("Authorization") is not None,
                          "ua": self.headers.get("User-Agent", "")[:120]})

    def _send(self, status: int, headers: dict[str, str], body: bytes = b"", head: bool = False) -> None:
        self._status = status
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        if "Content-Length" not in headers:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head and body:
            self.wfile.write(body)
            self._body_bytes += len(body)
            self.hub._sent(len(body))

    def _json(self, obj: Any, head: bool, extra: dict[str, str] | None = None) -> None:
        body = json.dumps(obj).encode()
        self._send(200, {"Content-Type": "application/json; charset=utf-8", **(extra or {})}, body, head)

    def _error(self, e: _HubError, head: bool) -> None:
        headers = {"Content-Type": "application/json; charset=utf-8", "X-Error-Message": e.message}
        if e.code:
            headers["X-Error-Code"] = e.code
        if e.commit:
            headers["X-Repo-Commit"] = e.commit
        self._send(e.status, headers, json.dumps({"error": e.message}).encode(), head)

    def _token(self) -> str | None:
        auth = self.headers.get("Authorization") or ""
        return auth[7:].strip() if auth.lower().startswith("bearer ") else None

    def _check_token(self, cfg: HubConfig) -> None:
        tok = self._token()
        if tok is not None and tok not in cfg["tokens"]:
            raise _HubError(401, None, "Invalid credentials in Authorization header")

    def _repo(self, repo_id: str) -> Repo:
        r = self.hub.repos().get(repo_id)
        if r is None:
            raise _HubError(404 if self._token() else 401, "RepoNotFound", "Repository not found")
        return r

    @staticmethod
    def _revision(repo: Repo, rev: str) -> str:
        revision: str = repo["revision"]
        if rev in ("main", revision):
            return revision
        raise _HubError(404, "RevisionNotFound", f"Invalid rev id: {rev}")

    # -- the Hub's origin
    def _route(self, head: bool) -> None:
        url = urlsplit(self.path)
        parts = [unquote(p) for p in url.path.split("/")[1:]]
        query = parse_qs(url.query)
        cfg = self.hub.config()
        if parts[:2] == ["_testbed", "stats"]:
            self._kind = "stats"
            return self._json(self.hub.stats(), head)
        if parts == ["api", "agent-harnesses"]:
            self._kind = "agent-harnesses"     # the CLI's best-effort registry fetch (utils/_detect_agent.py)
            return self._json({"standardEnvVars": [], "harnesses": {}}, head)
        if len(parts) >= 3 and parts[0] == "api" and parts[1] == "models":
            self._check_token(cfg)
            repo_id = "/".join(parts[2:4])
            rest = parts[4:]
            repo = self._repo(repo_id)
            if not rest:
                self._kind = "info"
                return self._json(self._info(repo_id, repo, self._revision(repo, "main"), query, cfg), head)
            if rest[0] == "revision" and len(rest) == 2:
                self._kind = "info"
                return self._json(self._info(repo_id, repo, self._revision(repo, rest[1]), query, cfg), head)
            if rest[0] == "tree" and len(rest) >= 2:
                self._kind = "tree"
                sha = self._revision(repo, rest[1])
                return self._json(self._tree(repo, "/".join(rest[2:]), query), head, {"X-Repo-Commit": sha})
            raise _HubError(404, None, "Not Found")
        if len(parts) >= 5 and parts[2] == "resolve":
            self._kind = "resolve"
            self._check_token(cfg)
            return self._resolve("/".join(parts[:2]), parts[3], "/".join(parts[4:]), head, cfg)
        raise _HubError(404, None, "Not Found")

    def _info(self, repo_id: str, repo: Repo, sha: str, query: Query, cfg: HubConfig) -> dict[str, object]:
        blobs = query.get("blobs", ["false"])[0].lower() == "true"
        siblings = []
        for path, f in sorted(repo["files"].items()):
            s: dict[str, Any] = {"rfilename": path}
            if blobs:
                s.update({"size": f["size"], "blobId": f["oid"]})
                if f["lfs"]:
                    s["lfs"] = {"sha256": f["lfs"]["oid"], "size": f["size"], "pointerSize": f["lfs"]["pointerSize"]}
            siblings.append(s)
        org = repo_id.split("/")[0]
        return {"_id": hashlib.sha1(repo_id.encode()).hexdigest()[:24], "id": repo_id, "modelId": repo_id,
                "author": org, "sha": sha, "lastModified": DATE, "createdAt": DATE, "private": False,
                "gated": "manual" if repo_id in cfg["gated"] else False, "disabled": False, "downloads": 0,
                "likes": 0, "library_name": "transformers", "pipeline_tag": "text-generation",
                "tags": ["transformers", "safetensors", "text-generation"], "siblings": siblings, "spaces": [],
                "usedStorage": sum(f["size"] for f in repo["files"].values())}

    @staticmethod
    def _tree(repo: Repo, under: str, query: Query) -> list[dict[str, object]]:
        recursive = query.get("recursive", ["false"])[0].lower() == "true"
        prefix = f"{under.rstrip('/')}/" if under else ""
        out: list[dict[str, object]] = []
        dirs: set[str] = set()
        for path, f in sorted(repo["files"].items()):
            if not path.startswith(prefix):
                continue
            rest = path[len(prefix):]
            if "/" in rest:
                parts = rest.split("/")
                for i in range(1, len(parts) if recursive else 2):
                    d = prefix + "/".join(parts[:i])
                    if d not in dirs:
                        dirs.add(d)
                        out.append({"type": "directory", "oid": hashlib.sha1(d.encode()).hexdigest(), "size": 0,
                                    "path": d})
                if not recursive:
                    continue
            e: dict[str, Any] = {"type": "file", "oid": f["oid"], "size": f["size"], "path": path}
            if f["lfs"]:
                e["lfs"] = dict(f["lfs"])
            out.append(e)
        return out

    def _resolve(self, repo_id: str, rev: str, path: str, head: bool, cfg: HubConfig) -> None:
        repo = self._repo(repo_id)
        sha = self._revision(repo, rev)
        f = repo["files"].get(path)
        if f is None:
            raise _HubError(404, "EntryNotFound", f"{path} does not exist on \"{rev}\"", commit=sha)
        if repo_id in cfg["gated"] and self._token() is None:
            raise _HubError(401, "GatedRepo", f"Access to model {repo_id} is restricted. You must have access to it "
                                              "and be authenticated to access it. Please log in.")
        common = {"X-Repo-Commit": sha, "Accept-Ranges": "bytes", "Access-Control-Expose-Headers":
                  "X-Repo-Commit,X-Linked-Etag,X-Linked-Size,ETag,Content-Range"}
        if f["lfs"]:
            common["X-Linked-Etag"] = f'"{f["lfs"]["oid"]}"'
            common["X-Linked-Size"] = str(f["size"])
            if cfg["redirect_lfs"]:
                loc = f"{self.hub.cdn_url}/repos/{quote(repo_id)}/{f['lfs']['oid']}?filename={quote(path)}"
                self._send(302, {**common, "ETag": f'"{f["oid"]}"', "Location": loc,
                                 "Content-Type": "text/plain; charset=utf-8"}, b"" if head else
                           f"Found. Redirecting to {loc}".encode(), head)
                return
            etag = f["lfs"]["oid"]
        else:
            etag = f["oid"]
        self._file(Path(repo["dir"]) / path, f["size"], {**common, "ETag": f'"{etag}"'}, head, cfg)

    # -- the "CDN" origin: /repos/ORG/NAME/SHA256
    def _cdn(self, head: bool) -> None:
        self._kind = "cdn"
        parts = [unquote(p) for p in urlsplit(self.path).path.split("/")[1:]]
        if len(parts) != 4 or parts[0] != "repos":
            raise _HubError(404, None, "NoSuchKey")
        repo = self.hub.repos().get(f"{parts[1]}/{parts[2]}") or {}
        for path, f in repo.get("files", {}).items():
            if f["lfs"] and f["lfs"]["oid"] == parts[3]:
                self._file(Path(repo["dir"]) / path, f["size"],
                           {"ETag": f'"{parts[3]}"', "Accept-Ranges": "bytes"}, head, self.hub.config())
                return
        raise _HubError(404, None, "NoSuchKey")

    def _file(self, p: Path, size: int, headers: dict[str, str], head: bool, cfg: HubConfig) -> None:
        start, end, status = 0, size - 1, 200
        rng = self.headers.get("Range")
        if rng:
            m = re.fullmatch(r"bytes=(\d*)-(\d*)", rng.strip())
            if not m or (not m.group(1) and not m.group(2)):
                raise _HubError(416, None, "Invalid Range")
            if m.group(1):
                start = int(m.group(1))
                end = min(int(m.group(2)), size - 1) if m.group(2) else size - 1
            else:
                start = max(size - int(m.group(2)), 0)
            if start >= size or start > end:
                self._send(416, {"Content-Range": f"bytes */{size}"}, b"", head)
                return
            status = 206
            headers = {**headers, "Content-Range": f"bytes {start}-{end}/{size}"}
        length = end - start + 1 if size else 0
        self._status = status
        self.send_response(status)
        for k, v in {**headers, "Content-Type": "application/octet-stream", "Content-Length": str(length)}.items():
            self.send_header(k, v)
        self.end_headers()
        if head:
            return
        drop = self.hub._take_drop(length)
        rate = int(cfg["throttle"] or 0)
        chunk = CHUNK if rate <= 0 else max(1024, min(CHUNK, rate // 20))
        with open(p, "rb") as fh:
            fh.seek(start)
            left = length
            while left > 0:
                data = fh.read(min(chunk, left))
                if not data:
                    break
                if drop and self._body_bytes + len(data) > drop:
                    data = data[:max(drop - self._body_bytes, 0)]
                    self.wfile.write(data)
                    self._body_bytes += len(data)
                    self.hub._sent(len(data))
                    self.close_connection = True
                    self._status = -status          # logged as a dropped body
                    return
                self.hub._throttle.take(len(data), rate)
                self.wfile.write(data)
                self._body_bytes += len(data)
                self.hub._sent(len(data))
                left -= len(data)


# ---------------------------------------------------------------------------------------------- in the testbed

def _hub_state() -> Path:
    from .layout import state_dir
    return state_dir() / "hub"


def config_file() -> Path:
    return _hub_state() / "config.json"


def log_file() -> Path:
    return _hub_state() / "requests.jsonl"


def configure(*, gated: list[str] | None = None, tokens: list[str] | None = None, throttle: int | None = None,
              redirect_lfs: bool | None = None, drop_after: int | None = None,
              drop_times: int | None = None) -> HubConfig:
    """Change the running stand-in's behaviour (it re-reads the file on its next request): gated repo ids, the
    tokens it accepts for them, bytes/s for all bodies together (0: unlimited), LFS via the CDN redirect or
    served directly, and drop a body after `drop_after` bytes, `drop_times` times. Unnamed keys keep their value;
    `reset_config()` puts the defaults back (every scenario does)."""
    cfg: HubConfig
    try:
        cfg = json.loads(config_file().read_text())
    except (OSError, ValueError):
        cfg = {}
    for k, v in {"gated": gated, "tokens": tokens, "throttle": throttle, "redirect_lfs": redirect_lfs,
                 "drop_after": drop_after, "drop_times": drop_times}.items():
        if v is not None:
            cfg[k] = v
    _write_config(cfg)
    return cfg


def reset_config() -> None:
    _write_config({})


def _write_config(cfg: HubConfig) -> None:
    config_file().parent.mkdir(parents=True, exist_ok=True)
    tmp = config_file().with_suffix(".tmp")
    tmp.write_text(json.dumps(cfg, indent=1))
    tmp.replace(config_file())


def requests(since: float = 0.0) -> list[RequestRecord]:
    """The requests the running stand-in answered (one dict per request: method, path, status, kind, bytes, range,
    auth, ...), those that started at or after *since* (time.time()). A request is logged just after its answer
    went out, so a client may see the answer first: poll (testbed.proc.wait_for). A dropped body has status
    -(its status)."""
    try:
        lines = log_file().read_text().splitlines()
    except OSError:
        return []
    return [r for r in map(json.loads, lines) if r["t"] >= since]


def start(head: Any, weights_size: int) -> None:
    """Build (or keep) the store and start the stand-in in the head's network namespace, on its loopback (once per
    `up`: kept while it runs)."""
    from .proc import alive, load_pids, spawn, wait_for
    ensure_testbed_repos(weights_size)
    _hub_state().mkdir(parents=True, exist_ok=True)
    e = load_pids().get(PID_NAME)
    if e and alive(e["pid"], e.get("starttime")):
        return
    root = Path(__file__).resolve().parents[1]
    spawn(PID_NAME, ["nsenter", f"--net=/run/netns/{head.netns}", "--", sys.executable, "-m", "testbed.hub",
                     "--db", str(db_file()), "--config", str(config_file()), "--log", str(log_file())],
          log=_hub_state() / "hub.log", env={**os.environ, "PYTHONPATH": str(root)})
    url = f"{HF_ENDPOINT}/_testbed/stats"
    wait_for(lambda: subprocess.run(["ip", "netns", "exec", head.netns, "curl", "-sf", "-m", "2", url],
                                    capture_output=True, timeout=10, check=False).returncode == 0,
             timeout=20, what="the Hub stand-in on the head")


def stop() -> None:
    from .proc import stop_recorded
    stop_recorded(PID_NAME)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m testbed.hub", description="The Hugging Face Hub stand-in.")
    p.add_argument("--db", required=True)
    p.add_argument("--config")
    p.add_argument("--log")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=HUB_PORT)
    p.add_argument("--cdn-port", type=int, default=CDN_PORT)
    a = p.parse_args(argv)
    Hub(Path(a.db), Path(a.config) if a.config else None, Path(a.log) if a.log else None, host=a.host,
        port=a.port, cdn_port=a.cdn_port).serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
