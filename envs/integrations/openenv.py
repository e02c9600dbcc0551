"""Serve any registered env as an OpenEnv environment server, and use a served env as a Gymnasium env.

Server (`cgym serve ENV --port P`): `build_app` wraps the env in OpenEnv's `HTTPEnvServer`, so each
WebSocket session (`/ws`) gets its own env instance, sessions run concurrently up to
`max_sessions`, and a session's env is closed when its client disconnects (or, with
`session_timeout_s`, when it has been idle that long). The action is one assistant turn
(`TurnAction.text`); the observation (`TurnObservation`) carries what `info` holds locally, as JSON.
OpenEnv's per-request HTTP `/reset` and `/step` build a fresh env per call, which cannot hold a
multi-turn episode, so the app serves OpenEnv's production routes (`/ws`, `/health`, `/metadata`,
`/schema`) only.

Client (`envs.make("openenv/Remote-v0", url=...)`): `RemoteEnv` speaks to that server through
OpenEnv's own `EnvClient` and returns what the local env returns, so `cgym eval` and `cgym train`
run against a served env unchanged::

    cgym serve cgym/ApiReport-v0 --port 8000 --env-kwargs '{"difficulty": "medium"}'
    cgym eval --env openenv/Remote-v0 --env-kwargs '{"url": "http://127.0.0.1:8000"}' --policy hf:...

What does not cross the wire: the typed task object (`info["task"]` is a `SimpleTask` of the id
and prompt, so scripted agents, which read task fields, cannot play a remote env) and the
episode's env-specific trail (`Episode.extras`; the checks that read it run on the server). The
finished episode itself does (`episode_to_dict`), so critiques render remotely as they do locally.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import socket
import sys
import urllib.parse
import uuid
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import asdict
from typing import Any, ClassVar

import gymnasium as gym
from cgym.envs import bounded_json
from cgym.envs.core import CHARSET, MAX_ACTION_CHARS, MAX_OBSERVATION_CHARS, ResetNeeded, SimpleTask
from cgym.envs.critique import Critique
from cgym.envs.episode import Episode, StepRecord, ToolResult
from cgym.envs.errors import CgymError, InvalidEnvKwargError, MissingExtraError, check_choice
from gymnasium.spaces import Text

try:
    from openenv.core.client_types import StepResult
    from openenv.core.env_client import EnvClient
    from openenv.core.env_server import Action, ConcurrencyConfig, Environment, HTTPEnvServer, Observation, ServerMode, State
    from openenv.core.env_server.types import EnvironmentMetadata
    from pydantic import Field, ValidationError
    from starlette.websockets import WebSocketDisconnect, WebSocketDisconnected
    from websockets.exceptions import WebSocketException
except ImportError as exc:  # one line from the CLI instead of a traceback
    raise MissingExtraError(f"openenv/Remote-v0 and `cgym serve` need openenv-core ({exc.name} is missing): pip install 'critique-gym[interop]'") from exc
from cgym.envs.registration import make, registered, takes_kwarg
from cgym.envs.toolcall import ToolCall

REMOTE_ENV_ID = "openenv/Remote-v0"
_SCHEMES = ("http://", "https://", "ws://", "wss://")
# OpenEnv's client raises RuntimeError for an error message from the server; the rest are the connection's
_TRANSPORT_ERRORS = (RuntimeError, OSError, TimeoutError, asyncio.TimeoutError, WebSocketException)


class RemoteEnvError(CgymError, RuntimeError):
    """The env server could not be reached, refused a request, or does not speak `cgym serve`."""


# -- the wire format ------------------------------------------------------------------------
class TurnAction(Action):
    """One assistant turn: tool calls (Hermes `<tool_call>` blocks) or the final answer."""

    text: str = Field(description="The assistant's raw text for this turn")


class TurnObservation(Observation):
    """What the env returns after a reset or a turn: the observation text plus the JSON part of `info`."""

    text: str = Field(default="", description="The env's observation: the task prompt after reset, the tool results after a turn")
    messages: list[dict[str, Any]] = Field(default_factory=list, description="Chat messages the env added since the last observation")
    tools: list[dict[str, Any]] = Field(default_factory=list, description="The episode's tool schemas (OpenAI format); sent on reset only")
    task_id: str | None = Field(default=None, description="The episode's task id")
    turn: int = Field(default=0, description="Assistant turns taken so far")
    critique: dict[str, Any] | None = Field(default=None, description="This turn's first critique, if any")
    turn_reward: float = Field(default=0.0, description="This turn's reward from the step critiques so far (envs.credit)")
    turn_rewards: list[float] = Field(default_factory=list, description="Every turn's reward from the step critiques (last observation only)")
    truncated: bool = Field(default=False, description="The episode ended at the turn limit (done is True too)")
    success: bool | None = Field(default=None, description="Whether the episode succeeded (last observation only)")
    reward_breakdown: dict[str, float] = Field(default_factory=dict, description="Reward per rubric check (last observation only)")
    checks_passed: dict[str, bool] = Field(default_factory=dict, description="Which rubric checks passed (last observation only)")
    critiques: list[dict[str, Any]] = Field(default_factory=list, description="Every critique of the episode (last observation only)")
    episode: dict[str, Any] | None = Field(default=None, description="The finished episode record, see episode_to_dict (last observation only)")


def episode_to_dict(episode: Episode) -> dict[str, Any]:
    """A finished episode as JSON: its turns, calls, results and critiques, and the task's id, prompt and answer."""
    task = episode.task
    return _jsonable(
        {
            "task": {"id": getattr(task, "id", ""), "prompt": getattr(task, "prompt", ""), "ground_truth": getattr(task, "ground_truth", "")},
            "final_answer": episode.final_answer,
            "truncated": episode.truncated,
            "steps": [
                {
                    "index": step.index,
                    "action": step.action,
                    "final": step.final,
                    "critique": _critique_dict(step.critique),
                    "critiques": [_critique_dict(c) for c in step.critiques],
                    "calls": [asdict(call) for call in step.calls],
                    "results": [{"call": asdict(r.call), "ok": r.ok, "content": r.content, "critique": _critique_dict(r.critique)} for r in step.results],
                }
                for step in episode.steps
            ],
        }
    )


