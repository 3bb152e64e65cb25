"""Cross-tokenizer alignment: the student's response as text, the teacher's tokens of that text, and the
chunks of the response where both tokenizations have a boundary (docs/records.md, Teachers with another
tokenizer; docs/losses.md, Aligned chunks).

Everything is done on **bytes**, never on decoded strings: each token id has one byte string (a table
built once per tokenizer), the student's response bytes are the concatenation of its tokens' bytes,
and the teacher's tokens of the response text must concatenate to exactly the same bytes. A chunk
boundary is a byte offset that both cumulative sums reach, so a chunk is the same bytes on both sides:
``log p_T(chunk)`` and ``log p_S(chunk)`` are log-probabilities of the same event given the same text
before it. (A boundary may fall inside a character when both tokenizers split its UTF-8 bytes at the same
place; ``char_end`` then counts that character in the chunk where it starts.)

A teacher with the student's own vocabulary (``--align text`` with the same tokenizer) keeps the student's
ids instead of re-tokenizing: sampled tokens need not be the canonical tokenization of their text, and the
student's ids are a tokenization in the teacher's vocabulary. Every chunk is then one token, which is what
makes the chunk objectives reduce exactly to the token ones (docs/losses.md).

Text that does not round-trip is never aligned by guesswork: a teacher tokenizer whose normalizer
changes the text, or student tokens that are not valid UTF-8 in the middle of the response, refuse the
record (status ``refused`` and a reason; no chunk, so no signal). A response cut mid-character by
``max_tokens`` is aligned up to its last whole character (status ``partial``: the trailing student
tokens belong to no chunk). A leading space added by a SentencePiece-style dummy prefix is the one
difference that is handled (the teacher's first token loses that space).

TRL's GOLD trainer aligns by incremental string decoding and greedy group growth, which costs
O(T^2) decodes and, when the texts differ, closes the remainder as one possibly misaligned group;
this module is O(T) on byte tables and refuses instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from .errors import ConfigError

ALIGN_FORMAT = "opd-text/1"  # teachers.NAME.text.format: bump when the block's meaning changes


def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte <-> printable unicode map (byte-level BPE), inverted: char -> byte."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(keep, chars, strict=True)}


def _decoder_kind(tokenizer) -> str:
    """'byte-level' or 'metaspace' from the fast tokenizer's decoder, else ''."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return ""
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    types = {p.get("type") for p in parts}
    if "ByteLevel" in types:
        return "byte-level"
    if "Metaspace" in types or "ByteFallback" in types:
        return "metaspace"
    return ""


def token_bytes(tokenizer, flag: str) -> list[bytes]:
    """The byte string of every token id (index = id), for a byte-level BPE or a SentencePiece-style
    (metaspace, byte-fallback) fast tokenizer; added tokens are their content. ConfigError otherwise."""
    kind = _decoder_kind(tokenizer)
    if not kind:
        raise ConfigError(f"{flag}: its tokenizer is neither byte-level BPE nor SentencePiece-style (no ByteLevel, "
                          "Metaspace or ByteFallback decoder), so its tokens' bytes are unknown; give a model "
                          "whose fast tokenizer is of either kind")
    size = max(len(tokenizer), max(tokenizer.get_vocab().values()) + 1)
    table = [b""] * size
    byte_of = _byte_level_table()
    for piece, i in tokenizer.get_vocab().items():
        if kind == "byte-level":
            table[i] = bytes(byte_of[c] for c in piece) if all(c in byte_of for c in piece) else piece.encode()
        else:
            table[i] = _metaspace_bytes(piece)
    for i, added in tokenizer.added_tokens_decoder.items():
        table[i] = _metaspace_bytes(added.content) if kind == "metaspace" else added.content.encode()
    return table


def _metaspace_bytes(piece: str) -> bytes:
    """A SentencePiece-style piece: '<0xNN>' is byte NN (byte fallback), U+2581 is a space."""
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            pass
    return piece.replace("\u2581", " ").encode()


def _boundaries(pieces: list[bytes]) -> np.ndarray:
    """Cumulative byte offsets: ends[i] = bytes of pieces[: i + 1]."""
    return np.cumsum([len(p) for p in pieces], dtype=np.int64) if pieces else np.zeros(0, np.int64)


