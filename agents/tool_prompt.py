"""How tools are shown to a model whose chat template has no tools section (SmolLM2's).

Two layouts: `json`, one JSON schema a line inside `<tools></tools>` (Hermes/Qwen's), and
`compact`, one function signature a line, `name(arg: type, optional?: type): description`, the
way several model families state their tools. Both end with the same instruction for calling
(Hermes `<tool_call>` blocks), and both carry every tool's name, every argument's name and type
and whether it is required; `compact` drops argument descriptions and schema keywords beyond
type (bounds, formats, defaults), and costs far fewer prompt tokens.

A model keeps the layout it was trained with: `set_tool_layout` records it in the tokenizer's
config (saved with the model), and `ChatEncoder` renders with `tool_layout(tokenizer)`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

ToolLayout = Literal["json", "compact"]
TOOL_LAYOUTS: tuple[ToolLayout, ...] = ("json", "compact")
LAYOUT_KEY = "cgym_tool_layout"  # in tokenizer_config.json
TRAINED_LAYOUT: ToolLayout = "compact"
"""What SFT records on a model that records no layout yet: the quickstart's three seeds SFT'd to
52% with it against 20% with JSON schemas, in half the time (benchmarks/RESULTS.md)."""

JSON_PREAMBLE = "# Tools\n\nYou can call the functions whose JSON schemas are listed inside <tools></tools>:\n<tools>\n"
JSON_END = "\n</tools>"
COMPACT_PREAMBLE = "# Tools\n\nYou can call these functions (an argument marked ? is optional):\n"
CALLING = (
    "\n\nTo call a function, reply with a JSON object holding its name and arguments "
    "inside <tool_call></tool_call> tags (one block per call):\n"
    '<tool_call>\n{"name": "<function-name>", "arguments": {<arguments as JSON>}}\n</tool_call>'
)


def tools_block(tools: Sequence[Mapping[str, Any]], layout: ToolLayout = "json") -> str:
    """The tools section of a system message, in `layout`."""
    if layout == "json":
        return JSON_PREAMBLE + "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools) + JSON_END + CALLING
    if layout == "compact":
        return COMPACT_PREAMBLE + "\n".join("- " + signature(tool) for tool in tools) + CALLING
    raise ValueError(f"unknown tool layout {layout!r}; choose one of {list(TOOL_LAYOUTS)}")


def signature(tool: Mapping[str, Any]) -> str:
    """`name(arg: type, optional?: type): description` for an OpenAI tool schema."""
    spec = tool.get("function", tool)
    parameters = spec.get("parameters") or {}
    required = set(parameters.get("required", ()))
    args = ", ".join(f"{name}{'' if name in required else '?'}: {type_text(schema)}" for name, schema in (parameters.get("properties") or {}).items())
    description = " ".join(str(spec.get("description", "")).split())
    return f"{spec['name']}({args})" + (f": {description}" if description else "")


def type_text(schema: Mapping[str, Any]) -> str:
    """A JSON schema's type in a few tokens: `string`, `integer|null`, `"a"|"b"`, `array<integer>`, `{x: number, y?: string}`."""
    if "const" in schema:
        return json.dumps(schema["const"], ensure_ascii=False)
    if "enum" in schema:
        return "|".join(json.dumps(value, ensure_ascii=False) for value in schema["enum"])
    options = schema.get("anyOf") or schema.get("oneOf")
    if options:
        return "|".join(type_text(option) for option in options)
    kind = schema.get("type")
    if isinstance(kind, list):
        return "|".join(type_text({**schema, "type": k}) for k in kind)
    if kind == "array":
        items = schema.get("items")
        return f"array<{type_text(items)}>" if isinstance(items, Mapping) else "array"
    if kind == "object" and schema.get("properties"):
        required = set(schema.get("required", ()))
        fields = ", ".join(f"{name}{'' if name in required else '?'}: {type_text(s)}" for name, s in schema["properties"].items())
        return "{" + fields + "}"
    return str(kind) if kind else "any"


_SIGNATURE = re.compile(r"^(?P<name>[A-Za-z0-9_-]+)\((?P<args>.*)\)(?::.*)?$", re.DOTALL)


def parse_signature(line: str) -> tuple[str, dict[str, tuple[str, bool]]]:
    """The name and `{argument: (type text, required)}` of a `signature` line: what a reader can recover."""
    found = _SIGNATURE.match(_outer_call(line))
    if not found:
        raise ValueError(f"not a signature: {line!r}")
    args: dict[str, tuple[str, bool]] = {}
    for part in _split_top_level(found.group("args")):
        name, _, kind = part.partition(": ")
        args[name.removesuffix("?")] = (kind, not name.endswith("?"))
    return found.group("name"), args


def _outer_call(line: str) -> str:
    """`name(...)` up to its matching parenthesis (a description may hold parentheses too)."""
    depth = 0
    for i, char in enumerate(line):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == ")" and depth == 0:
            return line[: i + 1]
    return line


def _split_top_level(text: str) -> list[str]:
    """`text` split at the commas outside braces, brackets and quotes."""
    parts, depth, quoted, start = [], 0, False, 0
    for i, char in enumerate(text):
        if char == '"' and (i == 0 or text[i - 1] != "\\"):
            quoted = not quoted
        elif not quoted and char in "{<[(":
            depth += 1
        elif not quoted and char in "}>])":
            depth -= 1
        elif not quoted and depth == 0 and text.startswith(", ", i):
            parts.append(text[start:i])
            start = i + 2
    tail = text[start:]
    return parts + [tail] if tail else parts


def tool_layout(tokenizer: Any) -> ToolLayout:
    """The layout the model of `tokenizer` was trained with (`json` unless it says otherwise:
    models saved before layouts were recorded, and models as shipped)."""
    return recorded_layout(tokenizer) or "json"


def recorded_layout(tokenizer: Any) -> ToolLayout | None:
    """The layout recorded in `tokenizer`'s config, or None."""
    layout = getattr(tokenizer, "init_kwargs", {}).get(LAYOUT_KEY)
    if layout is not None and layout not in TOOL_LAYOUTS:
        raise ValueError(f"the tokenizer's config says {LAYOUT_KEY}={layout!r}; choose one of {list(TOOL_LAYOUTS)}")
    return layout


def set_tool_layout(tokenizer: Any, layout: ToolLayout) -> None:
    """Record `layout` on `tokenizer`; `save_pretrained` keeps it with the model."""
    if layout not in TOOL_LAYOUTS:
        raise ValueError(f"unknown tool layout {layout!r}; choose one of {list(TOOL_LAYOUTS)}")
    tokenizer.init_kwargs[LAYOUT_KEY] = layout
