"""hf://ORG/NAME: the Hugging Face Hub through huggingface_hub's HfApi (or any Hub-compatible
server named by HF_ENDPOINT). The token comes from HF_TOKEN or the login cache and is never printed."""

from __future__ import annotations

import importlib
import os
import sys
import tempfile
from pathlib import Path

from opd_common.errors import StreamError, require

from .layout import sha256_bytes
from .repo import Target


def _transport_errors() -> tuple[type[BaseException], ...]:
    """OSError (HfHubHTTPError is one) plus the HTTP client's own base error, whichever
    huggingface_hub uses (httpx2 in 2.x, httpx in 1.x, requests before)."""
    found: list[type[BaseException]] = [OSError]
    for module, name in (("httpx2", "HTTPError"), ("httpx", "HTTPError"), ("requests", "RequestException")):
        try:
            found.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            pass
    return tuple(found)


class HubTarget(Target):
    def __init__(self, repo_id: str, revision: str | None = None, token: str | None = None, quiet: bool = False):
        hub = require("huggingface_hub", "publish")
        for sub in ("errors", "hf_api", "utils"):  # submodules the package loads lazily
            importlib.import_module(f"huggingface_hub.{sub}")
        if quiet or not sys.stderr.isatty():  # its tqdm bars, like ours, only on a terminal
            hub.utils.disable_progress_bars()
        self.repo_id, self.revision = repo_id, revision or "main"
        self.url = f"hf://{repo_id}" + (f"@{revision}" if revision else "")
        self.endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
        self.api = hub.HfApi(endpoint=self.endpoint, token=token)
        self.hub = hub
        self.errors = _transport_errors()
        self._cache = tempfile.TemporaryDirectory(prefix="opd-publish-")
        self._listing: dict | None = None

    def ensure(self, private: bool) -> None:
        self.api.create_repo(self.repo_id, private=private or None, exist_ok=True)
        if self.revision != "main":
            self.api.create_branch(self.repo_id, branch=self.revision, exist_ok=True)

    def head(self) -> str:
        return self.api.repo_info(self.repo_id, revision=self.revision).sha

    def _tree(self) -> dict:
        try:
            entries = self.api.list_repo_tree(self.repo_id, revision=self.revision, recursive=True)
            return {e.path: e for e in entries if isinstance(e, self.hub.hf_api.RepoFile)}
        except (self.hub.errors.RepositoryNotFoundError, self.hub.errors.RevisionNotFoundError):
            raise StreamError(f"{self.url}: no such repo or revision at {self.endpoint} (nothing was published "
                              "there, or HF_TOKEN cannot read it)") from None

    def list_files(self) -> dict[str, int]:
        self._listing = self._tree()
        return {p: e.size for p, e in sorted(self._listing.items())}

    def read(self, path: str) -> bytes:
        with tempfile.TemporaryDirectory(dir=self._cache.name) as tmp:
            dest = Path(tmp) / "f"
            self.download(path, dest)
            return dest.read_bytes()

    def sha256(self, path: str) -> str:
        entry = (self._listing or {}).get(path)
        if entry is not None and entry.lfs is not None:  # the Hub states LFS files' sha256
            return entry.lfs.sha256
        return sha256_bytes(self.read(path))  # regular (git) files: re-download and hash

    def download(self, path: str, dest: Path) -> None:
        with tempfile.TemporaryDirectory(dir=self._cache.name) as tmp:
            try:
                got = self.hub.hf_hub_download(self.repo_id, path, revision=self.revision, local_dir=tmp,
                                               endpoint=self.endpoint, token=self.api.token)
            except self.hub.errors.EntryNotFoundError:
                raise StreamError(f"{self.url}: {path} is missing") from None
            os.replace(got, dest)

    def commit(self, adds: dict[str, Path | bytes], message: str) -> str:
        ops = [self.hub.CommitOperationAdd(path_in_repo=path,
                                           path_or_fileobj=src if isinstance(src, bytes) else str(src))
               for path, src in sorted(adds.items(), key=lambda kv: kv[0])]
        info = self.api.create_commit(self.repo_id, ops, commit_message=message, revision=self.revision)
        self._listing = None
        return info.oid
