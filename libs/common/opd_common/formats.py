"""Prompt formats: which column of a row is the prompt, and how it becomes chat messages (README, Inputs).

- plain: a text field (``problem``, else ``prompt``, ``question``; or ``--prompt-field``) rendered by
  ``--template`` into one user message (its ``{problem}`` reads the field).
- chat: a conversational column (``prompt`` or ``messages``, or ``--prompt-field``): a list of
  ``{role, content}`` messages (TRL's conversational format; also datasets' columnar form of a
  ``Sequence`` of them, ``{role: [...], content: [...]}``), used as they are, system messages kept:
  the conversation up to its last user turn (a ``messages`` column's final assistant answer is dropped).
- verl: verl's layout, a chat ``prompt`` column plus ``reward_model.ground_truth`` (the gold answer,
  copied to the row's ``answer`` when it has none) and ``extra_info.index`` (the prompt id when the row
  has no ``--id-field``).

A custom --template that does not use ``{problem}`` is filled from the row as it is (format "template").
The chat template is applied once to the messages, by the tool (models.render_messages).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import RecordError
from .records import Where

DEFAULT_FIELD = "problem"
CANDIDATES = ("problem", "prompt", "messages", "question")  # looked for in this order (default --prompt-field)


@dataclass(frozen=True)
class PromptFormat:
    kind: str  # "plain" | "chat" | "verl" | "template"
    field: str | None

    def describe(self) -> str:
        if self.kind == "plain":
            return f"plain: text field '{self.field}' rendered with --template"
        if self.kind == "chat":
            return f"chat: messages in '{self.field}' as they are, chat template applied once"
        if self.kind == "verl":
            return ("verl: messages in 'prompt', gold answer from reward_model.ground_truth, "
                    "id from extra_info.index")
        return "template: --template filled from the row's fields"


def as_messages(value: Any) -> list[dict] | None:
    """A conversation as a list of message dicts, or None. Besides a list of {role, content} dicts, takes the
    columnar form datasets gives a ``Sequence`` of structs (a card's ``sequence:`` feature): {role: [...],
    content: [...]}."""
    if isinstance(value, list):
        return value if value and all(isinstance(m, dict) and "role" in m for m in value) else None
    if isinstance(value, dict) and isinstance(value.get("role"), list) and value["role"]:
        columns = {k: v for k, v in value.items() if isinstance(v, list) and len(v) == len(value["role"])}
        if len(columns) == len(value):
            return [dict(zip(columns, m, strict=True)) for m in zip(*columns.values(), strict=True)]
    return None


def is_messages(value: Any) -> bool:
    return as_messages(value) is not None


def is_verl(row: dict) -> bool:
    reward = row.get("reward_model")
    return is_messages(row.get("prompt")) and isinstance(reward, dict) and "ground_truth" in reward


def detect(row: dict, prompt_field: str, where: Where) -> PromptFormat:
    """The row's format; a row with no usable column is an error naming the row, its columns and the flag."""
    names = CANDIDATES if prompt_field == DEFAULT_FIELD else (prompt_field,)
    for name in names:
        value = row.get(name)
        if isinstance(value, str):
            return PromptFormat("plain", name)
        if is_messages(value):
            return PromptFormat("verl" if name == "prompt" and is_verl(row) else "chat", name)
        if name == prompt_field != DEFAULT_FIELD and name in row:
            raise RecordError(f"{where.at}: --prompt-field '{name}' is a {type(value).__name__}, neither text nor "
                              "a list of {role, content} messages")
    wanted = (f"'{prompt_field}' (--prompt-field)" if prompt_field != DEFAULT_FIELD else
              "a text field (problem, prompt, question) or a conversation (prompt, messages: {role, content} lists)")
    raise RecordError(f"{where.at} has no prompt: expected {wanted}; its columns: {', '.join(sorted(row)) or 'none'}; "
                      "name the prompt column with --prompt-field (or fill --template from the columns)")


def _text(content: Any, where: Where, field: str) -> str:
    """A message's content: a string, or a list of parts of which the text ones are joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        return "".join(p.get("text") or "" for p in content if p.get("type", "text") == "text")
    raise RecordError(f"{where.at}: a message in '{field}' has content of type {type(content).__name__} "
                      "(expected text, or a list of {type: text, text} parts)")


def chat_messages(row: dict, fmt: PromptFormat, where: Where) -> list[dict[str, str]]:
    """The conversation up to and including its last user turn, as {role, content} dicts."""
    messages = [{"role": str(m["role"]), "content": _text(m.get("content"), where, fmt.field)}
                for m in as_messages(row[fmt.field]) or []]
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if not users:
        roles = ", ".join(dict.fromkeys(m["role"] for m in messages))
        raise RecordError(f"{where.at}: the conversation in '{fmt.field}' has no user turn (roles: {roles}); "
                          "a prompt needs one (or name a text column with --prompt-field)")
    return messages[:users[-1] + 1]


def verl_answer(row: dict) -> dict:
    """A verl row with reward_model.ground_truth copied to 'answer' (when it has none): what opd-score's
    --reward and opd-eval's --answer-field read."""
    if "answer" in row or not is_verl(row):
        return row
    return {**row, "answer": row["reward_model"]["ground_truth"]}


def row_id(row: dict, id_field: str) -> str | None:
    """The prompt id from --id-field, else verl's extra_info.index; None when neither is there."""
    if row.get(id_field) is not None:
        return str(row[id_field])
    extra = row.get("extra_info")
    if isinstance(extra, dict) and extra.get("index") is not None:
        return str(extra["index"])
    return None
