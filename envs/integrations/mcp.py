"""Expose one episode of an env over MCP (the official `mcp` SDK), so any MCP client can play it.

`cgym serve ENV --mcp [--seed N]` serves on stdin/stdout; one server session is one episode:

- **tools**: the env's own tools (their schemas as the MCP input schemas), plus `final_answer`.
  Each call is one env turn: a tool call steps the env with that call, `final_answer` steps it
  with the answer text and ends the episode. A call that earns a critique (bad arguments, an
  unknown tool, an API error) comes back with `isError` set and the env's error text.
- **prompt** `task`: the task as a user message; the env's system prompt is the server's `instructions`.
- **resource** `cgym://episode/result` (JSON): `{"done": false, ...}` until the episode ends, then its
  reward, rubric breakdown, critiques (as data) and the critique in all three renderings.

MCP has no turn with several calls in it: each call is a turn of its own, so parallel calls
count against the env's `max_turns` one by one.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import anyio
from cgym.envs.critique import CRITIQUE_STYLES, Critique, render
from cgym.envs.errors import CgymError
from cgym.envs.registration import make
from cgym.envs.toolcall import ToolCall
from mcp import types
from mcp.server.lowlevel import Server
from mcp.server.stdio import stdio_server
from mcp.shared.exceptions import MCPError
from mcp.shared.message import SessionMessage
from pydantic import ValidationError

ANSWER_TOOL = "final_answer"
RESULT_URI = "cgym://episode/result"
TASK_PROMPT = "task"
_ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "description": "The final answer, exactly as the task asks for it."}},
    "required": ["answer"],
}


class McpEpisode:
    """One episode of `env_id`, played one MCP tool call at a time (what one server session holds)."""

    def __init__(self, env_id: str, *, env_kwargs: Mapping[str, Any] | None = None, seed: int = 0, options: dict[str, Any] | None = None) -> None:
        self.env_id = env_id
        self.seed = seed
        self.env = make(env_id, **dict(env_kwargs or {}))
        self.prompt, info = self.env.reset(seed=seed, options=options)
        self.system_prompt: str = info["messages"][0]["content"]
        self.task_id: str | None = info["task_id"]
        self.tools: list[dict[str, Any]] = [schema.get("function", schema) for schema in info["tools"]]
        if any(tool["name"] == ANSWER_TOOL for tool in self.tools):
            raise CgymError(f"{env_id} has a tool named {ANSWER_TOOL!r}, which MCP serving keeps for the final answer; rename the env's tool")
        self.turn = 0
        self.result: dict[str, Any] | None = None

    def call(self, name: str, arguments: dict[str, Any]) -> tuple[str, bool]:
        """Take one turn: call the env's tool `name`, or give the final answer. Returns (text, is_error)."""
        if self.result is not None:
            return f"The episode is over; its result is in the resource {RESULT_URI}.", True
        if name == ANSWER_TOOL:
            answer = arguments.get("answer")
            if not isinstance(answer, str):
                return f"{ANSWER_TOOL} takes one string argument, 'answer'; got {json.dumps(arguments)[:200]}", True
            if self.env.unwrapped.turn_parser(answer).is_tool_turn:
                return f"The answer reads as a tool call; call that tool directly, or give {ANSWER_TOOL} the answer alone.", True
            action = answer
        else:
            action = ToolCall(name, arguments).render()
        text, reward, terminated, truncated, info = self.env.step(action)
        self.turn = info["turn"]
        if terminated or truncated:
            self.result = self._result(reward, truncated, info)
            end = (
                "The episode is over"
                if terminated
                else f"The turn limit ({self.env.unwrapped.max_turns}) was reached, so the episode is over without a final answer"
            )
            text = f"{text}\n\n{end}; its result is in the resource {RESULT_URI}.".lstrip()
        return text, info["critique"] is not None

    def result_json(self) -> str:
        """The `cgym://episode/result` resource: progress until the episode ends, then its score and critiques."""
        if self.result is None:
            return json.dumps({"done": False, "env_id": self.env_id, "task_id": self.task_id, "turn": self.turn, "max_turns": self.env.unwrapped.max_turns})
        return json.dumps(self.result, default=str)

    def close(self) -> None:
        self.env.close()

    def _result(self, reward: float, truncated: bool, info: dict[str, Any]) -> dict[str, Any]:
        critiques = [Critique(**c) for c in info["critiques"]]
        return {
            "done": True,
            "env_id": self.env_id,
            "task_id": self.task_id,
            "seed": self.seed,
            "turns": info["turn"],
            "reward": reward,
            "success": info["success"],
            "truncated": truncated,
            "reward_breakdown": info["reward_breakdown"],
            "checks_passed": info["checks_passed"],
            "critiques": info["critiques"],
            "turn_rewards": info.get("turn_rewards", []),
            "critique_text": {style: render(style, info["episode"], critiques, info["success"]) for style in CRITIQUE_STYLES},
        }


