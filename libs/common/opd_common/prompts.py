"""Prompts, the one template system (docs/architecture.md, Templates).

The student's prompt: an input is ``-`` (stdin), a JSONL(.zst) file, a shard directory, a table (parquet,
a datasets save_to_disk folder, ``hf://datasets/ORG/NAME@REV:SPLIT``: opd_common.tables) or the name of a
bundled dataset (``aime24``, ``math500``, ...). Each row is a JSON object; its ``--id-field`` (default ``id``,
else verl's ``extra_info.index``) becomes the prompt id, else ``SOURCE-LINE``. The row's format
(opd_common.formats: a plain text field, a conversation, verl's layout) decides its chat messages (Prompter):
``--template`` (a Python format string over the row, default DEFAULT_TEMPLATE: the OPSD student / evaluation
prompt) renders a plain field into the user message (render_message); a conversation is used as it is.

The teacher's prompt: privileged context rendered from a record's `example` fields. A teacher template is a
file: ``*.j2``/``*.jinja`` are Jinja templates, anything else is a Python ``str.format`` string (``{{}}``
renders as ``{}``). ``--teacher-prompt`` (opd-score) and ``--self-teacher`` (opd-train) take a bundled name
(``opsd``, ``student``; the files in opd_common/templates/) or a path (load). The rendered text is the
teacher's *user message*; the chat template is applied to it once, with ``enable_thinking`` from
``--teacher-thinking``. Bundled ``opsd`` reproduces the OPSD teacher message exactly: the problem, the
reference solution between "=== Reference Solution Begin/End ===", the transition prompt and the
boxed-answer instruction.
"""

from __future__ import annotations

import logging
import string
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opd_common.datasets import BUNDLED, bundled_path
from opd_common.errors import ConfigError, RecordError, StreamError

if TYPE_CHECKING:  # streams and records import numpy: not at --help time
    from opd_common.records import Where
    from opd_common.streams import InputSource

AS_IS = "as-is"


# ------------------------------------------------------------------------- bundled templates


def bundled_dir() -> Path:
    return Path(str(resources.files("opd_common") / "templates"))


def bundled() -> dict[str, Path]:
    return {p.name.split(".")[0]: p for p in sorted(bundled_dir().iterdir()) if p.is_file()}


# The OPSD student / evaluation prompt (bundled "student"), a Python format string over the row.
DEFAULT_TEMPLATE = (bundled_dir() / "student.fmt").read_text(encoding="utf-8")


def read_template(spec: str) -> str:
    """--template's value: the text of @FILE, else the format string itself."""
    if not spec.startswith("@"):
        return spec
    try:
        with open(spec[1:], encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise ConfigError(f"--template {spec}: cannot read the file ({exc.strerror})") from None


# ------------------------------------------------------------------------- the student's prompt


@dataclass
class PromptRow:
    prompt_id: str
    row: dict[str, Any]
    where: Where


def resolve_prompt_specs(specs: list[str]) -> list[str]:
    """Map bundled dataset names to their files; leave paths and '-' alone; reject unknown names."""
    from opd_common.streams import resolve_input
    from opd_common.tables import parse_table_spec

    resolved = []
    for spec in specs or ["-"]:
        if spec == "-" or Path(spec).exists() or parse_table_spec(spec) is not None:
            resolved.append(spec)
        elif spec in BUNDLED or not any(c in spec for c in "/.\\"):
            resolved.append(str(bundled_path(spec)))  # raises "unknown benchmark ... did you mean"
        else:
            resolve_input(spec)  # raises "input ... does not exist"
    return resolved


def iter_prompt_rows(specs: list[str], id_field: str, sources: list[InputSource] | None = None,
                     limit: int | None = None) -> Iterator[PromptRow]:
    """Rows of already-resolved specs (see resolve_prompt_specs), with unique prompt ids."""
    from opd_common.formats import row_id, verl_answer
    from opd_common.streams import iter_inputs

    seen: dict[str, Where] = {}
    count = 0
    for row, where in iter_inputs(specs, check=False, sources=sources):
        if not isinstance(row, dict):
            raise RecordError(f"{where.at}: expected a JSON object, got {type(row).__name__}")
        prompt_id = row_id(row, id_field) or f"{Path(where.source).stem}-{where.number}"
        if prompt_id in seen:
            raise RecordError(
                f"{where.at}: prompt id {prompt_id!r} repeats {seen[prompt_id].at} "
                f"(ids in --id-field '{id_field}' must be unique)"
            )
        seen[prompt_id] = where
        yield PromptRow(prompt_id, verl_answer(row), where)
        count += 1
        if limit is not None and count >= limit:
            return


def template_fields(template: str) -> list[str]:
    return [name for _, name, _, _ in string.Formatter().parse(template) if name]


def render_message(template: str, row: dict[str, Any], prompt_field: str, where: Where) -> str:
    """Fill the template from the row; the default template's {problem} reads --prompt-field."""
    values = dict(row)
    if prompt_field != "problem" and prompt_field in row:
        values["problem"] = row[prompt_field]
    for name in template_fields(template):
        key = name.split(".")[0].split("[")[0]
        if key not in values:
            wanted = prompt_field if key == "problem" else key
            raise RecordError(
                f"{where.at} has no '{wanted}' field "
                f"(set --prompt-field or --template to match the rows' fields: {', '.join(sorted(row))})"
            )
    try:
        return template.format(**values)
    except (IndexError, KeyError, ValueError, AttributeError) as exc:
        raise StreamError(f"--template cannot be filled from {where.at} ({exc})") from None


class Prompter:
    """Prompt rows -> the chat messages the chat template is applied to, in the format each row is in
    (opd_common.formats); the format is logged on stderr once per input and format."""

    def __init__(self, template: str, prompt_field: str, tool: str):
        self.template, self.prompt_field = template, prompt_field
        self.uses_problem = "problem" in {name.split(".")[0].split("[")[0] for name in template_fields(template)}
        self.log = logging.getLogger(tool)
        self.logged: set[str] = set()

    def messages(self, prow: PromptRow) -> list[dict[str, str]]:
        from opd_common.formats import PromptFormat, chat_messages, detect

        fmt = detect(prow.row, self.prompt_field, prow.where) if self.uses_problem else PromptFormat("template", None)
        if fmt.describe() not in self.logged:
            self.logged.add(fmt.describe())
            self.log.info("prompt format %s (first seen at %s)", fmt.describe(), prow.where.at)
        if fmt.kind in ("chat", "verl"):
            return chat_messages(prow.row, fmt, prow.where)
        text = render_message(self.template, prow.row, fmt.field or self.prompt_field, prow.where)
        return [{"role": "user", "content": text}]


# ------------------------------------------------------------------------- the teacher's prompt


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
        return sorted({name.split(".")[0].split("[")[0] for name in template_fields(self.text)})

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


def load(spec: str) -> Template:
    """A bundled template by name, or a template file by path."""
    path = bundled().get(spec) or Path(spec)
    if not path.is_file():
        raise ConfigError(f"--teacher-prompt {spec}: neither a bundled template ({', '.join(bundled())}) "
                          "nor a file; list them with: opd-score templates")
    kind = "jinja" if path.suffix in (".j2", ".jinja") else "format"
    return Template(name=spec if spec in bundled() else str(path), path=path, kind=kind,
                    text=path.read_text(encoding="utf-8"))
