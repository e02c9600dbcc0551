"""critique-gym environments: multi-turn tool use with verifiable rewards and critiques.

Importing this package registers the built-in envs with Gymnasium under ``cgym/`` and loads
the ``cgym.envs`` plugins, so their ids work with `gymnasium.make` too::

    import gymnasium as gym
    from cgym import envs

    env = gym.make("cgym/ApiReport-v0", difficulty="medium")
"""

from __future__ import annotations

from cgym.envs.core import AgentEnv, ResetNeeded, SimpleTask, Task
from cgym.envs.critique import CRITIQUE_STYLES, Critique, CritiqueStyle, render
from cgym.envs.errors import CgymError, InvalidChoiceError, InvalidEnvKwargError, UnknownEnvError
from cgym.envs.registration import EnvCard, ScriptedAgentsError, load_plugins, make, register, registered
from cgym.envs.rubric import Check, CheckResult, Rubric, Score
from cgym.envs.tools import Tool, ToolError, ToolSchemaError

DIFFICULTIES = ("easy", "medium", "hard")
SPLITS = ("train", "test")

register(
    "cgym/ApiReport-v0",
    "cgym.envs.api_report:ApiReportEnv",
    description="Call a mocked shop API (auth, search, paginated orders, faults), then write a JSON report.",
    agents="cgym.agents.scripted.api_report:FAMILY",
)
register(
    "cgym/SqlQuery-v0",
    "cgym.envs.sql:SqlQueryEnv",
    description="Answer questions about a SQLite database (shop, HR, flights) with one SQL query; execution match.",
    agents="cgym.agents.scripted.sql:FAMILY",
)
register(
    "openenv/Remote-v0",
    "cgym.envs.integrations.openenv:RemoteEnv",
    description="An env served by `cgym serve` (OpenEnv, over WebSocket); pass its url=, e.g. 'http://127.0.0.1:8000'.",
)

__all__ = [
    "AgentEnv",
    "CRITIQUE_STYLES",
    "CgymError",
    "Check",
    "CheckResult",
    "Critique",
    "CritiqueStyle",
    "DIFFICULTIES",
    "EnvCard",
    "InvalidChoiceError",
    "InvalidEnvKwargError",
    "ResetNeeded",
    "Rubric",
    "SPLITS",
    "Score",
    "ScriptedAgentsError",
    "SimpleTask",
    "Task",
    "Tool",
    "ToolError",
    "ToolSchemaError",
    "UnknownEnvError",
    "load_plugins",
    "render",
    "make",
    "register",
    "registered",
]

load_plugins()  # last: a plugin that imports `envs` finds every name above already defined
