"""opd-eval's grading, on answers written in the bundled benchmarks' real styles.

Every gold answer below is a real gold of aime24/aime25, hmmt25 or math500 (the id is given);
the predictions are written the way models write them. Verdicts and reasons come from the
mathematics and the grading rules of docs/grading.md, not from running the grader. The table goes
through the shared Grader's worker processes, exactly as `opd-eval run` grades.
"""

from __future__ import annotations

import pytest

from opd_common.datasets import data_path
from opd_common.grading import Grader, extract_answer

B = r"So the final answer is $\boxed{%s}$."
THINK = "<think>\nLet me work it out... maybe \\boxed{%s}?\n</think>\n\nTherefore the answer is \\boxed{%s}."

# (gold, response text, grader mode, expected reason) -- reason 'match' means correct.
CASES = [
    # ---- AIME (integers 0-999; aime24 strips leading zeros: aime24-I-2 '025' -> '25') ----
    ("204", B % "204", "integer", "match"),                      # aime24-I-1
    ("25", B % "025", "integer", "match"),                       # aime24-I-2, leading zero in the prediction
    ("25", B % "25", "math", "match"),
    ("25", B % "025", "math", "match"),
    ("73", B % "073", "integer", "match"),                       # aime24-II-1
    ("80", B % "80.0", "integer", "match"),                      # aime24-II-5
    ("80", B % "80.5", "integer", "parse-failure"),              # not an integer
    ("809", B % "908", "integer", "mismatch"),                   # aime24-I-3
    ("809", B % "809", "math", "match"),
    ("116", B % r"\text{116}", "integer", "match"),              # aime24-I-4
    ("104", B % "m+n=104", "integer", "match"),                  # aime24-I-5: 'the part after the last ='
    ("294", B % r"294^\circ", "integer", "match"),               # aime24-I-6
    ("540", "... which gives 540.\n\n**Answer:** 540", "integer", "match"),  # answer line, no box
    ("70", B % "70" + " Wait, no: " + B % "7", "integer", "mismatch"),  # aime25-I-1, the last box counts
    ("588", B % "58" + " Correction: " + B % "588", "integer", "match"),  # aime25-I-2
    ("16", "The count is sixteen.", "integer", "no-answer"),     # aime25-I-3, no box
    ("117", THINK % ("100", "117"), "integer", "match"),         # aime25-I-4, box inside the thinking, then final
    ("279", THINK % ("279", "280"), "integer", "mismatch"),      # aime25-I-5: the final box, not the thought
    ("504", r"We get \boxed{5" , "integer", "no-answer"),        # aime25-I-6, truncated inside the box
    ("821", B % r"\frac{1642}{2}", "integer", "match"),          # aime25-I-7
    ("77", B % r"\boxed{77}", "integer", "match"),               # aime25-I-8: nested box
    ("62", B % "", "integer", "no-answer"),                      # aime25-I-9: empty box
    # ---- HMMT February 2025 (LaTeX answers) ----
    ("103", B % "103", "math", "match"),                                           # hmmt-1
    (r"\frac{1}{576}", B % "1/576", "math", "match"),                              # hmmt-3
    (r"\frac{1}{576}", B % r"\dfrac{1}{576}", "math", "match"),
    (r"\frac{1}{576}", B % r"\frac{1}{567}", "math", "mismatch"),
    ("-984", B % "-984", "math", "match"),                                         # hmmt-4
    ("-984", B % "984", "math", "mismatch"),
    (r"\frac{1311}{2017}", B % r"\frac{2622}{4034}", "math", "match"),             # hmmt-6, unreduced
    (r"\frac{9 \sqrt{23}}{23}", B % r"\frac{9}{\sqrt{23}}", "math", "match"),      # hmmt-7, rationalized or not
    (r"\frac{9 \sqrt{23}}{23}", B % r"\frac{9\sqrt{23}}{32}", "math", "mismatch"),
    (r"1-\frac{2}{\pi}", B % r"\frac{\pi - 2}{\pi}", "math", "match"),             # hmmt-8
    (r"1-\frac{2}{\pi}", B % r"1-\frac{\pi}{2}", "math", "mismatch"),
    (r"\frac{-1+\sqrt{17}}{2}, \frac{-1-\sqrt{17}}{2}",                            # hmmt-10, two values
     B % r"\frac{-1-\sqrt{17}}{2}, \frac{-1+\sqrt{17}}{2}", "math", "match"),
    (r"2^{25} \cdot 26!", B % r"26! \cdot 2^{25}", "math", "match"),               # hmmt-17
    (r"2^{25} \cdot 26!", B % r"2^{26} \cdot 25!", "math", "mismatch"),
    (r"8\sqrt{10}", B % r"\sqrt{640}", "math", "match"),                           # hmmt-23
    (r"\sqrt{23}-2 \sqrt{3}", B % r"-2\sqrt{3}+\sqrt{23}", "math", "match"),       # hmmt-25
    (r"\sqrt{23}-2 \sqrt{3}", B % r"\sqrt{23}-3\sqrt{2}", "math", "mismatch"),
    (r"14+4\sqrt{37}", B % r"2(7+2\sqrt{37})", "math", "match"),                   # hmmt-29
    (r"\sqrt{\frac{95}{24}}", B % r"\frac{\sqrt{570}}{12}", "math", "match"),      # hmmt-30
    (r"\sqrt{6}", B % r"\sqrt{6", "math", "no-answer"),                            # hmmt-28, unbalanced box
    (r"\frac{448}{3}", B % r"\frac{448}{3}\text{ cm}^2", "math", "match"),         # hmmt-20, with a unit
    # ---- MATH-500 (intervals, tuples, text, degrees, units, bases, matrices) ----
    (r"\left( 3, \frac{\pi}{2} \right)", B % r"(3, \frac{\pi}{2})", "math", "match"),       # precalculus/807
    (r"\left( 3, \frac{\pi}{2} \right)", B % r"(3, \pi)", "math", "mismatch"),
    (r"(3,4]", B % r"(3, 4]", "math", "match"),                                              # interval
    (r"(3,4]", B % r"[3,4]", "math", "mismatch"),
    (r"(-\infty, 0]", B % r"(-\infty,0]", "math", "match"),
    (r"(0,9) \cup (9,36)", B % r"(0,9)\cup(9,36)", "math", "match"),
    (r"(0,9) \cup (9,36)", B % r"(0,36)", "math", "mismatch"),
    (r"\left(\frac{3}{5},\frac{8}{3}\right]", B % r"(0.6, \frac{8}{3}]", "math", "match"),
    ("(6,31,-1)", B % "(6, 31, -1)", "math", "match"),                                        # tuple
    ("(6,31,-1)", B % "(6, -1, 31)", "math", "mismatch"),
    ("3, 5, 7", B % "3,5,7", "math", "match"),
    (r"\text{Evelyn}", B % r"\text{Evelyn}", "math", "match"),                                # text answers
    (r"\text{Evelyn}", B % "Evelyn", "math", "match"),
    (r"\text{east}", B % r"\text{west}", "math", "mismatch"),
    (r"\text{(C)}", B % "(C)", "math", "match"),
    (r"\text{(C)}", B % r"\text{(E)}", "math", "mismatch"),
    (r"90^\circ", B % "90", "math", "match"),                                                 # degrees
    (r"90^\circ", B % r"90^{\circ}", "math", "match"),
    (r"90^\circ", B % r"\frac{\pi}{2}", "math", "mismatch"),  # degrees gold: radians are another number
    (r"\frac{270}7\text{ degrees}", B % r"\frac{270}{7}", "math", "match"),
    (r"5.4 \text{ cents}", B % "5.4", "math", "match"),                                       # units
    (r"864 \mbox{ inches}^2", B % "864", "math", "match"),
    (r"\$32,\!348", B % "32348", "math", "match"),                                            # money, thousands
    (r"10,\!080", B % "10080", "math", "match"),
    (r"11,\! 111,\! 111,\! 100", B % "11111111100", "math", "match"),
    ("6 - 5i", B % "6-5i", "math", "match"),                                                  # complex
    ("6 - 5i", B % "6+5i", "math", "mismatch"),
    ("x=5", B % "5", "math", "match"),                                                        # equation gold
    ("1.25", B % r"\frac{5}{4}", "math", "match"),                                            # decimals
    (".0000672", B % "6.72\\times 10^{-5}", "math", "match"),
    (r"\frac 59", B % r"\frac{5}{9}", "math", "match"),                                       # \frac without braces
    (r"\frac9{19}", B % r"\frac{9}{19}", "math", "match"),
    (r"1 \pm \sqrt{19}", B % r"1+\sqrt{19}, 1-\sqrt{19}", "math", "match"),
    (r"x^5 - x^4 + x^3 - x^2 + x - 1", B % r"x^5-x^4+x^3-x^2+x-1", "math", "match"),          # polynomials
    (r"x^5 - x^4 + x^3 - x^2 + x - 1", B % r"x^5-x^4+x^3-x^2+x+1", "math", "mismatch"),
    (r"\begin{pmatrix} -2 \\ -14 \\ -7 \end{pmatrix}", B % r"\begin{pmatrix}-2\\-14\\-7\end{pmatrix}", "math", "match"),
    (r"\begin{pmatrix} -1 & 0 \\ 0 & -1 \end{pmatrix}", B % r"\begin{pmatrix}1&0\\0&1\end{pmatrix}",
     "math", "mismatch"),
    (r"\frac{3\sqrt{3}}{4}", B % r"\frac{3\sqrt{3}}{4}" + " and earlier " + B % "1", "math", "mismatch"),  # last box
    (r"\frac{3\sqrt{3}}{4}", r"Area $=\boxed{\dfrac{3\sqrt{3}}{4}}$ square units.", "math", "match"),  # nested braces
    ("p - q", B % "p-q", "math", "match"),
    ("p - q", B % "q-p", "math", "mismatch"),
    ("11\\sqrt2", B % "??", "math", "parse-failure"),                                         # nothing to read
    (r"\frac{14}{3}", "I believe it is 14/3, but I did not box it.", "math", "no-answer"),
]


