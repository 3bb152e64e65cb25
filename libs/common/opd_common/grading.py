"""Math answer grading shared by ``opd-score --reward math`` and ``opd-eval`` (docs/grading.md).

Pipeline for one (response text, gold answer) pair, following the OPSD evaluator (reading answers:
opd_common.answers; opd's rules beyond math-verify: opd_common.answer_rules):

1. extract the answer: the last ``\\boxed{...}`` / ``\\fbox{...}`` with balanced braces (with the
   boxes listed right before it: '$\\boxed{1}$ and $\\boxed{-2}$' is '1, -2'), else the last
   ``Answer: ...`` line; a response whose last box is cut off (truncated) has no answer. A gold
   that holds a box (a worked solution) is read the same way;
2. ``mode="math"``: equal after string normalization -> match; else math-verify ``parse`` of both
   sides (a bare gold is wrapped in ``$...$``) and ``verify`` with a timeout (inequalities against
   intervals allowed), then opd's own rules: decimal commas, decimal approximations, inequalities
   joined by 'or' against a union of intervals;
   ``mode="integer"`` (AIME-style): both sides reduced to integers and compared.

math-verify enforces its timeout with ``signal.alarm``, which only works in a process's main
thread, so ``grade_one`` must run in a worker process: ``Grader`` keeps a pool of them and also
enforces an overall per-item timeout from the parent (a stuck worker is killed, never waited on).
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from opd_common.answer_rules import beyond_math_verify, decimal_comma
from opd_common.answers import (
    as_latex,
    extract_answer,
    extract_boxed,
    extract_boxes,
    gold_answer,
    has_value,
    normalize_answer,
    parse_latex,
    to_integer,
    verify_latex,
)
from opd_common.errors import ConfigError, OpdError, RecordError, require

# Reading answers lives in opd_common.answers, opd's own rules in opd_common.answer_rules; the grader's
# callers import what they need from here.
__all__ = ["MODES", "REASONS", "Grade", "Grader", "extract_answer", "extract_boxed", "extract_boxes", "gold_answer",
           "grade_one", "normalize_answer", "overlong_penalty", "reward", "to_integer"]

MODES = ("math", "integer")
REASONS = ("match", "no-answer", "parse-failure", "mismatch", "timeout")


@dataclass
class Grade:
    """The verdict on one response.

    reason: 'match' (correct), 'no-answer' (nothing extracted), 'parse-failure' (an answer was
    extracted but math-verify read nothing from it or from the gold, or, in integer mode, it is not
    an integer), 'mismatch' (read, compared, different), 'timeout' (grading ran out of time).
    """

    correct: bool
    extracted: str | None
    reason: str


def _grade_integer(answer: str, gold: str, timeout: float) -> Grade:
    gold_int = to_integer(gold, timeout)
    if gold_int is None:
        raise RecordError(f"gold answer {gold!r} is not an integer, so the integer grader cannot "
                          "grade against it (use the math grader)")
    pred_int = to_integer(answer, timeout)
    if pred_int is None:
        return Grade(False, answer, "parse-failure")
    return Grade(pred_int == gold_int, answer, "match" if pred_int == gold_int else "mismatch")


def grade_one(prediction_text: str, gold: str, mode: str = "math", timeout: float = 5.0) -> Grade:
    """Grade one response against one gold answer (module docstring). Runs math-verify in this
    process with signal timeouts: call it only in a process's main thread (a Grader worker)."""
    from math_verify.errors import TimeoutException

    if mode not in MODES:
        raise ConfigError(f"unknown grader {mode!r}; choose one of {', '.join(MODES)}")
    answer, _how = extract_answer(prediction_text)
    if answer is None:
        return Grade(False, None, "no-answer")
    gold = gold_answer(gold)
    try:
        if mode == "integer":
            return _grade_integer(answer, gold, timeout)
        norm = normalize_answer(answer)
        if norm and norm == normalize_answer(gold):
            return Grade(True, answer, "match")
        gold_text, pred_text = decimal_comma(gold, answer), decimal_comma(answer, gold)
        gold_parsed, pred_parsed = parse_latex(as_latex(gold_text), timeout), parse_latex(as_latex(pred_text), timeout)
        if not has_value(gold_parsed):
            return Grade(False, answer, "parse-failure")
        ok = has_value(pred_parsed) and verify_latex(gold_parsed, pred_parsed, timeout) or \
            beyond_math_verify(gold_text, pred_text, gold_parsed, pred_parsed, timeout)
        if not ok and not has_value(pred_parsed):
            return Grade(False, answer, "parse-failure")
    except TimeoutException:
        return Grade(False, answer, "timeout")
    return Grade(ok, answer, "match" if ok else "mismatch")


# ------------------------------------------------------------------------------ worker pool


def _init_worker(ready) -> None:
    """Pool initializer: import math-verify (and sympy) once, then say so. Never raises: a worker
    whose initializer fails is respawned by the pool forever; the import error surfaces per task."""
    try:
        import math_verify  # noqa: F401
    except Exception:
        pass
    finally:
        ready.release()


