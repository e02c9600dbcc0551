"""A seeded fault plan: which requests to a mocked service fail, and how the failure looks.

The plan is deterministic in `(seed, request ordinal)`, so an episode replays exactly.

Rule: **a fault is never injected on two consecutive requests.** The request right after a
fault always succeeds, so a client that retries each failed request once always gets through.
At `rate=1` requests alternate fault / success; in general a fraction `rate / (1 + rate)` of
requests fails.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, get_args

import httpx

FaultKind = Literal["rate_limit", "server_error", "timeout", "malformed_json"]
FAULT_KINDS: tuple[FaultKind, ...] = get_args(FaultKind)
Serve = Callable[[], httpx.Response]


@dataclass(frozen=True)
class Fault:
    """One injected fault: its kind and the 0-based ordinal of the request it hit."""

    kind: FaultKind
    ordinal: int

    @property
    def status(self) -> int | None:
        """The HTTP status the client sees, `None` for a timeout (no response at all)."""
        return _STATUS[self.kind]


@dataclass
class FaultPlan:
    """Decides, request by request, whether to inject a fault and of which kind.

    `rate` is the chance that a request which may fail (one not right after a fault) fails;
    `kinds` restricts the faults drawn (all four by default). `log` lists injected faults.
    """

    rate: float
    seed: int
    kinds: tuple[FaultKind, ...] = FAULT_KINDS
    log: list[Fault] = field(default_factory=list, init=False, repr=False)
    _rng: random.Random = field(init=False, repr=False, compare=False)
    _ordinal: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not 0.0 <= self.rate <= 1.0:
            raise ValueError(f"fault rate must be in [0, 1], got {self.rate!r}")
        unknown = [k for k in self.kinds if k not in FAULT_KINDS]
        if unknown or not self.kinds:
            raise ValueError(
                f"fault kinds must be a non-empty subset of {FAULT_KINDS}, got {self.kinds!r}"
            )
        self._rng = random.Random(self.seed)

    def next(self) -> Fault | None:
        """The fault for the next request, or `None` when it should succeed."""
        ordinal, self._ordinal = self._ordinal, self._ordinal + 1
        # Draw both numbers every time, so the plan depends only on (seed, ordinal).
        roll, pick = self._rng.random(), self._rng.randrange(len(self.kinds))
        after_fault = bool(self.log) and self.log[-1].ordinal == ordinal - 1
        if after_fault or roll >= self.rate:
            return None
        fault = Fault(self.kinds[pick], ordinal)
        self.log.append(fault)
        return fault


def faulty_response(
    fault: Fault, request: httpx.Request, serve: Serve
) -> httpx.Response:
    """What a client sees when `fault` hits `request`; `serve()` builds the real response.

    Raises `httpx.ReadTimeout` for a timeout fault, as a real transport would.
    """
    return _RESPONDERS[fault.kind](request, serve)


def _rate_limit(request: httpx.Request, serve: Serve) -> httpx.Response:
    body = {"error": "rate_limited", "message": "Too many requests; retry after 1 second."}
    return httpx.Response(429, headers={"Retry-After": "1"}, json=body)


def _server_error(request: httpx.Request, serve: Serve) -> httpx.Response:
    body = {"error": "internal_error", "message": "The server hit an unexpected error."}
    return httpx.Response(500, json=body)


def _timeout(request: httpx.Request, serve: Serve) -> httpx.Response:
    raise httpx.ReadTimeout("The read operation timed out", request=request)


def _malformed_json(request: httpx.Request, serve: Serve) -> httpx.Response:
    """The real body cut in half: a proper prefix of a JSON object is never valid JSON."""
    content = serve().content
    return httpx.Response(
        200,
        headers={"Content-Type": "application/json"},
        content=content[: len(content) // 2],
    )


_RESPONDERS: dict[FaultKind, Callable[[httpx.Request, Serve], httpx.Response]] = {
    "rate_limit": _rate_limit,
    "server_error": _server_error,
    "timeout": _timeout,
    "malformed_json": _malformed_json,
}
_STATUS: dict[FaultKind, int | None] = {
    "rate_limit": 429,
    "server_error": 500,
    "timeout": None,
    "malformed_json": 200,
}
