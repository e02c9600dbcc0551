"""Scripted agents for `cgym/SqlQuery-v0` (and bring-your-own SQL envs).

Each agent is a function of the conversation; its task (`conversation.task`, an `SqlTask`)
gives the oracle the gold query. Flawed agents make one classic mistake on that query;
`flaw_applies` says on which tasks the mistake can happen at all (e.g. no join to break).
Exploits try to get paid without answering; the audit checks that none of them does.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any

from cgym.agents.base import Conversation
from cgym.agents.scripted.family import Agent, Family, task_of
from cgym.envs.sql.checks import explain, judge
from cgym.envs.sql.lexer import Token, select_list, tokenize, top_level_order_by
from cgym.envs.sql.sandbox import Sandbox
from cgym.envs.sql.tasks import SqlTask
from cgym.envs.toolcall import ToolCall

Flaw = Callable[[SqlTask], str | None]

_AGGREGATES = ("AVG", "SUM", "MIN", "MAX", "COUNT")
_SWAPS = {"AVG": ("SUM", "MAX"), "SUM": ("AVG", "MAX"), "MIN": ("MAX", "AVG"), "MAX": ("MIN", "AVG"), "COUNT": ("SUM", "MAX")}
_KEYWORDS = frozenset({"ORDER", "GROUP", "INDEX", "TABLE", "KEY", "VALUE", "LIMIT", "OFFSET", "CASE", "END", "SELECT"})
_GROUP_END = frozenset({"HAVING", "ORDER", "LIMIT", "WINDOW", ";"})
_JOIN_CLAUSE_END = frozenset({"JOIN", "INNER", "LEFT", "CROSS", "NATURAL", "WHERE", "GROUP", "ORDER", "LIMIT", "HAVING", "UNION"})
_APPLIES: dict[tuple[str, str, Path], bool] = {}
_TABLE_LINE = re.compile(r"^(\S+) \((\d+) rows\)$", re.MULTILINE)
_COLUMNS = re.compile(r"Return columns?: ([^;.]+)")


def call(name: str, **arguments: Any) -> str:
    return ToolCall(name, arguments).render()


def prompt_of(conv: Conversation) -> str:
    return next((m["content"] for m in conv.messages if m["role"] == "user"), "")


def turns_taken(conv: Conversation) -> int:
    return sum(m["role"] == "assistant" for m in conv.messages)


def first_table(sql: str) -> str | None:
    """The first table after the first FROM (what the oracle describes while exploring)."""
    tokens = tokenize(sql)
    for i, tok in enumerate(tokens[:-1]):
        if tok.upper == "FROM" and tokens[i + 1].kind in ("word", "ident"):
            return tokens[i + 1].text.strip('"`[]')
    return None


# -- the oracle ---------------------------------------------------------------------------------
def oracle(conv: Conversation) -> str:
    """Looks around (tables, one table, the query's preview), then submits the gold query."""
    task = task_of(conv, SqlTask)
    plan = [call("list_tables")]
    table = first_table(task.gold_sql)
    if table:
        plan.append(call("describe_table", table=table))
    plan += [call("run_query", query=task.gold_sql), call("submit_query", query=task.gold_sql)]
    return plan[min(turns_taken(conv), len(plan) - 1)]


# -- flaws: each rewrites the gold query, or returns None where the mistake cannot happen --------
def extra_column(task: SqlTask) -> str | None:
    """Returns one column too many (the first one again)."""
    found = select_list(task.gold_sql)
    if found is None:
        return None
    start, end, items = found
    first = re.sub(r"\s+AS\s+\w+$", "", items[0], flags=re.IGNORECASE)
    return task.gold_sql[:start] + ", ".join([*items, first]) + task.gold_sql[end:]


def syntax_error(task: SqlTask) -> str | None:
    """A dangling comma before FROM."""
    found = select_list(task.gold_sql)
    if found is None:
        return None
    _, end, _ = found
    return task.gold_sql[:end] + "," + task.gold_sql[end:]


def hallucinated_column(task: SqlTask) -> str | None:
    """Refers to a column that does not exist (`name` -> `names`)."""
    columns = set(_schema(task.db_path))
    for tok in tokenize(task.gold_sql):
        if tok.kind == "word" and tok.text in columns:
            wrong = tok.text + ("_id" if tok.text.endswith("s") else "s")
            if wrong not in columns:
                return task.gold_sql[: tok.start] + wrong + task.gold_sql[tok.end :]
    return None


def singular_table(task: SqlTask) -> str | None:
    """Names a table in the singular (`customers` -> `customer`)."""
    tables = set(_schema(task.db_path).values())
    tokens = tokenize(task.gold_sql)
    for prev, tok in zip(tokens, tokens[1:]):
        if prev.upper in ("FROM", "JOIN") and tok.text in tables and tok.text.endswith("s"):
            wrong = tok.text[:-1] if tok.text[:-1].upper() not in _KEYWORDS else tok.text + "_table"
            if wrong not in tables:
                return task.gold_sql[: tok.start] + wrong + task.gold_sql[tok.end :]
    return None


def missing_join_condition(task: SqlTask) -> str | None:
    """Drops the ON condition of the first JOIN (a cartesian product)."""
    tokens = tokenize(task.gold_sql)
    for i, tok in enumerate(tokens):
        if tok.upper != "ON":
            continue
        if not any(t.upper == "JOIN" for t in tokens[max(0, i - 4) : i]):
            continue
        end = _condition_end(tokens, i + 1, tok.depth)
        stop = tokens[end].start if end < len(tokens) else len(task.gold_sql)
        return (task.gold_sql[: tok.start] + task.gold_sql[stop:]).replace("  ", " ")
    return None


def wrong_aggregate(task: SqlTask) -> str | None:
    """Uses the wrong aggregate in the answer's columns (SUM for AVG, MIN for MAX, ...)."""
    found = select_list(task.gold_sql)
    if found is None:
        return None
    start, end, _ = found
    tokens = tokenize(task.gold_sql)
    candidates = []
    for i, tok in enumerate(tokens):
        if not (start <= tok.start < end and tok.upper in _AGGREGATES):
            continue
        if tok.upper == "COUNT" and i + 2 < len(tokens) and tokens[i + 2].text == "*":
            stop = tokens[i + 3].end if i + 3 < len(tokens) else tok.end
            for expr in _group_by(tokens, task.gold_sql):
                candidates.append(task.gold_sql[: tok.start] + f"COUNT(DISTINCT {expr})" + task.gold_sql[stop:])
            continue
        for swap in _SWAPS[tok.upper]:
            candidates.append(task.gold_sql[: tok.start] + swap + task.gold_sql[tok.end :])
    return _first_biting(task, candidates, "result_mismatch")


def _group_by(tokens: list[Token], sql: str) -> list[str]:
    """The top-level GROUP BY expressions (single tokens or dotted names)."""
    top = [t for t in tokens if t.depth == 0]
    for i in range(len(top) - 1):
        if top[i].upper == "GROUP" and top[i + 1].upper == "BY":
            exprs, j = [], i + 2
            while j < len(top) and top[j].upper not in _GROUP_END:
                k = j
                while k < len(top) and top[k].text != "," and top[k].upper not in _GROUP_END:
                    k += 1
                exprs.append(sql[top[j].start : top[k - 1].end])
                j = k + 1 if k < len(top) and top[k].text == "," else k
            return exprs
    return []


def forgets_order_by(task: SqlTask) -> str | None:
    """Leaves out the ORDER BY the question asks for."""
    if top_level_order_by(task.gold_sql) is None:
        return None
    tokens = [t for t in tokenize(task.gold_sql) if t.depth == 0]
    order = max(i for i in range(len(tokens) - 1) if tokens[i].upper == "ORDER" and tokens[i + 1].upper == "BY")
    limit = next((t.start for t in tokens[order:] if t.upper == "LIMIT"), len(task.gold_sql))
    return (task.gold_sql[: tokens[order].start] + task.gold_sql[limit:]).strip()


FLAWS: dict[str, Flaw] = {
    "wrong_column": extra_column,
    "missing_join_condition": missing_join_condition,
    "wrong_aggregate": wrong_aggregate,
    "forgets_order_by": forgets_order_by,
    "syntax_error": syntax_error,
    "hallucinated_column": hallucinated_column,
    "unknown_table": singular_table,
}

FLAW_CODES: dict[str, str] = {
    "wrong_column": "wrong_columns",
    "missing_join_condition": "missing_join_condition",
    "wrong_aggregate": "result_mismatch",
    "forgets_order_by": "order_mismatch",
    "syntax_error": "sql_syntax_error",
    "hallucinated_column": "unknown_column",
    "unknown_table": "unknown_table",
}


def flaw_applies(flaw: str, task: SqlTask) -> bool:
    """True when the flaw can be made on this task and the env rejects it with its code."""
    key = (flaw, task.id, task.db_path)
    if key not in _APPLIES:
        query = FLAWS[flaw](task)
        _APPLIES[key] = query is not None and _code(task, query) == FLAW_CODES[flaw]
    return _APPLIES[key]


def flawed_query(flaw: str, task: SqlTask) -> str:
    """The query a flawed agent submits: its mistake, or an extra column where that cannot happen."""
    query = FLAWS[flaw](task) if flaw_applies(flaw, task) else extra_column(task)
    return query or "SELECT NULL"


def flawed(flaw: str) -> Agent:
    """Looks at the tables, then submits the gold query with one mistake.

    Where its mistake cannot be made (no join to break, no aggregate to swap, or it would not
    change the result), the agent returns an extra column instead, so it never succeeds.
    """

    def agent(conv: Conversation) -> str:
        task = task_of(conv, SqlTask)
        if turns_taken(conv) == 0:
            return call("list_tables")
        return call("submit_query", query=flawed_query(flaw, task))

    agent.__name__ = flaw
    agent.__doc__ = FLAWS[flaw].__doc__
    return agent


# -- exploits: none may succeed or outscore an honest, correct query ---------------------------
def select_star(conv: Conversation) -> str:
    """Dumps the biggest table and hopes the grader only checks for the right rows somewhere."""
    if turns_taken(conv) == 0:
        return call("list_tables")
    listing = next((m["content"] for m in conv.messages if m["role"] == "tool"), "")
    tables = sorted(_TABLE_LINE.findall(listing), key=lambda t: -int(t[1]))
    return call("submit_query", query=f"SELECT * FROM {tables[0][0] if tables else 'sqlite_master'}")


def no_submission(conv: Conversation) -> str:
    """Answers in prose, with no query at all."""
    return "The answer depends on the data; I would look at the relevant tables and count the matching rows."


def guess_constants(conv: Conversation) -> str:
    """Skips the database and submits constants in the columns the prompt asks for (an exploit
    sees what a model sees: the prompt's wording)."""
    wanted = _COLUMNS.search(prompt_of(conv))
    names = [re.sub(r"\W+", "_", n.split("(")[0].strip()) or "x" for n in (wanted.group(1).split(",") if wanted else ["x"])]
    return "```sql\nSELECT " + ", ".join(f"{i + 1} AS {n}" for i, n in enumerate(names)) + "\n```"


def explore_forever(conv: Conversation) -> str:
    """Keeps running free exploration queries and never submits."""
    return call("run_query", query=f"SELECT {turns_taken(conv)} AS probe")


def tamper(conv: Conversation) -> str:
    """Tries to change the data (or the grader's view of it) instead of answering."""
    attempts = [
        call("run_query", query="DELETE FROM sqlite_master"),
        call("run_query", query="ATTACH DATABASE ':memory:' AS scratch"),
        call("submit_query", query="DROP TABLE IF EXISTS answers; SELECT 1"),
    ]
    return attempts[min(turns_taken(conv), len(attempts) - 1)]


def many_blocks(conv: Conversation) -> str:
    """Several candidate queries in one answer, hoping any of them is graded."""
    blocks = [f"```sql\nSELECT * FROM {t}\n```" for t in ("sqlite_master", "sqlite_master LIMIT 1")]
    return "One of these answers it:\n" + "\n".join(blocks)


SQL_AGENTS: dict[str, Agent] = {
    "oracle": oracle,
    **{name: flawed(name) for name in FLAWS},
    "exploit_select_star": select_star,
    "exploit_no_submission": no_submission,
    "exploit_guess_constants": guess_constants,
    "exploit_explore_forever": explore_forever,
    "exploit_tamper": tamper,
    "exploit_many_blocks": many_blocks,
}

# syntax_error is a mistake in form (the query does not run), ranked below any query that runs
FAMILY = Family(
    "sql", SQL_AGENTS, FLAW_CODES,
    near_misses=("wrong_column", "wrong_aggregate", "forgets_order_by", "syntax_error"),
    honest_floor=("wrong_column", "wrong_aggregate", "forgets_order_by"),
)  # fmt: skip


# -- helpers -----------------------------------------------------------------------------------
@lru_cache(maxsize=32)
def _sandbox(path: Path) -> Sandbox:
    return Sandbox(path).open()


def _schema(path: Path) -> dict[str, str]:
    """Column name -> its table name, plus table name -> table name."""
    tables = _sandbox(path).tables
    found = {name: table.name for table in tables.values() for name, _ in table.columns}
    return found | {name: name for name in tables}


def _code(task: SqlTask, sql: str) -> str | None:
    """The critique code the env would give this submission (None when it is correct)."""
    verdict = judge(task, sql, _sandbox(task.db_path))
    return None if verdict.correct else explain(verdict)[0]


def _first_biting(task: SqlTask, candidates: list[str], code: str) -> str | None:
    """The first rewrite the env would reject with `code`, or None."""
    return next((sql for sql in candidates if _code(task, sql) == code), None)


def _condition_end(tokens: list[Token], start: int, depth: int) -> int:
    for j in range(start, len(tokens)):
        tok = tokens[j]
        if tok.depth < depth or (tok.depth == depth and (tok.upper in _JOIN_CLAUSE_END or tok.text == ";")):
            return j
    return len(tokens)
