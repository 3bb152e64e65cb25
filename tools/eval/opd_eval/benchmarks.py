"""Benchmarks: the bundled ones (opd_common/data, provenance in PROVENANCE.md) or any prompt input (--data:
JSONL, parquet, a datasets folder, a Hub dataset id; verl rows' gold answer is reward_model.ground_truth).

A benchmark is an ordered list of problems, each a row with a unique prompt id, the problem text
(read through the prompt template) and a gold answer (``--answer-field``). Its identity for
``compare`` is ``problems_sha256``: the hash of every (prompt id, problem, answer) evaluated.
"""

from __future__ import annotations

import difflib
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from opd_common.datasets import BUNDLED, data_path
from opd_common.errors import ConfigError, RecordError, StreamError
from opd_common.records import Where

BENCHMARKS = {name: b for name, b in BUNDLED.items() if b.split == "benchmark"}


@dataclass
class Problem:
    prompt_id: str
    row: dict[str, Any]
    answer: str
    where: Where


@dataclass
class Benchmark:
    name: str  # bundled name, or "data:FILENAME"
    path: str
    file_sha256: str
    problems: list[Problem]

    @property
    def problems_sha256(self) -> str:
        return problems_hash(self.problems)

    def describe(self, limit: int | None) -> dict[str, Any]:
        return {"name": self.name, "file": self.path, "file_sha256": self.file_sha256,
                "problems": len(self.problems), "problems_sha256": self.problems_sha256, "limit": limit}


def problems_hash(problems: list[Problem]) -> str:
    """sha256 over the problems' (prompt id, row, gold answer), one canonical JSON line each."""
    h = hashlib.sha256()
    for p in problems:
        h.update(orjson.dumps([p.prompt_id, p.row, p.answer], option=orjson.OPT_SORT_KEYS) + b"\n")
    return h.hexdigest()


def unknown_benchmark(name: str) -> ConfigError:
    close = difflib.get_close_matches(name, BENCHMARKS, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ConfigError(f"--bench: unknown benchmark {name!r}{hint}; bundled: {', '.join(BENCHMARKS)} "
                       "(or --data FILE for your own JSONL; `opd-eval ls` lists them)")


def benchmark_file(bench: str | None, data: str | None) -> tuple[str, str]:
    """(name, input spec) of --bench NAME or --data INPUT (a JSONL or parquet file, a parquet or datasets
    folder, hf://datasets/ORG/NAME@REV:SPLIT)."""
    from opd_common.tables import parse_table_spec

    if bench is not None:
        if bench not in BENCHMARKS:
            raise unknown_benchmark(bench)
        return bench, str(data_path(BENCHMARKS[bench].file))
    table = parse_table_spec(data)  # type: ignore[arg-type]
    if table is not None:
        return f"data:{data if table.kind == 'hub' else Path(table.path).name}", data  # type: ignore[return-value]
    path = Path(data)  # type: ignore[arg-type]
    if not path.is_file():
        raise StreamError(f"--data {data}: no such file")
    return f"data:{path.name}", str(path)


def load_benchmark(bench: str | None, data: str | None, *, id_field: str = "id", answer_field: str = "answer",
                   limit: int | None = None) -> Benchmark:
    """Read the problems (the first `limit`), checking every row has an answer and a unique id."""
    from opd_common.prompts import iter_prompt_rows
    from opd_common.streams import InputSource

    name, path = benchmark_file(bench, data)
    problems = []
    sources: list[InputSource] = []
    for prow in iter_prompt_rows([path], id_field, sources=sources, limit=limit):
        problems.append(Problem(prow.prompt_id, prow.row, _gold(prow.row, answer_field, prow.where), prow.where))
    if not problems:
        raise StreamError(f"{path}: no problems in it (an empty file?)")
    return Benchmark(name, path, sources[0].sha256, problems)


def _gold(row: dict[str, Any], field: str, where: Where) -> str:
    value = row.get(field)
    if value is None or (isinstance(value, str) and not value.strip()):
        state = "an empty" if field in row else "no"
        raise RecordError(f"{where.at} has {state} '{field}' field, the gold answer "
                          f"(set --answer-field to the field that holds it; the row has: {', '.join(sorted(row))})")
    if isinstance(value, (dict, list, bool)):
        raise RecordError(f"{where.at}: '{field}' is a {type(value).__name__}, "
                          "not an answer string or number")
    return str(value)


def listing() -> list[dict[str, Any]]:
    """One entry per bundled benchmark: name, problems, description, source, sha256 (for `ls`)."""
    from opd_common.streams import sha256_file

    out = []
    for name, b in BENCHMARKS.items():
        path = data_path(b.file)
        with open(path, "rb") as f:
            first = orjson.loads(f.readline())
        source = first.get("source_repo") or first.get("source", "")
        commit = first.get("source_commit")
        out.append({"name": name, "problems": b.rows, "description": b.description,
                    "source": f"{source}@{commit[:8]}" if commit else source,
                    "file": b.file, "sha256": sha256_file(path)})
    return out
