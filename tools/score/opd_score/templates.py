"""Teacher prompt templates: privileged context rendered from a record's `example` fields.

A template is a file: ``*.j2``/``*.jinja`` are Jinja templates, anything else is a Python
``str.format`` string (``{{}}`` renders as ``{}``). ``--teacher-prompt`` takes a bundled name
(``opsd``, ``student``) or a path. The rendered text is the teacher's *user message*; the chat
template is applied to it once, with ``enable_thinking`` from ``--teacher-thinking``.

Bundled ``opsd`` reproduces the OPSD teacher message exactly (DESIGN.md section 6): the problem,
the reference solution between "=== Reference Solution Begin/End ===", the transition prompt and
the boxed-answer instruction.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from opd_common.errors import ConfigError, RecordError

AS_IS = "as-is"


@dataclass(frozen=True)
class Template:
    name: str
    path: Path
    kind: str  # "format" | "jinja"
    text: str

    def fields(self) -> list[str]:
        if self.kind == "jinja":
            import jinja2.meta

            return sorted(jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(self.text)))
        return sorted({name.split(".")[0].split("[")[0] for _, name, _, _ in string.Formatter().parse(self.text) if name})

    def render(self, example: dict[str, Any], where: str) -> str:
        missing = [f for f in self.fields() if f not in example]
        if missing:
            raise RecordError(f"{where}: example has no '{missing[0]}' field, which --teacher-prompt {self.name} "
                              f"needs (fields present: {', '.join(sorted(example)) or 'none'})")
        if self.kind == "jinja":
            import jinja2

            return jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True) \
                .from_string(self.text).render(**example)
        return self.text.format(**example)


def bundled_dir() -> Path:
    return Path(str(resources.files("opd_score") / "templates"))


def bundled() -> dict[str, Path]:
    return {p.name.split(".")[0]: p for p in sorted(bundled_dir().iterdir()) if p.is_file()}


def load(spec: str) -> Template:
    """A bundled template by name, or a template file by path."""
    path = bundled().get(spec) or Path(spec)
    if not path.is_file():
        raise ConfigError(f"--teacher-prompt {spec}: neither a bundled template ({', '.join(bundled())}) "
                          "nor a file; list them with: opd-score templates")
    kind = "jinja" if path.suffix in (".j2", ".jinja") else "format"
    return Template(name=spec if spec in bundled() else str(path), path=path, kind=kind,
                    text=path.read_text(encoding="utf-8"))
