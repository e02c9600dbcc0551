"""`ScriptedPolicy` and the lookup of an env's scripted agents in the env registry."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import gymnasium as gym
from cgym.agents.base import Conversation, Turn
from cgym.agents.scripted.family import Agent, Family
from cgym.envs.errors import InvalidChoiceError, UnknownEnvError, did_you_mean
from cgym.envs.registration import ScriptedAgentsError, registered, resolve_id


def family_for(env_id: str) -> Family:
    """The scripted agents registered with `env_id` (after the plugins load)."""
    env_id = resolve_id(env_id)
    specs = registered()
    spec = specs.get(env_id)
    if spec is None and env_id not in gym.registry:
        raise UnknownEnvError(f"no env registered as {env_id!r}.{did_you_mean(env_id, specs)}")
    found = spec.load_agents() if spec is not None else None
    if found is None:
        scripted = sorted(i for i, s in specs.items() if s.agents is not None)
        raise ScriptedAgentsError(
            f"{env_id} has no scripted agents (register it with agents='module:FAMILY', an agents.scripted.Family); envs that have them: {scripted}"
        )
    if not isinstance(found, Family):
        raise ScriptedAgentsError(f"the scripted agents of {env_id} ({spec.agents!r}) are a {type(found).__name__}, not an agents.scripted.Family")
    return found


def scripted_names() -> list[str]:
    """Every scripted agent name of every registered env; an env whose agents fail to load warns."""
    names: set[str] = set()
    for env_id, spec in registered().items():
        if spec.agents is None:
            continue
        try:
            names.update(family_for(env_id).agents)
        except ScriptedAgentsError as exc:  # one broken plugin must not hide the other envs' agents
            warnings.warn(str(exc), stacklevel=2)
    return sorted(names)


class ScriptedPolicy:
    """A scripted agent behind the `Policy` protocol.

    With `env_id` the agent is that env's, and its name is checked against them. Without, each
    conversation's own env (`Conversation.env_id`) picks the family, so one `scripted:oracle`
    plays every env that registered an oracle.
    """

    def __init__(self, agent: str, *, env_id: str | None = None) -> None:
        self._families: dict[str, Family] = {}
        names = sorted(self._family(env_id).agents) if env_id is not None else scripted_names()
        if agent not in names:
            where = f" for {env_id}" if env_id is not None else ""
            raise InvalidChoiceError(f"no scripted agent {agent!r}{where}; choose one of {names}.{did_you_mean(agent, names)}")
        self.agent = agent
        self.env_id = env_id
        self.name = f"scripted:{agent}"

    def act(self, batch: Sequence[Conversation]) -> list[Turn]:
        return [Turn(self._agent_for(conv)(conv)) for conv in batch]

    def _agent_for(self, conv: Conversation) -> Agent:
        env_id = self.env_id or conv.env_id
        if env_id is None:
            raise ScriptedAgentsError("this conversation names no env; build ScriptedPolicy(agent, env_id=...) to play it")
        agents = self._family(env_id).agents
        if self.agent not in agents:
            raise InvalidChoiceError(f"{env_id} has no scripted agent {self.agent!r}; choose one of {sorted(agents)}.{did_you_mean(self.agent, agents)}")
        return agents[self.agent]

    def _family(self, env_id: str) -> Family:
        if env_id not in self._families:
            self._families[env_id] = family_for(env_id)
        return self._families[env_id]