def align_pieces(student: list[bytes], teacher: list[bytes]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Chunks of two tokenizations of the same bytes: (student_end [C], teacher_end [C], byte_end [C]).

    A boundary is a byte offset > 0 that both cumulative sums reach; chunk c covers student tokens
    [student_end[c-1], student_end[c]) and teacher tokens [teacher_end[c-1], teacher_end[c]). Zero-byte
    tokens join the chunk they end. The caller guarantees b"".join(student) == b"".join(teacher).
    """
    s_end, t_end = _boundaries(student), _boundaries(teacher)
    common = np.intersect1d(s_end, t_end)
    common = common[common > 0]
    student_end = np.searchsorted(s_end, common, side="right")
    teacher_end = np.searchsorted(t_end, common, side="right")
    return student_end.astype(np.int32), teacher_end.astype(np.int32), common.astype(np.int64)


@dataclass
class TextAlignment:
    """One record's alignment (docs/records.md, teachers.NAME.text)."""

    teacher_ids: np.ndarray  # int32 [U]: the teacher's tokens of the response text (+ its EOS)
    student_end: np.ndarray  # int32 [C]: chunk c ends before student token student_end[c]
    teacher_end: np.ndarray  # int32 [C]: chunk c ends before teacher token teacher_end[c]
    char_end: np.ndarray  # int32 [C]: chunk c ends before character char_end[c] of `text`
    text: str  # the response text both tokenizations spell (the student's EOS excluded)
    status: str  # "ok" | "partial" (trailing student tokens in no chunk) | "refused" (no chunk)
    reason: str = ""


def _char_offsets(data: bytes, byte_end: np.ndarray) -> np.ndarray:
    """Characters that start before each byte offset (a character split by a boundary counts where it starts)."""
    starts = np.frombuffer(data, dtype=np.uint8) & 0xC0 != 0x80
    chars_before = np.concatenate([[0], np.cumsum(starts)])
    return chars_before[byte_end].astype(np.int32)


def _refused(reason: str) -> TextAlignment:
    empty = np.zeros(0, np.int32)
    return TextAlignment(empty, empty, empty, empty, "", "refused", reason)


class Aligner:
    """Aligns a student's response ids to a teacher tokenizer's tokens of the same text."""

    def __init__(self, student_tokenizer, teacher_tokenizer, teacher_flag: str, same_vocab: bool = False,
                 student_flag: str = "--student-tokenizer"):
        """`teacher_flag` / `student_flag`: the flags an error about either tokenizer names (the caller's own)."""
        self.same_vocab = same_vocab  # keep the student's ids: one chunk per token (module docstring)
        self.student = student_tokenizer
        self.teacher = teacher_tokenizer
        self.s_bytes = token_bytes(student_tokenizer, student_flag)
        self.t_bytes = token_bytes(teacher_tokenizer, teacher_flag)
        self.s_eos, self.t_eos = student_tokenizer.eos_token_id, teacher_tokenizer.eos_token_id

    def __call__(self, response_ids, stopped: bool | None = None) -> TextAlignment:
        """`stopped`: the response ended on a stop token (finish_reason "stop": the engine stops on every EOS id
        of the model's generation config, not only the tokenizer's); None: its last id is the tokenizer's EOS."""
        ids = [int(i) for i in response_ids]
        ends_on_stop = bool(ids) and (ids[-1] == self.s_eos if stopped is None else stopped)
        if self.same_vocab:
            return self._same(ids, ends_on_stop)
        has_eos = ends_on_stop and self.t_eos is not None
        body = ids[:-1] if has_eos else ids
        pieces = [self.s_bytes[i] if 0 <= i < len(self.s_bytes) else b"" for i in body]
        n = len(pieces)
        while True:
            data = b"".join(pieces[:n])
            try:
                text = data.decode("utf-8")
                break
            except UnicodeDecodeError as exc:
                if exc.reason != "unexpected end of data":
                    return _refused(f"the student's tokens are not valid UTF-8 at byte {exc.start}")
                n, has_eos = _whole(pieces, exc.start), False  # cut mid-character by max_tokens: whole characters
        pieces = pieces[:n]
        teacher_ids = list(self.teacher(text, add_special_tokens=False)["input_ids"]) if text else []
        t_pieces = [self.t_bytes[i] for i in teacher_ids]
        t_data = b"".join(t_pieces)
        if t_data != data and t_pieces and t_data == b" " + data and t_pieces[0].startswith(b" "):
            t_pieces[0] = t_pieces[0][1:]  # a SentencePiece dummy prefix: the added space is not the student's
        elif t_data != data:
            at = next((i for i, (a, b) in enumerate(zip(data, t_data, strict=False)) if a != b), min(len(data),
                                                                                                    len(t_data)))
            return _refused(f"the teacher's tokenizer does not reproduce the text (normalizer or unknown bytes): "
                            f"the bytes differ from byte {at} ({data[at:at + 12]!r} vs {t_data[at:at + 12]!r})")
        student_end, teacher_end, byte_end = align_pieces(pieces, t_pieces)
        char_end = _char_offsets(data, byte_end)
        if has_eos:  # the EOS is one chunk of its own: the student's EOS <-> the teacher's
            teacher_ids.append(self.t_eos)
            student_end = np.append(student_end, len(ids)).astype(np.int32)
            teacher_end = np.append(teacher_end, len(teacher_ids)).astype(np.int32)
            char_end = np.append(char_end, len(text)).astype(np.int32)
        covered = int(student_end[-1]) if len(student_end) else 0
        status = "ok" if covered == len(ids) else "partial"
        reason = "" if status == "ok" else f"{len(ids) - covered} trailing student tokens are in no chunk"
        return TextAlignment(np.asarray(teacher_ids, np.int32), student_end, teacher_end, char_end, text, status,
                             reason)


    def _same(self, ids: list[int], ends_on_stop: bool) -> TextAlignment:
        """The student's own ids, one chunk per token (a final stop token spells no text, as in the other path)."""
        pieces = [self.s_bytes[i] if 0 <= i < len(self.s_bytes) else b"" for i in ids]
        if ends_on_stop:
            pieces[-1] = b""
        data = b"".join(pieces)
        ends = np.arange(1, len(ids) + 1, dtype=np.int32)
        char_end = _char_offsets(data, _boundaries(pieces))
        return TextAlignment(np.asarray(ids, np.int32), ends, ends.copy(), char_end,
                             data.decode("utf-8", errors="replace"), "ok")


def _whole(pieces: list[bytes], n_bytes: int) -> int:
    """How many leading pieces fit in the first n_bytes bytes."""
    return int(np.searchsorted(_boundaries(pieces), n_bytes, side="right"))


def chunk_sums(values_U: np.ndarray, ends_C: np.ndarray) -> np.ndarray:
    """Sum of values over each chunk's tokens [ends[c-1], ends[c]), in float64 (a one-token chunk's sum is its
    value exactly), returned as float32."""
    ends = np.asarray(ends_C, np.int64)
    if not len(ends):
        return np.zeros(0, np.float32)
    starts = np.concatenate([[0], ends[:-1]])
    return np.add.reduceat(np.asarray(values_U, np.float64)[:ends[-1]], starts).astype(np.float32)


def teacher_prompt_ids(rec: dict, student_tokenizer, teacher_tokenizer) -> np.ndarray:
    """--teacher-prompt as-is for a teacher with another tokenizer: the student's prompt as text (its chat
    markup included), tokenized by the teacher. A template renders the teacher's own chat template instead."""
    text = student_tokenizer.decode([int(i) for i in rec["prompt_ids"]], skip_special_tokens=False,
                                    clean_up_tokenization_spaces=False)
    ids = list(teacher_tokenizer(text, add_special_tokens=False)["input_ids"])
    bos = getattr(teacher_tokenizer, "bos_token_id", None)
    if bos is not None and (not ids or ids[0] != bos) and \
            list(teacher_tokenizer("x", add_special_tokens=True)["input_ids"])[:1] == [bos]:
        ids = [bos, *ids]  # a tokenizer that opens every text with BOS (Llama, Gemma, Mistral) reads it here too
    return np.asarray(ids, np.int32)