class Grader:
    """A pool of worker processes running `grade_fn` (default `grade_one`); a context manager.

    Usable from any thread. `timeout` is math-verify's per-call limit inside a worker;
    `item_timeout` is the parent's limit on one item's wall time once its turn comes (default
    8 x `timeout` + 5 s): an item past it is graded 'timeout', the pool is killed and restarted and
    the rest of the batch resubmitted. `grade_fn` must be a picklable module-level function with
    `grade_one`'s signature (tests inject a slow one).
    """

    def __init__(self, workers: int | None = None, timeout: float = 5.0, item_timeout: float | None = None,
                 grade_fn: Callable[..., Grade] = grade_one, start_timeout: float = 120.0):
        self.workers = workers or min(4, os.cpu_count() or 1)
        if self.workers < 1:
            raise ConfigError(f"grader workers must be >= 1, got {workers}")
        self.timeout = timeout
        self.item_timeout = item_timeout if item_timeout is not None else 8 * timeout + 5
        self.grade_fn = grade_fn
        self.start_timeout = start_timeout
        self._pool = None

    def __enter__(self) -> Grader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop the workers (idempotent)."""
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None

    def _ensure_pool(self):
        """Start the pool (spawn: no forked locks or CUDA state) and wait until workers are up,
        so that start-up time never counts against an item's timeout."""
        if self._pool is None:
            if importlib.util.find_spec("math_verify") is None:
                require("math_verify", "eval")  # raises DependencyError naming the extra
            ctx = mp.get_context("spawn")
            ready = ctx.Semaphore(0)
            self._pool = ctx.Pool(self.workers, initializer=_init_worker, initargs=(ready,))
            # Pool._pool (its worker processes) is private, but a worker that dies before its
            # initializer runs (e.g. spawn cannot re-import the main module) is otherwise respawned
            # forever while we wait. Keep the first workers: the pool reaps dead ones from its list.
            first = list(getattr(self._pool, "_pool", []))
            deadline, started = time.monotonic() + self.start_timeout, 0
            while started < self.workers:
                if ready.acquire(timeout=0.1):
                    started += 1
                    continue
                codes = [p.exitcode for p in first if p.exitcode is not None]
                if codes or time.monotonic() > deadline:
                    self.close()
                    why = f"exited with code {codes[0]}" if codes else f"did not start in {self.start_timeout:.0f} s"
                    raise OpdError(f"grader worker processes {why} (see the worker traceback above; spawned "
                                   "workers re-import the main module, which must be a file or a package)")
        return self._pool

    def grade(self, items: list[tuple[str, str]], mode: str = "math") -> list[Grade]:
        """Grade (prediction text, gold) pairs in the workers; results in input order."""
        if mode not in MODES:
            raise ConfigError(f"unknown grader {mode!r}; choose one of {', '.join(MODES)}")
        results: list[Grade] = []
        pending = list(items)
        while pending:
            pool = self._ensure_pool()
            kwargs = {"mode": mode, "timeout": self.timeout}
            handles = [pool.apply_async(self.grade_fn, item, kwargs) for item in pending]
            rest: list[tuple[str, str]] = []
            for i, handle in enumerate(handles):
                try:
                    results.append(handle.get(timeout=self.item_timeout))
                except mp.TimeoutError:
                    results.append(Grade(False, extract_answer(pending[i][0])[0], "timeout"))
                    self.close()  # the stuck worker cannot be interrupted: kill the pool
                    rest = pending[i + 1 :]
                    break
            pending = rest
        return results


# ---------------------------------------------------------------------------------- reward


def overlong_penalty(response_len: int, max_response_tokens: int | None, overlong_buffer: int | None) -> float:
    """DAPO soft overlong penalty; L_max = max_response_tokens, cache = overlong_buffer:

        0                            if len <= L_max - cache
        (L_max - cache - len) / cache  if L_max - cache < len <= L_max   (0 down to -1, linear)
        -1                           if len > L_max

    No L_max -> 0. No (or zero) cache -> a hard cut: -1 past L_max, else 0.
    """
    if max_response_tokens is None:
        return 0.0
    cache = overlong_buffer or 0
    if not 0 <= cache <= max_response_tokens:
        raise ConfigError(f"overlong buffer {cache} must be in [0, max response tokens {max_response_tokens}]")
    if response_len > max_response_tokens:
        return -1.0
    if response_len <= max_response_tokens - cache:
        return 0.0
    return (max_response_tokens - cache - response_len) / cache


def reward(grade: Grade, finish_reason: str, response_len: int, *, require_stop: bool = False,
           max_response_tokens: int | None = None, overlong_buffer: int | None = None,
           format_penalty: float = 0.0, verifier: str = "math") -> dict:
    """The record's ``reward`` block for one graded response.

    correct       1 if the grader matched, else 0 (the verdict, whatever the finish reason)
    format_ok     an answer was extracted (box or answer line)
    stop_ok       finish_reason == 'stop'
    length_penalty  ``overlong_penalty(response_len, max_response_tokens, overlong_buffer)``
    total         accuracy + length_penalty - format_penalty * (not format_ok), where
                  accuracy = 1.0 if correct (and, with require_stop, stop_ok) else 0.0
    verifier, extracted, reason  which grader, what it extracted, and why (Grade.reason)
    """
    stop_ok = finish_reason == "stop"
    format_ok = grade.extracted is not None
    penalty = overlong_penalty(response_len, max_response_tokens, overlong_buffer)
    accuracy = 1.0 if grade.correct and (stop_ok or not require_stop) else 0.0
    total = accuracy + penalty - (0.0 if format_ok else format_penalty)
    return {"correct": int(grade.correct), "format_ok": format_ok, "stop_ok": stop_ok,
            "length_penalty": penalty, "total": total, "verifier": verifier,
            "extracted": grade.extracted, "reason": grade.reason}
