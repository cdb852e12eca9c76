"""Input row formats (docs/data_formats.md): one record of a user's file or dataset -> one internal row.

    spec = RowSpec.build("prompt_completion", {"prompt": "question", "completion": "answer"})
    row, reason = spec.convert({"question": "2+2?", "answer": "4"})
    # row = {"messages": [{"role": "user", ...}, {"role": "assistant", ...}]}; reason None

Formats and their fields (a column name may be remapped with `dataset.fields`):
  messages           messages (list of {role, content}, or its JSON text)
  prompt_completion  prompt, completion, [system]
  alpaca             instruction, output, [input], [system]   (input is appended to the instruction)
  text               text    (raw text, every token supervised: pretraining-style)
  auto               per record, the first whose required fields are present, in the order above
A chat row is {"messages": [...]}; a text row is {"text": str}. A record that cannot be used gives
(None, "malformed: ..." / "empty: ...") naming the field, so `dllmflow prepare` can report it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from dllmflow.errors import UserError

ROLES = ("system", "user", "assistant")
REQUIRED = {
    "messages": ("messages",),
    "prompt_completion": ("prompt", "completion"),
    "alpaca": ("instruction", "output"),
    "text": ("text",),
}
OPTIONAL = {"messages": (), "prompt_completion": ("system",), "alpaca": ("input", "system"), "text": ()}
FORMATS = ("auto", *REQUIRED)
# A chat row nests 3 levels ([{"role", "content"}]); far deeper is not a row, and json would recurse
# once per level (a RecursionError at ~1000).
MAX_JSON_DEPTH = 100
TOO_DEEP = f"malformed: JSON nested deeper than {MAX_JSON_DEPTH} levels"
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_BRACKET = re.compile(r"[\[\]{}]")


def json_depth_over(text: str, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether the JSON `text` nests arrays/objects deeper than `limit`, without parsing it (brackets
    inside strings do not count); linear time, no recursion."""
    if text.count("[") + text.count("{") <= limit:  # the common case: too few brackets to matter
        return False
    depth = 0
    for m in _BRACKET.finditer(_JSON_STRING.sub('""', text)):
        depth += 1 if m.group() in "[{" else -1
        if depth > limit:
            return True
    return False


def loads_row(text: str) -> tuple[Any, str | None]:
    """(decoded JSON, None), or (None, reason) for text that is not JSON or nests too deep."""
    if json_depth_over(text):
        return None, TOO_DEEP
    try:
        return json.loads(text), None
    except json.JSONDecodeError:
        return None, "malformed: not JSON"


def check_messages(value: Any) -> tuple[list[dict] | None, str | None]:
    """(clean messages, None) for a usable chat, else (None, reason). A JSON string is decoded first
    (our own shards and regenerated data store messages as JSON text)."""
    if isinstance(value, str):
        value, reason = loads_row(value)
        if reason == TOO_DEEP:
            return None, reason
        if reason:
            return None, "malformed: messages is a string that is not JSON"
    if hasattr(value, "tolist"):  # numpy arrays from parquet/pandas
        value = value.tolist()
    if value is None:
        return None, "malformed: missing messages"
    if not isinstance(value, list | tuple):
        return None, f"malformed: messages is {type(value).__name__}, not a list"
    if not value:
        return None, "empty: no messages"
    out = []
    for m in value:
        if not isinstance(m, dict):
            return None, "malformed: a message is not a {role, content} mapping"
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            return None, f"malformed: role {role!r} not in {'/'.join(ROLES)}"
        if not isinstance(content, str):
            return None, "malformed: content is not a string"
        out.append({"role": role, "content": content})
    if out[-1]["role"] != "assistant":
        return None, "malformed: last message is not an assistant turn"
    if not out[-1]["content"].strip():
        return None, "empty: final assistant content is empty"
    if not any(m["role"] != "assistant" and m["content"].strip() for m in out[:-1]):
        return None, "empty: no prompt before the final assistant turn"
    return out, None


