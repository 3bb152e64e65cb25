"""The run directory: what opd-train writes and every other tool reads (docs/architecture.md, "run-dir handshake").

  config.json            tool, version, resolved options, inputs (written before step 1)
  metrics.jsonl          one line per step
  checkpoint-NNNNNN/     a peft LoRA adapter + tokenizer, trainer_state.json (step, records read, ...) and
                         trainer_state.pt (optimizer, scheduler, RNG states: --resume only)
  latest                 "checkpoint-NNNNNN\\n": the newest finished checkpoint
  reader.json            the trainer's input reader while it waits for records (opd-rollout --follow)
  policy/                opd-train --share-policy: v-NNNNNN/ (the adapter after step NNNNNN: adapter files and
                         trainer_state.json, no optimizer state, not fsynced) and policy/latest naming the newest;
                         the newest POLICY_KEEP are kept. A hand-over to followers, not a checkpoint: --resume and
                         opd-publish never read it, and opd-train clears it when it (re)starts.

The handshake: the writer fills a hidden ``.checkpoint-NNNNNN.tmp/``, fsyncs every file, renames it into
place and only then replaces ``latest`` (atomically). So a checkpoint folder is complete as soon as it is
visible, and readers trust ``latest``: a finished checkpoint is a ``checkpoint-NNNNNN/`` folder whose step
is not after the one ``latest`` names (a folder renamed into place by a save that crashed before ``latest``
moved is not trusted: ``opd-train --resume`` writes that step again). A run directory with folders but no
``latest`` (one put together by hand) trusts its folders.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ConfigError

CONFIG = "config.json"
METRICS = "metrics.jsonl"
LATEST = "latest"
READER = "reader.json"  # the trainer's input reader state while it waits for records
TRAINER_STATE = "trainer_state.json"  # in a checkpoint: step, max_steps, records_read, ... (for people and readers)
RESUME_STATE = "trainer_state.pt"  # in a checkpoint: optimizer, scheduler, RNG states (opd-train --resume)
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
POLICY = "policy"  # opd-train --share-policy: the newest adapters for followers (policy/v-NNNNNN/, policy/latest)
POLICY_KEEP = 4  # policy folders kept (a follower loads the newest; --max-lag L needs L + 1 at most)
POLICY_RE = re.compile(r"v-(\d+)")
CHECKPOINT_RE = re.compile(r"checkpoint-(\d+)")  # opd-train writes 6+ digits; other trainers' folders fewer


def checkpoint_name(step: int) -> str:
    """The folder name of the checkpoint of trainer step `step`: checkpoint-000050."""
    return f"checkpoint-{step:06d}"


def policy_name(step: int) -> str:
    """The folder name (under policy/) of the adapter shared after trainer step `step`: v-000050."""
    return f"v-{step:06d}"


def parse_checkpoint_name(name: str) -> int | None:
    """The step in a checkpoint-N folder name (any number of digits), None for other names."""
    m = CHECKPOINT_RE.fullmatch(name)
    return int(m.group(1)) if m else None


def read_trainer_state(folder: Path) -> dict[str, Any]:
    """A checkpoint's trainer_state.json ({} when it is absent or not a JSON object)."""
    try:
        state = json.loads((Path(folder) / TRAINER_STATE).read_text())
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


@dataclass(frozen=True)
class Checkpoint:
    """A finished checkpoint of a run directory."""

    step: int
    path: Path

    @property
    def name(self) -> str:
        return self.path.name

    def state(self) -> dict[str, Any]:
        """Its trainer_state.json ({} when absent)."""
        return read_trainer_state(self.path)


# ------------------------------------------------------------------------------ reading


def _pointer(run_dir: Path) -> tuple[Path, str] | None:
    """(`latest`, the name it holds), None before the first checkpoint."""
    pointer = Path(run_dir) / LATEST
    try:
        return pointer, pointer.read_text().strip()
    except FileNotFoundError:
        return None


def read_latest(run_dir: Path) -> Checkpoint | None:
    """The checkpoint `latest` names; None before the first one. A `latest` that names no checkpoint folder
    is an error (the writer renames the folder into place before it moves `latest`)."""
    found = _pointer(run_dir)
    if found is None:
        return None
    pointer, name = found
    step = parse_checkpoint_name(name)
    path = Path(run_dir) / name
    if step is None or not path.is_dir():
        raise ConfigError(f"{pointer} points to {name or 'nothing'}, which is missing or incomplete; "
                          "the run directory was edited by hand?")
    return Checkpoint(step, path)


