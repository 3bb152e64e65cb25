"""Math answer grading shared by ``opd-score --reward math`` and ``opd-eval`` (docs/grading.md).

Pipeline for one (response text, gold answer) pair, following the OPSD evaluator:

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
import math
import multiprocessing as mp
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from decimal import ROUND_DOWN, ROUND_HALF_UP, Decimal

from opd_common.errors import ConfigError, OpdError, RecordError, require

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


# ---------------------------------------------------------------------------------- extraction

_BOX = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_ANSWER_LINE = re.compile(r"^[ \t*_#>]*(?:final\s+)?answer\s*[*_]*\s*[:：]\s*[*_]*(.*?)[*_\s]*$",
                          re.IGNORECASE | re.MULTILINE)
_MATH_DELIMS = (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"))


def _group_end(text: str, start: int) -> int | None:
    """The index of the '}' closing the brace group that opens at text[start] == '{', or None."""
    depth, i = 0, start
    while i < len(text):
        ch = text[i]
        if ch == "\\":  # an escaped char (\{, \}, \\) never opens or closes a group
            i += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


@dataclass
class _Box:
    start: int  # where '\boxed' begins
    end: int  # just past its group (or shorthand token); len(text) if never closed
    contents: str | None  # None: never closed (truncated)


def _boxes(text: str) -> list[_Box]:
    """Every ``\\boxed``/``\\fbox`` in `text`, in order: braced, ``\\boxed {x}`` or shorthand ``\\boxed 5``."""
    found = []
    for match in _BOX.finditer(text):
        rest = text[match.end() :]
        stripped = rest.lstrip()
        at = match.end() + len(rest) - len(stripped)
        if stripped.startswith("{"):
            close = _group_end(text, at)
            box = _Box(match.start(), len(text), None) if close is None else \
                _Box(match.start(), close + 1, text[at + 1 : close])
        elif rest[:1].isspace() and (token := re.match(r"[^\s$]+", stripped)):
            box = _Box(match.start(), at + token.end(), token.group(0))
        else:
            box = _Box(match.start(), len(text), None)
        found.append(box)
    return found


def extract_boxed(text: str) -> str | None:
    """The contents of the last ``\\boxed{...}`` or ``\\fbox{...}`` in `text`, braces balanced.

    Nested and escaped braces are handled, as are ``\\boxed {x}`` and the shorthand ``\\boxed x``.
    If the last box is never closed (a response truncated mid-answer) the result is None, not an
    earlier box: a truncated response has not committed to a final answer.
    """
    boxes = _boxes(text)
    return boxes[-1].contents if boxes else None


# What may stand between the boxes of one answer list: '$\boxed{1}$ and $\boxed{-2}$',
# 'x = \boxed{1}, x = \boxed{-2}', '\boxed{(1,2)},\quad \boxed{(3,4)}', '\boxed{1} papers and \boxed{2}' (a unit
# word, then 'and'). Other prose ('Wait, no:', '. Checking again,') ends the list.
_LIST_GLUE = re.compile(r"(?:\s|\$|\\[()\[\]]|[,;&]|\\\\|\\q?quad\b|\\[,;:! ]|~|\b(?:and|or)\b"
                        r"|\\(?:text|mathrm|textrm)\s*\{\s*(?:and|or|,)?\s*\}"
                        r"|[A-Za-z](?:_\{?\w{1,3}\}?)?\s*=|\b[A-Za-z]{2,12}\s+and\b)*", re.IGNORECASE)


def extract_boxes(text: str) -> list[str] | None:
    """The final answer's boxes: the last box and the boxes right before it that form one list with it
    (only connectives such as ',', 'and', 'or', '$', '\\quad' or 'x =' between them), in order.

    '$\\boxed{1}$ and $\\boxed{-2}$' gives ['1', '-2']; 'first \\boxed{41}, then corrected: \\boxed{42}'
    gives ['42']. None when there is no box or the last box is never closed (truncated).
    """
    boxes = _boxes(text)
    if not boxes or boxes[-1].contents is None:
        return None
    group = [boxes[-1]]
    for prev in reversed(boxes[:-1]):
        glue = text[prev.end : group[0].start]
        if prev.contents is None or prev.end > group[0].start or len(glue) > 40 or not _LIST_GLUE.fullmatch(glue):
            break
        group.insert(0, prev)
    return [box.contents for box in group]


def _unwrap(answer: str) -> str:
    """Strip whitespace and one pair of surrounding math delimiters ($...$, \\(...\\), ...)."""
    answer = answer.strip()
    for left, right in _MATH_DELIMS:
        if len(answer) > len(left) + len(right) and answer.startswith(left) and answer.endswith(right):
            return answer[len(left) : -len(right)].strip()
    return answer


def _join_boxes(contents: list[str]) -> str:
    """One answer from a list of boxes: their contents, each once, joined by ', ' ('1, -2')."""
    seen: dict[str, str] = {}
    for item in (_unwrap(c) for c in contents):
        seen.setdefault(normalize_answer(item), item)
    return ", ".join(item for item in seen.values() if item)


def extract_answer(text: str) -> tuple[str | None, str]:
    """(answer, how): the final boxes ('boxed'), else the last ``Answer: ...`` line ('answer-line').

    Several boxes that form one list ('$\\boxed{1}$ and $\\boxed{-2}$', see `extract_boxes`) are one
    answer, '1, -2'. ``Final answer:``, ``**Answer:** 42`` and ``Answer: $42$`` count as answer lines.
    An empty box or line is no answer: (None, 'none').
    """
    if _BOX.search(text):
        contents = extract_boxes(text)
        if contents is not None and contents[-1].strip():
            return _join_boxes(contents), "boxed"
        return None, "none"
    lines = _ANSWER_LINE.findall(text)
    if lines:
        line = _unwrap(lines[-1])
        inner = extract_boxed(line) if _BOX.search(line) else None
        line = _unwrap(inner) if inner is not None else line
        if line:
            return line, "answer-line"
    return None, "none"


def gold_answer(gold: str) -> str:
    """The gold answer to compare with: a gold that is a worked solution ending in a box (MATH's
    ``solution`` field) is read like a response, by its final boxes; any other gold is used whole."""
    if _BOX.search(gold):
        answer, _how = extract_answer(gold)
        if answer is not None:
            return answer
    return gold


# ------------------------------------------------------------------------------- normalization

_WRAPPERS = re.compile(r"\\(?:text|textbf|textit|textrm|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")
_UNITS = (r"(?:degrees?|deg|radians?|cm|mm|km|m|meters?|metres?|centimeters?|inch(?:es)?|in|feet|foot|ft"
          r"|square\s+units|sq\s+units|units?|cents?|dollars?|hours?|hrs?|minutes?|mins?|seconds?|sec|s"
          r"|mph|kg|g|grams?|lbs?|pounds?)")
_TRAILING_UNIT = re.compile(rf"(?<=[\d}}])\s*{_UNITS}(?:\^\{{?[23]\}}?)?\s*$")


def normalize_answer(answer: str) -> str:
    """A canonical string for the fallback comparison (never used to decide 'wrong').

    Drops ``$``, spaces, ``\\left``/``\\right``, ``\\!``-style spacing, ``\\text{...}``-style
    wrappers (keeping their contents), degree signs, a trailing unit word after a number, a
    trailing period and thousands separators in a number ('32,348' -> '32348');
    ``\\dfrac``/``\\tfrac`` become ``\\frac`` and ``\\frac12`` becomes ``\\frac{1}{2}``.
    """
    s = _unwrap(answer)
    s = re.sub(r"\\[dt]frac(?![A-Za-z])", r"\\frac", s)
    s = re.sub(r"\\(?:left|right)(?![A-Za-z])", "", s)
    s = re.sub(r"\^\s*\{?\\circ\}?|\\circ|\\degree|°", "", s)
    while True:
        unwrapped = _WRAPPERS.sub(r"\1", s)
        if unwrapped == s:
            break
        s = unwrapped
    s = re.sub(r"\\[!,;: ]|~", " ", s).replace("\\$", "").replace("$", "")
    s = _TRAILING_UNIT.sub("", s.strip())
    s = re.sub(r"\s+", "", s).rstrip(".")
    if re.fullmatch(r"[+-]?\d{1,3}(,\d{3})+(\.\d+)?", s):  # thousands separators: '32,348' (MATH's '\$32,\!348')
        s = s.replace(",", "")
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    return re.sub(r"\\sqrt(\d)", r"\\sqrt{\1}", s)


def to_integer(answer: str, timeout: float = 5.0) -> int | None:
    """`answer` as an int if it is one ('025', '25.0', '$25$', '25^\\circ', '1,000', 'n=25',
    '\\frac{50}{2}'), else None. Falls back to math-verify, so call it in a worker process."""
    s = normalize_answer(answer)
    s = s.rsplit("=", 1)[-1]
    if re.fullmatch(r"[+-]?\d{1,3}(,\d{3})+", s):
        s = s.replace(",", "")
    if re.fullmatch(r"[+-]?\d+(\.0*)?", s):
        return int(s.split(".")[0])
    for value in _parse(f"${s}$", timeout):
        number = _evaluate_integer(value, timeout)
        if number is not None:
            return number
    return None


def _evaluate_integer(value, timeout: float) -> int | None:
    """A parsed value as an int if it is an integral number: math-verify leaves products and
    powers unevaluated ('5\\sqrt{25}' -> 5*sqrt(25)), so evaluate, under its signal timeout."""
    import sympy
    from math_verify.utils import timeout as with_timeout

    if not isinstance(value, sympy.Basic) or not value.is_number:
        return None
    number = with_timeout(max(1, math.ceil(timeout)))(value.doit)()
    if number.is_Integer:
        return int(number)
    if number.is_Float and float(number).is_integer():  # sympy >= 1.13: Float(25.0) != 25
        return int(float(number))
    return None


# ---------------------------------------------------------------------------------- grading


def _parse_raw(latex: str, timeout: float) -> list:
    from math_verify import parse
    from math_verify.errors import TimeoutException

    try:
        return parse(latex, parsing_timeout=max(1, math.ceil(timeout)), raise_on_error=True)
    except TimeoutException:
        raise
    except Exception:
        return []


_LETTER_IN_TEXT = re.compile(r"\\(?:text|mathrm|textrm|mathit)\s*\{\s*([A-Za-z])\s*\}")


def _mangled(parsed: list) -> bool:
    """Whether math-verify's reading of a text is cut off: the text it read has unbalanced braces."""
    texts = [re.sub(r"\\[{}]", "", item) for item in parsed if isinstance(item, str)]
    return any(text.count("{") != text.count("}") for text in texts)


