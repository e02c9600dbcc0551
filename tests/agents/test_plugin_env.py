"""A plugin env registered as a bundle: its oracle runs through `ScriptedPolicy`, its audit runs."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import gymnasium as gym
import pytest
from cgym.agents.demos import demonstrations
from cgym.agents.eval.audit import audit
from cgym.agents.eval.episodes import run_episodes
from cgym.agents.scripted import Family, ScriptedPolicy, family_for, scripted_names
from cgym.envs import ScriptedAgentsError
from cgym.envs.errors import InvalidChoiceError, UnknownEnvError

from cgym import envs
from tests.agents.plugin_env import FAMILY, oracle

ENV = "testorg/Sum-v0"
BARE = "testorg/SumBare-v0"
envs.register(ENV, "tests.agents.plugin_env:SumEnv", description="Add two numbers.", agents="tests.agents.plugin_env:FAMILY")
envs.register(BARE, "tests.agents.plugin_env:SumEnv")


@pytest.mark.parametrize("env_id", [None, ENV], ids=["found-from-conversation", "pinned"])
def test_plugin_oracle_solves_every_episode(env_id: str | None) -> None:
    results = run_episodes(lambda: envs.make(ENV), ScriptedPolicy("oracle", env_id=env_id), range(20))
    assert all(r.success for r in results) and len({r.task_id for r in results}) > 10
    assert all(r.conversation.env_id == ENV for r in results)


def test_plugin_flaw_produces_its_critique_code() -> None:
    results = run_episodes(lambda: envs.make(ENV), ScriptedPolicy("off_by_one"), range(10))
    assert not any(r.success for r in results)
    assert all(r.codes == [FAMILY.flaw_codes["off_by_one"]] for r in results)


def test_plugin_audit_passes_and_names_its_exploits() -> None:
    report = audit(ENV, {}, episodes=8)
    assert report["passed"] and report["oracle"]["success_rate"] == 1.0
    assert list(report["exploits"]) == ["exploit_zero"] == FAMILY.exploits


def test_plugin_demonstrations_mix_its_oracle_and_near_misses() -> None:
    demos = demonstrations(ENV, {}, episodes=12, seed=0, imperfect=0.5)  # the env takes no split: none is passed
    finals = [messages[-1]["content"] for messages, _ in demos]
    assert len(demos) == 12 and 0 < sum("<tool_call>" not in m[2]["content"] for m, _ in demos) < 12
    assert all(f.strip().isdigit() for f in finals)


def test_env_without_scripted_agents_gets_one_clear_error() -> None:
    with pytest.raises(ScriptedAgentsError, match=f"{BARE} has no scripted agents") as caught:
        audit(BARE, {}, episodes=2)
    assert "\n" not in str(caught.value) and ENV in str(caught.value)
    with pytest.raises(ScriptedAgentsError):
        ScriptedPolicy("oracle", env_id=BARE)


def test_unknown_env_suggests_the_closest() -> None:
    with pytest.raises(UnknownEnvError, match=f"Did you mean '{ENV}'"):
        family_for("testorg/Summ-v0")


def test_agent_names_are_checked_against_the_env_family() -> None:
    assert "off_by_one" in scripted_names() and "exploit_tamper" in scripted_names()
    with pytest.raises(InvalidChoiceError, match="Did you mean 'off_by_one'"):
        ScriptedPolicy("off_by_on", env_id=ENV)
    with pytest.raises(InvalidChoiceError, match="for testorg/Sum-v0"):
        ScriptedPolicy("skip_pagination", env_id=ENV)


@pytest.fixture
def broken_env() -> Iterator[Callable[[str], str]]:
    """Registers an env whose `agents` reference is broken; unregisters it after the test."""
    env_id = "testorg/SumBroken-v0"

    def make(agents: str) -> str:
        envs.register(env_id, "tests.agents.plugin_env:SumEnv", agents=agents)
        return env_id

    yield make
    gym.registry.pop(env_id, None)


@pytest.mark.parametrize(
    ("agents", "match"),
    [("tests.agents.plugin_env:NOPE", "cannot load the scripted agents"), ("tests.agents.no_such_module:FAMILY", "cannot load"),
     ("tests.agents.plugin_env:oracle", "not an agents.scripted.Family")],
    ids=["missing-attr", "missing-module", "not-a-family"],
)
def test_bad_agents_reference_is_a_clear_error(broken_env: Callable[[str], str], agents: str, match: str) -> None:
    with pytest.raises(ScriptedAgentsError, match=match):
        family_for(broken_env(agents))
    with pytest.warns(UserWarning, match=match):  # listing every env's agent names skips the broken one
        assert "oracle" in scripted_names()


def test_agents_reference_must_name_an_attribute() -> None:
    with pytest.raises(ScriptedAgentsError, match="module:attr"):
        envs.register("testorg/SumBad-v0", "tests.agents.plugin_env:SumEnv", agents="tests.agents.plugin_env")


def test_a_family_needs_an_oracle_and_agents_for_its_flaws() -> None:
    with pytest.raises(ScriptedAgentsError, match="no 'oracle'"):
        Family("x", {"exploit_zero": oracle})
    with pytest.raises(ScriptedAgentsError, match=r"\['typo'\]"):
        Family("x", {"oracle": oracle}, {"typo": "field_mismatch"})


def test_builtins_register_their_families() -> None:
    from cgym.agents.scripted import api_report, sql

    assert family_for("cgym/ApiReport-v0") is api_report.FAMILY and family_for("cgym/SqlQuery-v0") is sql.FAMILY
    for family in (api_report.FAMILY, sql.FAMILY):
        assert len(family.exploits) >= 5 and set(family.near_misses) <= set(family.flaw_codes)


def _called_tool(episode):
    """+0.5 for calling the tool, correct or not: an exploit that calls it and answers anything
    outscores an honest attempt that computed the sum by hand, wrongly."""
    from cgym.envs import CheckResult

    called = any(step.calls for step in episode.steps)
    return CheckResult(called, 1.0 if called else 0.0)


def _tool_then_zero(conv) -> str:
    from cgym.envs.toolcall import ToolCall

    if not any(m["role"] == "tool" for m in conv.messages):
        return ToolCall("add", {"a": 1, "b": 1}).render()
    return "0"


def _bonus_env(**kwargs):
    from cgym.envs import Check, Rubric

    from tests.agents.plugin_env import SumEnv, _correct

    class SumWithToolBonus(SumEnv):
        rubric = Rubric([Check("correct", _correct, 2.0), Check("called_tool", _called_tool, 0.5)])

    return SumWithToolBonus(**kwargs)


@pytest.mark.parametrize("floor", [None, ()], ids=["every-near-miss", "no-floor"])
def test_an_exploit_that_outscores_an_honest_mistake_fails_the_audit_and_is_named(floor: tuple[str, ...] | None) -> None:
    from tests.agents.plugin_env import off_by_one

    family = Family("sum-bonus", {"oracle": oracle, "off_by_one": off_by_one, "exploit_tool_then_zero": _tool_then_zero}, near_misses=("off_by_one",), honest_floor=floor)
    env_id = f"testorg/SumBonus{'Floor' if floor is None else 'None'}-v0"
    envs.register(env_id, f"{__name__}:_bonus_env", agents=family)
    try:
        report = audit(env_id, {}, episodes=6)
    finally:  # out of both registries, so later tests see only the envs every run registers
        gym.registry.pop(env_id)
    entry = report["exploits"]["exploit_tool_then_zero"]
    assert entry["success_rate"] == 0.0 and entry["episodes_reaching_honest_reward"] == 0
    if floor is None:
        assert not report["passed"] and entry["episodes_above_near_misses"] == {"off_by_one": 6}
    else:  # a family may leave a format-only mistake out of the floor
        assert report["passed"] and entry["episodes_above_near_misses"] == {}
