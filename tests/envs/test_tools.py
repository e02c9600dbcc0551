from __future__ import annotations

from typing import Literal

import pytest
from cgym.envs.tools import Tool, ToolError


def lookup(customer_id: int, page: int = 1, mode: Literal["fast", "full"] = "fast", token: str | None = None, ratio: float = 1.0) -> dict:
    """Look a customer up.

    Args:
        customer_id: The customer's id.
        page: 1-based page.
        mode: How much to fetch.
        token: Optional bearer token.
        ratio: A number.
    """
    return {"customer_id": customer_id, "page": page, "mode": mode, "token": token}


TOOL = Tool.from_function(lookup)


def test_schema_from_signature_and_docstring() -> None:
    fn = TOOL.schema["function"]
    assert fn["name"] == "lookup" and fn["description"] == "Look a customer up."
    props = fn["parameters"]["properties"]
    assert props["customer_id"] == {"type": "integer", "description": "The customer's id."}
    assert props["mode"]["enum"] == ["fast", "full"]
    assert props["token"]["type"] == "string"
    assert props["ratio"]["type"] == "number"
    assert fn["parameters"]["required"] == ["customer_id"]


@pytest.mark.parametrize(
    ("arguments", "code"),
    [
        ({}, "missing_argument"),
        ({"customer_id": "7"}, "invalid_argument"),
        ({"customer_id": True}, "invalid_argument"),
        ({"customer_id": 7, "mode": "slow"}, "invalid_argument"),
        ({"customer_id": 7, "pgae": 2}, "unexpected_argument"),
    ],
    ids=["missing", "string-for-int", "bool-for-int", "not-in-enum", "typo"],
)
def test_bad_arguments_raise_tool_errors(arguments: dict, code: str) -> None:
    with pytest.raises(ToolError) as info:
        TOOL.invoke(arguments)
    assert info.value.code == code


def test_typo_gets_a_did_you_mean() -> None:
    with pytest.raises(ToolError, match="Did you mean 'page'"):
        TOOL.invoke({"customer_id": 1, "pgae": 2})


def test_null_optional_argument_means_default() -> None:
    assert '"token": null' in TOOL.invoke({"customer_id": 7, "token": None})


def test_int_accepted_for_number() -> None:
    assert TOOL.check_arguments({"customer_id": 1, "ratio": 2}) is None


def test_tools_rebuilt_at_each_reset_share_one_validator() -> None:
    """A fresh env builds its tools at every reset; the same name and schema reuse the validator
    (building one took ~5 ms), and a schema that differs gets its own, with its own rules."""
    again = Tool.from_function(lookup)
    assert again._validator is TOOL._validator
    assert again.check_arguments({"customer_id": 3}) is None

    narrower = Tool.from_schema({"name": "lookup", "parameters": {"type": "object", "properties": {"customer_id": {"type": "string"}}}}, lookup)
    assert narrower._validator is not TOOL._validator
    assert narrower.check_arguments({"customer_id": 3}).code == "invalid_argument"
    assert TOOL.check_arguments({"customer_id": 3}) is None


def test_a_bad_schema_is_refused_every_time() -> None:
    """Failed builds are not cached: the second identical bad schema is refused too."""
    from cgym.envs.tools import ToolSchemaError

    bad = {"name": "t", "parameters": {"type": "object", "properties": {"x": {"type": "integr"}}}}
    for _ in range(2):
        with pytest.raises(ToolSchemaError, match="'t'"):
            Tool.from_schema(bad, lookup)


class _Shop:
    def find(self, name: str, limit: int = 5) -> list:
        """Find customers.

        Args:
            name: Part of a name.
            limit: At most this many.
        """
        return [self, name, limit]


class _Unhashable:
    __hash__ = None  # type: ignore[assignment]

    def __call__(self, query: str) -> str:
        """Answer a query."""
        return query


def test_methods_of_two_objects_share_their_schema_but_not_their_dicts_or_their_self() -> None:
    """The schema is read once per function; each tool still calls its own object's method and
    holds its own copy of the parameters (one tool's edit does not reach another)."""
    a, b = _Shop(), _Shop()
    first, second = Tool.from_function(a.find), Tool.from_function(b.find)
    assert (
        first.parameters
        == second.parameters
        == {
            "type": "object",
            "properties": {"name": {"type": "string", "description": "Part of a name."}, "limit": {"type": "integer", "description": "At most this many."}},
            "required": ["name"],
        }
    )
    first.parameters["properties"]["name"]["description"] = "changed"
    assert second.parameters["properties"]["name"]["description"] == "Part of a name."
    assert Tool.from_function(a.find).parameters["properties"]["name"]["description"] == "Part of a name."
    assert first.fn("x")[0] is a and second.fn("x")[0] is b
    plain = Tool.from_function(_Shop.find)  # the function itself: `self` is a parameter
    assert plain.required == ["self", "name"]


def test_a_method_of_an_unhashable_object_makes_a_tool() -> None:
    tool = Tool.from_function(_Unhashable().__call__)
    assert tool.required == ["query"] and tool.description == "Answer a query."
