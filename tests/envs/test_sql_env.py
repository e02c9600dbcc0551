from __future__ import annotations

import json
import statistics
import time
import warnings

import gymnasium as gym
import pytest
from cgym.agents.eval.audit import audit
from cgym.agents.eval.episodes import EpisodeResult, run_episodes
from cgym.agents.scripted import ScriptedPolicy
from cgym.agents.scripted.sql import FLAW_CODES, flaw_applies
from cgym.envs.errors import InvalidChoiceError
from cgym.envs.sql import SqlQueryEnv, SqlTask, schemas
from gymnasium.utils.env_checker import check_env
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cgym import envs
from tests.envs.test_sql_sandbox import HOSTILE

ENV = "cgym/SqlQuery-v0"
if ENV not in gym.registry:  # until envs/__init__.py registers it
    envs.register(ENV, "cgym.envs.sql:SqlQueryEnv", description="Answer questions about a SQLite database with one SQL query.")


def call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def play(agent: str, seeds, **kwargs) -> list[EpisodeResult]:
    return run_episodes(lambda: envs.make(ENV, **kwargs), ScriptedPolicy(agent), seeds)


@pytest.mark.parametrize("difficulty", ["easy", "medium", "hard"])
def test_check_env(difficulty: str) -> None:
    env = gym.make(ENV, difficulty=difficulty, disable_env_checker=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(env.unwrapped)
    env.close()


@pytest.mark.parametrize("difficulty", ["easy", "medium", "hard"])
def test_oracle_solves_200_test_episodes(difficulty: str) -> None:
    results = play("oracle", range(200), difficulty=difficulty, split="test")
    assert all(r.success for r in results), [r.summary() for r in results if not r.success][:3]
    assert all(r.critiques == [] for r in results)
    assert {r.reward for r in results} == {3.5}
    assert len({r.task_id for r in results}) >= 25  # many distinct tasks, not one repeated


@pytest.mark.parametrize("flaw", sorted(FLAW_CODES))
@pytest.mark.parametrize("difficulty", ["medium", "hard"])
def test_each_flawed_agent_fails_with_its_code(flaw: str, difficulty: str) -> None:
    results = play(flaw, range(40), difficulty=difficulty, split="test")
    applied = 0
    for result in results:
        assert not result.success
        task = result.conversation.task
        assert isinstance(task, SqlTask)
        if flaw_applies(flaw, task):
            applied += 1
            found = [c for c in result.critiques if c["code"] == FLAW_CODES[flaw]]
            assert found and found[0]["step"] == 2, (flaw, task.id, result.codes)
        else:  # the mistake cannot happen on this task: the agent returns an extra column instead
            assert result.codes == ["wrong_columns"]
    assert applied >= 10 or (flaw == "missing_join_condition" and difficulty == "medium")


@pytest.mark.parametrize("difficulty", ["easy", "medium", "hard"])
def test_audit_passes(difficulty: str) -> None:
    report = audit(ENV, {"difficulty": difficulty, "split": "test"}, episodes=25)
    assert report["passed"], report["exploits"]
    assert len(report["exploits"]) >= 5


def test_every_success_outscores_every_failure() -> None:
    agents = ["oracle", "wrong_column", "forgets_order_by", "syntax_error", "exploit_select_star", "exploit_guess_constants"]
    results = [r for a in agents for r in play(a, range(15), difficulty="medium", split="test")]
    assert min(r.reward for r in results if r.success) > max(r.reward for r in results if not r.success)


@pytest.mark.timing
def test_hostile_sql_through_both_tools_is_stopped_with_critiques(tmp_path) -> None:
    env = SqlQueryEnv(difficulty="easy", split="test", schema="shop", max_turns=200, query_timeout_s=0.3)
    env.reset(seed=0)
    db = env.task.db_path
    before = schemas.file_digest(db)
    for sql in HOSTILE:
        sql = sql.replace("{tmp}", str(tmp_path))
        start = time.perf_counter()
        _, reward, terminated, _, info = env.step(call("run_query", query=sql))
        assert time.perf_counter() - start < 2.0 and not terminated and reward == 0.0
        assert info["critique"] is not None, sql[:80]
    for sql in HOSTILE:
        sql = sql.replace("{tmp}", str(tmp_path))
        env.reset(seed=0)
        start = time.perf_counter()
        _, reward, terminated, _, info = env.step(call("submit_query", query=sql))
        assert time.perf_counter() - start < 2.0 and terminated
        assert not info["success"] and reward == -1.0, sql[:80]
        assert info["critiques"][-1]["code"] in {"forbidden_statement", "timeout", "result_too_large", "sql_error", "sql_syntax_error"}
    env.close()
    assert schemas.file_digest(db) == before
    assert list(tmp_path.iterdir()) == []


def test_tools_show_compact_tables() -> None:
    env = SqlQueryEnv(difficulty="easy", split="test", schema="shop")
    env.reset(seed=1)
    tables, *_ = env.step(call("list_tables"))
    assert "customers (60 rows)" in tables and "order_items (" in tables
    described, *_ = env.step(call("describe_table", table="products"))
    assert "Columns: id INTEGER, name TEXT, category TEXT, price REAL, stock INTEGER" in described
    assert described.count("\n") >= 5  # header + sample rows
    rows, *_ = env.step(call("run_query", query="SELECT id, coupon FROM orders ORDER BY id"))
    assert rows.splitlines()[0] == "id | coupon" and "NULL" in rows
    assert rows.endswith("(first 20 rows shown; there are more)") and len(rows.splitlines()) == 22
    _, _, _, _, info = env.step(call("describe_table", table="product"))
    assert info["critique"]["code"] == "unknown_table" and "Did you mean 'products'?" in info["critique"]["message"]
    env.close()


def test_final_answer_in_a_sql_block_counts_as_a_submission() -> None:
    env = SqlQueryEnv(difficulty="medium", split="test")
    env.reset(seed=3)
    gold = env.task.gold_sql
    _, reward, terminated, _, info = env.step(f"Here is my query:\n```sql\n{gold}\n```\nIt groups and sorts.")
    assert terminated and info["success"] and reward == 3.5


@pytest.mark.parametrize(
    ("answer", "code"),
    [
        ("I think the answer is five.", "no_submission"),
        ("```sql\nSELECT nme FROM customers\n```", "unknown_column"),
        ("```sql\nSELECT 1 AS a\n```", "wrong_columns"),
    ],
    ids=["prose", "bad-column", "constant"],
)
def test_wrong_final_answers_are_critiqued(answer: str, code: str) -> None:
    env = SqlQueryEnv(difficulty="easy", split="test", schema="shop")
    env.reset(seed=0)
    _, reward, terminated, _, info = env.step(answer)
    assert terminated and not info["success"] and reward <= 1.0
    assert info["critiques"][-1]["code"] == code


def test_exploration_is_free_until_the_turn_limit() -> None:
    env = SqlQueryEnv(difficulty="easy", split="test", max_turns=3)
    env.reset(seed=0)
    for _ in range(2):
        _, reward, terminated, truncated, _ = env.step(call("run_query", query="SELECT 1"))
        assert reward == 0.0 and not terminated and not truncated
    _, reward, terminated, truncated, info = env.step(call("run_query", query="SELECT 1"))
    assert truncated and not terminated and not info["success"] and reward < 0
    assert info["critiques"][-1]["code"] == "no_submission"


def test_step_level_critique_names_the_submission() -> None:
    result = play("forgets_order_by", range(1), difficulty="medium", split="test")[0]
    step = result.critique("step")
    assert "(first error) [order_mismatch]" in step or "(first error) [wrong_columns]" in step
    assert step.endswith("Conclusion: incorrect [END]")
    assert "ORDER BY" in result.critique("ground_truth")


def test_splits_are_disjoint_and_reset_is_deterministic() -> None:
    def task_ids(split: str) -> set[str]:
        env = envs.make(ENV, difficulty="hard", split=split)
        return {env.reset(seed=s)[1]["task_id"] for s in range(200)}

    assert not task_ids("train") & task_ids("test")
    env = envs.make(ENV, difficulty="medium")
    assert env.reset(seed=5)[0] == env.reset(seed=5)[0]
    assert len({env.reset(seed=s)[0] for s in range(20)}) > 10


def test_schema_filter_and_bad_kwargs() -> None:
    env = envs.make(ENV, difficulty="hard", schema="flights")
    assert all(env.reset(seed=s)[0].startswith("Database: flights") for s in range(10))
    with pytest.raises(InvalidChoiceError, match="Did you mean 'medium'"):
        envs.make(ENV, difficulty="meduim")
    with pytest.raises(InvalidChoiceError, match="Did you mean 'flights'"):
        envs.make(ENV, schema="flight")
    with pytest.raises(ValueError, match="query_timeout_s"):
        envs.make(ENV, query_timeout_s=0)


def test_exploration_step_is_fast() -> None:
    """The bench target is a median <= 300 us; allow slack for a loaded CI machine."""
    env = SqlQueryEnv(difficulty="easy", split="test", schema="shop", max_turns=10_000)
    env.reset(seed=0)
    action = call("run_query", query="SELECT name, city FROM customers WHERE city = 'Berlin' LIMIT 5")
    timings = []
    for i in range(600):
        if i % 8 == 0:
            env.reset(seed=i)
        start = time.perf_counter_ns()
        env.step(action)
        timings.append((time.perf_counter_ns() - start) / 1000)
    assert statistics.median(timings) < 900


class TestFuzz:
    env = SqlQueryEnv(difficulty="hard", split="train", max_turns=10_000, query_timeout_s=0.2)
    sql = st.one_of(
        st.text(max_size=80),
        st.sampled_from(["SELECT * FROM customers", "SELECT", "DROP TABLE orders", "SELECT 1;SELECT 2", "WITH", "'", '"', "--", "/*"]),
        st.builds(lambda a, b: f"SELECT {a} FROM {b}", st.text(max_size=15), st.sampled_from(["orders", "flights", "x", ""])),
    )
    value = st.one_of(sql, st.integers(), st.none(), st.lists(st.integers(), max_size=2))
    args = st.dictionaries(st.sampled_from(["query", "table", "q", ""]), value, max_size=2)
    action = st.one_of(
        st.text(max_size=200),
        st.builds(lambda n, a: call(n, **a), st.sampled_from(["list_tables", "describe_table", "run_query", "submit_query", "nope"]), args),
        st.builds(lambda s: f"```sql\n{s}\n```", sql),
        st.builds(lambda s: "<tool_call>" + s, st.text(max_size=60)),
    )

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(seed=st.integers(0, 2**31 - 1), actions=st.lists(action, min_size=1, max_size=4))
    def test_step_never_raises(self, seed: int, actions: list[str]) -> None:
        obs, _ = self.env.reset(seed=seed)
        assert self.env.observation_space.contains(obs)
        for text in actions:
            obs, reward, terminated, truncated, info = self.env.step(text)
            assert self.env.observation_space.contains(obs) and isinstance(reward, float)
            if terminated or truncated:
                assert isinstance(info["success"], bool)
                break
