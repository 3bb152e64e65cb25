"""The math grader (opd_common.grading): extraction, math-verify verdicts, workers, rewards."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from opd_common.errors import ConfigError, RecordError
from opd_common.grading import (
    Grade,
    Grader,
    extract_answer,
    extract_boxed,
    extract_boxes,
    gold_answer,
    grade_one,
    overlong_penalty,
    reward,
)

B = r"The answer is $\boxed{%s}$."  # a response that boxes its answer

# (gold, response text, mode, correct?) -- verdicts from the mathematics, not from the grader.
CASES = [
    # fractions and decimals
    (r"\frac{1}{2}", B % "0.5", "math", True),
    (r"\frac{1}{2}", B % "1/2", "math", True),
    (r"\frac{1}{2}", B % r"\dfrac12", "math", True),
    (r"\frac{1}{2}", B % r"\tfrac{1}{2}", "math", True),
    (r"\frac{1}{2}", B % r"\frac{2}{4}", "math", True),
    (r"\frac{1}{2}", B % "0.25", "math", False),
    (r"\frac{1}{3}", B % "0.33", "math", False),
    (r"\frac{3}{4}", B % r"\frac{4}{3}", "math", False),
    (r"-\frac{1}{2}", B % r"\frac{-1}{2}", "math", True),
    (r"-\frac{1}{2}", B % r"\frac{1}{2}", "math", False),
    ("0.75", B % r"\frac34", "math", True),
    (r"\frac{1}{3}", B % "0.333333", "math", True),  # math-verify compares floats rounded to 6 places
    (r"10\%", B % "10", "math", True),  # math-verify's convention: a bare number matches a percent gold
    # radicals
    (r"2\sqrt{3}", B % r"\sqrt{12}", "math", True),
    (r"2\sqrt{3}", B % r"2\sqrt3", "math", True),
    (r"2\sqrt{3}", B % r"3\sqrt{2}", "math", False),
    (r"\frac{\sqrt{3}}{2}", B % r"\frac{1}{2}\sqrt{3}", "math", True),
    (r"\frac{\sqrt{2}}{2}", B % r"\frac{1}{\sqrt{2}}", "math", True),
    (r"\sqrt{2}", B % "1.41", "math", False),
    # intervals
    ("(0,1]", B % "(0,1]", "math", True),
    ("(0,1]", B % "(0,1)", "math", False),
    ("(0,1]", B % "[0,1]", "math", False),
    (r"(-\infty, 2)", B % r"(-\infty,2)", "math", True),
    (r"(-\infty, 2)", B % r"(-\infty,2]", "math", False),
    (r"[1, \infty)", B % r"\left[1, \infty\right)", "math", True),
    # sets and tuples
    (r"\{1,2,3\}", B % r"\{3,2,1\}", "math", True),
    (r"\{1,2,3\}", B % r"\{1,2\}", "math", False),
    ("1, 2", B % "2, 1", "math", True),
    ("(3, -1)", B % "(3,-1)", "math", True),
    ("(3, -1)", B % "(-1,3)", "math", False),
    # matrices
    (r"\begin{pmatrix} 1 & 2 \\ 3 & 4 \end{pmatrix}", B % r"\begin{pmatrix}1&2\\3&4\end{pmatrix}", "math", True),
    (r"\begin{pmatrix} 1 & 2 \\ 3 & 4 \end{pmatrix}", B % r"\begin{pmatrix}1&2\\4&3\end{pmatrix}", "math", False),
    (r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}", B % r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}", "math", True),
    # integers, leading zeros, thousands, negatives
    ("25", B % "025", "math", True),
    ("25", B % "25.0", "math", True),
    ("25", B % "24", "math", False),
    ("1000", B % "1,000", "math", True),
    ("1000", B % "10000", "math", False),
    ("-7", B % "-7", "math", True),
    ("-7", B % "7", "math", False),
    ("0", B % "0", "math", True),
    # \text{} wrappers, units, degrees
    ("10", B % r"\text{10}", "math", True),
    ("10", B % r"10 \text{ cm}", "math", True),
    ("10", B % r"10\text{ cm}^2", "math", True),
    ("10", B % "10 cm", "math", True),
    ("30", B % r"30^\circ", "math", True),
    ("30", B % r"30^{\circ}", "math", True),
    ("30", B % "30°", "math", True),
    ("30", B % r"30 \text{ degrees}", "math", True),
    (r"30^\circ", B % "30", "math", True),
    ("30", B % r"60^\circ", "math", False),
    (r"\text{Monday}", B % r"\text{Monday}", "math", True),
    (r"\text{Monday}", B % "Monday", "math", True),
    (r"\text{Monday}", B % r"\text{Tuesday}", "math", False),
    (r"\text{(B)}", B % r"\text{(B)}", "math", True),
    (r"\text{(B)}", B % r"\text{(C)}", "math", False),
    # pi expressions
    (r"2\pi", B % r"2 \pi", "math", True),
    (r"2\pi", B % r"\pi \cdot 2", "math", True),
    (r"\frac{\pi}{3}", B % r"\frac{1}{3}\pi", "math", True),
    (r"\frac{\pi}{3}", B % r"\frac{\pi}{6}", "math", False),
    (r"4\pi", B % r"4\pi \text{ cm}^2", "math", True),
    # expressions and equations
    ("x^2+2x+1", B % "(x+1)^2", "math", True),
    ("x^2+2x+1", B % "(x-1)^2", "math", False),
    ("3", B % "x = 3", "math", True),
    ("x = 3", B % "3", "math", True),
    ("x = 3", B % "y = 3", "math", False),  # an equation's variable counts
    (r"\left( 3, 4 \right)", B % "(3,4)", "math", True),
    # where the answer sits
    ("42", r"First \boxed{41}, then corrected: \boxed{42}", "math", True),
    ("42", r"\boxed{42} at first, but finally \boxed{41}", "math", False),
    ("42", "So the total is 42.\nAnswer: 42", "math", True),
    ("42", "Answer: 41\nWait, recheck.\nFinal Answer: $42$", "math", True),
    ("42", r"\fbox{42}", "math", True),
    ("42", "The total is 42.", "math", False),  # no box, no answer line: no answer
    # integer mode (AIME-style)
    ("25", B % "025", "integer", True),
    ("025", B % "25", "integer", True),
    ("25", B % "25.0", "integer", True),
    ("25", B % "$25$", "integer", True),
    ("25", r"\boxed{025}", "integer", True),
    ("25", B % r"25^\circ", "integer", True),
    ("25", B % r"\text{25}", "integer", True),
    ("25", B % "n = 25", "integer", True),
    ("25", B % r"\frac{50}{2}", "integer", True),
    ("25", "Answer: 25", "integer", True),
    ("25", B % "26", "integer", False),
    ("25", B % "25.5", "integer", False),
    ("25", B % r"\frac{51}{2}", "integer", False),
    ("25", B % r"5\sqrt{25}", "integer", True),
    ("25", B % r"2 \cdot 12.5", "integer", True),
    ("25", B % r"\sqrt{2}", "integer", False),
    ("25", B % "x", "integer", False),
    ("-4", B % "-4", "integer", True),
    ("1000", B % "1,000", "integer", True),
]


@pytest.mark.parametrize(("gold", "text", "mode", "correct"), CASES,
                         ids=[f"{i}-{c[3]}" for i, c in enumerate(CASES)])
def test_grade_table(gold, text, mode, correct):
    grade = grade_one(text, gold, mode)
    assert grade.correct is correct, grade
    assert (grade.reason == "match") is correct
    assert grade.reason in ({"match"} if correct else {"mismatch", "parse-failure", "no-answer"})


def test_table_is_large_and_covers_both_modes():
    assert len(CASES) >= 60
    assert {c[2] for c in CASES} == {"math", "integer"}
    assert {c[3] for c in CASES} == {True, False}


# ---------------------------------------------------------------------------- extraction


def test_extract_boxed_last_balanced_nested():
    assert extract_boxed(r"\boxed{1} and \boxed{\frac{a}{b^{2}}}") == r"\frac{a}{b^{2}}"
    assert extract_boxed(r"\boxed{\{1,2\}}") == r"\{1,2\}"  # escaped braces do not count
    assert extract_boxed(r"\boxed {7}") == "7"
    assert extract_boxed(r"so $\boxed 5$.") == "5"
    assert extract_boxed(r"\fbox{3}") == "3"
    assert extract_boxed("no box here") is None


def test_missing_box_is_no_answer():
    grade = grade_one("I think it is 42 but I am not sure.", "42")
    assert grade == Grade(False, None, "no-answer")
    assert extract_answer("I think it is 42") == (None, "none")


def test_truncated_last_box_is_no_answer_not_an_earlier_box():
    # Decision (docs/grading.md): a response cut off inside its last box committed to no answer.
    text = r"Maybe \boxed{42}. Let me double-check: \boxed{\frac{84}{2"
    assert extract_boxed(text) is None
    assert extract_answer(text) == (None, "none")
    assert grade_one(text, "42") == Grade(False, None, "no-answer")


def test_empty_box_is_no_answer():
    assert extract_answer(r"\boxed{}") == (None, "none")


def test_answer_line_extraction():
    assert extract_answer("work...\nAnswer: 42") == ("42", "answer-line")
    assert extract_answer("Answer: 1\nmore work\n**Final Answer:** $\\frac{1}{2}$\n") == (r"\frac{1}{2}", "answer-line")
    assert extract_answer("Answer: \\boxed{7}")[0] == "7"  # a box on the line is a box: 'boxed' wins
    assert extract_answer(r"Answer: 3 but \boxed{4}") == ("4", "boxed")
    assert extract_answer("Answer:   \n") == (None, "none")


def test_parse_failure_reason():
    # math-verify reads no value from '\frac{}{}' (it hands back the raw string), nor from '??'
    assert grade_one(B % r"\frac{}{}", "3") == Grade(False, r"\frac{}{}", "parse-failure")
    assert grade_one(B % "??", "3").reason == "parse-failure"
    assert grade_one(B % "4", "3").reason == "mismatch"


def test_integer_mode_rejects_non_integer_gold_and_unknown_mode():
    with pytest.raises(RecordError, match="not an integer"):
        grade_one(B % "1", r"\frac{1}{2}", "integer")
    with pytest.raises(ConfigError, match="unknown grader"):
        grade_one(B % "1", "1", "fuzzy")
    assert grade_one(B % "25.5", "25", "integer").reason == "parse-failure"


def test_a_list_of_final_boxes_is_one_answer():
    assert extract_boxes(r"The roots are $\boxed{1}$ and $\boxed{-2}$.") == ["1", "-2"]
    assert extract_boxes(r"$x = \boxed{1}$, $x = \boxed{-2}$") == ["1", "-2"]
    assert extract_boxes(r"\[\boxed{(1,2)} \quad \text{and} \quad \boxed{(3,4)}\]") == ["(1,2)", "(3,4)"]
    assert extract_boxes(r"First \boxed{41}, then corrected: \boxed{42}") == ["42"]  # prose: a correction
    assert extract_boxes(r"\boxed{1} and \boxed{2") is None  # truncated last box: still no answer
    assert extract_answer(r"$\boxed{3}$, $\boxed{5}$, and $\boxed{3}$") == ("3, 5", "boxed")  # each once
    assert grade_one(r"So $n = \boxed{1}$ or $n = \boxed{-2}$.", "1,-2") == Grade(True, "1, -2", "match")
    assert grade_one(r"So $n = \boxed{1}$ or $n = \boxed{2}$.", "1,-2").reason == "mismatch"
    assert grade_one(r"\boxed{1}, \boxed{-2}", "1").reason == "mismatch"  # a hedge is not the answer


def test_a_gold_solution_is_read_by_its_box():
    solution = r"Then $(x-3)^2 = 25$, so the points are $\boxed{(-2,18)}$ and $\boxed{(8,38)}$."
    assert gold_answer(solution) == "(-2,18), (8,38)"
    assert gold_answer("x = 3") == "x = 3"
    assert grade_one(B % "(8,38), (-2,18)", solution).correct
    assert not grade_one(B % "(8,38)", solution).correct
    assert grade_one(B % "25", r"So the answer is $\boxed{025}$.", "integer").correct


@pytest.mark.parametrize(("gold", "answer", "correct"), [
    ("1.22", "1,22", True), ("1,22", "1.22", True), ("326.5", "326,5", True), (".35625", "0,35625", True),
    ("1234.5", "1.234,5", True), ("326.5", "3,265", False), ("58,500", "58500", True), ("1.5", "1,6", False),
])
def test_decimal_commas(gold, answer, correct):
    assert grade_one(B % answer, gold).correct is correct


@pytest.mark.parametrize(("gold", "answer", "correct"), [
    (r"\frac{8}{3}", "2.6667", True), (r"\frac{8}{3}", "2.6666", True), (r"\frac{8}{3}", "2.667", True),
    (r"\frac{8}{3}", "2.67", False), (r"\frac{8}{3}", "2.6668", False), ("25", "24.9999", False),
    (r"\pi", "3.1416", True), ("2.33", r"\frac{7}{3}", True), (".79", r"\frac{\pi}{4}", True),
    ("2.33", r"\frac{7}{2}", False), ("0.3", r"\frac{1}{3}", False),  # one decimal place: too often exact
])
def test_decimal_approximations(gold, answer, correct):
    assert grade_one(B % answer, gold).correct is correct


@pytest.mark.parametrize(("gold", "answer", "correct"), [
    ("[-2, 7]", r"-2 \le x \le 7", True), ("[-2, 7]", "-2 < x < 7", False), (r"(2,\infty)", "x > 2", True),
    (r"(-\infty, 2) \cup (3, \infty)", r"x < 2 \text{ or } x > 3", True),
    (r"(-\infty, 2) \cup (3, \infty)", r"x < 2 \lor x > 3", True),
    (r"(-\infty, 2) \cup (3, \infty)", r"x \le 2 \text{ or } x \ge 3", False),
])
def test_inequalities_against_intervals(gold, answer, correct):
    assert grade_one(B % answer, gold).correct is correct


def test_a_reading_math_verify_cuts_short_is_never_a_match():
    # math-verify reads '1 \pm \frac{1}{\mathrm{e}}' as 1 (the \mathrm{e} taken for a unit)
    assert not grade_one(B % r"1 + \frac{1}{\mathrm{e}}", r"1 - \frac{1}{\mathrm{e}}").correct
    assert grade_one(B % r"\frac{e-1}{e}", r"1 - \frac{1}{\mathrm{e}}").correct


# ------------------------------------------------------------------------------ the pool


def sleepy_grade(prediction_text: str, gold: str, mode: str = "math", timeout: float = 5.0) -> Grade:
    """A grade_fn for the Grader that hangs on the prediction 'sleep' (runs in a worker)."""
    if prediction_text == "sleep":
        time.sleep(60)
    return grade_one(prediction_text, gold, mode, timeout)


@pytest.fixture(scope="module")
def grader():
    with Grader(workers=2) as g:
        yield g


def test_grader_matches_in_process_grading_in_order(grader):
    items = [(text, gold) for gold, text, mode, _ in CASES if mode == "math"]
    expected = [grade_one(text, gold) for text, gold in items]
    assert grader.grade(items, "math") == expected
    ints = [(text, gold) for gold, text, mode, _ in CASES if mode == "integer"]
    assert [g.correct for g in grader.grade(ints, "integer")] == [c[3] for c in CASES if c[2] == "integer"]


def test_grader_works_from_a_thread(grader):
    # math-verify's signal timeout raises outside a main thread; the workers' main threads grade.
    items = [(B % "0.5", r"\frac{1}{2}"), (B % r"\sqrt{12}", r"2\sqrt{3}"), (B % "3", "4")] * 4
    out: dict = {}
    thread = threading.Thread(target=lambda: out.setdefault("grades", grader.grade(items, "math")))
    thread.start()
    thread.join(60)
    assert [g.correct for g in out["grades"]] == [True, True, False] * 4
    assert {g.reason for g in out["grades"]} == {"match", "mismatch"}


def test_grader_item_timeout_kills_and_recovers():
    items = [(B % "1", "1"), ("sleep", "1"), (B % "2", "2"), (B % "3", "4")]
    with Grader(workers=1, item_timeout=1.0, grade_fn=sleepy_grade) as g:
        t0 = time.perf_counter()
        grades = g.grade(items, "math")
        assert time.perf_counter() - t0 < 30  # the sleeping worker was killed, not waited on
        assert [gr.reason for gr in grades] == ["match", "timeout", "match", "mismatch"]
        assert grades[1] == Grade(False, None, "timeout")
        assert [gr.reason for gr in g.grade([(B % "5", "5")], "math")] == ["match"]  # pool restarted


def test_signal_timeout_inside_grading_is_reported():
    # integer mode evaluates 10^(10^10) under math-verify's signal timeout: reported, not hung
    t0 = time.perf_counter()
    assert grade_one(B % "10^{10^{10}}", "25", "integer", timeout=1) == Grade(False, "10^{10^{10}}", "timeout")
    assert time.perf_counter() - t0 < 10


def test_workers_that_cannot_start_fail_fast_not_forever():
    # spawn cannot re-import a main module read from stdin: every worker dies before its
    # initializer; the pool would respawn them forever, the Grader must give up with a clear error
    script = "from opd_common.grading import Grader\nwith Grader(workers=2) as g:\n    g.grade([('x', '1')])\n"
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable], input=script, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "grader worker processes exited with code" in done.stderr
    assert time.perf_counter() - t0 < 30


def test_grader_rejects_unknown_mode(grader):
    with pytest.raises(ConfigError, match="unknown grader"):
        grader.grade([("x", "1")], "fuzzy")


def test_worker_errors_reach_the_caller(grader):
    with pytest.raises(RecordError, match="not an integer"):
        grader.grade([(B % "1", "1/2")], "integer")


# ---------------------------------------------------------------------------------- reward


@pytest.mark.parametrize(("length", "expected"), [
    (0, 0.0), (800, 0.0),          # at or below L_max - cache = 800
    (801, -1 / 200), (900, -0.5),  # inside the buffer: (800 - len) / 200
    (1000, -1.0),                  # at L_max: the bottom of the ramp
    (1001, -1.0), (5000, -1.0),    # past L_max
])
def test_overlong_penalty_hand_computed(length, expected):
    assert overlong_penalty(length, 1000, 200) == pytest.approx(expected)


def test_overlong_penalty_off_and_hard_cut():
    assert overlong_penalty(10**6, None, None) == 0.0
    assert overlong_penalty(1000, 1000, None) == 0.0 and overlong_penalty(1001, 1000, 0) == -1.0
    with pytest.raises(ConfigError):
        overlong_penalty(10, 100, 200)


def test_reward_block_totals():
    right, wrong, none = Grade(True, "42", "match"), Grade(False, "41", "mismatch"), Grade(False, None, "no-answer")
    r = reward(right, "stop", 900, require_stop=True, max_response_tokens=1000, overlong_buffer=200)
    assert r == {"correct": 1, "format_ok": True, "stop_ok": True, "length_penalty": -0.5, "total": 0.5,
                 "verifier": "math", "extracted": "42", "reason": "match"}
    assert reward(right, "stop", 10)["total"] == 1.0
    assert reward(wrong, "stop", 10)["total"] == 0.0
    assert reward(wrong, "stop", 950, max_response_tokens=1000, overlong_buffer=200)["total"] == pytest.approx(-0.75)
    # require_stop: a truncated response earns no accuracy, though the verdict is kept
    cut = reward(right, "length", 1000, require_stop=True, max_response_tokens=1000, overlong_buffer=200)
    assert (cut["correct"], cut["stop_ok"], cut["total"]) == (1, False, -1.0)
    assert reward(right, "length", 10, require_stop=False)["total"] == 1.0
    # format
    assert reward(none, "stop", 10)["format_ok"] is False
    assert reward(none, "stop", 10, format_penalty=0.5)["total"] == -0.5
    assert reward(right, "stop", 10, format_penalty=0.5, verifier="integer")["verifier"] == "integer"
