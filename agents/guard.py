"""`guarded:<spec>`: runtime validation and retries, the alternative to training.

Each turn is checked before it reaches the env: tool calls must parse, name a known tool and
carry the required arguments; a final answer must be a JSON object with the fields the task
lists (`conversation.task.fields`; a conversation without such a task gets its calls checked
only). A turn that fails is sent back to the policy with the validation error, up to `retries`
times. This shows what a guard fixes (format) and what only training fixes (wrong values).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from cgym.agents.base import Conversation, Policy, Turn
from cgym.envs.api_report.checks import extract_report
from cgym.envs.toolcall import ParsedTurn, parse_turn


@runtime_checkable
class ReportFields(Protocol):
    """A task whose final answer is a JSON object with these fields (e.g. `ReportTask`)."""

    fields: tuple[str, ...]


def validate(conv: Conversation, text: str) -> str | None:
    """The first problem with `text` as the next turn of `conv`, or None."""
    parsed = parse_turn(text)
    if parsed.is_tool_turn:
        return _validate_calls(conv, parsed)
    if not isinstance(conv.task, ReportFields):
        return None
    report = extract_report(text)
    if report.data is None:
        return f"Your answer is not a valid JSON report ({report.error}). Reply with the JSON object."
    missing = [f for f in conv.task.fields if f not in report.data]
    return f"Your report is missing the fields {missing}." if missing else None


def _validate_calls(conv: Conversation, parsed: ParsedTurn) -> str | None:
    if parsed.errors:
        return f"Your tool call could not be read: {parsed.errors[0].message}"
    schemas = {t["function"]["name"]: t["function"] for t in conv.tools if "function" in t}
    for call in parsed.calls:
        if call.name not in schemas:
            return f"There is no tool {call.name!r}; the tools are {sorted(schemas)}."
        required = schemas[call.name].get("parameters", {}).get("required", [])
        missing = [a for a in required if a not in call.arguments]
        if missing:
            return f"{call.name} needs the arguments {missing}."
    return None


class GuardedPolicy:
    """Validates each turn of `inner` and asks again (with the error) up to `retries` times."""

    def __init__(self, inner: Policy, retries: int = 2) -> None:
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        self.inner = inner
        self.retries = retries
        self.name = f"guarded:{inner.name}"
        self.rejections = 0

    def act(self, batch: Sequence[Conversation]) -> list[Turn]:
        # Scratch copies: retries must not leak into the real conversations (or token ledgers).
        scratch = [_scratch(c, list(c.messages)) for c in batch]
        turns = self.inner.act(scratch)
        for _ in range(self.retries):
            errors = {i: e for i, t in enumerate(turns) if (e := validate(batch[i], t.text))}
            if not errors:
                break
            self.rejections += len(errors)
            retry = [
                _scratch(batch[i], [*batch[i].messages, {"role": "assistant", "content": turns[i].text}, {"role": "user", "content": f"Validation error: {errors[i]} Try again."}])
                for i in errors
            ]
            for i, turn in zip(errors, self.inner.act(retry)):
                turns[i] = turn
        return [Turn(t.text, truncated=t.truncated) for t in turns]


def _scratch(conv: Conversation, messages: list[dict]) -> Conversation:
    """A copy of `conv` with other messages and no token ledger (same tools, task and env)."""
    return Conversation(messages, conv.tools, task=conv.task, env_id=conv.env_id)
