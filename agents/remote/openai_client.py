"""A policy backed by any OpenAI-compatible chat-completions server.

Works with vLLM, SGLang, `transformers serve` and the OpenAI API itself. The envs speak one
format, raw assistant text with Hermes tool calls (`<tool_call>{...}</tool_call>`); with
`native_tools` this module translates that history into native `tool_calls` / `tool_call_id`
messages on the way out and renders the server's native tool calls back into Hermes text on
the way in, so the env parses a single format whatever the server does.

Spec form on the CLI: `openai:<model>@<base_url>`, with transport options as a query string,
e.g. `openai:m@http://127.0.0.1:8000/v1?timeout_s=20&max_retries=2&deadline_s=60` (see
`SPEC_OPTIONS`).

Why httpx and not the `openai` SDK (weighed against openai 3.57): its timeout applies per
read, so a server that trickles its reply (300 bytes at 20 ms each) held
`OpenAI(timeout=0.3, max_retries=5)` for 6.3 s, which then raised a bare JSONDecodeError; this
client's `deadline_s` bounds the whole turn across retries (0.6 s in
tests/agents/test_openai_robustness.py), caps the reply's size before parsing, and reads Hermes
text as well as native tool calls.
"""

from __future__ import annotations

import json
import os
import random
import re
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
from cgym.agents.base import Conversation, Message, Turn
from cgym.agents.options import DEFAULT_SAMPLING, PolicySpecError, SamplingOptions
from cgym.envs import bounded_json
from cgym.envs.errors import CgymError, did_you_mean
from cgym.envs.toolcall import parse_turn

SPEC_EXAMPLE = "openai:Qwen/Qwen2.5-0.5B-Instruct@http://127.0.0.1:8000/v1"
_SPEC = re.compile(r"^(?P<model>[^\s]+?)@(?P<base_url>https?://[^\s?#]+)(?:\?(?P<options>\S*))?$")
_RETRYABLE_ERRORS = (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError)
MAX_REPLY_BYTES = 1 << 20  # a 512-token completion is a few KB; 1 MiB leaves room for long tool calls


def _flag(text: str) -> bool:
    if text.lower() not in ("true", "false", "1", "0"):
        raise ValueError(f"expected true or false, got {text!r}")
    return text.lower() in ("true", "1")


SPEC_OPTIONS: dict[str, tuple[Callable[[str], Any], str]] = {
    "timeout_s": (float, "a number of seconds"),
    "deadline_s": (float, "a number of seconds"),
    "max_retries": (int, "a whole number"),
    "backoff_s": (float, "a number of seconds"),
    "max_retry_after_s": (float, "a number of seconds"),
    "max_reply_bytes": (int, "a whole number"),
    "concurrency": (int, "a whole number"),
    "native_tools": (_flag, "true or false"),
}
"""Options a spec may set after `?`: the `OpenAIPolicy` keyword of that name, how to read it, and what it must be."""


class PolicyError(CgymError, RuntimeError):
    """A policy could not produce a turn: the server refused the request, answered with something
    that is not a chat completion, or gave no answer within the turn's deadline."""


