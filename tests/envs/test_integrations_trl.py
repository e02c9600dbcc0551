"""The TRL adapter: generated tool methods, the scripted oracle through them, and a real `GRPOTrainer`."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, ClassVar

import gymnasium as gym
import pytest

pytest.importorskip("trl")
pytest.importorskip("datasets")

from cgym.agents.base import Conversation  # noqa: E402
from cgym.agents.eval.episodes import run_episodes  # noqa: E402
from cgym.agents.scripted import ScriptedPolicy  # noqa: E402
from cgym.envs.core import AgentEnv, SimpleTask  # noqa: E402
from cgym.envs.episode import Episode  # noqa: E402
from cgym.envs.integrations.trl import CgymTrlEnv, ToolNameError, dataset, env_reward, environment_factory, tool_method  # noqa: E402
from cgym.envs.rubric import Check, CheckResult, Rubric  # noqa: E402
from cgym.envs.toolcall import parse_turn  # noqa: E402
from cgym.envs.tools import Tool  # noqa: E402
from transformers.utils import get_json_schema  # noqa: E402

from cgym import envs  # noqa: E402

API = "cgym/ApiReport-v0"
EASY = {"difficulty": "easy", "split": "train"}


def _schema(**parameters: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "probe", "description": "Probe the thing.", "parameters": {"type": "object", **parameters}}}


@pytest.mark.parametrize(
    "schema",
    [
        _schema(properties={"name": {"type": "string", "description": "Who."}, "page": {"type": "integer", "description": "Which page."}}, required=["name"]),
        _schema(properties={"unit": {"type": "string", "enum": ["C", "F"], "description": "The unit."}}, required=["unit"]),
        _schema(
            properties={"ids": {"type": "array", "items": {"type": "integer"}, "description": "Ids."}, "ok": {"type": "boolean", "description": "Flag."}},
            required=["ids", "ok"],
        ),
        _schema(properties={"x": {"type": "number", "description": "A number."}, "meta": {"type": "object", "description": "Extra."}}, required=["x", "meta"]),
        _schema(properties={}),
    ],
    ids=["string-and-optional-int", "enum", "array-and-bool", "number-and-object", "no-arguments"],
)
def test_get_json_schema_reads_the_generated_method_back(schema: dict[str, Any]) -> None:
    got = get_json_schema(tool_method(schema))["function"]
    want = schema["function"]
    assert (got["name"], got["description"]) == (want["name"], want["description"])
    assert got["parameters"]["properties"] == want["parameters"]["properties"]
    assert sorted(got["parameters"].get("required", [])) == sorted(want["parameters"].get("required", []))


def test_every_api_report_tool_round_trips_through_get_json_schema() -> None:
    env = envs.make(API, **EASY)
    _, info = env.reset(seed=0)
    cls = environment_factory(API, **EASY)
    for schema in info["tools"]:
        got = get_json_schema(getattr(cls, schema["function"]["name"]))["function"]
        want = schema["function"]
        assert got["parameters"]["properties"] == want["parameters"]["properties"], want["name"]
        assert sorted(got["parameters"].get("required", [])) == sorted(want["parameters"]["required"])


@pytest.mark.parametrize("name", ["reset", "get_reward", "critiques", "_hidden", "math.add", "a b"])
def test_a_tool_name_that_cannot_be_a_method_is_refused(name: str) -> None:
    schema = {"type": "function", "function": {"name": name, "description": "d", "parameters": {"type": "object", "properties": {}}}}
    with pytest.raises(ToolNameError, match=re.escape(repr(name))):
        tool_method(schema)


@pytest.mark.parametrize("name", ["get-token", "class", "book-trip_2"])
def test_a_tool_name_openai_accepts_becomes_a_method_trl_reads(name: str) -> None:
    schema = {"type": "function", "function": {"name": name, "description": "Do it.", "parameters": {"type": "object", "properties": {"x": {"type": "integer", "description": "X."}}, "required": ["x"]}}}
    method = tool_method(schema)
    cls = type("C", (CgymTrlEnv,), {name: method})
    assert get_json_schema(getattr(cls, name))["function"]["name"] == name  # TRL dispatches on this name


@pytest.mark.parametrize("arg", ["class", "a-b", "self"])
def test_an_argument_name_that_cannot_be_a_keyword_is_refused(arg: str) -> None:
    schema = {"type": "function", "function": {"name": "probe", "description": "d", "parameters": {"type": "object", "properties": {arg: {"type": "string"}}}}}
    with pytest.raises(ToolNameError, match=re.escape(repr(arg))):
        tool_method(schema)


def test_only_reset_and_the_tools_are_public_functions() -> None:
    """TRL exposes every public function of the class but `reset` and `get_reward` as a tool."""
    import inspect

    cls = environment_factory(API, **EASY)
    public = {n for n, _ in inspect.getmembers(cls, inspect.isfunction) if not n.startswith("_")}
    assert public == {"reset", "get_token", "search_customers", "list_orders", "get_order", "get_product"}


def test_bad_calls_become_the_envs_critiques() -> None:
    env = environment_factory(API, **EASY)()
    env.reset(seed=3)
    assert env.list_orders().startswith("Error [missing_argument]")
    assert env.list_orders(customer_id="seven").startswith("Error [invalid_argument]")
    assert env.get_order(order_id=1, colour="red").startswith("Error [unexpected_argument]")
    assert [c["code"] for c in env.critiques] == ["missing_argument", "invalid_argument", "unexpected_argument"]
    assert env.reward is None and not env.done


def _play_oracle(env: CgymTrlEnv, env_id: str, seed: int) -> float | None:
    """The oracle driven the way TRL drives a model: each call through a method, the last text to `env_reward`."""
    prompt = env.reset(seed=seed, prompt=[{"role": "user", "content": ""}])
    system = {"role": "system", "content": env.env.system_prompt_for(env.env.task)}  # what the dataset row carries
    conv = Conversation(messages=[system, {"role": "user", "content": prompt}], task=env.env.task, env_id=env_id)
    policy = ScriptedPolicy("oracle", env_id=env_id)
    while not env.done:
        text = policy.act([conv])[0].text
        calls = parse_turn(text).calls
        if not calls:
            return env_reward([[{"role": "assistant", "content": text}]], [env])[0]
        conv.messages.append({"role": "assistant", "content": text})
        conv.messages += [{"role": "tool", "name": c.name, "content": getattr(env, c.name)(**c.arguments)} for c in calls]
    return env_reward([[{"role": "assistant", "content": "after the episode ended"}]], [env])[0]  # e.g. after a submit tool


@pytest.mark.parametrize(
    ("env_id", "kwargs"),
    [(API, EASY), (API, {"difficulty": "hard", "split": "test", "faults": 0.2}), ("cgym/SqlQuery-v0", {"difficulty": "medium"})],
    ids=["api-easy", "api-hard-faults", "sql-submit-tool"],
)  # fmt: skip
def test_the_oracle_through_trl_gets_the_native_rewards(env_id: str, kwargs: dict[str, Any]) -> None:
    seeds = range(6)
    native = run_episodes(lambda: envs.make(env_id, **kwargs), ScriptedPolicy("oracle", env_id=env_id), seeds)
    env = environment_factory(env_id, **kwargs)()
    for seed, result in zip(seeds, native, strict=True):
        assert _play_oracle(env, env_id, seed) == result.reward
        assert env.success == result.success
        assert [c["code"] for c in env.critiques] == result.codes


@pytest.mark.parametrize(
    ("last", "code"),
    [({"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "get_order", "arguments": {}}}]}, "no_final_answer"),
     ({"role": "assistant", "content": "plain words"}, "json_parse_error")],
    ids=["stopped-mid-tool-loop", "plain-text-answer"],
)  # fmt: skip
def test_env_reward_scores_the_last_message(last: dict[str, Any], code: str) -> None:
    env = environment_factory(API, **EASY)()
    env.reset(seed=0)
    logged: dict[str, Any] = {}
    rewards = env_reward([[last]], [env], log_extra=logged.__setitem__, log_metric=logged.__setitem__)
    assert rewards == [env.reward] and env.done and not env.success
    assert code in [c["code"] for c in env.critiques]
    assert code in logged["critiques"][0] and logged["cgym/success"] == 0.0
    if code == "no_final_answer":
        assert "rollout ended without a final answer" in env.critiques[-1]["message"]


def test_env_reward_leaves_other_environments_to_other_reward_functions() -> None:
    ours = environment_factory(API, **EASY)()
    ours.reset(seed=0)
    assert env_reward(["{}", "{}"], [object(), ours]) == [None, ours.reward]


def test_a_task_id_column_picks_the_task() -> None:
    native = envs.make("cgym/SqlQuery-v0")  # a fixed task list (ApiReport generates its tasks from the seed)
    _, info = native.reset(seed=9)
    env = environment_factory("cgym/SqlQuery-v0")()
    assert env.reset(task_id=info["task_id"]) == info["messages"][1]["content"]
    assert env.env.task.id == info["task_id"]


def test_dataset_rows_hold_the_seed_and_the_system_message() -> None:
    rows = dataset(API, 3, difficulty="easy")
    assert rows["seed"] == [0, 1, 2]
    env = envs.make(API, **EASY)
    _, info = env.reset(seed=1)
    assert rows[1]["prompt"] == [info["messages"][0], {"role": "user", "content": ""}]


# -- a real GRPOTrainer --------------------------------------------------------------------
def _share_of_letters(episode: Episode) -> CheckResult:
    text = episode.final_answer or ""
    share = sum(c.isalpha() for c in text) / max(len(text), 1)
    return CheckResult(share > 0.5, share)


class LettersEnv(AgentEnv):
    """One tool; the reward is the share of letters in the answer, so random text gets varied rewards."""

    system_prompt: ClassVar[str] = "Answer with a word."
    rubric = Rubric([Check("letters", _share_of_letters)])

    def __init__(self) -> None:
        super().__init__(max_turns=3, tasks=[SimpleTask("word", "Write a word.")])

    def tools(self) -> list[Tool]:
        def echo(text: str) -> str:
            """Repeat the text.

            Args:
                text: What to repeat.
            """
            return text

        return [Tool.from_function(echo)]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from cgym.agents.demos import corpus, demonstrations
    from cgym.trainer.tiny import build_tiny

    demos = demonstrations(API, {"difficulty": "easy"}, episodes=8, seed=0)
    return build_tiny(
        tmp_path_factory.mktemp("tiny"), corpus(demos), vocab_size=400, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, max_positions=2048
    )


@pytest.mark.parametrize(("env_id", "kwargs"), [(API, EASY), ("cgymtest/Letters-v0", {})], ids=["api-report", "letters"])
def test_grpo_trainer_logs_the_envs_rewards(env_id: str, kwargs: dict[str, Any], tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    from cgym.agents.local.trl_template import for_trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    monkeypatch.setitem(gym.registry, "cgymtest/Letters-v0", gym.envs.registration.EnvSpec("cgymtest/Letters-v0", entry_point=LettersEnv))
    tokenizer = for_trl(AutoTokenizer.from_pretrained(tiny_model))  # the tiny model as `cgym tiny` ships it
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    config = GRPOConfig(
        output_dir=str(tmp_path), use_cpu=True, max_steps=2, per_device_train_batch_size=4, num_generations=2,
        max_completion_length=24, logging_steps=1, report_to="none", save_strategy="no", learning_rate=1e-2, seed=0,
    )  # fmt: skip
    per_step: list[list[tuple[float | None, float]]] = []  # (the instance's reward, its env's rubric rescoring the episode)

    class Record(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:  # the pool's instances are reset next step
            per_step.append([(e.reward, e.env.rubric.score(e.episode).reward) for e in trainer.environments])

    rows = dataset(env_id, 4, **{k: v for k, v in kwargs.items() if k != "split"})
    trainer = GRPOTrainer(
        model=model, reward_funcs=env_reward, args=config, processing_class=tokenizer, callbacks=[Record()],
        train_dataset=rows, environment_factory=environment_factory(env_id, **kwargs),
    )  # fmt: skip
    trainer.train()

    logs = [h for h in trainer.state.log_history if "rewards/env_reward/mean" in h]
    assert len(logs) == len(per_step) == 2
    for log, played in zip(logs, per_step, strict=True):
        rewards = [reward for reward, _ in played]
        assert rewards == [rescored for _, rescored in played]
        assert math.isclose(log["rewards/env_reward/mean"], sum(rewards) / len(rewards), abs_tol=1e-6)
        assert math.isclose(log["reward"], log["rewards/env_reward/mean"], abs_tol=1e-6)  # one reward source, not two
    assert math.isfinite(logs[-1]["loss"])
    if env_id != API:  # varied rewards: the update moved the weights
        assert any(not torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())


def test_a_call_parsed_by_trl_runs_in_the_env(tiny_model: Path) -> None:
    """TRL's own parser (typing arguments from the generated schemas) feeds the methods what they expect."""
    import inspect

    from transformers import AutoTokenizer
    from trl.chat_template_utils import parse_response, qwen3_template

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    tokenizer.response_template = qwen3_template
    env = environment_factory(API, **EASY)()
    prompt = env.reset(seed=0)
    tools = [getattr(env, n) for n, _ in inspect.getmembers(type(env), inspect.isfunction) if n not in ("reset",) and not n.startswith("_")]
    prefix = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tools=tools, add_generation_prompt=True, tokenize=True, return_dict=True)[
        "input_ids"
    ]
    text = '<tool_call>\n{"name": "list_orders", "arguments": {"customer_id": "7"}}\n</tool_call><|im_end|>'
    (call,) = parse_response(tokenizer, tokenizer(text)["input_ids"], prefix=prefix, tools=tools)["tool_calls"]
    assert call["function"] == {"name": "list_orders", "arguments": {"customer_id": 7}}  # typed from the integer schema
    reply = getattr(env, call["function"]["name"])(**call["function"]["arguments"])
    native = envs.make(API, **EASY)
    native.reset(seed=0)
    assert reply == native.step('<tool_call>{"name": "list_orders", "arguments": {"customer_id": 7}}</tool_call>')[0]


