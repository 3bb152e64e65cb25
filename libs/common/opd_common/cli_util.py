"""Shared CLI plumbing: logging setup, domain errors -> one clear line, a progress bar on stderr."""

from __future__ import annotations

import functools
import logging
import os
import sys

import click

from .errors import OpdError


def setup_logging(quiet: bool = False) -> None:
    """Logs go to stderr (stdout carries records only); called from main(), never at import."""
    logging.basicConfig(level=logging.WARNING if quiet else logging.INFO, stream=sys.stderr,
                        format="%(name)s: %(message)s")


def handle_errors(func):
    """Turn OpdError (and a closed stdout pipe) into a ClickException with one clear line."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except OpdError as exc:
            raise click.ClickException(str(exc)) from None
        except BrokenPipeError:
            # The reader went away (`| head`, or opd-train done with its --max-steps): stop quietly. os._exit,
            # not sys.exit: a reader thread may still block on stdin, and interpreter shutdown would abort on it.
            sys.stderr.flush()
            os._exit(0)

    return wrapper


def progress(total: int | None, unit: str, quiet: bool, desc: str):
    """A tqdm bar on stderr, shown only when stderr is a terminal and --quiet is off."""
    from tqdm import tqdm

    return tqdm(total=total, unit=unit, desc=desc, file=sys.stderr, dynamic_ncols=True,
                disable=quiet or not sys.stderr.isatty())
