"""`opd-eval report DIR`: results of several checkpoints -> a Markdown table and a PNG plot.

Every opd-eval results file in DIR is read and grouped by benchmark (name and problems). Within a
benchmark the results are ordered by training step; each gets its avg@n with a 95% bootstrap CI
over problems, and, when a step-0 (base model) result is there, the paired difference to it with
its CI and permutation p-value (as `compare`). The plot shows avg@n with CI bars against step,
one line per benchmark.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from opd_common.errors import StreamError, require

from .compare import check_compatible, compare_pair
from .results import SCHEMA, read_results

log = logging.getLogger("opd-eval")
MARKDOWN, PLOT = "report.md", "accuracy.png"


def collect(directory: Path) -> list[dict]:
    """The opd-eval results files in `directory` (other JSON files are skipped)."""
    if not directory.is_dir():
        raise StreamError(f"report: {directory} is not a directory (give the folder that holds results files)")
    found = []
    for path in sorted(directory.glob("*.json")):
        with open(path, "rb") as f:
            head = f.read(4096)
        if f'"schema": "{SCHEMA}"'.encode() not in head and f'"schema":"{SCHEMA}"'.encode() not in head:
            log.info("report: skipping %s (not an opd-eval results file)", path.name)
            continue
        found.append(read_results(path))
    if not found:
        raise StreamError(f"report: no opd-eval results files (*.json) in {directory}; write them with "
                          f"`opd-eval run ... --out {directory}/step-N.json`")
    return found


def group(results: list[dict]) -> dict[str, list[dict]]:
    """Results per benchmark, each list ordered by (step, file name); every result needs a step."""
    groups: dict[str, list[dict]] = {}
    for r in results:
        if r.get("step") is None:
            raise StreamError(f"{r['_path']}: no training step (an --adapter outside a run dir, not named "
                              "checkpoint-N); evaluate it with --run-dir D --checkpoint N so report can place it")
        key = f"{r['benchmark']['name']}"
        groups.setdefault(key, []).append(r)
    return {k: sorted(v, key=lambda r: (r["step"], Path(r["_path"]).name)) for k, v in sorted(groups.items())}


def build(directory: Path, resamples: int, seed: int, force: bool = False) -> dict[str, Any]:
    """The report's rows per benchmark (plain data; rendered by markdown() and plot())."""
    out: dict[str, Any] = {}
    for name, items in group(collect(directory)).items():
        base = next((r for r in items if r["step"] == 0), None)
        rows = []
        for r in items:
            o = r["metrics"]["overall"]
            row = {"file": Path(r["_path"]).name, "step": r["step"], "n": o["n"], "problems": o["problems"],
                   "avg": o["avg"], "ci": [o["avg_ci"]["lo"], o["avg_ci"]["hi"]],
                   "pass_at_k": o["pass_at_k"], "majority": o["majority"], "format_rate": o["format_rate"],
                   "truncation_rate": o["truncation_rate"], "mean_length": o["length"]["mean"], "vs_base": None}
            if base is not None and r is not base:
                c = compare_pair(base, r, resamples, seed, force)
                row["vs_base"] = {"diff": c["diff"], "ci": c["ci"], "p_value": c["p_value"],
                                  "wins": c["wins"], "losses": c["losses"], "ties": c["ties"]}
            elif base is None and r is not items[0]:
                check_compatible(items[0], r, force)
            rows.append(row)
        out[name] = rows
    return out


def markdown(report: dict[str, Any], plot_name: str = PLOT) -> str:
    def pct(x: float) -> str:
        return f"{100 * x:.1f}"

    lines = ["# opd-eval report", ""]
    for name, rows in report.items():
        n = rows[0]["n"]
        k = max((int(k) for k in rows[0]["pass_at_k"]), default=1)
        lines += [f"## {name}", "",
                  f"| step | file | avg@{n} (95% CI) | pass@{k} | maj@{n} | boxed | truncated | mean length "
                  "| vs step 0 (95% CI) | p | W/L/T |",
                  "|---:|---|---|---:|---:|---:|---:|---:|---|---:|---|"]
        for r in rows:
            vs = r["vs_base"]
            delta = (f"{100 * vs['diff']:+.1f} ({100 * vs['ci'][0]:+.1f}, {100 * vs['ci'][1]:+.1f})",
                     f"{vs['p_value']:.3f}",
                     f"{vs['wins']}/{vs['losses']}/{vs['ties']}") if vs else ("-", "-", "-")
            lines.append(f"| {r['step']} | {r['file']} | {pct(r['avg'])} ({pct(r['ci'][0])}-{pct(r['ci'][1])}) "
                         f"| {pct(r['pass_at_k'].get(str(k), 0.0))} | {pct(r['majority'])} | {pct(r['format_rate'])} "
                         f"| {pct(r['truncation_rate'])} | {r['mean_length']:.0f} "
                         f"| {delta[0]} | {delta[1]} | {delta[2]} |")
        lines.append("")
    lines += ["Accuracies in percent. CIs: percentile bootstrap over problems; vs step 0: paired bootstrap of the "
              "per-problem difference and a paired sign-flip permutation p-value (docs/eval.md).", "",
              f"![accuracy vs training step]({plot_name})", ""]
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    """avg@n with 95% CI bars against training step, one line per benchmark (matplotlib, Agg)."""
    matplotlib = require("matplotlib", "eval")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    for name, rows in report.items():
        steps = [r["step"] for r in rows]
        avg = [100 * r["avg"] for r in rows]
        err = [[100 * (r["avg"] - r["ci"][0]) for r in rows], [100 * (r["ci"][1] - r["avg"]) for r in rows]]
        ax.errorbar(steps, avg, yerr=err, marker="o", capsize=3, label=f"{name} (avg@{rows[0]['n']})")
    ax.set_xlabel("training step")
    ax.set_ylabel("accuracy (%)")
    ax.set_title("opd-eval: accuracy with 95% CI")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(path)


def write(directory: Path, out_dir: Path | None, resamples: int, seed: int, force: bool) -> tuple[str, Path, Path]:
    """Build, render and write report.md and accuracy.png (atomically); returns (markdown, paths)."""
    from opd_common.rundir import atomic_write_bytes

    report = build(directory, resamples, seed, force)
    out_dir = out_dir or directory
    out_dir.mkdir(parents=True, exist_ok=True)
    text = markdown(report)
    png = out_dir / PLOT
    plot(report, png)
    md = out_dir / MARKDOWN
    atomic_write_bytes(md, text.encode())
    return text, md, png
