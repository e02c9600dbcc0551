"""`Family`: one env's scripted agents, registered with the env as part of its bundle.

A scripted agent is a function of the conversation so far (`Conversation`: its messages, the
tools on offer and the task as typed data) that writes the next assistant turn. It reads what it
must know about the task from `conversation.task`, never from the prompt's wording.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from cgym.agents.base import Conversation
from cgym.envs.registration import ScriptedAgentsError

Agent = Callable[[Conversation], str]
T = TypeVar("T")


@dataclass(frozen=True)
class Family:
    """An env's scripted agents: ``register(env_id, ..., agents="module:FAMILY")``.

    `agents` holds an ``"oracle"`` that solves every task; agents named ``exploit_*`` game a naive
    scorer (the audit checks that none of them pays). `flaw_codes` maps each flawed agent to the
    critique code the env must give it; `near_misses` are the flaws that look like honest
    mistakes (the imperfect share of SFT demonstrations, the failures refinement demos fix).
    `honest_floor` names the near misses that no exploit may outscore on the same task (the audit
    checks it; None: every near miss). Leave out a near miss whose mistake is in the format the
    rubric rewards, since format may reorder answers within one level of correctness.
    """

    name: str
    agents: Mapping[str, Agent]
    flaw_codes: Mapping[str, str] = field(default_factory=dict)
    near_misses: tuple[str, ...] = ()
    honest_floor: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if "oracle" not in self.agents:
            raise ScriptedAgentsError(f"scripted family {self.name!r} has no 'oracle' agent; it has {sorted(self.agents)}")
        unknown = sorted({*self.flaw_codes, *self.near_misses, *(self.honest_floor or ())} - set(self.agents))
        if unknown:
            raise ScriptedAgentsError(f"scripted family {self.name!r} names flaws without an agent: {unknown}")

    @property
    def floor(self) -> tuple[str, ...]:
        """The near misses no exploit may outscore on the same task."""
        return self.near_misses if self.honest_floor is None else self.honest_floor

    @property
    def exploits(self) -> list[str]:
        """The names of the exploit agents, sorted."""
        return sorted(name for name in self.agents if name.startswith("exploit_"))


def task_of(conv: Conversation, kind: type[T]) -> T:
    """`conv.task`, checked to be the kind of task a family's agents are written for."""
    if not isinstance(conv.task, kind):
        raise TypeError(f"these scripted agents need a {kind.__name__} in conversation.task (the env's info['task']), got {type(conv.task).__name__}")
    return conv.task
