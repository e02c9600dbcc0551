"""critique-gym envs inside TRL's `GRPOTrainer(environment_factory=...)` (TRL >= 1.16).

`environment_factory(env_id, **env_kwargs)` builds the class TRL instantiates once per rollout:
`reset(**row)` starts the row's episode and returns its prompt, and one public method per env
tool (generated from the tool's JSON schema, with a typed signature and a Google docstring, as
TRL's `get_json_schema` wants) routes each call into the env's own dispatch, so bad arguments,
unknown tools and tool errors become critiques exactly as in a native episode. `dataset` gives
rows `reset` understands; `env_reward` is the reward function::

    trainer = GRPOTrainer(model, reward_funcs=env_reward, train_dataset=dataset("cgym/ApiReport-v0", 64),
                          environment_factory=environment_factory("cgym/ApiReport-v0"), args=config)

The project's own models (SmolLM2, the embedded tiny model) need their tokenizer readied for TRL,
which refuses chat templates it does not know: `cgym.agents.local.trl_template.for_trl`::

    trainer = GRPOTrainer(model, processing_class=for_trl(AutoTokenizer.from_pretrained(model)), ...)

What TRL cannot express, and how this adapter carries it:

- The final answer. TRL ends a rollout at the first assistant message without tool calls and
  never shows it to the environment, so the class defines no `get_reward()` (TRL would call it,
  add it as a second reward beside `reward_funcs`, and it could not score that answer).
  `env_reward` gives each env its rollout's last assistant message as the final answer and
  returns the rubric total; a rollout that stopped inside the tool loop (completion budget,
  `max_tool_calling_iterations`) is scored as truncated, with a `no_final_answer` critique.
- Step-level critiques. TRL's reward is one float per rollout. The critiques stay on the
  instance (`.critiques`, `.success`, `.reward`, `.episode`), and `env_reward` logs them to
  TRL's completions table (`log_extra("critiques", ...)`) and as metrics
  (`cgym/success`, `cgym/critiques_per_episode`).
- Turns. TRL calls tools one by one, so each call is one env step (the env's `max_turns` counts
  calls); prose written beside a tool call is not seen by the env.
- Turn rewards (`envs.credit`). TRL's GRPO takes one reward per completion and has no per-turn or
  per-token advantage to put them in, so they stay on the instance (`.turn_rewards`) for logging;
  training on them needs `cgym train --credit turn`.
- Per-task tools. TRL reads the tool methods once per class and shows them to every rollout of
  that class; since 1.16 it also takes a dict of classes, picked per row by an `environment`
  column. `environment_factories(env_id)` reads every task's tools (each task of the env's list;
  for generated tasks the first `PROBE_SEEDS` seeds' episodes), makes one class per distinct
  tool set, and `dataset` gives each row the `environment` of its task's set, so every rollout
  sees exactly its own task's tools. `environment_factory` (one class) refuses an env whose
  tasks differ (`PerTaskToolsError`, naming two tasks and their tools) rather than train every
  row on one task's tools. A task outside the probed seeds with a set none of them had has no
  class: `dataset` says so.
"""

from __future__ import annotations

import functools
import inspect
import keyword
import operator
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from cgym.envs.core import AgentEnv
from cgym.envs.episode import Episode
from cgym.envs.errors import CgymError
from cgym.envs.registration import make, takes_kwarg
from cgym.envs.toolcall import ToolCall

_JSON_HINTS: dict[str, Any] = {"string": str, "integer": int, "number": float, "boolean": bool, "object": dict, "null": type(None)}
_OPEN_REASON = "The rollout ended without a final answer (the trainer's completion budget or tool-call limit ran out)."


PROBE_SEEDS = 32
"""Seeds whose episodes `environment_factory` reads the tools of, for an env without a task list."""


class ToolNameError(CgymError, ValueError):
    """An env tool whose name (or argument name) cannot be a method of the TRL environment class."""


class PerTaskToolsError(CgymError, ValueError):
    """An env whose tasks have different tools, which TRL's one class of tool methods cannot express."""


