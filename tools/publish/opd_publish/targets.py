"""Where checkpoints go: --repo parsed into a Target (repo.py). file:// here, hf:// in hub.py."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

from opd_common.errors import ConfigError, StreamError
from opd_common.streams import sha256_file

from .repo import Target


class FileTarget(Target):
    """A directory with the repo's layout (a local or network mirror for air-gapped clusters).

    Each file is written to a temporary name, fsynced and renamed; each commit is appended to
    .opd/commits.jsonl with an id (sha1 of the previous id and the files' sha256s).
    """

    LOG = ".opd/commits.jsonl"

    def __init__(self, root: Path | str, url: str | None = None):
        self.root = Path(root)
        self.url = url or f"file://{self.root}"

    def ensure(self, private: bool) -> None:
        if self.root.exists() and not self.root.is_dir():
            raise ConfigError(f"--repo {self.url}: {self.root} exists and is not a directory")
        self.root.mkdir(parents=True, exist_ok=True)

    def _require(self) -> None:
        if not self.root.is_dir():
            raise StreamError(f"{self.url}: no such directory (nothing was published there)")

    def list_files(self) -> dict[str, int]:
        self._require()
        out = {}
        for p in self.root.rglob("*"):
            rel = p.relative_to(self.root).as_posix()
            if p.is_file() and not any(part.startswith(".") for part in rel.split("/")):
                out[rel] = p.stat().st_size
        return dict(sorted(out.items()))

    def read(self, path: str) -> bytes:
        full = self.root / path
        if not full.is_file():
            raise StreamError(f"{self.url}: {path} is missing")
        return full.read_bytes()

    def sha256(self, path: str) -> str:
        full = self.root / path
        if not full.is_file():
            raise StreamError(f"{self.url}: {path} is missing")
        return sha256_file(full)

    def download(self, path: str, dest: Path) -> None:
        if not (self.root / path).is_file():
            raise StreamError(f"{self.url}: {path} is missing")
        shutil.copyfile(self.root / path, dest)

    def head(self) -> str:
        log = self.root / self.LOG
        lines = log.read_text().splitlines() if log.exists() else []
        return json.loads(lines[-1])["commit"] if lines else ""

    def commit(self, adds: dict[str, Path | bytes], message: str) -> str:
        self._require()
        h = hashlib.sha1(self.head().encode())
        for path, src in sorted(adds.items(), key=lambda kv: kv[0]):
            dest = self.root / path
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_name(f".{dest.name}.tmp")
            if isinstance(src, bytes):
                tmp.write_bytes(src)
            else:
                shutil.copyfile(src, tmp)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, dest)
            h.update(f"{path}\0{sha256_file(dest)}\n".encode())
        commit = h.hexdigest()
        log = self.root / self.LOG
        log.parent.mkdir(exist_ok=True)
        with open(log, "a") as f:
            f.write(json.dumps({"commit": commit, "message": message, "files": sorted(adds),
                                "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}) + "\n")
        return commit


def parse_target(spec: str, revision: str | None = None, token: str | None = None, quiet: bool = False) -> Target:
    """--repo hf://ORG/NAME | file:///path | ORG/NAME (the Hub)."""
    if spec.startswith("file://"):
        if revision:
            raise ConfigError("--revision applies to hf:// targets only (a file:// mirror has one branch)")
        path = spec[len("file://"):]
        if not path:
            raise ConfigError(f"--repo {spec!r}: give a directory, e.g. file:///mnt/mirror/run1")
        return FileTarget(Path(path), spec)
    name = spec[len("hf://"):] if spec.startswith("hf://") else spec
    if "://" in spec and not spec.startswith("hf://"):
        raise ConfigError(f"--repo {spec!r}: use hf://ORG/NAME, file:///DIR or ORG/NAME")
    if name.count("/") != 1 or not all(name.split("/")):
        raise ConfigError(f"--repo {spec!r}: a Hub repo is ORG/NAME (e.g. hf://my-org/qwen3-opd-run1)")
    try:
        from .hub import HubTarget
    except ImportError:
        raise ConfigError(f"--repo {spec!r}: hf:// targets need huggingface_hub: pip install 'opd[publish]' "
                          "(or use file:///DIR)") from None
    return HubTarget(name, revision=revision, token=token, quiet=quiet)
