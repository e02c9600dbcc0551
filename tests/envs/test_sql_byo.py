from __future__ import annotations

import json
import os
import sqlite3
import time
import warnings
from pathlib import Path

import cgym.envs.sql
import gymnasium as gym
import pytest
import sqlite_utils
from cgym.agents.eval.episodes import run_episodes
from cgym.agents.scripted import ScriptedPolicy
from cgym.envs.sql import Sandbox, TaskFileError, schemas
from gymnasium.utils.env_checker import check_env

from cgym import envs

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
    spec = cgym.envs.sql.register_from_jsonl("testorg/Library-v0", library / "tasks.jsonl", max_turns=6)
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
        cgym.envs.sql.register_from_jsonl("testorg/Bad-v0", path)
    assert message in str(caught.value)
    assert "testorg/Bad-v0" not in gym.registry


def test_not_a_database_and_empty_files(tmp_path: Path) -> None:
    (tmp_path / "junk.sqlite").write_text("this is not sqlite")
    (tmp_path / "t.jsonl").write_text(json.dumps({"question": "q", "gold_sql": "SELECT 1", "db": "junk.sqlite"}) + "\n")
    with pytest.raises(TaskFileError, match="not a readable SQLite database"):
        cgym.envs.sql.load_tasks(tmp_path / "t.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(TaskFileError, match="holds no tasks"):
        cgym.envs.sql.load_tasks(tmp_path / "empty.jsonl")


# -- hostile task files and databases ---------------------------------------------------------
GOOD = {"question": "q", "gold_sql": "SELECT title FROM books", "db": "data/library.sqlite"}


@pytest.fixture()
def folder(library: Path, tmp_path: Path) -> Path:
    """A task folder holding its own copy of the library database."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "library.sqlite").write_bytes((library / "data" / "library.sqlite").read_bytes())
    return tmp_path


def write_lines(path: Path, *lines: bytes | str) -> Path:
    path.write_bytes(b"\n".join(line if isinstance(line, bytes) else line.encode() for line in lines) + b"\n")
    return path


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (b'{"question": "caf\xe9", "gold_sql": "SELECT 1", "db": "data/library.sqlite"}', "line 2: not valid UTF-8 (byte 0xe9 at byte 18)"),
        ("[" * 100_000 + "]" * 100_000, "line 2: not valid for a task (JSON nested too deeply)"),
        ('{"question": ' + "[" * 500 + "]" * 500 + ', "gold_sql": "SELECT 1", "db": "x"}', "line 2: 'question' must be a non-empty string"),
        ('{"question": "q", "id": ' + "9" * 5_000 + ', "gold_sql": "SELECT 1", "db": "x"}', "line 2: not valid JSON"),
        ('{"question": "q", "gold_sql": "SELECT 1", "db": ""}', "line 2: 'db' must be a non-empty string"),
        ('"just a string"', "line 2: expected a JSON object, got str"),
        ('{"question": "q", "gold_sql": "SELECT 1", "db": "data/library.sqlite\\u0000x"}', "line 2: db 'data/library.sqlite\\x00x' holds a NUL byte"),
    ],
    ids=["invalid-utf8", "deep-json", "deep-value", "huge-number", "empty-db", "not-an-object", "nul-in-db"],
)
def test_malformed_lines_are_task_file_errors_with_the_line(folder: Path, line: bytes | str, message: str) -> None:
    path = write_lines(folder / "t.jsonl", json.dumps(GOOD), line)
    with pytest.raises(TaskFileError) as caught:
        cgym.envs.sql.load_tasks(path)
    assert message in str(caught.value)


def test_every_bad_line_is_reported_at_once(folder: Path) -> None:
    path = write_lines(folder / "t.jsonl", json.dumps(GOOD), b"\xff\xfe", json.dumps(GOOD | {"gold_sql": "SELECT nope FROM books"}),
                       json.dumps(GOOD), "[" * 50_000, json.dumps(GOOD | {"db": "../elsewhere.sqlite"}))
    with pytest.raises(TaskFileError) as caught:
        cgym.envs.sql.load_tasks(path)
    text = str(caught.value)
    assert [f"line {n}:" in text for n in (1, 2, 3, 4, 5, 6)] == [False, True, True, False, True, True], text


def test_a_byte_order_mark_and_crlf_line_ends_are_accepted(folder: Path) -> None:
    path = folder / "t.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(GOOD).encode() + b"\r\n" + json.dumps(GOOD | {"id": "two"}).encode() + b"\r\n")
    assert [t.id for t in cgym.envs.sql.load_tasks(path)] == ["t-1", "two"]


@pytest.mark.parametrize("where", ["absolute", "dot-dot", "symlink-out", "symlinked-folder-out"])
def test_db_paths_are_confined_to_the_task_files_folder_unless_allowed(library: Path, tmp_path: Path, where: str) -> None:
    outside = library / "data" / "library.sqlite"
    inside = tmp_path / "tasks"
    inside.mkdir()
    if where == "absolute":
        db = str(outside)
    elif where == "dot-dot":
        db = os.path.relpath(outside, inside)
    elif where == "symlink-out":
        (inside / "lib.sqlite").symlink_to(outside)
        db = "lib.sqlite"
    else:
        (inside / "data").symlink_to(outside.parent, target_is_directory=True)
        db = "data/library.sqlite"
    path = write_lines(inside / "t.jsonl", json.dumps(GOOD | {"db": db}))
    with pytest.raises(TaskFileError, match="outside the task file's folder .*allow_outside=True"):
        cgym.envs.sql.register_from_jsonl(f"testorg/Out{where.title().replace('-', '')}-v0", path)
    spec = cgym.envs.sql.register_from_jsonl(f"testorg/Allowed{where.title().replace('-', '')}-v0", path, allow_outside=True)
    env = envs.make(spec.id)
    _, info = env.reset(seed=0)
    assert info["task_id"] == "t-1"
    env.close()


def test_a_symlink_that_stays_inside_the_folder_is_fine(folder: Path) -> None:
    (folder / "same.sqlite").symlink_to(folder / "data" / "library.sqlite")
    path = write_lines(folder / "t.jsonl", json.dumps(GOOD | {"db": "same.sqlite"}))
    assert len(cgym.envs.sql.load_tasks(path)) == 1


@pytest.fixture()
def hostile_db(tmp_path: Path) -> Path:
    """Views that never end, a blob view far past the value limit, and an ordinary table."""
    path = tmp_path / "data" / "hostile.sqlite"
    path.parent.mkdir()
    conn = sqlite3.connect(path)
    conn.executescript("""
        CREATE TABLE items (id INTEGER PRIMARY KEY, name TEXT);
        INSERT INTO items VALUES (1, 'a'), (2, 'b'), (3, 'c');
        CREATE TABLE blobs (b BLOB);
        INSERT INTO blobs VALUES (zeroblob(300000));
        CREATE VIEW endless AS WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r) SELECT i FROM r;
        CREATE VIEW endless_max AS WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r) SELECT max(i) AS m FROM r;
        CREATE VIEW huge AS SELECT zeroblob(900000000) AS b;
    """)
    conn.close()
    return path


@pytest.mark.timing
def test_a_hostile_database_registers_quickly_and_its_bad_views_are_named(hostile_db: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cgym.envs.sql.byo, "GOLD_BUDGET_S", 1.0)
    good = {"question": "q", "gold_sql": "SELECT name FROM items ORDER BY id", "db": "data/hostile.sqlite"}
    path = write_lines(hostile_db.parent.parent / "t.jsonl", json.dumps(good),
                       json.dumps(good | {"gold_sql": "SELECT m FROM endless_max"}), json.dumps(good | {"gold_sql": "SELECT b FROM huge"}),
                       json.dumps(good | {"gold_sql": "SELECT length(b) FROM blobs"}), json.dumps(good | {"gold_sql": "SELECT b FROM blobs"}))
    start = time.perf_counter()
    with pytest.raises(TaskFileError) as caught:
        cgym.envs.sql.load_tasks(path)
    assert time.perf_counter() - start < 6.0
    text = str(caught.value)
    assert "line 2: gold_sql fails to run: [timeout]" in text
    assert "line 3: gold_sql fails to run: [result_too_large]" in text and "line 5: gold_sql fails to run: [result_too_large]" in text
    assert "line 1:" not in text and "line 4:" not in text


@pytest.mark.timing
def test_the_schema_of_a_hostile_database_is_read_within_its_budget(hostile_db: Path) -> None:
    start = time.perf_counter()
    with Sandbox(hostile_db, time_budget_s=1.0) as sandbox:
        assert time.perf_counter() - start < 2.0
        tables = sandbox.tables
    assert tables["items"].row_count == 3 and tables["blobs"].row_count == 1
    assert tables["endless"].row_count is None and tables["endless_max"].row_count is None
    assert tables["endless"].sample == ((1,), (2,), (3,))
    assert tables["huge"].sample == () and tables["blobs"].sample == ()  # never fetched past the value limit


def test_list_tables_says_which_counts_are_unknown(hostile_db: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cgym.envs.sql.byo, "GOLD_BUDGET_S", 1.0)
    path = write_lines(hostile_db.parent.parent / "t.jsonl", json.dumps({"question": "q", "gold_sql": "SELECT name FROM items",
                                                                          "db": "data/hostile.sqlite"}))
    env = envs.make(cgym.envs.sql.register_from_jsonl("testorg/Hostile-v0", path).id)
    env.reset(seed=0)
    obs, *_ = env.step(f'<tool_call>{json.dumps({"name": "list_tables", "arguments": {}})}</tool_call>')
    env.close()
    assert "endless (row count unknown" in obs and "items (3 rows)" in obs


@pytest.mark.parametrize(
    ("gold", "message"),
    [
        ("SELECT value FROM json_each('[3, 1, 2]') ORDER BY value", None),
        ("SELECT b.title, j.value FROM books b, json_tree(json_array(b.year)) j WHERE b.id = 1 AND j.atom IS NOT NULL", None),
        ("SELECT count(*) FROM dbstat", "the table-valued function dbstat is not allowed"),
        ("SELECT * FROM pragma_table_info('books')", "the table-valued function pragma_table_info is not allowed"),
        ("WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r WHERE i < 20000) SELECT i FROM r", "more than 10000 rows"),
    ],
    ids=["json-each", "json-tree", "dbstat", "pragma-function", "too-many-rows"],
)
def test_table_valued_functions_in_gold_queries(folder: Path, gold: str, message: str | None) -> None:
    path = write_lines(folder / "t.jsonl", json.dumps(GOOD | {"gold_sql": gold}))
    if message is None:
        assert cgym.envs.sql.load_tasks(path)[0].expected.rows
    else:
        with pytest.raises(TaskFileError, match=message):
            cgym.envs.sql.load_tasks(path)


def test_a_database_replaced_after_the_env_was_made_is_a_cgym_error_at_reset(folder: Path) -> None:
    path = write_lines(folder / "t.jsonl", json.dumps(GOOD))
    env = cgym.envs.sql.JsonlSqlEnv(tasks_file=str(path))
    (folder / "data" / "library.sqlite").write_bytes(b"not a database any more" * 100)
    with pytest.raises(envs.CgymError, match="does not open .*replaced or removed"):
        env.reset(seed=0)
    env.close()
