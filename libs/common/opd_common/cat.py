"""opd-cat: print, select, decode and summarize opd records from any input."""

from __future__ import annotations

import itertools
import sys
from collections import Counter
from typing import Any

import click
import numpy as np
import orjson

from .cli_util import console_main, tool_command
from .errors import ConfigError
from .records import plain_tree
from .streams import StreamWriter, iter_inputs


def get_path(rec: dict, path: str) -> Any:
    """A dotted field path ('reward.total', 'teachers.t.logprobs'); missing -> None."""
    value: Any = rec
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def select(rec: dict, fields: list[str]) -> dict:
    return {f: get_path(rec, f) for f in fields}


class Decoder:
    """Adds token text to a record: prompt_text and response_tokens (one string per token)."""

    def __init__(self, tokenizer_name: str | None):
        self.name = tokenizer_name
        self._cache: dict[str, Any] = {}

    def _tokenizer(self, rec: dict):
        name = self.name or get_path(rec, "policy.model")
        if not name:
            return None
        if name not in self._cache:
            from .models import load_tokenizer

            self._cache[name] = load_tokenizer(name)
        return self._cache[name]

    def __call__(self, rec: dict) -> dict:
        out = plain_tree(rec)
        tok = self._tokenizer(rec)
        if tok is not None and "response_ids" in rec:
            out["prompt_text"] = tok.decode(out["prompt_ids"])
            out["response_tokens"] = tok.convert_ids_to_tokens(out["response_ids"])
            if "topk_ids" in out:
                out["topk_tokens"] = [tok.convert_ids_to_tokens(row) for row in out["topk_ids"]]
        chunks = {name: text_chunks(block["text"], out.get("logprobs"))
                  for name, block in (out.get("teachers") or {}).items() if isinstance(block.get("text"), dict)}
        if chunks:
            out["teacher_chunks"] = chunks
        return out


def text_chunks(text: dict, logprobs: list | None) -> list[dict]:
    """A teacher with another tokenizer (teachers.NAME.text), readable: one entry per aligned chunk with its
    text, the student's and the teacher's token ranges [start, end) and both log-probs of the chunk."""
    out, s0, t0, c0 = [], 0, 0, 0
    for s1, t1, c1, lp in zip(text["student_end"], text["teacher_end"], text["char_end"], text["chunk_logprobs"],
                              strict=True):
        row = {"text": text.get("text", "")[c0:c1], "student": [s0, s1], "teacher": [t0, t1], "teacher_logprob": lp}
        if logprobs is not None:
            row["student_logprob"] = float(np.sum(np.asarray(logprobs[s0:s1], np.float64)))
        out.append(row)
        s0, t0, c0 = s1, t1, c1
    return out


def _quantiles(values: list[int]) -> dict[str, float]:
    if not values:
        return {}
    arr = np.asarray(values, dtype=np.float64)
    qs = {f"p{int(q * 100)}": float(np.quantile(arr, q)) for q in (0.1, 0.5, 0.9)}
    return {"min": float(arr.min()), **qs, "max": float(arr.max()), "mean": float(arr.mean())}


class Summary:
    """Accumulates the --summary figures record by record (bounded memory: lengths only)."""

    def __init__(self) -> None:
        self.records = 0
        self.groups: set[str] = set()
        self.lengths: list[int] = []
        self.finish: Counter = Counter()
        self.versions: Counter = Counter()
        self.engines: Counter = Counter()
        self.teachers: dict[str, list[float]] = {}  # name -> [records, token count, logprob sum]
        self.aligned: dict[str, Counter] = {}  # teacher with another tokenizer -> {ok, partial, refused: records}
        self.rewards: list[dict] = []
        self.shift = [0, 0, 0.0]  # records, entries, delta sum

    def add(self, rec: dict) -> None:
        self.records += 1
        self.groups.add(str(rec.get("prompt_id")))
        self.lengths.append(len(rec.get("response_ids", [])))
        self.finish[rec.get("finish_reason")] += 1
        self.versions[str(get_path(rec, "policy.version"))] += 1
        self.engines[str(get_path(rec, "sampling.engine"))] += 1
        for name, block in (rec.get("teachers") or {}).items():
            acc = self.teachers.setdefault(name, [0, 0, 0.0])
            text = block.get("text") if isinstance(block.get("text"), dict) else None
            if text is not None:  # another tokenizer: the teacher's own tokens, and how the records aligned
                self.aligned.setdefault(name, Counter())[str(text.get("status"))] += 1
            lp = np.asarray((text or block).get("logprobs", []), dtype=np.float64)
            acc[0] += 1
            acc[1] += lp.size
            acc[2] += float(lp.sum())
        if isinstance(rec.get("reward"), dict):
            self.rewards.append(rec["reward"])
        if isinstance(rec.get("shift"), dict):
            delta = np.asarray(rec["shift"].get("delta", []), dtype=np.float64)
            self.shift[0] += 1
            self.shift[1] += delta.size
            self.shift[2] += float(delta.sum())

    def result(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "records": self.records,
            "groups": len(self.groups),
            "response_tokens": int(sum(self.lengths)),
            "response_length": _quantiles(self.lengths),
            "finish_reason": dict(self.finish),
            "policy_version": dict(self.versions),
            "engine": dict(self.engines),
        }
        if self.teachers:
            out["teachers"] = {n: {"records": int(a[0]), "tokens": int(a[1]),
                                   "mean_logprob": a[2] / a[1] if a[1] else None}
                               for n, a in self.teachers.items()}
            for name, statuses in self.aligned.items():  # tokens are then the teacher's own
                out["teachers"][name]["aligned"] = dict(sorted(statuses.items()))
        if self.rewards:
            out["reward"] = _reward_summary(self.rewards)
        if self.shift[0]:
            out["shift"] = {"records": self.shift[0], "mean_delta": self.shift[2] / max(self.shift[1], 1)}
        return out


