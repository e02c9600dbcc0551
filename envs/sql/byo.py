"""Bring your own database: a SQLite file plus a JSONL of questions becomes a registered env.

Each JSONL line is ``{"question": ..., "gold_sql": ..., "db": "relative/to/the/jsonl.sqlite"}``
with an optional ``"id"`` (and optional ``"difficulty"`` / ``"split"`` labels to filter on)::

    import envs.sql, gymnasium as gym
    envs.sql.register_from_jsonl("myorg/MyDb-v0", "tasks.jsonl")
    env = gym.make("myorg/MyDb-v0")

Every row is checked when it is registered (a missing key, a database that is not there, a gold
query that fails) and gold results are computed once, then shared by every env instance.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

from envs.errors import CgymError, did_you_mean
from envs.registration import EnvSpec, register
from envs.rubric import Rubric
from envs.sql.env import SqlQueryEnv
from envs.sql.sandbox import DEFAULT_TIME_BUDGET_S, Sandbox, SqlError
from envs.sql.tasks import SqlTask, gold_result, remember

REQUIRED = ("question", "gold_sql", "db")
OPTIONAL = ("id", "difficulty", "split")

_LOADED: dict[tuple[Path, int], tuple[SqlTask, ...]] = {}


class TaskFileError(CgymError, ValueError):
    """A bring-your-own task file that cannot be used; the message names the line and the fix."""


def register_from_jsonl(env_id: str, jsonl_path: str | Path, *, description: str = "", **defaults: Any) -> EnvSpec:
    """Validate `jsonl_path` and register it as `env_id` (`defaults` become env kwargs)."""
    path = Path(jsonl_path).resolve()
    tasks = load_tasks(path)
    text = description or f"SQL questions from {path.name} ({len(tasks)} tasks)."
    return register(env_id, "envs.sql.byo:JsonlSqlEnv", description=text, tasks_file=str(path), **defaults)


def load_tasks(jsonl_path: str | Path) -> tuple[SqlTask, ...]:
    """Parse and validate a task file, run every gold query once; cached per file version."""
    path = Path(jsonl_path).resolve()
    if not path.is_file():
        raise TaskFileError(f"task file {str(path)!r} not found")
    key = (path, path.stat().st_mtime_ns)
    if key not in _LOADED:
        _LOADED[key] = _load(path)
    return _LOADED[key]


def _load(path: Path) -> tuple[SqlTask, ...]:
    sandboxes: dict[Path, Sandbox] = {}
    tasks: list[SqlTask] = []
    seen: dict[str, int] = {}
    try:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            task = _task(path, number, _row(path, number, line), sandboxes)
            if task.id in seen:
                raise TaskFileError(f"{path.name} line {number}: id {task.id!r} is already used on line {seen[task.id]}")
            seen[task.id] = number
            tasks.append(task)
    finally:
        for sandbox in sandboxes.values():
            sandbox.close()
    if not tasks:
        raise TaskFileError(f"{path.name} holds no tasks; each line needs {{\"question\", \"gold_sql\", \"db\"}}")
    for task in tasks:
        remember(task)
    return tuple(tasks)


def _row(path: Path, number: int, line: str) -> dict[str, Any]:
    where = f"{path.name} line {number}"
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TaskFileError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(row, dict):
        raise TaskFileError(f"{where}: expected a JSON object, got {type(row).__name__}")
    for key in REQUIRED:
        if key not in row:
            raise TaskFileError(f"{where}: missing key {key!r} (each row needs {', '.join(REQUIRED)})")
    for key, value in row.items():
        if key not in REQUIRED + OPTIONAL:
            raise TaskFileError(f"{where}: unknown key {key!r}.{did_you_mean(key, REQUIRED + OPTIONAL)}")
        if not isinstance(value, str) or not value.strip():
            raise TaskFileError(f"{where}: {key!r} must be a non-empty string, got {value!r}")
    return row


def _task(path: Path, number: int, row: dict[str, Any], sandboxes: dict[Path, Sandbox]) -> SqlTask:
    where = f"{path.name} line {number}"
    db_path = (path.parent / row["db"]).resolve()
    if not db_path.is_file():
        raise TaskFileError(f"{where}: db file {row['db']!r} not found (looked for {str(db_path)!r})")
    sandbox = sandboxes.get(db_path)
    if sandbox is None:
        try:
            sandbox = sandboxes[db_path] = Sandbox(db_path, time_budget_s=5.0).open()
        except sqlite3.Error as exc:
            raise TaskFileError(f"{where}: {row['db']!r} is not a readable SQLite database ({exc})") from None
    try:
        expected = gold_result(sandbox, row["gold_sql"])
    except SqlError as exc:
        raise TaskFileError(f"{where}: gold_sql fails to run: [{exc.code}] {exc.message}") from None
    return SqlTask(
        id=row.get("id", f"{path.stem}-{number}"),
        db=db_path.stem,
        db_path=db_path,
        question=" ".join(row["question"].split()),
        gold_sql=row["gold_sql"].strip(),
        expected=expected,
        difficulty=row.get("difficulty", "any"),
        split=row.get("split", "any"),
    )


class JsonlSqlEnv(SqlQueryEnv):
    """`SqlQueryEnv` over the tasks of a JSONL file (see `register_from_jsonl`).

    Args:
        tasks_file: Path of the JSONL task file.
        difficulty: Keep only rows with this "difficulty" label (rows without one always stay).
        split: Keep only rows with this "split" label (rows without one always stay).
        max_turns: turn limit; exploration is free until it runs out.
        query_timeout_s: time budget of every query before the sandbox stops it.
        rubric: replace the default rubric (see `envs.sql.checks`).
    """

    def __init__(
        self,
        *,
        tasks_file: str,
        difficulty: str | None = None,
        split: str | None = None,
        max_turns: int = 8,
        query_timeout_s: float = DEFAULT_TIME_BUDGET_S,
        rubric: Rubric | None = None,
        render_mode: str | None = None,
    ) -> None:
        self.tasks_file = str(tasks_file)
        self.difficulty = difficulty  # type: ignore[assignment]
        self.split = split  # type: ignore[assignment]
        self.schema = None
        self._init_common(query_timeout_s, rubric)
        super(SqlQueryEnv, self).__init__(max_turns=max_turns, render_mode=render_mode)
        self.tasks()  # fail at make() time, not at the first reset

    def tasks(self) -> tuple[SqlTask, ...]:
        if self._pool is None:
            pool = tuple(t for t in load_tasks(self.tasks_file) if _keeps(t.difficulty, self.difficulty) and _keeps(t.split, self.split))
            if not pool:
                raise TaskFileError(f"{self.tasks_file}: no task has difficulty={self.difficulty!r} and split={self.split!r}")
            self._pool = pool
        return self._pool


def _keeps(label: str, wanted: str | None) -> bool:
    """A row is kept when no filter is asked for, it has no label, or the labels agree."""
    return wanted is None or label in ("any", wanted)
