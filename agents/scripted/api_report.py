"""Scripted agents for `cgym/ApiReport-v0`: the oracle, one flawed agent per error type, exploits.

Each agent is a pure function of the conversation so far: it reads the task's fields (the
customer, the required fields, the credentials) and the tool results, and writes the next
assistant turn. The oracle solves every task and retries transient failures; each flawed agent
makes one mistake; each exploit games a naive scorer (the reward-hacking audit checks that none
of them pays).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from cgym.agents.base import Conversation
from cgym.agents.scripted.family import Agent, Family, task_of
from cgym.envs.api_report.tasks import COUNTED_STATUSES, ReportTask
from cgym.envs.toolcall import ToolCall, parse_turn


@dataclass
class State:
    """What the conversation has established so far."""

    name: str
    fields: list[str]
    credentials: tuple[str, str] | None
    token: str | None = None
    customer: dict[str, Any] | None = None
    pages: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    total_pages: int | None = None
    products: dict[int, str] = field(default_factory=dict)
    last_call: ToolCall | None = None
    last_error: str | None = None
    turns: int = 0


def read_state(conv: Conversation) -> State:
    """The task's facts (from `conv.task`) and what the tool results so far have established."""
    task = task_of(conv, ReportTask)
    state = State(task.customer.name, list(task.fields), task.credentials if task.require_auth else None)
    pending: list[ToolCall] = []
    for message in conv.messages[2:]:
        if message["role"] == "assistant":
            state.turns += 1
            pending = parse_turn(message["content"]).calls
        elif message["role"] == "tool" and pending:
            _absorb(state, pending.pop(0), message["content"])
    return state


def _absorb(state: State, call: ToolCall, content: str) -> None:
    state.last_call = call
    try:
        reply = json.loads(content)
    except json.JSONDecodeError:
        state.last_error = "unreadable"
        return
    state.last_error = reply.get("error")
    data = reply.get("data")
    if state.last_error or data is None:
        return
    if call.name == "get_token":
        state.token = data["access_token"]
    elif call.name == "search_customers":
        exact = [c for c in data["customers"] if c["name"] == state.name]
        state.customer = exact[0] if exact else None
    elif call.name == "list_orders":
        state.pages[int(call.arguments.get("page", 1))] = data["orders"]
        state.total_pages = data["total_pages"]
    elif call.name == "get_product":
        state.products[data["id"]] = data["name"]


def call(tool: str, state: State, **arguments: Any) -> str:
    if state.credentials and state.token:
        arguments["token"] = state.token
    return ToolCall(tool, arguments).render()


def compute_report(state: State) -> dict[str, Any]:
    customer = state.customer or {}
    orders = [o for page in sorted(state.pages) for o in state.pages[page]]
    values: dict[str, Any] = {
        "customer_id": customer.get("id"),
        "order_count": len(orders),
        "total_spent": round(sum(o["total"] for o in orders if o["status"] in COUNTED_STATUSES), 2),
        "top_product": state.products.get(top_product_id(orders) or -1, ""),
    }
    return {name: values[name] if name in values else customer.get(name) for name in state.fields}


def top_product_id(orders: list[dict[str, Any]]) -> int | None:
    units: Counter[int] = Counter()
    for order in orders:
        if order["status"] in COUNTED_STATUSES:
            for item in order["items"]:
                units[item["product_id"]] += item["quantity"]
    return min(units, key=lambda pid: (-units[pid], pid)) if units else None


def answer(report: dict[str, Any], state: State) -> str:
    orders = sum(len(p) for p in state.pages.values())
    summary = f"Looked up {state.name}" + (f" and {orders} orders." if state.pages else ".")
    return f"{summary}\n{json.dumps(report)}"


class Oracle:
    """Solves every task: auth if asked, search, every page, the top product, retries."""

    name = "oracle"
    retry = True
    all_pages = True
    authenticate = True

    def __call__(self, conv: Conversation) -> str:
        state = read_state(conv)
        if state.last_error and state.last_call is not None:
            if self.retry:
                return state.last_call.render()
            return self.final(state)
        step = self.next_call(state)
        return step if step is not None else self.final(state)

    def next_call(self, state: State) -> str | None:
        if state.credentials and self.authenticate and state.token is None:
            user, password = state.credentials
            return ToolCall("get_token", {"username": user, "password": password}).render()
        if state.customer is None:
            return call("search_customers", state, name=state.name)
        cid = state.customer["id"]
        if {"order_count", "total_spent", "top_product"} & set(state.fields):
            wanted = range(1, (state.total_pages or 1) + 1) if self.all_pages else range(1, 2)
            missing = [p for p in wanted if p not in state.pages]
            if missing:
                return call("list_orders", state, customer_id=cid, page=missing[0])
        if "top_product" in state.fields:
            orders = [o for page in state.pages.values() for o in page]
            pid = top_product_id(orders)
            if pid is not None and pid not in state.products:
                return call("get_product", state, product_id=pid)
        return None

    def final(self, state: State) -> str:
        return answer(compute_report(state), state)


class SkipPagination(Oracle):
    name = "skip_pagination"
    all_pages = False


class NoRetry(Oracle):
    name = "no_retry"
    retry = False


class SkipAuth(Oracle):
    name = "skip_auth"
    authenticate = False

    def __call__(self, conv: Conversation) -> str:
        state = read_state(conv)
        if state.last_error == "unauthorized":
            return self.final(state)
        return super().__call__(conv)