class OpenAIPolicy:
    """Takes turns by POSTing each conversation to `{base_url}/chat/completions`.

    Requests in a batch run concurrently on one shared `httpx.Client`; results keep the input
    order. 429 (honouring `Retry-After`), 5xx, timeouts and connection errors are retried with
    exponential backoff and seeded jitter (`seed`); a `Retry-After` is capped at
    `max_retry_after_s`; any other 4xx raises `PolicyError` at once. Each attempt may take
    `timeout_s` and one turn, retries and waits included, at most `deadline_s`; a reply over
    `max_reply_bytes` or one that is not a well-formed chat completion raises `PolicyError`
    without a retry. `sleep` and `clock` are injectable so tests never wait. The API key
    defaults to `$OPENAI_API_KEY`, then `$CGYM_API_KEY`, and is
    sent only as an `Authorization: Bearer` header, never logged or shown in `repr`.
    """

    def __init__(
        self,
        model: str,
        base_url: str,
        *,
        api_key: str | None = None,
        sampling: SamplingOptions = DEFAULT_SAMPLING,
        timeout_s: float = 60.0,
        deadline_s: float = 120.0,
        max_retries: int = 4,
        backoff_s: float = 0.5,
        max_retry_after_s: float = 30.0,
        max_reply_bytes: int = MAX_REPLY_BYTES,
        concurrency: int = 8,
        native_tools: bool = True,
        client: httpx.Client | None = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        _validate(
            model=model, base_url=base_url, timeout_s=timeout_s,
            deadline_s=deadline_s, max_retries=max_retries, backoff_s=backoff_s, max_retry_after_s=max_retry_after_s,
            max_reply_bytes=max_reply_bytes, concurrency=concurrency,
        )  # fmt: skip
        self.model = model
        self.base_url = base_url.rstrip("/")
        self.name = f"openai:{model}@{self.base_url}"
        self.sampling = sampling  # max_new_tokens is the request's max_tokens
        self.timeout_s = timeout_s
        self.deadline_s = deadline_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_retry_after_s = max_retry_after_s
        self.max_reply_bytes = max_reply_bytes
        self.concurrency = concurrency
        self.native_tools = native_tools
        self._api_key = api_key or os.environ.get("OPENAI_API_KEY") or os.environ.get("CGYM_API_KEY")
        self._owns_client = client is None
        self._client = client if client is not None else httpx.Client(timeout=timeout_s)
        self._sleep = sleep
        self._clock = clock
        self._rng = random.Random(sampling.seed)
        self._rng_lock = threading.Lock()

    @classmethod
    def from_spec(cls, rest: str, **options: Any) -> OpenAIPolicy:
        """Build from the part of `openai:<model>@<base_url>` after `openai:`."""
        match = _SPEC.match(rest.strip())
        if match is None:
            raise PolicySpecError(
                f"bad openai policy spec {('openai:' + rest)!r}: expected openai:<model>@<base_url>[?option=value&...] "
                f"with an http(s) base URL, e.g. {SPEC_EXAMPLE}"
            )
        return cls(match["model"], match["base_url"], **options, **spec_options(match["options"] or "", "openai:" + rest))

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
        return [turn_from_response(data) for data in self.post_many([self.request_body(conv) for conv in batch])]

    def post_many(self, bodies: Sequence[dict[str, Any]], endpoint: str = "chat/completions") -> list[dict[str, Any]]:
        """`post` each body, up to `concurrency` at once on the shared client; replies in input order."""
        if len(bodies) <= 1:
            return [self.post(body, endpoint) for body in bodies]
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(bodies))) as pool:
            return list(pool.map(lambda body: self.post(body, endpoint), bodies))

    def request_body(self, conversation: Conversation) -> dict[str, Any]:
        """The JSON body sent to `/chat/completions` for this conversation."""
        body: dict[str, Any] = {
            "model": self.model,
            "temperature": self.sampling.temperature,
            "top_p": self.sampling.top_p,
            "max_tokens": self.sampling.max_new_tokens,
        }
        if self.native_tools:
            body["messages"] = to_native_messages(conversation.messages)
            if conversation.tools:
                body["tools"] = [_as_tool(schema) for schema in conversation.tools]
        else:
            body["messages"] = to_plain_messages(conversation.messages)
        return body

    # ---- HTTP with retries ----

    def post(self, body: dict[str, Any], endpoint: str = "chat/completions") -> dict[str, Any]:
        """POST `body` to `{base_url}/{endpoint}` with this policy's retries, deadline and reply cap;
        the reply's JSON object (`PolicyError` when there is none)."""
        url = f"{self.base_url}/{endpoint}"
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        deadline = self._clock() + self.deadline_s
        last_problem = ""
        for attempt in range(self.max_retries + 1):
            try:
                response, content = self._send(url, body, headers, deadline)
            except _RETRYABLE_ERRORS as exc:
                last_problem = f"{type(exc).__name__}: {exc}"
                delay = self._backoff(attempt)
            else:
                if response.status_code < 400:
                    return _json_body(response.status_code, content)
                if response.status_code != 429 and response.status_code < 500:
                    raise PolicyError(f"{url} answered {response.status_code}: {_server_message(response, content)}")
                last_problem = f"HTTP {response.status_code}: {_server_message(response, content)}"
                retry_after = self._retry_after(response)
                delay = self._backoff(attempt) if retry_after is None else retry_after
            if attempt == self.max_retries:
                break
            if self._clock() + delay >= deadline:
                raise PolicyError(f"{url} gave no answer within the turn deadline of {self.deadline_s:g}s ({attempt + 1} attempt{'s' if attempt else ''}); last error: {last_problem}")
            self._sleep(delay)
        attempts = f"{self.max_retries + 1} attempt" + ("s" if self.max_retries else "")
        raise PolicyError(f"{url} failed after {attempts}; last error: {last_problem}")

    def _send(self, url: str, body: dict[str, Any], headers: dict[str, str], deadline: float) -> tuple[httpx.Response, bytes]:
        """One POST, its body read up to `max_reply_bytes` and no later than `deadline`."""
        remaining = deadline - self._clock()
        if remaining <= 0:
            raise httpx.TimeoutException("the turn deadline passed before this attempt")
        chunks: list[bytes] = []
        size = 0
        with self._client.stream("POST", url, json=body, headers=headers, timeout=min(self.timeout_s, remaining)) as response:
            declared = response.headers.get("Content-Length", "")
            if declared.isdigit() and int(declared) > self.max_reply_bytes:
                raise PolicyError(f"{url} sent a reply of {int(declared):,} bytes, over max_reply_bytes={self.max_reply_bytes:,}")
            for chunk in response.iter_bytes():
                size += len(chunk)
                if size > self.max_reply_bytes:
                    raise PolicyError(f"{url} sent a reply of over max_reply_bytes={self.max_reply_bytes:,} bytes")
                if self._clock() > deadline:
                    raise httpx.ReadTimeout("the turn deadline passed while the reply was still arriving")
                chunks.append(chunk)
        return response, b"".join(chunks)

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
    """The first choice of a chat-completions response as a Turn with Hermes tool-call text.

    Raises `PolicyError` when the response is not shaped like a chat completion (no message
    object, content that is not a string or null, tool calls that are not function objects).
    """
    choices = data.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices else None
    message = choice.get("message") if isinstance(choice, dict) else None
    if not isinstance(message, dict):
        raise PolicyError(f"the server's response has no choices[0].message object: {_clip(json.dumps(data))}")
    content = _content_text(message.get("content"))
    tool_calls = message.get("tool_calls") or []
    if not isinstance(tool_calls, list):
        raise PolicyError(f"choices[0].message.tool_calls must be a list, got {type(tool_calls).__name__}: {_clip(json.dumps(tool_calls))}")
    text = content or ""
    calls = [hermes_call(tc) for tc in tool_calls]
    if calls:
        text = "\n".join([text.strip(), *calls]) if text.strip() else "\n".join(calls)
    return Turn(text=text, truncated=choice.get("finish_reason") == "length")


