"""opd-train: scored records -> LoRA adapter checkpoints (flags only; work in run.run)."""

from __future__ import annotations

import sys

from opd_common.cli_util import console_main, tool_command

from .config import TrainConfig


@tool_command("opd-train", TrainConfig, inputs=True)
def command(config: TrainConfig, inputs: list[str]) -> int:
    """Train a LoRA adapter on scored opd records, for exactly --max-steps optimizer steps.

    \b
      opd-rollout --model S -n 4 aime24 | opd-score --teacher t=T \\
          | opd-train --model S --out run/ --max-steps 100 --batch-groups 8
      opd-train scored/ --model S --loss fkl --self-teacher opsd --out run/ --max-steps 100 --batch-size 32
      opd-train scored/ --model S --loss shift --out run/ --max-steps 100 --batch-groups 64 --resume

    INPUTS: scored records from '-' (stdin, the default), .jsonl/.jsonl.zst files or shard
    directories, read lazily: a step runs as soon as its batch is complete. The run directory
    gets config.json, metrics.jsonl and checkpoint-NNNNNN/ folders (peft adapters) with a
    `latest` pointer; --resume continues exactly where the last checkpoint left off.
    """
    from .publishing import PublishOnSave
    from .run import run

    on_save = PublishOnSave(config.publish, config.quiet) if config.publish else None  # opd-publish push
    return run(config, inputs or ["-"], on_save=on_save)


def main(argv: list[str] | None = None):
    return console_main(command, sys.argv[1:] if argv is None else argv, "opd-train")


if __name__ == "__main__":
    main()
