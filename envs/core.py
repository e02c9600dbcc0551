"""`AgentEnv`: the Gymnasium contract for multi-turn, tool-calling text environments.

The action is the policy's raw text for one assistant turn; the observation is the content of
the env's next message. A turn that calls tools gets their results; a turn without tool calls is
the final answer, scored by the env's `Rubric`. Nothing a policy writes makes `step` raise:
unreadable calls, unknown tools, bad arguments and crashing tools all become critiques.

Each step also has a bounded cost. An action longer than `MAX_ACTION_CHARS` is refused unread;
at most `MAX_CALLS_PER_TURN` tool calls of a turn run; tools that can take long (a SQL query)
share the turn's `turn_time_s` budget, and calls left when it is spent are refused. Parsing is
linear in the action's length, and a check that raises fails with a critique that names it.
"""

from __future__ import annotations

import math
import re
import string
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Protocol

import gymnasium as gym
import numpy as np
from cgym.envs.credit import DEFAULT_CREDIT, TurnCredit, turn_rewards
from cgym.envs.critique import Critique, CritiqueStyle, new_mistakes, render
from cgym.envs.episode import Episode, StepRecord, ToolResult
from cgym.envs.errors import CgymError, InvalidChoiceError, check_choice, did_you_mean
from cgym.envs.rubric import Rubric, Score
from cgym.envs.toolcall import ParsedTurn, ParseError, ToolCall, parse_turn
from cgym.envs.tools import Tool, ToolError
from gymnasium.spaces import Text

CHARSET = frozenset(string.printable)
_OUTSIDE_CHARSET = re.compile(f"[^{re.escape(string.printable)}]")
MAX_OBSERVATION_CHARS = 16_000
MAX_ACTION_CHARS = 32_000  # room for the SQL sandbox's longest query (20,000) inside a tool call
MAX_CALLS_PER_TURN = 8  # malformed calls included
TURN_TIME_S = 0.8  # tool and scoring time of one step; parsing and replies fit in the rest of a second


class Task(Protocol):
    """What an env's task must expose: a stable id, the prompt, the answer for critiques.

    Agents get the task object itself as `info["task"]`, so a task carries its facts (the fields a
    report needs, the gold query, ...) as typed attributes, and nothing parses the prompt back.
    """

    id: str
    prompt: str
    ground_truth: str


@dataclass(frozen=True)
class SimpleTask:
    """A ready-made `Task`: the prompt, the answer critiques may show, and any facts as `data`."""

    id: str
    prompt: str
    ground_truth: str = ""
    data: Mapping[str, Any] = field(default_factory=dict)


class ResetNeeded(CgymError, RuntimeError):
    """`step` was called before `reset` or after the episode ended."""


