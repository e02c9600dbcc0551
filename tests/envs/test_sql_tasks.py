from __future__ import annotations

import re
import sqlite3
import time
from collections import defaultdict
from pathlib import Path

import pytest
from cgym.envs.errors import InvalidChoiceError
from cgym.envs.sql import schemas
from cgym.envs.sql.match import compare
from cgym.envs.sql.tasks import builtin_tasks, task_pool
from cgym.envs.sql.templates import TEMPLATES


@pytest.mark.timing
@pytest.mark.parametrize("schema", schemas.SCHEMAS)
def test_schema_builds_fast_and_deterministically(schema: str, tmp_path: Path) -> None:
    start = time.perf_counter()
    first = schemas.build(schema, 3, tmp_path / "a.sqlite")
    assert time.perf_counter() - start < 1.0
    second = schemas.build(schema, 3, tmp_path / "b.sqlite")
    other = schemas.build(schema, 4, tmp_path / "c.sqlite")
    dump = lambda p: list(sqlite3.connect(p).iterdump())  # noqa: E731
    assert dump(first) == dump(second) != dump(other)


@pytest.mark.parametrize("schema", schemas.SCHEMAS)
def test_schemas_are_relational(schema: str, tmp_path: Path) -> None:
    conn = sqlite3.connect(schemas.build(schema, 1, tmp_path / "db.sqlite"))
    tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
    foreign_keys = [fk for t in tables for fk in conn.execute(f"PRAGMA foreign_key_list({t})")]
    rows = sum(conn.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in tables)
    assert len(tables) >= 4 and len(foreign_keys) >= 3 and 300 <= rows <= 2000
    assert conn.execute("PRAGMA foreign_key_check").fetchall() == []


def test_database_path_is_cached_and_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CGYM_SQL_CACHE", str(tmp_path))
    path = schemas.database_path("hr", 11)
    stamp = path.stat().st_mtime_ns
    assert schemas.database_path("hr", 11) == path and path.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp file left behind
    with pytest.raises(InvalidChoiceError, match="Did you mean 'shop'"):
        schemas.database_path("shops", 1)  # type: ignore[arg-type]


@pytest.mark.parametrize("difficulty", ["easy", "medium", "hard"])
@pytest.mark.parametrize("schema", schemas.SCHEMAS)
def test_every_pool_has_tasks(schema: str, difficulty: str) -> None:
    assert len(task_pool(difficulty, "train", schema)) >= 8  # type: ignore[arg-type]
    assert len(task_pool(difficulty, "test", schema)) >= 3  # type: ignore[arg-type]


def test_splits_are_disjoint_by_entity() -> None:
    entities: dict[tuple[str, str], set[str]] = defaultdict(set)
    for schema in schemas.SCHEMAS:
        for task in builtin_tasks(schema):
            entities[(task.template, task.split)].add(task.entity)
    for template in TEMPLATES:
        assert not entities[(template.id, "train")] & entities[(template.id, "test")], template.id
    train_ids = {t.id for s in schemas.SCHEMAS for t in builtin_tasks(s) if t.split == "train"}
    test_ids = {t.id for s in schemas.SCHEMAS for t in builtin_tasks(s) if t.split == "test"}
    assert train_ids and test_ids and not train_ids & test_ids


def test_questions_name_their_columns_and_gold_results_fit() -> None:
    for schema in schemas.SCHEMAS:
        for task in builtin_tasks(schema):
            named = re.search(r"Return columns: ([^;.]+)", task.question)
            assert named, task.id
            wanted = [re.sub(r"\s*\(.*", "", c).strip() for c in named.group(1).split(",")]
            assert wanted == list(task.expected.columns), task.id
            assert 0 < len(task.expected.rows) <= 200
            assert task.expected.ordered == ("ordered by" in task.question), task.id


def test_gold_results_do_not_depend_on_scan_order() -> None:
    """With SQLite's scan order reversed, every gold query still gives the same answer (no ties
    left unbroken at an ORDER BY ... LIMIT boundary, no order the question does not ask for)."""
    for schema in schemas.SCHEMAS:
        tasks = builtin_tasks(schema)
        conn = sqlite3.connect(f"file:{tasks[0].db_path}?mode=ro", uri=True)
        conn.execute("PRAGMA reverse_unordered_selects = ON")
        for task in tasks:
            cursor = conn.execute(task.gold_sql)
            columns = [d[0] for d in cursor.description]
            assert compare(task.expected, columns, cursor.fetchall()) is None, task.id


def test_hard_tasks_need_joins_nesting_or_nulls() -> None:
    for task in task_pool("hard", "test"):
        sql = task.gold_sql.upper()
        assert " JOIN " in sql or "(SELECT" in sql or "NULL" in sql, task.id


def test_the_ground_truth_shows_the_gold_query_and_its_result() -> None:
    task = task_pool("medium", "test", "flights")[0]
    assert task.gold_sql in task.ground_truth and "result:" in task.ground_truth
