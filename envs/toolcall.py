"""Parse one assistant turn into tool calls, parse errors and the remaining text.

Accepted forms: Hermes/Qwen blocks ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
(several per turn), or as the whole turn (optionally inside a ```json fence) either a bare JSON
object with ``name`` and ``arguments`` or a JSON array of such objects (parallel calls). A turn
with none of these is a final answer.

Parsing costs time linear in the turn's length: the block pattern is a lazy scan to a literal,
the fence is found with `str` methods, and JSON goes through `envs.bounded_json`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from cgym.envs import bounded_json

_BLOCK = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)
_FENCE = "```"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]

    def render(self) -> str:
        """The canonical Hermes text of this call."""
        payload = json.dumps({"name": self.name, "arguments": self.arguments})
        return f"<tool_call>{payload}</tool_call>"


@dataclass(frozen=True)
class ParseError:
    """A tool call that could not be read; `code` is a stable critique code."""

    code: str
    message: str
    got: str


@dataclass(frozen=True)
class ParsedTurn:
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[ParseError] = field(default_factory=list)
    content: str = ""

    @property
    def is_tool_turn(self) -> bool:
        """True when the turn tried to call tools (successfully or not)."""
        return bool(self.calls or self.errors)


def parse_turn(text: str) -> ParsedTurn:
    """Split `text` into tool calls, malformed-call errors and the prose around them."""
    if "<tool_call>" in text:
        return _parse_blocks(text)
    bare = _bare_call(text)
    if bare is not None:
        return bare
    return ParsedTurn(content=text)


def _parse_blocks(text: str) -> ParsedTurn:
    calls: list[ToolCall] = []
    errors: list[ParseError] = []
    for match in _BLOCK.finditer(text):
        body, closing = match.group(1).strip(), match.group(2)
        if not closing:
            errors.append(ParseError("malformed_tool_call", "A <tool_call> block is never closed with </tool_call>.", _clip(body)))
            continue
        call, error = _decode_call(body)
        if call is not None:
            calls.append(call)
        if error is not None:
            errors.append(error)
    content = _BLOCK.sub("", text).strip()
    return ParsedTurn(calls, errors, content)


def _bare_call(text: str) -> ParsedTurn | None:
    """The whole turn as one call object or an array of them; None when it is an answer."""
    body = _unfence(text.strip())
    if not (body[:1] in ("{", "[") and '"name"' in body and '"arguments"' in body):
        return None
    try:
        obj = bounded_json.loads(body)
    except json.JSONDecodeError:
        return None  # a final answer that merely mentions these keys
    objects = obj if isinstance(obj, list) else [obj]
    if not (objects and all(_looks_like_call(o) for o in objects)):
        return None  # e.g. a JSON answer whose records have a "name"
    decoded = [_from_object(o, body) for o in objects]
    return ParsedTurn([c for c, _ in decoded if c], [e for _, e in decoded if e], "")


def _looks_like_call(obj: Any) -> bool:
    return isinstance(obj, dict) and "name" in obj and set(obj) <= {"name", "arguments"}


def _unfence(text: str) -> str:
    """The inside of a turn that is one ```json fence (the "json" tag and padding dropped), else `text`."""
    if len(text) < 2 * len(_FENCE) or not (text.startswith(_FENCE) and text.endswith(_FENCE)):
        return text
    inner = text[len(_FENCE) : -len(_FENCE)]
    return inner.removeprefix("json").strip()


def _decode_call(body: str) -> tuple[ToolCall | None, ParseError | None]:
    try:
        obj = bounded_json.loads(body)
    except json.JSONDecodeError as exc:
        where = f"line {exc.lineno} column {exc.colno} (char {exc.pos})"
        return None, ParseError("json_parse_error", f"The tool call is not valid JSON: {exc.msg} at {where}.", _clip(body))
    return _from_object(obj, body)


def _from_object(obj: Any, body: str) -> tuple[ToolCall | None, ParseError | None]:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None, ParseError("malformed_tool_call", 'A tool call must be a JSON object with a string "name".', _clip(body))
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):  # some models double-encode the arguments
        try:
            arguments = bounded_json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return None, ParseError("malformed_tool_call", '"arguments" must be a JSON object.', _clip(body))
    return ToolCall(obj["name"], arguments), None


def _clip(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