@dataclass(frozen=True)
class RowSpec:
    """Which format to read and where its fields live (`dataset.format`, `dataset.fields`)."""

    format: str = "auto"
    fields: dict[str, str] = field(default_factory=dict)  # format field -> column
    where: str = "dataset"  # settings path for messages ("dataset" or "dataset.mixture[1]")

    @classmethod
    def build(
        cls,
        fmt: str = "auto",
        fields: dict | None = None,
        messages_column: str = "messages",
        where: str = "dataset",
    ) -> RowSpec:
        if fmt not in FORMATS:
            raise UserError(f"{where}.format={fmt!r}: unknown data format; choose one of {list(FORMATS)}")
        fields = dict(fields or {})
        known = sorted({f for name in REQUIRED for f in (*REQUIRED[name], *OPTIONAL[name])})
        allowed = known if fmt == "auto" else [*REQUIRED[fmt], *OPTIONAL[fmt]]
        for key in fields:
            if key not in allowed:
                raise UserError(
                    f"{where}.fields.{key}: not a field of format {fmt!r}; fields it maps: {allowed}"
                )
        if messages_column != "messages":
            fields.setdefault("messages", messages_column)
        return cls(fmt, fields, where)

    def column(self, name: str) -> str:
        return self.fields.get(name, name)

    def required_columns(self) -> list[str]:
        """Columns that must exist in the data (explicit formats only; auto decides per record)."""
        return [] if self.format == "auto" else [self.column(f) for f in REQUIRED[self.format]]

    def check_columns(self, columns, source: str) -> None:
        """UserError when a required column is absent from the whole source (a mapping to a missing
        field), rather than dropping every row as malformed."""
        missing = [c for c in self.required_columns() if c not in columns]
        if missing:
            hint = {c: f"{self.where}.fields.{k}" for k, c in self.fields.items()}
            names = ", ".join(f"{c!r} ({hint.get(c, f'{self.format} field')})" for c in missing)
            raise UserError(f"{source}: no column {names}; its columns: {sorted(columns)}")

    def detect(self, rec: dict) -> str | None:
        if self.format != "auto":
            return self.format
        return next((name for name, req in REQUIRED.items() if all(self.column(f) in rec for f in req)), None)

    def convert(self, rec: dict) -> tuple[dict | None, str | None]:
        fmt = self.detect(rec)
        if fmt is None:
            return None, "malformed: no messages, prompt/completion, instruction/output or text field"
        return CONVERTERS[fmt](self, rec)


def _text_field(spec: RowSpec, rec: dict, name: str, required: bool) -> tuple[str | None, str | None]:
    col = spec.column(name)
    value = rec.get(col)
    if value is None:
        return None, f"malformed: missing field {col!r}" if required else None
    if not isinstance(value, str):
        return None, f"malformed: field {col!r} is {type(value).__name__}, not a string"
    if required and not value.strip():
        return None, f"empty: field {col!r} is empty"
    return value, None


def _from_messages(spec: RowSpec, rec: dict):
    col = spec.column("messages")
    messages, reason = check_messages(rec.get(col))
    if reason and col != "messages":
        reason = f"{reason} (field {col!r})"
    return ({"messages": messages}, None) if messages else (None, reason)


def _chat(spec: RowSpec, rec: dict, prompt_field: str, answer_field: str, extra: str | None = None):
    values = {}
    for name, required in ((prompt_field, True), (answer_field, True), ("system", False), (extra, False)):
        if name is None:
            continue
        values[name], reason = _text_field(spec, rec, name, required)
        if reason:
            return None, reason
    prompt = values[prompt_field]
    if extra and values.get(extra) and values[extra].strip():
        prompt = f"{prompt}\n\n{values[extra]}"
    messages = [{"role": "system", "content": values["system"]}] if values.get("system") else []
    messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": values[answer_field]}]
    return {"messages": messages}, None


def _from_text(spec: RowSpec, rec: dict):
    text, reason = _text_field(spec, rec, "text", True)
    return ({"text": text}, None) if text is not None else (None, reason)


CONVERTERS = {
    "messages": _from_messages,
    "prompt_completion": lambda spec, rec: _chat(spec, rec, "prompt", "completion"),
    "alpaca": lambda spec, rec: _chat(spec, rec, "instruction", "output", extra="input"),
    "text": _from_text,
}


def split_key(row: dict) -> str:
    """What decides a row's train/eval split: its first prompt turn, or a text row's text."""
    if "text" in row:
        return row["text"]
    return next(m["content"] for m in row["messages"] if m["role"] != "assistant")


def row_texts(row: dict):
    """The texts a trained BPE learns from."""
    if "text" in row:
        yield row["text"]
    else:
        yield from (m["content"] for m in row["messages"])
