"""`AgentEnv`'s public hooks: tasks as data, per-task tools and prompts, `finish`, the turn parser."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from cgym.envs import AgentEnv, Check, CheckResult, Critique, Rubric, SimpleTask, Tool
from cgym.envs.core import ResetNeeded, Task
from cgym.envs.episode import Episode
from cgym.envs.errors import InvalidChoiceError
from cgym.envs.toolcall import ParsedTurn, ToolCall
from gymnasium.utils.env_checker import check_env


# -- the README's example plugin env ---------------------------------------------------------
def weather_tool(cities: list[str]) -> dict[str, Any]:
    parameters = {"type": "object", "properties": {"city": {"type": "string", "enum": cities}}, "required": ["city"]}
    return {"type": "function", "function": {"name": "get_weather", "description": "Today's weather in a city.", "parameters": parameters}}


TASKS = [
    SimpleTask("oslo", "Is it snowing in Oslo? Answer yes or no.", "yes", data={"weather": {"Oslo": "snow", "Bergen": "rain"}}),
    SimpleTask("ghent", "Is it raining in Ghent? Answer yes or no.", "no", data={"weather": {"Ghent": "sun"}}),
]


def correct(episode: Episode) -> CheckResult:
    if (episode.final_answer or "").strip().lower() == episode.task.ground_truth:
        return CheckResult.ok()
    return CheckResult.fail(Critique(episode.final_step, "wrong_answer", f"The answer is {episode.task.ground_truth!r}."))


def looked_it_up(episode: Episode) -> CheckResult:
    if any(r.ok for r in episode.results):
        return CheckResult.ok()
    return CheckResult.fail(Critique(episode.final_step, "no_lookup", "Call get_weather before answering."))


class WeatherEnv(AgentEnv):
    """Answer a yes/no weather question; each task has its own cities."""

    system_prompt = "Look the weather up with the tools, then answer in one word."
    rubric = Rubric([Check("correct", correct), Check("looked_it_up", looked_it_up, weight=0.2, gate=False)])

    def __init__(self, *, max_turns: int = 4, render_mode: str | None = None) -> None:
        super().__init__(tasks=TASKS, max_turns=max_turns, render_mode=render_mode)

    def tools_for(self, task: SimpleTask) -> list[Tool]:  # type: ignore[override]
        weather = task.data["weather"]
        return [Tool.from_schema(weather_tool(sorted(weather)), lambda city: weather[city])]


# -- the example works end to end ---------------------------------------------------------------
def call(name: str, **arguments: Any) -> str:
    return json.dumps({"name": name, "arguments": arguments})


@pytest.mark.filterwarnings("ignore:.*alternative render modes")
def test_example_env_passes_check_env() -> None:
    check_env(WeatherEnv())


def test_example_env_scores_an_oracle_run() -> None:
    env = WeatherEnv()
    _, info = env.reset(seed=0, options={"task_id": "oslo"})
    assert info["task"] is TASKS[0]
    assert info["tools"][0]["function"]["parameters"]["properties"]["city"]["enum"] == ["Bergen", "Oslo"]
    obs, *_ = env.step(call("get_weather", city="Oslo"))
    assert obs == "snow"
    _, reward, terminated, _, info = env.step("yes")
    assert terminated and info["success"] and reward == pytest.approx(1.2)
    assert info["critiques"] == [] and info["episode"].final_answer == "yes"


def test_tools_follow_the_task() -> None:
    env = WeatherEnv()
    _, info = env.reset(seed=0, options={"task_id": "ghent"})
    assert info["tools"][0]["function"]["parameters"]["properties"]["city"]["enum"] == ["Ghent"]
    _, _, _, _, info = env.step(call("get_weather", city="Oslo"))
    assert info["critique"]["code"] == "invalid_argument" and "one of ['Ghent']" in info["critique"]["message"]


def test_a_failed_episode_gets_no_bonus_critique() -> None:
    env = WeatherEnv()
    env.reset(seed=0, options={"task_id": "oslo"})
    _, reward, _, _, info = env.step("no")
    assert reward == 0.0 and [c["code"] for c in info["critiques"]] == ["wrong_answer"]


def test_unknown_task_id_is_refused_with_a_suggestion() -> None:
    with pytest.raises(InvalidChoiceError, match="Did you mean 'oslo'"):
        WeatherEnv().reset(options={"task_id": "olso"})


def test_seeds_draw_from_the_tasks_reproducibly() -> None:
    ids = [WeatherEnv().reset(seed=s)[1]["task_id"] for s in range(12)]
    assert set(ids) == {"oslo", "ghent"}
    assert ids == [WeatherEnv().reset(seed=s)[1]["task_id"] for s in range(12)]


# -- each hook on its own -----------------------------------------------------------------------
class HookEnv(AgentEnv):
    """Records what each hook saw; `submit` ends the episode through `finish`."""

    rubric = Rubric([Check("said_done", lambda e: CheckResult.ok() if e.final_answer == "done" else CheckResult.fail(None))])

    def __init__(self, **kwargs: Any) -> None:
        self.seen: list[tuple[str, Any]] = []
        super().__init__(**kwargs)

    def sample_task(self, rng: np.random.Generator, *, seed: int | None, options: dict[str, Any] | None) -> Task:
        self.seen.append(("sample_task", (seed, options)))
        return SimpleTask(f"t{seed}", "Say done.", "done")

    def begin_episode(self, task: Task) -> None:
        self.seen.append(("begin_episode", task.id))

    def system_prompt_for(self, task: Task) -> str:
        return f"System for {task.id}."

    def tools(self) -> list[Tool]:
        self.seen.append(("tools", None))
        return [Tool.from_function(self.submit)]

    def before_score(self, episode: Episode) -> None:
        self.seen.append(("before_score", episode.final_answer))

    def submit(self, answer: str) -> str:
        """Submit the answer.

        Args:
            answer: The answer.
        """
        self.finish(answer)
        return "Submitted."


def test_hooks_see_the_seed_options_and_task() -> None:
    env = HookEnv()
    _, info = env.reset(seed=3, options={"level": 2})
    env.reset(seed=4)
    assert env.seen == [
        ("sample_task", (3, {"level": 2})), ("begin_episode", "t3"), ("tools", None),
        ("sample_task", (4, None)), ("begin_episode", "t4"),  # fixed tools are built once
    ]
    assert info["messages"][0] == {"role": "system", "content": "System for t3."}


def test_a_tool_can_finish_the_episode() -> None:
    env = HookEnv()
    env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step(f"<tool_call>{call('submit', answer='done')}</tool_call>")
    assert (obs, reward, terminated, truncated, info["success"]) == ("Submitted.", 1.0, True, False, True)
    assert env.seen[-1] == ("before_score", "done")


def test_the_turn_parser_can_be_swapped() -> None:
    def slash_commands(text: str) -> ParsedTurn:
        if text.startswith("/submit "):
            return ParsedTurn(calls=[ToolCall("submit", {"answer": text.removeprefix("/submit ")})])
        return ParsedTurn(content=text)

    env = HookEnv(turn_parser=slash_commands)
    env.reset(seed=0)
    _, reward, terminated, _, _ = env.step("/submit done")
    assert terminated and reward == 1.0


def test_a_json_array_turn_runs_every_call() -> None:
    env = WeatherEnv()
    env.reset(seed=0, options={"task_id": "oslo"})
    obs, _, _, _, info = env.step(f"[{call('get_weather', city='Oslo')}, {call('get_weather', city='Bergen')}]")
    assert obs == "snow\nrain" and info["critique"] is None


@pytest.mark.parametrize("passes", [True, False], ids=["success", "failure"])
def test_the_turn_limit_critique_is_only_for_failures(passes: bool) -> None:
    class Lookup(WeatherEnv):
        rubric = Rubric([Check("looked_it_up", looked_it_up if passes else correct)])

    env = Lookup(max_turns=1)
    env.reset(seed=0, options={"task_id": "oslo"})
    _, _, terminated, truncated, info = env.step(call("get_weather", city="Oslo"))
    assert truncated and not terminated and info["success"] is passes
    assert ("no_final_answer" in [c["code"] for c in info["critiques"]]) is not passes


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"tasks": []}, ValueError, "at least one task"),
        ({"tasks": [SimpleTask("a", "p"), SimpleTask("a", "q")]}, ValueError, r"repeated: \['a'\]"),
    ],
    ids=["empty", "repeated-ids"],
)
def test_bad_task_lists_are_refused(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        AgentEnv(**kwargs)


def test_an_env_without_tasks_says_how_to_give_them() -> None:
    class NoTasks(AgentEnv):
        rubric = Rubric([Check("x", lambda e: CheckResult.ok())])

    with pytest.raises(NotImplementedError, match="pass tasks="):
        NoTasks().reset(seed=0)


def test_repeated_tool_names_are_refused() -> None:
    class Twice(HookEnv):
        def tools(self) -> list[Tool]:
            return [Tool.from_function(self.submit), Tool.from_function(self.submit)]

    with pytest.raises(ValueError, match="tool names must be unique"):
        Twice().reset(seed=0)


def test_truncate_ends_an_open_episode_with_the_callers_reason() -> None:
    env = WeatherEnv()
    env.reset(seed=0, options={"task_id": "oslo"})
    env.step(call("get_weather", city="Oslo"))
    reward, info = env.truncate("The trainer's token budget ran out.")
    assert reward == 0.0 and not info["success"]
    assert info["critiques"][-1]["code"] == "no_final_answer" and info["critiques"][-1]["message"] == "The trainer's token budget ran out."
    assert info["episode"].truncated
    with pytest.raises(ResetNeeded):
        env.truncate("again")
