"""Commands of tools that are planned but not built yet: they say so and exit non-zero."""

from __future__ import annotations

import click


def unbuilt_command(tool: str, purpose: str, issue: str):
    """A click command that refuses to run, naming what the tool will do and where it is tracked."""

    @click.command(name=tool, context_settings={"help_option_names": ["-h", "--help"],
                                                "ignore_unknown_options": True})
    @click.argument("args", nargs=-1, type=click.UNPROCESSED)
    def main(args):
        raise click.ClickException(f"{tool} is not built yet ({purpose}; tracked in {issue}); it does nothing")

    main.help = f"NOT BUILT YET: {purpose}. Tracked in {issue}. Running it exits with an error."
    return main
