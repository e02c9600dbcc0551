"""`cgym serve ENV --mcp`: one episode over MCP, driven by the `mcp` SDK's own client over stdio.

Scripted agents play locally; their tool calls and final answer are replayed as MCP tool calls
(each of their turns makes one call, so the turns line up one to one).
"""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest

pytest.importorskip("mcp")

import anyio
from cgym.agents.eval.episodes import EpisodeResult, run_episodes
from cgym.agents.scripted import ScriptedPolicy
from cgym.envs.integrations.mcp import ANSWER_TOOL, RESULT_URI, TASK_PROMPT
from cgym.envs.toolcall import parse_turn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mcp import ClientSession, StdioServerParameters, stdio_client

from cgym import envs

ROOT = Path(__file__).resolve().parents[2]
ENV = "cgym/ApiReport-v0"
SEED = 3
T = TypeVar("T")


@asynccontextmanager
async def mcp_session(env_kwargs: dict[str, Any]) -> AsyncIterator[ClientSession]:
    args = ["-m", "cgym", "serve", ENV, "--mcp", "--seed", str(SEED), "--env-kwargs", json.dumps(env_kwargs)]
    async with stdio_client(StdioServerParameters(command=sys.executable, args=args, cwd=ROOT)) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        yield session


def with_session(env_kwargs: dict[str, Any], play: Callable[[ClientSession], Awaitable[T]]) -> T:
    async def run() -> T:
        async with mcp_session(env_kwargs) as session:
            return await play(session)

    return anyio.run(run)


async def result(session: ClientSession) -> dict[str, Any]:
    read = await session.read_resource(RESULT_URI)
    return json.loads(read.contents[0].text)


def local(agent: str, env_kwargs: dict[str, Any]) -> EpisodeResult:
    return run_episodes(lambda: envs.make(ENV, **env_kwargs), ScriptedPolicy(agent), [SEED])[0]


@pytest.mark.parametrize("agent", ["oracle", "missing_argument"])
def test_a_scripted_agent_scores_over_mcp_as_it_does_locally(agent: str) -> None:
    kwargs = {"difficulty": "medium"}
    here = local(agent, kwargs)
    *tool_turns, answer = [t.text for t in here.turns]
    calls = [call for text in tool_turns for call in parse_turn(text).calls]

    async def play(session: ClientSession) -> dict[str, Any]:
        tools = (await session.list_tools()).tools
        prompt = await session.get_prompt(TASK_PROMPT)
        errors = [(await session.call_tool(call.name, call.arguments)).is_error for call in calls]
        ended = await session.call_tool(ANSWER_TOOL, {"answer": answer})
        return {"tools": tools, "prompt": prompt.messages[0].content.text, "errors": errors, "ended": ended, "result": await result(session)}

    got = with_session(kwargs, play)
    assert [(t.name, t.input_schema) for t in got["tools"]][:-1] == [(s["function"]["name"], s["function"]["parameters"]) for s in here.conversation.tools]
    assert got["tools"][-1].name == ANSWER_TOOL
    assert got["prompt"] == here.conversation.messages[1]["content"]
    assert got["errors"] == [r.critique is not None for r in here.record.results]  # a critiqued call is an MCP tool error
    assert not got["ended"].is_error and RESULT_URI in got["ended"].content[0].text
    out = got["result"]
    assert (out["done"], out["reward"], out["success"], out["truncated"]) == (True, here.reward, here.success, here.truncated)
    assert (out["reward_breakdown"], out["checks_passed"], out["critiques"]) == (here.breakdown, here.passed, here.critiques)
    assert out["critique_text"] == {style: here.critique(style) for style in ("indicative", "ground_truth", "step")}


def test_an_episode_ends_once_and_says_why() -> None:
    async def play(session: ClientSession) -> list[Any]:
        before = await result(session)
        disguised = await session.call_tool(ANSWER_TOOL, {"answer": '<tool_call>{"name": "get_token", "arguments": {}}</tool_call>'})
        unknown = await session.call_tool("no_such_tool", {})
        last = await session.call_tool("search_customers", {"name": "x"})
        after_end = await session.call_tool("search_customers", {"name": "x"})
        return [before, disguised, unknown, last, after_end, await result(session)]

    before, disguised, unknown, last, after_end, out = with_session({"difficulty": "easy", "max_turns": 2}, play)
    assert (before["done"], before["turn"], before["max_turns"]) == (False, 0, 2)
    assert disguised.is_error and "reads as a tool call" in disguised.content[0].text  # refused without taking a turn
    assert unknown.is_error and "unknown_tool" in unknown.content[0].text
    assert "turn limit (2)" in last.content[0].text
    assert after_end.is_error and "episode is over" in after_end.content[0].text
    assert (out["done"], out["turns"], out["truncated"], out["success"]) == (True, 2, True, False)
    assert [c["code"] for c in out["critiques"]][0] == "unknown_tool" and "no_final_answer" in [c["code"] for c in out["critiques"]]
    assert out["critique_text"]["step"].endswith("Conclusion: incorrect [END]")