def _parse(latex: str, timeout: float) -> list:
    """math-verify parse with its signal timeout; a TimeoutException propagates, errors -> [].

    math-verify drops a ``\\text{..}``/``\\mathrm{..}`` it takes for a unit even inside a group, so
    '1 - \\frac{1}{\\mathrm{e}}' reads as 1. A reading cut off like that (unbalanced braces in the text
    it read) is retried with such one-letter wrappers removed, and if still cut off it counts as no value.
    """
    parsed = _parse_raw(latex, timeout)
    if _mangled(parsed):
        retry = _LETTER_IN_TEXT.sub(r"\1", latex)
        parsed = _parse_raw(retry, timeout) if retry != latex else parsed
        if _mangled(parsed):
            parsed = [item for item in parsed if isinstance(item, str)]
    return parsed


def _verify(gold: list, pred: list, timeout: float) -> bool:
    """math-verify verify, pair by pair (as verify does), so that a timeout is seen, not swallowed.
    An inequality answer is compared with an interval gold as a set: '-2 \\le x \\le 7' is '[-2, 7]'."""
    from math_verify import verify
    from math_verify.errors import TimeoutException

    seconds = max(1, math.ceil(timeout))
    for g in gold:
        for p in pred:
            try:
                if verify(g, p, timeout_seconds=seconds, raise_on_error=True, allow_set_relation_comp=True):
                    return True
            except TimeoutException:
                raise
            except Exception:
                continue
    return False


