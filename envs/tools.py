"""Tools: a typed Python function or a JSON schema, with validated dispatch.

A tool is any function with type hints and a Google-style docstring::

    def list_orders(customer_id: int, page: int = 1) -> dict:
        '''List one page of a customer's orders.

        Args:
            customer_id: The customer's id.
            page: 1-based page number.
        '''

`Tool.from_function` turns it into an OpenAI function schema; `Tool.from_schema` takes such a
schema as data (an OpenAI ``{"type": "function", "function": {...}}`` or the bare
``{"name", "description", "parameters"}``) plus the function to call. `Tool.invoke` checks the
arguments a model wrote against the schema before calling, so bad arguments become critiques
(`missing_argument`, `invalid_argument`, `unexpected_argument`), never exceptions.

Arguments are checked with `jsonschema` rather than by hand: it is well kept, recursive (nested
objects, arrays, `anyOf`, `$defs`) and follows the JSON Schema drafts, where the matcher it
replaced read only the top level and let unknown types through. It costs about 15 us a call,
half of a SQL tool step, so flat schemas (every built-in tool's) first get a quick check that
can only accept what jsonschema accepts; anything it does not accept goes to jsonschema.
"""

from __future__ import annotations

import copy
import functools
import inspect
import json
import re
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Union, get_args, get_origin

import jsonschema
from cgym.envs.errors import CgymError, did_you_mean
from jsonschema.exceptions import ValidationError
from jsonschema.protocols import Validator

_JSON_TYPES: dict[type, str] = {str: "string", int: "integer", float: "number", bool: "boolean", dict: "object", list: "array"}
_TYPE_NAMES = ("array", "boolean", "integer", "null", "number", "object", "string")
# Type names from other schema dialects (Python, OpenAPI 2, BFCL), and what JSON Schema says instead
_OTHER_DIALECTS = {
    "any": "leave 'type' out (any value)", "dict": "use 'object'", "list": "use 'array'", "tuple": "use 'array'",
    "str": "use 'string'", "int": "use 'integer'", "long": "use 'integer'", "float": "use 'number'", "double": "use 'number'",
    "bool": "use 'boolean'", "none": "use 'null'", "None": "use 'null'",
}  # fmt: skip
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names; the hosts refuse others
_IS_TYPE: dict[str, Callable[[Any], bool]] = {
    "array": lambda v: isinstance(v, list),
    "boolean": lambda v: isinstance(v, bool),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "null": lambda v: v is None,
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "object": lambda v: isinstance(v, dict),
    "string": lambda v: isinstance(v, str),
}


