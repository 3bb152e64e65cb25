"""What a published repo holds, read from an opd-train run directory.

Target layout (identical for hf:// and file://):

  checkpoint-NNNNNN/        adapter_model.safetensors, adapter_config.json, tokenizer files,
                            trainer_state.json, sha256sums.txt (one "SHA256  NAME" line per file)
  latest-resume/            (--with-resume-state) the latest checkpoint's trainer_state.pt + .json
  checkpoint_index.json     the only record of completion: a checkpoint is published when, and
                            only when, it is listed here (written after its files were verified)
  README.md                 model card from config.json and metrics.jsonl

The run directory's names and which of its checkpoints are finished: opd_common.rundir.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opd_common import rundir
from opd_common.errors import ConfigError, StreamError
from opd_common.streams import sha256_file

INDEX = "checkpoint_index.json"
CARD = "README.md"
SUMS = "sha256sums.txt"
RESUME_DIR = "latest-resume"
RESUME_FILES = (rundir.RESUME_STATE, rundir.TRAINER_STATE)
EXCLUDED = {rundir.RESUME_STATE}  # resume state: only under latest-resume/, with --with-resume-state


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class Manifest:
    """Files of one published folder: name -> (sha256, size), and its sha256sums.txt text."""

    files: dict[str, tuple[str, int]]

    @property
    def text(self) -> str:
        return "".join(f"{sha}  {name}\n" for name, (sha, _) in sorted(self.files.items()))

    @property
    def sha256(self) -> str:
        return sha256_bytes(self.text.encode())

    @classmethod
    def of_files(cls, paths: dict[str, Path]) -> Manifest:
        return cls({name: (sha256_file(p), p.stat().st_size) for name, p in paths.items()})

    @staticmethod
    def parse(text: str, where: str) -> dict[str, str]:
        """name -> sha256 from a sha256sums.txt."""
        out = {}
        for number, line in enumerate(text.splitlines(), start=1):
            sha, sep, name = line.partition("  ")
            if not sep or not re.fullmatch(r"[0-9a-f]{64}", sha) or not name:
                raise StreamError(f"{where} line {number} is not 'SHA256  NAME': {line[:80]!r}")
            out[name] = sha
        return out


@dataclass(frozen=True)
class LocalCheckpoint(rundir.Checkpoint):
    """A finished checkpoint of the run directory, as published."""

    def files(self) -> dict[str, Path]:
        """The files to publish (everything but the resume state; hidden files skipped)."""
        out = {}
        for p in sorted(self.path.rglob("*")):
            rel = p.relative_to(self.path).as_posix()
            if p.is_file() and rel not in EXCLUDED and rel != SUMS and not rel.startswith("."):
                out[rel] = p
        return out

    def manifest(self) -> Manifest:
        return Manifest.of_files(self.files())


class RunDir:
    """An opd-train run directory: config.json, metrics.jsonl, checkpoint-NNNNNN/, latest."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        if not (self.path / rundir.CONFIG).is_file():
            raise ConfigError(f"RUN_DIR {self.path} has no {rundir.CONFIG} (is it an opd-train --out directory?)")
        self.config = json.loads((self.path / rundir.CONFIG).read_text())

    def checkpoints(self) -> list[LocalCheckpoint]:
        """Finished checkpoints, by step (rundir.list_checkpoints: none after `latest`)."""
        return [LocalCheckpoint(c.step, c.path) for c in rundir.list_checkpoints(self.path)]

    def latest(self) -> LocalCheckpoint | None:
        latest = rundir.read_latest(self.path)
        return None if latest is None else LocalCheckpoint(latest.step, latest.path)

    def select(self, spec: str) -> list[LocalCheckpoint]:
        """--checkpoints all | latest | N,M (steps)."""
        ckpts = self.checkpoints()
        if not ckpts:
            raise ConfigError(f"RUN_DIR {self.path} has no checkpoint-NNNNNN/ folders yet; nothing to publish")
        if spec == "all":
            return ckpts
        if spec == rundir.LATEST:
            latest = self.latest()
            if latest is None:
                raise ConfigError(f"--checkpoints latest: {self.path}/latest is missing or points nowhere")
            return [latest]
        by_step = {c.step: c for c in ckpts}
        try:
            steps = [int(s) for s in spec.split(",") if s.strip()]
        except ValueError:
            raise ConfigError(f"--checkpoints must be 'all', 'latest' or steps like '50,100', got {spec!r}") from None
        missing = [s for s in steps if s not in by_step]
        if missing or not steps:
            raise ConfigError(f"--checkpoints {spec}: no checkpoint for step(s) {missing} in {self.path} "
                              f"(it has {sorted(by_step)})")
        return [by_step[s] for s in sorted(set(steps))]

    def metrics(self) -> dict[int, dict[str, Any]]:
        path = self.path / rundir.METRICS
        out = {}
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    row = json.loads(line)
                    out[int(row["step"])] = row
                except (ValueError, KeyError):
                    break  # a torn last line
        return out


def data_hashes(inputs: list[str], base: Path) -> list[dict[str, Any]]:
    """sha256 of each training input still present (a file's bytes, a shard dir's manifest.json)."""
    out = []
    for spec in inputs:
        path = Path(spec) if Path(spec).is_absolute() else base / spec
        path = path if path.exists() else Path(spec)
        sha = None
        if path.is_file():
            sha = sha256_file(path)
        elif (path / "manifest.json").is_file():
            sha = sha256_file(path / "manifest.json")
        out.append({"input": spec, "sha256": sha})
    return out
