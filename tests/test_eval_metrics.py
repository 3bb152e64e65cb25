"""opd-eval's metric and statistics functions against hand-computed values and simulations."""

from __future__ import annotations

import itertools
from math import comb

import numpy as np
import pytest

from opd_eval import stats
from opd_eval.metrics import (
    ks_for,
    length_stats,
    majority_vote,
    pass_at_k,
    pass_at_k_closed_form,
    problem_metrics,
    summarize,
)
from opd_eval.stats import bootstrap_ci, paired_bootstrap, permutation_pvalue, wins_losses

# ------------------------------------------------------------------------------------ pass@k


@pytest.mark.parametrize(("n", "c", "k", "expected"), [
    (4, 1, 1, 0.25),
    (4, 1, 2, 1 - 3 / 6),          # 1 - C(3,2)/C(4,2)
    (4, 2, 2, 1 - 1 / 6),          # 1 - C(2,2)/C(4,2)
    (4, 1, 4, 1.0),
    (12, 3, 4, 1 - 126 / 495),     # 1 - C(9,4)/C(12,4)
    (12, 3, 8, 1.0),               # n - c = 9 >= 8 but C(9,8)/C(12,8) = 9/495
    (5, 0, 2, 0.0),
    (5, 5, 1, 1.0),
])
def test_pass_at_k_hand_computed(n, c, k, expected):
    if (n, c, k) == (12, 3, 8):
        expected = 1 - 9 / 495
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_equals_the_closed_form_and_subset_enumeration():
    for n in range(1, 17):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(pass_at_k_closed_form(n, c, k), abs=1e-12)
    # the estimator's meaning: the share of k-subsets of the n samples that hold a correct one
    for n in range(1, 8):
        for c in range(n + 1):
            samples = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(samples, k))
                assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / comb(n, k), abs=1e-12)


def test_pass_at_1_is_accuracy_and_bad_arguments_raise():
    assert pass_at_k(12, 7, 1) == pytest.approx(7 / 12)
    for bad in [(4, 5, 1), (4, 1, 0), (4, 1, 5)]:
        with pytest.raises(ValueError):
            pass_at_k(*bad)


def test_ks_are_powers_of_two_up_to_n():
    assert ks_for(1) == [1]
    assert ks_for(2) == [1, 2]
    assert ks_for(12) == [1, 2, 4, 8]
    assert ks_for(16) == [1, 2, 4, 8, 16]


# ------------------------------------------------------------------------- majority, lengths


def test_majority_vote():
    assert majority_vote(["5", "5", "7"], [True, True, False]) == ("5", True)
    assert majority_vote(["7", "5", "5"], [False, True, True]) == ("5", True)
    assert majority_vote(["7", "5"], [False, True]) == ("7", False)  # a tie goes to the first seen
    # equal after normalization: one vote ('\dfrac12' == '\frac{1}{2}'), '0.5' is another string
    assert majority_vote(["0.5", r"\dfrac12", r"\frac{1}{2}"], [True, True, True]) == (r"\dfrac12", True)
    assert majority_vote([None, None, "3"], [False, False, False]) == ("3", False)  # no answer, no vote
    assert majority_vote([None, None], [False, False]) == (None, False)


def test_length_stats_hand_computed():
    # numpy's linear interpolation: p90 of 10,20,30,40 sits at rank 2.7 -> 30 + 0.7 * 10
    assert length_stats([10, 20, 30, 40]) == pytest.approx({"mean": 25.0, "p50": 25.0, "p90": 37.0, "p99": 39.7,
                                                            "max": 40})
    assert length_stats([7]) == {"mean": 7.0, "p50": 7.0, "p90": 7.0, "p99": 7.0, "max": 7}


def _row(pid, s, correct, extracted, answer_from, finish, length, reason):
    return {"prompt_id": pid, "sample": s, "correct": correct, "extracted": extracted, "answer_from": answer_from,
            "finish_reason": finish, "length": length, "reason": reason}


