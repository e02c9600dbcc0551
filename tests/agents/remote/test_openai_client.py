"""OpenAIPolicy against a respx-mocked chat-completions endpoint."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import respx
from cgym.agents.base import Conversation, Policy
from cgym.agents.options import SamplingOptions
from cgym.agents.remote.openai_client import OpenAIPolicy, PolicyError, hermes_call, to_native_messages, to_plain_messages
from cgym.envs.toolcall import parse_turn

BASE_URL = "http://mock-llm.test/v1"
ENDPOINT = f"{BASE_URL}/chat/completions"

SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search customers.",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
    },
}


def completion(content: str | None = "hello", *, tool_calls: list | None = None, finish: str = "stop") -> dict:
    message: dict = {"role": "assistant", "content": content}
    if tool_calls is not None:
        message["tool_calls"] = tool_calls
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": "m",
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
    }


def native_call(name: str, arguments: dict | str, call_id: str = "x1") -> dict:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def conversation(text: str = "Find Ada.") -> Conversation:
    return Conversation(
        messages=[{"role": "system", "content": "You are an agent."}, {"role": "user", "content": text}],
        tools=[SEARCH_TOOL],
    )


class SleepRecorder:
    def __init__(self) -> None:
        self.calls: list[float] = []

    def __call__(self, seconds: float) -> None:
        self.calls.append(seconds)


@pytest.fixture
def sleeps() -> SleepRecorder:
    return SleepRecorder()


@pytest.fixture
def policy(sleeps: SleepRecorder, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("CGYM_API_KEY", raising=False)
    with OpenAIPolicy("m", BASE_URL, sleep=sleeps, backoff_s=0.5, max_retries=4) as p:
        yield p


def sent_json(route: respx.Route, index: int = -1) -> dict:
    return json.loads(route.calls[index].request.content)


# ---- responses -> turns ----


@respx.mock
def test_plain_content_is_returned_as_is(policy: OpenAIPolicy) -> None:
    text = '  Thinking.\n<tool_call>{"name": "search", "arguments": {"q": "Ada"}}</tool_call>'
    respx.post(ENDPOINT).mock(return_value=httpx.Response(200, json=completion(text)))
    [turn] = policy.act([conversation()])
    assert turn.text == text
    assert not turn.truncated
    assert turn.token_ids == () and turn.logprobs == ()


@respx.mock
def test_native_tool_calls_render_as_hermes_text(policy: OpenAIPolicy) -> None:
    calls = [native_call("search", {"q": "Ada"}, "a"), native_call("search", {"q": "Bob"}, "b")]
    respx.post(ENDPOINT).mock(return_value=httpx.Response(200, json=completion("Let me look.", tool_calls=calls)))
    [turn] = policy.act([conversation()])
    lines = turn.text.split("\n")
    assert lines[0] == "Let me look."
    assert len(lines) == 3
    parsed = parse_turn(turn.text)
    assert [(c.name, c.arguments) for c in parsed.calls] == [("search", {"q": "Ada"}), ("search", {"q": "Bob"})]
    assert parsed.content == "Let me look."


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [({"q": "Ada"}, {"q": "Ada"}), ('{"q": "Ada"}', {"q": "Ada"}), ("", {}), ("{not json", "{not json")],
    ids=["dict", "json-string", "empty", "invalid-json-kept-raw"],
)
def test_hermes_call_arguments(arguments: dict | str, expected: dict | str) -> None:
    rendered = hermes_call({"function": {"name": "search", "arguments": arguments}})
    assert rendered.startswith("<tool_call>") and rendered.endswith("</tool_call>")
    payload = json.loads(rendered[len("<tool_call>") : -len("</tool_call>")])
    assert payload == {"name": "search", "arguments": expected}


@respx.mock
def test_finish_reason_length_marks_truncated(policy: OpenAIPolicy) -> None:
    respx.post(ENDPOINT).mock(return_value=httpx.Response(200, json=completion("abc", finish="length")))
    [turn] = policy.act([conversation()])
    assert turn.truncated


@respx.mock
def test_response_without_choices_raises(policy: OpenAIPolicy) -> None:
    respx.post(ENDPOINT).mock(return_value=httpx.Response(200, json={"object": "error"}))
    with pytest.raises(PolicyError, match="choices"):
        policy.act([conversation()])


# ---- conversations -> requests ----


HISTORY = [
    {"role": "system", "content": "sys"},
    {"role": "user", "content": "Find Ada and Bob."},
    {
        "role": "assistant",
        "content": 'I will search.\n<tool_call>{"name": "search", "arguments": {"q": "Ada"}}</tool_call>\n'
        '<tool_call>{"name": "search", "arguments": {"q": "Bob"}}</tool_call>',
    },
    {"role": "tool", "name": "search", "content": "[1]"},
    {"role": "tool", "name": "search", "content": "[2]"},
    {"role": "assistant", "content": '<tool_call>{"name": "search", "arguments": {"q": "Cy"}}</tool_call>'},
    {"role": "tool", "name": "search", "content": "[]"},
]


@respx.mock
def test_native_request_has_tool_calls_ids_and_tools(policy: OpenAIPolicy) -> None:
    route = respx.post(ENDPOINT).mock(return_value=httpx.Response(200, json=completion("done")))
    policy.act([Conversation(messages=list(HISTORY), tools=[SEARCH_TOOL])])
    body = sent_json(route)
    assert body["model"] == "m" and body["max_tokens"] == 256  # SamplingOptions.max_new_tokens
    assert body["tools"] == [SEARCH_TOOL]
    messages = body["messages"]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "tool", "assistant", "tool"]
    first = messages[2]
    assert first["content"] == "I will search."
    assert [tc["id"] for tc in first["tool_calls"]] == ["call_1_0", "call_1_1"]
    assert [json.loads(tc["function"]["arguments"]) for tc in first["tool_calls"]] == [{"q": "Ada"}, {"q": "Bob"}]
    assert all(tc["type"] == "function" and tc["function"]["name"] == "search" for tc in first["tool_calls"])
    assert messages[3] == {"role": "tool", "tool_call_id": "call_1_0", "content": "[1]"}
    assert messages[4] == {"role": "tool", "tool_call_id": "call_1_1", "content": "[2]"}
    assert messages[5]["content"] is None
    assert messages[5]["tool_calls"][0]["id"] == "call_2_0"
    assert messages[6]["tool_call_id"] == "call_2_0"


def test_bare_function_schemas_are_wrapped(policy: OpenAIPolicy) -> None:
    body = policy.request_body(Conversation(messages=HISTORY[:2], tools=[SEARCH_TOOL["function"]]))
    assert body["tools"] == [SEARCH_TOOL]


def test_mismatched_exchange_falls_back_to_plain_text() -> None:
    malformed = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "<tool_call>{broken</tool_call>"},
        {"role": "tool", "name": "invalid_tool_call", "content": "Error [json_parse_error]: ..."},
    ]
    out = to_native_messages(malformed)
    assert out[1] == {"role": "assistant", "content": "<tool_call>{broken</tool_call>"}
    assert out[2]["role"] == "user"
    assert out[2]["content"] == "<tool_response>\nError [json_parse_error]: ...\n</tool_response>"
    assert all("tool_calls" not in m and m["role"] != "tool" for m in out)


@respx.mock
def test_plain_mode_sends_text_and_no_tools(sleeps: SleepRecorder) -> None:
    route = respx.post(ENDPOINT).mock(return_value=httpx.Response(200, json=completion("ok")))
    with OpenAIPolicy("m", BASE_URL, native_tools=False, sleep=sleeps) as policy:
        policy.act([Conversation(messages=list(HISTORY), tools=[SEARCH_TOOL])])
    body = sent_json(route)
    assert "tools" not in body
    messages = body["messages"]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert messages[2]["content"] == HISTORY[2]["content"]
    assert messages[3]["content"] == "<tool_response>\n[1]\n</tool_response>\n<tool_response>\n[2]\n</tool_response>"
    assert all("tool_calls" not in m for m in messages)
    assert to_plain_messages(HISTORY) == messages


# ---- retries ----


@respx.mock
def test_429_honours_retry_after(policy: OpenAIPolicy, sleeps: SleepRecorder) -> None:
    route = respx.post(ENDPOINT).mock(
        side_effect=[
            httpx.Response(429, headers={"Retry-After": "3"}, json={"error": {"message": "slow down"}}),
            httpx.Response(200, json=completion("ok")),
        ]
    )
    [turn] = policy.act([conversation()])
    assert turn.text == "ok"
    assert route.call_count == 2
    assert sleeps.calls == [3.0]


@respx.mock
def test_retry_after_is_capped(sleeps: SleepRecorder) -> None:
    respx.post(ENDPOINT).mock(
        side_effect=[httpx.Response(429, headers={"Retry-After": "3600"}), httpx.Response(200, json=completion())]
    )
    with OpenAIPolicy("m", BASE_URL, sleep=sleeps, max_retry_after_s=10.0) as policy:
        policy.act([conversation()])
    assert sleeps.calls == [10.0]


@respx.mock
def test_500_twice_then_success_backs_off_exponentially(policy: OpenAIPolicy, sleeps: SleepRecorder) -> None:
    route = respx.post(ENDPOINT).mock(
        side_effect=[httpx.Response(500), httpx.Response(503, text="busy"), httpx.Response(200, json=completion("ok"))]
    )
    [turn] = policy.act([conversation()])
    assert turn.text == "ok"
    assert route.call_count == 3
    first, second = sleeps.calls
    assert 0.5 <= first <= 0.5 * 1.25
    assert 1.0 <= second <= 1.0 * 1.25


def test_jitter_is_seeded() -> None:
    def delays(seed: int) -> list[float]:
        policy = OpenAIPolicy("m", BASE_URL, sampling=SamplingOptions(seed=seed))
        return [policy._backoff(attempt) for attempt in range(3)]

    assert delays(7) == delays(7)
    assert delays(7) != delays(8)


@pytest.mark.parametrize(
    "error",
    [httpx.ReadTimeout("read timed out"), httpx.ConnectError("connection refused")],
    ids=["timeout", "connect-error"],
)
@respx.mock
def test_transport_error_then_success(policy: OpenAIPolicy, sleeps: SleepRecorder, error: Exception) -> None:
    route = respx.post(ENDPOINT).mock(side_effect=[error, httpx.Response(200, json=completion("ok"))])
    [turn] = policy.act([conversation()])
    assert turn.text == "ok"
    assert route.call_count == 2
    assert len(sleeps.calls) == 1


@pytest.mark.parametrize(
    ("status", "body", "message"),
    [
        (400, {"error": {"message": "messages[1]: unknown role", "type": "invalid_request_error"}}, "unknown role"),
        (422, {"detail": "Unexpected fields in the request: {'foo'}"}, "Unexpected fields"),
        (401, {"error": "bad key"}, "bad key"),
    ],
    ids=["openai-400", "fastapi-422", "401"],
)
@respx.mock
def test_client_errors_raise_without_retry(
    policy: OpenAIPolicy, sleeps: SleepRecorder, status: int, body: dict, message: str
) -> None:
    route = respx.post(ENDPOINT).mock(return_value=httpx.Response(status, json=body))
    with pytest.raises(PolicyError, match=str(status)) as info:
        policy.act([conversation()])
    assert message in str(info.value)
    assert route.call_count == 1
    assert sleeps.calls == []


@respx.mock
def test_retries_exhausted_raise(policy: OpenAIPolicy, sleeps: SleepRecorder) -> None:
    route = respx.post(ENDPOINT).mock(return_value=httpx.Response(502, text="bad gateway"))
    with pytest.raises(PolicyError, match="after 5 attempts") as info:
        policy.act([conversation()])
    assert "502" in str(info.value) and "bad gateway" in str(info.value)
    assert route.call_count == 5
    assert len(sleeps.calls) == 4
    assert sleeps.calls == sorted(sleeps.calls)


# ---- batching, auth, specs ----


@respx.mock
def test_batch_order_is_kept_under_concurrency(sleeps: SleepRecorder) -> None:
    in_flight = 0
    peak = 0
    lock = threading.Lock()

    def echo(request: httpx.Request) -> httpx.Response:
        nonlocal in_flight, peak
        with lock:
            in_flight += 1
            peak = max(peak, in_flight)
        prompt = json.loads(request.content)["messages"][-1]["content"]
        time.sleep(0.05 if prompt.endswith(("0", "2", "4")) else 0.0)  # early items finish last
        with lock:
            in_flight -= 1
        return httpx.Response(200, json=completion(f"echo {prompt}"))

    respx.post(ENDPOINT).mock(side_effect=echo)
    batch = [conversation(f"task {i}") for i in range(6)]
    with OpenAIPolicy("m", BASE_URL, concurrency=3, sleep=sleeps) as policy:
        turns = policy.act(batch)
    assert [t.text for t in turns] == [f"echo task {i}" for i in range(6)]
    assert 1 < peak <= 3


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"OPENAI_API_KEY": "sk-openai", "CGYM_API_KEY": "sk-cgym"}, "Bearer sk-openai"),
        ({"CGYM_API_KEY": "sk-cgym"}, "Bearer sk-cgym"),
        ({}, None),
    ],
    ids=["openai-first", "cgym-fallback", "no-key"],
)
@respx.mock
def test_api_key_header_from_env(monkeypatch: pytest.MonkeyPatch, env: dict, expected: str | None) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("CGYM_API_KEY", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    route = respx.post(ENDPOINT).mock(return_value=httpx.Response(200, json=completion()))
    with OpenAIPolicy("m", BASE_URL) as policy:
        policy.act([conversation()])
        assert "sk-" not in repr(policy)
    assert route.calls.last.request.headers.get("Authorization") == expected


@respx.mock
def test_explicit_key_and_injected_client(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-env")
    route = respx.post(ENDPOINT).mock(return_value=httpx.Response(200, json=completion()))
    with httpx.Client() as client:
        policy = OpenAIPolicy("m", BASE_URL, api_key="sk-explicit", client=client)
        policy.act([conversation()])
        policy.close()
        assert not client.is_closed
    assert route.calls.last.request.headers["Authorization"] == "Bearer sk-explicit"


def test_policy_protocol_and_name() -> None:
    policy = OpenAIPolicy("m", BASE_URL + "/")
    assert isinstance(policy, Policy)
    assert policy.name == f"openai:m@{BASE_URL}"
    assert policy.act([]) == []


@pytest.mark.parametrize(
    ("rest", "model", "base_url"),
    [
        ("Qwen/Qwen2.5-0.5B@http://127.0.0.1:8000/v1", "Qwen/Qwen2.5-0.5B", "http://127.0.0.1:8000/v1"),
        ("gpt-4o-mini@https://api.openai.com/v1/", "gpt-4o-mini", "https://api.openai.com/v1"),
        ("org/model@dev@http://host:1/v1", "org/model@dev", "http://host:1/v1"),
    ],
    ids=["local", "https-trailing-slash", "at-in-model"],
)
def test_from_spec(rest: str, model: str, base_url: str) -> None:
    policy = OpenAIPolicy.from_spec(rest, sampling=SamplingOptions(temperature=0.0))
    assert (policy.model, policy.base_url, policy.sampling.temperature) == (model, base_url, 0.0)


@pytest.mark.parametrize(
    "rest",
    ["", "Qwen/Qwen2.5-0.5B-Instruct", "@http://127.0.0.1:8000/v1", "model@127.0.0.1:8000/v1", "model@"],
    ids=["empty", "no-url", "no-model", "no-scheme", "empty-url"],
)
def test_from_spec_errors_show_expected_form(rest: str) -> None:
    with pytest.raises(ValueError, match=r"openai:<model>@<base_url>"):
        OpenAIPolicy.from_spec(rest)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"concurrency": 0}, "concurrency"), ({"max_retries": -1}, "max_retries")],
    ids=["concurrency", "max-retries"],
)
def test_bad_options_raise_value_error(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        OpenAIPolicy("m", BASE_URL, **kwargs)
