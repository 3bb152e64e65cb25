"""Evaluation metrics as pure functions over graded samples (docs/eval.md, "Metrics").

A *sample row* is a dict with at least ``prompt_id``, ``correct`` (bool), ``extracted`` (str or
None), ``answer_from`` ('boxed' | 'answer-line' | None), ``finish_reason`` and ``length``
(response tokens). Nothing here does I/O or knows about models.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from math import comb

import numpy as np

from opd_common.grading import REASONS, normalize_answer

LENGTH_QUANTILES = (0.5, 0.9, 0.99)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al., 2021):

        pass@k = 1 - C(n - c, k) / C(n, k)

    the probability that k samples drawn without replacement from the n include a correct one.
    Computed as 1 - prod_{i = n-c+1}^{n} (1 - k / i), which never forms large binomials.
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def pass_at_k_closed_form(n: int, c: int, k: int) -> float:
    """The same estimator with exact integer binomials (the reference the tests hold pass_at_k to)."""
    return 1.0 - comb(n - c, k) / comb(n, k)


def ks_for(n: int) -> list[int]:
    """k = 1, 2, 4, 8, ... up to n."""
    ks, k = [], 1
    while k <= n:
        ks.append(k)
        k *= 2
    return ks


def majority_vote(extracted: Sequence[str | None], correct: Sequence[bool]) -> tuple[str | None, bool]:
    """(winning answer, its verdict): the most frequent extracted answer, answers grouped by their
    normalized string (``normalize_answer``: '\\dfrac12' and '\\frac{1}{2}' are one vote, '0.5' is
    another). Ties go to the answer seen first. Samples without an answer do not vote; if none has
    one, the vote is (None, False). The verdict is that of the winning group's first sample."""
    votes: Counter[str] = Counter()
    first: dict[str, int] = {}
    for i, answer in enumerate(extracted):
        if answer is None:
            continue
        key = normalize_answer(answer)
        votes[key] += 1
        first.setdefault(key, i)
    if not votes:
        return None, False
    best = max(votes, key=lambda key: (votes[key], -first[key]))
    i = first[best]
    return extracted[i], bool(correct[i])


def length_stats(lengths: Sequence[int]) -> dict[str, float]:
    """mean, p50, p90, p99 (numpy's linear interpolation between order statistics) and max."""
    if not lengths:
        return {"mean": 0.0, **{f"p{round(q * 100)}": 0.0 for q in LENGTH_QUANTILES}, "max": 0}
    arr = np.asarray(lengths, dtype=np.float64)
    stats = {"mean": float(arr.mean())}
    for q, value in zip(LENGTH_QUANTILES, np.quantile(arr, LENGTH_QUANTILES), strict=True):
        stats[f"p{round(q * 100)}"] = float(value)
    stats["max"] = int(arr.max())
    return stats


def group_by_problem(rows: Iterable[dict], order: Sequence[str] | None = None) -> dict[str, list[dict]]:
    """Rows per prompt_id (in `order` if given, else first appearance), each sorted by sample."""
    groups: dict[str, list[dict]] = {pid: [] for pid in order or []}
    for row in rows:
        groups.setdefault(row["prompt_id"], []).append(row)
    return {pid: sorted(g, key=lambda r: r["sample"]) for pid, g in groups.items()}


def problem_metrics(prompt_id: str, rows: Sequence[dict], ks: Sequence[int]) -> dict:
    """Metrics of one problem's samples: accuracy (c / n), pass@k, majority vote, format and
    truncation rates, mean length."""
    n = len(rows)
    c = sum(bool(r["correct"]) for r in rows)
    answer, maj_ok = majority_vote([r["extracted"] for r in rows], [r["correct"] for r in rows])
    return {
        "prompt_id": prompt_id, "n": n, "correct": c, "accuracy": c / n if n else 0.0,
        "pass_at_k": {str(k): pass_at_k(n, c, k) for k in ks if k <= n},
        "majority": {"answer": answer, "correct": maj_ok},
        "format_rate": _rate(r.get("answer_from") == "boxed" for r in rows),
        "truncation_rate": _rate(r["finish_reason"] == "length" for r in rows),
        "mean_length": float(np.mean([r["length"] for r in rows])) if rows else 0.0,
    }


def _rate(flags: Iterable[bool]) -> float:
    flags = list(flags)
    return sum(flags) / len(flags) if flags else 0.0


def summarize(rows: Sequence[dict], order: Sequence[str] | None = None) -> dict:
    """{'overall': ..., 'per_problem': [...]} for graded sample rows (docs/eval.md, "Metrics").

    Overall: avg = mean over problems of per-problem accuracy (with the same n for every problem,
    the mean over all samples: avg@n); pass@k and majority vote = means over problems; format,
    truncation and reasons over all samples; length statistics over all samples.
    """
    groups = group_by_problem(rows, order)
    empty = [pid for pid, g in groups.items() if not g]
    if empty:
        raise ValueError(f"no samples for problems {empty[:3]}")
    sizes = {len(g) for g in groups.values()}
    n = min(sizes) if sizes else 0
    ks = ks_for(n)
    per_problem = [problem_metrics(pid, g, ks) for pid, g in groups.items()]
    reasons = Counter(r["reason"] for r in rows)
    overall = {
        "problems": len(per_problem), "samples": len(rows), "n": n if len(sizes) == 1 else None,
        "avg": _mean(p["accuracy"] for p in per_problem),
        "pass_at_k": {str(k): _mean(p["pass_at_k"][str(k)] for p in per_problem) for k in ks},
        "majority": _mean(p["majority"]["correct"] for p in per_problem),
        "format_rate": _rate(r.get("answer_from") == "boxed" for r in rows),
        "truncation_rate": _rate(r["finish_reason"] == "length" for r in rows),
        "length": length_stats([r["length"] for r in rows]),
        "reasons": {reason: reasons.get(reason, 0) for reason in REASONS},
    }
    return {"overall": overall, "per_problem": per_problem}


def _mean(values: Iterable[float]) -> float:
    values = [float(v) for v in values]
    return sum(values) / len(values) if values else 0.0
