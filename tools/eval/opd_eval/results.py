"""The results file (one JSON, written atomically) and its progress sidecar (docs/eval.md).

While an evaluation runs, each finished chunk of graded samples is appended to
``OUT.progress.jsonl`` (first line: a header with what is being measured; then one sample row per
line; flushed and fsynced per chunk). ``--resume`` reads it back, checks the header against the
new run, drops a torn last line and continues with the samples not yet there. When every sample
is in, the results JSON is written to a temporary name and renamed, then the sidecar removed.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Any

import orjson

from opd_common.errors import ConfigError, StreamError
from opd_common.rundir import ADAPTER_CONFIG, ADAPTER_WEIGHTS

SCHEMA = "opd-eval/1"
PROGRESS_SUFFIX = ".progress.jsonl"
# Model files whose bytes define the model (weights, config, tokenizer, chat template).
MODEL_SUFFIXES = (".safetensors", ".bin", ".json", ".txt", ".model", ".jinja", ".tiktoken")
ADAPTER_FILES = (ADAPTER_WEIGHTS, "adapter_model.bin", ADAPTER_CONFIG)  # peft's files (.bin: older adapters)


# ------------------------------------------------------------------------------------ hashes


def tree_sha256(folder: Path, names: list[str]) -> str:
    """sha256 over 'relative path<TAB>sha256 of the file' lines, in sorted path order."""
    from opd_common.streams import sha256_file

    h = hashlib.sha256()
    for name in sorted(names):
        h.update(f"{name}\t{sha256_file(folder / name)}\n".encode())
    return h.hexdigest()


def model_identity(model: str, revision: str | None) -> dict[str, Any]:
    """{ref, revision, sha256, files}: sha256 over the model folder's weight, config and tokenizer
    files (a Hub id is hashed from the local Hub cache when it is there; else sha256 is null)."""
    folder = Path(model).expanduser()
    note = None
    if not folder.is_dir():
        folder, note = _hub_snapshot(model, revision)
    if folder is None:
        return {"ref": model, "revision": revision, "sha256": None, "files": 0, "note": note}
    names = [str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.suffix in MODEL_SUFFIXES
             and not any(part.startswith(".") for part in p.relative_to(folder).parts)]
    return {"ref": model, "revision": revision, "sha256": tree_sha256(folder, names), "files": len(names)}


def _hub_snapshot(model: str, revision: str | None) -> tuple[Path | None, str]:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, revision=revision, local_files_only=True)), ""
    except Exception:  # not installed, not cached, not a Hub id: identity by name only
        return None, "not a local folder and not in the local Hub cache: identified by name only"


def adapter_identity(path: str | None, step: int | None, run_dir: str | None) -> dict[str, Any] | None:
    if path is None:
        return None
    folder = Path(path)
    names = [name for name in ADAPTER_FILES if (folder / name).is_file()]
    return {"path": str(path), "run_dir": run_dir, "step": step, "sha256": tree_sha256(folder, names)}


# ---------------------------------------------------------------------------- progress file


def progress_path(out: Path) -> Path:
    return out.with_name(out.name + PROGRESS_SUFFIX)


def prepare_output(out: Path, resume: bool, overwrite: bool) -> Path:
    """Check --out against what is there; return the progress path (removed unless resuming)."""
    progress = progress_path(out)
    if out.is_dir():
        raise StreamError(f"--out {out} is a directory; give a file name such as {out / 'results.json'}")
    if out.exists() and not overwrite:
        raise StreamError(f"--out {out} already holds finished results; pass --overwrite or choose another file")
    if progress.exists() and not (resume or overwrite) and progress.read_bytes().count(b"\n") <= 1:
        progress.unlink()  # only a header: the earlier run stopped before its first sample (e.g. bad flags)
    if progress.exists() and not (resume or overwrite):
        raise StreamError(f"--out {out} has an unfinished evaluation ({progress.name}); pass --resume to continue "
                          "it, --overwrite to start again, or choose another file")
    if resume and not progress.exists():
        raise StreamError(f"--resume: there is no unfinished evaluation for --out {out} (no {progress.name})")
    if overwrite:
        progress.unlink(missing_ok=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    return progress


def read_progress(progress: Path) -> tuple[dict, list[dict]]:
    """(header, rows) of a progress file; a torn last line (crash mid-write) is cut off the file."""
    data = progress.read_bytes()
    complete = data[: data.rfind(b"\n") + 1]  # rows are written whole, newline last
    if len(complete) < len(data):
        with open(progress, "r+b") as f:
            f.truncate(len(complete))
    parsed = []
    for i, line in enumerate(complete.splitlines()):
        try:
            parsed.append(orjson.loads(line))
        except orjson.JSONDecodeError:
            raise StreamError(f"{progress}: line {i + 1} is not valid JSON; pass --overwrite to start "
                              "again") from None
    if not parsed or "header" not in parsed[0]:
        raise StreamError(f"{progress}: no header line (not written by opd-eval?); pass --overwrite to start again")
    return parsed[0]["header"], parsed[1:]


def check_resumable(old: dict, new: dict, progress: Path) -> None:
    """Refuse to resume with a different model, adapter, benchmark or sampling protocol."""
    diffs = []
    for key in ("sampling", "benchmark", "adapter"):
        if old.get(key) != new.get(key):
            diffs.append(key)
    old_model, new_model = old.get("model") or {}, new.get("model") or {}
    if old_model.get("ref") != new_model.get("ref") or (
            old_model.get("sha256") and new_model.get("sha256") and old_model["sha256"] != new_model["sha256"]):
        diffs.append("model")
    if diffs:
        raise ConfigError(f"--resume: {progress.name} was started with another {', '.join(diffs)}; run with the "
                          "same settings, or pass --overwrite to start again")


class ProgressWriter:
    """Appends sample rows to the progress file, durably, one chunk at a time."""

    def __init__(self, path: Path, header: dict | None):
        self.path = path
        self._f = open(path, "ab")
        if header is not None:
            self.append_lines([{"header": header}])

    def append_lines(self, rows: list[dict]) -> None:
        self._f.write(b"".join(orjson.dumps(r) + b"\n" for r in rows))
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()


# ---------------------------------------------------------------------------- results file


def write_results(out: Path, results: dict) -> None:
    from opd_common.rundir import atomic_write_bytes

    atomic_write_bytes(out, orjson.dumps(results, option=orjson.OPT_INDENT_2) + b"\n")


def read_results(path: str | Path) -> dict:
    """A results file, checked enough that compare/report can trust its fields."""
    path = Path(path)
    try:
        data = orjson.loads(path.read_bytes())
    except OSError as exc:
        raise StreamError(f"{path}: cannot read it ({exc.strerror})") from None
    except orjson.JSONDecodeError as exc:
        raise StreamError(f"{path}: not valid JSON ({exc.msg}); is it an opd-eval results file?") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise StreamError(f"{path}: not an opd-eval results file (expected \"schema\": \"{SCHEMA}\")")
    for key in ("benchmark", "sampling", "samples", "metrics"):
        if key not in data:
            raise StreamError(f"{path}: results file has no '{key}' (truncated or edited by hand?)")
    data["_path"] = str(path)
    return data


def iso_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
