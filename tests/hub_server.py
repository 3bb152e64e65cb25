"""A small Hub-compatible HTTP server on loopback for tests: the endpoints huggingface_hub's HfApi
and hf_hub_download call for create_repo, create_commit (preupload + NDJSON commit, every file
answered "regular", i.e. sent base64 inline, except *.safetensors / *.pt: "lfs", uploaded through
the LFS batch API with a basic PUT and verify), list_repo_tree (LFS files carry their sha256 as
the Hub gives it), repo_info, create_branch and resolve downloads (HEAD + GET with ETag and
X-Repo-Commit). Dataset repos (what `datasets.load_dataset` reads) live under the key "datasets/ORG/NAME"
and are served on the same routes with the Hub's /api/datasets/ and /datasets/ prefixes. Tests set
HF_HUB_DISABLE_XET so LFS files take the LFS (not Xet) protocol.

State is in memory: repo -> branch -> commit id, commit id -> {path: bytes}. Tests inject faults
through `fail_commit` (a predicate on the commit summary -> HTTP 500) and `corrupt()` (rewrite a
stored file's bytes in place, as bit rot on the server would).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class HubState:
    def __init__(self):
        self.repos: dict[str, dict] = {}  # repo_id -> {"private": bool, "branches": {name: commit}}
        self.commits: dict[str, dict[str, bytes]] = {"0" * 40: {}}
        self.requests: list[str] = []
        self.authorizations: set[str] = set()  # Authorization headers seen (the client must send the token)
        self.lfs: dict[str, bytes] = {}  # sha256 -> object
        self.fail_commit = lambda summary: False
        self.lock = threading.Lock()

    def files(self, repo_id: str, revision: str) -> dict[str, bytes] | None:
        repo = self.repos.get(repo_id)
        if repo is None:
            return None
        commit = repo["branches"].get(revision, revision if revision in self.commits else None)
        return None if commit is None else self.commits[commit]

    def corrupt(self, repo_id: str, path: str, data: bytes, revision: str = "main") -> None:
        self.files(repo_id, revision)[path] = data


API = re.compile(r"^/api/(?P<type>models|datasets)/(?P<repo>[^/]+/[^/]+)/(?P<op>preupload|commit|tree|revision|branch)/"
                 r"(?P<rev>[^/]+)(?P<rest>/.*)?$")
LFS_SUFFIXES = (".safetensors", ".pt")
BATCH = re.compile(r"^/(?P<repo>[^/]+/[^/]+)\.git/info/lfs/objects/batch$")
LFS_OBJECT = re.compile(r"^/lfs/(?P<op>upload|verify)/(?P<oid>[0-9a-f]{64})$")
RESOLVE = re.compile(r"^/(?P<repo>(?:datasets/)?[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out in separate writes
    state: HubState

    def log_message(self, *args) -> None:  # quiet
        pass

    def _send(self, status: int, body: bytes = b"", headers: dict | None = None, head: bool = False) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if "Content-Length" not in (headers or {}):
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _json(self, status: int, obj, headers: dict | None = None) -> None:
        self._send(status, json.dumps(obj).encode(), {"Content-Type": "application/json", **(headers or {})})

    def _error(self, status: int, code: str, message: str, head: bool = False) -> None:
        body = json.dumps({"error": message}).encode()
        self._send(status, b"" if head else body, {"Content-Type": "application/json", "X-Error-Code": code,
                                                   "X-Error-Message": message}, head=head)

    def _body(self) -> bytes:
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _route(self, method: str) -> None:
        url = urlparse(self.path)
        path = unquote(url.path)
        self.state.requests.append(f"{method} {path}")
        if self.headers.get("Authorization"):
            self.state.authorizations.add(self.headers["Authorization"])
        if method == "POST" and path == "/api/repos/create":
            return self._create(json.loads(self._body()))
        if method == "POST" and path == "/api/validate-yaml":
            self._body()
            return self._json(200, {"errors": [], "warnings": []})
        m = API.match(path)
        if m:
            repo, op, rev = ("datasets/" if m["type"] == "datasets" else "") + m["repo"], m["op"], m["rev"]
            body = self._body() if method == "POST" else b""
            with self.state.lock:
                if op == "branch" and method == "POST":
                    return self._branch(repo, rev)
                files = self.state.files(repo, rev)
                if files is None:
                    return self._error(404, "RepoNotFound", f"Repository {repo} or revision {rev} not found")
                if op == "preupload" and method == "POST":
                    req = json.loads(body)
                    return self._json(200, {"files": [{"path": f["path"], "shouldIgnore": False,
                                                       "uploadMode": ("lfs" if f["path"].endswith(LFS_SUFFIXES)
                                                                      else "regular")}
                                                      for f in req["files"]]})
                if op == "commit" and method == "POST":
                    return self._commit(repo, rev, files, body)
                if op == "tree" and method == "GET":
                    return self._tree(files, (m["rest"] or "").strip("/"), "recursive=true" in url.query.lower())
                if op == "revision" and method == "GET":
                    commit = self.state.repos[repo]["branches"].get(rev, rev)
                    return self._json(200, {"id": repo, "sha": commit, "private": self.state.repos[repo]["private"],
                                            "siblings": [{"rfilename": p} for p in sorted(files)]})
        m = BATCH.match(path)
        if m and method == "POST":
            return self._batch(json.loads(self._body()))
        m = LFS_OBJECT.match(path)
        if m and method in ("PUT", "POST"):
            return self._lfs_object(m["op"], m["oid"], self._body())
        m = RESOLVE.match(path)
        if m and method in ("GET", "HEAD"):
            return self._resolve(m["repo"], m["rev"], m["path"], head=method == "HEAD")
        self._error(404, "NotFound", f"no route for {method} {path}", head=method == "HEAD")

    def _create(self, req: dict) -> None:
        repo = f"{req.get('organization') or 'user'}/{req['name']}"
        with self.state.lock:
            if repo in self.state.repos:  # the Hub answers 409 with the repo's url
                return self._json(409, {"error": "You already created this model repo",
                                        "url": f"http://{self.headers['Host']}/{repo}"}, {"X-Error-Code": "RepoExists"})
            self.state.repos[repo] = {
                "private": req.get("visibility", "private" if req.get("private") else "public") != "public",
                "branches": {"main": "0" * 40}}
        self._json(200, {"url": f"http://{self.headers['Host']}/{repo}", "name": repo})

    def _branch(self, repo: str, branch: str) -> None:
        branches = self.state.repos.get(repo, {}).get("branches")
        if branches is None:
            return self._error(404, "RepoNotFound", f"Repository {repo} not found")
        if branch in branches:
            return self._error(409, "BranchExists", f"branch {branch} already exists")
        branches[branch] = branches["main"]
        self._json(200, {})

    def _commit(self, repo: str, rev: str, files: dict[str, bytes], body: bytes) -> None:
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        header = next(x["value"] for x in lines if x["key"] == "header")
        if self.state.fail_commit(header["summary"]):
            return self._error(500, "InternalError", "simulated storage failure")
        new = dict(files)
        for item in lines:
            value = item["value"]
            if item["key"] == "file":
                new[value["path"]] = base64.b64decode(value["content"])
            elif item["key"] == "lfsFile":
                if value["oid"] not in self.state.lfs:
                    return self._error(400, "BadRequest", f"LFS object {value['oid']} of {value['path']} is missing")
                new[value["path"]] = self.state.lfs[value["oid"]]
            elif item["key"] == "deletedFile":
                new.pop(value["path"], None)
            elif item["key"] != "header":
                return self._error(400, "BadRequest", f"unsupported commit operation {item['key']}")
        parent = self.state.repos[repo]["branches"][rev]
        commit = hashlib.sha1(parent.encode()
                              + json.dumps(sorted((p, git_blob_sha1(d)) for p, d in new.items())).encode()
                              + header["summary"].encode()).hexdigest()
        self.state.commits[commit] = new
        self.state.repos[repo]["branches"][rev] = commit
        self._json(200, {"commitUrl": f"http://{self.headers['Host']}/{repo}/commit/{commit}", "commitOid": commit,
                         "success": True})

    def _batch(self, req: dict) -> None:
        base = f"http://{self.headers['Host']}/lfs"
        objects = []
        for obj in req["objects"]:
            out = {"oid": obj["oid"], "size": obj["size"]}
            if obj["oid"] not in self.state.lfs:  # already stored: no actions, the client skips it
                out["actions"] = {"upload": {"href": f"{base}/upload/{obj['oid']}"},
                                  "verify": {"href": f"{base}/verify/{obj['oid']}"}}
            objects.append(out)
        self._json(200, {"transfer": "basic", "objects": objects})

    def _lfs_object(self, op: str, oid: str, body: bytes) -> None:
        if op == "upload":
            if hashlib.sha256(body).hexdigest() != oid:
                return self._error(400, "BadRequest", "LFS object does not match its oid")
            self.state.lfs[oid] = body
            return self._send(200)
        if oid not in self.state.lfs:
            return self._error(404, "EntryNotFound", f"LFS object {oid} was not uploaded")
        self._json(200, {})

    def _tree(self, files: dict[str, bytes], prefix: str, recursive: bool) -> None:
        entries, folders = [], set()
        for path in sorted(files):
            if prefix and not path.startswith(prefix + "/"):
                continue
            rel = path[len(prefix) + 1:] if prefix else path
            parts = rel.split("/")
            for i in range(1, len(parts)):
                folders.add("/".join(([prefix] if prefix else []) + parts[:i]))
            if recursive or len(parts) == 1:
                data = files[path]
                entry = {"type": "file", "path": path, "size": len(data), "oid": git_blob_sha1(data)}
                if path.endswith(LFS_SUFFIXES):
                    entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
                entries.append(entry)
        for folder in sorted(folders):
            if recursive or folder.count("/") == (prefix.count("/") + 1 if prefix else 0):
                entries.append({"type": "directory", "path": folder, "oid": hashlib.sha1(folder.encode()).hexdigest()})
        self._json(200, entries)

    def _resolve(self, repo: str, rev: str, path: str, head: bool) -> None:
        with self.state.lock:
            files = self.state.files(repo, rev)
            if files is None:
                return self._error(404, "RepoNotFound", f"Repository {repo} not found", head=head)
            if path not in files:
                return self._error(404, "EntryNotFound", f"{path} does not exist on {rev}", head=head)
            data = files[path]
            commit = self.state.repos[repo]["branches"].get(rev, rev)
        headers = {"ETag": f'"{git_blob_sha1(data)}"', "X-Repo-Commit": commit, "Content-Length": str(len(data)),
                   "Content-Type": "application/octet-stream", "Accept-Ranges": "bytes"}
        self._send(200, data, headers, head=head)

    def do_GET(self):
        self._route("GET")

    def do_HEAD(self):
        self._route("HEAD")

    def do_POST(self):
        self._route("POST")

    def do_PUT(self):
        self._route("PUT")


class HubServer:
    """Start with `with HubServer() as hub:`; hub.endpoint is the base URL for HF_ENDPOINT."""

    def __init__(self):
        self.state = HubState()
        handler = type("BoundHandler", (Handler,), {"state": self.state})
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.endpoint = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> HubServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
