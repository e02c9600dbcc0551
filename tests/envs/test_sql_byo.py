from __future__ import annotations

import json
import warnings
from pathlib import Path

import gymnasium as gym
import pytest
import sqlite_utils
from gymnasium.utils.env_checker import check_env

import envs
import envs.sql
from agents.episodes import run_episodes
from agents.scripted import ScriptedPolicy
from envs.sql import TaskFileError, schemas

QUESTIONS = [
    {"question": "List the titles of books published before 1950. Return columns: title.",
     "gold_sql": "SELECT title FROM books WHERE year < 1950"},
    {"question": "How many books has each author written? Return columns: author, books; ordered by books descending, then author.",
     "gold_sql": "SELECT a.name AS author, COUNT(*) AS books FROM authors a JOIN books b ON b.author_id = a.id "
                 "GROUP BY a.id ORDER BY books DESC, author", "id": "per-author"},
    {"question": "Which books have never been loaned? Return columns: title, year.",
     "gold_sql": "SELECT title, year FROM books b WHERE NOT EXISTS (SELECT 1 FROM loans l WHERE l.book_id = b.id)"},
    {"question": "Which loans are still open (returned is NULL)? Return columns: book_id, member.",
     "gold_sql": "SELECT book_id, member FROM loans WHERE returned IS NULL", "split": "test"},
]


@pytest.fixture(scope="module")
def library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small library database and its question file, as a user would bring them."""
    root = tmp_path_factory.mktemp("byo")
    (root / "data").mkdir()
    db = sqlite_utils.Database(root / "data" / "library.sqlite")
    db["authors"].insert_all([{"id": i, "name": n} for i, n in enumerate(["Austen", "Borges", "Calvino", "Dickens"], 1)], pk="id")
    db["books"].insert_all(
        [{"id": i, "title": f"Book {i}", "author_id": 1 + i % 4, "year": 1800 + 17 * i} for i in range(1, 13)],
        pk="id", foreign_keys=[("author_id", "authors", "id")],
    )
    db["loans"].insert_all(
        [{"id": i, "book_id": 1 + (3 * i) % 9, "member": f"m{i % 5}", "returned": None if i % 3 == 0 else f"2024-01-0{1 + i % 8}"}
         for i in range(1, 16)],
        pk="id", foreign_keys=[("book_id", "books", "id")],
    )
    db.close()
    lines = [json.dumps(q | {"db": "data/library.sqlite"}) for q in QUESTIONS]
    (root / "tasks.jsonl").write_text("\n".join(lines[:2]) + "\n\n" + "\n".join(lines[2:]) + "\n")
    return root


@pytest.fixture(scope="module")
def env_id(library: Path) -> str:
    spec = envs.sql.register_from_jsonl("testorg/Library-v0", library / "tasks.jsonl", max_turns=6)
    assert "4 tasks" in spec.description
    return spec.id


def test_registered_env_passes_check_env(env_id: str) -> None:
    env = gym.make(env_id, disable_env_checker=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(env.unwrapped)
    assert env.unwrapped.max_turns == 6


def test_oracle_solves_every_byo_task(env_id: str) -> None:
    results = run_episodes(lambda: envs.make(env_id), ScriptedPolicy("oracle"), range(40))
    assert all(r.success for r in results), [r.summary() for r in results if not r.success][:2]
    assert {r.task_id for r in results} == {"tasks-1", "per-author", "tasks-4", "tasks-5"}


@pytest.mark.parametrize("agent", ["exploit_select_star", "exploit_guess_constants", "wrong_column", "missing_join_condition"])
def test_flawed_and_exploit_agents_fail_on_byo(env_id: str, agent: str) -> None:
    results = run_episodes(lambda: envs.make(env_id), ScriptedPolicy(agent), range(12))
    assert not any(r.success for r in results)


def test_split_labels_filter_and_unlabelled_rows_stay(env_id: str) -> None:
    env = envs.make(env_id, split="train")
    ids = {env.reset(seed=s)[1]["task_id"] for s in range(40)}
    assert ids == {"tasks-1", "per-author", "tasks-4"}


def test_byo_database_is_never_written(env_id: str, library: Path) -> None:
    db = library / "data" / "library.sqlite"
    before = schemas.file_digest(db)
    env = envs.make(env_id)
    env.reset(seed=0)
    for sql in ["DROP TABLE books", "UPDATE loans SET returned = NULL", "ATTACH ':memory:' AS x", "PRAGMA journal_mode = WAL"]:
        env.step(f'<tool_call>{json.dumps({"name": "run_query", "arguments": {"query": sql}})}</tool_call>')
    env.close()
    assert schemas.file_digest(db) == before


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"question": "q", "db": "data/library.sqlite"}', "line 2: missing key 'gold_sql'"),
        ('{"question": "q", "gold_sql": "SELECT 1", "db": "nope.sqlite"}', "line 2: db file 'nope.sqlite' not found"),
        ('{"question": "q", "gold_sql": "SELECT titel FROM books", "db": "data/library.sqlite"}', "line 2: gold_sql fails to run: [unknown_column]"),
        ('{"question": "q", "gold": "SELECT 1", "gold_sql": "SELECT 1", "db": "data/library.sqlite"}', "unknown key 'gold'. Did you mean 'gold_sql'?"),
        ('{"question": "q", "gold_sql": "DELETE FROM books", "db": "data/library.sqlite"}', "[forbidden_statement]"),
        ("not json", "line 2: not valid JSON"),
        ('{"question": 3, "gold_sql": "SELECT 1", "db": "data/library.sqlite"}', "'question' must be a non-empty string"),
        ('{"question": "q", "gold_sql": "SELECT 1 AS x", "db": "data/library.sqlite", "id": "dup"}', "id 'dup' is already used on line 1"),
    ],
    ids=["missing-key", "no-db", "bad-gold", "typo-key", "write-gold", "bad-json", "bad-type", "duplicate-id"],
)
def test_bad_rows_are_rejected_with_line_numbers(library: Path, tmp_path: Path, line: str, message: str) -> None:
    first = json.dumps({"question": "q", "gold_sql": "SELECT title FROM books", "db": "data/library.sqlite", "id": "dup"})
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "library.sqlite").write_bytes((library / "data" / "library.sqlite").read_bytes())
    path = tmp_path / "bad.jsonl"
    path.write_text(first + "\n" + line + "\n")
    with pytest.raises(TaskFileError) as caught:
        envs.sql.register_from_jsonl("testorg/Bad-v0", path)
    assert message in str(caught.value)
    assert "testorg/Bad-v0" not in gym.registry


def test_not_a_database_and_empty_files(tmp_path: Path) -> None:
    (tmp_path / "junk.sqlite").write_text("this is not sqlite")
    (tmp_path / "t.jsonl").write_text(json.dumps({"question": "q", "gold_sql": "SELECT 1", "db": "junk.sqlite"}) + "\n")
    with pytest.raises(TaskFileError, match="not a readable SQLite database"):
        envs.sql.load_tasks(tmp_path / "t.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(TaskFileError, match="holds no tasks"):
        envs.sql.load_tasks(tmp_path / "empty.jsonl")
