"""A policy backed by any OpenAI-compatible chat-completions server.

Works with vLLM, SGLang, `transformers serve` and the OpenAI API itself. The envs speak one
format, raw assistant text with Hermes tool calls (`<tool_call>{...}</tool_call>`); with
`native_tools` this module translates that history into native `tool_calls` / `tool_call_id`
messages on the way out and renders the server's native tool calls back into Hermes text on
the way in, so the env parses a single format whatever the server does.

Spec form on the CLI: `openai:<model>@<base_url>`.
"""

from __future__ import annotations

import json
import os
import random
import re
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from agents.base import Conversation, Message, Turn
from envs.toolcall import parse_turn

SPEC_EXAMPLE = "openai:Qwen/Qwen2.5-0.5B-Instruct@http://127.0.0.1:8000/v1"
_SPEC = re.compile(r"^(?P<model>[^\s]+?)@(?P<base_url>https?://\S+)$")
_RETRYABLE_ERRORS = (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError)


class PolicyError(RuntimeError):
    """A policy could not produce a turn: the server refused the request, or retries ran out."""


class OpenAIPolicy:
    """Takes turns by POSTing each conversation to `{base_url}/chat/completions`.

    Requests in a batch run concurrently on one shared `httpx.Client`; results keep the input
    order. 429 (honouring `Retry-After`), 5xx, timeouts and connection errors are retried with
    exponential backoff and seeded jitter (`seed`); a `Retry-After` is capped at
    `max_retry_after_s`; any other 4xx raises `PolicyError` at once. `sleep` is injectable so
    tests never wait. The API key defaults to `$OPENAI_API_KEY`, then `$CGYM_API_KEY`, and is
    sent only as an `Authorization: Bearer` header, never logged or shown in `repr`.
    """

    def __init__(
        self,
        model: str,
        base_url: str,
        *,
        api_key: str | None = None,
        temperature: float = 0.7,
        top_p: float = 1.0,
        max_tokens: int = 512,
        timeout_s: float = 60.0,
        max_retries: int = 4,
        backoff_s: float = 0.5,
        max_retry_after_s: float = 30.0,
        concurrency: int = 8,
        native_tools: bool = True,
        seed: int = 0,
        client: httpx.Client | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        _validate(model, base_url, temperature, top_p, max_tokens, max_retries, backoff_s, concurrency)
        self.model = model
        self.base_url = base_url.rstrip("/")
        self.name = f"openai:{model}@{self.base_url}"
        self.temperature = temperature
        self.top_p = top_p
        self.max_tokens = max_tokens
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_retry_after_s = max_retry_after_s
        self.concurrency = concurrency
        self.native_tools = native_tools
        self._api_key = api_key or os.environ.get("OPENAI_API_KEY") or os.environ.get("CGYM_API_KEY")
        self._owns_client = client is None
        self._client = client if client is not None else httpx.Client(timeout=timeout_s)
        self._sleep = sleep
        self._rng = random.Random(seed)
        self._rng_lock = threading.Lock()

    @classmethod
    def from_spec(cls, rest: str, **options: Any) -> OpenAIPolicy:
        """Build from the part of `openai:<model>@<base_url>` after `openai:`."""
        match = _SPEC.match(rest.strip())
        if match is None:
            raise ValueError(
                f"bad openai policy spec {('openai:' + rest)!r}: expected openai:<model>@<base_url> "
                f"with an http(s) base URL, e.g. {SPEC_EXAMPLE}"
            )
        return cls(match["model"], match["base_url"], **options)

    def __repr__(self) -> str:  # never shows the API key
        return f"OpenAIPolicy(model={self.model!r}, base_url={self.base_url!r})"

    def close(self) -> None:
        """Close the HTTP client if this policy created it."""
        if self._owns_client:
            self._client.close()

    def __enter__(self) -> OpenAIPolicy:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---- taking turns ----

    def act(self, batch: Sequence[Conversation]) -> list[Turn]:
        """Return one turn per conversation, in input order."""
        if not batch:
            return []
        if len(batch) == 1:
            return [self._act_one(batch[0])]
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(batch))) as pool:
            return list(pool.map(self._act_one, batch))

    def _act_one(self, conversation: Conversation) -> Turn:
        data = self._post(self.request_body(conversation))
        return turn_from_response(data)

    def request_body(self, conversation: Conversation) -> dict[str, Any]:
        """The JSON body sent to `/chat/completions` for this conversation."""
        body: dict[str, Any] = {
            "model": self.model,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "max_tokens": self.max_tokens,
        }
        if self.native_tools:
            body["messages"] = to_native_messages(conversation.messages)
            if conversation.tools:
                body["tools"] = [_as_tool(schema) for schema in conversation.tools]
        else:
            body["messages"] = to_plain_messages(conversation.messages)
        return body

    # ---- HTTP with retries ----

    def _post(self, body: dict[str, Any]) -> dict[str, Any]:
        url = f"{self.base_url}/chat/completions"
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        last_problem = ""
        for attempt in range(self.max_retries + 1):
            try:
                response = self._client.post(url, json=body, headers=headers)
            except _RETRYABLE_ERRORS as exc:
                last_problem = f"{type(exc).__name__}: {exc}"
                delay = self._backoff(attempt)
            else:
                if response.status_code < 400:
                    return _json_body(response)
                if response.status_code != 429 and response.status_code < 500:
                    raise PolicyError(f"{url} answered {response.status_code}: {_server_message(response)}")
                last_problem = f"HTTP {response.status_code}: {_server_message(response)}"
                retry_after = self._retry_after(response)
                delay = self._backoff(attempt) if retry_after is None else retry_after
            if attempt < self.max_retries:
                self._sleep(delay)
        raise PolicyError(f"{url} failed after {self.max_retries + 1} attempts; last error: {last_problem}")

    def _backoff(self, attempt: int) -> float:
        with self._rng_lock:
            jitter = self._rng.uniform(0.0, 0.25)
        return self.backoff_s * (2**attempt) * (1.0 + jitter)

    def _retry_after(self, response: httpx.Response) -> float | None:
        """`Retry-After` in seconds (capped), or None when absent or an HTTP date."""
        if response.status_code != 429:
            return None
        try:
            seconds = float(response.headers.get("Retry-After", ""))
        except ValueError:
            return None
        return min(max(seconds, 0.0), self.max_retry_after_s)