def _latest_step(run_dir: Path) -> int | None:
    """The step `latest` names (the folder not looked at), None without a `latest`."""
    found = _pointer(run_dir)
    return None if found is None else parse_checkpoint_name(found[1])


def list_checkpoints(run_dir: Path) -> list[Checkpoint]:
    """The finished checkpoints, by step (see the module docstring)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    last = _latest_step(run_dir)
    found = []
    for path in run_dir.iterdir():
        step = parse_checkpoint_name(path.name)
        if step is not None and path.name == checkpoint_name(step) and path.is_dir() and (last is None or step <= last):
            found.append(Checkpoint(step, path))
    return sorted(found, key=lambda c: c.step)


def find_checkpoint(run_dir: Path, step: int) -> Checkpoint | None:
    """The finished checkpoint of `step`, None when there is none."""
    path = Path(run_dir) / checkpoint_name(step)
    last = _latest_step(run_dir)
    if not path.is_dir() or (last is not None and step > last):
        return None
    return Checkpoint(step, path)


def read_policy(run_dir: Path) -> Checkpoint | None:
    """The adapter policy/latest names (opd-train --share-policy), None when there is none or its folder is gone."""
    try:
        name = (Path(run_dir) / POLICY / LATEST).read_text().strip()
    except OSError:
        return None
    m = POLICY_RE.fullmatch(name)
    path = Path(run_dir) / POLICY / name
    if m is None or not path.is_dir():
        return None
    return Checkpoint(int(m.group(1)), path)


class RunReader:
    """A reader's view of a run directory that opd-train is writing now (opd-rollout --follow): its config.json
    (parsed again only when the file changed: a follower looks every 20 ms), `latest`, policy/latest and
    reader.json."""

    def __init__(self, run_dir: Path | str):
        self.path = Path(run_dir)
        self._config: tuple[tuple[int, int], dict] | None = None  # ((mtime_ns, size), config) last parsed
        self._latest: Checkpoint | None = None
        self.before = self.reader_text()  # a reader.json already there is a previous (killed) trainer's
        self.policy_before = self.policy_text()  # likewise policy/latest (the restarted trainer clears it)

    def config(self) -> dict:
        """The trainer's resolved options (config.json's "config"; {} before the file exists)."""
        path = self.path / CONFIG
        try:
            stat = path.stat()
        except OSError:
            return {}
        key = (stat.st_mtime_ns, stat.st_size)
        if self._config is None or self._config[0] != key:
            self._config = (key, json.loads(path.read_text())["config"])
        return self._config[1]

    def latest(self) -> Checkpoint | None:
        """The checkpoint `latest` names. While it names a folder this machine does not see yet (a shared
        filesystem's client may see the new `latest` first), the one seen before."""
        try:
            self._latest = read_latest(self.path)
        except ConfigError:
            pass
        return self._latest

    def policy_text(self) -> str | None:
        try:
            return (self.path / POLICY / LATEST).read_text()
        except OSError:
            return None

    def policy(self) -> Checkpoint | None:
        """The newest shared adapter (opd-train --share-policy) of the trainer running now: None before its
        first, and while policy/latest is the one a previous (killed) trainer left."""
        if self.policy_before is not None:
            if self.policy_text() == self.policy_before:
                return None
            self.policy_before = None
        return read_policy(self.path)

    def newest(self) -> Checkpoint | None:
        """The newest adapter a follower may sample with: the shared policy or the checkpoint `latest` names,
        whichever is of the later step (the policy on a tie: it is in memory)."""
        latest, policy = self.latest(), self.policy()
        if policy is not None and (latest is None or policy.step >= latest.step):
            return policy
        return latest

    def reader_text(self) -> str | None:
        try:
            return (self.path / READER).read_text()
        except OSError:
            return None

    def reader(self) -> dict:
        """The trainer's reader.json, written each time its input runs dry ({} when absent, unreadable or
        left by a previous trainer)."""
        text = self.reader_text()
        if text is None or text == self.before:
            return {}
        try:
            state = json.loads(text)
        except ValueError:
            return {}
        return state if isinstance(state, dict) else {}


# ------------------------------------------------------------------------------ writing


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to a hidden temporary file next to `path`, fsync it, then rename it onto `path`."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_write_text(path: Path, text: str) -> None:
    """atomic_write_bytes of `text` in UTF-8."""
    atomic_write_bytes(path, text.encode())


def fsync_tree(path: Path) -> None:
    """fsync every file under `path`, then the folder itself (before it is renamed into place)."""
    for p in sorted(Path(path).rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
