"""The SkyRL-gym adapter, through `skyrl_gym.make` itself, played by the scripted oracle."""

from __future__ import annotations

import json
from typing import Any

import pytest

skyrl_gym = pytest.importorskip("skyrl_gym")

from cgym.agents.base import Conversation  # noqa: E402
from cgym.agents.eval.episodes import run_episodes  # noqa: E402
from cgym.agents.scripted import ScriptedPolicy  # noqa: E402
from cgym.envs.integrations.skyrl import CgymTextEnv, register_envs, rows  # noqa: E402

from cgym import envs  # noqa: E402

API = "cgym/ApiReport-v0"
SQL = "cgym/SqlQuery-v0"


def _play_oracle(env: CgymTextEnv, env_id: str) -> list[dict[str, Any]]:
    """The oracle on SkyRL's loop: init's prompt, then each step's observations appended; returns every step's output."""
    prompt, _ = env.init([])
    conv = Conversation(messages=list(prompt), task=env.task, env_id=env_id)
    policy = ScriptedPolicy("oracle", env_id=env_id)
    outputs: list[dict[str, Any]] = []
    while not (outputs and outputs[-1]["done"]):
        text = policy.act([conv])[0].text
        outputs.append(env.step(text))
        conv.messages += [{"role": "assistant", "content": text}, *outputs[-1]["observations"]]
    return outputs


def test_every_cgym_env_is_registered_with_skyrl_gym() -> None:
    assert {e for e in envs.registered() if e.startswith("cgym/")} <= set(skyrl_gym.registry)  # on import
    register_envs()  # the envs other tests registered since
    assert set(envs.registered()) <= set(skyrl_gym.registry)
    assert register_envs(API) == []  # again: already there, left alone


@pytest.mark.parametrize(
    ("env_id", "config"),
    [(API, {"difficulty": "easy"}), (API, {"difficulty": "hard", "split": "test", "faults": 0.2}), (SQL, {"difficulty": "medium"})],
    ids=["api-easy", "api-hard-faults", "sql-medium"],
)  # fmt: skip
def test_the_oracle_through_skyrl_gets_the_native_outcome(env_id: str, config: dict[str, Any]) -> None:
    seeds = range(5)
    native = run_episodes(lambda: envs.make(env_id, **config), ScriptedPolicy("oracle", env_id=env_id), seeds)
    for seed, result in zip(seeds, native, strict=True):
        env = skyrl_gym.make(env_id, env_config=config, extras={"seed": seed})
        outputs = _play_oracle(env, env_id)
        last = outputs[-1]["metadata"]
        assert sum(o["reward"] for o in outputs) == result.reward
        assert (last["success"], [c["code"] for c in last["critiques"]]) == (result.success, result.codes)
        assert env.get_metrics() == {"success": result.success, "turns": len(outputs), "critiques": len(result.critiques)}


def test_the_prompt_carries_the_tools_and_the_task() -> None:
    env = skyrl_gym.make(API, env_config={"difficulty": "easy"}, extras={"extra_info": {"seed": 2}})
    prompt, meta = env.init([{"role": "user", "content": "the row's own prompt is replaced"}])
    native = envs.make(API, difficulty="easy")
    _, info = native.reset(seed=2)
    assert prompt[1] == info["messages"][1]
    assert prompt[0]["content"].startswith(info["messages"][0]["content"])
    for tool in info["tools"]:
        assert json.dumps(tool) in prompt[0]["content"]
    assert meta["task_id"] == info["task_id"]


def test_a_step_carries_its_critique_and_the_tool_reply() -> None:
    env = skyrl_gym.make(API, env_config={"difficulty": "easy"}, extras={"seed": 0})
    env.init([])
    out = env.step('<tool_call>{"name": "list_orders", "arguments": {}}</tool_call>')
    assert (out["done"], out["reward"]) == (False, 0.0)
    assert out["metadata"]["critique"]["code"] == "missing_argument"
    (reply,) = out["observations"]
    assert reply["role"] == "tool" and reply["content"].startswith("Error [missing_argument]")


def test_a_task_id_in_the_row_picks_the_task() -> None:
    native = envs.make(SQL)  # a fixed task list (ApiReport generates its tasks, so only seeds pick them)
    _, info = native.reset(seed=9)
    env = skyrl_gym.make(SQL, extras={"task_id": info["task_id"]})
    assert env.init([])[1]["task_id"] == info["task_id"]


def test_rows_are_skyrl_dataset_rows_that_init_reproduces() -> None:
    made = rows(API, 3, difficulty="easy")
    assert [r["seed"] for r in made] == [0, 1, 2] and {r["env_class"] for r in made} == {API}
    row = made[1]
    extras = {k: v for k, v in row.items() if k not in ("prompt", "env_class")}  # what SkyRL's dataset passes
    env = skyrl_gym.make(row["env_class"], env_config={"difficulty": "easy", "split": "train"}, extras=extras)
    assert env.init(row["prompt"])[0] == row["prompt"]