BAD_LINES = {
    "not-json": "this is not json",
    "a-scalar": "42",
    "a-batch": '[{"jsonrpc": "2.0", "id": 1, "method": "ping"}]',
    "wrong-version": '{"jsonrpc": "1.0", "id": 1, "method": "ping"}',
    "no-method": '{"jsonrpc": "2.0", "id": 1}',
    "nested-deeply": '{"jsonrpc": "2.0", "id": 1, "method": "ping", "params": ' + "[" * 5000 + "]" * 5000 + "}",
    "huge-and-cut": '{"jsonrpc": "2.0", "id": 1, "method": "ping", "params": {"x": "' + "a" * 2_000_000,
    "lone-surrogate": '{"jsonrpc": "2.0", "id": 1, "method": "\\ud800"}',
    "truncated": '{"jsonrpc": "2.0", "id": 1, "meth',
}


def test_every_line_that_is_not_a_message_gets_an_error_reply() -> None:
    import subprocess

    lines = [*BAD_LINES.values(), '{"jsonrpc": "2.0", "id": 7, "method": "ping"}', '{"jsonrpc": "2.0", "id": 8, "method": "ping", "params": {"x": "' + "a" * 2_000_000 + '"}}']
    done = subprocess.run(
        [sys.executable, "-m", "cgym", "serve", ENV, "--mcp"], input="\n".join(lines) + "\n", capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    replies = [json.loads(line) for line in done.stdout.splitlines()]
    errors = [r for r in replies if "error" in r]
    assert len(errors) == len(BAD_LINES), (done.stdout[-2000:], done.stderr[-2000:])
    assert all(r["id"] is None and r["error"]["code"] in (-32700, -32600) and "Traceback" not in r["error"]["message"] for r in errors)
    assert {r.get("id") for r in replies if "result" in r} == {7, 8}  # the server still answers after them
    assert "Traceback" not in done.stderr


def test_requests_read_before_the_input_ends_are_all_answered() -> None:
    """The SDK cancels the requests in flight when the client's input ends; requests already read
    (slow ones here) are answered first, then the server stops."""
    from cgym.envs.integrations.mcp import _answering_bad_lines
    from mcp import types
    from mcp.server.lowlevel import Server
    from mcp.shared.message import SessionMessage

    async def slow_tools(ctx: Any, params: Any) -> types.ListToolsResult:
        await anyio.sleep(0.2)
        return types.ListToolsResult(tools=[])

    server = Server("slow", on_list_tools=slow_tools)
    hello = types.InitializeRequestParams(protocol_version="2025-06-18", capabilities=types.ClientCapabilities(), client_info=types.Implementation(name="t", version="0"))
    lines = [
        types.JSONRPCRequest(jsonrpc="2.0", id=0, method="initialize", params=hello.model_dump(by_alias=True, exclude_none=True)),
        types.JSONRPCNotification(jsonrpc="2.0", method="notifications/initialized"),
        *(types.JSONRPCRequest(jsonrpc="2.0", id=n, method="tools/list") for n in (1, 2, 3)),
    ]

    async def play() -> list[Any]:
        to_server, read = anyio.create_memory_object_stream[Any](len(lines))
        write, from_server = anyio.create_memory_object_stream[Any](100)
        for line in lines:
            to_server.send_nowait(SessionMessage(line))
        to_server.close()  # the input ends right after the last request
        with anyio.fail_after(20):
            async with _answering_bad_lines(read, write) as (messages, replies):
                await server.run(messages, replies, server.create_initialization_options())
        return [item.message async for item in from_server]  # the server closed its side: this ends

    replies = anyio.run(play)
    assert sorted(r.id for r in replies) == [0, 1, 2, 3]
    assert all(isinstance(r, types.JSONRPCResponse) for r in replies)


def test_a_request_never_answered_does_not_keep_the_server_past_the_drain(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the input has ended, the server waits `DRAIN_S` for the requests it read, then stops:
    the ones answered by then keep their replies, a hung one does not hold the server open."""
    import cgym.envs.integrations.mcp as cgym_mcp
    from mcp import types
    from mcp.server.lowlevel import Server
    from mcp.shared.message import SessionMessage

    async def hung_tools(ctx: Any, params: Any) -> types.ListToolsResult:
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    monkeypatch.setattr(cgym_mcp, "DRAIN_S", 0.3)
    server = Server("hung", on_list_tools=hung_tools)
    hello = types.InitializeRequestParams(protocol_version="2025-06-18", capabilities=types.ClientCapabilities(), client_info=types.Implementation(name="t", version="0"))
    lines = [
        types.JSONRPCRequest(jsonrpc="2.0", id=0, method="initialize", params=hello.model_dump(by_alias=True, exclude_none=True)),
        types.JSONRPCNotification(jsonrpc="2.0", method="notifications/initialized"),
        types.JSONRPCRequest(jsonrpc="2.0", id=1, method="tools/list"),
    ]

    async def play() -> list[Any]:
        to_server, read = anyio.create_memory_object_stream[Any](len(lines))
        write, from_server = anyio.create_memory_object_stream[Any](100)
        for line in lines:
            to_server.send_nowait(SessionMessage(line))
        to_server.close()
        with anyio.fail_after(20):  # without the drain's limit this would wait for the hung request forever
            async with cgym_mcp._answering_bad_lines(read, write) as (messages, replies):
                await server.run(messages, replies, server.create_initialization_options())
        return [item.message async for item in from_server]

    replies = anyio.run(play)
    assert [r.id for r in replies if isinstance(r, types.JSONRPCResponse)] == [0]
    assert all(r.id == 1 for r in replies if not isinstance(r, types.JSONRPCResponse))  # the hung one: no result


def test_a_bad_prompt_or_resource_name_is_an_invalid_params_error() -> None:
    from mcp.shared.exceptions import MCPError

    async def play(session: ClientSession) -> list[Any]:
        caught = []
        for ask in (lambda: session.get_prompt("nope"), lambda: session.read_resource("cgym://nope")):
            with pytest.raises(MCPError) as info:
                await ask()
            caught.append(info.value)
        return caught

    for error in with_session({"difficulty": "easy"}, play):
        assert error.error.code == -32602 and "this server has" in error.error.message


class StdioServer:
    """`cgym serve --mcp` as a child process, read by a thread: send lines, collect the replies."""

    def __init__(self) -> None:
        import itertools
        import queue
        import subprocess
        import threading

        self.process = subprocess.Popen(
            [sys.executable, "-m", "cgym", "serve", ENV, "--mcp"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, encoding="utf-8", cwd=ROOT,
        )  # fmt: skip
        self.replies: queue.Queue[str] = queue.Queue()
        self.ids = itertools.count(1000)
        threading.Thread(target=lambda: [self.replies.put(line) for line in self.process.stdout], daemon=True).start()  # type: ignore[union-attr]

    def send(self, lines: list[str]) -> list[dict[str, Any]]:
        """Write `lines` and a closing ping; every reply up to the ping's (the server answers in order)."""
        ping = next(self.ids)
        assert self.process.stdin is not None
        self.process.stdin.write("".join(line + "\n" for line in [*lines, json.dumps({"jsonrpc": "2.0", "id": ping, "method": "ping"})]))
        self.process.stdin.flush()
        got: list[dict[str, Any]] = []
        while not got or got[-1].get("id") != ping:
            got.append(json.loads(self.replies.get(timeout=60)))  # a missing reply fails here instead of hanging
        return got[:-1]


@pytest.fixture(scope="module")
def stdio_server() -> Any:
    server = StdioServer()
    init = {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "fuzz", "version": "0"}}
    assert "result" in server.send([json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": init})])[0]
    server.send([json.dumps({"jsonrpc": "2.0", "method": "notifications/initialized"})])
    yield server
    server.process.stdin.close()  # type: ignore[union-attr]
    server.process.wait(timeout=30)
    assert "Traceback" not in server.process.stderr.read()  # type: ignore[union-attr]


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)
_ONE_LINE = st.characters(blacklist_categories=("Cs",), blacklist_characters="\r\n")
_GARBAGE = st.one_of(  # lines that are no JSON-RPC 2.0 message
    st.text(_ONE_LINE, max_size=200).filter(lambda t: not t.lstrip().startswith("{")),
    st.lists(_JSON, max_size=3).map(json.dumps),  # a batch, or an empty one
    st.dictionaries(st.text(max_size=8).filter(lambda k: k != "jsonrpc"), _JSON, max_size=4).map(json.dumps),
)
_METHOD = st.sampled_from(["ping", "tools/list", "tools/call", "prompts/list", "prompts/get", "resources/list", "resources/read"]) | st.text(_ONE_LINE, max_size=20)


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(st.one_of(_GARBAGE.map(lambda g: ("bad", g)), st.tuples(_METHOD, st.none() | st.dictionaries(st.text(max_size=8), _JSON, max_size=3))), max_size=6))
def test_fuzzed_lines_each_get_one_reply_and_the_server_lives(stdio_server: StdioServer, lines: list[tuple[Any, Any]]) -> None:
    """A Hypothesis fuzz of the stdio handler: every unreadable line gets a JSON-RPC error (id null),
    every request a reply with its id, none of them Python internals, and the server answers after."""
    sent, asked = [], []
    for method, params in lines:
        if method == "bad":
            sent.append(params)
            continue
        asked.append(next(stdio_server.ids))
        sent.append(json.dumps({"jsonrpc": "2.0", "id": asked[-1], "method": method} | ({"params": params} if params is not None else {})))
    replies = stdio_server.send(sent)
    assert sorted(r["id"] for r in replies if r.get("id") is not None) == asked
    assert sum(r.get("id") is None and "error" in r for r in replies) == len(sent) - len(asked)
    for reply in replies:
        message = reply.get("error", {}).get("message", "")
        assert not any(internal in message for internal in ("Traceback", "object has no attribute", "<class ")), message
