from __future__ import annotations

import pytest

from envs.toolcall import ToolCall, parse_turn


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
