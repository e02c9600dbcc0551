"""Scripted policies: oracles, flawed agents and exploits, registered with their envs.

`scripted:<name>` on the CLI. An env registers its `Family` of scripted agents together with
the env (``register(..., agents="module:FAMILY")``); `ScriptedPolicy` finds it by env id, so
`scripted:oracle` and the audit work on every env that ships an oracle, plugins included.
"""

from __future__ import annotations

from cgym.agents.scripted.family import Agent, Family, task_of
from cgym.agents.scripted.policy import ScriptedPolicy, family_for, scripted_names

__all__ = ["Agent", "Family", "ScriptedPolicy", "family_for", "scripted_names", "task_of"]