def episode_from_dict(data: Mapping[str, Any]) -> Episode:
    """The `Episode` that `episode_to_dict` wrote (its task a `SimpleTask`; `extras` stay on the server)."""
    steps = [
        StepRecord(
            index=step["index"],
            action=step["action"],
            calls=[ToolCall(**call) for call in step["calls"]],
            results=[ToolResult(ToolCall(**r["call"]), r["ok"], r["content"], _critique(r["critique"])) for r in step["results"]],
            critiques=[c for c in map(_critique, step.get("critiques", [step["critique"]])) if c is not None],
            final=step["final"],
        )
        for step in data["steps"]
    ]
    return Episode(SimpleTask(**data["task"]), steps, final_answer=data["final_answer"], truncated=data["truncated"])


def _critique_dict(critique: Critique | None) -> dict[str, Any] | None:
    return critique.to_dict() if critique is not None else None


def _critique(data: Mapping[str, Any] | None) -> Critique | None:
    return Critique(**data) if data is not None else None


def _jsonable(value: Any) -> Any:
    """`value` as plain JSON (a critique's `expected` / `got` may hold tuples or other objects)."""
    return json.loads(json.dumps(value, default=str))


# -- the server -----------------------------------------------------------------------------
class ServedEnv(Environment[TurnAction, TurnObservation, State]):
    """One session's env behind OpenEnv's `Environment` interface (the server builds one per session).

    `reset` takes Gymnasium's `seed` and `options` and, for envs with splits, the client's `split`
    (the trainer asks for "train", eval for "test"), which rebuilds the env when it changes.
    """

    SUPPORTS_CONCURRENT_SESSIONS: ClassVar[bool] = True

    def __init__(self, env_id: str, env_kwargs: Mapping[str, Any]) -> None:
        super().__init__()
        self.env_id = env_id
        self._kwargs = dict(env_kwargs)
        self._env = make(env_id, **self._kwargs)
        self._sent = 0  # messages already sent to the client
        self._episode_id: str | None = None
        self._task_id: str | None = None
        self._turn = 0

    def reset(self, seed: int | None = None, episode_id: str | None = None, options: dict[str, Any] | None = None, split: str | None = None) -> TurnObservation:
        _check_reset(seed, options, split)
        if split is not None and split != self._kwargs.get("split") and takes_kwarg(self.env_id, "split"):
            self._env.close()
            self._kwargs["split"] = split
            self._env = make(self.env_id, **self._kwargs)
        text, info = self._env.reset(seed=seed, options=options)
        self._sent, self._turn = 0, 0
        self._episode_id, self._task_id = episode_id or uuid.uuid4().hex, info["task_id"]
        return self._observe(text, info, tools=info["tools"])

    def step(self, action: TurnAction, timeout_s: float | None = None, **kwargs: Any) -> TurnObservation:
        text, reward, terminated, truncated, info = self._env.step(action.text)
        self._turn = info["turn"]
        observation = self._observe(text, info, reward=reward, done=terminated or truncated, truncated=truncated)
        if terminated or truncated:
            observation.success = info["success"]
            observation.reward_breakdown = info["reward_breakdown"]
            observation.checks_passed = info["checks_passed"]
            observation.critiques = _jsonable(info["critiques"])
            observation.turn_rewards = list(info.get("turn_rewards", []))
            observation.episode = episode_to_dict(info["episode"])
        return observation

    @property
    def state(self) -> State:
        """OpenEnv's state, plus the env id, the task id and the env's turn limit (`max_turns`)."""
        max_turns = getattr(self._env.unwrapped, "max_turns", None)
        return State(episode_id=self._episode_id, step_count=self._turn, env_id=self.env_id, task_id=self._task_id, max_turns=max_turns)

    def get_metadata(self) -> EnvironmentMetadata:
        spec = registered().get(self.env_id)
        return EnvironmentMetadata(name=self.env_id, description=spec.description if spec else self.env_id, version="critique-gym")

    def close(self) -> None:
        self._env.close()

    def _observe(self, text: str, info: dict[str, Any], **fields: Any) -> TurnObservation:
        messages = info["messages"][self._sent :]
        self._sent = len(info["messages"])
        return TurnObservation(text=text, messages=messages, task_id=info["task_id"], turn=info["turn"], critique=_jsonable(info["critique"]), turn_reward=info.get("turn_reward", 0.0), **fields)


