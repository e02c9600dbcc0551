"""SQL tasks: a question, its gold query and the gold result, on one database file.

Built-in tasks are expanded from `templates.TEMPLATES` on the bundled databases, once per
process. Train and test are disjoint by entity: for every template, the values of its first
parameter (a city, a status, a year, ...) are split by a stable hash, and test tasks only use
values that no train task of that template uses. Tasks whose gold result is empty, a single
cell (guessable), or larger than `MAX_GOLD_ROWS` are left out.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Literal

from cgym.envs.errors import check_choice
from cgym.envs.sql.match import Expected, render_row
from cgym.envs.sql.sandbox import Sandbox
from cgym.envs.sql.schemas import DEFAULT_SEED, SCHEMAS, SchemaName, database_path
from cgym.envs.sql.templates import DIFFICULTIES, TEMPLATES, Difficulty, Template

Split = Literal["train", "test"]
SPLITS: tuple[Split, ...] = ("train", "test")
MAX_GOLD_ROWS = 200
MAX_COMBOS = 24  # parameter combinations kept per template
TEST_SHARE = 0.3
SUBMIT_ROW_CAP = 10_000
PREVIEW_ROWS = 5



@dataclass(frozen=True)
class SqlTask:
    """One question on one database, with the gold query and its precomputed result."""

    id: str
    db: str
    db_path: Path
    question: str
    gold_sql: str
    expected: Expected = field(repr=False)
    difficulty: str = "any"
    split: str = "any"
    template: str = ""
    entity: str = ""

    @property
    def prompt(self) -> str:
        return (
            f"Database: {self.db} (SQLite).\n"
            f"Question: {self.question}\n"
            "Explore the database with the tools if you need to, then submit one SQL query that answers the question "
            "with submit_query (or reply with the query in a ```sql block)."
        )

    @property
    def ground_truth(self) -> str:
        """The gold query plus a preview of its result (what critiques with ground truth show)."""
        rows = [render_row(r) for r in self.expected.rows[:PREVIEW_ROWS]]
        more = f" ... ({len(self.expected.rows)} rows in all)" if len(self.expected.rows) > PREVIEW_ROWS else ""
        result = json.dumps({"columns": list(self.expected.columns), "rows": rows})
        return f"{self.gold_sql}\n-- result: {result}{more}"


def sql_literal(value: Any) -> str:
    """Render a parameter value as an SQL literal (strings quoted, quotes doubled)."""
    if isinstance(value, str):
        return "'" + value.replace("'", "''") + "'"
    if value is None:
        return "NULL"
    return repr(value)


def gold_result(sandbox: Sandbox, gold_sql: str) -> Expected:
    """Run a gold query in the sandbox and wrap its result (raises `SqlError` if it fails)."""
    result = sandbox.run(gold_sql, max_rows=SUBMIT_ROW_CAP, time_budget_s=5.0)
    return Expected.from_query(gold_sql, result.columns, result.rows)


@cache
def builtin_tasks(schema: SchemaName, seed: int = DEFAULT_SEED) -> tuple[SqlTask, ...]:
    """Every task of every template of `schema`, both splits, built once per process."""
    check_choice("schema", schema, SCHEMAS)
    path = database_path(schema, seed)
    tasks: list[SqlTask] = []
    with Sandbox(path) as sandbox:
        for template in TEMPLATES:
            if template.schema == schema:
                tasks.extend(_expand(template, sandbox, path))
    return tuple(tasks)


def task_pool(difficulty: Difficulty, split: Split, schema: SchemaName | None = None) -> tuple[SqlTask, ...]:
    """The tasks an env samples from."""
    check_choice("difficulty", difficulty, DIFFICULTIES)
    check_choice("split", split, SPLITS)
    schemas = SCHEMAS if schema is None else (schema,)
    return tuple(t for s in schemas for t in builtin_tasks(s) if t.difficulty == difficulty and t.split == split)


def _expand(template: Template, sandbox: Sandbox, path: Path) -> list[SqlTask]:
    combos = sandbox.run(template.params, max_rows=SUBMIT_ROW_CAP)
    names = combos.columns
    rows = sorted(combos.rows, key=lambda r: _digest(template.id, *r))[:MAX_COMBOS]
    test_entities = _test_entities(template.id, [r[0] for r in rows])
    tasks = []
    for row in rows:
        values = dict(zip(names, row))
        gold = template.sql.format(**{k: sql_literal(v) for k, v in values.items()})
        expected = gold_result(sandbox, gold)
        if not _usable(expected):
            continue
        suffix = "-".join(str(v).replace(" ", "_") for v in row)
        tasks.append(SqlTask(
            id=f"sql-{template.id}-{suffix}",
            db=template.schema,
            db_path=path,
            question=template.question.format(**values),
            gold_sql=gold,
            expected=expected,
            difficulty=template.difficulty,
            split="test" if row[0] in test_entities else "train",
            template=template.id,
            entity=str(row[0]),
        ))
    return tasks


def _test_entities(template_id: str, entities: list[Any]) -> set[Any]:
    distinct = sorted(set(entities), key=lambda e: _digest(template_id, "split", e))
    if len(distinct) < 2:
        return set()
    return set(distinct[: max(1, round(TEST_SHARE * len(distinct)))])


def _usable(expected: Expected) -> bool:
    n = len(expected.rows)
    return 0 < n <= MAX_GOLD_ROWS and not (n == 1 and len(expected.columns) == 1)


def _digest(*parts: Any) -> str:
    return hashlib.sha1("\x1f".join(map(str, parts)).encode()).hexdigest()