class AgentEnv(gym.Env[str, str]):
    """Base class of the text envs: subclasses provide tasks, tools and a rubric.

    Hooks, each with a default, that a subclass overrides:

    - `sample_task(rng, *, seed, options) -> Task`: the episode's task. Default: `options["task_id"]`
      if given, else task `seed % len(tasks())` (consecutive seeds walk the task set in order, so an
      N-episode eval over N tasks sees each once; `task_order = "draw"` draws instead), else a draw.
    - `tasks() -> Sequence[Task]`: the task list; default: the `tasks=` given to `__init__`.
    - `begin_episode(task)`: per-episode setup (a mocked service, a DB connection).
    - `tools_for(task) -> list[Tool]`: the episode's tools, asked at every reset; default:
      `tools()`, built once per env, for envs whose tools never change.
    - `system_prompt_for(task) -> str`: default, the class's `system_prompt`.
    - `before_score(episode)`: run once when the episode ends, before the rubric scores it.

    A single-response env (`single_response = True`: one turn of calls is the whole answer, as
    in a function-calling benchmark) ends every episode after its first turn, as finished
    (`terminated=True`), with every call of that turn run. Otherwise a tool may call
    `finish(answer)` to end the episode after this turn (a `submit` tool), and a
    slow tool keeps within `turn_time_left()`. `turn_parser` reads a turn into calls (default
    `parse_turn`); pass `turn_parser=` or set it on the class as a `staticmethod`.

    Every `info` holds `messages`, `tools` (this episode's schemas), `task`, the step's
    `critique` and its `turn_reward` (as far as this step knows, `envs.credit`); the last step's
    adds `success`, `reward_breakdown`, `checks_passed`, every `critiques`, the `turn_rewards` of
    every turn and the finished `episode`.
    """

    metadata: ClassVar[dict[str, Any]] = {"render_modes": ["ansi"], "render_fps": 1}
    system_prompt: ClassVar[str] = "You are a helpful assistant that uses tools."
    truncation_code: ClassVar[str] = "no_final_answer"
    single_response: ClassVar[bool] = False
    task_order: ClassVar[Literal["walk", "draw"]] = "walk"  # how a seed picks the default `sample_task`'s task
    turn_credit: ClassVar[TurnCredit] = DEFAULT_CREDIT  # how critiques map to `info["turn_reward(s)"]` (`envs.credit`)
    turn_time_s: ClassVar[float] = TURN_TIME_S
    turn_parser: Callable[[str], ParsedTurn] = staticmethod(parse_turn)
    rubric: Rubric

    def __init__(
        self,
        *,
        max_turns: int = 8,
        render_mode: str | None = None,
        tasks: Iterable[Task] | None = None,
        turn_parser: Callable[[str], ParsedTurn] | None = None,
    ) -> None:
        if not isinstance(max_turns, int) or isinstance(max_turns, bool) or max_turns < 1:
            raise ValueError(f"max_turns must be a positive int, got {max_turns!r}")
        if render_mode is not None:
            check_choice("render_mode", render_mode, self.metadata["render_modes"])
        self.max_turns = max_turns
        self.render_mode = render_mode
        self.observation_space = Text(max_length=MAX_OBSERVATION_CHARS, min_length=0, charset=CHARSET)
        self.action_space = Text(max_length=MAX_ACTION_CHARS, min_length=0, charset=CHARSET)
        self._task_list = None if tasks is None else _task_tuple(tasks)
        if turn_parser is not None:
            self.turn_parser = turn_parser
        self._fixed_tools: list[Tool] | None = None
        self._tool_list: list[Tool] = []
        self._tool_map: dict[str, Tool] = {}
        self._schemas: list[dict[str, Any]] = []
        self._episode: Episode | None = None
        self._messages: list[dict[str, Any]] = []
        self._final_answer: str | None = None
        self._score: Score | None = None
        self._turn_deadline = math.inf  # set by each step

    # -- hooks ---------------------------------------------------------------------------
    def tasks(self) -> Sequence[Task]:
        """The tasks `sample_task` draws from: by default the `tasks=` given to `__init__`."""
        if self._task_list is None:
            raise NotImplementedError(f"{type(self).__name__} needs tasks: pass tasks=[...] to AgentEnv.__init__, or override tasks() or sample_task()")
        return self._task_list

    def sample_task(self, rng: np.random.Generator, *, seed: int | None, options: dict[str, Any] | None) -> Task:
        """The next episode's task: `options["task_id"]` when given, else task `seed % len(tasks())`
        (consecutive seeds walk the set in order), else a draw from `tasks()`."""
        pool = self.tasks()
        wanted = (options or {}).get("task_id")
        if wanted is None:
            return pool[seed % len(pool)] if seed is not None and self.task_order == "walk" else pool[int(rng.integers(len(pool)))]
        found = next((t for t in pool if t.id == wanted), None)
        if found is None:
            ids = [t.id for t in pool]
            raise InvalidChoiceError(f"options['task_id']={wanted!r} is not a task of {type(self).__name__}.{did_you_mean(str(wanted), ids)}")
        return found

    def begin_episode(self, task: Task) -> None:
        """Set up per-episode state (a mocked service, a DB connection); default: nothing."""

    def tools(self) -> list[Tool]:
        """The tools of every episode, for envs whose tools are fixed; default: none."""
        return []

    def tools_for(self, task: Task) -> list[Tool]:
        """The tools of `task`'s episode; default: `tools()`, built once per env."""
        if self._fixed_tools is None:
            self._fixed_tools = self.tools()
        return self._fixed_tools

    def system_prompt_for(self, task: Task) -> str:
        """The system message of `task`'s episode; default: the class's `system_prompt`."""
        return self.system_prompt

    def before_score(self, episode: Episode) -> None:
        """Run once when the episode ends, before the rubric scores it (e.g. run a query)."""

    # -- the Gymnasium API ---------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        task = self.sample_task(self.np_random, seed=seed, options=options)
        self.begin_episode(task)
        self._use_tools(self.tools_for(task))
        self._episode = Episode(task)
        self._final_answer = None
        self._score = None
        self._messages = [
            {"role": "system", "content": self.system_prompt_for(task)},
            {"role": "user", "content": task.prompt},
        ]
        return _clean(task.prompt), self._info(None)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        episode = self._episode
        if episode is None or self._score is not None:
            raise ResetNeeded("call reset() before step(), and again after an episode ends")
        text = valid_unicode(action if isinstance(action, str) else str(action))
        index = len(episode.steps) + 1
        self._turn_deadline = time.perf_counter() + self.turn_time_s
        self._messages.append({"role": "assistant", "content": text if len(text) <= MAX_ACTION_CHARS else refused_excerpt(text)})
        record, observation = self._take_turn(text, index)
        episode.steps.append(record)
        terminated = self._final_answer is not None or self.single_response
        truncated = not terminated and index >= self.max_turns
        info = self._info(record)
        reward = 0.0
        if terminated or truncated:
            reward = self._end_episode(truncated, info)
        return _clean(observation), reward, terminated, truncated, info

    def render(self) -> str | None:
        if self.render_mode != "ansi":
            return None
        return "\n\n".join(f"[{m['role']}] {m['content']}" for m in self._messages)

    # -- helpers for tools ---------------------------------------------------------------
    def finish(self, answer: str) -> None:
        """End the episode after this turn with `answer` as the final answer (e.g. from a submit tool)."""
        self._final_answer = answer

    def truncate(self, reason: str) -> tuple[float, dict[str, Any]]:
        """End the open episode now, without a final answer, and score it like a truncation.

        For a caller whose rollout stopped outside the env (a trainer's token or tool-call budget);
        `reason` is the message of the episode's `no_final_answer` critique. Returns the reward and
        the end-of-episode `info`.
        """
        if self._episode is None or self._score is not None:
            raise ResetNeeded("truncate() needs an open episode: call reset() first")
        info = self._info(None)
        return self._end_episode(True, info, reason), info

    def turn_time_left(self) -> float:
        """Seconds left of this step's `turn_time_s`: a slow tool (a query) must finish within it."""
        return max(self._turn_deadline - time.perf_counter(), 0.0)

    @property
    def task(self) -> Task | None:
        return self._episode.task if self._episode else None

    @property
    def episode(self) -> Episode | None:
        """The current (or just finished) episode record."""
        return self._episode

    def critique_text(self, style: CritiqueStyle) -> str:
        """The finished episode's critique in one of the three renderings."""
        if self._episode is None or self._score is None:
            raise ResetNeeded("critique_text() needs a finished episode")
        return render(style, self._episode, self._score.critiques, self._score.success)

    # -- internals -----------------------------------------------------------------------
    def _take_turn(self, text: str, index: int) -> tuple[StepRecord, str]:
        """Refuse an over-long action unread, run a tool turn, or take the text as the final answer."""
        if len(text) > MAX_ACTION_CHARS:
            record = StepRecord(index, refused_excerpt(text))  # never kept whole: a client could fill memory with them
            message = f"The turn is {len(text)} characters long; the limit is {MAX_ACTION_CHARS}, so it was not read."
            return record, self._refuse(record, "action_too_long", message, "invalid_action", MAX_ACTION_CHARS, len(text))
        parsed = self._parse(text)
        if parsed.is_tool_turn:
            return self._run_tools(parsed, text, index)
        self.finish(text)
        return StepRecord(index, text, final=True), ""

    def _run_tools(self, parsed: ParsedTurn, text: str, index: int) -> tuple[StepRecord, str]:
        record = StepRecord(index, text, calls=list(parsed.calls))
        errors = parsed.errors[:MAX_CALLS_PER_TURN]
        calls = parsed.calls[: MAX_CALLS_PER_TURN - len(errors)]
        contents: list[str] = []
        for error in errors:
            record.critiques.append(Critique(index, error.code, error.message, got=error.got))
            contents.append(self._reply("invalid_tool_call", f"Error [{error.code}]: {error.message}"))
        for done, call in enumerate(calls):
            if self._final_answer is not None:
                break  # a call that ended the episode makes the rest of the turn moot
            if self.turn_time_left() <= 0:
                message = f"The turn's time budget ({self.turn_time_s:g} s) ran out; {len(calls) - done} call(s) were not run. Spread slow calls over turns."
                contents.append(self._refuse(record, "turn_time_exceeded", message, "invalid_tool_call", self.turn_time_s, None))
                break
            result = self._call(call, index)
            record.results.append(result)
            if result.critique is not None:
                record.critiques.append(result.critique)
            contents.append(self._reply(call.name, result.content))
        attempts = len(parsed.errors) + len(parsed.calls)
        if attempts > MAX_CALLS_PER_TURN and self._final_answer is None:
            message = f"This turn makes {attempts} tool calls; only the first {MAX_CALLS_PER_TURN} were read and the rest were not run."
            contents.append(self._refuse(record, "too_many_tool_calls", message, "invalid_tool_call", MAX_CALLS_PER_TURN, attempts))
        return record, "\n".join(contents)

    def _parse(self, text: str) -> ParsedTurn:
        """`turn_parser`, with a crash reported as an unreadable call rather than raised."""
        try:
            return self.turn_parser(text)
        except Exception as exc:  # noqa: BLE001 - a parser is meant never to raise; if it does, step() still must not
            return ParsedTurn(errors=[ParseError("parse_crashed", f"The turn could not be parsed: {type(exc).__name__}: {_clip(str(exc))}", _clip(text))])

    def _use_tools(self, tools: list[Tool]) -> None:
        """Dispatch to `tools` this episode (and show their schemas in `info["tools"]`)."""
        if tools is self._tool_list:
            return
        names = [t.name for t in tools]
        if len(set(names)) != len(names):
            raise ValueError(f"{type(self).__name__}: tool names must be unique, got {names}")
        self._tool_list = tools
        self._tool_map = dict(zip(names, tools))
        self._schemas = [t.schema for t in tools]

    def _refuse(self, record: StepRecord, code: str, message: str, name: str, expected: Any, got: Any) -> str:
        """Critique `record` and reply with the refusal."""
        record.critiques.append(Critique(record.index, code, message, expected, got))
        return self._reply(name, f"Error [{code}]: {message}")

    def _call(self, call: ToolCall, index: int) -> ToolResult:
        tool = self._tool_map.get(call.name)
        try:
            if tool is None:
                raise ToolError(
                    "unknown_tool",
                    f"There is no tool {call.name!r}.{did_you_mean(call.name, self._tool_map)}",
                    expected=sorted(self._tool_map),
                    got=call.name,
                )
            return ToolResult(call, True, tool.invoke(call.arguments))
        except ToolError as exc:
            critique = Critique(index, exc.code, exc.message, exc.expected, exc.got)
            return ToolResult(call, False, f"Error [{exc.code}]: {exc.message}", critique)
        except Exception as exc:  # noqa: BLE001 - tools run on model-written input; never crash step()
            message = f"{call.name} failed: {type(exc).__name__}: {exc}"
            return ToolResult(call, False, f"Error [tool_crashed]: {message}", Critique(index, "tool_crashed", message))

    def _reply(self, name: str, content: str) -> str:
        content = _clean(content)
        self._messages.append({"role": "tool", "name": name, "content": content})
        return content

    def _end_episode(self, truncated: bool, info: dict[str, Any], reason: str | None = None) -> float:
        assert self._episode is not None
        self._episode.final_answer = self._final_answer
        self._episode.truncated = truncated
        critiques = [c for step in self._episode.steps for c in step.critiques]
        try:
            self.before_score(self._episode)
        except Exception as exc:  # noqa: BLE001 - the hook reads the model's answer; the checks still run
            message = f"Preparing the score failed: {type(exc).__name__}: {_clip(str(exc))}"
            critiques.append(Critique(self._episode.final_step, "scoring_crashed", message))
        score = self.rubric.score(self._episode)
        critiques += new_mistakes(critiques, score.critiques)
        if truncated and not score.success:
            critiques.append(
                Critique(self._episode.final_step, self.truncation_code, reason or f"The turn limit ({self.max_turns}) was reached without a final answer.")
            )
        critiques.sort(key=lambda c: c.step)
        self._score = Score(score.reward, score.success, score.breakdown, critiques, score.passed)
        info.update(
            success=score.success,
            reward_breakdown=dict(score.breakdown),
            checks_passed=dict(score.passed),
            critiques=[c.to_dict() for c in critiques],
            episode=self._episode,
            turn_rewards=turn_rewards(len(self._episode.steps), [c.step for c in critiques], self.turn_credit),
        )
        return score.reward

    def _info(self, record: StepRecord | None) -> dict[str, Any]:
        task = self._episode.task if self._episode else None
        steps = self._episode.steps if self._episode else []
        return {
            "turn_reward": turn_rewards(len(steps), [s.index for s in steps if s.critique], self.turn_credit)[-1] if steps else 0.0,
            "messages": list(self._messages),
            "tools": self._schemas,
            "critique": record.critique.to_dict() if record and record.critique else None,
            "step_critiques": [c.to_dict() for c in record.critiques] if record else [],
            "turn": len(self._episode.steps) if self._episode else 0,
            "task_id": getattr(task, "id", None),
            "task": task,
        }


