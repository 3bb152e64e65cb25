"""One line per check: PASS / WARN / FAIL / SKIP, the figure, and the fix (or one JSON object with --json)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

ORDER = ("PASS", "SKIP", "WARN", "FAIL")


@dataclass
class Result:
    check: str  # the check's name: tokenizers, rendering, logprobs, adapter, self, topk, stops
    status: str  # PASS | WARN | FAIL | SKIP
    figure: str  # what was measured, in words and numbers
    fix: str = ""  # what to do about a WARN or FAIL
    details: list[str] = field(default_factory=list)  # shown under the line (rendered prompts, ...)
    values: dict = field(default_factory=dict)  # the figures as numbers (--json)

    def worst(self, other: Result) -> Result:
        return other if ORDER.index(other.status) > ORDER.index(self.status) else self


def merge(check: str, parts: list[Result]) -> Result:
    """Several findings of one check as one result: the worst status, every figure, the fixes of the bad ones."""
    status = max((p.status for p in parts), key=ORDER.index)
    bad = [p for p in parts if p.status in ("WARN", "FAIL")]
    return Result(check, status, "; ".join(p.figure for p in parts if p.figure),
                  " ".join(p.fix for p in bad if p.fix), [d for p in parts for d in p.details],
                  {k: v for p in parts for k, v in p.values.items()})


def text(results: list[Result], verbose_details: bool = True) -> str:
    lines = []
    for r in results:
        line = f"{r.status:<4}  {r.check:<10} {r.figure}"
        if r.fix and r.status in ("WARN", "FAIL"):
            line += f" -> {r.fix}"
        lines.append(line)
        if verbose_details:
            lines += [f"      {d}" for d in r.details]
    counts = {s: sum(r.status == s for r in results) for s in ORDER}
    lines.append(f"opd-check: {counts['PASS']} pass, {counts['WARN']} warn, {counts['FAIL']} fail, "
                 f"{counts['SKIP']} skipped")
    return "\n".join(lines)


def as_json(results: list[Result]) -> dict:
    return {"ok": not any(r.status == "FAIL" for r in results), "checks": [asdict(r) for r in results]}
