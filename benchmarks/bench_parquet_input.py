"""Memory of reading a parquet prompt file: peak RSS of a process that reads every row with opd's table
reader (opd_common.tables: one row group at a time, pyarrow pre_buffer off), through
opd_common.prompts.iter_prompt_rows (what opd-rollout and opd-eval do: it also keeps every prompt id seen,
to refuse duplicates, so it grows with the number of prompts), and with pyarrow's defaults.

    python benchmarks/bench_parquet_input.py                 # a 256 MB file of 2 KB prompts, 16 MB row groups
    python benchmarks/bench_parquet_input.py --mb 1024

Each reading runs in a fresh subprocess, so its peak RSS (VmHWM, Linux) is its own. The rows are random
letters (parquet cannot compress them much), so the file's size is close to the data's. The times are not a
comparison: opd's reader turns every row into a dict and a prompt row, the pyarrow-defaults reading only
counts each batch's rows.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

READ_OPD = """
import sys, time
from opd_common.prompts import iter_prompt_rows
t0 = time.perf_counter()
n = sum(1 for _ in iter_prompt_rows([sys.argv[1]], "id"))
print(n, time.perf_counter() - t0, peak_mb())
"""
READ_TABLE = """
import sys, time
from opd_common.tables import iter_table, parse_table_spec
t0 = time.perf_counter()
n = sum(1 for _ in iter_table(parse_table_spec(sys.argv[1])))
print(n, time.perf_counter() - t0, peak_mb())
"""
READ_DEFAULT = """
import sys, time
import pyarrow.parquet as pq
t0 = time.perf_counter()
n = sum(batch.num_rows for batch in pq.ParquetFile(sys.argv[1]).iter_batches(batch_size=1024))
print(n, time.perf_counter() - t0, peak_mb())
"""
BASELINE = """
import pyarrow.parquet, opd_common.prompts, opd_common.tables
print(0, 0.0, peak_mb())
"""


PEAK = """
def peak_mb():  # VmHWM: this process's peak resident memory (ru_maxrss would carry the forking parent's peak)
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")) / 1024
"""


def write_file(path: Path, mb: int, row_bytes: int, group_mb: int) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows_per_group = max(1, group_mb * 2**20 // row_bytes)
    rng = np.random.default_rng(0)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ", dtype=np.uint8)
    total = mb * 2**20 // row_bytes
    schema = pa.schema([("id", pa.int64()), ("problem", pa.string())])
    with pq.ParquetWriter(path, schema) as writer:
        for start in range(0, total, rows_per_group):
            n = min(rows_per_group, total - start)
            text = letters[rng.integers(0, len(letters), size=(n, row_bytes))]
            problems = [row.tobytes().decode() for row in text]
            writer.write_table(pa.table({"id": np.arange(start, start + n), "problem": problems}, schema=schema))


def measure(script: str, path: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", PEAK + script, str(path)], capture_output=True, text=True, check=True)
    rows, seconds, peak_mb = out.stdout.split()
    return {"rows": int(rows), "seconds": round(float(seconds), 2), "peak_rss_mb": round(float(peak_mb), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=256, help="file size to write, MB")
    parser.add_argument("--row-bytes", type=int, default=2048, help="prompt length, bytes")
    parser.add_argument("--group-mb", type=int, default=16, help="row group size, MB")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "prompts.parquet"
        t0 = time.perf_counter()
        write_file(path, args.mb, args.row_bytes, args.group_mb)
        result = {"file_mb": round(path.stat().st_size / 2**20, 1), "row_group_mb": args.group_mb,
                  "write_seconds": round(time.perf_counter() - t0, 1),
                  "imports_only": measure(BASELINE, path), "opd_table_reader": measure(READ_TABLE, path),
                  "opd_prompt_rows": measure(READ_OPD, path),
                  "pyarrow_defaults": measure(READ_DEFAULT, path)}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