ROWS = [
    _row("p1", 0, True, "1", "boxed", "stop", 10, "match"),
    _row("p1", 1, False, "2", "boxed", "length", 20, "mismatch"),
    _row("p1", 2, True, "1", "answer-line", "stop", 30, "match"),
    _row("p1", 3, False, None, None, "length", 40, "no-answer"),
    *[_row("p2", s, False, x, "boxed", "stop", 5, "mismatch") for s, x in enumerate(["7", "7", "8", "7"])],
]


def test_problem_metrics_hand_computed():
    p1 = problem_metrics("p1", ROWS[:4], [1, 2, 4])
    assert p1.pop("pass_at_k") == pytest.approx({"1": 0.5, "2": 5 / 6, "4": 1.0})
    assert p1 == {
        "prompt_id": "p1", "n": 4, "correct": 2, "accuracy": 0.5,
        "majority": {"answer": "1", "correct": True},
        "format_rate": 0.5,  # boxed: samples 0 and 1 (an answer line is not a box)
        "truncation_rate": 0.5, "mean_length": 25.0,
    }


def test_summarize_hand_computed():
    # rows out of order: summarize groups by problem and sorts by sample
    out = summarize(list(reversed(ROWS)), order=["p1", "p2"])
    assert [p["prompt_id"] for p in out["per_problem"]] == ["p1", "p2"]
    p2 = out["per_problem"][1]
    assert (p2["accuracy"], p2["pass_at_k"], p2["majority"]) == (0.0, {"1": 0.0, "2": 0.0, "4": 0.0},
                                                                 {"answer": "7", "correct": False})
    o = out["overall"]
    assert (o["problems"], o["samples"], o["n"]) == (2, 8, 4)
    assert o["avg"] == pytest.approx(0.25)
    assert o["pass_at_k"] == pytest.approx({"1": 0.25, "2": 5 / 12, "4": 0.5})
    assert o["majority"] == pytest.approx(0.5)
    assert o["format_rate"] == pytest.approx(6 / 8)
    assert o["truncation_rate"] == pytest.approx(2 / 8)
    # lengths 5,5,5,5,10,20,30,40: p50 at rank 3.5 -> 7.5, p90 at 6.3 -> 33, p99 at 6.93 -> 39.3
    assert o["length"] == pytest.approx({"mean": 15.0, "p50": 7.5, "p90": 33.0, "p99": 39.3, "max": 40})
    assert o["reasons"] == {"match": 2, "no-answer": 1, "parse-failure": 0, "mismatch": 5, "timeout": 0}


def test_summarize_refuses_a_problem_without_samples():
    with pytest.raises(ValueError, match="no samples"):
        summarize(ROWS[:4], order=["p1", "p2"])


# --------------------------------------------------------------------------------- bootstrap


def test_bootstrap_ci_hand_computed():
    assert bootstrap_ci([0.25] * 7, resamples=500) == (0.25, 0.25)
    # two problems: resample means are 0, 0.5, 1 with probabilities 1/4, 1/2, 1/4, so the
    # 2.5% and 97.5% quantiles of 10,000 draws are 0 and 1
    assert bootstrap_ci([0.0, 1.0], resamples=10_000, seed=3) == (0.0, 1.0)


def test_bootstrap_is_seeded():
    rng = np.random.default_rng(0)
    x = rng.random(40)
    assert bootstrap_ci(x, 2000, seed=7) == bootstrap_ci(x, 2000, seed=7)
    assert bootstrap_ci(x, 2000, seed=7) != bootstrap_ci(x, 2000, seed=8)
    # the percentile CI of a mean is close to mean -/+ 1.96 standard errors for 40 smooth values
    lo, hi = bootstrap_ci(x, 20_000, seed=1)
    se = x.std(ddof=0) / np.sqrt(len(x))
    assert lo == pytest.approx(x.mean() - 1.96 * se, abs=0.3 * se)
    assert hi == pytest.approx(x.mean() + 1.96 * se, abs=0.3 * se)


