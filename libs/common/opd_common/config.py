"""One config object per tool: a dataclass whose fields map one to one to click flags.

Each field carries its help text (and optionally a flag name and choices) in its metadata.
``click_options(Config)`` turns the fields into click options whose default is None, so that
``build(Config, config_file, flags)`` can layer dataclass defaults < ``--config file.yaml`` < flags
actually given. The resolved config (``asdict``) is what goes into an output's manifest.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any

import click

from .errors import ConfigError


def opt(default: Any = None, help: str = "", *, flag: str | None = None, short: str | None = None,
        choices: tuple[str, ...] | None = None, multiple: bool = False, cli: bool = True):
    """A config field with its command-line help (use as `x: int = opt(1, "...")`)."""
    meta = {"help": help, "flag": flag, "short": short, "choices": choices, "multiple": multiple, "cli": cli}
    if multiple or isinstance(default, (list, dict)):
        factory = ((lambda d=default: list(d or [])) if multiple or isinstance(default, list)
                   else (lambda d=default: dict(d)))
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _base_type(tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _base_type(args[0]) if args else str
    if origin in (list, tuple):
        return _base_type(typing.get_args(tp)[0])
    return tp


def _flag_name(field: dataclasses.Field) -> str:
    return field.metadata.get("flag") or "--" + field.name.replace("_", "-")


def click_options(cls):
    """Decorator adding one click option per dataclass field of `cls` (in field order)."""
    hints = typing.get_type_hints(cls)

    def decorate(func):
        for field in reversed(dataclasses.fields(cls)):
            meta = field.metadata
            if not meta.get("cli", True):
                continue
            names = [_flag_name(field)] + ([meta["short"]] if meta.get("short") else [])
            tp = _base_type(hints[field.name])
            default = field.default if field.default is not dataclasses.MISSING else None
            help_text = meta.get("help", "")
            if default is not None and not meta.get("multiple"):
                help_text += f"  [default: {default}]"
            kwargs: dict[str, Any] = {"default": None, "help": help_text, "show_default": False}
            if meta.get("multiple"):
                kwargs.update(multiple=True, default=None, type=click.STRING if tp is str else tp)
            elif tp is bool:
                names = [f"{names[0]}/--no-{names[0][2:]}"]
                kwargs["default"] = None
            elif meta.get("choices"):
                kwargs["type"] = click.Choice(meta["choices"])
            elif tp in (int, float, str):
                kwargs["type"] = tp
            func = click.option(*names, field.name, **kwargs)(func)
        return func

    return decorate


def build(cls, config_file: str | None, flags: dict[str, Any]):
    """Resolve defaults < YAML file < given flags into an instance of `cls` (validated)."""
    names = {f.name for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    if config_file:
        import yaml

        try:
            loaded = yaml.safe_load(Path(config_file).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"--config {config_file}: cannot read it ({exc})") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"--config {config_file}: expected a mapping of option names to values")
        for key, value in loaded.items():
            name = key.replace("-", "_")
            if name not in names:
                raise ConfigError(f"--config {config_file}: unknown option {key!r}")
            values[name] = value
    for key, value in flags.items():
        if key in names and value is not None and value != ():
            values[key] = list(value) if isinstance(value, tuple) else value
    try:
        return cls(**values)
    except TypeError as exc:
        raise ConfigError(str(exc)) from None


def resolved(config) -> dict[str, Any]:
    """The resolved config as plain data, for manifests."""
    return dataclasses.asdict(config)
