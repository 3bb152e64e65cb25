"""opd-rollout: prompts -> sampled records (click flags only; the work is in run.run)."""

from __future__ import annotations

import sys

from opd_common.cli_util import console_main, tool_command

from .config import RolloutConfig


@tool_command("opd-rollout", RolloutConfig, inputs=True)
def command(config: RolloutConfig, inputs: list[str]) -> int:
    """Sample responses to prompts and print one opd record per sample.

    \b
      opd-rollout --model M -n 4 aime24 | opd-score --teacher t=T | opd-train ...
      opd-rollout --model M --engine hf -n 2 prompts.jsonl --out rollouts/

    INPUTS: prompt JSONL files (.jsonl or .jsonl.zst), shard directories, '-' for stdin
    (the default), parquet files or folders (verl's layout too), datasets save_to_disk folders
    (DIR:SPLIT for a DatasetDict), hf://datasets/ORG/NAME[@REV][:SPLIT], or a bundled dataset
    name: aime24, aime25, hmmt25, math500, train-aime, train-math. Records go to stdout (or
    --out DIR); progress and logs go to stderr.
    """
    from opd_common.config import resolved
    from opd_common.streams import ManifestInfo, open_writer

    from .run import run

    sources = []
    info = ManifestInfo(tool="opd-rollout", config=resolved(config), inputs=sources)
    writer = open_writer(config.out, info, name="rollouts", shard_size=config.shard_size,
                         encoding=config.encoding, compress=config.compress, overwrite=config.overwrite)
    with writer:
        return run(config, inputs, writer, sources=sources)


def main(argv: list[str] | None = None):
    """The opd-rollout console script (see opd_common.cli_util.console_main)."""
    console_main(command, sys.argv[1:] if argv is None else argv, "opd-rollout")


if __name__ == "__main__":
    main()
