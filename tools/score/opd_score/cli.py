"""opd-score: records -> records with teacher, shift and reward blocks (flags only; work in run.run)."""

from __future__ import annotations

import sys

import click

from opd_common.cli_util import console_main, tool_command

from .config import ScoreConfig


@tool_command("opd-score", ScoreConfig, inputs=True)
def command(config: ScoreConfig, inputs: list[str]) -> int:
    """Add teacher log-probs, Direct-OPD shift tensors and verifier rewards to opd records.

    \b
      opd-rollout --model S -n 4 aime24 | opd-score --teacher t=T | opd-train ...
      opd-score rollouts/ --teacher self=S --teacher-prompt opsd --out scored/
      opd-score rollouts/ --shift post=POST,pre=PRE --shift-k 16 --reward math
      opd-rollout --model S --follow run/ ... | opd-score --follow run/ --teacher self=S \\
          --teacher-prompt opsd | opd-train --model S --out run/ --save-every 1 ...
      opd-score templates          # list the teacher prompt templates

    INPUTS: opd records from '-' (stdin, the default), .jsonl/.jsonl.zst files or shard
    directories. Teachers score each record's response_ids verbatim; records come out in input
    order on stdout (or --out DIR). Log-probs are full-vocabulary log_softmax at temperature 1.
    """
    from opd_common.config import resolved
    from opd_common.streams import ManifestInfo, open_writer

    from .run import run

    sources = []
    info = ManifestInfo(tool="opd-score", config=resolved(config), inputs=sources)
    writer = open_writer(config.out, info, name="scored", shard_size=config.shard_size, encoding=config.encoding,
                         compress=config.compress, overwrite=config.overwrite, resume=config.resume, resumable=True)
    with writer:
        return run(config, inputs, writer, sources=sources)


@tool_command("opd-score templates")
def templates():
    """List the bundled teacher prompt templates (name, kind, fields, file)."""
    from opd_common.prompts import bundled, load

    for name in bundled():
        t = load(name)
        click.echo(f"{name}\t{t.kind}\tfields: {', '.join(t.fields())}\t{t.path}")


def main(argv: list[str] | None = None):
    """`opd-score templates` lists templates; anything else scores records."""
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["templates"]:
        return templates.main(args[1:], prog_name="opd-score templates")
    return console_main(command, args, "opd-score")


if __name__ == "__main__":
    main()