def build_server(episode: McpEpisode) -> Server:
    """A low-level MCP `Server` whose tools, `task` prompt and result resource play `episode`."""
    lock = anyio.Lock()  # one turn at a time, even if the client sends calls concurrently

    async def list_tools(ctx: Any, params: Any) -> types.ListToolsResult:
        tools = [types.Tool(name=t["name"], description=t.get("description", ""), input_schema=t.get("parameters", {"type": "object"})) for t in episode.tools]
        answer = types.Tool(name=ANSWER_TOOL, description="Give the final answer; this ends the episode.", input_schema=_ANSWER_SCHEMA)
        return types.ListToolsResult(tools=[*tools, answer])

    async def call_tool(ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        async with lock:
            text, is_error = await anyio.to_thread.run_sync(episode.call, params.name, dict(params.arguments or {}))
        return types.CallToolResult(content=[types.TextContent(type="text", text=text)], is_error=is_error)

    async def list_prompts(ctx: Any, params: Any) -> types.ListPromptsResult:
        return types.ListPromptsResult(prompts=[types.Prompt(name=TASK_PROMPT, description=f"The task of this {episode.env_id} episode")])

    async def get_prompt(ctx: Any, params: types.GetPromptRequestParams) -> types.GetPromptResult:
        if params.name != TASK_PROMPT:
            raise MCPError(types.INVALID_PARAMS, f"no prompt {params.name!r}; this server has {TASK_PROMPT!r}")
        message = types.PromptMessage(role="user", content=types.TextContent(type="text", text=episode.prompt))
        return types.GetPromptResult(description=f"{episode.env_id} task {episode.task_id}", messages=[message])

    async def list_resources(ctx: Any, params: Any) -> types.ListResourcesResult:
        result = types.Resource(
            name="result", uri=RESULT_URI, mime_type="application/json", description="The episode's reward, rubric and critiques, once it is over"
        )
        return types.ListResourcesResult(resources=[result])

    async def read_resource(ctx: Any, params: types.ReadResourceRequestParams) -> types.ReadResourceResult:
        if str(params.uri) != RESULT_URI:
            raise MCPError(types.INVALID_PARAMS, f"no resource {str(params.uri)!r}; this server has {RESULT_URI!r}")
        return types.ReadResourceResult(contents=[types.TextResourceContents(uri=RESULT_URI, mime_type="application/json", text=episode.result_json())])

    instructions = f"{episode.system_prompt}\n\nWhen you are done, call `{ANSWER_TOOL}` with your answer; that ends the episode."
    return Server(
        f"critique-gym {episode.env_id}",
        instructions=instructions,
        on_list_tools=list_tools,
        on_call_tool=call_tool,
        on_list_prompts=list_prompts,
        on_get_prompt=get_prompt,
        on_list_resources=list_resources,
        on_read_resource=read_resource,
    )


def serve_stdio(env_id: str, *, env_kwargs: Mapping[str, Any] | None = None, seed: int = 0) -> None:
    """Serve one episode of `env_id` over MCP on stdin/stdout until the client disconnects (`cgym serve --mcp`)."""
    episode = McpEpisode(env_id, env_kwargs=env_kwargs, seed=seed)
    server = build_server(episode)

    async def run() -> None:
        async with stdio_server() as (read, write), _answering_bad_lines(read, write) as (messages, replies):
            await server.run(messages, replies, server.create_initialization_options())

    try:
        anyio.run(run)
    finally:
        episode.close()


DRAIN_S = 30.0  # once the client's input ends, how long the requests it sent may still take to answer


@asynccontextmanager
async def _answering_bad_lines(read: Any, write: Any) -> AsyncIterator[tuple[Any, Any]]:
    """(messages, replies) streams for the server: every line of the client's that is not one
    JSON-RPC 2.0 message is answered at once with a JSON-RPC error (id null: it could not be read)
    instead of passed on, where the SDK would log it and leave the client waiting for a reply that
    never comes. When the input ends, the server sees its end only once every request read has
    been answered (within `DRAIN_S`): the SDK cancels the requests still in flight at that point,
    so a client that writes its requests and closes its side (`cgym serve --mcp < requests`) would
    lose the replies of the last ones."""
    send, receive = anyio.create_memory_object_stream[Any](0)
    replies, outgoing = anyio.create_memory_object_stream[Any](0)
    pending: set[Any] = set()

    async def pump() -> None:
        async with send:
            async for item in read:
                if isinstance(item, Exception):
                    await write.send(SessionMessage(types.JSONRPCError(jsonrpc="2.0", id=None, error=_bad_line(item))))
                    continue
                if isinstance(item.message, types.JSONRPCRequest):
                    pending.add(item.message.id)
                await send.send(item)
            with anyio.move_on_after(DRAIN_S):
                while pending:
                    await anyio.sleep(0.01)

    forwarded = anyio.Event()

    async def forward() -> None:
        async with outgoing:
            async for item in outgoing:
                await write.send(item)
                if isinstance(item.message, (types.JSONRPCResponse, types.JSONRPCError)):
                    pending.discard(item.message.id)
        await write.aclose()
        forwarded.set()

    async with anyio.create_task_group() as group:
        group.start_soon(pump)
        group.start_soon(forward)
        yield receive, replies
        await forwarded.wait()  # the server closed its side: every reply is written
        group.cancel_scope.cancel()


def _bad_line(exc: Exception) -> types.ErrorData:
    """What was wrong with a line, in the client's terms (never Python internals)."""
    problems = exc.errors(include_url=False, include_input=False) if isinstance(exc, ValidationError) else []
    if any(p["type"] == "json_invalid" for p in problems):
        return types.ErrorData(code=types.PARSE_ERROR, message=f"not valid JSON: {problems[0]['msg'].removeprefix('Invalid JSON: ')}")
    first = problems[0] if problems else None
    where = ".".join(str(part) for part in first["loc"] if not str(part).startswith("JSONRPC")) if first else ""
    said = f" ({where + ': ' if where else ''}{first['msg']})" if first else ""
    return types.ErrorData(code=types.INVALID_REQUEST, message=f"not a JSON-RPC 2.0 request, notification or response object{said}")
