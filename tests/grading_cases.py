"""Answer-equivalence tables for the math grader, scored against plain math-verify (docs/grading.md).

One row per case: the source whose grader or data the case comes from, its kind, the gold answer as
the benchmark stores it, a response as a model writes it, and the expected verdict. Verdicts come
from the mathematics and from the conventions written in docs/grading.md (a truncated box is no
answer, the last box or list of boxes is the answer), not from running either grader. Where a
source's own grader disagrees, the row's note says so.

Sources:
- `math-verify`: cases in the style of huggingface/Math-Verify's tests (tests/test_all.py).
- `nemo-skills`: NVIDIA/NeMo-Skills tests/test_math_equal.py, each pair in both directions.
- `hendrycks-math`: hendrycks/math modeling/math_equivalence_test.py, and MATH `solution` fields
  (bundled train_math_full / math500) as the gold.
- `qwen25-math`: QwenLM/Qwen2.5-Math evaluation/grader.py cases and its numeric convention (a
  decimal within a relative 1e-4 of an exact value counts).
- `bundled`: golds of the bundled benchmarks (aime24/25, hmmt_feb_2025, math500) with responses in
  the styles models write.

`score(cases)` grades every row with opd's `grade_one` and with plain math-verify (`parse` of the
raw gold and of the raw response, then `verify`, as a user would call it); `markdown(...)` prints the
counts. Both run math-verify with signal timeouts: call them in a process's main thread.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass
from functools import cache

from opd_common.datasets import data_path


@dataclass(frozen=True)
class Case:
    source: str
    kind: str
    gold: str
    response: str
    correct: bool
    note: str = ""


SOURCES = ("math-verify", "nemo-skills", "hendrycks-math", "qwen25-math", "bundled")
KINDS = (
    "multi-box",
    "gold-solution",
    "decimal-comma",
    "approximation",
    "inequality",
    "number",
    "latex",
    "structure",
    "extraction",
)


def box(answer: str) -> str:
    """A response that boxes `answer` after a line of work."""
    return "Putting the pieces together gives the result.\n\nThe final answer is $\\boxed{" + answer + "}$."


@cache
def _solutions() -> dict[str, str]:
    found = {}
    for name in ("math500.jsonl", "train_math_full.jsonl"):
        for line in data_path(name).read_bytes().splitlines():
            row = json.loads(line)
            found[row["id"]] = row["solution"]
    return found


def solution(row_id: str) -> str:
    """The MATH `solution` field of a bundled row (math500 or train_math_full)."""
    return _solutions()[row_id]


THINK = (
    "<think>\nLet me try small cases first... it might be \\boxed{%s}? No, recheck the algebra.\n</think>\n\n"
    "Therefore the answer is $\\boxed{%s}$."
)
R = box


def _math_verify_rows() -> list[Case]:
    s = "math-verify"
    rows = [
        # number formats (tests/test_all.py test_number_extraction)
        ("number", "7425000", R("7,425,000"), True, ""),
        ("number", "1000", R("1 000"), True, ""),
        ("number", "1000.0", R("1,000.0"), True, ""),
        ("decimal-comma", "1000.99", R("1000,99"), True, "decimal separator ','"),
        ("decimal-comma", "1.22", R("1,22"), True, ""),
        ("decimal-comma", "1,22", R("1.22"), True, "the gold has the decimal comma"),
        ("decimal-comma", "0,111", R("0.111"), True, ""),
        ("decimal-comma", "2.74", R("2,74"), True, ""),
        ("number", "0.4", R(".4"), True, ""),
        ("number", "1000.99", R("1,000.99"), True, ""),
        ("number", "1000.99", R("\\$1,000.99"), True, ""),
        ("number", "2", R("AZYUK2A"), False, ""),
        ("number", "10/9", R("\\frac{10}{9}"), True, ""),
        ("number", "-10/9", R("-\\frac{10}{9}"), True, ""),
        ("number", "28\\%", R("28"), True, "percent gold, bare number (math-verify convention)"),
        ("number", "28\\%", R("28\\%"), True, ""),
        ("number", "28\\%", R("29\\%"), False, ""),
        ("number", "4", R("4\\sqrt{2}"), False, "tests/test_all.py test_sqrt_precision"),
        ("approximation", f"{math.sqrt(17):.15f}", R("\\sqrt{17}"), True, "float gold, exact answer"),
        # LaTeX notation (test_latex_notation)
        ("latex", "1/3", R("\\frac13"), True, ""),
        ("latex", "1", R("\\frac3{3}"), True, ""),
        ("latex", "\\sqrt{3}", R("\\sqrt3"), True, ""),
        ("latex", "1/3", R("\\cfrac{1}{3}"), True, ""),
        ("latex", "1/3", R("\\left( \\frac{1}{3} \\right)"), True, ""),
        ("latex", "1/3", R("\\frac{1}{3} \\text{meters}"), True, ""),
        ("latex", "1/3", R("k = \\frac{1}{3}"), True, ""),
        ("latex", "1/3", R("\\frac{1}{4}"), False, ""),
        ("latex", "\\text{E}", R("E"), True, ""),
        ("latex", "125 \\text{ miles}", "The distance is $\\boxed{125\\textnormal{ miles}}.$", True, ""),
        # sets and intervals (test_sets_handling)
        ("structure", "[0,1)", R("[0,1)"), True, ""),
        ("structure", "[0,9)", R("[0,1)"), False, ""),
        ("structure", "(0,9)", R("[0,9)"), False, ""),
        (
            "structure",
            "\\{1\\pm\\sqrt{5},-2\\}",
            "The roots of $P(x)$ are $-2$ and $1 \\pm \\sqrt{5}$, so the answer is $\\boxed{\\{1\\pm\\sqrt{5},-2\\}}.$",
            True,
            "",
        ),
        ("structure", "-2,1", "Checking, we find that the only integer roots are $\\boxed{-2,1}.$", True, ""),
        ("structure", "1 \\pm \\sqrt{19}", "By the quadratic formula, $x = \\boxed{1 \\pm \\sqrt{19}}.$", True, ""),
        (
            "structure",
            "(2, 12) \\cup (12, 102)",
            "Thus, the answer is $x \\in \\boxed{(2,12) \\cup (12,102)}$",
            True,
            "",
        ),
        # MATH solutions as gold and as response (test_math_extraction_additional_cases)
        (
            "gold-solution",
            "Since $x<2$, it follows that $|x-2|=2-x$. If $2-x=p$, then $x=2-p$. Thus $x-p=\\boxed{2-2p}$.",
            R("2-2p"),
            True,
            "",
        ),
        (
            "gold-solution",
            "Since $x<2$, it follows that $|x-2|=2-x$. If $2-x=p$, then $x=2-p$. Thus $x-p=\\boxed{2-2p}$.",
            R("2-p"),
            False,
            "",
        ),
        (
            "gold-solution",
            "so the solutions are $n = \\boxed{1,-2}.$",
            "<think> ... so n = 1 or n = -2.\n\n**Final Answer**\nThe integers are \\boxed{-2} and \\boxed{1}. "
            "</think>\n\n"
            "Solving $n^2 + n - 2 = 0$ gives\n\\[ \\boxed{-2} \\quad \\text{and} \\quad \\boxed{1}. \\]",
            True,
            "math-verify's case: a solution gold, a list of boxes in the response",
        ),
        ("multi-box", "\\boxed{1}\\boxed{2}", R("1,2"), True, "test_all.py: boxes side by side in the gold"),
        ("multi-box", "1, -2", "The solutions are $\\boxed{1}$ and $\\boxed{-2}$.", True, ""),
        ("multi-box", "1, -2", "The solutions are $x = \\boxed{1}$ or $x = \\boxed{-2}$.", True, ""),
        ("multi-box", "1, -2", "The solutions are $\\boxed{1}$ and $\\boxed{2}$.", False, ""),
        (
            "multi-box",
            "189",
            "so the area is 189.\n\n**Final Answer**\n\\boxed{189}\n</think>\n\nThus, the area of the "
            "trapezoid is \\(\\boxed{189}\\) square centimeters.",
            True,
            "the same box twice (test_all.py)",
        ),
        (
            "extraction",
            "840",
            "could answer therefore\\boxed{840}.,but let me put this after explain.\n\n**Final Answer**\n\\boxed{840}",
            True,
            "test_boxed.py",
        ),
        (
            "extraction",
            "004",
            "the remainder is 004. So, \\boxed{004} is the correct answer.\n\n**Final Answer**\n\\boxed{004}",
            True,
            "test_boxed.py",
        ),
        # relations against sets (test_set_rel_assymetry)
        ("inequality", "-2 \\le x \\le 7", R("x \\in [-2,7]"), True, "relation gold, set answer"),
        (
            "inequality",
            "x \\in [-2,7]",
            R("-2 \\le x \\le 7"),
            True,
            "set gold, relation answer: math-verify needs allow_set_relation_comp",
        ),
        ("inequality", "[-2,7]", R("-2 \\leq x \\leq 7"), True, ""),
        ("inequality", "[-2,7]", R("-2 < x < 7"), False, ""),
        ("inequality", "[-2,7]", R("-2 \\le x \\le 8"), False, ""),
        # approximations (test_all.py test_precision: float_rounding decides)
        ("approximation", "\\frac{1}{3}", R("0.333333"), True, "6 decimals: math-verify's float_rounding"),
        ("approximation", "\\frac{1}{3}", R("0.3333"), True, "4 significant digits"),
        ("approximation", "\\frac{1}{3}", R("0.33"), False, "2 significant digits: too coarse"),
        ("approximation", "\\frac{1}{3}", R("0.3334"), False, "neither rounded nor cut off"),
        # model outputs from tests/test_numina_cases.py, test_open_thoughts.py, test_yujianll.py
        # (an unboxed prediction there is boxed here: those tests are about equivalence, not extraction)
        (
            "structure",
            "$(37,3,3,13),(17,3,3,7),(3,37,3,13),(3,17,3,7),(3,3,2,3)$",
            "$\\boxed{(3, 37, 3, 13), (3, 17, 3, 7), (3, 3, 2, 3), (3,17,3,7), (17,3,3,7), (37,3,3,13)}$",
            True,
            "numina",
        ),
        (
            "structure",
            "$(37,3,3),(17,3,3,7),(3,37,3,13),(3,17,3,7),(3,3,2,3)$",
            "$\\boxed{(3, 37, 3, 13), (3, 17, 3, 7), (3, 3, 2, 3), (3,17,3,7), (17,3,3,7), (37,3,3,13)}$",
            False,
            "numina",
        ),
        ("structure", "$(p,q)=(3,2)$", R("(3,2)"), True, "numina"),
        (
            "structure",
            "$(0;0;0),(0;-2;0),(0;0;6),(0;-2;6),(4;0;0),(4;-2;0),(4;0;6),(4;-2;6)$",
            "\\boxed{(4, 0, 6), (4, -2, 6), (0, 0, 6), (0, -2, 6), (4, 0, 0), (4, -2, 0), (0, 0, 0), (0, -2, 0)}",
            True,
            "numina",
        ),
        (
            "inequality",
            "$1\\leq|z|\\leq \\frac{3}{2}$",
            R("z \\in \\left[-\\frac{3}{2}, -1\\right] \\cup \\left[1, \\frac{3}{2}\\right]"),
            True,
            "numina",
        ),
        ("structure", "$-12;-11;-10;-8;-7;-6$", R("\\{-12, -11, -10, -8, -7, -6\\}"), True, "numina"),
        ("structure", "$AB=4,CD=5$", R("4, 5"), True, "numina"),
        ("structure", "$(11,7)or(7,11)$", R("(7,11),\\ (11,7)"), True, "numina"),
        ("latex", "$S_{MBCN}:S=7:32$", R("7:32"), True, "numina"),
        ("latex", "$\\frac{NO}{BO}=\\frac{1}{\\sqrt{6}}$", R("\\frac{1}{\\sqrt{6}}"), True, "numina"),
        ("structure", "$p=5,q=2;p=7,q=2$", R("(5,2),(7,2)"), True, "numina"),
        ("latex", "$V_{1}:V_{2}=11:21$", R("11:21"), True, "numina"),
        (
            "multi-box",
            "$(2,1),(1,2),(-1,-20),(-20,-1)$",
            "solutions are:\n\n\\[\n\\boxed{(1, 2)}, \\boxed{(2, 1)}, \\boxed{(-1, -20)}, \\boxed{(-20, -1)}\n\\]",
            True,
            "numina",
        ),
        ("multi-box", "\\(\\boxed{1}\\) and \\(\\boxed{-2}\\).", R("-2,1"), True, "numina: boxes listed in the gold"),
        ("latex", "$\\text{odd}$", R("odd"), True, "numina"),
        ("latex", "$d$", R("\\text{E}"), False, "numina"),
        ("structure", "$1$ and $2$ and $3$", R("1,2,3"), True, "numina"),
        ("structure", "\\boxed{x = -5,\\ p = \\frac{14}{3}} ", R("-5, \\frac{14}{3}"), True, "numina"),
        ("structure", "\\boxed{a=4,\\,-8,\\,-10}", R("-10,-8,4"), True, "numina"),
        ("structure", "$21,16$ or $11$", R("21,16,11"), True, "numina"),
        ("inequality", "$0<f(x)<1$", R("(0,1)"), True, "numina"),
        ("structure", "\\(\\boxed{6 \\text{ and } 8}\\)", R("6,8"), True, "numina"),
        (
            "structure",
            "\\n\\n\\[ \\boxed{p = -1 \\text{ and } p = \\dfrac{15}{8}} \\]",
            R("p=-1,p=\\frac{15}{8}"),
            True,
            "numina",
        ),
        (
            "multi-box",
            "$$\\boxed{2}, \\boxed{3}, \\boxed{5}, \\boxed{7}, \\boxed{13}$$",
            R("2, 3, 5, 7, 13"),
            True,
            "open_thoughts",
        ),
        ("inequality", "$$-793 < a < 10$$", R("(-793, 10)"), True, "open_thoughts"),
        ("structure", "$$a_3 = 2, a_{37} = 19$$", "$$\\boxed{a_{37} = 19, \\quad a_3 = 2}$$", True, "open_thoughts"),
        ("structure", "$$(1, +\\infty)$$", R("(1, +\\infty)"), True, "open_thoughts"),
        (
            "structure",
            "$$x = \\frac{1}{2}, x = \\frac{-1 \\pm \\sqrt{13}}{4}$$",
            "$$\\boxed{x = \\frac{1}{2}, x = \\frac{-1 \\pm \\sqrt{13}}{4}}$$",
            True,
            "open_thoughts",
        ),
        ("latex", "$$0.06 \\text{ yuan}$$", "$$\\boxed{0.06 \\text{ yuan}}$$", True, "open_thoughts"),
        (
            "structure",
            "$$(5, 8), (8, 5)$$",
            "$$\\boxed{(x, y) = (5, 8) \\quad \\text{and} \\quad (8, 5)}$$",
            True,
            "open_thoughts",
        ),
        (
            "multi-box",
            "$$(2, 2), (6, 2)$$",
            "$$\\boxed{(2, 2)} \\quad \\text{and} \\quad \\boxed{(6, 2)}$$",
            True,
            "open_thoughts",
        ),
        (
            "multi-box",
            "$$(3, 3), (1, 1)$$",
            "$$\\boxed{(3, 3)} \\text{ for part (a) and } \\boxed{(1, 1)}$$",
            True,
            "open_thoughts",
        ),
        (
            "multi-box",
            "$$k = 45, n = 2$$",
            "$$\\boxed{k = 45} \\quad \\text{and} \\quad \\boxed{n = 2}$$",
            True,
            "open_thoughts",
        ),
        ("multi-box", "$${1,2,3}$$", "\\boxed{1} and \\boxed{2} and \\boxed{3}", True, "open_thoughts"),
        ("multi-box", "$${1,2,3}$$", "\\boxed{1},\\boxed{2},\\boxed{3}", True, "open_thoughts"),
        ("latex", "$$|AB|=1$$", R("1"), True, "open_thoughts"),
        ("latex", "$$f(x)=1$$", R("1"), True, "open_thoughts"),
        (
            "multi-box",
            "$x_{1}=10^{\\frac{-5+\\sqrt{13}}{6}},\\quadx_{2}=10^{\\frac{-5-\\sqrt{13}}{6}}$",
            "$\\boxed{10^{\\frac{\\sqrt{13} - 5}{6}}} \\quad \\text{and} \\quad "
            "\\boxed{10^{-\\frac{5 + \\sqrt{13}}{6}}}$",
            True,
            "open_thoughts",
        ),
        (
            "multi-box",
            "$x_{1}=\\frac{1}{2}+\\frac{31\\sqrt{5}}{216},\\quadx_{2}=\\frac{1}{2}-\\frac{31\\sqrt{5}}{216}$",
            "$\\boxed{\\dfrac{108 + 31\\sqrt{5}}{216}} \\quad \\text{and} \\quad "
            "\\boxed{\\dfrac{108 - 31\\sqrt{5}}{216}}$",
            True,
            "open_thoughts",
        ),
        (
            "multi-box",
            "$y_{1}=-2 x^{2}+4 x+3, y_{2}=3 x^{2}+12 x+10$",
            "\\($y_1 = \\boxed{-2(x - 1)^2 + 5} \\) and \\( y_2 = \\boxed{3(x + 2)^2 - 2} \\) ",
            True,
            "open_thoughts",
        ),
        ("multi-box", "\\boxed{1} papers and \\boxed{2} bins", R("1,2"), True, "open_thoughts: boxes in the gold"),
        ("multi-box", "\\boxed{1} no no no no no \\boxed{2}", R("1,2"), False, "open_thoughts"),
        ("structure", "$n=1, 2, 3$", R("n=1, 2, 3"), True, "yujianll"),
        ("structure", "$n=2, 3, 4$", R("n=1, 2, 3"), False, "yujianll"),
        ("structure", "$D = (0, 1)$", R("D = (0, 1.5)"), False, "yujianll"),
        ("structure", "$19, 46, and 82$", R("19, 46, \\text{ and } 82"), True, "yujianll"),
        ("structure", "$19, 46, and 82$", R("21, 36, \\text{ and } 82"), False, "yujianll"),
        ("structure", "$\\pm 2021$", R("2021"), False, "yujianll"),
        ("structure", "$\\pm 2021$", R("\\{-2021, 2021\\}"), True, "yujianll"),
        ("latex", "$12:00$", R("1:00"), False, "yujianll"),
        (
            "latex",
            "$1 - \\frac{1}{\\mathrm{e}}$",
            R("1 + \\frac{1}{\\mathrm{e}}"),
            False,
            "yujianll expects a match (its known quirk); the values differ",
        ),
        (
            "latex",
            "$1 - \\frac{1}{\\mathrm{e}}$",
            R("\\frac{e-1}{e}"),
            True,
            "math-verify reads '\\frac{1}{\\mathrm{e}}' as '\\frac{1}{' (the 'e' taken for a unit)",
        ),
    ]
    return [Case(s, *row) for row in rows]


_NEMO_EQUAL = [
    ("5", "5"),
    ("5", "5.0"),
    ("1/2", "0.5"),
    ("\\frac{1}{2}", "0.5"),
    ("918\\frac{1}{2}", "918.5"),
    ("x^2+2x+1", "x^2 + 2*x + 1"),
    ("x^2+2x+1", "x^2 + 2*x - (-1)"),
    ("y = x^2+2x+1", "2x+ 1+x^2"),
    ("E", "\\mathrm{E}"),
    ("A", "\\textbf{A}"),
    ("f'", "f'"),
    (".185", "0.185"),
    ("\\frac {1}{2}", "0.5"),
    ("17\\text{ any text}", "17"),
    ("\\$10", "10"),
    ("10\\%", "10"),
    ("2.5", "\\frac{5}{2}"),
    ("\\frac{1}{3}", "\\dfrac{1}{3}"),
    ("(r+5)(r+5)", "(r+5)^2"),
    ("\\frac{\\sqrt{3}}{3}", "\\frac{\\sqrt{3}}{3} \\approx 0.577"),
    (
        "\\begin{pmatrix}0&0&0\\\\0&1&0\\\\0&0&1\\end{pmatrix}",
        "\\begin{bmatrix} 0 & 0 & 0 \\\\ 0 & 1 & 0 \\\\ 0 & 0 & 1 \\end{bmatrix}",
    ),
]
_NEMO_DIFFERENT = [
    ("5", "5.001"),
    ("x^2+2x+1", "x^3+2x+1"),
    ("odd", "\\text{oddd}"),
    ("E", "\\mathrm{E}*2"),
    ("\\sqrt{67},-\\sqrt{85}", "\\sqrt{67}"),
]
_NEMO_KIND = {
    "918\\frac{1}{2}": "number",
    "5": "number",
    "1/2": "number",
    "\\frac{1}{2}": "number",
    ".185": "number",
    "\\frac {1}{2}": "number",
    "\\$10": "number",
    "10\\%": "number",
    "2.5": "number",
    "\\begin{pmatrix}0&0&0\\\\0&1&0\\\\0&0&1\\end{pmatrix}": "structure",
    "\\sqrt{67},-\\sqrt{85}": "structure",
}


def _nemo_rows() -> list[Case]:
    rows = []
    for pairs, correct in ((_NEMO_EQUAL, True), (_NEMO_DIFFERENT, False)):
        for a, b in pairs:
            kind = _NEMO_KIND.get(a, "latex")
            rows += [
                Case("nemo-skills", kind, a, R(b), correct, "test_math_equal.py"),
                Case("nemo-skills", kind, b, R(a), correct, "test_math_equal.py, reversed"),
            ]
    return rows


def _hendrycks_rows() -> list[Case]:
    s = "hendrycks-math"
    rows = [
        # modeling/math_equivalence_test.py (is_equiv(gold, answer))
        ("latex", "\\tfrac{1}{2} + \\frac1{72}", R("\\frac{1}{2} + 2/3"), False, "test_fractions"),
        ("latex", "\\tfrac{1}{2} +\\! \\frac1{72}", R("\\dfrac{1}{2} +\\frac{1}{72}"), True, "test_dfrac"),
        ("latex", "10\\text{ units}", R("10 "), True, "test_units"),
        ("latex", "10\\text{ units}", R("100 "), False, "test_units2"),
        ("number", "10", R("\\$10"), True, "test_dollars"),
        ("latex", "\\left(x-2\\right)\\left(x+2\\right)", R("(x-2)(x+2)"), True, "test_parentheses"),
        ("number", "0.1", R(".1"), True, "test_decimals2"),
        ("number", "10\\%", R("10"), True, "test_percentage"),
        ("latex", "10\\sqrt{3} + \\sqrt4", R("10\\sqrt3 + \\sqrt{4}"), True, "test_sqrt"),
        ("latex", "\\frac34i", R("\\frac{3}{4}i"), True, "test_frac"),
        ("latex", "\\tfrac83", R("\\frac{8}{3}"), True, "test_tfrac"),
        ("latex", "5x - 7y + 11z + 4 = 0", R("x + y - z + 2 = 0"), False, "test_expression"),
        ("number", "1/2", R("\\frac{1}{2}"), True, "test_half"),
        (
            "structure",
            "10, 4, -2",
            R("4, 10, -2"),
            True,
            "test_order: is_equiv's string match says no; MATH lists solutions as an unordered set",
        ),
        ("structure", "10, 4, 2", R("4, 12, 2"), False, "test_order2"),
        # Minerva-style answer lines (the MATH few-shot format), no box
        (
            "extraction",
            "28\\%",
            "So the loss is $28\\%$.\nFinal Answer: The final answer is $28\\%$. I hope it is correct.",
            True,
            "answer line",
        ),
        (
            "extraction",
            "\\frac{14}{3}",
            "Final Answer: The final answer is $\\frac{14}{3}$. I hope it is correct.",
            True,
            "",
        ),
        (
            "extraction",
            "\\frac{14}{3}",
            "Final Answer: The final answer is $\\frac{13}{3}$. I hope it is correct.",
            False,
            "",
        ),
        # the `solution` field as the gold: compared by its final box (or list of boxes)
        (
            "gold-solution",
            solution("train/algebra/152"),
            "The points are $\\boxed{(-2,18)}$ and $\\boxed{(8,38)}$.",
            True,
            "two boxed points; the bundled answer field keeps only '(8,38)'",
        ),
        ("gold-solution", solution("train/algebra/152"), R("(-2,18); (8,38)"), True, "points separated by semicolons"),
        ("gold-solution", solution("train/algebra/152"), R("(8,38)"), False, "one of the two points"),
        (
            "gold-solution",
            solution("train/intermediate_algebra/1486"),
            "So $t = \\boxed{\\frac{1}{3}}$ or $t = \\boxed{-\\frac{5}{2}}$.",
            True,
            "",
        ),
        ("gold-solution", solution("train/intermediate_algebra/1486"), R("\\frac13, -\\frac52"), True, ""),
        (
            "gold-solution",
            solution("train/intermediate_algebra/1486"),
            R("-\\frac{5}{2}"),
            False,
            "one of two values; the bundled answer field keeps only this one",
        ),
        (
            "gold-solution",
            solution("train/precalculus/1149"),
            "$\\theta$ is $\\boxed{30^\\circ}$ or $\\boxed{150^\\circ}$.",
            True,
            "",
        ),
        ("gold-solution", solution("train/precalculus/1149"), R("150^\\circ"), False, ""),
        ("gold-solution", solution("test/algebra/2043.json"), R("(-\\infty,2)\\cup(3,\\infty)"), True, ""),
        ("gold-solution", solution("test/algebra/2043.json"), R("(-\\infty,2]\\cup[3,\\infty)"), False, ""),
        ("gold-solution", solution("test/intermediate_algebra/1992.json"), R("(0,9)\\cup(9,36)"), True, ""),
        ("gold-solution", solution("test/intermediate_algebra/47.json"), R("(-2,1)"), True, ""),
        ("gold-solution", solution("test/intermediate_algebra/47.json"), R("(1,-2)"), False, ""),
        ("gold-solution", solution("test/precalculus/807.json"), R("(3, \\frac{\\pi}{2})"), True, ""),
        ("gold-solution", solution("test/prealgebra/1558.json"), R("1.25"), True, ""),
        ("gold-solution", solution("test/prealgebra/1558.json"), R("1.5"), False, ""),
        (
            "gold-solution",
            solution("test/number_theory/459.json"),
            R("\\frac{639}{40}"),
            True,
            "two boxes holding one value twice: 15 39/40 and 639/40",
        ),
        ("gold-solution", solution("test/algebra/1078.json"), R("(-\\sqrt{3}, \\sqrt{3})"), True, ""),
        ("gold-solution", solution("test/intermediate_algebra/1388.json"), R("1, -2"), True, ""),
        ("gold-solution", solution("test/intermediate_algebra/1388.json"), R("1"), False, ""),
        # 'to the nearest hundredth' golds: the exact value rounds to the stored decimal
        ("approximation", "0.57", R("\\frac{\\pi}{2}-1"), True, "train/algebra/1654, nearest hundredth"),
        ("approximation", "0.57", R("\\frac{\\pi}{2}"), False, ""),
        ("approximation", "2.33", R("\\frac{7}{3}"), True, "train/algebra/2568"),
        ("approximation", "2.33", R("\\frac{7}{2}"), False, ""),
        ("approximation", "3.24", R("\\frac{120}{37}"), True, "train/algebra/24123"),
        ("approximation", ".79", R("\\frac{\\pi}{4}"), True, "train/geometry/93"),
        ("approximation", ".79", R("\\frac{\\pi}{3}"), False, ""),
        ("approximation", "5.29", R("2\\sqrt{7}"), True, "train/prealgebra/609"),
        ("approximation", "5.29", R("2\\sqrt{6}"), False, ""),
        ("approximation", "3.14", R("\\pi"), True, "train/prealgebra/194"),
        ("approximation", "6.25", R("\\frac{25}{4}"), True, "train/geometry/278, an exact decimal"),
    ]
    return [Case(s, *row) for row in rows]


def _qwen_rows() -> list[Case]:
    s = "qwen25-math"
    rows = [
        # evaluation/grader.py tests and _test_math_equal
        ("approximation", "\\frac{1}{12}", R("0.0833333333333333"), True, ""),
        ("structure", "(1,\\frac{9}{2})", R("(1,4.5)"), True, ""),
        ("latex", "\\frac{x+2}{7}", R("\\frac{x}{7}+\\frac{2}{7}"), True, ""),
        ("number", "0.1", R("10\\%"), True, "test_is_numerical_equal"),
        ("number", "10\\%", R("0.1"), True, ""),
        ("number", "10", R("10"), True, ""),
        ("number", "20", R("10"), False, ""),
        ("structure", "[1, 2, 3]", R("[1, 2, 3]"), True, "test_compare_lists"),
        (
            "structure",
            "\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}",
            R("\\begin{pmatrix}1&2\\\\3&5\\end{pmatrix}"),
            False,
            "test_compare_matrices",
        ),
        (
            "structure",
            "\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}",
            R("\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}"),
            True,
            "",
        ),
        ("latex", "x = 10", R("10"), True, "test_compare_equations"),
        ("latex", "10", R("x = 10"), True, ""),
        ("number", "1000", R("1,000"), True, "parse_digits drops commas"),
        # numeric_equal: isclose(rel_tol=1e-4); opd: 4 significant digits, rounded or cut off
        ("approximation", "\\frac{8}{3}", R("2.6667"), True, "rel 1.2e-5"),
        ("approximation", "\\frac{8}{3}", R("2.667"), True, "correctly rounded (Qwen: rel 1.2e-4, rejects)"),
        ("approximation", "\\frac{8}{3}", R("2.6666"), True, "cut off"),
        ("approximation", "\\frac{8}{3}", R("2.67"), False, ""),
        ("approximation", "\\frac{8}{3}", R("2.6668"), False, "neither rounded nor cut off"),
        ("approximation", "\\sqrt{2}", R("1.4142"), True, ""),
        ("approximation", "\\sqrt{2}", R("1.41"), False, ""),
        ("approximation", "\\pi", R("3.1416"), True, ""),
        ("approximation", "\\pi", R("3.14"), False, ""),
        ("approximation", "\\frac{2}{7}", R("0.2857"), True, ""),
        ("approximation", "\\frac{2}{7}", R("0.2858"), False, ""),
        ("approximation", "2\\sqrt{3}", R("3.4641"), True, ""),
        ("approximation", "25", R("24.9999"), False, "an integer gold takes no approximation (Qwen accepts)"),
        ("approximation", "\\frac{1}{7}", R("\\approx 0.142857"), True, ""),
    ]
    return [Case(s, *row) for row in rows]


def _bundled_rows() -> list[Case]:
    s = "bundled"
    rows = [
        # several solutions, each boxed (math500 'enter all ... separated by commas')
        ("multi-box", "1,-2", "The integers are $\\boxed{1}$ and $\\boxed{-2}$.", True, "math500 int_alg/1388"),
        ("multi-box", "1,-2", "So $n = \\boxed{1}$, $n = \\boxed{-2}$.", True, ""),
        ("multi-box", "1,-2", "The integers are $\\boxed{1}$ and $\\boxed{2}$.", False, ""),
        (
            "multi-box",
            "1,-2",
            "I first got \\boxed{1}. That was a slip; redoing the algebra, the answer is \\boxed{-2}.",
            False,
            "prose between the boxes: the last box alone",
        ),
        (
            "multi-box",
            "3, 5, 7",
            "The roots are $\\boxed{3}$, $\\boxed{5}$, and $\\boxed{7}$.",
            True,
            "math500 int_alg/428",
        ),
        (
            "multi-box",
            "3, 5, 7",
            "The roots are \\[x = \\boxed{3},\\quad x = \\boxed{5},\\quad x = \\boxed{7}.\\]",
            True,
            "",
        ),
        ("multi-box", "3, 5, 7", "The roots are $\\boxed{3}$ and $\\boxed{7}$.", False, "a root missing"),
        (
            "multi-box",
            "-2,1",
            "The integer roots are $\\boxed{-2} \\text{ and } \\boxed{1}$.",
            True,
            "math500 int_alg/1102",
        ),
        (
            "multi-box",
            "\\frac{-1+\\sqrt{17}}{2}, \\frac{-1-\\sqrt{17}}{2}",
            "$a+b+c = \\boxed{\\frac{-1+\\sqrt{17}}{2}}$ or $\\boxed{\\frac{-1-\\sqrt{17}}{2}}$.",
            True,
            "hmmt25-10",
        ),
        (
            "multi-box",
            "1 \\pm \\sqrt{19}",
            "So $x = \\boxed{1+\\sqrt{19}}$ and $x = \\boxed{1-\\sqrt{19}}$.",
            True,
            "math500",
        ),
        (
            "multi-box",
            "(6,31,-1)",
            "The answer is \\boxed{(6,31,-1)}, that is \\boxed{(6,31,-1)}.",
            True,
            "the same box twice",
        ),
        ("extraction", "70", R("70") + " Wait, no: " + R("7"), False, "aime25-I-1: the last box counts"),
        ("extraction", "117", THINK % ("100", "117"), True, "aime25-I-4"),
        ("extraction", "279", THINK % ("279", "280"), False, "aime25-I-5"),
        (
            "extraction",
            "504",
            "Maybe \\boxed{504}. Let me double-check: \\boxed{50",
            False,
            "truncated inside the last box: no answer",
        ),
        ("extraction", "62", R(""), False, "aime25-I-9: an empty box"),
        # decimal commas and thousands separators
        ("decimal-comma", "1.25", R("1,25"), True, "math500 prealgebra/1558"),
        ("decimal-comma", "3.21", R("3,21"), True, "math500 algebra/621"),
        ("decimal-comma", "326.5", R("326,5"), True, "math500 prealgebra/1784"),
        ("decimal-comma", "4.5", R("4,5"), True, "math500 prealgebra/2019"),
        ("decimal-comma", ".35625", R("0,35625"), True, "math500 number_theory/410"),
        ("decimal-comma", "326.5", R("3,265"), False, "a thousands separator"),
        ("decimal-comma", "4.5", R("45"), False, ""),
        ("decimal-comma", "58,500", R("58500"), True, "math500 counting/737"),
        ("decimal-comma", "58,500", R("58.5"), False, ""),
        ("number", "10,\\!080", R("10080"), True, "math500 counting/508"),
        ("number", "\\$32,\\!348", R("\\$32,348"), True, "math500 algebra/2626"),
        ("number", "11,\\! 111,\\! 111,\\! 100", R("11111111100"), True, "math500 number_theory/417"),
        # intervals written as inequalities
        ("inequality", "(-\\infty, 2) \\cup (3, \\infty)", R("x < 2 \\text{ or } x > 3"), True, "math500 algebra/2043"),
        ("inequality", "(-\\infty, 2) \\cup (3, \\infty)", R("x<2 \\lor x>3"), True, ""),
        ("inequality", "(-\\infty, 2) \\cup (3, \\infty)", R("x \\le 2 \\text{ or } x \\ge 3"), False, ""),
        ("inequality", "(-\\infty, 2) \\cup (3, \\infty)", R("2 < x < 3"), False, ""),
        ("inequality", "(2,\\infty)", R("x > 2"), True, "math500 int_alg/183"),
        ("inequality", "(2,\\infty)", R("x \\geq 2"), False, ""),
        ("inequality", "(-\\sqrt{3}, \\sqrt{3})", R("-\\sqrt{3} < x < \\sqrt{3}"), True, "math500 algebra/1078"),
        ("inequality", "(-\\sqrt{3}, \\sqrt{3})", R("-\\sqrt{3} \\le x \\le \\sqrt{3}"), False, ""),
        ("inequality", "(3,4]", R("3 < x \\le 4"), True, "math500 int_alg/558"),
        ("inequality", "(3,4]", R("3 \\le x \\le 4"), False, ""),
        ("inequality", "(-\\infty, 0]", R("x \\le 0"), True, "math500 precalculus/695"),
        ("inequality", "(-\\infty, 0]", R("x < 0"), False, ""),
        ("inequality", "(0,9) \\cup (9,36)", R("0 < x < 9 \\text{ or } 9 < x < 36"), True, "math500 int_alg/1992"),
        ("inequality", "(0,9) \\cup (9,36)", R("0 < x < 36"), False, ""),
        # decimal approximations of exact golds
        ("approximation", "\\frac{1}{576}", R("0.001736"), True, "hmmt25-3"),
        ("approximation", "\\frac{1}{576}", R("0.0017"), False, ""),
        ("approximation", "\\frac{9 \\sqrt{23}}{23}", R("1.8766"), True, "hmmt25-7"),
        ("approximation", "\\frac{9 \\sqrt{23}}{23}", R("1.88"), False, ""),
        ("approximation", "1-\\frac{2}{\\pi}", R("0.3634"), True, "hmmt25-8"),
        ("approximation", "1-\\frac{2}{\\pi}", R("0.36"), False, ""),
        ("approximation", "8\\sqrt{10}", R("25.298"), True, "hmmt25-23"),
        ("approximation", "8\\sqrt{10}", R("25.3"), False, ""),
        ("approximation", "\\sqrt{23}-2 \\sqrt{3}", R("1.3317"), True, "hmmt25-25"),
        ("approximation", "\\frac{14}{3}", R("4.6667"), True, "math500"),
        ("approximation", "\\frac{14}{3}", R("4.7"), False, ""),
        ("approximation", "204", R("204.0001"), False, "aime24-I-1: an integer gold"),
        # everyday formats of the same golds
        ("latex", "\\frac{1}{576}", R("1/576"), True, "hmmt25-3"),
        ("latex", "\\frac{9 \\sqrt{23}}{23}", R("\\frac{9}{\\sqrt{23}}"), True, "hmmt25-7"),
        ("latex", "\\left( 3, \\frac{\\pi}{2} \\right)", R("(3, \\frac{\\pi}{2})"), True, "math500 precalculus/807"),
        ("latex", "\\text{Evelyn}", R("Evelyn"), True, "math500"),
        ("latex", "90^\\circ", R("90"), True, "math500"),
        ("latex", "5.4 \\text{ cents}", R("5.4"), True, "math500 prealgebra/1044"),
        ("number", "25", R("025"), True, "aime24-I-2"),
        ("number", "809", R("908"), False, "aime24-I-3"),
    ]
    return [Case(s, *row) for row in rows]


def all_cases() -> list[Case]:
    return _math_verify_rows() + _nemo_rows() + _hendrycks_rows() + _qwen_rows() + _bundled_rows()


# --------------------------------------------------------------------------------- scoring


def opd_verdict(case: Case) -> bool:
    from opd_common.grading import grade_one

    return grade_one(case.response, case.gold).correct


def math_verify_verdict(case: Case, wrap_gold: bool = False) -> bool:
    """Plain math-verify: parse the raw gold (or, with wrap_gold, '$gold$') and the raw response, verify."""
    from math_verify import parse, verify

    try:
        gold = parse(f"${case.gold}$" if wrap_gold else case.gold)
        return bool(verify(gold, parse(case.response)))
    except Exception:
        return False


GRADERS = {
    "opd": opd_verdict,
    "math-verify": math_verify_verdict,
    "math-verify ($gold$)": lambda case: math_verify_verdict(case, wrap_gold=True),
}


@dataclass
class Tally:
    rows: int = 0
    right: int = 0
    false_pos: int = 0  # a wrong answer accepted
    false_neg: int = 0  # a right answer rejected

    def add(self, verdict: bool, correct: bool) -> None:
        self.rows += 1
        self.right += verdict == correct
        self.false_pos += verdict and not correct
        self.false_neg += correct and not verdict


def score(cases: list[Case]) -> tuple[dict[str, list[bool]], dict[tuple[str, str], Tally]]:
    """(verdicts per grader, tallies per (grader, source), (grader, kind) and (grader, 'all'))."""
    verdicts = {name: [grade(case) for case in cases] for name, grade in GRADERS.items()}
    tallies: dict[tuple[str, str], Tally] = {}
    for name, marks in verdicts.items():
        for case, verdict in zip(cases, marks, strict=True):
            for key in ((name, case.source), (name, case.kind), (name, "all")):
                tallies.setdefault(key, Tally()).add(verdict, case.correct)
    return verdicts, tallies


def markdown(cases: list[Case], tallies: dict[tuple[str, str], Tally], by: str = "source") -> str:
    """The counts table by source (or by kind): for each grader, its agreement with the expected
    verdicts, then its false positives (wrong answers accepted) / false negatives (right answers rejected)."""
    groups = SOURCES if by == "source" else KINDS
    size = Counter(getattr(case, by) for case in cases)
    right = Counter(getattr(case, by) for case in cases if case.correct)
    size["all"], right["all"] = len(cases), sum(case.correct for case in cases)
    lines = [
        f"| {by} | cases (right/wrong) | " + " | ".join(f"{name}: agree, FP/FN" for name in GRADERS) + " |",
        "|" + " --- |" * (2 + len(GRADERS)),
    ]
    for group in (*groups, "all"):
        cells = []
        for name in GRADERS:
            t = tallies[(name, group)]
            cells.append(f"{t.right}/{t.rows} ({100 * t.right / t.rows:.1f}%), {t.false_pos}/{t.false_neg}")
        label = "**all**" if group == "all" else f"`{group}`"
        lines.append(
            f"| {label} | {size[group]} ({right[group]}/{size[group] - right[group]}) | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines)
