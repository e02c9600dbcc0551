from __future__ import annotations

import json
import time
import warnings

import gymnasium as gym
import pytest
from cgym.agents.eval.audit import audit
from cgym.agents.eval.episodes import EpisodeResult, run_episodes
from cgym.agents.scripted import ScriptedPolicy
from cgym.envs.api_report.checks import extract_report
from cgym.envs.toolcall import parse_turn
from gymnasium.utils.env_checker import check_env
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cgym import envs

ENV = "cgym/ApiReport-v0"


def play(agent: str, seeds: range, **kwargs) -> list[EpisodeResult]:
    return run_episodes(lambda: envs.make(ENV, **kwargs), ScriptedPolicy(agent), seeds)


@pytest.mark.parametrize("difficulty", ["easy", "medium", "hard"])
def test_check_env(difficulty: str) -> None:
    env = gym.make(ENV, difficulty=difficulty, disable_env_checker=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(env.unwrapped)


@pytest.mark.parametrize(
    ("difficulty", "faults"),
    [("easy", 0.0), ("medium", 0.0), ("hard", None), ("easy", 0.2), ("medium", 0.2), ("hard", 0.2)],
    ids=["easy", "medium", "hard", "easy-faults", "medium-faults", "hard-faults"],
)
def test_oracle_solves_200_test_episodes(difficulty: str, faults: float | None) -> None:
    results = play("oracle", range(200), difficulty=difficulty, split="test", faults=faults)
    assert all(r.success for r in results), [r.summary() for r in results if not r.success][:3]
    assert all(r.critiques == [] for r in results)


def test_tool_results_use_the_reports_json_separators() -> None:
    """A value's key reads the same in the tool result and in the report (`"city": "Ghent"`)."""
    result = play("oracle", range(1), difficulty="easy", split="test")[0]
    tool, answer = result.conversation.messages[3]["content"], result.conversation.messages[4]["content"]
    report = extract_report(answer).data
    strings = [field for field in ("email", "city", "tier", "signup_date") if field in report]
    assert len(strings) == 2  # every easy task asks for two string fields
    for field in strings:
        assert f'"{field}": "{report[field]}"' in tool and f'"{field}": "{report[field]}"' in answer
    assert json.dumps(json.loads(tool)) == tool


def test_faults_actually_happen_and_are_retried() -> None:
    results = play("oracle", range(50), difficulty="hard", split="test", faults=0.2)
    tool_replies = [m["content"] for r in results for m in r.conversation.messages if m["role"] == "tool"]
    kinds = {json.loads(c).get("error") for c in tool_replies}
    assert {"rate_limited", "server_error", "timeout", "malformed_json"} <= kinds


FLAWS = [
    # agent, env kwargs, code, which step (a function of the finished episode)
    ("skip_pagination", {"difficulty": "hard", "faults": 0.0}, "pagination_incomplete", lambda r: 4),
    ("no_retry", {"difficulty": "hard", "faults": 1.0}, "http_error_not_retried", lambda r: 1),
    ("skip_auth", {"difficulty": "hard", "faults": 0.0}, "auth_skipped", lambda r: 1),
    ("wrong_field", {"difficulty": "medium"}, "field_mismatch", lambda r: len(r.turns)),
    ("typo", {"difficulty": "easy"}, "field_mismatch", lambda r: len(r.turns)),
    ("typo", {"difficulty": "hard", "faults": 0.0}, "field_mismatch", lambda r: len(r.turns)),
    ("malformed_json", {"difficulty": "easy"}, "json_parse_error", lambda r: len(r.turns)),
    ("missing_argument", {"difficulty": "easy"}, "missing_argument", lambda r: 1),
    ("unknown_tool", {"difficulty": "medium"}, "unknown_tool", lambda r: 1),
]


@pytest.mark.parametrize(("agent", "kwargs", "code", "step"), FLAWS, ids=[f[0] for f in FLAWS])
def test_each_flawed_agent_fails_with_its_code_at_the_right_step(agent, kwargs, code, step) -> None:
    for result in play(agent, range(30), split="test", **kwargs):
        assert not result.success
        found = [c for c in result.critiques if c["code"] == code]
        assert found, (agent, result.codes)
        assert found[0]["step"] == step(result), (agent, found[0])


def test_skip_pagination_critique_names_the_missing_page_and_values() -> None:
    result = play("skip_pagination", range(1), difficulty="hard", split="test", faults=0.0)[0]
    mismatch = next(c for c in result.critiques if c["code"] == "field_mismatch")
    assert "never fetched" in mismatch["message"]
    assert "order_count" in mismatch["expected"] and mismatch["got"]["order_count"] != mismatch["expected"]["order_count"]


@pytest.mark.parametrize("difficulty", ["easy", "medium", "hard"])
def test_audit_passes(difficulty: str) -> None:
    report = audit(ENV, {"difficulty": difficulty, "split": "test"}, episodes=25)
    assert report["passed"], report["exploits"]
    assert len(report["exploits"]) >= 5


def test_every_success_outscores_every_failure_across_agents() -> None:
    agents = ["oracle", "wrong_field", "malformed_json", "exploit_json_wrong_fields", "exploit_raw_dump", "exploit_padded_reasoning"]
    results = [r for a in agents for r in play(a, range(10), difficulty="medium", split="test")]
    worst_success = min(r.reward for r in results if r.success)
    best_failure = max(r.reward for r in results if not r.success)
    assert worst_success > best_failure


def test_splits_are_disjoint_and_reset_is_deterministic() -> None:
    def task_ids(split: str) -> set[str]:
        env = envs.make(ENV, difficulty="easy", split=split)
        return {env.reset(seed=s)[1]["task_id"] for s in range(300)}

    assert not task_ids("train") & task_ids("test")
    env = envs.make(ENV, difficulty="hard")
    assert env.reset(seed=5)[0] == env.reset(seed=5)[0]
    assert env.reset(seed=5)[0] != env.reset(seed=6)[0]


def test_turn_limit_truncates_and_scores_as_unfinished() -> None:
    env = envs.make(ENV, difficulty="easy", max_turns=2)
    env.reset(seed=0)
    call = '<tool_call>{"name": "search_customers", "arguments": {"name": "nobody"}}</tool_call>'
    env.step(call)
    _, reward, terminated, truncated, info = env.step(call)
    assert truncated and not terminated and not info["success"]
    assert reward < 0
    assert info["critiques"][-1]["code"] == "no_final_answer"


def test_critique_renderings() -> None:
    result = play("skip_pagination", range(1), difficulty="hard", split="test", faults=0.0)[0]
    assert result.critique("indicative") == "The answer is incorrect."
    assert "The correct answer is" in result.critique("ground_truth") and "order_count" in result.critique("ground_truth")
    step = result.critique("step")
    assert "(first error)" in step and "pagination_incomplete" in step
    assert step.endswith("Conclusion: incorrect [END]")
    good = play("oracle", range(1), difficulty="easy", split="test")[0]
    assert good.critique("step").endswith("Conclusion: correct [END]")


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        ('{"a": 1}', None),
        ('Summary.\n```json\n{"a": 1}\n```', None),
        ('{"a": 1,}', "Expecting property name"),
        ("no json here", "no JSON object"),
        ("[1, 2]", "no JSON object"),
    ],
    ids=["bare", "fenced", "trailing-comma", "none", "array"],
)
def test_extract_report(answer: str, error: str | None) -> None:
    report = extract_report(answer)
    if error is None:
        assert report.data == {"a": 1}
    else:
        assert report.data is None and error in report.error


