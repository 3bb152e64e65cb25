"""Record streams: readers for stdin, files and shard directories; writers to stdout or shards.

Inputs: ``-`` (stdin), ``*.jsonl`` or ``*.jsonl.zst`` files (zstd is detected by its magic bytes,
not by the name), or a shard directory written by an opd tool (its ``manifest.json`` is required
and every shard's sha256 and record count are checked before its records are read); or a table
(opd_common.tables): parquet files and folders, datasets' save_to_disk folders, hf://datasets/ ids.

Outputs: stdout (one record per line, flushed per batch so pipes overlap), optionally zstd
(``--compress``); or ``--out DIR``: ``NAME-00000.jsonl.zst`` shards of ``--shard-size`` records,
each written to ``*.tmp`` and renamed when its zstd frame is complete, then ``manifest.json``
written last (also atomically). A directory without a manifest is, by definition, unfinished.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import os
import queue
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import orjson
import zstandard

from . import __version__
from .errors import RecordError, StreamError
from .records import SCHEMA, Where, pack_tree, plain_tree, unpack_tree, validate
from .rundir import atomic_write_bytes

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
MANIFEST = "manifest.json"
PROGRESS = "progress.json"  # shards completed so far, while a resumable writer runs
RESUME_IGNORED = ("resume", "overwrite", "quiet")
ENCODINGS = ("packed", "json")
TABLE_KINDS = ("parquet", "parquet-dir", "dataset", "hub")  # opd_common.tables


# --------------------------------------------------------------------------- encoding


def encode(rec: dict, encoding: str = "packed") -> bytes:
    """One record as one JSON line (with the trailing newline)."""
    if encoding == "packed":
        return orjson.dumps(pack_tree(rec)) + b"\n"
    return orjson.dumps(plain_tree(rec)) + b"\n"


def decode_line(line: bytes, where: Where | str) -> Any:
    try:
        return unpack_tree(orjson.loads(line))
    except orjson.JSONDecodeError as exc:
        raise RecordError(f"{where} is not valid JSON ({exc.msg} at column {exc.colno})") from None
    except (ValueError, TypeError, KeyError) as exc:
        raise RecordError(f"{where} has a malformed packed array ({exc})") from None


# --------------------------------------------------------------------------- reading


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


class _HashingReader(io.RawIOBase):
    """Wraps a binary stream and hashes what passes through (for stdin's input hash)."""

    def __init__(self, raw: IO[bytes]):
        self._raw = raw
        self.sha = hashlib.sha256()

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        data = self._raw.read1(len(buf)) if hasattr(self._raw, "read1") else self._raw.read(len(buf))
        n = len(data)
        buf[:n] = data
        self.sha.update(data)
        return n


def _chunks(stream: IO[bytes], size: int = 1 << 16) -> Iterator[bytes]:
    """Chunks of a binary stream as they arrive (read1: never waits for a full buffer)."""
    buffered = stream if isinstance(stream, io.BufferedReader) else io.BufferedReader(stream)
    while chunk := buffered.read1(size):
        yield chunk


def _unzstd(chunks: Iterator[bytes]) -> Iterator[bytes]:
    """Decompress zstd frames chunk by chunk, yielding whatever output each chunk completes."""
    dobj = zstandard.ZstdDecompressor().decompressobj(read_across_frames=True)
    for chunk in chunks:
        if out := dobj.decompress(chunk):
            yield out


def _lines(stream: IO[bytes]) -> Iterator[bytes]:
    """Lines of a binary stream, transparently decompressing zstd (detected by magic bytes).

    Works chunk by chunk, so a line is yielded as soon as its bytes (or, for zstd, its flushed
    block) arrive: a pipe overlaps with its producer. A pipe may deliver the first bytes in
    pieces, so the magic bytes are looked for only once 4 bytes (or end of input) are in.
    """
    chunks = _chunks(stream)
    head = b""
    for chunk in chunks:
        head += chunk
        if len(head) >= 4:
            break
    data = itertools.chain([head], chunks)
    if head[:4] == ZSTD_MAGIC:
        data = _unzstd(data)
    parts: list[bytes] = []
    for chunk in data:
        *complete, rest = chunk.split(b"\n")
        if complete:
            complete[0] = b"".join([*parts, complete[0]])
            parts = []
            for line in complete:
                if line.strip():
                    yield line
        parts.append(rest)
    last = b"".join(parts)
    if last.strip():
        yield last


def reader_gone(stream=None) -> bool:
    """True when `stream` (default stdout) is a pipe whose reading end has been closed: the next write would fail
    with EPIPE. A process that waits before writing (opd-rollout --follow) asks this to leave at once when the rest
    of its pipeline has gone, instead of after its timeout. False for files, terminals and in-memory streams."""
    import select

    try:
        fd = (stream or sys.stdout).fileno()
    except (AttributeError, ValueError, OSError, io.UnsupportedOperation):
        return False
    poller = select.poll()
    poller.register(fd, 0)  # POLLERR and POLLHUP are reported whatever the mask
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))


