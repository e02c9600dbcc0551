"""The record of one episode: every assistant turn, the calls it made and what came back."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from cgym.envs.critique import Critique
from cgym.envs.toolcall import ToolCall


@dataclass(frozen=True)
class ToolResult:
    """One executed call: `ok` is False when it produced a critique instead of data."""

    call: ToolCall
    ok: bool
    content: str
    critique: Critique | None = None


@dataclass
class StepRecord:
    """One assistant turn (1-based `index`)."""

    index: int
    action: str
    calls: list[ToolCall] = field(default_factory=list)
    results: list[ToolResult] = field(default_factory=list)
    critiques: list[Critique] = field(default_factory=list)
    """Every critique of this turn, in the order they arose (unreadable calls, then calls, then refusals)."""
    final: bool = False

    @property
    def critique(self) -> Critique | None:
        """The turn's first critique (None: the turn was fine)."""
        return self.critiques[0] if self.critiques else None

    def summary(self) -> str:
        """One line for step-level critiques: what the agent did at this turn."""
        if self.final:
            return f"gave the final answer {_clip(self.action.strip())!r}"
        if not self.calls:
            return f"wrote a tool call that could not be read: {_clip(self.action.strip())!r}"
        done = "; ".join(f"called {r.call.name}({_args(r.call.arguments)}) -> {'ok' if r.ok else 'error'}" for r in self.results)
        return done


@dataclass
class Episode:
    """Everything a check needs to score a finished episode."""

    task: Any
    steps: list[StepRecord] = field(default_factory=list)
    final_answer: str | None = None
    truncated: bool = False
    extras: dict[str, Any] = field(default_factory=dict)  # env-specific trail, e.g. HTTP calls

    @property
    def results(self) -> list[ToolResult]:
        """Every tool result of the episode, in order."""
        return [r for step in self.steps for r in step.results]

    @property
    def final_step(self) -> int:
        """The index of the last turn (where end-of-episode critiques point)."""
        return self.steps[-1].index if self.steps else 1


def _args(arguments: dict[str, Any]) -> str:
    return ", ".join(f"{k}={json.dumps(v)}" for k, v in arguments.items())


def _clip(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
