"""`Tool.from_schema`: OpenAI schemas as data, checked recursively, refused by name when unusable."""

from __future__ import annotations

from typing import Any

import pytest
from cgym.envs.errors import CgymError
from cgym.envs.tools import Tool, ToolError, ToolSchemaError
from hypothesis import given, settings
from hypothesis import strategies as st

PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "location": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "country": {"type": "string", "enum": ["BE", "NO"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
        "days": {"type": "array", "items": {"type": "integer"}},
        "unit": {"anyOf": [{"type": "string", "enum": ["c", "f"]}, {"type": "null"}]},
        "extras": {"type": "object"},
    },
    "required": ["location"],
}
WRAPPED = {"type": "function", "function": {"name": "get_weather", "description": "The weather.", "parameters": PARAMETERS}}


def weather(**arguments: Any) -> dict[str, Any]:
    return arguments


TOOL = Tool.from_schema(WRAPPED, weather)


def test_wrapped_and_bare_schemas_make_the_same_tool() -> None:
    bare = Tool.from_schema(WRAPPED["function"], weather)
    assert bare == TOOL and TOOL.schema == WRAPPED


def test_a_schema_without_required_requires_nothing() -> None:
    tool = Tool.from_schema({"name": "ping", "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}}}, lambda n=0: f"pong {n}")
    assert tool.invoke({}) == "pong 0" and tool.invoke({"n": 2}) == "pong 2"


def test_a_schema_without_parameters_takes_no_arguments() -> None:
    tool = Tool.from_schema({"name": "now"}, lambda: "noon")
    assert tool.invoke({}) == "noon"
    assert tool.check_arguments({"x": 1}).code == "unexpected_argument"


@pytest.mark.parametrize(
    ("arguments", "code", "message"),
    [
        ({}, "missing_argument", "get_weather needs the argument 'location'."),
        ({"location": {}}, "missing_argument", "get_weather needs the argument 'location.city'."),
        ({"location": {"city": 3}}, "invalid_argument", "get_weather: 'location.city' must be a JSON string."),
        ({"location": {"city": "Oslo", "country": "SE"}}, "invalid_argument", "get_weather: 'location.country' must be one of ['BE', 'NO']."),
        ({"location": {"city": "Oslo", "twon": "x"}}, "unexpected_argument", "get_weather has no argument 'location.twon'."),
        ({"location": {"city": "Oslo"}, "days": [1, "2"]}, "invalid_argument", "get_weather: 'days[1]' must be a JSON integer."),
        ({"location": {"city": "Oslo"}, "days": [1.0]}, "invalid_argument", "get_weather: 'days[0]' must be a JSON integer."),
        ({"location": {"city": "Oslo"}, "unit": "k"}, "invalid_argument", "get_weather: 'unit' must be one of ['c', 'f'] or a JSON null."),
        ({"location": {"city": "Oslo"}, "dayz": [1]}, "unexpected_argument", "get_weather has no argument 'dayz'. Did you mean 'days'?"),
    ],
    ids=["missing", "nested-missing", "nested-type", "nested-enum", "nested-unknown", "array-item", "float-for-int", "any-of", "top-level-typo"],
)
def test_arguments_are_checked_recursively(arguments: dict[str, Any], code: str, message: str) -> None:
    with pytest.raises(ToolError) as info:
        TOOL.invoke(arguments)
    assert (info.value.code, info.value.message) == (code, message)


def test_valid_nested_arguments_reach_the_function() -> None:
    arguments = {"location": {"city": "Oslo"}, "days": [1, 2], "extras": {"any": ["thing"]}}
    assert TOOL.check_arguments(arguments) is None
    assert '"city": "Oslo"' in TOOL.invoke(arguments)


def test_the_shallowest_problem_is_reported_first() -> None:
    problem = TOOL.check_arguments({"days": ["x"], "location": {"city": 1}, "oops": 1})
    assert problem is not None and problem.code == "unexpected_argument" and problem.got == "oops"


def test_local_refs_are_followed() -> None:
    parameters = {"type": "object", "$defs": {"city": {"type": "string"}}, "properties": {"city": {"$ref": "#/$defs/city"}}}
    tool = Tool.from_schema({"name": "f", "parameters": parameters}, weather)
    assert tool.check_arguments({"city": 1}).message == "f: 'city' must be a JSON string."


@pytest.mark.parametrize(
    ("schema", "names"),
    [
        ({"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "str"}}}}, ["'str'", "not a JSON type", "use 'string'"]),
        ({"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "any"}}}}, ["'properties.a.type' is 'any'", "leave 'type' out"]),
        ({"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "strin"}}}}, ["Did you mean 'string'"]),
        ({"name": "f", "parameters": {"type": "dict", "properties": {}}}, ["got 'type': 'dict'", "use 'object'"]),
        ({"name": "math.add", "parameters": {"type": "object"}}, ["tool name 'math.add'", "'math_add'"]),
        ({"name": "x" * 65}, ["1-64 letters"]),
        ({"name": "f", "parameters": {"type": "object", "properties": {"a": {"$ref": "https://x.org/s.json"}}}}, ["$ref", "https://x.org/s.json"]),
        ({"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": "0"}}}},
         ["properties.a.minimum", "'0' is not of type 'number'"]),
        ({"name": "f", "parameters": {"type": "array"}}, ["'parameters' must be an object schema"]),
        ({"description": "no name"}, ["non-empty string 'name'"]),
        ({"type": "function", "function": {"name": ""}}, ["non-empty string 'name'"]),
    ],
    ids=["python-type", "any-type", "misspelt-type", "dict-at-the-top", "dotted-name", "long-name", "remote-ref", "bad-keyword-value", "not-an-object", "no-name", "empty-name"],
)
def test_unusable_schemas_are_refused_by_name(schema: dict[str, Any], names: list[str]) -> None:
    with pytest.raises(ToolSchemaError) as info:
        Tool.from_schema(schema, weather)
    assert all(name in str(info.value) for name in names), str(info.value)
    assert isinstance(info.value, CgymError) and isinstance(info.value, ValueError)


def test_a_property_called_type_is_not_read_as_a_keyword() -> None:
    parameters = {"type": "object", "properties": {"type": {"type": "string"}, "enum": {"type": "integer"}}, "required": ["type"]}
    tool = Tool.from_schema({"name": "f", "parameters": parameters}, weather)
    assert tool.check_arguments({"type": "x", "enum": 1}) is None


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.floats(-3, 3, allow_nan=False) | st.sampled_from(["fast", "full", "x", ""]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(["a", "b"]), inner, max_size=2),
    max_leaves=6,
)
FLAT = [
    Tool.from_function(lambda customer_id, page=1: None, name="lookup"),
    Tool.from_schema({"name": "f", "parameters": {"type": "object", "properties": {
        "n": {"type": "integer", "enum": [0, 1]}, "x": {"type": "number"}, "mode": {"type": "string", "enum": ["fast", "full"]},
        "on": {"type": "boolean"}, "o": {"type": "object"}, "l": {"type": "array"}, "z": {"type": "null"}}, "required": ["n"]}}, weather),
]


@settings(max_examples=300, deadline=None)
@given(tool=st.sampled_from(FLAT), arguments=st.dictionaries(st.sampled_from(["customer_id", "page", "n", "x", "mode", "on", "o", "l", "z", "q"]), json_values, max_size=4))
def test_the_quick_check_accepts_only_what_jsonschema_accepts(tool: Tool, arguments: dict[str, Any]) -> None:
    assert tool._quick is not None
    if tool._quick(arguments):
        assert tool._validator.is_valid(arguments)


def test_from_function_follows_transformers_get_json_schema() -> None:
    """Our schemas from typed functions are transformers' `get_json_schema` (the convention TRL and
    chat templates use) except where that leaves JSON Schema: no "return", no OpenAPI "nullable",
    and an explicit empty "required". Kept our own: `envs` stays free of the transformers import."""
    get_json_schema = pytest.importorskip("transformers.utils").get_json_schema
    from cgym import envs

    for env_id in ("cgym/ApiReport-v0", "cgym/SqlQuery-v0"):
        env = envs.make(env_id)
        env.reset(seed=0)
        for tool in env.unwrapped._tool_list:
            theirs = get_json_schema(tool.fn)["function"]
            theirs.pop("return", None)
            theirs["parameters"].setdefault("required", [])
            for prop in theirs["parameters"]["properties"].values():
                prop.pop("nullable", None)
            assert tool.schema["function"] == theirs, tool.name
        env.close()