@dataclass
class InputSource:
    """One input as given on the command line, with the hash that goes into a manifest."""

    spec: str
    kind: str  # "stdin" | "file" | "dir" | "bundled" | a TABLE_KINDS kind (sha256: see tables.table_sha256)
    sha256: str | None = None

    def describe(self) -> dict[str, Any]:
        return {"input": self.spec, "kind": self.kind, "sha256": self.sha256}


def _read_manifest(path: Path) -> dict:
    mpath = path / MANIFEST
    if not mpath.exists():
        shards = sorted(p.name for p in path.iterdir() if ".jsonl" in p.name)
        hint = f" ({len(shards)} shard file(s) present)" if shards else ""
        raise StreamError(
            f"{path} has no {MANIFEST}: the tool that wrote it did not finish{hint}; "
            "re-run it (with --overwrite) or read the shard files directly"
        )
    try:
        manifest = json.loads(mpath.read_text())
        shards = manifest["shards"]
    except (ValueError, KeyError) as exc:
        raise StreamError(f"{mpath} is not a valid opd manifest ({exc})") from None
    return manifest | {"shards": shards}


def _verify_shard(directory: Path, shard: dict) -> Path:
    spath = directory / shard["file"]
    if not spath.exists():
        raise StreamError(f"{directory}/{MANIFEST} lists {shard['file']}, which is missing")
    digest = sha256_file(spath)
    if digest != shard["sha256"]:
        raise StreamError(
            f"{spath}: sha256 {digest[:12]}... disagrees with {MANIFEST} ({shard['sha256'][:12]}...); "
            "the shard was modified or corrupted after it was written"
        )
    return spath


def iter_dir(directory: Path, check: bool = True) -> Iterator[tuple[Any, Where]]:
    manifest = _read_manifest(directory)
    for shard in manifest["shards"]:
        spath = _verify_shard(directory, shard)
        count = 0
        with open(spath, "rb") as f:
            for count, (rec, where) in enumerate(_iter_stream(f, spath.name, check), start=1):  # noqa: B007 (count is checked after the loop)
                yield rec, where
        if count != shard["records"]:
            raise StreamError(f"{spath}: has {count} records but {MANIFEST} says {shard['records']}")


def _iter_stream(stream: IO[bytes], name: str, check: bool) -> Iterator[tuple[Any, Where]]:
    for number, line in enumerate(_lines(stream), start=1):
        where = Where(name, number)
        rec = decode_line(line, where)
        yield (validate(rec, where) if check else rec), where


