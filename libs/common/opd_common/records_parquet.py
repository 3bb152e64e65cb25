"""Records as parquet (`opd-cat --parquet OUT.parquet`, docs/records.md): one row per record.

Columns are the record's top-level fields. Per-token arrays are list columns of the schema's dtypes
(``response_ids`` list<int32>, ``logprobs`` list<float>, ``topk_ids`` list<list<int32>>, the same inside
``teachers`` and ``shift``); blocks (``example``, ``policy``, ``sampling``, ``teachers``, ``reward``, ...) are
struct columns, so pandas, polars and DuckDB read ``teachers.t.logprobs`` or ``reward.total`` directly.

The file's schema must hold every record, and records differ (a teacher block on some, a reward on others,
an example field that is null in the first rows): the writer spools the records to a zstd JSONL file beside
the output while it unifies each batch's inferred schema with the last (pyarrow's permissive promotion:
null -> any type, int -> float, struct fields merged), then writes the parquet in one pass over the spool,
to ``OUT.tmp`` renamed when complete. Memory holds one batch of ROWS_PER_GROUP records (a row group).

A struct field that a record lacks reads back as null; the hidden column ``_opd_absent`` lists those
field paths per row, so reading the file back (tables.restore) gives every record exactly as it was written.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from .errors import StreamError, require
from .tables import ABSENT, METADATA_KEY

ROWS_PER_GROUP = 1024


def arrow_value(value: Any) -> Any:
    """A record value as pyarrow takes it: 1-D arrays as they are (typed lists), 2-D as lists of rows."""
    if isinstance(value, np.ndarray):
        return list(value) if value.ndim == 2 else value
    if isinstance(value, dict):
        return {k: arrow_value(v) for k, v in value.items()}
    if isinstance(value, list):
        return [arrow_value(v) for v in value]
    return value


def absent_paths(rec: dict, struct_type, prefix: tuple = ()) -> list[list[str]]:
    """Field paths the (struct) schema has and the record does not, recursing into nested structs."""
    import pyarrow as pa

    out = []
    for field in struct_type:
        path = (*prefix, field.name)
        if field.name == ABSENT:
            continue
        if field.name not in rec:
            out.append(list(path))
        elif pa.types.is_struct(field.type) and isinstance(rec[field.name], dict):
            out.extend(absent_paths(rec[field.name], field.type, path))
    return out


class RecordParquetWriter:
    """write(rec) per record, close(ok) writes OUT atomically (see the module's docstring)."""

    def __init__(self, out: str | Path, rows_per_group: int = ROWS_PER_GROUP):
        require("pyarrow", "data")
        from .streams import StreamWriter

        self.out = Path(out)
        if self.out.is_dir():
            raise StreamError(f"--parquet {out} is a directory; give a file name such as records.parquet")
        self.rows_per_group = rows_per_group
        self.spool_path = self.out.with_name(self.out.name + ".spool.jsonl.zst")
        self._spool_file = open(self.spool_path, "wb")
        self._spool = StreamWriter(self._spool_file, compress=True)
        self._batch: list[dict] = []
        self.schema = None
        self.count = 0

    def write(self, rec: dict) -> None:
        self._spool.write(rec)
        self._batch.append(arrow_value(rec))
        self.count += 1
        if len(self._batch) >= self.rows_per_group:
            self._unify()

    def flush(self) -> None:
        pass  # the file is written whole, at close

    def _unify(self) -> None:
        import pyarrow as pa

        if not self._batch:
            return
        first = self.count - len(self._batch) + 1
        try:
            keys = list(dict.fromkeys(k for row in self._batch for k in row))  # from_pylist: the first row's only
            schema = pa.Table.from_pydict({k: [row.get(k) for row in self._batch] for k in keys}).schema
            self.schema = schema if self.schema is None else pa.unify_schemas([self.schema, schema],
                                                                               promote_options="permissive")
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as exc:
            raise StreamError(f"records {first}-{self.count}: a field's type differs from earlier records' and "
                              f"parquet needs one type per column ({str(exc).splitlines()[0]})") from None
        self._batch = []

    def close(self, ok: bool = True) -> None:
        self._spool.close()
        self._spool_file.close()
        try:
            if ok:
                self._unify()
                self._write_parquet()
        finally:
            self.spool_path.unlink(missing_ok=True)

    def _write_parquet(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        schema = (self.schema or pa.schema([])).append(pa.field(ABSENT, pa.list_(pa.list_(pa.string()))))
        schema = schema.with_metadata({METADATA_KEY: b"records opd/1"})
        tmp = self.out.with_name(self.out.name + ".tmp")
        try:
            self._write_rows(pq.ParquetWriter(tmp, schema), schema)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        os.replace(tmp, self.out)

    def _write_rows(self, parquet_writer, schema) -> None:
        import pyarrow as pa

        from .streams import iter_inputs

        with parquet_writer as writer:
            rows: list[dict] = []
            for rec, _ in iter_inputs([str(self.spool_path)], check=False):
                row = arrow_value(rec)
                row[ABSENT] = absent_paths(rec, schema) or None
                rows.append(row)
                if len(rows) >= self.rows_per_group:
                    writer.write_table(pa.Table.from_pylist(rows, schema=schema))
                    rows = []
            if rows:
                writer.write_table(pa.Table.from_pylist(rows, schema=schema))

    def __enter__(self) -> RecordParquetWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(ok=exc_type is None)
