"""How a run names its teachers on the command line: --teacher NAME=MODEL[@REVISION][+ADAPTER] and
--shift post=MODEL,pre=MODEL (opd-score and opd-check parse them alike)."""

from __future__ import annotations

from dataclasses import dataclass

from opd_common.errors import ConfigError


@dataclass(frozen=True)
class TeacherSpec:
    """--teacher NAME=MODEL[@REVISION][+ADAPTER]"""

    name: str
    model: str
    revision: str | None = None
    adapter: str | None = None

    @classmethod
    def parse(cls, text: str, flag: str = "--teacher") -> TeacherSpec:
        name, sep, rest = text.partition("=")
        if not sep or not name or not rest:
            raise ConfigError(f"{flag} {text!r}: expected NAME=MODEL[@REVISION][+ADAPTER]")
        rest, _, adapter = rest.partition("+")
        model, _, revision = rest.partition("@")
        return cls(name=name, model=model, revision=revision or None, adapter=adapter or None)


def parse_shift(text: str) -> tuple[str, str]:
    """--shift post=MODEL,pre=MODEL -> (post, pre)."""
    parts = dict(p.partition("=")[::2] for p in text.split(","))
    if set(parts) != {"post", "pre"} or not all(parts.values()):
        raise ConfigError(f"--shift {text!r}: expected post=MODEL,pre=MODEL")
    return parts["post"], parts["pre"]
