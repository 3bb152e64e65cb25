"""The grader against plain math-verify on the answer-equivalence tables of tests/grading_cases.py.

Targets (docs/grading.md, "How it compares"): per source, opd agrees with the expected verdicts at
least as often as plain math-verify (on the raw texts, and with the gold wrapped in $...$); >= 95%
overall; and opd accepts no wrong answer that math-verify rejects. The tables in docs/grading.md are
the output of benchmarks/grading_table.py, checked here to be current.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from grading_cases import KINDS, SOURCES, all_cases, markdown, score

BASELINES = ("math-verify", "math-verify ($gold$)")
DOCS = Path(__file__).resolve().parents[1] / "docs" / "grading.md"


@pytest.fixture(scope="module")
def scored():
    logging.disable(logging.WARNING)  # math-verify logs every expression it cannot parse
    try:
        cases = all_cases()
        verdicts, tallies = score(cases)
    finally:
        logging.disable(logging.NOTSET)
    return cases, verdicts, tallies


def test_tables_are_large_and_cover_every_source_and_kind():
    cases = all_cases()
    assert len(cases) >= 250
    for group, field in ((SOURCES, "source"), (KINDS, "kind")):
        for name in group:
            rows = [case for case in cases if getattr(case, field) == name]
            assert {case.correct for case in rows} == {True, False}, name  # right and wrong answers in each
    assert {case.source for case in cases} == set(SOURCES) and {case.kind for case in cases} == set(KINDS)


@pytest.mark.parametrize("source", SOURCES)
def test_opd_at_least_as_good_as_math_verify_on_each_source(scored, source):
    _cases, _verdicts, tallies = scored
    for baseline in BASELINES:
        assert tallies[("opd", source)].right >= tallies[(baseline, source)].right, (source, baseline)


def test_opd_agrees_with_95_percent_of_the_verdicts(scored):
    _cases, _verdicts, tallies = scored
    overall = tallies[("opd", "all")]
    assert overall.right >= 0.95 * overall.rows


def test_opd_accepts_no_wrong_answer_that_math_verify_rejects(scored):
    cases, verdicts, tallies = scored
    for baseline in BASELINES:
        extra = [(case.gold, case.response) for case, ours, theirs in zip(cases, verdicts["opd"], verdicts[baseline],
                                                                        strict=True)
                 if ours and not theirs and not case.correct]
        assert extra == [], baseline
    # counted apart: opd's false positives stay no more than its baselines', false negatives are the rest
    assert all(tallies[("opd", s)].false_pos <= min(tallies[(b, s)].false_pos for b in BASELINES) for s in SOURCES)


def test_the_tables_in_the_docs_are_current(scored):
    cases, _verdicts, tallies = scored
    text = DOCS.read_text()
    for by in ("source", "kind"):
        assert markdown(cases, tallies, by=by) in text, f"rerun: python benchmarks/grading_table.py ({by} table)"
