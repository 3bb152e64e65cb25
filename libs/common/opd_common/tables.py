"""Tables as inputs: parquet files and folders, `datasets` folders, Hub dataset repos (README, Inputs).

An input spec names one of:

  FILE.parquet                            a parquet file (recognised by its PAR1 magic bytes too)
  DIR                                     a folder of *.parquet files (all of them, recursively, sorted by path)
  DIR  or  DIR:SPLIT                      a folder written by datasets' save_to_disk (a DatasetDict needs :SPLIT)
  hf://datasets/ORG/NAME[@REV][:SPLIT]    a dataset repo on the Hub (split default: train), streamed by datasets

Every reader streams: parquet is read one batch of BATCH_ROWS rows at a time with pyarrow's iter_batches
(memory bounded by a row group, whatever the file's size), a save_to_disk folder is memory-mapped by
datasets, a Hub dataset is read with datasets' streaming mode (nothing is downloaded up front). Rows come
out as plain dicts (structs as dicts, lists as lists) with a Where whose unit is "row". A table that cannot be
read (an empty or truncated parquet, a damaged page, a Hub file that fails mid-stream) is one StreamError
naming the input and, once rows have come out, the first row that could not be read.

A parquet written by ``opd-cat --parquet`` (metadata key ``opd``) reads back as the records it was written
from (restore).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from .errors import ConfigError, StreamError, require
from .records import Where

HUB_PREFIX = "hf://datasets/"
PARQUET_MAGIC = b"PAR1"
BATCH_ROWS = 1024
DATASET_FILES = ("state.json", "dataset_dict.json")  # what save_to_disk writes (Dataset, DatasetDict)
ABSENT = "_opd_absent"  # opd-cat --parquet: per row, the field paths the record lacked (records_parquet)
METADATA_KEY = b"opd"  # opd-cat --parquet: the schema metadata key that marks a file of records


@dataclass(frozen=True)
class TableSpec:
    spec: str
    kind: str  # "parquet" (a file) | "parquet-dir" | "dataset" (save_to_disk) | "hub"
    path: str  # the file or folder; for "hub" the repo id ORG/NAME
    split: str | None = None
    revision: str | None = None


def parse_hub(spec: str) -> TableSpec:
    """hf://datasets/ORG/NAME[@REV][:SPLIT] (split default: train)."""
    rest = spec[len(HUB_PREFIX):]
    split = None
    if ":" in rest:
        rest, split = rest.rsplit(":", 1)
    repo, _, revision = rest.partition("@")
    if repo.count("/") != 1 or not all(repo.split("/")) or (split == "") or ("@" in rest and not revision):
        raise ConfigError(f"input {spec!r}: expected hf://datasets/ORG/NAME[@REVISION][:SPLIT], "
                          "e.g. hf://datasets/HuggingFaceH4/MATH-500@main:test")
    return TableSpec(spec, "hub", repo, split or "train", revision or None)


def _is_parquet(path: Path) -> bool:
    if path.suffix == ".parquet":
        return True
    with open(path, "rb") as f:
        return f.read(4) == PARQUET_MAGIC


def _is_dataset_dir(path: Path) -> bool:
    return any((path / name).is_file() for name in DATASET_FILES)


def parse_table_spec(spec: str) -> TableSpec | None:
    """The table a spec names, or None (stdin, JSONL, shard directories, bundled names, missing paths)."""
    if spec.startswith(HUB_PREFIX):
        return parse_hub(spec)
    if spec == "-":
        return None
    path = Path(spec)
    if path.is_file():
        return TableSpec(spec, "parquet", spec) if _is_parquet(path) else None
    if path.is_dir():
        if (path / "manifest.json").exists():
            return None  # an opd shard directory
        if _is_dataset_dir(path):
            return TableSpec(spec, "dataset", spec)
        if next(path.rglob("*.parquet"), None) is not None:
            return TableSpec(spec, "parquet-dir", spec)
        return None
    base, sep, split = spec.rpartition(":")
    if sep and split and Path(base).is_dir() and _is_dataset_dir(Path(base)):
        return TableSpec(spec, "dataset", base, split=split)
    return None


# ------------------------------------------------------------------------------------- identity


def footer_sha256(path: Path) -> str:
    """sha256 of a parquet file's footer (schema, row groups, sizes, statistics): read up front without
    reading the data, so a 10 GB file's rows start flowing at once."""
    incomplete = f"{path}: not a parquet file (no PAR1 footer); was it written completely?"
    with open(path, "rb") as f:
        total = f.seek(0, 2)
        if total < 12:  # PAR1, a footer length, PAR1
            raise StreamError(incomplete)
        f.seek(-8, 2)
        tail = f.read(8)
        size = int.from_bytes(tail[:4], "little")
        if tail[4:] != PARQUET_MAGIC or size + 12 > total:
            raise StreamError(incomplete)
        f.seek(-(8 + size), 2)
        return hashlib.sha256(f.read(size + 8)).hexdigest()


def parquet_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.parquet") if p.is_file())


def table_sha256(ts: TableSpec) -> str | None:
    """The hash a manifest records for a table input: a parquet file's footer; a folder's files' footers;
    a save_to_disk folder's state.json files (they hold datasets' fingerprints); None for the Hub (the spec
    names the revision)."""
    if ts.kind == "parquet":
        return footer_sha256(Path(ts.path))
    h = hashlib.sha256()
    if ts.kind == "parquet-dir":
        for p in parquet_files(Path(ts.path)):
            h.update(f"{p.relative_to(ts.path)} {footer_sha256(p)}\n".encode())
        return h.hexdigest()
    if ts.kind == "dataset":
        for p in sorted(Path(ts.path).rglob("*.json")):
            h.update(p.read_bytes())
        return h.hexdigest()
    return None


