"""opd-publish: verified, immutable checkpoint publishing (flags only; work in publish.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from opd_common.cli_util import CONTEXT, setup_logging, tool_command

REPO_HELP = "hf://ORG/NAME, ORG/NAME (the Hub) or file:///DIR (a mirror with the same layout)."


def _emit(records) -> None:
    for rec in records:
        sys.stdout.write(json.dumps(rec, sort_keys=True) + "\n")
    sys.stdout.flush()


def _setup_logging(quiet: bool) -> None:
    import logging

    setup_logging(quiet)
    for name in ("httpx", "httpx2", "huggingface_hub"):  # one line per HTTP request is noise here
        logging.getLogger(name).setLevel(logging.WARNING)


def _target(spec: str, revision: str | None, quiet: bool):
    from .targets import parse_target

    return parse_target(spec, revision, quiet=quiet)


@click.group(name="opd-publish", context_settings=CONTEXT)
def command():
    """Publish opd-train checkpoints, verified and immutable, to the Hub or a file:// mirror.

    \b
      opd-train scored/ --model S --out run/ --max-steps 100 --batch-groups 8 && opd-publish push run/ --repo hf://org/run1
      opd-publish push run/ --repo file:///mnt/mirror/run1 --checkpoints latest --with-resume-state
      opd-publish verify hf://org/run1 --local run/ | jq -c 'select(.ok | not)'
      opd-publish pull hf://org/run1 --checkpoint 100 ckpt/ && opd-eval run --model M --adapter ckpt/ --bench aime24

    Each checkpoint-NNNNNN/ gets sha256sums.txt; it enters checkpoint_index.json (the only record
    of completion) after its remote files were listed and their sizes and sha256 checked. Pushing
    the same content again is a no-op; other content under a published step is an error. Records
    (one JSON line per checkpoint) go to stdout, logs to stderr.
    """


@tool_command("push", group=command)
@click.argument("run_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--repo", required=True, help=REPO_HELP)
@click.option("--checkpoints", default="all", show_default=True, help="'all', 'latest' or steps such as 50,100.")
@click.option("--with-resume-state", is_flag=True, help="Also publish the latest checkpoint's trainer_state.pt "
              "(optimizer, scheduler, RNG) under latest-resume/.")
@click.option("--private", is_flag=True, help="Create the Hub repo private (hf:// only).")
@click.option("--revision", default=None, help="Branch to commit to (hf:// only; default main).")
@click.option("--quiet", is_flag=True, help="Only warnings and errors on stderr.")
def push(run_dir, repo, checkpoints, with_resume_state, private, revision, quiet):
    """Publish RUN_DIR's checkpoints to --repo (opd-publish push run/ --repo hf://org/run1 | jq .status)."""
    from .publish import push as run_push

    _setup_logging(quiet)
    _emit(run_push(run_dir, _target(repo, revision, quiet), checkpoints, with_resume_state, private))


@tool_command("verify", group=command)
@click.argument("target")
@click.option("--local", type=click.Path(file_okay=False, path_type=Path), help="Also compare with this run dir.")
@click.option("--revision", default=None, help="Branch to check (hf:// only).")
@click.option("--quiet", is_flag=True, help="Only warnings and errors on stderr.")
def verify(target, local, revision, quiet):
    """Check every indexed checkpoint's files on TARGET (opd-publish verify hf://org/run1 | jq .ok)."""
    from .publish import VerifyError
    from .publish import verify as run_verify

    _setup_logging(quiet)
    try:
        _emit(run_verify(_target(target, revision, quiet), local))
    except VerifyError as exc:
        _emit(exc.results)
        raise


@tool_command("pull", group=command)
@click.argument("target")
@click.argument("dir", type=click.Path(path_type=Path))
@click.option("--checkpoint", required=True, help="Step number, or 'latest' (the highest published step).")
@click.option("--revision", default=None, help="Branch to read (hf:// only).")
@click.option("--quiet", is_flag=True, help="Only warnings and errors on stderr.")
def pull(target, dir, checkpoint, revision, quiet):
    """Fetch a published checkpoint into DIR, every sha256 checked (opd-publish pull T --checkpoint 100 c/ | jq .)."""
    from .publish import pull as run_pull

    _setup_logging(quiet)
    _emit([run_pull(_target(target, revision, quiet), checkpoint, dir)])


def main(argv: list[str] | None = None):
    return command.main(argv, prog_name="opd-publish")


if __name__ == "__main__":
    main()
