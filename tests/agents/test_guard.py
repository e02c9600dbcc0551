"""The guard reads the task's required fields from `conversation.task`, never from the prompt."""

from __future__ import annotations

import dataclasses
import json

import pytest
from cgym.agents.base import Conversation
from cgym.agents.eval.episodes import run_episodes
from cgym.agents.guard import GuardedPolicy, validate
from cgym.agents.scripted import ScriptedPolicy
from cgym.envs.toolcall import ToolCall

from cgym import envs

ENV = "cgym/ApiReport-v0"


@pytest.fixture(scope="module")
def opening() -> Conversation:
    env = envs.make(ENV, difficulty="medium", split="test")
    _, info = env.reset(seed=3)
    return Conversation(list(info["messages"]), info["tools"], task=info["task"], env_id=ENV)


def test_a_report_missing_a_task_field_is_refused(opening: Conversation) -> None:
    fields = opening.task.fields
    full = json.dumps({name: 1 for name in fields})
    short = json.dumps({name: 1 for name in fields[:-1]})
    assert validate(opening, full) is None
    assert validate(opening, short) == f"Your report is missing the fields {[fields[-1]]}."
    assert "not a valid JSON report" in validate(opening, "no report here")


def test_the_fields_come_from_the_task_not_the_prompt(opening: Conversation) -> None:
    reworded = dataclasses.replace(opening, messages=[opening.messages[0], {"role": "user", "content": "Write the report."}])
    assert validate(reworded, json.dumps({"customer_id": 1})) == f"Your report is missing the fields {list(opening.task.fields[1:])}."


def test_without_a_task_only_calls_are_checked(opening: Conversation) -> None:
    bare = Conversation(opening.messages, opening.tools)
    assert validate(bare, "any answer at all") is None
    assert validate(bare, ToolCall("search_customers", {}).render()) == "search_customers needs the arguments ['name']."
    assert "There is no tool 'find'" in validate(bare, ToolCall("find", {}).render())


def test_guarded_scripted_oracle_still_solves_and_retries_carry_the_task() -> None:
    oracle = GuardedPolicy(ScriptedPolicy("oracle"))
    assert all(r.success for r in run_episodes(lambda: envs.make(ENV, difficulty="hard", split="test"), oracle, range(6)))
    assert oracle.rejections == 0
    guarded = GuardedPolicy(ScriptedPolicy("missing_argument"), retries=1)
    results = run_episodes(lambda: envs.make(ENV, difficulty="easy", split="test"), guarded, range(4))
    assert guarded.rejections >= 4 and not any(r.success for r in results)
