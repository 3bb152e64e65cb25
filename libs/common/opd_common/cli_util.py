"""Shared CLI plumbing: the one `tool_command` decorator every opd CLI is built with (config flags,
`--config`, domain errors -> one clear line), logging setup, a progress bar on stderr, `console_main`."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import threading

import click

from .errors import OpdError

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


def setup_logging(quiet: bool = False) -> None:
    """Logs go to stderr (stdout carries records only); called from main(), never at import."""
    logging.basicConfig(level=logging.WARNING if quiet else logging.INFO, stream=sys.stderr,
                        format="%(name)s: %(message)s")


def leave_quietly() -> None:
    """The reader went away (`| head`, or opd-train done with its --max-steps): stop quietly, from any thread (a
    record writer's too: the main thread may be blocked reading input that will not come). os._exit, not
    sys.exit: a reader thread may still block on stdin, and interpreter shutdown would abort on it. vLLM's
    engine-core processes go first: left behind, they would hold the GPU's memory; so do the processes
    registered with `stopped_on_leaving` (opd-score's data-parallel workers, each holding its teachers)."""
    for llm in list(_VLLM["engines"]):
        close_vllm(llm)
    for stop in list(_ON_LEAVING):
        stop()
    sys.stderr.flush()
    os._exit(0)


def handle_errors(func):
    """Turn OpdError (and a closed stdout pipe) into a ClickException with one clear line."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except OpdError as exc:
            raise click.ClickException(str(exc)) from None
        except BrokenPipeError:
            leave_quietly()

    return wrapper


def tool_command(name: str, config_cls=None, *, inputs: bool = False, group: click.Group | None = None):
    """Make `func` an opd click command (or a subcommand of `group`) named `name`, with -h/--help and
    domain errors turned into one line. With `config_cls` the command gets one flag per config field
    plus `--config FILE.yaml` (flags override it), logging is set up from the config's `quiet`, and
    `func(config)` is called (`func(config, inputs)` with `inputs`: the INPUTS arguments as a list);
    without, `func` gets its own click parameters. An int that `func` returns is the exit status.
    The docstring of `func` is the command's --help."""
    from .config import build, click_options

    def decorate(func):
        @functools.wraps(func)
        def callback(*args, **params):
            if config_cls is None:
                result = func(*args, **params)
            else:
                positional = [list(params.pop("inputs"))] if inputs else []
                config = build(config_cls, params.pop("config_file"), params)
                setup_logging(config.quiet)
                result = func(config, *positional)
            if isinstance(result, int):
                raise SystemExit(result)

        command = handle_errors(callback)
        if config_cls is not None:
            command = click_options(config_cls)(command)
            command = click.option("--config", "config_file", type=click.Path(dir_okay=False),
                                   help="YAML file of options; flags override it.")(command)
            if inputs:
                command = click.argument("inputs", nargs=-1)(command)
        make = group.command if group is not None else click.command
        return make(name=name, context_settings=CONTEXT)(command)

    return decorate


def progress(total: int | None, unit: str, quiet: bool, desc: str):
    """A tqdm bar on stderr, shown only when stderr is a terminal and --quiet is off."""
    from tqdm import tqdm

    return tqdm(total=total, unit=unit, desc=desc, file=sys.stderr, dynamic_ncols=True,
                disable=quiet or not sys.stderr.isatty())



_VLLM = {"engines": [], "used": False}
_ON_LEAVING: list = []  # callables leave_quietly runs before os._exit


@contextlib.contextmanager
def stopped_on_leaving(stop):
    """Within the block, `leave_quietly` calls `stop()` before the process ends: os._exit runs no finally
    block, so child processes the block would have stopped on its way out are stopped here instead."""
    _ON_LEAVING.append(stop)
    try:
        yield
    finally:
        _ON_LEAVING.remove(stop)


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
