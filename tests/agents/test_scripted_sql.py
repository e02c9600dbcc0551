from __future__ import annotations

import json

import pytest
from cgym.agents.base import Conversation
from cgym.agents.scripted import ScriptedPolicy, family_for
from cgym.agents.scripted.sql import FAMILY, FLAW_CODES, FLAWS, SQL_AGENTS, flaw_applies, flawed_query, oracle
from cgym.envs.sql import SqlQueryEnv
from cgym.envs.sql.tasks import SqlTask, builtin_tasks, task_pool
from cgym.envs.toolcall import parse_turn


def task(template: str, split: str = "test") -> SqlTask:
    schema = template.split(".", 1)[0]
    return next(t for t in builtin_tasks(schema) if t.template == template and t.split == split)  # type: ignore[arg-type]


def test_every_flaw_has_a_code_and_an_agent() -> None:
    assert set(FLAWS) == set(FLAW_CODES)
    assert set(FLAWS) | {"oracle"} <= set(SQL_AGENTS)
    assert sum(name.startswith("exploit_") for name in SQL_AGENTS) >= 5


def test_oracle_explores_then_submits_the_gold_query() -> None:
    env = SqlQueryEnv(difficulty="hard", split="test")
    _, info = env.reset(seed=7)
    names = []
    while True:
        text = oracle(Conversation(info["messages"], info["tools"], task=info["task"]))
        names.append(parse_turn(text).calls[0].name)
        _, _, terminated, truncated, info = env.step(text)
        if terminated or truncated:
            break
    assert names == ["list_tables", "describe_table", "run_query", "submit_query"]
    assert info["success"]


def test_a_conversation_without_its_task_is_refused() -> None:
    conv = Conversation([{"role": "system", "content": "x"}, {"role": "user", "content": "Database: nowhere. Question: ?"}])
    with pytest.raises(TypeError, match="SqlTask"):
        oracle(conv)


@pytest.mark.parametrize(
    ("flaw", "template", "check"),
    [
        ("wrong_column", "shop.customers_in_city", lambda q: q.startswith("SELECT name, email, name FROM")),
        ("syntax_error", "shop.customers_in_city", lambda q: "email, FROM" in q),
        ("hallucinated_column", "shop.customers_in_city", lambda q: q.startswith("SELECT names, email")),
        ("unknown_table", "shop.customers_in_city", lambda q: "FROM customer " in q),
        ("forgets_order_by", "shop.most_expensive", lambda q: "ORDER BY" not in q and q.endswith("LIMIT " + q.split()[-1])),
        ("missing_join_condition", "flights.city_travellers", lambda q: "JOIN bookings b JOIN" in q),
        ("wrong_aggregate", "hr.salary_by_title", lambda q: "COUNT(DISTINCT title) AS employees" in q),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_flaw_rewrites(flaw: str, template: str, check) -> None:
    t = task(template)
    query = FLAWS[flaw](t)
    assert query is not None and check(query), query
    assert flaw_applies(flaw, t)


def test_flaws_that_cannot_happen_fall_back_to_an_extra_column() -> None:
    t = task("shop.customers_in_city")  # no join, no aggregate, no ORDER BY
    for flaw in ("missing_join_condition", "wrong_aggregate", "forgets_order_by"):
        assert FLAWS[flaw](t) is None and not flaw_applies(flaw, t)
        assert flawed_query(flaw, t) == FLAWS["wrong_column"](t)


@pytest.mark.parametrize(
    ("flaw", "difficulty", "share"),
    [("forgets_order_by", "medium", 0.8), ("wrong_aggregate", "medium", 0.5), ("missing_join_condition", "hard", 0.7),
     ("hallucinated_column", "easy", 1.0), ("unknown_table", "hard", 1.0), ("syntax_error", "hard", 1.0), ("wrong_column", "easy", 1.0)],
    ids=lambda v: v if isinstance(v, str) else str(v),
)
def test_flaws_apply_to_most_tasks_of_their_difficulty(flaw: str, difficulty: str, share: float) -> None:
    pool = task_pool(difficulty, "test")  # type: ignore[arg-type]
    assert sum(flaw_applies(flaw, t) for t in pool) >= share * len(pool)


def test_scripted_policy_finds_the_sql_family_by_env_id() -> None:
    assert family_for("cgym/SqlQuery-v0") is FAMILY
    env = SqlQueryEnv(difficulty="easy", split="test")
    _, info = env.reset(seed=0)
    conv = Conversation(list(info["messages"]), info["tools"], task=info["task"], env_id="cgym/SqlQuery-v0")
    turn = ScriptedPolicy("exploit_select_star").act([conv])[0]
    assert json.loads(turn.text.removeprefix("<tool_call>").removesuffix("</tool_call>"))["name"] == "list_tables"
