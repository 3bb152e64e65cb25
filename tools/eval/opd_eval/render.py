"""Short human tables (stderr for run and compare; Markdown for report)."""

from __future__ import annotations

from pathlib import Path


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def _signed(x: float) -> str:
    return f"{100 * x:+.1f}"


def run_table(results: dict) -> str:
    o = results["metrics"]["overall"]
    n = o["n"]
    ci = o["avg_ci"]
    length = o["length"]
    who = results["model"]["ref"] + (f" + {results['adapter']['path']}" if results.get("adapter") else "")
    rows = [
        (f"avg@{n}", f"{_pct(o['avg'])}%  (95% CI {_pct(ci['lo'])} to {_pct(ci['hi'])})"),
        *[(f"pass@{k}", f"{_pct(v)}%") for k, v in o["pass_at_k"].items()],
        (f"maj@{n}", f"{_pct(o['majority'])}%"),
        ("boxed", f"{_pct(o['format_rate'])}%   truncated {_pct(o['truncation_rate'])}%"),
        ("length", f"mean {length['mean']:.0f}  p50 {length['p50']:.0f}  p90 {length['p90']:.0f}  max {length['max']}"),
        ("reasons", ", ".join(f"{k} {v}" for k, v in o["reasons"].items())),
    ]
    lines = [f"opd-eval: {results['benchmark']['name']}  {who}  step {results.get('step')}",
             f"  problems {o['problems']}  samples {o['samples']}  n {n}",
             *[f"  {name:<10} {value}" for name, value in rows]]
    return "\n".join(lines)


def compare_table(report: dict) -> str:
    base = report["baseline"]
    lines = [f"baseline {base['file']} ({base['benchmark']}): avg {_pct(base['avg'])}%",
             f"{'file':<32} {'probs':>5} {'avg':>6} {'diff':>6}  {'95% CI':<16} {'p':>6}  W/L/T"]
    for c in report["comparisons"]:
        ci = f"[{_signed(c['ci'][0])}, {_signed(c['ci'][1])}]"
        lines.append(f"{Path(c['file']).name:<32} {c['problems']:>5} {_pct(c['avg_b']):>6} {_signed(c['diff']):>6}  "
                     f"{ci:<16} {c['p_value']:>6.3f}  {c['wins']}/{c['losses']}/{c['ties']}")
        lines.extend(f"  warning (--force): {w}" for w in c["warnings"])
    lines.append("(differences and CIs in accuracy points; a CI that excludes 0 is a paired gain or loss)")
    return "\n".join(lines)
