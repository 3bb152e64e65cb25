"""opd-check: a preflight of a run's pieces (click flags only; the work is in run.run)."""

from __future__ import annotations

import sys

from opd_common.cli_util import console_main, tool_command

from .config import CheckConfig


@tool_command("opd-check", CheckConfig, inputs=True)
def command(config: CheckConfig, inputs: list[str]) -> int:
    """Check that a run's pieces agree before it starts: one line per check, PASS / WARN / FAIL / SKIP,
    with the figure and the fix; exit status 1 on any FAIL.

    \b
      opd-check --model S --teacher t=T --loss rkl train-math && opd-rollout --model S ... | opd-score ...
      opd-check --model S --loss fkl --self-teacher opsd --loss-temperature 1.1 --temperature 1.1 train-math
      opd-check --model S --adapter A --engine vllm --json aime24 | jq .checks

    It takes the flags of the stages it guards, spelled as they spell them, samples --limit prompts
    (-n each) through the real opd-rollout, and checks: tokenizers (student vs every teacher),
    rendering (the prompts each one sees), logprobs (engine vs trainer forward, temperature),
    adapter (it reached the engine), self (teacher = student: zero loss and gradient in a real
    opd-train step), topk (the KL error of --topk), stops (EOS, --max-tokens, the grader on gold
    answers). INPUTS: prompts, as opd-rollout reads them. docs/check.md explains each check.
    """
    from .run import run

    return run(config, inputs)


def main(argv: list[str] | None = None):
    """The opd-check console script."""
    console_main(command, sys.argv[1:] if argv is None else argv, "opd-check")


if __name__ == "__main__":
    main()