class CgymTrlEnv:
    """Base of the generated classes: one critique-gym episode per TRL rollout.

    Only `reset` and the generated tool methods are public functions: TRL exposes every other
    public method as a tool, so the episode's outcome is read through properties.
    """

    env_id: str = ""
    env_kwargs: Mapping[str, Any] = {}

    def __init__(self) -> None:
        self._env = make(self.env_id, **self.env_kwargs)
        self._reward: float | None = None
        self._critiques: list[dict[str, Any]] = []
        self._turn_rewards: list[float] = []
        self._success = False

    def reset(self, *, seed: int | None = None, task_id: str | None = None, **row: Any) -> str:
        """Start the row's episode (its `seed`, or `task_id` as `options`) and return the task prompt.

        Other columns of the row (`prompt`, ...) are ignored; TRL appends the returned prompt to
        the row's last message.
        """
        options = {"task_id": task_id} if task_id is not None else None
        observation, _ = self._env.reset(seed=seed, options=options)
        self._reward = None
        self._critiques = []
        self._turn_rewards = []
        self._success = False
        return observation

    # -- the episode's outcome -----------------------------------------------------------
    @property
    def env(self) -> AgentEnv:
        """The critique-gym env this instance plays (unwrapped)."""
        return self._env.unwrapped

    @property
    def done(self) -> bool:
        """Whether the episode has ended (a submit tool, the turn limit, or `env_reward` scoring it)."""
        return self._reward is not None

    @property
    def reward(self) -> float | None:
        """The episode's rubric total, or None while the episode is open."""
        return self._reward

    @property
    def success(self) -> bool:
        """Whether the finished episode passed the rubric's gates (False while open)."""
        return self._success

    @property
    def critiques(self) -> list[dict[str, Any]]:
        """The episode's critiques (step, code, message, ...): every step's so far, all of them once it ended."""
        return list(self._critiques)

    @property
    def turn_rewards(self) -> list[float]:
        """Every step's reward from its critiques (`envs.credit`), once the episode has ended; [] before."""
        return list(self._turn_rewards)

    @property
    def episode(self) -> Episode | None:
        """The env's record of this episode (steps, calls, results, final answer)."""
        return self.env.episode

    # -- internals -----------------------------------------------------------------------
    def _call_tool(self, name: str, arguments: dict[str, Any]) -> str:
        """One TRL tool call as one env step, so the env checks it and critiques it."""
        if self.done:
            return f"Error [episode_over]: the episode has ended; {name} was not run."
        return self._step(ToolCall(name, arguments).render())

    def _finish(self, completion: str | Sequence[Mapping[str, Any]]) -> float:
        """Score the rollout: its last assistant message is the final answer (unless the episode already ended)."""
        if not self.done:
            answer = _final_answer(completion)
            if answer is not None:
                self._step(answer)
            if not self.done:  # the rollout stopped mid tool loop, or the env read the text as a tool call
                reward, info = self.env.truncate(_OPEN_REASON)
                self._end(reward, info)
        assert self._reward is not None
        return self._reward

    def _step(self, action: str) -> str:
        observation, reward, terminated, truncated, info = self._env.step(action)
        self._critiques += info["step_critiques"]
        if terminated or truncated:
            self._end(reward, info)
        return observation

    def _end(self, reward: float, info: Mapping[str, Any]) -> None:
        self._reward = float(reward)
        self._success = bool(info["success"])
        self._critiques = list(info["critiques"])
        self._turn_rewards = list(info.get("turn_rewards", []))


def environment_factory(env_id: str, **env_kwargs: Any) -> type[CgymTrlEnv]:
    """The class to pass as `GRPOTrainer(environment_factory=...)`: one method per tool of `env_id`.

    `env_kwargs` go to `envs.make` for every instance (use the same as for `dataset`). An env whose
    tasks have different tools raises `PerTaskToolsError`: use `environment_factories`.
    """
    sets = tool_sets(env_id, env_kwargs)
    if len(sets) > 1:
        (one, first), (other, second) = list(sets.items())[:2]
        raise PerTaskToolsError(
            f"{env_id} gives its tasks different tools ({len(sets)} sets; e.g. {_names(first)} and {_names(second)}). "
            "One TRL environment class shows one set of tool methods to every rollout, so every row would be trained with one task's tools. "
            f"Pass environment_factory=environment_factories({env_id!r}, ...) (a class per tool set) with rows from dataset(...), "
            "which name each row's class in their `environment` column."
        )
    return _env_class(env_id, env_kwargs, next(iter(sets.values())))


def environment_factories(env_id: str, **env_kwargs: Any) -> dict[str, type[CgymTrlEnv]]:
    """`GRPOTrainer(environment_factory=...)` for per-task tools: a class per distinct tool set, by name.

    TRL (>= 1.16) picks each row's class by the row's `environment` column, which `dataset`
    writes; an env with fixed tools gets one class, named after its tools.
    """
    return {name: _env_class(env_id, env_kwargs, tools, name) for name, tools in tool_sets(env_id, env_kwargs).items()}


