"""Scripted policies: oracles, flawed agents and exploits, for every built-in env family.

`scripted:<name>` on the CLI. A scripted agent is a function of the conversation's messages;
`ScriptedPolicy` picks the env family from the conversation's tools, so one spec such as
`scripted:oracle` works on every env that has one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from agents.base import Conversation, Turn
from agents.scripted.api_report import API_AGENTS, AgentFn
from agents.scripted.api_report import FLAW_CODES as API_FLAW_CODES
from envs.errors import InvalidChoiceError, did_you_mean


@dataclass(frozen=True)
class Family:
    """Scripted agents for one env family, recognised by a tool only that family has."""

    name: str
    marker_tool: str
    agents: dict[str, AgentFn]
    flaw_codes: dict[str, str]
    near_misses: tuple[str, ...] = ()  # flaws that look like honest mistakes (SFT's imperfect share)


FAMILIES: list[Family] = [Family("api_report", "search_customers", API_AGENTS, API_FLAW_CODES, ("wrong_field", "typo", "malformed_json", "skip_pagination", "no_retry"))]

try:  # the SQL family registers itself when present
    from agents.scripted.sql import FLAW_CODES as SQL_FLAW_CODES
    from agents.scripted.sql import SQL_AGENTS

    FAMILIES.append(Family("sql", "run_query", SQL_AGENTS, SQL_FLAW_CODES, ("wrong_column", "wrong_aggregate", "forgets_order_by", "syntax_error")))
except ImportError:  # pragma: no cover - during development only
    pass


def scripted_names() -> list[str]:
    return sorted({name for family in FAMILIES for name in family.agents})


def family_of(tools: Sequence[dict]) -> Family | None:
    names = {t.get("function", {}).get("name") for t in tools}
    return next((f for f in FAMILIES if f.marker_tool in names), None)


def family_of_env(env_id: str, env_kwargs: dict, *, seed: int = 0, purpose: str = "script") -> Family:
    """The scripted family of an env, found from the tools its first episode offers."""
    from envs.registration import make

    probe = make(env_id, **env_kwargs)
    _, info = probe.reset(seed=seed)
    probe.close()
    family = family_of(info["tools"])
    if family is None:
        raise ValueError(f"{env_id} has no scripted agents to {purpose} with")
    return family


class ScriptedPolicy:
    """A scripted agent behind the `Policy` protocol."""

    def __init__(self, agent: str) -> None:
        if agent not in scripted_names():
            raise InvalidChoiceError(f"no scripted agent {agent!r}; choose one of {scripted_names()}.{did_you_mean(agent, scripted_names())}")
        self.agent = agent
        self.name = f"scripted:{agent}"

    def act(self, batch: Sequence[Conversation]) -> list[Turn]:
        return [Turn(self._agent_for(conv)(conv.messages)) for conv in batch]

    def _agent_for(self, conv: Conversation) -> Callable[[list[dict]], str]:
        family = family_of(conv.tools)
        if family is None or self.agent not in family.agents:
            raise InvalidChoiceError(f"scripted agent {self.agent!r} does not exist for this env ({family.name if family else 'unknown family'})")
        return family.agents[self.agent]
