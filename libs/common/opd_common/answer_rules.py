"""opd's rules for answers math-verify rejects (docs/grading.md): decimal commas, decimal
approximations of exact values, inequalities joined by 'or' against a union of intervals."""

from __future__ import annotations

import math
import re
from decimal import ROUND_DOWN, ROUND_HALF_UP, Decimal

from opd_common.answers import as_latex, normalize_answer, parse_latex, unwrap

# ----------------------------------------------------------------- rules beyond math-verify

_PLAIN_DECIMAL = re.compile(r"[+-]?\d*\.(\d+)")
_SIGNIFICANT = 4  # digits an approximation must show: '2.667' for 8/3, not '2.67' or '0.33' for 1/3


def _plain_number(answer: str) -> str:
    """`answer` without math delimiters, spaces and LaTeX spacing ('1{,}5' -> '1,5')."""
    return re.sub(r"\s|\\[,!;: ]", "", unwrap(answer)).replace("{,}", ",")


def decimal_comma(answer: str, other: str) -> str:
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
    for value in parse_latex(as_latex(_OR.sub(",", pred)), timeout):
        conditions = (sympy.core.relational.Relational, sympy.logic.boolalg.And)
        if not isinstance(value, sympy.FiniteSet) or not all(isinstance(r, conditions) for r in value.args):
            continue
        if len(set().union(*(r.free_symbols for r in value.args))) != 1:
            continue
        union = sympy.Union(*(r.as_set() for r in value.args))
        if any(union == g for g in gold_sets):
            return True
    return False


def beyond_math_verify(gold: str, pred: str, gold_parsed: list, pred_parsed: list, timeout: float) -> bool:
    """opd's rules for what math-verify rejects (docs/grading.md), under math-verify's signal timeout."""
    from math_verify.utils import timeout as with_timeout

    def check() -> bool:
        return _approximates(gold, pred, gold_parsed, pred_parsed) or _inequalities_union(gold_parsed, pred, timeout)

    return with_timeout(max(1, math.ceil(timeout)))(check)()