@pytest.fixture(scope="module")
def grader():
    with Grader(workers=2) as g:
        yield g


def test_table_is_large_and_covers_the_styles():
    assert len(CASES) >= 60
    reasons = {c[3] for c in CASES}
    assert reasons == {"match", "mismatch", "no-answer", "parse-failure"}
    assert {c[2] for c in CASES} == {"math", "integer"}


def test_golds_are_real_benchmark_answers():
    import orjson

    golds = set()
    for name in ("aime24.jsonl", "aime25.jsonl", "hmmt_feb_2025.jsonl", "math500.jsonl"):
        golds |= {orjson.loads(line)["answer"] for line in data_path(name).read_bytes().splitlines()}
    missing = sorted({c[0] for c in CASES} - golds)
    assert missing == []


@pytest.mark.parametrize("mode", ["math", "integer"])
def test_grader_verdicts_and_reasons(grader, mode):
    cases = [c for c in CASES if c[2] == mode]
    grades = grader.grade([(text, gold) for gold, text, _, _ in cases], mode)
    wrong = [(gold, text, want, (g.correct, g.reason)) for (gold, text, _, want), g in zip(cases, grades, strict=True)
             if g.reason != want or g.correct != (want == "match")]
    assert wrong == []


def test_extracted_answer_is_the_last_balanced_box(grader):
    text = B % "58" + " Correction: " + B % r"\frac{\sqrt{2}}{2}"
    [grade] = grader.grade([(text, r"\frac{\sqrt{2}}{2}")], "math")
    assert grade.extracted == r"\frac{\sqrt{2}}{2}"
    assert extract_answer(r"\boxed{\boxed{77}}") == ("77", "boxed")  # nested: the inner group's contents