class ToolError(Exception):
    """Raised by a tool function to report a failure that becomes a critique."""

    def __init__(self, code: str, message: str, *, expected: Any = None, got: Any = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.expected = expected
        self.got = got


class ToolSchemaError(CgymError, ValueError):
    """A tool schema that cannot be used; the message names the tool, the keyword and the fix."""


@dataclass(frozen=True)
class Tool:
    """A named function the model can call; `parameters` is its JSON schema (an object schema)."""

    name: str
    description: str
    parameters: dict[str, Any]
    fn: Callable[..., Any]
    _validator: Validator = field(init=False, repr=False, compare=False)
    _quick: _QuickAccept | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not TOOL_NAME.fullmatch(self.name):
            fixed = re.sub(r"[^A-Za-z0-9_-]", "_", str(self.name))[:64] or "tool"
            raise ToolSchemaError(f"tool name {self.name!r}: a tool name is 1-64 letters, digits, '_' or '-' (OpenAI's rule, which the serving hosts enforce); for example {fixed!r}")
        object.__setattr__(self, "_validator", _validator(self.name, self.parameters))
        object.__setattr__(self, "_quick", _QuickAccept.of(self.parameters))

    @classmethod
    def from_function(cls, fn: Callable[..., Any], *, name: str | None = None) -> Tool:
        """Build a tool from a typed function (or bound method) and its docstring. The schema is
        read once per function: an env's bound methods (one env per live episode) share it."""
        plain, bound = getattr(fn, "__func__", fn), inspect.ismethod(fn)
        try:
            summary, parameters = _function_schema(plain, bound)
        except TypeError:  # an unhashable callable (an object that defines __eq__): read it each time
            summary, parameters = _function_schema.__wrapped__(plain, bound)
        return cls(name or fn.__name__, summary, copy.deepcopy(parameters), fn)

    @classmethod
    def from_schema(cls, schema: Mapping[str, Any], fn: Callable[..., Any]) -> Tool:
        """Build a tool from an OpenAI function schema (wrapped or bare); `fn` gets the arguments as keywords.

        Raises `ToolSchemaError` for a schema it cannot check: no name, parameters that are not
        an object schema, a `type` that is not a JSON type, a `$ref` outside the schema.
        """
        if not isinstance(schema, Mapping):
            raise ToolSchemaError(f"a tool schema must be a JSON object, got {type(schema).__name__}")
        spec = schema.get("function", schema) if schema.get("type") == "function" else schema
        name = spec.get("name")
        if not isinstance(name, str) or not name:
            raise ToolSchemaError(f"a tool schema needs a non-empty string 'name', got {name!r}")
        parameters = spec.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, Mapping):
            raise ToolSchemaError(f"tool {name!r}: 'parameters' must be an object schema ({{\"type\": \"object\", ...}}), got {type(parameters).__name__}")
        if (kind := parameters.get("type", "object")) != "object":
            advice = "" if kind in _TYPE_NAMES else _type_advice(kind)
            raise ToolSchemaError(f"tool {name!r}: 'parameters' must be an object schema ({{\"type\": \"object\", ...}}), got 'type': {kind!r}.{advice}")
        return cls(name, str(spec.get("description", "")), dict(parameters), fn)

    @property
    def schema(self) -> dict[str, Any]:
        """The OpenAI function-calling schema."""
        return {"type": "function", "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    @property
    def required(self) -> list[str]:
        """The parameters a call must give (none when the schema has no `required`)."""
        return list(self.parameters.get("required", []))

    def check_arguments(self, arguments: dict[str, Any]) -> ToolError | None:
        """The most basic problem with `arguments` (shallowest first), or None when they fit the schema."""
        given = self._given(arguments)
        if (self._quick is not None and self._quick(given)) or self._validator.is_valid(given):
            return None
        error = min(self._validator.iter_errors(given), key=_rank)
        return self._tool_error(error)

    def invoke(self, arguments: dict[str, Any]) -> str:
        """Validate, call, and render the result as text. Raises `ToolError` only."""
        problem = self.check_arguments(arguments)
        if problem is not None:
            raise problem
        result = self.fn(**self._given(arguments))
        return result if isinstance(result, str) else json.dumps(result, separators=(", ", ": "))

    def _given(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """`arguments` without nulls for optional parameters: null there means "not given"."""
        props, required = self.parameters.get("properties", {}), self.required
        return {k: v for k, v in arguments.items() if v is not None or k in required or k not in props}

    def _tool_error(self, error: ValidationError) -> ToolError:
        path = list(error.absolute_path)
        if error.validator == "required":
            missing = next(r for r in error.validator_value if r not in error.instance)
            return ToolError("missing_argument", f"{self.name} needs the argument {_dotted([*path, missing])!r}.",
                             expected=_dotted([*path, missing]), got=sorted(error.instance))
        if error.validator == "additionalProperties":
            known = error.schema.get("properties", {})
            extra = next(k for k in error.instance if k not in known)
            return ToolError("unexpected_argument", f"{self.name} has no argument {_dotted([*path, extra])!r}.{did_you_mean(extra, known)}",
                             expected=sorted(known), got=_dotted([*path, extra]))
        where = _dotted(path) if path else "the arguments"
        if error.validator in ("type", "enum", "anyOf", "oneOf", "const"):
            wanted = _describe(error.schema)
            return ToolError("invalid_argument", f"{self.name}: {where!r} must be {wanted}.", expected=wanted, got=error.instance)
        return ToolError("invalid_argument", f"{self.name}: {where!r} is invalid: {error.message}.", expected=error.validator_value, got=error.instance)


def _validator(name: str, parameters: dict[str, Any]) -> Validator:
    """A validator for the arguments, built once per distinct schema; the schema is checked first.

    Envs build their tools at every reset of a fresh instance (an eval makes one env per
    episode), and building a validator (checking the schema, deriving a validator class) took
    ~5 ms a tool: 2.5 s of a 100-episode ApiReport eval. Validators are stateless, so tools with
    the same name and schema (as JSON) share one; the 512 latest are kept.
    """
    if not isinstance(parameters, dict):
        raise ToolSchemaError(f"tool {name!r}: parameters must be a JSON object schema, got {type(parameters).__name__}")
    try:
        text = json.dumps(parameters, sort_keys=True)
    except (TypeError, ValueError):  # not JSON: let the checks say what is wrong with it
        return _build_validator(name, parameters)
    return _shared_validator(name, text)


@functools.lru_cache(maxsize=512)
def _shared_validator(name: str, schema_text: str) -> Validator:
    return _build_validator(name, json.loads(schema_text))


def _build_validator(name: str, parameters: dict[str, Any]) -> Validator:
    _check_keywords(name, parameters)
    base = jsonschema.validators.validator_for(parameters, default=jsonschema.Draft202012Validator)
    try:
        base.check_schema(parameters)
    except jsonschema.SchemaError as exc:
        raise ToolSchemaError(f"tool {name!r}: invalid parameters schema at {_dotted(list(exc.absolute_path)) or 'the top'!r}: {exc.message}") from None
    # Integers are what Python calls int: 3.0 stays a float (jsonschema would accept it), so a
    # tool declared `int` never receives one. Python's kwargs cannot take unknown names, so the
    # top level is closed unless the schema says otherwise.
    integer = base.TYPE_CHECKER.redefine("integer", lambda _, value: isinstance(value, int) and not isinstance(value, bool))
    strict = jsonschema.validators.extend(base, type_checker=integer)
    return strict({"additionalProperties": False, **parameters})


@dataclass(frozen=True)
class _QuickAccept:
    """True for arguments a flat schema (top-level scalars, `enum`s) surely accepts; False means "ask jsonschema"."""

    required: frozenset[str]
    rules: dict[str, tuple[Callable[[Any], bool], tuple[Any, ...] | None]]  # name -> (type test, enum)

    @classmethod
    def of(cls, parameters: dict[str, Any]) -> _QuickAccept | None:
        """The quick check of `parameters`, or None when it is not flat."""
        if not set(parameters) <= {"type", "properties", "required", "additionalProperties", "description", "title"}:
            return None
        if parameters.get("type", "object") != "object" or parameters.get("additionalProperties", False) is not False:
            return None
        rules: dict[str, tuple[Callable[[Any], bool], tuple[Any, ...] | None]] = {}
        for name, schema in parameters.get("properties", {}).items():
            kind = schema.get("type") if isinstance(schema, dict) else None
            if kind not in _IS_TYPE or not set(schema) <= {"type", "enum", "description", "title"}:
                return None
            enum = tuple(schema.get("enum", ()))
            if enum and (kind in ("array", "object") or not all(_IS_TYPE[kind](v) for v in enum)):
                return None  # where `==` and JSON equality differ (True == 1 inside containers)
            rules[name] = (_IS_TYPE[kind], enum or None)
        return cls(frozenset(parameters.get("required", ())), rules)

    def __call__(self, arguments: dict[str, Any]) -> bool:
        if not self.required <= arguments.keys():
            return False
        for name, value in arguments.items():
            rule = self.rules.get(name)
            if rule is None or not rule[0](value) or (rule[1] is not None and value not in rule[1]):
                return False
        return True


def _check_keywords(name: str, schema: Any, path: tuple[str | int, ...] = ()) -> None:
    """Refuse, by name, what jsonschema would read differently from a model: unknown types, outside refs."""
    for key, value, where in _walk(schema, path):
        if key == "type":
            for kind in value if isinstance(value, list) else [value]:
                if kind not in _TYPE_NAMES:
                    raise ToolSchemaError(f"tool {name!r}: {_dotted(list(where)) or 'type'!r} is {kind!r}, not a JSON type.{_type_advice(kind)}")
        elif key == "$ref" and not (isinstance(value, str) and value.startswith("#")):
            raise ToolSchemaError(f"tool {name!r}: {_dotted(list(where))!r} is {value!r}; only refs inside the schema ('#/$defs/...') are supported")


def _type_advice(kind: Any) -> str:
    """What to write instead of a type name JSON Schema does not have."""
    if isinstance(kind, str) and kind in _OTHER_DIALECTS:
        return f" In JSON Schema, {_OTHER_DIALECTS[kind]}."
    return did_you_mean(str(kind), _TYPE_NAMES) or f" Use one of {list(_TYPE_NAMES)}."


def _walk(schema: Any, path: tuple[str | int, ...]) -> Iterator[tuple[str, Any, tuple[str | int, ...]]]:
    """(keyword, value, path) of every keyword of every subschema, skipping `properties` names and `enum` values."""
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            yield from _walk(item, (*path, i))
        return
    if not isinstance(schema, dict):
        return
    for key, value in schema.items():
        where = (*path, key)
        if key in ("enum", "const", "default", "examples", "description", "required"):
            continue
        if key in ("properties", "patternProperties", "$defs", "definitions"):
            for sub, subschema in (value.items() if isinstance(value, dict) else []):
                yield from _walk(subschema, (*where, sub))
            continue
        yield key, value, where
        yield from _walk(value, where)


def _rank(error: ValidationError) -> tuple[int, int]:
    """Shallow problems first; at one depth a missing argument, then an unknown one, then a bad value."""
    return len(error.absolute_path), {"required": 0, "additionalProperties": 1}.get(str(error.validator), 2)


def _dotted(path: list[Any]) -> str:
    """A JSON path as a model would write it: `location.city`, `stops[2].name`."""
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


@functools.lru_cache(maxsize=512)
def _function_schema(fn: Callable[..., Any], bound: bool) -> tuple[str, dict[str, Any]]:
    """(summary, object schema of the parameters) of a typed function and its docstring; `bound`
    leaves out its first parameter (a method's `self`)."""
    summary, arg_docs = _parse_docstring(inspect.getdoc(fn) or "")
    hints = typing.get_type_hints(fn)
    properties: dict[str, Any] = {}
    required: list[str] = []
    for pname, param in list(inspect.signature(fn).parameters.items())[1 if bound else 0 :]:
        schema = _type_schema(hints.get(pname, str))
        if pname in arg_docs:
            schema["description"] = arg_docs[pname]
        properties[pname] = schema
        if param.default is inspect.Parameter.empty:
            required.append(pname)
    return summary, {"type": "object", "properties": properties, "required": required}


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


def _describe(schema: dict[str, Any]) -> str:
    if "enum" in schema:
        return f"one of {schema['enum']}"
    if "const" in schema:
        return f"exactly {json.dumps(schema['const'])}"
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return " or ".join(_describe(s) for s in schema[key])
    kind = schema.get("type", "value")
    return " or ".join(f"a JSON {k}" for k in kind) if isinstance(kind, list) else f"a JSON {kind}"