def test_paired_bootstrap_hand_computed():
    a, b = [0.0, 0.5, 1.0, 0.5], [0.5, 0.5, 1.0, 1.0]
    out = paired_bootstrap(a, b, resamples=5000, seed=0)
    assert out["diff"] == pytest.approx(0.25)
    assert 0.0 <= out["lo"] <= 0.25 <= out["hi"] <= 0.5  # every difference is 0 or 0.5
    assert wins_losses(a, b) == {"wins": 2, "losses": 0, "ties": 2}
    with pytest.raises(ValueError):
        paired_bootstrap([0.1], [0.1, 0.2])


def test_paired_bootstrap_ci_covers_the_true_difference_at_about_95_percent():
    """400 simulated evaluations of 50 problems (difficulty ~ U(0.2, 0.8), model B + 0.05 on each,
    8 samples per problem per model): the true mean difference is exactly 0.05."""
    rng = np.random.default_rng(2024)
    trials, P, n, delta = 400, 50, 8, 0.05
    covered = 0
    for t in range(trials):
        p_a = rng.uniform(0.2, 0.8, P)
        acc_a = rng.binomial(n, p_a) / n
        acc_b = rng.binomial(n, p_a + delta) / n
        out = paired_bootstrap(acc_a, acc_b, resamples=1000, seed=t)
        covered += out["lo"] <= delta <= out["hi"]
    coverage = covered / trials
    assert 0.91 <= coverage <= 0.98, coverage  # binomial sd of the estimate at 0.95: 0.011


# ------------------------------------------------------------------------------ permutation


def test_permutation_pvalue_exact_hand_computed():
    # d = (1, 1, 1): of the 8 sign flips only +++ and --- reach |mean| = 1
    assert permutation_pvalue([0, 0, 0], [1, 1, 1]) == {"p_value": 0.25, "method": "exact", "flips": 8}
    # d = (.5, 0, 0, .5): zeros do not move; of the 4 flips of the two halves, 2 reach |mean| = .25
    assert permutation_pvalue([0, 0.5, 1, 0.5], [0.5, 0.5, 1, 1])["p_value"] == 0.5
    # d = (1, -1): observed mean 0, every flip reaches it
    assert permutation_pvalue([0, 1], [1, 0])["p_value"] == 1.0
    assert permutation_pvalue([0.3, 0.3], [0.3, 0.3]) == {"p_value": 1.0, "method": "exact", "flips": 1}


def test_permutation_pvalue_monte_carlo_matches_exact(monkeypatch):
    rng = np.random.default_rng(5)
    a, b = rng.random(16), rng.random(16)
    exact = permutation_pvalue(a, b)
    assert exact["method"] == "exact" and exact["flips"] == 2**16
    monkeypatch.setattr(stats, "EXACT_LIMIT", 0)
    mc = permutation_pvalue(a, b, resamples=40_000, seed=1)
    assert mc["method"] == "monte-carlo"
    assert mc["p_value"] == pytest.approx(exact["p_value"], abs=0.01)
    # 30 equal gains: no random flip of 1000 reaches it (chance 2 / 2^30 each), p = 1 / 1001
    assert permutation_pvalue([0] * 30, [1] * 30, resamples=1000)["p_value"] == pytest.approx(1 / 1001)


def test_permutation_pvalue_is_calibrated_under_the_null():
    """a and b from one distribution: p < 0.05 in about 5% of 300 simulated comparisons."""
    rng = np.random.default_rng(11)
    rejections = 0
    for t in range(300):
        p = rng.uniform(0.1, 0.9, 30)
        a, b = rng.binomial(4, p) / 4, rng.binomial(4, p) / 4
        rejections += permutation_pvalue(a, b, resamples=2000, seed=t)["p_value"] < 0.05
    assert 0.02 <= rejections / 300 <= 0.09
