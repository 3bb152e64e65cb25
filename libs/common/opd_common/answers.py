"""Reading answers (docs/grading.md): the boxed answer of a response or a gold solution, the
normalized string, integers, and math-verify's parse and verify under its signal timeout (call those
in a process's main thread: a Grader worker, opd_common.grading)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

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


def unwrap(answer: str) -> str:
    """Strip whitespace and one pair of surrounding math delimiters ($...$, \\(...\\), ...)."""
    answer = answer.strip()
    for left, right in _MATH_DELIMS:
        if len(answer) > len(left) + len(right) and answer.startswith(left) and answer.endswith(right):
            return answer[len(left) : -len(right)].strip()
    return answer


def _join_boxes(contents: list[str]) -> str:
    """One answer from a list of boxes: their contents, each once, joined by ', ' ('1, -2')."""
    seen: dict[str, str] = {}
    for item in (unwrap(c) for c in contents):
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
        line = unwrap(lines[-1])
        inner = extract_boxed(line) if _BOX.search(line) else None
        line = unwrap(inner) if inner is not None else line
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
    s = unwrap(answer)
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
    for value in parse_latex(f"${s}$", timeout):
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


def parse_latex(latex: str, timeout: float) -> list:
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


def verify_latex(gold: list, pred: list, timeout: float) -> bool:
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


def has_value(parsed: list) -> bool:
    """Whether math-verify read a value: it falls back to returning the raw string (fallback_mode
    'first_match'), and a string alone only compares by exact text, which the normalized string
    check already did."""
    return any(not isinstance(item, str) for item in parsed)


def as_latex(answer: str) -> str:
    """Wrap a bare answer in $...$ (math-verify parses a bare '\\frac{1}{2}' to nothing)."""
    return answer if "$" in answer or "\\boxed" in answer else f"${answer}$"