def _check_reset(seed: Any, options: Any, split: Any) -> None:
    """A client's reset arguments, refused in its own terms (the env would name Python types)."""
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or seed < 0):
        raise ValueError(f"reset: 'seed' must be a non-negative integer or null, got {_json_kind(seed)}{f' ({seed})' if isinstance(seed, int) else ''}")
    if options is not None and not isinstance(options, dict):
        raise ValueError(f"reset: 'options' must be a JSON object or null, got {_json_kind(options)}")
    if split is not None and not isinstance(split, str):
        raise ValueError(f"reset: 'split' must be a string or null, got {_json_kind(split)}")


def _json_kind(value: Any) -> str:
    """What a decoded JSON value was, in JSON's words."""
    kinds = ((bool, "a boolean"), (int, "an integer"), (float, "a number"), (str, "a string"), (list, "an array"), (dict, "an object"))
    return next((name for kind, name in kinds if isinstance(value, kind)), "null" if value is None else "a value")


DEFAULT_SESSION_TIMEOUT_S = 300.0
_GONE = (WebSocketDisconnect, WebSocketDisconnected)  # the client left; OpenEnv's handler then writes to a closed socket
ROUTES = ("/ws", "/health", "/metadata", "/schema")  # what the docs name; OpenEnv's /mcp session routes are left out