def _reward_summary(rewards: list[dict]) -> dict[str, Any]:
    out: dict[str, Any] = {"records": len(rewards)}
    keys = sorted({k for r in rewards for k, v in r.items() if isinstance(v, (int, float, bool))})
    for key in keys:
        vals = [float(r[key]) for r in rewards if isinstance(r.get(key), (int, float, bool))]
        out[f"mean_{key}"] = sum(vals) / len(vals)
    return out


@tool_command("opd-cat")
@click.argument("inputs", nargs=-1)
@click.option("--fields", help="Comma-separated (dotted) fields to keep, e.g. id,finish_reason,reward.total.")
@click.option("--head", type=int, help="Stop after this many records.")
@click.option("--decode", is_flag=True, help="Per-token arrays as plain numbers; add prompt_text and response_tokens.")
@click.option("--tokenizer", help="Tokenizer for --decode [default: each record's policy.model].")
@click.option("--summary", is_flag=True, help="Print one JSON summary (records, groups, lengths, blocks) instead.")
@click.option("--no-check", is_flag=True, help="Do not validate records against the schema.")
@click.option("--parquet", "parquet", metavar="OUT.parquet",
              help="Write the records to this parquet file (one row each, per-token arrays as list columns) "
                   "instead of stdout.")
def command(inputs, fields, head, decode, tokenizer, summary, no_check, parquet):
    """Print opd records from files, shard directories or stdin.

    \b
      opd-rollout --model M aime24 | opd-cat --summary
      opd-cat rollouts/ --head 1 --decode | jq .response_tokens
      opd-cat scored.jsonl.zst --fields id,reward.total
      opd-cat scored/ --parquet scored.parquet   # then pandas/polars/DuckDB

    INPUTS: '-' (stdin, the default), .jsonl/.jsonl.zst files (zstd by magic bytes),
    shard directories (manifest.json and shard hashes are checked), or .parquet files
    (those --parquet writes read back as the records).
    """
    if head is not None and head < 0:
        raise ConfigError(f"--head must be >= 0, got {head}")
    if parquet and summary:
        raise ConfigError("--parquet writes the records and --summary prints one summary instead; give one of them")
    keep = [f.strip() for f in fields.split(",") if f.strip()] if fields else None
    decoder = Decoder(tokenizer) if decode else None
    acc = Summary() if summary else None
    writer = _writer(parquet, decode)
    records = iter_inputs(inputs, check=not no_check)
    if head is not None:  # stop reading at once: a later record is never read (or waited for)
        records = itertools.islice(records, head)
    with writer:  # a failure leaves no --parquet file (and no spool)
        for number, (rec, _where) in enumerate(records):
            if acc is not None:
                acc.add(rec)
                continue
            out = decoder(rec) if decoder else rec
            writer.write(select(out, keep) if keep else out)
            if number % 64 == 0:
                writer.flush()
        if acc is not None:
            sys.stdout.buffer.write(orjson.dumps(acc.result(), option=orjson.OPT_INDENT_2) + b"\n")


def _writer(parquet: str | None, decode: bool):
    if parquet:
        from .records_parquet import RecordParquetWriter

        return RecordParquetWriter(parquet)
    return StreamWriter(encoding="json" if decode else "packed")


def main(argv: list[str] | None = None):
    """The opd-cat console script (see opd_common.cli_util.console_main)."""
    console_main(command, sys.argv[1:] if argv is None else argv, "opd-cat")


if __name__ == "__main__":
    main()
