"""`opd-eval compare`: paired comparison of results on the same problems (docs/eval.md).

The first file is the baseline; every other file is compared with it problem by problem:
difference in avg@n (b - a), its paired bootstrap CI, a paired permutation p-value and per-problem
wins/losses/ties. Results of different benchmarks or sampling settings are refused unless forced.
"""

from __future__ import annotations

from typing import Any

from opd_common.errors import ConfigError

from .results import read_results
from .stats import LEVEL, paired_bootstrap, permutation_pvalue, wins_losses

SAMPLING_IGNORED = ("seed",)  # other seeds are other samples of one protocol: comparable


def label(results: dict) -> str:
    return results.get("_path", "results")


def incompatibilities(a: dict, b: dict) -> list[str]:
    """Why a and b are not a fair paired comparison ([] if they are)."""
    why = []
    ba, bb = a["benchmark"], b["benchmark"]
    if ba.get("name") != bb.get("name"):
        why.append(f"different benchmarks ({ba.get('name')} vs {bb.get('name')})")
    elif ba.get("problems_sha256") != bb.get("problems_sha256"):
        why.append(f"different problems of {ba.get('name')} ({ba.get('problems')} vs {bb.get('problems')} problems, "
                   "or other rows or answers)")
    sa, sb = a["sampling"], b["sampling"]
    diffs = [f"{k} {sa.get(k)!r} vs {sb.get(k)!r}" for k in sorted(set(sa) | set(sb))
             if k not in SAMPLING_IGNORED and sa.get(k) != sb.get(k)]
    if diffs:
        why.append("different sampling settings (" + "; ".join(diffs) + ")")
    return why


def check_compatible(a: dict, b: dict, force: bool) -> list[str]:
    """Raise unless a and b compare fairly; with force, return the reasons as warnings."""
    why = incompatibilities(a, b)
    if why and not force:
        raise ConfigError(f"{label(a)} and {label(b)} are not comparable: {'; '.join(why)}. A paired comparison "
                          "needs the same problems under the same protocol (pass --force to compare anyway, "
                          "over the problems both have)")
    return why


def accuracies(results: dict) -> dict[str, float]:
    """Per-problem accuracy (c / n) by prompt id, in the benchmark's order."""
    return {p["prompt_id"]: p["accuracy"] for p in results["metrics"]["per_problem"]}


def compare_pair(a: dict, b: dict, resamples: int, seed: int, force: bool = False) -> dict[str, Any]:
    warnings = check_compatible(a, b, force)
    acc_a, acc_b = accuracies(a), accuracies(b)
    shared = [pid for pid in acc_a if pid in acc_b]
    if not shared:
        raise ConfigError(f"{label(a)} and {label(b)} share no problem ids; there is nothing to pair")
    xa, xb = [acc_a[pid] for pid in shared], [acc_b[pid] for pid in shared]
    boot = paired_bootstrap(xa, xb, resamples, seed)
    perm = permutation_pvalue(xa, xb, resamples, seed)
    return {
        "file": label(b), "step": b.get("step"), "problems": len(shared),
        "avg_a": sum(xa) / len(xa), "avg_b": sum(xb) / len(xb),
        "diff": boot["diff"], "ci": [boot["lo"], boot["hi"]],
        "excludes_zero": boot["lo"] > 0 or boot["hi"] < 0,
        "p_value": perm["p_value"], "p_method": perm["method"],
        **wins_losses(xa, xb), "warnings": warnings,
        "per_problem": [{"prompt_id": pid, "a": x, "b": y, "diff": y - x}
                        for pid, x, y in zip(shared, xa, xb, strict=True)],
    }


def compare(paths: list[str], resamples: int, seed: int, force: bool = False) -> dict[str, Any]:
    if len(paths) < 2:
        raise ConfigError("compare needs at least two results files: BASELINE.json OTHER.json [...]")
    if resamples < 100:
        raise ConfigError(f"--resamples must be >= 100 for a 95% interval, got {resamples}")
    loaded = [read_results(p) for p in paths]
    base = loaded[0]
    return {
        "baseline": {"file": label(base), "benchmark": base["benchmark"]["name"], "step": base.get("step"),
                     "avg": base["metrics"]["overall"]["avg"]},
        "level": LEVEL, "resamples": resamples, "seed": seed,
        "comparisons": [compare_pair(base, other, resamples, seed, force) for other in loaded[1:]],
    }