def add_numbers(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


def multiply_numbers(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a * b


class PerTaskTools(AgentEnv):
    """Task 'sum' offers add, task 'product' offers mul (or both offer add when `same`)."""

    def __init__(self, *, same: bool = False, render_mode: str | None = None) -> None:
        super().__init__(tasks=[SimpleTask("sum", "Add 2 and 3."), SimpleTask("product", "Multiply 2 and 3.")], max_turns=2, render_mode=render_mode)
        self.same = same
        self.rubric = Rubric([Check("answered", lambda episode: CheckResult.ok())])

    def tools_for(self, task: SimpleTask) -> list[Tool]:
        return [Tool.from_function(add_numbers if task.id == "sum" or self.same else multiply_numbers)]


@pytest.fixture
def per_task_env() -> Any:
    gym.register("test/PerTaskTools-v0", entry_point=PerTaskTools)
    yield "test/PerTaskTools-v0"
    gym.registry.pop("test/PerTaskTools-v0")


def test_one_class_for_an_env_whose_tasks_have_different_tools_is_refused_loudly(per_task_env: str) -> None:
    from cgym.envs.integrations.trl import PerTaskToolsError

    with pytest.raises(PerTaskToolsError, match=r"\['add_numbers'\] and \['multiply_numbers'\].*environment_factories"):
        environment_factory(per_task_env)
    assert "add_numbers" in vars(environment_factory(per_task_env, same=True))  # tools_for overridden, tools alike: fine


def test_per_task_tools_get_a_class_per_tool_set_and_rows_that_name_it(per_task_env: str) -> None:
    from cgym.envs.integrations.trl import environment_factories

    classes = environment_factories(per_task_env)
    assert set(classes) == {"add_numbers", "multiply_numbers"}
    assert "multiply_numbers" not in vars(classes["add_numbers"]) and "add_numbers" not in vars(classes["multiply_numbers"])
    rows = dataset(per_task_env, 4)
    assert rows["environment"] == ["add_numbers", "multiply_numbers"] * 2  # the walk: seed s is task s % 2
    for row in rows:
        env = classes[row["environment"]]()
        env.reset(seed=row["seed"])
        tool = getattr(env, row["environment"])
        assert tool(a=2, b=3) in ("5", "6") and env.critiques == []  # each row's class holds its own task's tool
    assert "environment" not in dataset(per_task_env, 2, same=True).column_names
    assert list(environment_factories(per_task_env, same=True)) == ["add_numbers"]


def test_trl_routes_each_row_to_its_tool_sets_class(per_task_env: str, tiny_model: Path, tmp_path: Path) -> None:
    """GRPOTrainer with the dict: TRL renders each row's prompt with that row's tools only."""
    from cgym.agents.local.trl_template import for_trl
    from cgym.envs.integrations.trl import environment_factories
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    config = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2, max_completion_length=8, max_steps=1, report_to=[], use_cpu=True, logging_steps=1)
    tokenizer = for_trl(AutoTokenizer.from_pretrained(tiny_model))
    trainer = GRPOTrainer(
        model=str(tiny_model), processing_class=tokenizer, reward_funcs=env_reward, train_dataset=dataset(per_task_env, 4),
        environment_factory=environment_factories(per_task_env), args=config,
    )  # fmt: skip
    assert {name: [t.__name__ for t in tools] for name, tools in trainer._env_tools.items()} == {"add_numbers": ["add_numbers"], "multiply_numbers": ["multiply_numbers"]}


def test_trl_refuses_the_tiny_model_as_shipped_and_for_trl_fixes_it(tiny_model: Path, tmp_path: Path) -> None:
    from cgym.agents.local.trl_template import for_trl
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    config = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2, max_completion_length=8, max_steps=1, report_to=[], use_cpu=True)
    rows, factory = dataset(API, 2, difficulty="easy"), environment_factory(API, **EASY)
    with pytest.raises(ValueError, match="Unrecognized chat template"):
        GRPOTrainer(model=str(tiny_model), reward_funcs=env_reward, train_dataset=rows, environment_factory=factory, args=config)
    tokenizer = for_trl(AutoTokenizer.from_pretrained(tiny_model))
    GRPOTrainer(model=str(tiny_model), processing_class=tokenizer, reward_funcs=env_reward, train_dataset=rows, environment_factory=factory, args=config)


