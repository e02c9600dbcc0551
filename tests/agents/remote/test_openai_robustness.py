"""OpenAIPolicy against a misbehaving server: malformed replies, huge replies, slow servers, spec options."""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
import respx
from cgym.agents.base import Conversation
from cgym.agents.options import PolicySpecError, SamplingOptions
from cgym.agents.remote.openai_client import OpenAIPolicy, PolicyError
from cgym.agents.spec import load_policy
from cgym.envs.errors import CgymError

BASE_URL = "http://mock-llm.test/v1"
ENDPOINT = f"{BASE_URL}/chat/completions"
CONVERSATION = Conversation(messages=[{"role": "user", "content": "Find Ada."}], tools=[])


def _reply(message: object) -> dict:
    return {"choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}


def _call(function: object) -> dict:
    return {"id": "c1", "type": "function", "function": function}


class FakeClock:
    """Monotonic time that moves only when the policy sleeps or a fake request takes time."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def policy(clock: FakeClock) -> Iterator[OpenAIPolicy]:
    with OpenAIPolicy("m", BASE_URL, api_key="k", sleep=clock.sleep, clock=clock) as p:
        yield p


# ---- malformed responses: a PolicyError that names the field, never an AttributeError ----


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"choices": "nope"}, "choices[0].message"),
        ({"choices": []}, "choices[0].message"),
        ({"choices": ["a string choice"]}, "choices[0].message"),
        (_reply("a string message"), "choices[0].message"),
        (_reply(["a", "list"]), "choices[0].message"),
        (_reply({"role": "assistant", "content": 42}), "content must be a string, null or a list of text parts, got int"),
        (_reply({"role": "assistant", "content": [{"type": "image_url", "image_url": "x"}]}), "content must be a string, null or a list of text parts, got list"),
        (_reply({"role": "assistant", "content": None, "tool_calls": {"function": {}}}), "tool_calls must be a list"),
        (_reply({"role": "assistant", "content": None, "tool_calls": ["search"]}), "a tool call must be"),
        (_reply({"role": "assistant", "content": None, "tool_calls": [_call("search")]}), "a tool call must be"),
        (_reply({"role": "assistant", "content": None, "tool_calls": [_call({"name": 7, "arguments": "{}"})]}), "a tool call must be"),
        (_reply({"role": "assistant", "content": None, "tool_calls": [_call({"name": "search", "arguments": 3})]}), "a tool call must be"),
    ],
    ids=["choices-string", "choices-empty", "choice-string", "message-string", "message-list", "content-int", "content-image-part", "tool-calls-object", "tool-call-string", "function-string", "name-int", "arguments-int"],
)
@respx.mock
def test_malformed_responses_raise_policy_error(policy: OpenAIPolicy, body: dict, field: str) -> None:
    route = respx.post(ENDPOINT).mock(return_value=httpx.Response(200, json=body))
    with pytest.raises(PolicyError, match=field.replace("[", r"\[").replace("]", r"\]")) as info:
        policy.act([CONVERSATION])
    assert isinstance(info.value, CgymError)
    assert route.call_count == 1  # a server that answers garbage is not asked again


@respx.mock
def test_a_well_formed_reply_still_works(policy: OpenAIPolicy) -> None:
    call = _call({"name": "search", "arguments": '{"q": "Ada"}'})
    respx.post(ENDPOINT).mock(return_value=httpx.Response(200, json=_reply({"role": "assistant", "content": None, "tool_calls": [call]})))
    [turn] = policy.act([CONVERSATION])
    assert turn.text == '<tool_call>{"name": "search", "arguments": {"q": "Ada"}}</tool_call>'


@respx.mock
def test_content_given_as_text_parts_is_read_as_its_text(policy: OpenAIPolicy) -> None:
    parts = [{"type": "text", "text": "Ada Lovelace "}, {"type": "text", "text": "wrote the first program."}]
    respx.post(ENDPOINT).mock(return_value=httpx.Response(200, json=_reply({"role": "assistant", "content": parts})))
    [turn] = policy.act([CONVERSATION])
    assert turn.text == "Ada Lovelace wrote the first program."


@pytest.mark.parametrize(
    "body",
    [
        b'{"choices": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
        b'{"choices": [{"message": {"role": "assistant", "content": ' + b'{"a": ' * 20_000 + b"1" + b"}" * 20_000 + b"}}]}",
        b'{"choices": [{"message": {"role": "assistant", "content": 1' + b"0" * 10_000 + b"}}]}",
    ],
    ids=["nested-lists", "nested-objects", "huge-number"],
)
@respx.mock
def test_a_reply_nested_too_deep_is_a_policy_error_not_a_recursion_error(policy: OpenAIPolicy, body: bytes) -> None:
    respx.post(ENDPOINT).mock(return_value=httpx.Response(200, content=body))
    with pytest.raises(PolicyError, match="does not read"):
        policy.act([CONVERSATION])


@respx.mock
def test_tool_arguments_nested_too_deep_pass_on_as_the_raw_string(policy: OpenAIPolicy) -> None:
    deep = "[" * 50_000 + "]" * 50_000
    call = _call({"name": "search", "arguments": deep})
    respx.post(ENDPOINT).mock(return_value=httpx.Response(200, json=_reply({"role": "assistant", "content": None, "tool_calls": [call]})))
    [turn] = policy.act([CONVERSATION])
    assert turn.text.startswith('<tool_call>{"name": "search", "arguments": "[[[')


# ---- reply size ----


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
@respx.mock
def test_a_reply_over_the_cap_is_refused(clock: FakeClock, declared: bool) -> None:
    payload = b'{"choices": [' + b" " * 5_000 + b"]}"
    content = payload if declared else iter([payload[i : i + 512] for i in range(0, len(payload), 512)])
    route = respx.post(ENDPOINT).mock(return_value=httpx.Response(200, content=content))
    with OpenAIPolicy("m", BASE_URL, max_reply_bytes=1_000, sleep=clock.sleep, clock=clock) as policy:
        with pytest.raises(PolicyError, match="max_reply_bytes=1,000"):
            policy.act([CONVERSATION])
    assert route.call_count == 1


@respx.mock
def test_the_default_cap_refuses_a_20_mb_reply(policy: OpenAIPolicy) -> None:
    respx.post(ENDPOINT).mock(return_value=httpx.Response(200, content=b" " * 20_000_000, headers={"Content-Type": "application/json"}))
    with pytest.raises(PolicyError, match="20,000,000 bytes"):
        policy.act([CONVERSATION])


# ---- timeouts, retries and the turn deadline ----


def _slow_server(clock: FakeClock) -> Callable[[httpx.Request], httpx.Response]:
    """Every request takes its whole timeout, then times out (as a hung server does)."""

    def handler(request: httpx.Request) -> httpx.Response:
        clock.now += request.extensions["timeout"]["read"]
        raise httpx.ReadTimeout("timed out", request=request)

    return handler


@respx.mock
def test_a_hung_server_holds_a_turn_no_longer_than_the_deadline(clock: FakeClock) -> None:
    route = respx.post(ENDPOINT).mock(side_effect=_slow_server(clock))
    with OpenAIPolicy("m", BASE_URL, timeout_s=60.0, deadline_s=120.0, max_retries=4, sleep=clock.sleep, clock=clock) as policy:
        with pytest.raises(PolicyError, match="within the turn deadline of 120s"):
            policy.act([CONVERSATION])
    assert clock.now <= 120.0  # was 60 s x 5 attempts + backoff = 310 s
    assert [call.request.extensions["timeout"]["read"] for call in route.calls] == [60.0, pytest.approx(60.0 - clock.sleeps[0])]


@respx.mock
def test_timeout_and_retries_come_from_the_spec(clock: FakeClock) -> None:
    route = respx.post(ENDPOINT).mock(side_effect=_slow_server(clock))
    policy = load_policy(f"openai:m@{BASE_URL}?timeout_s=5&max_retries=1&deadline_s=30&backoff_s=0", SamplingOptions())
    policy._clock, policy._sleep = clock, clock.sleep
    with pytest.raises(PolicyError, match="after 2 attempts"):
        policy.act([CONVERSATION])
    assert [call.request.extensions["timeout"]["read"] for call in route.calls] == [5.0, 5.0]
    assert clock.now == 10.0


@respx.mock
def test_a_retry_after_beyond_the_deadline_gives_up_at_once(clock: FakeClock) -> None:
    respx.post(ENDPOINT).mock(return_value=httpx.Response(429, headers={"Retry-After": "30"}))
    with OpenAIPolicy("m", BASE_URL, deadline_s=10.0, sleep=clock.sleep, clock=clock) as policy:
        with pytest.raises(PolicyError, match="turn deadline of 10s"):
            policy.act([CONVERSATION])
    assert clock.sleeps == []


class _Handler(http.server.BaseHTTPRequestHandler):
    """A real server that either never answers in time or trickles its reply a byte at a time."""

    mode = "hang"

    def do_POST(self) -> None:  # noqa: N802 - the http.server API
        self.rfile.read(int(self.headers["Content-Length"]))
        try:
            if self.mode == "hang":
                time.sleep(2.0)
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            for byte in b'{"choices": []}' * 20:  # each byte well within the read timeout
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
                time.sleep(0.02)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[tuple[str, type[_Handler]]]:
    handler = type("Handler", (_Handler,), {})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/v1", handler
    httpd.shutdown()
    httpd.server_close()


@pytest.mark.parametrize("mode", ["hang", "trickle"])
def test_a_real_slow_server_is_cut_off_at_the_deadline(server: tuple[str, type[_Handler]], mode: str) -> None:
    url, handler = server
    handler.mode = mode
    started = time.monotonic()
    with OpenAIPolicy("m", url, timeout_s=0.3, deadline_s=0.6, max_retries=5, backoff_s=0.05) as policy:
        with pytest.raises(PolicyError, match="deadline"):
            policy.act([CONVERSATION])
    assert time.monotonic() - started < 1.5


# ---- spec options ----


def test_spec_options_set_the_transport() -> None:
    policy = load_policy(f"openai:m@{BASE_URL}?timeout_s=7.5&deadline_s=40&max_retries=0&max_reply_bytes=2048&concurrency=2&native_tools=false")
    assert (policy.timeout_s, policy.deadline_s, policy.max_retries, policy.max_reply_bytes, policy.concurrency, policy.native_tools) == (7.5, 40.0, 0, 2048, 2, False)
    assert policy.base_url == BASE_URL and policy.name == f"openai:m@{BASE_URL}"


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ("timeout=5", "unknown option 'timeout'.*Did you mean 'timeout_s'"),
        ("timeout_s=soon", "timeout_s='soon' is not a number"),
        ("max_retries=1.5", "is not a whole number"),
        ("native_tools=maybe", "is not true or false"),
        ("timeout_s=0", "timeout_s must be > 0"),
        ("deadline_s=-1", "deadline_s must be > 0"),
        ("max_reply_bytes=0", "max_reply_bytes must be >= 1"),
        ("max_retries=1&max_retries=2", "twice"),
        ("max_retries", "name=value"),
    ],
    ids=["unknown", "not-a-number", "not-an-int", "not-a-flag", "timeout-zero", "deadline-negative", "cap-zero", "twice", "no-value"],
)
def test_bad_spec_options_raise_policy_spec_error(query: str, message: str) -> None:
    with pytest.raises(PolicySpecError, match=message):
        load_policy(f"openai:m@{BASE_URL}?{query}")