def tool_sets(env_id: str, env_kwargs: Mapping[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Every distinct tool list among `env_id`'s tasks, named by its tools' names (`a+b`, then `a+b-2`, ...)."""
    env = make(env_id, **env_kwargs)
    try:
        by_task = _tools_by_task(env.unwrapped)
    finally:
        env.close()
    sets: dict[str, list[dict[str, Any]]] = {}
    for tools in by_task.values():
        if tools not in sets.values():
            base = name = "+".join(_names(tools)) or "no-tools"
            while name in sets:
                name = f"{base}-{len([n for n in sets if n == base or n.startswith(base + '-')]) + 1}"
            sets[name] = tools
    return sets


def _tools_by_task(env: AgentEnv) -> dict[str, list[dict[str, Any]]]:
    """Each task's tool schemas: every task of the env's list, or the first `PROBE_SEEDS` seeds' episodes."""
    if type(env).tools_for is AgentEnv.tools_for:  # fixed tools: one episode shows them all
        _, info = env.reset(seed=0)
        return {str(info["task_id"]): info["tools"]}
    try:
        tasks = list(env.tasks())
    except NotImplementedError:  # generated tasks: read the episodes' tools
        found = {}
        for seed in range(PROBE_SEEDS):
            _, info = env.reset(seed=seed)
            found.setdefault(str(info["task_id"] if info["task_id"] is not None else seed), info["tools"])
        return found
    return {str(getattr(task, "id", i)): [tool.schema for tool in env.tools_for(task)] for i, task in enumerate(tasks)}


def _env_class(env_id: str, env_kwargs: Mapping[str, Any], tools: Sequence[Mapping[str, Any]], suffix: str = "") -> type[CgymTrlEnv]:
    methods = {}
    for schema in tools:
        method = tool_method(schema)
        methods[method.__name__] = method
    name = "Cgym" + "".join(part[:1].upper() + part[1:] for part in re.split(r"\W+", f"{env_id.rsplit('/', 1)[-1]} {suffix}") if part)
    return type(name, (CgymTrlEnv,), {"env_id": env_id, "env_kwargs": dict(env_kwargs), **methods})


def _names(tools: Sequence[Mapping[str, Any]]) -> list[str]:
    return [schema.get("function", schema)["name"] for schema in tools]


def tool_method(schema: Mapping[str, Any]) -> Callable[..., str]:
    """A method for one OpenAI tool schema: a typed signature and a Google docstring for TRL, the env's dispatch inside."""
    spec = schema.get("function", schema)
    name = spec["name"]
    _check_name(name, "tool")
    parameters = spec.get("parameters", {})
    properties: dict[str, Any] = parameters.get("properties", {})
    required = set(parameters.get("required", ()))
    for arg in properties:
        _check_name(arg, f"argument of {name}")

    def method(self: CgymTrlEnv, **arguments: Any) -> str:
        return self._call_tool(name, arguments)

    # Keyword-only parameters: the schema's order needs no reordering of required before optional.
    signature = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    for arg, arg_schema in properties.items():
        default = inspect.Parameter.empty if arg in required else None
        signature.append(inspect.Parameter(arg, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=type_hint(arg_schema)))
    method.__signature__ = inspect.Signature(signature, return_annotation=str)  # type: ignore[attr-defined]
    method.__annotations__ = {p.name: p.annotation for p in signature[1:]} | {"return": str}
    method.__name__ = method.__qualname__ = name
    method.__doc__ = _docstring(spec.get("description", ""), properties, name)
    return method


def type_hint(schema: Mapping[str, Any]) -> Any:
    """The Python type `transformers.utils.get_json_schema` turns back into (roughly) `schema`."""
    enum = schema.get("enum")
    if enum and all(isinstance(v, (str, int, float, bool)) for v in enum):
        return Literal[tuple(enum)]
    kind = schema.get("type")
    if isinstance(kind, list):
        return functools.reduce(operator.or_, [type_hint({**schema, "type": k}) for k in kind])
    if kind == "array":
        items = schema.get("items")
        return list[type_hint(items)] if isinstance(items, Mapping) else list
    if kind in _JSON_HINTS:
        return _JSON_HINTS[kind]
    options = schema.get("anyOf") or schema.get("oneOf")
    if options:
        return functools.reduce(operator.or_, [type_hint(o) for o in options])
    return Any


def dataset(env_id: str, n: int, split: str = "train", *, seed: int = 0, **env_kwargs: Any) -> Any:
    """`n` rows for `GRPOTrainer`: `seed` (seed, seed+1, ...) and a `prompt` holding the episode's system message.

    The task prompt itself comes from `reset`, which TRL appends to the (empty) user message.
    `split` goes to envs that take one; pass the same kwargs to `environment_factory`. For an env
    with per-task tools each row also names its class in `environment` (see `environment_factories`).
    """
    from datasets import Dataset

    if takes_kwarg(env_id, "split"):
        env_kwargs = {"split": split, **env_kwargs}
    sets = tool_sets(env_id, env_kwargs)
    env = make(env_id, **env_kwargs)
    rows: dict[str, list[Any]] = {"prompt": [], "seed": []} | ({"environment": []} if len(sets) > 1 else {})
    for s in range(seed, seed + n):
        _, info = env.reset(seed=s)
        rows["prompt"].append([info["messages"][0], {"role": "user", "content": ""}])
        rows["seed"].append(s)
        if len(sets) > 1:
            rows["environment"].append(_set_of(sets, info["tools"], env_id, s))
    env.close()
    return Dataset.from_dict(rows)


def _set_of(sets: Mapping[str, list[dict[str, Any]]], tools: list[dict[str, Any]], env_id: str, seed: int) -> str:
    for name, known in sets.items():
        if known == tools:
            return name
    raise PerTaskToolsError(f"{env_id}: the task of seed {seed} offers {_names(tools)}, a tool set none of the probed tasks had (probed: {list(sets)})")


def env_reward(
    completions: Sequence[Any],
    environments: Sequence[Any],
    log_extra: Callable[[str, list[Any]], None] | None = None,
    log_metric: Callable[[str, float], None] | None = None,
    **kwargs: Any,
) -> list[float | None]:
    """TRL reward function: each rollout's episode reward, after giving the env its final answer.

    Rollouts whose environment is not a critique-gym one get None (TRL leaves them to the
    other reward functions). The critiques go to TRL's completions table and metrics.
    """
    ours = [(c, e) for c, e in zip(completions, environments, strict=True) if isinstance(e, CgymTrlEnv)]
    rewards = {id(e): e._finish(c) for c, e in ours}
    played = [e for _, e in ours]
    if log_extra is not None:
        log_extra("critiques", [_codes(e) if isinstance(e, CgymTrlEnv) else "" for e in environments])
    if log_metric is not None and played:
        log_metric("cgym/success", sum(e.success for e in played) / len(played))
        log_metric("cgym/critiques_per_episode", sum(len(e.critiques) for e in played) / len(played))
    return [rewards.get(id(e)) for e in environments]


def _final_answer(completion: str | Sequence[Mapping[str, Any]]) -> str | None:
    """The rollout's final answer: the last assistant message, unless it still asks for tools."""
    if isinstance(completion, str):
        return completion
    last = completion[-1] if completion else None
    if last is None or last.get("role") != "assistant" or last.get("tool_calls"):
        return None
    content = last.get("content") or ""
    return content if isinstance(content, str) else "".join(p.get("text", "") for p in content if isinstance(p, Mapping))


def _codes(env: CgymTrlEnv) -> str:
    return ", ".join(f"{c['step']}:{c['code']}" for c in env.critiques)


def _docstring(description: str, properties: Mapping[str, Any], name: str) -> str:
    lines = [description.strip() or f"The {name} tool."]
    if properties:
        lines += ["", "Args:"]
        for arg, schema in properties.items():
            text = " ".join(str(schema.get("description", "")).split()) or arg
            lines.append(f"    {arg}: {text}")
    return "\n".join(lines)


_RESERVED = frozenset(n for n in dir(CgymTrlEnv) if not n.startswith("_")) | {"get_reward"}


_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's function-name rule, which `Tool` enforces too


def _check_name(name: str, what: str) -> None:
    """A tool becomes a method, looked up by name (TRL dispatches on `__name__`, so `get-token` works),
    free in the class; its arguments become keyword parameters, so they must be Python names."""
    if what == "tool":
        if _TOOL_NAME.fullmatch(name) and not name.startswith("_") and name not in _RESERVED:
            return
        raise ToolNameError(
            f"the tool {name!r} cannot be used in the TRL environment class: it must be 1-64 letters, digits, '_' or '-', "
            f"not start with '_' and be none of {sorted(_RESERVED)}"
        )
    if not (name.isidentifier() and not keyword.iskeyword(name) and name != "self"):
        raise ToolNameError(f"the {what} {name!r} cannot be used in the TRL environment class: it must be a Python identifier, not 'self'")
