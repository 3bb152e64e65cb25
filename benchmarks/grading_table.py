"""Print the grader's answer-equivalence tables (tests/grading_cases.py) as Markdown, as in docs/grading.md.

    python benchmarks/grading_table.py            # counts by source, then by kind
    python benchmarks/grading_table.py --rows     # also every row some grader gets wrong

Each row is graded by opd's `grade_one` and by plain math-verify (parse of the raw gold and the raw
response, then verify; and once more with the gold wrapped in `$...$`). Runs in this process's main
thread, where math-verify's signal timeouts work. Takes a few seconds on one CPU core.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from grading_cases import GRADERS, all_cases, markdown, score  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", action="store_true", help="list the rows some grader gets wrong")
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)  # math-verify logs every expression it cannot parse
    cases = all_cases()
    verdicts, tallies = score(cases)
    print(markdown(cases, tallies, by="source"))
    print()
    print(markdown(cases, tallies, by="kind"))
    if args.rows:
        print()
        for i, case in enumerate(cases):
            wrong = [name for name in GRADERS if verdicts[name][i] != case.correct]
            if wrong:
                print(f"- [{case.source}/{case.kind}] expected {case.correct}, wrong: {', '.join(wrong)}; "
                      f"gold {case.gold[-60:]!r}; response {case.response[-70:]!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
