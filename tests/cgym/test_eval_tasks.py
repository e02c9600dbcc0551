"""`cgym eval --tasks`: every task of a task list once, or the tasks named, instead of seeds."""

from __future__ import annotations

import json
from pathlib import Path

import cgym.envs.sql
import pytest
import sqlite_utils
from cgym.agents.eval.evaluate import EvalConfig, evaluate
from cgym.agents.scripted import ScriptedPolicy

from cgym.cli import main

ROWS = [
    {"id": "old", "question": "Titles of books before 1900. Return columns: title.", "gold_sql": "SELECT title FROM books WHERE year < 1900"},
    {"id": "new", "question": "Titles of books from 1900 on. Return columns: title.", "gold_sql": "SELECT title FROM books WHERE year >= 1900"},
    {"id": "count", "question": "How many books are there? Return columns: n.", "gold_sql": "SELECT COUNT(*) AS n FROM books"},
]


@pytest.fixture(scope="module")
def env_id(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("tasks")
    db = sqlite_utils.Database(root / "books.sqlite")
    db["books"].insert_all([{"id": i, "title": f"Book {i}", "year": 1850 + 20 * i} for i in range(6)], pk="id")
    db.close()
    (root / "tasks.jsonl").write_text("".join(json.dumps(row | {"db": "books.sqlite"}) + "\n" for row in ROWS))
    return cgym.envs.sql.register_from_jsonl("evaltasks/Books-v0", root / "tasks.jsonl", max_turns=4).id


def test_the_task_ids_are_each_run_once_times_samples(env_id: str) -> None:
    summary, results = evaluate(ScriptedPolicy("oracle"), EvalConfig(env_id, task_ids=("count", "old"), samples=2))
    assert [r.task_id for r in results] == ["count", "count", "old", "old"]
    assert summary["success_rate"] == 1.0


def test_tasks_all_covers_the_list(env_id: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["eval", "--env", env_id, "--policy", "scripted:oracle", "--tasks", "all", "--split", "none", "--json", str(tmp_path / "out.json")]) == 0
    assert json.loads((tmp_path / "out.json").read_text())["episodes"] == len(ROWS)


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--env", "evaltasks/Books-v0", "--tasks", "olld"], "has no task 'olld'. Did you mean 'old'?"),
        (["--env", "cgym/ApiReport-v0", "--tasks", "all"], "has no fixed task list"),
    ],
    ids=["unknown-id", "generated-tasks"],
)
def test_bad_tasks_are_one_line(env_id: str, argv: list[str], said: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["eval", *argv, "--policy", "scripted:oracle", "--split", "none"])
    err = capsys.readouterr().err
    assert code == 2 and said in err and len(err.strip().splitlines()) == 1
