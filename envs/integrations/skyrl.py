"""critique-gym envs behind skyrl_gym's text env interface, so `skyrl_gym.make` builds them.

Importing this module registers every critique-gym env with skyrl_gym under its own id
(`register_envs()` again picks up envs registered later)::

    import skyrl_gym
    import cgym.envs.integrations.skyrl  # noqa: F401 - registers the cgym/ ids

    env = skyrl_gym.make("cgym/ApiReport-v0", env_config={"difficulty": "easy"}, extras={"seed": 3})
    prompt, _ = env.init([])
    out = env.step(model_turn)  # {"observations", "reward", "done", "metadata"}

As in SkyRL's own envs, `env_config` holds the env's kwargs (for `envs.make`) and `extras`,
the dataset row's other columns, say which task: `seed` and/or `task_id` (also read from
`extras["extra_info"]`). `rows` builds such rows.

What SkyRL's interface cannot express, and how this adapter carries it:

- Tool schemas: SkyRL's generator applies the chat template without `tools`, so the schemas are
  written into the system message (the Hermes/Qwen2.5 `<tools>` block).
- Critiques: a step returns one float. Each step's critique is in its `metadata["critique"]`,
  the last step's metadata holds every critique, `success` and the reward breakdown, and
  `get_metrics()` counts them for SkyRL's per-env metrics.
- Terminated vs truncated: SkyRL has one `done`; `metadata["truncated"]` tells them apart.
- Turn rewards (`envs.credit`): each step's `metadata["turn_reward"]`, and every turn's in the last
  step's `metadata["turn_rewards"]`; the step's `reward` stays the episode's (0 until the end).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import skyrl_gym
from cgym.envs.registration import make, registered, takes_kwarg
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput, ConversationType

_TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
)
_TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


class CgymTextEnv(BaseTextEnv):
    """One critique-gym episode as a skyrl_gym `BaseTextEnv`: `init` resets it, `step` plays one turn."""

    def __init__(self, env_config: Mapping[str, Any] | None = None, extras: Mapping[str, Any] | None = None, *, env_id: str) -> None:
        super().__init__()
        self.env_id = env_id
        self.env = make(env_id, **dict(env_config or {}))
        self.max_turns = self.env.unwrapped.max_turns
        row = dict(extras or {})
        info = row.get("extra_info") if isinstance(row.get("extra_info"), Mapping) else {}
        self.seed: int | None = row.get("seed", info.get("seed"))
        self.task_id: str | None = row.get("task_id", info.get("task_id"))
        self._seen = 0  # env messages already returned as observations
        self._last: dict[str, Any] = {}

    def init(self, prompt: ConversationType) -> tuple[ConversationType, dict[str, Any]]:
        """Reset to the row's task and return the env's own prompt (system with tools, user), not the row's."""
        options = {"task_id": self.task_id} if self.task_id is not None else None
        _, info = self.env.reset(seed=self.seed, options=options)
        system, user = info["messages"][:2]
        messages = [{"role": "system", "content": with_tools(system["content"], info["tools"])}, user]
        self._seen = len(info["messages"])
        self.turns = 0
        self._last = {}
        return messages, {"task_id": info["task_id"], "tools": info["tools"]}

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        _, reward, terminated, truncated, info = self.env.step(action)
        replies = info["messages"][self._seen + 1 :]  # after the assistant turn itself: the tool results
        self._seen = len(info["messages"])
        done = terminated or truncated
        self._last = info
        return BaseTextEnvStepOutput(observations=[] if done else replies, reward=float(reward), done=done, metadata=_metadata(info, truncated))

    @property
    def task(self) -> Any:
        """The task of the current episode (its typed fields, for a scripted agent)."""
        return self.env.unwrapped.task

    def get_metrics(self) -> dict[str, Any]:
        """The finished episode's success, turns and critique count (SkyRL averages them per env)."""
        return {"success": bool(self._last.get("success", False)), "turns": self.turns, "critiques": len(self._last.get("critiques", []))}

    def close(self) -> None:
        self.env.close()


def with_tools(system: str, tools: list[dict[str, Any]]) -> str:
    """`system` followed by the tool schemas as Qwen2.5's chat template writes them."""
    if not tools:
        return system
    listing = "\n".join(json.dumps(t) for t in tools)
    return f"{system}\n\n{_TOOLS_HEADER}{listing}{_TOOLS_FOOTER}"


def register_envs(*env_ids: str) -> list[str]:
    """Register `env_ids` (default: every critique-gym env) with skyrl_gym; ids already there are left alone."""
    added = []
    for env_id in env_ids or tuple(registered()):
        if env_id not in skyrl_gym.registry:
            skyrl_gym.register(id=env_id, entry_point=f"{__name__}:CgymTextEnv", kwargs={"env_id": env_id})
            added.append(env_id)
    return added


def rows(env_id: str, n: int, split: str = "train", *, seed: int = 0, **env_kwargs: Any) -> list[dict[str, Any]]:
    """`n` dataset rows in SkyRL's format (`prompt`, `env_class`, `seed`); pass the same kwargs as `env_config`."""
    if takes_kwarg(env_id, "split"):
        env_kwargs = {"split": split, **env_kwargs}
    env = CgymTextEnv(env_kwargs, env_id=env_id)
    out = []
    for s in range(seed, seed + n):
        env.seed = s
        prompt, _ = env.init([])
        out.append({"prompt": prompt, "env_class": env_id, "data_source": env_id, "seed": s})
    env.close()
    return out


def _metadata(info: Mapping[str, Any], truncated: bool) -> dict[str, Any]:
    keys = ("critique", "turn_reward", "turn", "task_id", "success", "reward_breakdown", "checks_passed", "critiques", "turn_rewards")
    return {k: info[k] for k in keys if k in info} | {"truncated": truncated}


register_envs()