def _content_text(content: Any) -> str | None:
    """A message's content as text: a string, null, or a list of text parts (``{"type": "text", "text": ...}``,
    and refusals, whose text is kept); anything else raises `PolicyError`."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [part.get(part.get("type")) for part in content if isinstance(part, dict) and part.get("type") in ("text", "refusal")]
        if len(texts) == len(content) and all(isinstance(t, str) for t in texts):
            return "".join(texts)
    raise PolicyError(f"choices[0].message.content must be a string, null or a list of text parts, got {type(content).__name__}: {_clip(json.dumps(content))}")


def hermes_call(tool_call: dict[str, Any]) -> str:
    """One native tool call as a Hermes `<tool_call>` block.

    Arguments the server could not give as valid JSON are passed on as the raw string, so the
    env reports the malformed call instead of this policy hiding it; a call that is not a
    `{"function": {"name": str, "arguments": str | object}}` object raises `PolicyError`.
    """
    function = tool_call.get("function") if isinstance(tool_call, dict) else None
    name = function.get("name", "") if isinstance(function, dict) else None
    arguments = function.get("arguments", {}) if isinstance(function, dict) else None
    if not isinstance(name, str) or not isinstance(arguments, (str, dict)):
        raise PolicyError(f'a tool call must be {{"function": {{"name": str, "arguments": str | object}}}}, got {_clip(json.dumps(tool_call))}')
    if isinstance(arguments, str):
        try:
            arguments = bounded_json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            pass
    payload = json.dumps({"name": name, "arguments": arguments})
    return f"<tool_call>{payload}</tool_call>"


# ---- helpers ----


def _json_body(status: int, content: bytes) -> dict[str, Any]:
    text = content.decode("utf-8", errors="replace")
    try:
        data = bounded_json.loads(text)  # a server's body is read like model text: nesting and numbers bounded
    except ValueError as exc:
        raise PolicyError(f"the server answered {status} with JSON this client does not read ({exc.args[0][:80]}): {_clip(text)}") from None
    if not isinstance(data, dict):
        raise PolicyError(f"the server answered with JSON that is not an object: {_clip(text)}")
    return data


def _server_message(response: httpx.Response, content: bytes) -> str:
    """The error text a server put in its body (OpenAI `{"error": {"message"}}` or FastAPI `detail`)."""
    text = content.decode("utf-8", errors="replace")
    try:
        data = bounded_json.loads(text)
    except ValueError:
        return _clip(text) or response.reason_phrase
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        for key in ("error", "detail", "message"):
            if data.get(key):
                return _clip(str(data[key]))
    return _clip(text)


def _clip(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def spec_options(query: str, spec: str) -> dict[str, Any]:
    """The `?name=value&...` options of an openai spec as keyword arguments (see `SPEC_OPTIONS`)."""
    try:
        pairs = urllib.parse.parse_qsl(query, keep_blank_values=True, strict_parsing=True) if query else []
    except ValueError:
        raise PolicySpecError(f"cannot read the options {query!r} of {spec!r}: expected name=value pairs joined by '&'") from None
    options: dict[str, Any] = {}
    for name, value in pairs:
        if name not in SPEC_OPTIONS:
            raise PolicySpecError(f"{spec!r} sets an unknown option {name!r}; options: {', '.join(SPEC_OPTIONS)}.{did_you_mean(name, SPEC_OPTIONS)}")
        if name in options:
            raise PolicySpecError(f"{spec!r} sets the option {name!r} twice")
        read, kind = SPEC_OPTIONS[name]
        try:
            options[name] = read(value)
        except ValueError:
            raise PolicySpecError(f"{spec!r}: option {name}={value!r} is not {kind}") from None
    return options


def _validate(
    *, model: str, base_url: str, timeout_s: float, deadline_s: float,
    max_retries: int, backoff_s: float, max_retry_after_s: float, max_reply_bytes: int, concurrency: int,
) -> None:  # fmt: skip
    checks = [
        (bool(model), f"model must be a non-empty name, got {model!r}"),
        (base_url.startswith(("http://", "https://")), f"base_url must be an http(s) URL, got {base_url!r}"),
        (timeout_s > 0, f"timeout_s must be > 0 seconds, got {timeout_s}"),
        (deadline_s > 0, f"deadline_s must be > 0 seconds, got {deadline_s}"),
        (max_retries >= 0, f"max_retries must be >= 0, got {max_retries}"),
        (backoff_s >= 0, f"backoff_s must be >= 0, got {backoff_s}"),
        (max_retry_after_s >= 0, f"max_retry_after_s must be >= 0, got {max_retry_after_s}"),
        (max_reply_bytes >= 1, f"max_reply_bytes must be >= 1, got {max_reply_bytes}"),
        (concurrency >= 1, f"concurrency must be >= 1, got {concurrency}"),
    ]
    for ok, message in checks:
        if not ok:
            raise PolicySpecError(message)
