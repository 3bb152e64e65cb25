"""The Scorer: loads the teachers (a teacher with another tokenizer scores the response text: cross.py), the
shift pair (checked to share the student's vocabulary) and the grader, and scores one window of records in
place. run.py drives it in this process, parallel.py in worker processes."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from opd_common.errors import ConfigError, RecordError
from opd_common.prompts import AS_IS, Template, load
from opd_common.records import Where

from .follow import adapters_for, by_adapter
from .teacher_hf import Sequence

log = logging.getLogger("opd-score")


def vocab_fingerprint(tokenizer) -> dict[str, int]:
    return tokenizer.get_vocab()


def check_same_vocab(student_name: str, student, teacher_flag: str, teacher, fix: str) -> None:
    """Refuse a model whose token ids do not mean the student's strings (ids cross tools as-is)."""
    s_vocab, t_vocab = vocab_fingerprint(student), vocab_fingerprint(teacher)
    if s_vocab == t_vocab:
        return
    s_by_id = {i: tok for tok, i in s_vocab.items()}
    t_by_id = {i: tok for tok, i in t_vocab.items()}
    # over both id sets: a teacher vocabulary that is a prefix of the student's differs only in ids it lacks
    differ = sum(1 for i in s_by_id.keys() | t_by_id.keys() if s_by_id.get(i) != t_by_id.get(i))
    raise ConfigError(
        f"{teacher_flag}: its tokenizer differs from the student's ({student_name}): {differ} token ids "
        f"map to other strings or exist in only one of them (vocab sizes {len(s_vocab)} vs {len(t_vocab)}); {fix}"
    )


ALIGN_IDS_FIX = "--align ids needs the student's tokenizer; --align auto scores such a teacher over text chunks"
SHIFT_FIX = "the shift models must share the student's tokenizer because the shift is read at the student's ids"


