"""Prompt rows in, rendered user messages out.

An input is ``-`` (stdin), a JSONL(.zst) file, a shard directory, or the name of a bundled
dataset (``aime24``, ``math500``, ...). Each row is a JSON object; its ``--id-field`` (default
``id``) becomes the prompt id, else ``SOURCE-LINE``.
"""

from __future__ import annotations

import string
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opd_common.datasets import BUNDLED, bundled_path
from opd_common.errors import RecordError, StreamError
from opd_common.records import Where
from opd_common.streams import InputSource, iter_inputs, resolve_input


@dataclass
class PromptRow:
    prompt_id: str
    row: dict[str, Any]
    where: Where


def resolve_prompt_specs(specs: list[str]) -> list[str]:
    """Map bundled dataset names to their files; leave paths and '-' alone; reject unknown names."""
    resolved = []
    for spec in specs or ["-"]:
        if spec == "-" or Path(spec).exists():
            resolved.append(spec)
        elif spec in BUNDLED or not any(c in spec for c in "/.\\"):
            resolved.append(str(bundled_path(spec)))  # raises "unknown benchmark ... did you mean"
        else:
            resolve_input(spec)  # raises "input ... does not exist"
    return resolved


def iter_prompt_rows(specs: list[str], id_field: str, sources: list[InputSource] | None = None,
                     limit: int | None = None) -> Iterator[PromptRow]:
    """Rows of already-resolved specs (see resolve_prompt_specs), with unique prompt ids."""
    seen: dict[str, Where] = {}
    count = 0
    for row, where in iter_inputs(specs, check=False, sources=sources):
        if not isinstance(row, dict):
            raise RecordError(f"line {where.number} of {where.source}: expected a JSON object, got {type(row).__name__}")
        prompt_id = str(row[id_field]) if row.get(id_field) is not None else f"{Path(where.source).stem}-{where.number}"
        if prompt_id in seen:
            raise RecordError(
                f"line {where.number} of {where.source}: prompt id {prompt_id!r} repeats line {seen[prompt_id].number} "
                f"of {seen[prompt_id].source} (ids in --id-field '{id_field}' must be unique)"
            )
        seen[prompt_id] = where
        yield PromptRow(prompt_id, row, where)
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
                f"line {where.number} of {where.source} has no '{wanted}' field "
                f"(set --prompt-field or --template to match the rows' fields: {', '.join(sorted(row))})"
            )
    try:
        return template.format(**values)
    except (IndexError, KeyError, ValueError, AttributeError) as exc:
        raise StreamError(f"--template cannot be filled from line {where.number} of {where.source} ({exc})") from None