def build_app(
    env_id: str,
    *,
    env_kwargs: Mapping[str, Any] | None = None,
    max_sessions: int = 64,
    session_timeout_s: float | None = DEFAULT_SESSION_TIMEOUT_S,
    sessions_per_client: int | None = None,
    token: str | None = None,
) -> Any:
    """A FastAPI app serving `env_id` over OpenEnv's HTTP/WebSocket protocol (its `HTTPEnvServer` is `app.state.env_server`).

    The env is built once here, so a bad id or kwarg fails before anything listens. A session idle
    for `session_timeout_s` is closed (None: never); one client address holds at most
    `sessions_per_client` sessions at once (None: `max_sessions`); with a `token`, every route
    but /health wants it (``Authorization: Bearer TOKEN`` or ``?token=TOKEN``).
    """
    from fastapi import FastAPI

    kwargs = dict(env_kwargs or {})
    make(env_id, **kwargs).close()
    config = ConcurrencyConfig(max_concurrent_envs=max_sessions, session_timeout=session_timeout_s)
    server = HTTPEnvServer(functools.partial(ServedEnv, env_id, kwargs), TurnAction, TurnObservation, concurrency_config=config)
    app = FastAPI(title=f"critique-gym: {env_id}", description=f"{env_id} {json.dumps(kwargs)} as an OpenEnv environment; sessions on /ws")
    server.register_routes(app, mode=ServerMode.PRODUCTION)  # no per-request /reset, /step: a fresh env each call cannot hold an episode
    app.router.routes[:] = [r for r in app.router.routes if getattr(r, "path", None) != "/mcp"]  # one session model: /ws
    app.add_middleware(_Guard, token=token, sessions_per_client=sessions_per_client or max_sessions)
    app.state.env_server = server
    return app


def serve(app: Any, sock: socket.socket) -> None:
    """Serve `app` (from `build_app`) on the bound `sock` until interrupted (`cgym serve`)."""
    import uvicorn

    cap_malloc_arenas()
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])


MALLOC_ARENAS = 2