class Scorer:
    """Holds the teachers, shift pair and grader; scores one window of records in place."""

    def __init__(self, config):
        self.config = config
        self.template: Template | None = None if config.teacher_prompt == AS_IS else load(config.teacher_prompt)
        self.teachers: dict[str, Any] = {}
        self.tokenizers: dict[str, Any] = {}
        self.aligners: dict[str, Any] = {}  # teacher name -> xtok.Aligner (a teacher scored over text)
        self.align_counts: dict[str, Any] = {}  # teacher name -> cross.AlignCounts
        self.student = None  # the student's tokenizer
        self.shift_models: tuple[Any, Any] | None = None
        self.grader = None
        self.opened = False

    def _engine(self, model: str, revision: str | None, adapter: str | None, flag: str):
        from opd_common.models import load_tokenizer

        self.tokenizers[flag] = load_tokenizer(model, revision)
        if self.config.engine == "vllm":
            from .teacher_vllm import VllmTeacher

            return VllmTeacher(model, revision, adapter, self.config)
        from .teacher_hf import HfTeacher

        return HfTeacher(model, revision, adapter, self.config)

    def open(self, first: dict) -> None:
        """Load teachers and check their vocabularies against the student's, before any scoring."""
        from opd_common.models import load_tokenizer

        self.opened = True
        cfg = self.config
        specs = [(f"--teacher {t.name}={t.model}", t.model, t.revision, t.adapter) for t in cfg.teachers]
        if cfg.shift_pair:
            sides = zip(("post", "pre"), cfg.shift_pair, strict=True)
            specs += [(f"--shift {side}={m}", m, None, None) for side, m in sides]
        if specs:
            student_name = cfg.student_tokenizer or (first.get("policy") or {}).get("model")
            try:
                student = load_tokenizer(student_name, None) if student_name else None
            except Exception as exc:
                raise ConfigError(f"cannot check the teachers' vocabulary: the student tokenizer {student_name!r} "
                                  f"does not load here ({str(exc).splitlines()[0]}); pass --student-tokenizer"
                                  ) from None
            if student is None:
                raise ConfigError("cannot check the teachers' vocabulary: records have no policy.model; "
                                  "pass --student-tokenizer")
        if cfg.follow:
            sampled = (first.get("policy") or {}).get("model")
            for t in cfg.teachers:
                if t.model != sampled:
                    log.warning("--follow %s: teacher %s is %s but the records were sampled by %s; the run's "
                                "adapters belong to the student's base model", cfg.follow, t.name, t.model, sampled)
        engines = {}
        for flag, model, revision, adapter in specs:
            engines[flag] = self._engine(model, revision, adapter, flag)
        self.student = student if specs else None
        for t in cfg.teachers:
            flag = f"--teacher {t.name}={t.model}"
            self._pick_alignment(t.name, flag, student_name)
        for side, m in zip(("post", "pre"), cfg.shift_pair or (), strict=False):
            check_same_vocab(student_name, student, f"--shift {side}={m}", self.tokenizers[f"--shift {side}={m}"],
                             SHIFT_FIX)
        self.teachers = {t.name: engines[f"--teacher {t.name}={t.model}"] for t in cfg.teachers}
        if cfg.shift_pair:
            self.shift_models = (engines[specs[-2][0]], engines[specs[-1][0]])
        if cfg.reward:
            from opd_common.grading import Grader

            self.grader = Grader(workers=cfg.grade_workers).__enter__()

    def _pick_alignment(self, name: str, flag: str, student_name: str) -> None:
        """Token ids when the teacher's vocabulary is the student's (unless --align text), else text chunks."""
        from opd_common.xtok import Aligner

        from .cross import AlignCounts

        cfg, tok = self.config, self.tokenizers[flag]
        same = vocab_fingerprint(self.student) == vocab_fingerprint(tok)
        if cfg.align == "ids" or (cfg.align == "auto" and same):
            check_same_vocab(student_name, self.student, flag, tok, ALIGN_IDS_FIX)
            return
        if cfg.follow:
            raise ConfigError(f"{flag} has another tokenizer than the student's ({student_name}) and --follow "
                              f"{cfg.follow} gives teachers the student's adapters; score this teacher in an "
                              "opd-score stage of its own, without --follow")
        if cfg.at_student_topk:
            raise ConfigError(f"{flag} has another tokenizer than the student's ({student_name}): "
                              "--at-student-topk reads the teacher at the student's ids; use --topk K instead")
        self.aligners[name] = Aligner(self.student, tok, flag, same_vocab=same)
        self.align_counts[name] = AlignCounts()

    def close(self, report: bool = True) -> None:
        """Release the teachers; `report`: log the alignment counts (a --data-parallel worker sends them to the
        parent instead, which logs the sum)."""
        if report and self.align_counts:
            from .cross import log_counts

            log_counts(self.align_counts)
        if self.grader is not None:
            self.grader.__exit__(None, None, None)
        for engine in list(self.teachers.values()) + list(self.shift_models or ()):
            engine.close()

    # ------------------------------------------------------------------ per window

    def _context(self, rec: dict, where: Where, flag: str, cache: dict, text: bool = False) -> np.ndarray:
        """The teacher's context ids; `text`: a teacher with another tokenizer reads the student's prompt as text."""
        if self.template is None and not text:
            return rec["prompt_ids"]
        if self.template is None:
            from opd_common.xtok import teacher_prompt_ids

            key = (flag, rec["prompt_id"])
            if key not in cache:
                cache[key] = teacher_prompt_ids(rec, self.student, self.tokenizers[flag])
            return cache[key]
        key = (flag, rec["prompt_id"])
        if key not in cache:
            from opd_common.models import render_chat

            message = self.template.render(rec["example"], str(where))
            ids = render_chat(self.tokenizers[flag], message, self.config.teacher_thinking == "on")
            cache[key] = np.asarray(ids, dtype=np.int32)
        return cache[key]

    def _student_topk(self, rec: dict, where: Where, k: int | None, flag: str) -> np.ndarray:
        """The record's top-k ids (the first k columns; all when k is None)."""
        ids = rec.get("topk_ids")
        have = 0 if ids is None or ids.ndim != 2 else ids.shape[1]
        if have == 0 or (k is not None and have < k):
            want = k or "k"
            raise RecordError(f"{where}: {flag} needs the student's top-{want} ids but the record has {have}; "
                              f"run opd-rollout with --topk-logprobs {want}")
        return ids if k is None else ids[:, :k]

    def score(self, window: list[tuple[dict, Where]]) -> None:
        cfg = self.config
        cache: dict = {}
        adapters = adapters_for(cfg.follow, window) if cfg.follow else None
        for t in cfg.teachers:
            flag = f"--teacher {t.name}={t.model}"
            if t.name in self.aligners:
                self._score_text(t, flag, window, cache)
                continue
            seqs = []
            for rec, where in window:
                at = self._student_topk(rec, where, None, "--at-student-topk") if cfg.at_student_topk else None
                seqs.append(Sequence(self._context(rec, where, flag, cache), rec["response_ids"], at))
            teacher = self.teachers[t.name]
            if adapters is None:
                groups = [(t.adapter, list(range(len(window))))]
            else:
                groups = list(by_adapter(adapters, teacher.adapter))
            for adapter, idx in groups:
                if adapters is not None:
                    teacher.set_adapter(adapter)  # in place; the base model stays loaded
                for i, scores in zip(idx, teacher.score([seqs[i] for i in idx], cfg.topk), strict=True):
                    rec = window[i][0]
                    rec.setdefault("teachers", {})[t.name] = self._teacher_block(t, adapter, scores, rec)
        if self.shift_models:
            self._score_shift(window, cache)
        if self.grader is not None:
            self._score_rewards(window)

    def _score_text(self, spec, flag: str, window, cache: dict) -> None:
        """A teacher with another tokenizer: align, score its own tokens of the text, write teachers.NAME.text."""
        from .cross import score_text, text_block, text_sequences

        other = not self.aligners[spec.name].same_vocab
        contexts = [self._context(rec, where, flag, cache, text=other) for rec, where in window]
        aligns, seqs = text_sequences(self.aligners[spec.name], window, contexts, self.align_counts[spec.name])
        scores = score_text(self.teachers[spec.name], aligns, seqs, self.config.topk)
        for (rec, _), al, sc in zip(window, aligns, scores, strict=True):
            block = {"model": spec.model, "revision": spec.revision, "adapter": spec.adapter,
                     "prompt": AS_IS if self.template is None else self.template.name,
                     "text": text_block(al, sc, self.config.topk)}
            rec.setdefault("teachers", {})[spec.name] = block

    def _teacher_block(self, spec, adapter: str | None, scores, rec: dict) -> dict:
        block = {"model": spec.model, "revision": spec.revision, "adapter": adapter,
                 "prompt": AS_IS if self.template is None else self.template.name, "logprobs": scores.logprobs}
        if scores.topk_ids is not None:
            block.update(topk="teacher", topk_ids=scores.topk_ids, topk_logprobs=scores.topk_logprobs)
        if scores.at_logprobs is not None:
            block.update(topk="student", topk_ids=rec["topk_ids"], topk_logprobs=scores.at_logprobs)
        return block

    def _score_shift(self, window, cache) -> None:
        cfg = self.config
        post, pre = self.shift_models
        seqs = {}
        for side, model in zip(("post", "pre"), cfg.shift_pair, strict=True):
            flag = f"--shift {side}={model}"
            seqs[side] = [Sequence(self._context(rec, where, flag, cache), rec["response_ids"],
                                   self._student_topk(rec, where, cfg.shift_k, "--shift")) for rec, where in window]
        post_scores, pre_scores = post.score(seqs["post"]), pre.score(seqs["pre"])
        for (rec, _), a, b, seq in zip(window, post_scores, pre_scores, seqs["post"], strict=True):
            rec["shift"] = {"post": cfg.shift_pair[0], "pre": cfg.shift_pair[1], "k": cfg.shift_k,
                            "ids": seq.at_ids, "delta": (a.at_logprobs - b.at_logprobs).astype(np.float32)}

    def _score_rewards(self, window) -> None:
        from opd_common.grading import reward

        from .reward_scale import rescale

        cfg = self.config
        items = []
        for rec, where in window:
            answer = rec["example"].get("answer")
            if answer is None:
                raise RecordError(f"{where}: example has no 'answer' field, which --reward math grades against")
            items.append((rec.get("response_text", ""), str(answer)))
        grades = self.grader.grade(items, cfg.grader)
        for (rec, _), grade in zip(window, grades, strict=True):
            block = reward(grade, rec["finish_reason"], len(rec["response_ids"]), require_stop=cfg.require_stop,
                           max_response_tokens=cfg.max_response_tokens, overlong_buffer=cfg.overlong_buffer,
                           verifier=cfg.grader)
            rec["reward"] = rescale(block, cfg.reward_scale, cfg.require_stop)
