"""opd-score's pure entry point: run(config, inputs, writer) -> exit code.

Records stream in, are gathered into windows (``--window``; less when a pipe pauses), scored
window by window (teachers sort by length inside and batch by ``--token-budget``) and written in
input order. Teachers score ``response_ids`` verbatim; nothing else in a record changes.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from opd_common.batching import batches
from opd_common.errors import ConfigError, RecordError
from opd_common.prompts import AS_IS, Template, load
from opd_common.records import Where
from opd_common.streams import InputSource, iter_inputs

from .follow import adapter_for, by_adapter
from .teacher_hf import Sequence

log = logging.getLogger("opd-score")


def vocab_fingerprint(tokenizer) -> dict[str, int]:
    return tokenizer.get_vocab()


def check_same_vocab(student_name: str, student, teacher_flag: str, teacher) -> None:
    """Refuse a teacher whose token ids do not mean the student's strings (ids cross tools as-is)."""
    s_vocab, t_vocab = vocab_fingerprint(student), vocab_fingerprint(teacher)
    if s_vocab == t_vocab:
        return
    s_by_id = {i: tok for tok, i in s_vocab.items()}
    t_by_id = {i: tok for tok, i in t_vocab.items()}
    # over both id sets: a teacher vocabulary that is a prefix of the student's differs only in ids it lacks
    differ = sum(1 for i in s_by_id.keys() | t_by_id.keys() if s_by_id.get(i) != t_by_id.get(i))
    raise ConfigError(
        f"{teacher_flag}: its tokenizer differs from the student's ({student_name}): {differ} token ids "
        f"map to other strings or exist in only one of them (vocab sizes {len(s_vocab)} vs {len(t_vocab)}); "
        "teachers must share the student's tokenizer because records carry token ids"
    )


class Scorer:
    """Holds the teachers, shift pair and grader; scores one window of records in place."""

    def __init__(self, config):
        self.config = config
        self.template: Template | None = None if config.teacher_prompt == AS_IS else load(config.teacher_prompt)
        self.teachers: dict[str, Any] = {}
        self.tokenizers: dict[str, Any] = {}
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
            specs += [(f"--shift {side}={m}", m, None, None) for side, m in zip(("post", "pre"), cfg.shift_pair, strict=True)]
        if specs:
            student_name = cfg.student_tokenizer or (first.get("policy") or {}).get("model")
            try:
                student = load_tokenizer(student_name, None) if student_name else None
            except Exception as exc:
                raise ConfigError(f"cannot check the teachers' vocabulary: the student tokenizer {student_name!r} "
                                  f"does not load here ({str(exc).splitlines()[0]}); pass --student-tokenizer") from None
            if student is None:
                raise ConfigError("cannot check the teachers' vocabulary: records have no policy.model; pass --student-tokenizer")
        if cfg.follow:
            sampled = (first.get("policy") or {}).get("model")
            for t in cfg.teachers:
                if t.model != sampled:
                    log.warning("--follow %s: teacher %s is %s but the records were sampled by %s; the run's "
                                "adapters belong to the student's base model", cfg.follow, t.name, t.model, sampled)
        engines = {}
        for flag, model, revision, adapter in specs:
            engines[flag] = self._engine(model, revision, adapter, flag)
            check_same_vocab(student_name, student, flag, self.tokenizers[flag])
        self.teachers = {t.name: engines[f"--teacher {t.name}={t.model}"] for t in cfg.teachers}
        if cfg.shift_pair:
            self.shift_models = (engines[specs[-2][0]], engines[specs[-1][0]])
        if cfg.reward:
            from opd_common.grading import Grader

            self.grader = Grader(workers=cfg.grade_workers).__enter__()

    def close(self) -> None:
        if self.grader is not None:
            self.grader.__exit__(None, None, None)
        for engine in list(self.teachers.values()) + list(self.shift_models or ()):
            engine.close()

    # ------------------------------------------------------------------ per window

    def _context(self, rec: dict, where: Where, flag: str, cache: dict) -> np.ndarray:
        if self.template is None:
            return rec["prompt_ids"]
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
        adapters = [adapter_for(cfg.follow, rec, where) for rec, where in window] if cfg.follow else None
        for t in cfg.teachers:
            flag = f"--teacher {t.name}={t.model}"
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

        cfg = self.config
        items = []
        for rec, where in window:
            answer = rec["example"].get("answer")
            if answer is None:
                raise RecordError(f"{where}: example has no 'answer' field, which --reward math grades against")
            items.append((rec.get("response_text", ""), str(answer)))
        grades = self.grader.grade(items, cfg.grader)
        for (rec, _), grade in zip(window, grades, strict=True):
            rec["reward"] = reward(grade, rec["finish_reason"], len(rec["response_ids"]), require_stop=cfg.require_stop,
                                   max_response_tokens=cfg.max_response_tokens, overlong_buffer=cfg.overlong_buffer,
                                   verifier=cfg.grader)


def score_here(config, windows) -> Iterator[list]:
    """Score windows in this process (teachers load on the first window)."""
    from opd_common.timeline import timeline

    tl = timeline("opd-score")
    scorer = Scorer(config)
    windows = iter(windows)
    try:
        while True:
            with tl.span("read"):
                window = next(windows, None)
            if window is None:
                return
            if not scorer.opened:
                scorer.open(window[0][0])
            with tl.span("score", records=len(window), tokens=sum(len(r["response_ids"]) for r, _ in window)):
                scorer.score(window)
            yield window
    finally:
        scorer.close()


def run(config, inputs: list[str], writer, sources: list[InputSource] | None = None) -> int:
    """Score every record of `inputs` and write it (with its new blocks) in input order."""
    from opd_common.cli_util import progress

    records = iter_inputs(inputs, check=True, sources=sources)
    if writer.resumed:
        log.info("resuming: skipping %d records already scored", writer.resumed)
        records = itertools.islice(records, writer.resumed, None)
    windows = batches(records, config.window)
    if config.data_parallel > 1:
        from .parallel import score_in_workers

        scored = score_in_workers(config, windows, config.data_parallel)
    else:
        scored = score_here(config, windows)
    t0, tokens, count = time.perf_counter(), 0, 0
    with progress(None, "record", config.quiet, "opd-score") as bar:
        for window in scored:
            for rec, _ in window:
                writer.write(rec)
                tokens += len(rec["response_ids"])
            writer.flush()
            count += len(window)
            bar.update(len(window))
            bar.set_postfix_str(f"{tokens / max(time.perf_counter() - t0, 1e-9):.0f} tok/s")
    seconds = time.perf_counter() - t0
    log.info("%d records, %d response tokens in %.1f s (%.0f tok/s)", count, tokens, seconds, tokens / max(seconds, 1e-9))
    return 0
