"""What an env author gets from `AgentEnv` with no code of their own: a task walk for evals, and
single-response episodes that end after one turn of (parallel) calls."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from cgym.envs import AgentEnv, Rubric, Tool
from cgym.envs.critique import Critique
from cgym.envs.episode import Episode
from cgym.envs.rubric import Check, CheckResult
from gymnasium.utils.env_checker import check_env


@dataclass(frozen=True)
class Row:
    id: str
    prompt: str
    a: int
    b: int


ROWS = [Row(f"row-{i}", f"Add {i} and {i + 1}, and multiply them, in one turn.", i, i + 1) for i in range(7)]


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def mul(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


class Calculator(AgentEnv):
    """Answer with two parallel calls in one turn; the calls are the answer."""

    single_response: ClassVar[bool] = True

    def __init__(self, **kwargs) -> None:
        super().__init__(tasks=ROWS, **kwargs)
        self.rubric = Rubric([Check("both_called", _both_called)])

    def tools(self) -> list[Tool]:
        return [Tool.from_function(add), Tool.from_function(mul)]


def _both_called(episode: Episode) -> CheckResult:
    called = {call.name for step in episode.steps for call in step.calls}
    return CheckResult.ok() if called == {"add", "mul"} else CheckResult.fail(Critique(1, "missing_call", f"called {sorted(called)}"))


def _calls(row: Row) -> str:
    return "".join(f'<tool_call>{{"name": "{n}", "arguments": {{"a": {row.a}, "b": {row.b}}}}}</tool_call>' for n in ("add", "mul"))


def test_a_single_response_episode_ends_after_its_turn_as_finished_with_every_call_run() -> None:
    env = Calculator(max_turns=1)
    _, info = env.reset(seed=3)
    _, reward, terminated, truncated, info = env.step(_calls(info["task"]))
    assert (terminated, truncated, info["success"], reward) == (True, False, True, 1.0)
    assert [r.content for r in info["episode"].steps[0].results] == ["7", "12"]  # row 3: 3 + 4, 3 * 4


def test_a_single_response_env_passes_check_env() -> None:
    check_env(Calculator())


def test_consecutive_seeds_walk_the_task_set_in_order() -> None:
    env = Calculator()
    seen = [env.reset(seed=100 + i)[1]["task_id"] for i in range(len(ROWS))]
    assert sorted(seen) == sorted(r.id for r in ROWS)  # an N-episode eval over N tasks covers each once
    assert env.reset(seed=100)[1]["task_id"] == seen[0]


def test_an_env_may_keep_drawing() -> None:
    class Drawn(Calculator):
        task_order = "draw"

    ids = {Drawn().reset(seed=s)[1]["task_id"] for s in range(40)}
    assert len(ids) > 1


class Strict(Calculator):
    """Its check reports a missing argument itself, as the tool's schema already does."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.rubric = Rubric([Check("both_called", _both_called), Check("complete", _complete)])


def _complete(episode: Episode) -> CheckResult:
    short = [call for step in episode.steps for call in step.calls if set(call.arguments) != {"a", "b"}]
    return CheckResult.fail(Critique(1, "missing_argument", "a call lacks an argument")) if short else CheckResult.ok()


def test_every_critique_of_a_turn_is_kept_and_a_mistake_is_reported_once() -> None:
    env = Strict(max_turns=1)
    env.reset(seed=0)
    turn = '<tool_call>not json</tool_call><tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call><tool_call>{"name": "mul", "arguments": {"a": 1, "b": "x"}}</tool_call>'
    _, _, terminated, _, info = env.step(turn)
    step_codes = [c["code"] for c in info["step_critiques"]]
    assert len(step_codes) == 3 and step_codes[1:] == ["missing_argument", "invalid_argument"]  # the unreadable call, then each bad call
    assert info["critique"] == info["step_critiques"][0]
    assert [c.code for c in info["episode"].steps[0].critiques] == step_codes
    codes = [c["code"] for c in info["critiques"]]
    assert terminated and codes.count("missing_argument") == 1  # the check's own missing_argument names no new mistake
    assert codes == step_codes  # both_called passed; complete's critique was the tool's, already there


def test_the_step_critique_marks_only_one_first_error() -> None:
    env = Strict(max_turns=1)
    env.reset(seed=0)
    env.step('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call><tool_call>{"name": "mul", "arguments": {"b": 1}}</tool_call>')
    text = env.critique_text("step")
    assert text.count("(first error)") == 1 and text.count("[missing_argument]") == 2