def _has_value(parsed: list) -> bool:
    """Whether math-verify read a value: it falls back to returning the raw string (fallback_mode
    'first_match'), and a string alone only compares by exact text, which the normalized string
    check already did."""
    return any(not isinstance(item, str) for item in parsed)


def _as_latex(answer: str) -> str:
    """Wrap a bare answer in $...$ (math-verify parses a bare '\\frac{1}{2}' to nothing)."""
    return answer if "$" in answer or "\\boxed" in answer else f"${answer}$"


# ----------------------------------------------------------------- rules beyond math-verify

_PLAIN_DECIMAL = re.compile(r"[+-]?\d*\.(\d+)")
_SIGNIFICANT = 4  # digits an approximation must show: '2.667' for 8/3, not '2.67' or '0.33' for 1/3


def _plain_number(answer: str) -> str:
    """`answer` without math delimiters, spaces and LaTeX spacing ('1{,}5' -> '1,5')."""
    return re.sub(r"\s|\\[,!;: ]", "", _unwrap(answer)).replace("{,}", ",")


def _decimal_comma(answer: str, other: str) -> str:
    """`answer` with its decimal comma read as a point when the other side is a decimal number:
    '1,22' -> '1.22', '0,5' -> '0.5', '1.234,5' -> '1234.5'. A comma before exactly three digits
    ('2,500') stays a thousands separator, unless the part before it is 0 ('0,125')."""
    if not _PLAIN_DECIMAL.fullmatch(normalize_answer(other)):
        return answer
    s = _plain_number(answer)
    if re.fullmatch(r"[+-]?\d{1,3}(\.\d{3})+,\d+", s):
        return s.replace(".", "").replace(",", ".")
    m = re.fullmatch(r"([+-]?\d+),(\d+)", s)
    if m and (len(m.group(2)) != 3 or m.group(1).lstrip("+-") == "0"):
        return f"{m.group(1)}.{m.group(2)}"
    return answer


