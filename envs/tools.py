"""Tools as plain typed Python functions: schema from the signature, validated dispatch.

A tool is any function with type hints and a Google-style docstring::

    def list_orders(customer_id: int, page: int = 1) -> dict:
        '''List one page of a customer's orders.

        Args:
            customer_id: The customer's id.
            page: 1-based page number.
        '''

`Tool.from_function` turns it into an OpenAI function schema; `Tool.invoke` checks the
arguments a model wrote against that schema before calling, so bad arguments become
critiques (`missing_argument`, `invalid_argument`, `unexpected_argument`), never exceptions.
"""

from __future__ import annotations

import inspect
import json
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Union, get_args, get_origin

from envs.errors import did_you_mean

_JSON_TYPES: dict[type, str] = {str: "string", int: "integer", float: "number", bool: "boolean", dict: "object", list: "array"}


class ToolError(Exception):
    """Raised by a tool function to report a failure that becomes a critique."""

    def __init__(self, code: str, message: str, *, expected: Any = None, got: Any = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.expected = expected
        self.got = got


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]
    fn: Callable[..., Any]

    @classmethod
    def from_function(cls, fn: Callable[..., Any], *, name: str | None = None) -> Tool:
        """Build a tool from a typed function (or bound method) and its docstring."""
        summary, arg_docs = _parse_docstring(inspect.getdoc(fn) or "")
        hints = typing.get_type_hints(fn)
        properties: dict[str, Any] = {}
        required: list[str] = []
        for pname, param in inspect.signature(fn).parameters.items():
            schema = _type_schema(hints.get(pname, str))
            if pname in arg_docs:
                schema["description"] = arg_docs[pname]
            properties[pname] = schema
            if param.default is inspect.Parameter.empty:
                required.append(pname)
        parameters = {"type": "object", "properties": properties, "required": required}
        return cls(name or fn.__name__, summary, parameters, fn)

    @property
    def schema(self) -> dict[str, Any]:
        """The OpenAI function-calling schema."""
        return {"type": "function", "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    def check_arguments(self, arguments: dict[str, Any]) -> ToolError | None:
        """The first problem with `arguments`, or None when they fit the schema."""
        props = self.parameters["properties"]
        for pname in self.parameters["required"]:
            if pname not in arguments:
                return ToolError("missing_argument", f"{self.name} needs the argument {pname!r}.", expected=pname, got=sorted(arguments))
        for pname, value in arguments.items():
            if value is None and pname in props and pname not in self.parameters["required"]:
                continue  # null for an optional argument means "not given"
            if pname not in props:
                hint = did_you_mean(pname, props)
                return ToolError("unexpected_argument", f"{self.name} has no argument {pname!r}.{hint}", expected=sorted(props), got=pname)
            if not _matches(value, props[pname]):
                return ToolError("invalid_argument", f"{self.name}: {pname!r} must be {_describe(props[pname])}.", expected=_describe(props[pname]), got=value)
        return None

    def invoke(self, arguments: dict[str, Any]) -> str:
        """Validate, call, and render the result as text. Raises `ToolError` only."""
        problem = self.check_arguments(arguments)
        if problem is not None:
            raise problem
        given = {k: v for k, v in arguments.items() if v is not None or k in self.parameters["required"]}
        result = self.fn(**given)
        return result if isinstance(result, str) else json.dumps(result, separators=(", ", ": "))


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    summary = doc.split("\n\n", 1)[0].replace("\n", " ").strip()
    args: dict[str, str] = {}
    section = re.search(r"^Args:\s*\n(.*?)(?:\n\s*\n|\Z)", doc, re.DOTALL | re.MULTILINE)
    if section:
        current = None
        for line in section.group(1).splitlines():
            item = re.match(r"\s*(\w+)(?:\s*\([^)]*\))?:\s*(.*)", line)
            if item and not line.startswith(" " * 8):
                current = item.group(1)
                args[current] = item.group(2).strip()
            elif current:
                args[current] += " " + line.strip()
    return summary, args


def _type_schema(hint: Any) -> dict[str, Any]:
    origin = get_origin(hint)
    if origin is Literal:
        values = list(get_args(hint))
        return {"type": _JSON_TYPES.get(type(values[0]), "string"), "enum": values}
    if origin in (Union, types.UnionType):
        options = [a for a in get_args(hint) if a is not type(None)]
        return _type_schema(options[0]) if len(options) == 1 else {"anyOf": [_type_schema(a) for a in options]}
    if origin in (list, tuple):
        inner = get_args(hint)
        return {"type": "array", "items": _type_schema(inner[0])} if inner else {"type": "array"}
    if origin is dict:
        return {"type": "object"}
    return {"type": _JSON_TYPES.get(hint, "string")}


def _matches(value: Any, schema: dict[str, Any]) -> bool:
    if "anyOf" in schema:
        return any(_matches(value, s) for s in schema["anyOf"])
    if "enum" in schema and value not in schema["enum"]:
        return False
    kind = schema.get("type")
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    checks: dict[str, type | tuple[type, ...]] = {"string": str, "boolean": bool, "object": dict, "array": list}
    return kind not in checks or isinstance(value, checks[kind])


def _describe(schema: dict[str, Any]) -> str:
    if "enum" in schema:
        return f"one of {schema['enum']}"
    if "anyOf" in schema:
        return " or ".join(_describe(s) for s in schema["anyOf"])
    return f"a JSON {schema.get('type', 'value')}"
