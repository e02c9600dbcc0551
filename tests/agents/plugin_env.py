"""A plugin env as a user writes one: a task as data, a tool, a rubric and its scripted agents.

Registered in the tests with ``register(..., agents="tests.agents.plugin_env:FAMILY")``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from cgym.agents.base import Conversation
from cgym.agents.scripted import Family
from cgym.agents.scripted.family import task_of
from cgym.envs import AgentEnv, Check, CheckResult, Critique, Rubric, Tool
from cgym.envs.episode import Episode
from cgym.envs.toolcall import ToolCall


@dataclass(frozen=True)
class SumTask:
    id: str
    a: int
    b: int

    @property
    def prompt(self) -> str:
        return f"What is {self.a} plus {self.b}? Use the add tool, then reply with the number only."

    @property
    def ground_truth(self) -> str:
        return str(self.a + self.b)


def _correct(episode: Episode) -> CheckResult:
    if (episode.final_answer or "").strip() == episode.task.ground_truth:
        return CheckResult.ok()
    return CheckResult.fail(Critique(episode.final_step, "wrong_sum", "The answer is not the sum.", episode.task.ground_truth, episode.final_answer))


class SumEnv(AgentEnv):
    """Add two numbers with a tool."""

    rubric = Rubric([Check("correct", _correct)])

    def __init__(self, *, max_turns: int = 4, render_mode: str | None = None) -> None:
        super().__init__(max_turns=max_turns, render_mode=render_mode)

    def sample_task(self, rng: np.random.Generator, *, seed: int | None, options: dict | None) -> SumTask:
        a, b = (int(x) for x in rng.integers(0, 1000, size=2))
        return SumTask(f"sum-{a}-{b}", a, b)

    def tools(self) -> list[Tool]:
        return [Tool.from_function(add)]


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


def oracle(conv: Conversation) -> str:
    task = task_of(conv, SumTask)
    if not any(m["role"] == "tool" for m in conv.messages):
        return ToolCall("add", {"a": task.a, "b": task.b}).render()
    return next(m["content"] for m in reversed(conv.messages) if m["role"] == "tool")


def off_by_one(conv: Conversation) -> str:
    task = task_of(conv, SumTask)
    return str(task.a + task.b + 1)


def exploit_zero(conv: Conversation) -> str:
    return "0"


FAMILY = Family("sum", {"oracle": oracle, "off_by_one": off_by_one, "exploit_zero": exploit_zero}, {"off_by_one": "wrong_sum"}, near_misses=("off_by_one",))