def _check_for_trl(tokenizer: Any) -> None:
    """TRL's view of a turn matches critique-gym's: the same prompt text, and calls parsed as the env parses them."""
    from cgym.agents.ledger import ChatEncoder
    from cgym.agents.local.trl_template import for_trl

    _, info = envs.make(API, difficulty="easy").reset(seed=0)
    messages, tools = info["messages"], info["tools"]
    ours = ChatEncoder(tokenizer).render(messages, tools, generation_prompt=True)  # what the project's sampler shows the model
    for_trl(tokenizer)
    assert tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True) == ours
    prefix = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    text = 'Looking it up.\n<tool_call>\n{"name": "get_orders", "arguments": {"customer_id": 7, "page": 1}}\n</tool_call><|im_end|>'
    parsed = tokenizer.parse_response(text, prefix=prefix)
    expected = parse_turn(text.removesuffix("<|im_end|>"))
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in parsed["tool_calls"]] == [(c.name, c.arguments) for c in expected.calls]
    assert parsed["content"] == "Looking it up." and tokenizer.parse_response("Done: 42.<|im_end|>", prefix=prefix) == {"role": "assistant", "content": "Done: 42."}


def test_for_trl_on_the_tiny_model(tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    _check_for_trl(AutoTokenizer.from_pretrained(tiny_model))


def test_for_trl_on_smollm2(tmp_path: Path) -> None:
    import cgym.agents.pretrained as pretrained
    from transformers import AutoTokenizer

    real = pretrained.cache_root() / "models" / pretrained.DEFAULT_MODEL
    if not pretrained.is_complete(real):
        pytest.skip("the real SmolLM2 model is not in the cache (cgym model fetch smollm2-135m)")
    _check_for_trl(AutoTokenizer.from_pretrained(real))


def test_for_trl_refuses_a_template_it_cannot_describe(tiny_model: Path) -> None:
    from cgym.agents.local.trl_template import UnsupportedTemplateError, for_trl
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    tokenizer.chat_template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
    with pytest.raises(UnsupportedTemplateError, match="ChatML"):
        for_trl(tokenizer)


CHATML_WITHOUT_TOOLS = "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"


@pytest.mark.parametrize("layout", ["json", "compact"])
def test_for_trl_writes_the_layout_the_model_was_trained_with(layout: str, tiny_model: Path) -> None:
    from cgym.agents.tool_prompt import set_tool_layout
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    tokenizer.chat_template = CHATML_WITHOUT_TOOLS  # SmolLM2's kind: no tools section
    set_tool_layout(tokenizer, layout)  # type: ignore[arg-type]
    _check_for_trl(tokenizer)


@pytest.mark.parametrize("layout", ["json", "compact"])
def test_for_trl_renders_every_built_in_tool_and_the_odd_schemas_as_the_sampler_does(layout: str, tiny_model: Path) -> None:
    from cgym.agents.local.trl_template import for_trl
    from cgym.agents.tool_prompt import set_tool_layout, tools_block
    from transformers import AutoTokenizer

    from tests.agents.test_tool_prompt import ODD, built_in_tools

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    tokenizer.chat_template = CHATML_WITHOUT_TOOLS
    set_tool_layout(tokenizer, layout)  # type: ignore[arg-type]
    tools = [*built_in_tools(), ODD]
    for_trl(tokenizer)
    for messages, system in [([{"role": "user", "content": "u"}], ""), ([{"role": "system", "content": "S"}, {"role": "user", "content": "u"}], "S\n\n")]:
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
        assert text.startswith(f"<|im_start|>system\n{system}{tools_block(tools, layout)}<|im_end|>\n<|im_start|>user\nu<|im_end|>")  # type: ignore[arg-type]