def resolve_input(spec: str) -> InputSource:
    if spec == "-":
        return InputSource(spec, "stdin")
    from .tables import parse_table_spec, table_sha256

    table = parse_table_spec(spec)
    if table is not None:
        return InputSource(spec, table.kind, table_sha256(table))
    path = Path(spec)
    if path.is_dir():
        manifest_hash = sha256_file(path / MANIFEST) if (path / MANIFEST).exists() else None
        return InputSource(spec, "dir", manifest_hash)
    if path.is_file():
        return InputSource(spec, "file", sha256_file(path))  # up front: a reader may stop early
    raise StreamError(f"input {spec!r} does not exist (expected '-', a .jsonl/.jsonl.zst or .parquet file, a shard, "
                      "parquet or datasets save_to_disk directory, or hf://datasets/ORG/NAME[@REV][:SPLIT])")


def iter_inputs(specs: Iterable[str], check: bool = True, sources: list[InputSource] | None = None
                ) -> Iterator[tuple[Any, Where]]:
    """Yield (record, where) from every input in order; no specs means stdin.

    With check=True records are validated against the schema (opd records); with check=False
    they are only parsed (prompt rows, foreign JSONL). `sources` (if given) collects one
    InputSource per input with its sha256: a file's bytes or a directory's manifest.json,
    hashed when the input is opened; stdin's bytes, filled in once stdin is fully read.
    """
    for spec in list(specs) or ["-"]:
        src = resolve_input(spec)
        if sources is not None:
            sources.append(src)
        if src.kind in TABLE_KINDS:
            yield from _iter_table(spec, check)
        elif src.kind == "dir":
            yield from iter_dir(Path(spec), check)
        elif src.kind == "stdin":
            hashing = _HashingReader(sys.stdin.buffer)
            yield from _iter_stream(hashing, "<stdin>", check)
            src.sha256 = hashing.sha.hexdigest()
        else:
            with open(spec, "rb") as raw:
                yield from _iter_stream(raw, Path(spec).name, check)


def _iter_table(spec: str, check: bool) -> Iterator[tuple[Any, Where]]:
    from .tables import iter_table, parse_table_spec

    for row, where in iter_table(parse_table_spec(spec)):
        yield (validate(row, where) if check else row), where


# --------------------------------------------------------------------------- writing


class StreamWriter:
    """Records to a binary stream (stdout by default), optionally zstd-compressed, flushed often."""

    def __init__(self, stream: IO[bytes] | None = None, encoding: str = "packed", compress: bool = False):
        self._stream = stream if stream is not None else sys.stdout.buffer
        self._encoding = encoding
        self._zstd = zstandard.ZstdCompressor(level=3).stream_writer(self._stream, closefd=False) if compress else None
        self.count = 0
        self.resumed = 0

    def write(self, rec: dict) -> None:
        data = encode(rec, self._encoding)
        (self._zstd or self._stream).write(data)
        self.count += 1

    def flush(self) -> None:
        if self._zstd is not None:
            self._zstd.flush(zstandard.FLUSH_BLOCK)
        self._stream.flush()

    def close(self, ok: bool = True) -> None:
        if self._zstd is not None:
            self._zstd.flush(zstandard.FLUSH_FRAME)
        try:
            self._stream.flush()
        except BrokenPipeError:  # the reader went away (e.g. `| head`); nothing more to do
            pass

    def __enter__(self) -> StreamWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(ok=exc_type is None)


