"""The Target interface: what publishing needs of a repo (list, read, commit files). file:// and the factory
for --repo are in targets.py, hf:// in hub.py; both implement this."""

from __future__ import annotations

from pathlib import Path

from .layout import sha256_bytes


class Target:
    """The operations publishing needs; paths are POSIX paths relative to the repo root."""

    url: str
    errors: tuple[type[BaseException], ...] = (OSError,)  # transport failures, reported as StreamError

    def head(self) -> str:
        """The current commit id."""
        raise NotImplementedError

    def ensure(self, private: bool) -> None:
        """Create the repo if missing."""

    def list_files(self) -> dict[str, int]:
        """Every file: path -> size in bytes."""
        raise NotImplementedError

    def read(self, path: str) -> bytes:
        raise NotImplementedError

    def sha256(self, path: str) -> str:
        """sha256 of a remote file's content as the target serves it."""
        return sha256_bytes(self.read(path))

    def download(self, path: str, dest: Path) -> None:
        dest.write_bytes(self.read(path))

    def commit(self, adds: dict[str, Path | bytes], message: str) -> str:
        """Add/replace files in one commit; returns the commit id."""
        raise NotImplementedError

    def exists(self, path: str) -> bool:
        return path in self.list_files()