# ---- message conversion ----


def to_native_messages(messages: Sequence[Message]) -> list[Message]:
    """Hermes-text history -> OpenAI messages with native `tool_calls` and `tool_call_id`s.

    An assistant turn's calls get synthetic ids `call_<turn>_<i>` (turn counted from 1) and the
    tool messages right after it take those ids in order. When the counts do not match (a
    malformed call, a missing result) that exchange is sent as plain text instead, because a
    server rejects tool messages that answer no call.
    """
    out: list[Message] = []
    turn = 0
    i = 0
    while i < len(messages):
        message = messages[i]
        if message.get("role") != "assistant":
            out.append(_plain(message))
            i += 1
            continue
        turn += 1
        j = i + 1
        while j < len(messages) and messages[j].get("role") == "tool":
            j += 1
        out.extend(_native_exchange(message, messages[i + 1 : j], turn))
        i = j
    return out


def _native_exchange(assistant: Message, results: Sequence[Message], turn: int) -> list[Message]:
    parsed = parse_turn(assistant.get("content") or "")
    if not parsed.calls or parsed.errors or len(parsed.calls) != len(results):
        return [_plain(assistant), *_tool_results_as_user(results)]
    ids = [f"call_{turn}_{k}" for k in range(len(parsed.calls))]
    tool_calls = [
        {"id": call_id, "type": "function", "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}
        for call_id, call in zip(ids, parsed.calls)
    ]
    native: list[Message] = [{"role": "assistant", "content": parsed.content or None, "tool_calls": tool_calls}]
    native += [{"role": "tool", "tool_call_id": call_id, "content": _text(r)} for call_id, r in zip(ids, results)]
    return native


def to_plain_messages(messages: Sequence[Message]) -> list[Message]:
    """History as plain text: tool results become user messages wrapped in `<tool_response>`."""
    out: list[Message] = []
    i = 0
    while i < len(messages):
        j = i
        while j < len(messages) and messages[j].get("role") == "tool":
            j += 1
        if j > i:
            out.extend(_tool_results_as_user(messages[i:j]))
            i = j
        else:
            out.append(_plain(messages[i]))
            i += 1
    return out


def _tool_results_as_user(results: Sequence[Message]) -> list[Message]:
    """Consecutive tool results as one user message, as Qwen/Hermes templates render them."""
    if not results:
        return []
    blocks = [f"<tool_response>\n{_text(r)}\n</tool_response>" for r in results]
    return [{"role": "user", "content": "\n".join(blocks)}]


def _plain(message: Message) -> Message:
    return {"role": message["role"], "content": _text(message)}


def _text(message: Message) -> str:
    content = message.get("content")
    return content if isinstance(content, str) else json.dumps(content)


def _as_tool(schema: dict[str, Any]) -> dict[str, Any]:
    """Accept both `{"type": "function", "function": {...}}` and a bare function schema."""
    return schema if "type" in schema else {"type": "function", "function": schema}


# ---- response conversion ----


def turn_from_response(data: dict[str, Any]) -> Turn:
    """The first choice of a chat-completions response as a Turn with Hermes tool-call text."""
    try:
        choice = data["choices"][0]
        message = choice["message"]
    except (KeyError, IndexError, TypeError) as exc:
        raise PolicyError(f"the server's response has no choices[0].message: {_clip(json.dumps(data))}") from exc
    text = message.get("content") or ""
    calls = [hermes_call(tc) for tc in message.get("tool_calls") or []]
    if calls:
        text = "\n".join([text.strip(), *calls]) if text.strip() else "\n".join(calls)
    return Turn(text=text, truncated=choice.get("finish_reason") == "length")


def hermes_call(tool_call: dict[str, Any]) -> str:
    """One native tool call as a Hermes `<tool_call>` block.

    Arguments the server could not give as valid JSON are passed on as the raw string, so the
    env reports the malformed call instead of this policy hiding it.
    """
    function = tool_call.get("function") or {}
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            pass
    payload = json.dumps({"name": function.get("name", ""), "arguments": arguments})
    return f"<tool_call>{payload}</tool_call>"


# ---- helpers ----


def _json_body(response: httpx.Response) -> dict[str, Any]:
    try:
        data = response.json()
    except ValueError as exc:
        raise PolicyError(f"the server answered {response.status_code} with non-JSON: {_clip(response.text)}") from exc
    if not isinstance(data, dict):
        raise PolicyError(f"the server answered with JSON that is not an object: {_clip(response.text)}")
    return data


def _server_message(response: httpx.Response) -> str:
    """The error text a server put in its body (OpenAI `{"error": {"message"}}` or FastAPI `detail`)."""
    try:
        data = response.json()
    except ValueError:
        return _clip(response.text) or response.reason_phrase
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        for key in ("error", "detail", "message"):
            if data.get(key):
                return str(data[key])
    return _clip(response.text)


def _clip(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _validate(
    model: str,
    base_url: str,
    temperature: float,
    top_p: float,
    max_tokens: int,
    max_retries: int,
    backoff_s: float,
    concurrency: int,
) -> None:
    checks = [
        (bool(model), f"model must be a non-empty name, got {model!r}"),
        (base_url.startswith(("http://", "https://")), f"base_url must be an http(s) URL, got {base_url!r}"),
        (temperature >= 0, f"temperature must be >= 0, got {temperature}"),
        (0 < top_p <= 1, f"top_p must be in (0, 1], got {top_p}"),
        (max_tokens >= 1, f"max_tokens must be >= 1, got {max_tokens}"),
        (max_retries >= 0, f"max_retries must be >= 0, got {max_retries}"),
        (backoff_s >= 0, f"backoff_s must be >= 0, got {backoff_s}"),
        (concurrency >= 1, f"concurrency must be >= 1, got {concurrency}"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)
