"""Shared CLI plumbing: logging setup, domain errors -> one clear line, a progress bar on stderr."""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading

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



_VLLM = {"engines": [], "used": False}


def vllm_started(llm) -> None:
    """Note a vllm.LLM this process built, so that console_main shuts it down before leaving."""
    _VLLM["engines"].append(llm)
    _VLLM["used"] = True


def close_vllm(llm) -> None:
    """Stop a vllm.LLM's engine-core processes now rather than at interpreter exit."""
    if llm is None:
        return
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as exc:  # pragma: no cover - other vLLM versions name it differently
        logging.getLogger("opd").debug("vLLM shutdown: %s", exc)
    if llm in _VLLM["engines"]:
        _VLLM["engines"].remove(llm)


def console_main(command, args: list[str], prog_name: str):
    """Run a click command as a console script. When vLLM ran in this process, or a daemon thread is
    still alive (an input reader blocked on stdin after opd-train spent its --max-steps), shut vLLM's
    engines down and leave with os._exit once the output is flushed: at interpreter teardown such
    threads abort the process (SIGABRT: vLLM's "terminate called without an active exception", or
    "could not acquire lock for <stdin> at interpreter shutdown") after all the work was done,
    turning a finished run into a failed one."""
    try:
        command.main(args, prog_name=prog_name)
        code = 0
    except SystemExit as exc:
        code = exc.code
    if not _VLLM["used"] and not any(t.daemon and t.is_alive() for t in threading.enumerate()):
        raise SystemExit(code)
    for llm in list(_VLLM["engines"]):
        close_vllm(llm)
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (BrokenPipeError, ValueError):
            pass
    os._exit(code or 0)