class TestFuzz:
    env = envs.make(ENV, difficulty="hard", faults=0.3).unwrapped

    call_like = st.one_of(
        st.text(max_size=300),
        st.builds(lambda s: f"<tool_call>{s}</tool_call>", st.text(max_size=200)),
        st.builds(
            lambda name, args: f'<tool_call>{{"name": {json.dumps(name)}, "arguments": {json.dumps(args)}}}</tool_call>',
            st.sampled_from(["get_token", "search_customers", "list_orders", "get_order", "get_product", "nope", ""]),
            st.dictionaries(st.sampled_from(["name", "customer_id", "page", "token", "order_id", "product_id", "x"]), st.one_of(st.integers(-10**12, 10**12), st.text(max_size=20), st.none(), st.floats(), st.lists(st.integers(), max_size=3))),
        ),
    )

    @settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(actions=st.lists(call_like, min_size=1, max_size=6), seed=st.integers(0, 10**6))
    def test_step_never_raises(self, actions: list[str], seed: int) -> None:
        env = self.env
        env.reset(seed=seed)
        for action in actions:
            obs, reward, terminated, truncated, info = env.step(action)
            assert env.observation_space.contains(obs)
            parsed = parse_turn(action)
            tool_names = {t["function"]["name"] for t in info["tools"]}
            malformed = bool(parsed.errors) or any(c.name not in tool_names for c in parsed.calls)
            if malformed:
                assert info["critique"] is not None, action
            if terminated or truncated:
                assert isinstance(info["success"], bool) and isinstance(reward, float)
                break


@pytest.mark.parametrize("difficulty", ["easy", "medium", "hard"])
def test_the_task_carries_what_the_prompt_states(difficulty: str) -> None:
    """Agents read `info["task"]`; its fields say what the prompt says, so nothing parses the prompt."""
    _, info = envs.make(ENV, difficulty=difficulty).reset(seed=3)
    task = info["task"]
    assert f'customer named "{task.customer_name}"' in task.prompt
    wanted = ", ".join(f"{name} ({kind})" for name, kind in task.field_types.items())
    assert f"Required JSON fields: {wanted}." in task.prompt and tuple(task.field_types) == task.fields
    user, password = task.credentials
    assert task.require_auth is (difficulty == "hard")
    assert (f'username "{user}" and password "{password}"' in task.prompt) is task.require_auth


@pytest.mark.timing
def test_latency_slows_each_request_and_changes_nothing_else() -> None:
    kwargs = {"difficulty": "hard", "split": "test", "faults": 0.2}
    instant = play("oracle", range(3), **kwargs)
    start = time.perf_counter()
    delayed = play("oracle", range(3), latency_s=0.01, **kwargs)
    elapsed = time.perf_counter() - start
    assert [r.conversation.messages for r in delayed] == [r.conversation.messages for r in instant]
    requests = sum(len(r.record.extras["calls"]) for r in delayed if r.record)
    assert requests >= 9 and elapsed >= requests * 0.01


@pytest.mark.parametrize("latency_s", [-0.01, 5.0], ids=["negative", "past-turn-budget"])
def test_bad_latency_is_rejected(latency_s: object) -> None:
    with pytest.raises(ValueError, match=r"latency_s must be a number of seconds in \[0, 0.8\]"):
        envs.make(ENV, latency_s=latency_s)


@pytest.mark.parametrize("latency_s", [True, "0.02"], ids=["bool", "string"])
def test_a_latency_of_another_type_is_refused_by_make(latency_s: object) -> None:
    with pytest.raises(envs.CgymError, match=r"latency_s=.* does not fit; it takes float"):
        envs.make(ENV, latency_s=latency_s)
