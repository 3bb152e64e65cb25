"""opd-train: scored records -> LoRA adapter checkpoints (flags only; work in run.run)."""

from __future__ import annotations

import sys

import click

from opd_common.cli_util import console_main, handle_errors, setup_logging
from opd_common.config import build, click_options

from .config import TrainConfig


@click.command(name="opd-train", context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.argument("inputs", nargs=-1)
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="YAML file of options; flags override it.")
@click_options(TrainConfig)
@handle_errors
def train(inputs, config_file, **flags):
    """Train a LoRA adapter on scored opd records, for exactly --max-steps optimizer steps.

    \b
      opd-rollout --model S -n 4 aime24 | opd-score --teacher t=T | opd-train --model S --out run/ --max-steps 100 --batch-groups 8
      opd-train scored/ --model S --loss fkl --self-teacher opsd --out run/ --max-steps 100 --batch-size 32
      opd-train scored/ --model S --loss shift --out run/ --max-steps 100 --batch-groups 64 --resume

    INPUTS: scored records from '-' (stdin, the default), .jsonl/.jsonl.zst files or shard
    directories, read lazily: a step runs as soon as its batch is complete. The run directory
    gets config.json, metrics.jsonl and checkpoint-NNNNNN/ folders (peft adapters) with a
    `latest` pointer; --resume continues exactly where the last checkpoint left off.
    """
    from .publishing import PublishOnSave
    from .run import run

    config = build(TrainConfig, config_file, flags)
    setup_logging(config.quiet)
    on_save = PublishOnSave(config.publish, config.quiet) if config.publish else None  # opd-publish push
    raise SystemExit(run(config, list(inputs) or ["-"], on_save=on_save))


def main(argv: list[str] | None = None):
    return console_main(train, sys.argv[1:] if argv is None else argv, "opd-train")


if __name__ == "__main__":
    main()