# ------------------------------------------------------------------------------------- reading


def iter_table(ts: TableSpec) -> Iterator[tuple[dict[str, Any], Where]]:
    """(row, where) for every row of the table, streamed."""
    if ts.kind == "parquet":
        yield from iter_parquet(ts.path, Path(ts.path).name)
    elif ts.kind == "parquet-dir":
        root = Path(ts.path)
        for p in parquet_files(root):
            yield from iter_parquet(str(p), str(p.relative_to(root.parent)))
    elif ts.kind == "dataset":
        yield from _iter_rows(_load_from_disk(ts), f"{Path(ts.path).name}:{ts.split}" if ts.split else
                              Path(ts.path).name)
    else:
        yield from _iter_rows(_load_hub(ts), ts.spec)


def iter_parquet(source: str | IO[bytes], name: str, batch_rows: int = BATCH_ROWS
                 ) -> Iterator[tuple[dict[str, Any], Where]]:
    """Rows of one parquet file (a path or a binary file object), one batch of `batch_rows` at a time."""
    require("pyarrow", "data")
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        # pre_buffer (pyarrow's default) reads ahead across row groups: about the whole file stays resident
        # (docs/benchmarks.md: 2.4 GB peak on a 2 GB file, against 137 MB this way)
        pf = pq.ParquetFile(source, pre_buffer=False)
    except (pa.ArrowInvalid, OSError) as exc:
        raise StreamError(f"{name}: cannot read it as parquet ({_first_line(exc)})") from None
    records = bool(pf.schema_arrow.metadata) and METADATA_KEY in pf.schema_arrow.metadata
    number = 0
    for group in range(pf.num_row_groups):  # one row group at a time: memory bounded by the largest one
        batches = pf.iter_batches(batch_size=batch_rows, row_groups=[group])
        while True:
            try:
                batch = next(batches, None)
            except (pa.ArrowException, OSError) as exc:  # a damaged page: after the rows before it
                raise StreamError(f"row {number + 1} of {name} cannot be read (row group {group + 1} of "
                                  f"{pf.num_row_groups}: {_first_line(exc)}); is the file damaged?") from None
            if batch is None:
                break
            for row in batch.to_pylist():
                number += 1
                yield (restore(row) if records else row), Where(name, number, "row")


def restore(row: dict) -> dict:
    """A row of an `opd-cat --parquet` file -> the record it was written from (fields it lacked removed)."""
    for path in row.pop(ABSENT, None) or []:
        parent = row
        for key in path[:-1]:
            parent = parent[key]
        del parent[path[-1]]
    return row


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def _iter_rows(rows, name: str) -> Iterator[tuple[dict[str, Any], Where]]:
    """Rows of a datasets Dataset or IterableDataset; a failure while reading (a damaged file, the network
    for a streamed Hub dataset) is one error naming the input and the last row read."""
    it = iter(rows)
    number = 0
    while True:
        try:
            row = next(it, None)
        except Exception as exc:  # noqa: BLE001 (datasets, fsspec, pyarrow, huggingface_hub raise many kinds)
            raise StreamError(f"row {number + 1} of {name} cannot be read ({_first_line(exc)})") from None
        if row is None:
            return
        number += 1
        yield row, Where(name, number, "row")


def _load_from_disk(ts: TableSpec):
    require("datasets", "data")
    import datasets

    where = f"input {ts.path}"
    try:
        obj = datasets.load_from_disk(ts.path)
    except (FileNotFoundError, ValueError, json.JSONDecodeError) as exc:
        raise StreamError(f"{where}: cannot load it with datasets.load_from_disk ({_first_line(exc)})") from None
    if isinstance(obj, datasets.DatasetDict):
        splits = ", ".join(obj)
        if ts.split is None:
            raise StreamError(f"{where} holds a DatasetDict (splits: {splits}); name one: {ts.path}:SPLIT")
        if ts.split not in obj:
            raise StreamError(f"{where}: split '{ts.split}' does not exist (splits: {splits}); "
                              f"name one: {ts.path}:SPLIT")
        return obj[ts.split]
    if ts.split is not None:
        raise StreamError(f"{where} holds one Dataset, not a DatasetDict: drop ':{ts.split}'")
    return obj


def _load_hub(ts: TableSpec):
    require("datasets", "data")
    import datasets

    try:
        return datasets.load_dataset(ts.path, split=ts.split, revision=ts.revision, streaming=True)
    except ValueError as exc:  # datasets: "Bad split: x. Available splits: ['test']"
        message = _first_line(exc)
        if "split" in message.lower():
            raise StreamError(f"input {ts.spec}: split '{ts.split}' does not exist ({message}); "
                              f"name one: hf://datasets/{ts.path}[@REV]:SPLIT") from None
        raise StreamError(f"input {ts.spec}: cannot load it with datasets ({message})") from None
    except Exception as exc:  # noqa: BLE001 (datasets/huggingface_hub raise many kinds: not found, offline, ...)
        message = _first_line(exc)
        raise StreamError(f"input {ts.spec}: cannot load it from the Hub ({message})") from None