def _numbers(parsed: list) -> list:
    """The real numbers among math-verify's parsed values (no sets, symbols or equations)."""
    import sympy

    return [v for v in parsed if isinstance(v, sympy.Expr) and v.is_number and v.is_real]


def _rounded(value, places: int) -> Decimal:
    return Decimal(str(value.evalf(40))).quantize(Decimal(1).scaleb(-places), rounding=ROUND_HALF_UP)


def _approximates(gold: str, pred: str, gold_parsed: list, pred_parsed: list) -> bool:
    """A decimal approximation of an exact value, either way round:

    - the answer is a decimal of at least 4 significant digits and the exact, non-integer gold
      rounded or cut off at the answer's last digit ('2.6667', '2.6666' or '2.667' for 8/3; not '2.67');
    - the gold is a decimal of 2 or more places and the exact answer rounds to it ('\\frac{1}{3}' for
      '0.33', the form MATH stores 'to the nearest hundredth' answers in).
    """
    import sympy

    gold_digits, pred_digits = _PLAIN_DECIMAL.fullmatch(normalize_answer(gold)), \
        _PLAIN_DECIMAL.fullmatch(_plain_number(pred))
    for g in _numbers(gold_parsed):
        for p in _numbers(pred_parsed):
            exact_gold, exact_pred = not g.has(sympy.Float), not p.has(sympy.Float)
            if pred_digits and exact_gold and not g.is_Integer:
                places = len(pred_digits.group(1))
                shown = Decimal(pred_digits.group(0))
                significant = len(str(abs(shown)).replace(".", "").lstrip("0"))
                cut = Decimal(str(g.evalf(40))).quantize(Decimal(1).scaleb(-places), rounding=ROUND_DOWN)
                if significant >= _SIGNIFICANT and shown in (_rounded(g, places), cut):
                    return True
            if gold_digits and len(gold_digits.group(1)) >= 2 and exact_pred and not p.is_Integer:
                if _rounded(p, len(gold_digits.group(1))) == Decimal(gold_digits.group(0)):
                    return True
    return False


_OR = re.compile(r"\\(?:text|mathrm)\s*\{\s*or\s*\}|\\(?:lor|vee)(?![A-Za-z])|\bor\b")


def _inequalities_union(gold_parsed: list, pred: str, timeout: float) -> bool:
    """An answer of inequalities joined by 'or' ('x < 2 \\text{ or } x > 3') against a gold union of
    intervals ('(-\\infty, 2) \\cup (3, \\infty)'): the union of their solution sets."""
    import sympy

    gold_sets = [g for g in gold_parsed if isinstance(g, sympy.Set)]
    if not gold_sets or not _OR.search(pred):
        return False
    for value in _parse(_as_latex(_OR.sub(",", pred)), timeout):
        conditions = (sympy.core.relational.Relational, sympy.logic.boolalg.And)
        if not isinstance(value, sympy.FiniteSet) or not all(isinstance(r, conditions) for r in value.args):
            continue
        if len(set().union(*(r.free_symbols for r in value.args))) != 1:
            continue
        union = sympy.Union(*(r.as_set() for r in value.args))
        if any(union == g for g in gold_sets):
            return True
    return False


def _beyond_math_verify(gold: str, pred: str, gold_parsed: list, pred_parsed: list, timeout: float) -> bool:
    """opd's rules for what math-verify rejects (docs/grading.md), under math-verify's signal timeout."""
    from math_verify.utils import timeout as with_timeout

    def check() -> bool:
        return _approximates(gold, pred, gold_parsed, pred_parsed) or _inequalities_union(gold_parsed, pred, timeout)

    return with_timeout(max(1, math.ceil(timeout)))(check)()


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
        gold_text, pred_text = _decimal_comma(gold, answer), _decimal_comma(answer, gold)
        gold_parsed, pred_parsed = _parse(_as_latex(gold_text), timeout), _parse(_as_latex(pred_text), timeout)
        if not _has_value(gold_parsed):
            return Grade(False, answer, "parse-failure")
        ok = _has_value(pred_parsed) and _verify(gold_parsed, pred_parsed, timeout) or \
            _beyond_math_verify(gold_text, pred_text, gold_parsed, pred_parsed, timeout)
        if not ok and not _has_value(pred_parsed):
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