def _task_tuple(tasks: Iterable[Task]) -> tuple[Task, ...]:
    pool = tuple(tasks)
    if not pool:
        raise ValueError("tasks must hold at least one task")
    repeated = sorted(i for i, n in Counter(t.id for t in pool).items() if n > 1)
    if repeated:
        raise ValueError(f"task ids must be unique; repeated: {repeated[:5]}")
    return pool


def _clip(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


REFUSED_PREFIX_CHARS = 200
_SURROGATES = re.compile("[\ud800-\udfff]")


def valid_unicode(text: str) -> str:
    """`text` with lone surrogates (which no UTF-8 encoder takes) replaced by U+FFFD, once, where
    an action enters the env: every message, record and critique made from it then serialises."""
    return _SURROGATES.sub("\ufffd", text) if _SURROGATES.search(text) else text


def refused_excerpt(text: str) -> str:
    """What is kept of an over-long action: its length and a short prefix."""
    return f"{text[:REFUSED_PREFIX_CHARS]}... [{len(text)} characters, refused unread]"


def _clean(text: str) -> str:
    """Keep observations inside the observation space: printable ASCII, bounded length."""
    if not text.isascii() or _OUTSIDE_CHARSET.search(text):
        text = _OUTSIDE_CHARSET.sub(lambda m: f"\\u{ord(m.group()):04x}", text)
    if len(text) > MAX_OBSERVATION_CHARS:
        text = text[: MAX_OBSERVATION_CHARS - 20] + "\n...[truncated]"
    return text
