"""push / verify / pull: pure functions over a RunDir and a Target (flags are in cli.py).

A checkpoint is published in two commits: its folder (files + sha256sums.txt), then, once every
remote file's size and sha256 match, checkpoint_index.json (and README.md). A failure in between
leaves a folder that is not in the index: unpublished by definition, and completed by re-running
the same push. Published folders are immutable: same content is a no-op, other content an error.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

from opd_common.errors import ConfigError, OpdError, StreamError
from opd_common.rundir import checkpoint_name

from .card import render_card
from .layout import CARD, INDEX, RESUME_DIR, RESUME_FILES, SUMS, LocalCheckpoint, Manifest, RunDir, sha256_bytes
from .repo import Target

log = logging.getLogger("opd-publish")
FORMAT = "opd-checkpoint-index/1"
RETRY = "nothing unverified was added to checkpoint_index.json; run the same push again to resume"


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@contextlib.contextmanager
def guard(target: Target, what: str):
    """Turn a transport failure (OSError, HTTP error) into one clear StreamError."""
    try:
        yield
    except OpdError:
        raise
    except target.errors as exc:
        detail = " ".join(str(exc).split())  # one line (HTTP errors span several)
        raise StreamError(f"{target.url}: {what} failed ({type(exc).__name__}: {detail}); {RETRY}") from None


def read_index(target: Target, files: dict[str, int] | None = None) -> dict[str, Any]:
    files = target.list_files() if files is None else files
    if INDEX not in files:
        return {"format": FORMAT, "repo": target.url, "checkpoints": [], "latest_resume": None}
    try:
        index = json.loads(target.read(INDEX))
        index["checkpoints"]
    except (ValueError, KeyError, TypeError) as exc:
        raise StreamError(f"{target.url}/{INDEX} is not a valid checkpoint index ({exc})") from None
    return index


def check_folder(target: Target, prefix: str, manifest: dict[str, str], sizes: dict[str, int] | None,
                 files: dict[str, int]) -> list[str]:
    """Problems with a remote folder against name -> sha256 (and name -> size); [] when it verifies."""
    problems = []
    for name, sha in sorted(manifest.items()):
        path = prefix + name
        if path not in files:
            problems.append(f"{path} is missing")
            continue
        if sizes is not None and name in sizes and files[path] != sizes[name]:
            problems.append(f"{path} has {files[path]} bytes, expected {sizes[name]}")
            continue
        remote = target.sha256(path)
        if remote != sha:
            problems.append(f"{path} has sha256 {remote[:12]}..., expected {sha[:12]}... (corrupted or changed)")
    return problems


def _upload_folder(target: Target, prefix: str, local: dict[str, Path], m: Manifest, files: dict[str, int],
                   message: str) -> str:
    """Commit the files that are not already there intact; returns the commit holding the folder."""
    adds: dict[str, Path | bytes] = {}
    for name, (sha, size) in m.files.items():
        path = prefix + name
        if path in files and files[path] == size and target.sha256(path) == sha:
            continue  # left by an interrupted push, intact
        adds[path] = local[name]
    sums = m.text.encode()
    if files.get(prefix + SUMS) != len(sums) or adds or target.read(prefix + SUMS) != sums:
        adds[prefix + SUMS] = sums
    if not adds:
        return target.head()
    with guard(target, f"upload of {prefix.rstrip('/')}"):
        return target.commit(adds, message)


def _verify_upload(target: Target, prefix: str, m: Manifest) -> None:
    with guard(target, f"listing {prefix.rstrip('/')} after upload"):
        files = target.list_files()
        problems = check_folder(target, prefix,
                                {n: s for n, (s, _) in m.files.items()} | {SUMS: sha256_bytes(m.text.encode())},
                                {n: z for n, (_, z) in m.files.items()}, files)
    if problems:
        raise StreamError(f"{target.url}: {prefix.rstrip('/')} did not verify after upload: {'; '.join(problems[:3])}"
                          f"{' ...' if len(problems) > 3 else ''}; it is not in {INDEX}; run the same push again")


def _check_leftover(target: Target, prefix: str, m: Manifest, files: dict[str, int]) -> None:
    """A folder not in the index (an interrupted push): refuse it if it holds other content."""
    if prefix + SUMS in files:
        if target.read(prefix + SUMS).decode(errors="replace") != m.text:
            raise StreamError(f"{target.url}: {prefix.rstrip('/')} exists with a different {SUMS} than the local "
                              "checkpoint (not in the index: another run's interrupted push?); checkpoints are never "
                              "overwritten: publish to another repo or remove that folder by hand")
    extra = sorted(p for p in files if p.startswith(prefix) and p[len(prefix):] not in m.files and p != prefix + SUMS)
    if extra:
        raise StreamError(f"{target.url}: {prefix.rstrip('/')} holds files the local checkpoint lacks "
                          f"({extra[0]}, ...); "
                          "checkpoints are never overwritten: publish to another repo")


def _commit_index(target: Target, index: dict, run: RunDir, message: str) -> None:
    data = (json.dumps(index, indent=1, sort_keys=True) + "\n").encode()
    card = render_card(run, index).encode()
    with guard(target, f"writing {INDEX}"):
        target.commit({INDEX: data, CARD: card}, message)
        if target.sha256(INDEX) != sha256_bytes(data):
            raise StreamError(f"{target.url}: {INDEX} did not verify after upload; run the same push again")


def push_checkpoint(target: Target, run: RunDir, ck: LocalCheckpoint, index: dict) -> dict[str, Any]:
    m = ck.manifest()
    published = {e["step"]: e for e in index["checkpoints"]}
    if ck.step in published:
        old = published[ck.step]["manifest_sha256"]
        if old == m.sha256:
            return {"step": ck.step, "status": "unchanged", "commit": published[ck.step]["commit"],
                    "manifest_sha256": m.sha256}
        raise StreamError(f"{target.url}: {ck.name} is already published with different content (manifest sha256 "
                          f"{old[:12]}..., local {m.sha256[:12]}...); published checkpoints are immutable: "
                          "push this run to a new repo")
    prefix = ck.name + "/"
    with guard(target, "listing the repo"):
        files = target.list_files()
        _check_leftover(target, prefix, m, files)
        commit = _upload_folder(target, prefix, ck.files(), m, files, f"Add {ck.name}")
    _verify_upload(target, prefix, m)
    entry = {"step": ck.step, "path": ck.name, "commit": commit, "manifest_sha256": m.sha256,
             "files": {n: z for n, (_, z) in sorted(m.files.items())},
             "metrics": run.metrics().get(ck.step, ck.state().get("metrics", {})), "completed_at": _now()}
    index["checkpoints"] = sorted([*index["checkpoints"], entry], key=lambda e: e["step"])
    _commit_index(target, index, run, f"Index {ck.name} (verified)")
    log.info("published %s at %s", ck.name, commit[:12])
    return {"step": ck.step, "status": "published", "commit": commit, "manifest_sha256": m.sha256}


def push_resume_state(target: Target, run: RunDir, index: dict) -> dict[str, Any]:
    latest = run.latest()
    if latest is None or not all((latest.path / f).exists() for f in RESUME_FILES):
        raise ConfigError(f"--with-resume-state: {run.path}/latest has no {' and '.join(RESUME_FILES)}")
    local = {f: latest.path / f for f in RESUME_FILES}
    m = Manifest.of_files(local)
    old = index.get("latest_resume")
    if old and old["manifest_sha256"] == m.sha256:
        return {"resume_step": latest.step, "status": "unchanged", "commit": old["commit"]}
    if old:  # about to replace it: the index must never point at a half-written folder
        index["latest_resume"] = None
        _commit_index(target, index, run, "Unindex latest-resume (being replaced)")
    prefix = RESUME_DIR + "/"
    with guard(target, "listing the repo"):
        commit = _upload_folder(target, prefix, local, m, target.list_files(), f"Resume state of {latest.name}")
    _verify_upload(target, prefix, m)
    index["latest_resume"] = {"step": latest.step, "path": RESUME_DIR, "commit": commit,
                              "manifest_sha256": m.sha256, "files": {n: z for n, (_, z) in m.files.items()},
                              "completed_at": _now()}
    _commit_index(target, index, run, f"Index latest-resume ({latest.name}, verified)")
    return {"resume_step": latest.step, "status": "published", "commit": commit}


def push(run_dir: Path, target: Target, checkpoints: str = "all", with_resume_state: bool = False,
         private: bool = False) -> list[dict[str, Any]]:
    run = RunDir(run_dir)
    selected = run.select(checkpoints)
    with guard(target, "opening the repo"):
        target.ensure(private)
        index = read_index(target)
    results = [push_checkpoint(target, run, ck, index) for ck in selected]
    if with_resume_state:
        results.append(push_resume_state(target, run, index))
    return results


def verify(target: Target, local: Path | None = None) -> list[dict[str, Any]]:
    """Check every indexed folder on the target (and, with local, against the run dir)."""
    with guard(target, "listing the repo"):
        files = target.list_files()
    if INDEX not in files:
        raise StreamError(f"{target.url}: no {INDEX}; nothing was published there (or the push never finished one)")
    index = read_index(target, files)
    entries = list(index["checkpoints"]) + ([index["latest_resume"]] if index.get("latest_resume") else [])
    results, problems = [], []
    local_ckpts = {c.step: c for c in RunDir(local).checkpoints()} if local else {}
    for e in entries:
        prefix = e["path"] + "/"
        with guard(target, f"reading {prefix}{SUMS}"):
            if prefix + SUMS not in files:
                found = [f"{prefix}{SUMS} is missing"]
            else:
                sums = target.read(prefix + SUMS)
                found = [] if sha256_bytes(sums) == e["manifest_sha256"] else [
                    f"{prefix}{SUMS} differs from the index's manifest_sha256"]
                found += check_folder(target, prefix, Manifest.parse(sums.decode(), f"{prefix}{SUMS}"),
                                      e.get("files"), files)
        if local and e["path"] != RESUME_DIR:
            ck = local_ckpts.get(e["step"])
            if ck is None:
                found.append(f"{e['path']} is not in --local {local}")
            elif ck.manifest().sha256 != e["manifest_sha256"]:
                found.append(f"{e['path']} differs from --local {ck.path}")
        problems += found
        results.append({"path": e["path"], "step": e["step"], "ok": not found, "problems": found})
    indexed = {e["path"] for e in entries}
    for folder in sorted({p.split("/")[0] for p in files if "/" in p} - indexed):
        log.warning("%s/ is on the target but not in %s (an unfinished push): not published", folder, INDEX)
    if local:
        for step in sorted(set(local_ckpts) - {e["step"] for e in index["checkpoints"]}):
            log.warning("%s is in --local but not published", checkpoint_name(step))
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise VerifyError(f"{target.url} failed verification: {'; '.join(problems[:3])}{more}", results)
    return results


class VerifyError(StreamError):
    def __init__(self, message: str, results: list[dict[str, Any]]):
        super().__init__(message)
        self.results = results


def pull(target: Target, checkpoint: str, dest: Path) -> dict[str, Any]:
    """Download an indexed checkpoint into dest (created; must not hold files), verifying every sha256."""
    with guard(target, "reading the index"):
        index = read_index(target)
    by_step = {e["step"]: e for e in index["checkpoints"]}
    if not by_step:
        raise StreamError(f"{target.url}: no published checkpoints ({INDEX} is missing or empty)")
    try:
        step = max(by_step) if checkpoint == "latest" else int(checkpoint)
    except ValueError:
        raise ConfigError(f"--checkpoint must be a step number or 'latest', got {checkpoint!r}") from None
    if step not in by_step:
        raise StreamError(f"{target.url}: {checkpoint_name(step)} is not published "
                          f"(published steps: {sorted(by_step)})")
    entry = by_step[step]
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise ConfigError(f"DIR {dest} already exists and is not empty; give a new directory")
    tmp = dest.with_name(f".{dest.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    prefix = entry["path"] + "/"
    try:
        with guard(target, f"downloading {entry['path']}"):
            sums = target.read(prefix + SUMS)
            if sha256_bytes(sums) != entry["manifest_sha256"]:
                raise StreamError(f"{target.url}: {prefix}{SUMS} differs from the index's manifest_sha256; not pulled")
            manifest = Manifest.parse(sums.decode(), prefix + SUMS)
            for name, sha in manifest.items():
                out = tmp / name
                out.parent.mkdir(parents=True, exist_ok=True)
                target.download(prefix + name, out)
                got = Manifest.of_files({name: out}).files[name][0]
                if got != sha:
                    raise StreamError(f"{target.url}: {prefix}{name} has sha256 {got[:12]}..., expected {sha[:12]}... "
                                      "(corrupted on the target); nothing was written to DIR")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    (tmp / SUMS).write_bytes(sums)
    if dest.exists():
        dest.rmdir()
    tmp.rename(dest)
    return {"step": step, "path": str(dest), "commit": entry["commit"], "manifest_sha256": entry["manifest_sha256"],
            "files": len(manifest)}