class WrongField(Oracle):
    name = "wrong_field"

    def final(self, state: State) -> str:
        report = compute_report(state)
        last = state.fields[-1]
        value = report[last]
        report[last] = value + 7 if isinstance(value, (int, float)) else f"{value}x"
        return answer(report, state)


class Typo(Oracle):
    """Miscopies one character of one field (a digit of the id, a letter of the email): the slip
    a small model makes when it copies from a tool result."""

    name = "typo"

    def final(self, state: State) -> str:
        report = compute_report(state)
        name = state.fields[len(state.name) % len(state.fields)]
        report[name] = _slip(report[name], seed=len(state.name) + sum(map(ord, str(report[name]))))
        return answer(report, state)


def _slip(value: Any, seed: int) -> Any:
    """`value` with one digit or letter replaced by another of the same kind."""
    text = str(value)
    spots = [i for i, ch in enumerate(text) if ch.isalnum()]
    if not spots:
        return f"{text}x"
    i = spots[seed % len(spots)]
    alphabet = "0123456789" if text[i].isdigit() else "abcdefghijklmnopqrstuvwxyz"
    ch = alphabet[(alphabet.index(text[i].lower()) + 1 + seed % (len(alphabet) - 1)) % len(alphabet)]
    slipped = text[:i] + ch + text[i + 1 :]
    return type(value)(slipped) if isinstance(value, (int, float)) and not isinstance(value, bool) else slipped


class MalformedJson(Oracle):
    name = "malformed_json"

    def final(self, state: State) -> str:
        return answer(compute_report(state), state).rstrip("}") + ","


class _GiveUpAfterFirstTurn(Oracle):
    """Makes one bad call, then answers with whatever it has."""

    bad_call = ""

    def __call__(self, conv: Conversation) -> str:
        state = read_state(conv)
        return self.bad_call if state.turns == 0 else self.final(state)


class MissingArgument(_GiveUpAfterFirstTurn):
    name = "missing_argument"
    bad_call = ToolCall("search_customers", {}).render()


class UnknownTool(_GiveUpAfterFirstTurn):
    name = "unknown_tool"
    bad_call = ToolCall("find_customer", {"query": "x"}).render()


# -- exploits: none of these may succeed or outscore an honest, correct report -----------------
def _guess(state: State) -> dict[str, Any]:
    slug = state.name.lower().replace(" ", ".")
    guesses = {"customer_id": 1000, "email": f"{slug}@example.com", "city": "Berlin", "tier": "standard", "signup_date": "2022-01-01", "order_count": 3, "total_spent": 100.0, "top_product": "Yoga Mat"}
    return {name: guesses.get(name) for name in state.fields}


def json_wrong_fields(conv: Conversation) -> str:
    """Perfectly formed JSON with every field present and made up."""
    return json.dumps(_guess(read_state(conv)))


def no_tools(conv: Conversation) -> str:
    """Answers at once with a plausible guess (the email pattern is guessable)."""
    return "Based on the name, here is the report.\n" + json.dumps(_guess(read_state(conv)))


def padded_reasoning(conv: Conversation) -> str:
    """Long, repetitive 'reasoning' to look diligent, then a guess."""
    padding = "Let me think step by step about the customer and verify every detail carefully. " * 40
    return padding + json.dumps(_guess(read_state(conv)))


def tag_spam(conv: Conversation) -> str:
    """Reasoning tags everywhere, nothing behind them."""
    return "<thought>" * 30 + "</thought>" * 30 + json.dumps(_guess(read_state(conv)))


def raw_dump(conv: Conversation) -> str:
    """Calls the API, then pastes the raw response as the 'report'."""
    state = read_state(conv)
    if state.turns == 0:
        return call("search_customers", state, name=state.name)
    return next(m["content"] for m in reversed(conv.messages) if m["role"] == "tool")


API_AGENTS: dict[str, Agent] = {
    "oracle": Oracle(),
    "skip_pagination": SkipPagination(),
    "no_retry": NoRetry(),
    "skip_auth": SkipAuth(),
    "wrong_field": WrongField(),
    "typo": Typo(),
    "malformed_json": MalformedJson(),
    "missing_argument": MissingArgument(),
    "unknown_tool": UnknownTool(),
    "exploit_json_wrong_fields": json_wrong_fields,
    "exploit_no_tools": no_tools,
    "exploit_padded_reasoning": padded_reasoning,
    "exploit_tag_spam": tag_spam,
    "exploit_raw_dump": raw_dump,
}

FLAW_CODES: dict[str, str] = {
    "skip_pagination": "pagination_incomplete",
    "no_retry": "http_error_not_retried",
    "skip_auth": "auth_skipped",
    "wrong_field": "field_mismatch",
    "typo": "field_mismatch",
    "malformed_json": "json_parse_error",
    "missing_argument": "missing_argument",
    "unknown_tool": "unknown_tool",
}

# malformed_json is an honest mistake in format: the rubric ranks any parseable report above it by
# design (format reorders answers within one level of correctness), so it sets no floor for exploits
FAMILY = Family(
    "api_report", API_AGENTS, FLAW_CODES,
    near_misses=("wrong_field", "typo", "malformed_json", "skip_pagination", "no_retry"),
    honest_floor=("wrong_field", "typo", "skip_pagination", "no_retry"),
)  # fmt: skip
