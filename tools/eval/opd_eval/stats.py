"""Confidence intervals and paired tests over problems (pure numpy; docs/eval.md, "compare").

The unit of resampling is the *problem*: a benchmark is a sample of problems, and a problem's n
sampled responses are not independent evidence about other problems. Each function takes
per-problem accuracies (c / n) and a seed, and gives the same answer for the same seed.
"""

from __future__ import annotations

import numpy as np

LEVEL = 0.95
RESAMPLES = 10_000
EXACT_LIMIT = 16  # enumerate all 2^m sign flips up to this many non-zero differences (65,536 x 16)


def _rng(seed: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(seed))


def _bootstrap_means(values_P: np.ndarray, resamples: int, seed: int, chunk: int = 2000) -> np.ndarray:
    """Means of `resamples` resamples (with replacement) of the P values, drawn in chunks."""
    rng = _rng(seed)
    P = len(values_P)
    means = np.empty(resamples)
    for start in range(0, resamples, chunk):
        stop = min(start + chunk, resamples)
        idx_RP = rng.integers(0, P, size=(stop - start, P))
        means[start:stop] = values_P[idx_RP].mean(axis=1)
    return means


def bootstrap_ci(values, resamples: int = RESAMPLES, seed: int = 0, level: float = LEVEL) -> tuple[float, float]:
    """Percentile bootstrap CI of the mean of `values` (e.g. per-problem accuracies)."""
    values_P = np.asarray(values, dtype=np.float64)
    if len(values_P) == 0:
        raise ValueError("bootstrap_ci needs at least one value")
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    means = _bootstrap_means(values_P, resamples, seed)
    alpha = (1.0 - level) / 2
    lo, hi = np.quantile(means, [alpha, 1.0 - alpha])
    return float(lo), float(hi)


def paired_bootstrap(a, b, resamples: int = RESAMPLES, seed: int = 0, level: float = LEVEL) -> dict:
    """Difference mean(b - a) over paired problems with its percentile bootstrap CI.

    a[i], b[i]: the two evaluations' accuracy on problem i. Problems are resampled with
    replacement and the differences of a resample averaged; the CI is the (alpha/2, 1 - alpha/2)
    quantiles of those means.
    """
    d_P = _paired(a, b)
    lo, hi = bootstrap_ci(d_P, resamples, seed, level)
    return {"diff": float(d_P.mean()), "lo": lo, "hi": hi, "level": level, "resamples": resamples, "seed": seed}


def permutation_pvalue(a, b, resamples: int = RESAMPLES, seed: int = 0) -> dict:
    """Two-sided paired permutation test of 'no difference' (sign flips of d = b - a).

    Under the null hypothesis the labels a/b of each problem are exchangeable, so each d_i is as
    likely to be -d_i. The statistic is |mean(d)|; p = the share of sign assignments whose
    |mean(s * d)| >= |mean(d)|. With at most EXACT_LIMIT non-zero differences all 2^m assignments
    are enumerated (exact p); otherwise `resamples` random ones, p = (1 + hits) / (1 + resamples).
    """
    d_P = _paired(a, b)
    observed = abs(d_P.mean())
    nonzero = d_P[d_P != 0]
    m, P = len(nonzero), len(d_P)
    if m == 0:
        return {"p_value": 1.0, "method": "exact", "flips": 1}
    tol = 1e-12 * max(1.0, observed)  # float sums of the same values in another order
    if m <= EXACT_LIMIT:
        signs_FM = 1 - 2 * ((np.arange(2**m)[:, None] >> np.arange(m)[None, :]) & 1)
        stats = np.abs(signs_FM @ nonzero) / P
        return {"p_value": float(np.mean(stats >= observed - tol)), "method": "exact", "flips": 2**m}
    rng = _rng(seed)
    hits = 0
    for start in range(0, resamples, 2000):
        rows = min(2000, resamples - start)
        signs_FM = rng.choice(np.array([-1.0, 1.0]), size=(rows, m))
        hits += int(np.sum(np.abs(signs_FM @ nonzero) / P >= observed - tol))
    return {"p_value": (1 + hits) / (1 + resamples), "method": "monte-carlo", "flips": resamples}


def wins_losses(a, b) -> dict:
    """Per-problem outcomes of b against a: wins (b higher), losses (b lower), ties."""
    d_P = _paired(a, b)
    return {"wins": int(np.sum(d_P > 0)), "losses": int(np.sum(d_P < 0)), "ties": int(np.sum(d_P == 0))}


def _paired(a, b) -> np.ndarray:
    a_P, b_P = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a_P.shape != b_P.shape or a_P.ndim != 1 or len(a_P) == 0:
        raise ValueError("paired statistics need two equal-length, non-empty 1-D arrays, "
                         f"got {a_P.shape} and {b_P.shape}")
    return b_P - a_P
