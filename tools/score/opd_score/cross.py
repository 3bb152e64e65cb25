"""Teachers with another tokenizer: the teacher scores the student's response *text* under its own
tokenization, and the block carries the chunks where both tokenizations agree (docs/records.md,
Teachers with another tokenizer). The alignment itself is opd_common.xtok."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field, fields

import numpy as np

from opd_common.xtok import ALIGN_FORMAT, Aligner, TextAlignment, chunk_sums

from .teacher_hf import Sequence

log = logging.getLogger("opd-score")


@dataclass
class AlignCounts:
    """What a run's alignments came to (logged at the end, one line per teacher)."""

    records: int = 0
    refused: int = 0
    partial: int = 0
    student_tokens: int = 0
    unaligned_tokens: int = 0  # student tokens in no chunk (refused records: all of theirs)
    reasons: dict[str, int] = field(default_factory=dict)

    def add(self, al: TextAlignment, n_student: int) -> None:
        self.records += 1
        self.student_tokens += n_student
        covered = int(al.student_end[-1]) if len(al.student_end) else 0
        self.unaligned_tokens += n_student - covered
        if al.status != "ok":
            setattr(self, al.status, getattr(self, al.status) + 1)
            key = re.sub(r"^\d+ ", "N ", al.reason.split(" (")[0].split(" at byte")[0])  # one entry per kind
            self.reasons[key] = self.reasons.get(key, 0) + 1

    def line(self, name: str) -> str:
        text = (f"teacher {name} (another tokenizer): {self.records} records aligned over text, {self.refused} "
                f"refused, {self.partial} partial; {self.unaligned_tokens} of {self.student_tokens} student tokens "
                "in no chunk (they get no teacher signal)")
        if self.reasons:
            text += "; " + "; ".join(f"{n} x {r}" for r, n in sorted(self.reasons.items()))
        return text

    def merge(self, other: AlignCounts) -> None:
        """Add another process's counts (--data-parallel workers each count their own windows)."""
        for f in fields(self):
            if isinstance(value := getattr(self, f.name), int):  # the counts; reasons below
                setattr(self, f.name, value + getattr(other, f.name))
        for reason, n in other.reasons.items():
            self.reasons[reason] = self.reasons.get(reason, 0) + n


def log_counts(counts_of: dict[str, AlignCounts]) -> None:
    """One line per teacher with another tokenizer, at the end of a run: a warning (shown under --quiet) when some
    records got no or partial signal."""
    for name, counts in counts_of.items():
        if counts.records:
            (log.warning if counts.refused or counts.partial else log.info)(counts.line(name))


def merge_counts(parts: list[dict[str, AlignCounts]]) -> dict[str, AlignCounts]:
    """The workers' counts per teacher, summed."""
    total: dict[str, AlignCounts] = {}
    for part in parts:
        for name, counts in part.items():
            total.setdefault(name, AlignCounts()).merge(counts)
    return total


def text_sequences(aligner: Aligner, window, contexts: list[np.ndarray],
                   counts: AlignCounts) -> tuple[list[TextAlignment], list[Sequence]]:
    """Each record's alignment and the teacher's sequence (its context + its tokens of the response text)."""
    aligns, seqs = [], []
    for (rec, _), ctx in zip(window, contexts, strict=True):
        al = aligner(rec["response_ids"], rec.get("finish_reason") == "stop")
        counts.add(al, len(rec["response_ids"]))
        aligns.append(al)
        seqs.append(Sequence(ctx, al.teacher_ids))
    return aligns, seqs


def text_block(al: TextAlignment, scores, topk: int) -> dict:
    """teachers.NAME.text: the teacher's tokens and log-probs, the chunks and each chunk's log-prob."""
    U = len(al.teacher_ids)
    logprobs = np.zeros(0, np.float32) if scores is None else scores.logprobs
    block = {"format": ALIGN_FORMAT, "status": al.status, "text": al.text, "ids": al.teacher_ids, "logprobs": logprobs,
             "student_end": al.student_end, "teacher_end": al.teacher_end, "char_end": al.char_end,
             "chunk_logprobs": chunk_sums(logprobs, al.teacher_end) if U else np.zeros(0, np.float32)}
    if al.reason:
        block["reason"] = al.reason
    if scores is not None and scores.topk_ids is not None:
        block.update(topk_ids=scores.topk_ids, topk_logprobs=scores.topk_logprobs, k=int(scores.topk_ids.shape[1]))
    elif topk:  # a refused record: no teacher tokens, [0][k] (k kept: JSON's [] has no width)
        block.update(topk_ids=np.zeros((0, topk), np.int32), topk_logprobs=np.zeros((0, topk), np.float32), k=topk)
    return block


def score_text(teacher, aligns: list[TextAlignment], seqs: list[Sequence], topk: int) -> list:
    """Teacher scores of the aligned records (None for refused ones, which have no tokens to score)."""
    todo = [i for i, al in enumerate(aligns) if len(al.teacher_ids)]
    out: list = [None] * len(aligns)
    if todo:
        for i, scores in zip(todo, teacher.score([seqs[i] for i in todo], topk), strict=True):
            out[i] = scores
    return out
