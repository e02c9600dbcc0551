from __future__ import annotations

import pytest
from cgym.envs.toolcall import ToolCall, parse_turn


@pytest.mark.parametrize(
    ("text", "calls"),
    [
        ('<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>', [ToolCall("a", {"x": 1})]),
        ('think\n<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": {"y": "z"}}</tool_call>', [ToolCall("a", {}), ToolCall("b", {"y": "z"})]),
        ('{"name": "a", "arguments": {"x": 2}}', [ToolCall("a", {"x": 2})]),
        ('```json\n{"name": "a", "arguments": {"x": 2}}\n```', [ToolCall("a", {"x": 2})]),
        ('<tool_call>{"name": "a", "arguments": "{\\"x\\": 3}"}</tool_call>', [ToolCall("a", {"x": 3})]),
    ],
    ids=["hermes", "two-calls", "bare-json", "fenced-bare-json", "double-encoded-arguments"],
)
def test_parses_tool_calls(text: str, calls: list[ToolCall]) -> None:
    parsed = parse_turn(text)
    assert parsed.calls == calls
    assert parsed.errors == []
    assert parsed.is_tool_turn


@pytest.mark.parametrize(
    ("text", "code"),
    [
        ('<tool_call>{"name": "a", "arguments": {"x": 1}</tool_call>', "json_parse_error"),
        ('<tool_call>{"name": "a"', "malformed_tool_call"),
        ('<tool_call>["a"]</tool_call>', "malformed_tool_call"),
        ('<tool_call>{"arguments": {}}</tool_call>', "malformed_tool_call"),
        ('<tool_call>{"name": "a", "arguments": [1]}</tool_call>', "malformed_tool_call"),
    ],
    ids=["bad-json", "unclosed", "not-object", "no-name", "arguments-not-object"],
)
def test_malformed_calls_become_errors(text: str, code: str) -> None:
    parsed = parse_turn(text)
    assert parsed.calls == []
    assert [e.code for e in parsed.errors] == [code]
    assert parsed.is_tool_turn


def test_json_parse_error_names_the_position() -> None:
    error = parse_turn('<tool_call>{"name": "a", "arguments": {"x": 1,}}</tool_call>').errors[0]
    assert "line 1 column" in error.message and "char" in error.message


@pytest.mark.parametrize(
    "text",
    ['{"customer_id": 3, "name": "Ann"}', "Here is the report: {\"email\": \"a@b.c\"}", "plain text", ""],
    ids=["report-with-name-key", "prose-and-json", "prose", "empty"],
)
def test_final_answers_are_not_tool_calls(text: str) -> None:
    parsed = parse_turn(text)
    assert not parsed.is_tool_turn
    assert parsed.content == text


def test_render_round_trips() -> None:
    call = ToolCall("list_orders", {"customer_id": 7, "page": 2})
    assert parse_turn(call.render()).calls == [call]


@pytest.mark.parametrize(
    "text",
    [
        '[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]',
        '```json\n[{"name": "a", "arguments": {"x": 1}}, {"name": "b"}]\n```',
    ],
    ids=["array", "fenced-array"],
)
def test_a_json_array_of_calls_is_parallel_calls(text: str) -> None:
    parsed = parse_turn(text)
    assert parsed.calls == [ToolCall("a", {"x": 1}), ToolCall("b", {})] and parsed.errors == []


def test_a_bad_call_in_an_array_is_an_error_beside_the_good_ones() -> None:
    parsed = parse_turn('[{"name": "a", "arguments": {}}, {"name": "b", "arguments": [1]}]')
    assert parsed.calls == [ToolCall("a", {})]
    assert [e.code for e in parsed.errors] == ["malformed_tool_call"]


@pytest.mark.parametrize(
    "text",
    ['[{"name": "Ann", "arguments": 2, "city": "Ghent"}]', "[]", '[{"name": "a", "arguments": {}}, 3]', '[{"name": "a", "arguments": {}}'],
    ids=["records-with-more-keys", "empty", "not-all-objects", "unclosed"],
)
def test_arrays_that_are_not_all_calls_are_final_answers(text: str) -> None:
    assert not parse_turn(text).is_tool_turn