class BackgroundWriter:
    """Writes batches of records in a thread, so that the producer (opd-rollout's engine loop) goes on while the
    next stage has not read the last batch yet: a batch is larger than a pipe's buffer, and the reader of a loop
    (opd-train) reads a step's records only when the step before is done. `put` hands a batch over and blocks
    only while `depth` batches already wait; batches are written in order, each flushed. A write's error
    (BrokenPipeError when the reader has gone) is raised by the next `put` or by `close`, which waits until
    every batch handed over is written: records made before a failure are not lost (as a context manager it
    closes on the way out, and a failure in the block stays the one reported). `depth` batches wait at most,
    besides the one being written. `on_broken_pipe` is called in the thread when the reader has gone (the CLIs leave at
    once: their main thread may be blocked reading input that will not come)."""

    _DONE = object()

    def __init__(self, writer, depth: int = 1, tool: str | None = None, on_broken_pipe=None):
        from .timeline import timeline

        self.writer, self._on_broken_pipe = writer, on_broken_pipe
        self._timeline = timeline(tool) if tool else None  # made here: the thread only writes its spans
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="opd-record-writer", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is self._DONE:
                return
            if self._error is not None:
                continue  # keep taking batches, so that put() never waits on a writer that has failed
            records, fields = item
            try:
                if self._timeline is None:
                    self._write(records)
                else:
                    with self._timeline.span("write", **fields):
                        self._write(records)
            except BaseException as exc:  # noqa: BLE001 - raised again in the producer's thread
                self._error = exc
                if isinstance(exc, BrokenPipeError) and self._on_broken_pipe is not None:
                    self._on_broken_pipe()  # the producer may be blocked on its input: it would never see it

    def _write(self, records) -> None:
        for rec in records:
            self.writer.write(rec)
        self.writer.flush()

    def put(self, records: list[dict], **fields) -> None:
        """Queue one batch (`fields`: the timeline's `write` span fields)."""
        self.check()
        self._queue.put((records, fields))

    def check(self) -> None:
        """Raise a write's error now (before making another batch nobody will read)."""
        if self._error is not None:
            raise self._error

    def close(self, raise_error: bool = True) -> None:
        if self._thread.is_alive():
            self._queue.put(self._DONE)
            self._thread.join()
        if raise_error:
            self.check()

    def __enter__(self) -> BackgroundWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(raise_error=exc_type is None)


@dataclass
class ManifestInfo:
    """What a tool states about its output: itself, its resolved config, its inputs."""

    tool: str
    config: dict[str, Any] = field(default_factory=dict)
    inputs: list[InputSource] = field(default_factory=list)


def prepare_out_dir(out_dir: Path, overwrite: bool, resumable: bool = False) -> None:
    """Create --out DIR; refuse to mix with an earlier output unless overwrite is set."""
    if out_dir.exists() and not out_dir.is_dir():
        raise StreamError(f"--out {out_dir} exists and is not a directory")
    out_dir.mkdir(parents=True, exist_ok=True)
    old = [p for p in out_dir.iterdir() if p.name in (MANIFEST, PROGRESS) or ".jsonl" in p.name]
    if old and not overwrite:
        if (out_dir / MANIFEST).exists():
            state, fix = "a finished output", "pass --overwrite"
        else:
            state = "an unfinished output (no manifest)"
            fix = "pass --resume to continue it, --overwrite to start again," if resumable else "pass --overwrite"
        raise StreamError(f"--out {out_dir} already holds {state}; {fix} or choose another directory")
    for p in old:
        p.unlink()


def _config_diff(old: dict, new: dict) -> list[str]:
    keys = (set(old) | set(new)) - set(RESUME_IGNORED)
    return sorted(k for k in keys if old.get(k) != new.get(k))


