"""The API-report env's log of HTTP calls, and what it says about how the agent worked."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

RETRYABLE = frozenset({"rate_limited", "server_error", "timeout", "malformed_json"})


@dataclass(frozen=True)
class ApiCall:
    """One tool call that reached the shop API, with its outcome (`error` None on success)."""

    step: int
    tool: str
    arguments: dict[str, Any]
    status: int | None
    error: str | None
    data: Any = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def retryable(self) -> bool:
        return self.error in RETRYABLE

    def key(self) -> tuple[str, tuple[tuple[str, Any], ...]]:
        """Identifies "the same request" regardless of the token passed."""
        args = tuple(sorted((k, v) for k, v in self.arguments.items() if k != "token" and not isinstance(v, (dict, list))))
        return self.tool, args


def unretried_failures(calls: list[ApiCall]) -> list[ApiCall]:
    """Transient failures (429, 5xx, timeouts, bad JSON) never followed by a successful retry."""
    succeeded = {c.key() for c in calls if c.ok}
    return [c for c in calls if c.retryable and c.key() not in succeeded]


def fetched_pages(calls: list[ApiCall], customer_id: int) -> set[int]:
    """The order pages of `customer_id` that came back successfully."""
    return {int(c.arguments.get("page", 1)) for c in calls if c.ok and c.tool == "list_orders" and c.arguments.get("customer_id") == customer_id}