def cap_malloc_arenas(arenas: int = MALLOC_ARENAS) -> bool:
    """Cap glibc's malloc arenas (where the C library has them); True if it took.

    OpenEnv runs each session's env calls on a thread of its own, and glibc gives new threads new
    arenas (up to 8 per core) that keep their freed pages: over 4,000 open-and-drop cycles the
    server's memory kept growing (+16 MB); with two arenas it levelled off after the first 1,000
    (`benchmarks/server_stress.py`). Call it before the server starts any thread.
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if sys.platform != "linux" or name is None:
        return False
    try:
        return bool(ctypes.CDLL(name).mallopt(-8, arenas))  # -8: M_ARENA_MAX in glibc's malloc.h
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False


class _Guard:
    """ASGI middleware in front of OpenEnv's routes: the token (when one is set), each client
    address's share of the sessions, and a quiet end to a socket its client has already closed
    (OpenEnv's /ws handler closes it again, and Starlette raises)."""

    def __init__(self, app: Any, *, token: str | None, sessions_per_client: int) -> None:
        self.app = app
        self.token = token
        self.sessions_per_client = sessions_per_client
        self.open: Counter[str] = Counter()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        if self.token and scope.get("path") != "/health" and not _carries(scope, self.token):
            return await _refuse(scope, receive, send, 401, "this server wants a token: Authorization: Bearer TOKEN, or ?token=TOKEN")
        if scope["type"] == "http":
            return await self.app(scope, receive, send)
        client = (scope.get("client") or ("unknown", 0))[0]
        if self.open[client] >= self.sessions_per_client:
            return await _refuse(scope, receive, send, 429, f"{client} holds {self.sessions_per_client} sessions already; close one first")
        self.open[client] += 1

        async def checked_receive() -> dict[str, Any]:
            """The next message, with frames OpenEnv would answer with a Python error answered here instead."""
            while True:
                message = await receive()
                problem = _bad_frame(message) if message["type"] == "websocket.receive" else None
                if problem is None:
                    return message
                await send({"type": "websocket.send", "text": json.dumps({"type": "error", "data": {"message": problem, "code": "INVALID_MESSAGE"}})})

        try:
            with contextlib.suppress(*_GONE):
                await self.app(scope, checked_receive, send)
        finally:
            self.open[client] -= 1
            if self.open[client] <= 0:
                del self.open[client]


FRAME_SHAPE = '{"type": "reset" | "step" | "state" | "close", "data": {...}}'


def _bad_frame(message: dict[str, Any]) -> str | None:
    """What is wrong with a client's WebSocket frame, in the client's terms; None if OpenEnv can read it."""
    raw = message.get("text")
    if raw is None:
        data = message.get("bytes") or b""
        raw = data.decode("utf-8", errors="replace")
    try:
        frame = bounded_json.loads(raw)
    except ValueError as exc:
        return f"not valid JSON ({exc.args[0][:120]}); a message is {FRAME_SHAPE}"
    if not isinstance(frame, dict):
        return f"a message is a JSON object {FRAME_SHAPE}, got a JSON {type(frame).__name__}"
    if not isinstance(frame.get("type", ""), str):
        return f"'type' must be a string, got {type(frame['type']).__name__}; a message is {FRAME_SHAPE}"
    if "data" in frame and not isinstance(frame["data"], dict):
        return f"'data' must be a JSON object, got {type(frame['data']).__name__}; a message is {FRAME_SHAPE}"
    return None


def _carries(scope: dict[str, Any], token: str) -> bool:
    """Whether a request carries `token`, as a bearer header or a query parameter (compared in constant time)."""
    headers = dict(scope.get("headers") or [])
    bearer = headers.get(b"authorization", b"").decode("latin-1").removeprefix("Bearer ").strip()
    query = urllib.parse.parse_qs(scope.get("query_string", b"").decode("latin-1")).get("token", [""])[0]
    return any(hmac.compare_digest(given.encode(), token.encode()) for given in (bearer, query) if given)


async def _refuse(scope: dict[str, Any], receive: Any, send: Any, status: int, reason: str) -> None:
    """Refuse before the app sees the request: an HTTP status with a JSON body, or a WebSocket closed at its handshake."""
    if scope["type"] == "websocket":
        await receive()  # websocket.connect
        await send({"type": "websocket.close", "code": 1008 if status == 401 else 1013, "reason": reason})
        return
    body = json.dumps({"error": {"code": status, "message": reason}}).encode()
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


# -- the client -----------------------------------------------------------------------------
class _TurnClient(EnvClient[TurnAction, TurnObservation, State]):
    """OpenEnv's WebSocket client, typed for `cgym serve`, carrying the server's token if it has one."""

    def __init__(self, *args: Any, token: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if token:
            self._ws_url += "?" + urllib.parse.urlencode({"token": token})

    def _step_payload(self, action: TurnAction) -> dict[str, Any]:
        return action.model_dump()

    def _parse_result(self, payload: dict[str, Any]) -> StepResult[TurnObservation]:
        observation = TurnObservation.model_validate({**payload.get("observation", {}), "reward": payload.get("reward"), "done": payload.get("done", False)})
        return StepResult(observation, observation.reward, observation.done)

    def _parse_state(self, payload: dict[str, Any]) -> State:
        return State.model_validate(payload)


class RemoteEnv(gym.Env[str, str]):
    """An env served by `cgym serve` (OpenEnv), behind the same Gymnasium contract as the local env.

    Args:
        url: the server's address, e.g. "http://127.0.0.1:8000" (ws:// works too).
        split: "train" or "test", for served envs that have splits (sent with every reset).
        render_mode: None or "ansi" (the transcript so far).
        timeout_s: how long to wait for the server's answer to one reset or step.
        token: the server's token, if it was started with one (`cgym serve --token`).

    Holds one server session (one env instance on the server) from construction to `close()`.
    """

    metadata: ClassVar[dict[str, Any]] = {"render_modes": ["ansi"], "render_fps": 1}

    def __init__(self, url: str, *, split: str | None = None, render_mode: str | None = None, timeout_s: float = 60.0, token: str | None = None) -> None:
        if not isinstance(url, str) or not url.startswith(_SCHEMES):
            raise InvalidEnvKwargError(
                f"url={url!r} is not the address of a `cgym serve` server; give one starting with {' or '.join(_SCHEMES)}, e.g. 'http://127.0.0.1:8000'"
            )
        if render_mode is not None:
            check_choice("render_mode", render_mode, self.metadata["render_modes"])
        self.url = url.rstrip("/")
        self.split = split
        self.render_mode = render_mode
        self.observation_space = Text(max_length=MAX_OBSERVATION_CHARS, min_length=0, charset=CHARSET)
        self.action_space = Text(max_length=MAX_ACTION_CHARS, min_length=0, charset=CHARSET)
        self._messages: list[dict[str, Any]] = []
        self._tools: list[dict[str, Any]] = []
        self._task: SimpleTask | None = None
        self._done = True
        self._client: Any = _TurnClient(base_url=self.url, message_timeout_s=timeout_s, token=token).sync()
        self.max_turns: int = self._connect()

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        request = {"seed": None if seed is None else int(seed), "options": options, "split": self.split}
        observation = self._request("reset", self._client.reset, **{k: v for k, v in request.items() if v is not None}).observation
        self._messages = list(observation.messages)
        self._tools = observation.tools
        self._task = SimpleTask(observation.task_id or "", observation.text)
        self._done = False
        return observation.text, self._info(observation)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self._done:
            raise ResetNeeded("call reset() before step(), and again after an episode ends")
        text = action if isinstance(action, str) else str(action)
        observation = self._request("step", self._client.step, TurnAction(text=text)).observation
        self._messages.extend(observation.messages)
        info = self._info(observation)
        if observation.done:
            self._done = True
            info.update(
                success=bool(observation.success),
                reward_breakdown=observation.reward_breakdown,
                checks_passed=observation.checks_passed,
                critiques=observation.critiques,
                turn_rewards=observation.turn_rewards,
                episode=episode_from_dict(observation.episode) if observation.episode is not None else None,
            )
        return observation.text, float(observation.reward or 0.0), observation.done and not observation.truncated, observation.truncated, info

    def render(self) -> str | None:
        if self.render_mode != "ansi":
            return None
        return "\n\n".join(f"[{m['role']}] {m['content']}" for m in self._messages)

    def close(self) -> None:
        """End the server session (the server closes its env); safe to call twice."""
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(*_TRANSPORT_ERRORS):
                client.close()
        super().close()

    def _info(self, observation: TurnObservation) -> dict[str, Any]:
        return {
            "messages": list(self._messages),
            "tools": self._tools,
            "critique": observation.critique,
            "turn_reward": observation.turn_reward,
            "turn": observation.turn,
            "task_id": observation.task_id,
            "task": self._task,
        }

    def _connect(self) -> int:
        """Open the session; returns the served env's turn limit (the trainer sizes its token budget by it)."""
        try:
            self._request("connect to", self._client.connect)
            state = self._request("read the state of", self._client.state)
            if not isinstance(getattr(state, "max_turns", None), int):
                raise RemoteEnvError(f"{self.url} is an OpenEnv server, but not `cgym serve`: its state has no max_turns")
        except RemoteEnvError:
            self.close()
            raise
        return state.max_turns

    def _request(self, what: str, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run one client call; a transport failure or a server-side error becomes a `RemoteEnvError`."""
        if self._client is None:
            raise RemoteEnvError(f"this RemoteEnv ({self.url}) is closed; make a new one")
        try:
            result = call(*args, **kwargs)
        except ValidationError as exc:
            raise RemoteEnvError(
                f"{self.url} answered {what} with something other than a `cgym serve` observation (another OpenEnv env?): {exc.error_count()} bad fields"
            ) from None
        except _TRANSPORT_ERRORS as exc:
            raise RemoteEnvError(f"could not {what} the env server at {self.url}: {exc or type(exc).__name__}") from None
        return result