class ShardWriter:
    """Records to NAME-00000.jsonl.zst shards in a directory; manifest.json written last."""

    def __init__(self, out_dir: Path | str, info: ManifestInfo, name: str = "records",
                 shard_size: int = 1000, encoding: str = "packed", overwrite: bool = False,
                 resume: bool = False, resumable: bool = False):
        if shard_size < 1:
            raise StreamError(f"--shard-size must be >= 1, got {shard_size}")
        self.dir = Path(out_dir)
        self.info, self.name, self.shard_size, self.encoding = info, name, shard_size, encoding
        self.resumable = resumable or resume
        self.shards: list[dict[str, Any]] = []
        self.count = 0
        if resume and self.dir.is_dir():
            self._recover()
        else:
            prepare_out_dir(self.dir, overwrite, self.resumable)
        self.resumed = self.count  # records already written by an interrupted run (skip as many inputs)
        self._file: IO[bytes] | None = None
        self._zstd = None
        self._in_shard = 0
        self._hash = None
        self._started = time.time()

    def _open(self) -> None:
        final = self.dir / f"{self.name}-{len(self.shards):05d}.jsonl.zst"
        self._final = final
        self._file = open(final.with_name(final.name + ".tmp"), "wb")
        self._zstd = zstandard.ZstdCompressor(level=3).stream_writer(self._file, closefd=False)
        self._in_shard = 0

    def _close_shard(self) -> None:
        assert self._file is not None and self._zstd is not None
        self._zstd.flush(zstandard.FLUSH_FRAME)
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        tmp = self._final.with_name(self._final.name + ".tmp")
        digest = sha256_file(tmp)
        os.replace(tmp, self._final)
        self.shards.append({"file": self._final.name, "records": self._in_shard, "sha256": digest,
                            "bytes": self._final.stat().st_size})
        self._file = self._zstd = None
        if self.resumable:  # after the rename: a shard not listed here is redone on --resume
            progress = {"config": self.info.config, "shards": self.shards}
            atomic_write_bytes(self.dir / PROGRESS, json.dumps(progress, indent=2, default=str).encode())

    def _recover(self) -> None:
        """Continue an interrupted run: keep the shards progress.json lists, drop anything else."""
        if (self.dir / MANIFEST).exists():
            raise StreamError(f"--out {self.dir} is already complete ({MANIFEST}); nothing to resume")
        progress = {"config": self.info.config, "shards": []}
        if (self.dir / PROGRESS).exists():
            progress = json.loads((self.dir / PROGRESS).read_text())
        changed = _config_diff(progress["config"], json.loads(json.dumps(self.info.config, default=str)))
        if changed:
            raise StreamError(f"--resume: the options differ from the interrupted run's ({', '.join(changed)}); "
                              "rerun with the same options, or --overwrite to start again")
        for shard in progress["shards"]:
            _verify_shard(self.dir, shard)
        keep = {shard["file"] for shard in progress["shards"]}
        for path in self.dir.iterdir():
            if ".jsonl" in path.name and path.name not in keep:
                path.unlink()
        self.shards = list(progress["shards"])
        self.count = sum(shard["records"] for shard in self.shards)

    def write(self, rec: dict) -> None:
        if self._file is None:
            self._open()
        self._zstd.write(encode(rec, self.encoding))
        self._in_shard += 1
        self.count += 1
        if self._in_shard >= self.shard_size:
            self._close_shard()

    def flush(self) -> None:
        pass  # shards become visible only when complete

    def close(self, ok: bool = True) -> None:
        """Finish the last shard and write the manifest; after a failure, write no manifest."""
        if not ok:
            if self._file is not None:
                self._file.close()  # the .tmp stays: evidence, never mistaken for a shard
            return
        if self._file is not None:
            self._close_shard()
        manifest = {
            "schema": SCHEMA,
            "tool": self.info.tool,
            "version": __version__,
            "config": self.info.config,
            "inputs": [s.describe() for s in self.info.inputs],
            "encoding": self.encoding,
            "records": self.count,
            "shards": self.shards,
            "started_at": _iso(self._started),
            "finished_at": _iso(time.time()),
        }
        atomic_write_bytes(self.dir / MANIFEST, json.dumps(manifest, indent=2, default=str).encode() + b"\n")
        (self.dir / PROGRESS).unlink(missing_ok=True)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(ok=exc_type is None)


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def open_writer(out: str | None, info: ManifestInfo, *, name: str = "records", shard_size: int = 1000,
                encoding: str = "packed", compress: bool = False, overwrite: bool = False,
                resume: bool = False, resumable: bool = False):
    """stdout when out is None or '-', else a ShardWriter into the directory `out`."""
    if encoding not in ENCODINGS:
        raise StreamError(f"--encoding must be one of {ENCODINGS}, got {encoding!r}")
    if out in (None, "-"):
        if resume:
            raise StreamError("--resume needs --out DIR (a stream on stdout cannot be resumed)")
        return StreamWriter(encoding=encoding, compress=compress)
    return ShardWriter(out, info, name=name, shard_size=shard_size, encoding=encoding, overwrite=overwrite,
                       resume=resume, resumable=resumable)
