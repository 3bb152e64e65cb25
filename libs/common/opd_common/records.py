"""The opd record: one JSON object per line, one record = one sampled response to one prompt.

This module is the single place that states the record contract (docs/architecture.md, "Records") as code.

Token alignment (the one rule every tool relies on)
---------------------------------------------------
Every per-token array is aligned to the *response* tokens: index ``t`` of ``logprobs``,
``topk_ids``, ``topk_logprobs``, ``teachers.*.logprobs``, ``shift.delta`` ... describes
``response_ids[t]``, i.e. the distribution over the token at sequence position
``len(prompt_ids) + t``, which the model predicts from the logits at position
``len(prompt_ids) + t - 1`` of ``prompt_ids + response_ids``.

Which distribution a log-prob comes from
----------------------------------------
``logprobs`` and ``topk_logprobs`` are *raw* log-probs: ``log_softmax(logits)`` of the
behaviour model over the full vocabulary at temperature 1, before temperature, top-p and top-k
are applied (vLLM's ``logprobs_mode="raw_logprobs"``; the hf engine computes the same). A
teacher-forced forward of ``prompt_ids + response_ids`` through the same weights reproduces them.
The sampling distribution itself was ``softmax(logits / temperature)`` truncated by top-k/top-p
(``sampling``); a trainer that wants temperature-scaled log-probs divides logits itself. The
convention is stamped into every record as ``sampling.logprobs = "raw"``.
Teacher log-probs (``teachers.*``) are likewise full-vocabulary ``log_softmax`` at temperature 1,
also when evaluated at a given id set.

Fields
------
Identity and provenance
  schema         str   ``"opd/1"``
  id             str   ``"{prompt_id}:{sample}"``, unique within a stream
  prompt_id      str   identifies the prompt; a *group* = all records with one prompt_id
  sample         int   0 <= sample < group_size
  group_size     int   n samples drawn for this prompt
  example        dict  the source row's fields, unchanged (problem, solution, answer, ...)
  policy         dict  {model, revision, adapter, version}; version = trainer step of the
                       adapter that sampled it (0 = base weights)
  sampling       dict  {temperature, top_p, top_k, max_tokens, seed, engine, logprobs="raw",
                       thinking}; seed is this sample's own derived seed
Tokens
  prompt_ids     int[P]    the rendered prompt (chat template applied once, by opd-rollout)
  response_ids   int[T]    sampled tokens, including the final EOS token when finish is "stop"
  finish_reason  str       "stop" (EOS or stop string) | "length" (hit max_tokens)
  response_text  str       decoded response, for people only (never used for training)
  logprobs       float[T]  raw behaviour log-prob of response_ids[t] (see above)
  topk_ids       int[T][k]    optional: the behaviour policy's own top-k ids at position t,
                              sorted by log-prob, descending
  topk_logprobs  float[T][k]  optional: their raw log-probs
Added by opd-score (named blocks; several may stack)
  teachers.NAME  dict  {model, revision, adapter, prompt ("as-is" | template name),
                       logprobs float[T], topk_ids int[T][k], topk_logprobs float[T][k]}
  teachers.NAME.text  dict  a teacher with another tokenizer, instead of logprobs/topk_*: {format "opd-text/1",
                       status, text, ids int[U], logprobs float[U], topk_* [U][k] and k, student_end int[C],
                       teacher_end int[C], char_end int[C], chunk_logprobs float[C]} (docs/records.md)
  shift          dict  {post, pre, k, ids int[T][k], delta float[T][k]} with
                       delta = log pi_post(id) - log pi_pre(id) at the student's top-k ids
  reward         dict  {correct, format_ok, stop_ok, length_penalty, total, scale, verifier, extracted, reason}

Encoding of per-token arrays
----------------------------
In memory, per-token arrays are numpy arrays (int32 ids, float32 log-probs). On disk and in
pipes they are written *packed* by default: ``{"nd": "float32", "shape": [T, k], "b64": "..."}``
where ``b64`` is the base64 of the little-endian C-order bytes. This is ~2.5x faster to read than
plain JSON lists (benchmarks/bench_io.py; the decision and figures are in docs/records.md).
``--encoding json`` writes plain JSON lists instead, and ``opd-cat --decode`` turns any record
into plain numbers. Readers accept both forms anywhere in a record.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import RecordError

SCHEMA = "opd/1"
LOGPROBS_KIND = "raw"
FINISH_REASONS = ("stop", "length")
ID_DTYPE = np.int32
LOGPROB_DTYPE = np.float32

# Per-token fields at the top level: name -> (dtype, rank). Rank 1 = [T], rank 2 = [T][k].
TOKEN_FIELDS: dict[str, tuple[type, int]] = {
    "response_ids": (ID_DTYPE, 1),
    "logprobs": (LOGPROB_DTYPE, 1),
    "topk_ids": (ID_DTYPE, 2),
    "topk_logprobs": (LOGPROB_DTYPE, 2),
}
# Per-token fields inside a teachers.NAME block and the shift block.
TEACHER_FIELDS: dict[str, tuple[type, int]] = {
    "logprobs": (LOGPROB_DTYPE, 1),
    "topk_ids": (ID_DTYPE, 2),
    "topk_logprobs": (LOGPROB_DTYPE, 2),
}
SHIFT_FIELDS: dict[str, tuple[type, int]] = {"ids": (ID_DTYPE, 2), "delta": (LOGPROB_DTYPE, 2)}
# teachers.NAME.text (a teacher with another tokenizer; docs/records.md): aligned to the teacher's own tokens
# of the response text ([U], [U][k]) or to the chunks ([C]), never to response_ids.
TEXT_TEACHER_FIELDS: dict[str, tuple[type, int]] = {
    "ids": (ID_DTYPE, 1), "logprobs": (LOGPROB_DTYPE, 1),
    "topk_ids": (ID_DTYPE, 2), "topk_logprobs": (LOGPROB_DTYPE, 2),
}
TEXT_CHUNK_FIELDS: dict[str, tuple[type, int]] = {
    "student_end": (ID_DTYPE, 1), "teacher_end": (ID_DTYPE, 1), "char_end": (ID_DTYPE, 1),
    "chunk_logprobs": (LOGPROB_DTYPE, 1),
}

REQUIRED: dict[str, type | tuple[type, ...]] = {
    "schema": str,
    "id": str,
    "prompt_id": str,
    "sample": int,
    "group_size": int,
    "example": dict,
    "policy": dict,
    "sampling": dict,
    "prompt_ids": (list, np.ndarray),
    "response_ids": (list, np.ndarray),
    "finish_reason": str,
    "logprobs": (list, np.ndarray),
}


@dataclass(frozen=True)
class Where:
    """Where a record came from, for error messages: 'record 17 of rollouts-00003.jsonl.zst'."""

    source: str
    number: int  # 1-based
    unit: str = "line"  # how a prompt row is named: "line" (JSONL) or "row" (parquet, datasets)

    def __str__(self) -> str:
        return f"record {self.number} of {self.source}"

    @property
    def at(self) -> str:
        """The row, for prompt-row errors: 'line 3 of prompts.jsonl', 'row 3 of train.parquet'."""
        return f"{self.unit} {self.number} of {self.source}"


# --------------------------------------------------------------------------- packing


def pack_array(arr: np.ndarray) -> dict[str, Any]:
    """Pack a numpy array as {"nd": dtype name, "shape": [...], "b64": little-endian bytes}."""
    arr = np.ascontiguousarray(arr)
    le = arr.astype(arr.dtype.newbyteorder("<"), copy=False)
    return {"nd": arr.dtype.name, "shape": list(arr.shape), "b64": base64.b64encode(le.tobytes()).decode()}


def is_packed(value: Any) -> bool:
    return isinstance(value, dict) and "nd" in value and "b64" in value and "shape" in value


def unpack_array(obj: dict[str, Any]) -> np.ndarray:
    """Inverse of pack_array (raises ValueError on a malformed packed array)."""
    dtype = np.dtype(obj["nd"]).newbyteorder("<")
    raw = base64.b64decode(obj["b64"], validate=False)
    return np.frombuffer(raw, dtype=dtype).reshape(obj["shape"])


def unpack_tree(value: Any) -> Any:
    """Replace every packed array inside dicts/lists by a numpy array (in place for dicts)."""
    if isinstance(value, dict):
        if is_packed(value):
            return unpack_array(value)
        for key, item in value.items():
            if isinstance(item, (dict, list)):
                value[key] = unpack_tree(item)
        return value
    if isinstance(value, list) and value and isinstance(value[0], dict):
        return [unpack_tree(v) for v in value]
    return value


def pack_tree(value: Any) -> Any:
    """Copy of `value` with every numpy array packed (the inverse of unpack_tree)."""
    if isinstance(value, np.ndarray):
        return pack_array(value)
    if isinstance(value, dict):
        return {k: pack_tree(v) for k, v in value.items()}
    if isinstance(value, list) and value and isinstance(value[0], dict):
        return [pack_tree(v) for v in value]
    return value


def plain_tree(value: Any) -> Any:
    """Copy of `value` with every numpy array (or packed array) turned into plain lists."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, dict):
        if is_packed(value):
            return unpack_array(value).tolist()
        return {k: plain_tree(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_tree(v) for v in value]
    return value


# --------------------------------------------------------------------------- normalize + validate


def _as_array(rec: dict, key: str, dtype: type, rank: int, where: Where | str, prefix: str = "") -> None:
    value = rec[key]
    name = f"{prefix}{key}"
    try:
        arr = np.asarray(value, dtype=dtype)  # no copy when it already has the schema's dtype
    except (TypeError, ValueError) as exc:
        raise RecordError(f"{where}: field '{name}' is not a numeric array ({exc})") from None
    if rank == 2 and arr.ndim == 1 and arr.size == 0:
        arr = arr.reshape(0, 0)  # an empty response's [T][k] array written as plain JSON: []
    if arr.ndim != rank:
        raise RecordError(f"{where}: field '{name}' must have {rank} dimension(s), got shape {list(arr.shape)}")
    rec[key] = arr


def normalize(rec: dict, where: Where | str) -> dict:
    """Turn per-token fields into numpy arrays of the schema's dtypes (in place) and return rec."""
    for key, (dtype, rank) in TOKEN_FIELDS.items():
        if key in rec:
            _as_array(rec, key, dtype, rank, where)
    if "prompt_ids" in rec:
        _as_array(rec, "prompt_ids", ID_DTYPE, 1, where)
    for name, block in (rec.get("teachers") or {}).items():
        if not isinstance(block, dict):
            raise RecordError(f"{where}: field 'teachers.{name}' must be an object")
        for key, (dtype, rank) in TEACHER_FIELDS.items():
            if key in block:
                _as_array(block, key, dtype, rank, where, f"teachers.{name}.")
        text = block.get("text")
        if text is not None:
            if not isinstance(text, dict):
                raise RecordError(f"{where}: field 'teachers.{name}.text' must be an object")
            for key, (dtype, rank) in (TEXT_TEACHER_FIELDS | TEXT_CHUNK_FIELDS).items():
                if key in text:
                    _as_array(text, key, dtype, rank, where, f"teachers.{name}.text.")
    shift = rec.get("shift")
    if isinstance(shift, dict):
        for key, (dtype, rank) in SHIFT_FIELDS.items():
            if key in shift:
                _as_array(shift, key, dtype, rank, where, "shift.")
    return rec


def _check_len(arr: np.ndarray, n: int, name: str, where: Where | str) -> None:
    if len(arr) != n:
        raise RecordError(
            f"{where}: field '{name}' has {len(arr)} entries but response_ids has {n} "
            "(per-token arrays are aligned to response tokens)"
        )


def validate(rec: Any, where: Where | str) -> dict:
    """Check a record against the schema; normalize its arrays; raise RecordError naming the field."""
    if not isinstance(rec, dict):
        raise RecordError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    for key, typ in REQUIRED.items():
        if key not in rec:
            raise RecordError(f"{where} has no '{key}' (was it written by opd-rollout?)")
        if not isinstance(rec[key], typ) or (typ is int and isinstance(rec[key], bool)):
            raise RecordError(f"{where}: field '{key}' has the wrong type ({type(rec[key]).__name__})")
    if rec["schema"] != SCHEMA:
        raise RecordError(f"{where}: field 'schema' is {rec['schema']!r}; this opd reads {SCHEMA!r}")
    if rec["finish_reason"] not in FINISH_REASONS:
        raise RecordError(f"{where}: field 'finish_reason' must be one of {FINISH_REASONS}, "
                          f"got {rec['finish_reason']!r}")
    normalize(rec, where)
    n = len(rec["response_ids"])
    for key in ("logprobs", "topk_ids", "topk_logprobs"):
        if key in rec:
            _check_len(rec[key], n, key, where)
    if ("topk_ids" in rec) != ("topk_logprobs" in rec):
        raise RecordError(f"{where}: 'topk_ids' and 'topk_logprobs' must appear together")
    for name, block in (rec.get("teachers") or {}).items():
        for key in TEACHER_FIELDS:
            if key in block:
                _check_len(block[key], n, f"teachers.{name}.{key}", where)
        if block.get("text") is not None:
            _check_text(block["text"], n, f"teachers.{name}.text", where)
    if isinstance(rec.get("shift"), dict):
        for key in SHIFT_FIELDS:
            if key in rec["shift"]:
                _check_len(rec["shift"][key], n, f"shift.{key}", where)
    return rec


def _check_text(text: dict, n: int, name: str, where: Where | str) -> None:
    """teachers.NAME.text: arrays of the teacher's tokens have len(ids) rows, chunk arrays one per chunk, and
    the chunk ends increase strictly within response_ids and the teacher's ids."""
    missing = [k for k in ("ids", "logprobs", "student_end", "teacher_end", "char_end", "chunk_logprobs")
               if k not in text]
    if missing:
        raise RecordError(f"{where}: field '{name}' has no '{missing[0]}' (was it written by opd-score?)")
    U, C = len(text["ids"]), len(text["student_end"])
    for key in TEXT_TEACHER_FIELDS:
        if key in text and len(text[key]) != U:
            raise RecordError(f"{where}: field '{name}.{key}' has {len(text[key])} entries but {name}.ids has {U} "
                              "(they are aligned to the teacher's tokens)")
    for key in TEXT_CHUNK_FIELDS:
        if len(text[key]) != C:
            raise RecordError(f"{where}: field '{name}.{key}' has {len(text[key])} entries but {name}.student_end "
                              f"has {C} (one per chunk)")
    for key, limit in (("student_end", n), ("teacher_end", U)):
        ends = np.asarray(text[key], np.int64)
        if C and (ends[0] < 1 or np.any(np.diff(ends) < 1) or ends[-1] > limit):
            raise RecordError(f"{where}: field '{name}.{key}' must increase strictly from >= 1 to <= {limit}")


def make_id(prompt_id: str, sample: int) -> str:
    return f"{prompt_id}:{sample}"
