"""Bring your own database: a SQLite file plus a JSONL of questions becomes a registered env.

Each JSONL line is ``{"question": ..., "gold_sql": ..., "db": "relative/to/the/jsonl.sqlite"}``
with an optional ``"id"`` (and optional ``"difficulty"`` / ``"split"`` labels to filter on)::

    import cgym.envs.sql, gymnasium as gym
    envs.sql.register_from_jsonl("myorg/MyDb-v0", "tasks.jsonl")
    env = gym.make("myorg/MyDb-v0")

The whole file is checked when it is registered: every line must be UTF-8 JSON with the right
keys, its `db` must lie inside the JSONL's folder (unless `allow_outside=True`) and open within the
sandbox's limits, and its gold query must run there. One `TaskFileError` lists every bad line.
Gold results are computed once, then shared by every env instance.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cgym.envs.errors import CgymError, did_you_mean
from cgym.envs.registration import EnvCard, register
from cgym.envs.rubric import Rubric
from cgym.envs.sql.env import SqlQueryEnv
from cgym.envs.sql.match import Expected
from cgym.envs.sql.sandbox import DEFAULT_TIME_BUDGET_S, Sandbox, SqlError
from cgym.envs.sql.tasks import SUBMIT_ROW_CAP, SqlTask

REQUIRED = ("question", "gold_sql", "db")
OPTIONAL = ("id", "difficulty", "split")
GOLD_BUDGET_S = 5.0  # time budget of reading a database's schema and of each gold query
MAX_REPORTED = 20  # bad lines listed before validation stops

_LOADED: dict[tuple[Path, int, bool], tuple[SqlTask, ...]] = {}


class TaskFileError(CgymError, ValueError):
    """A bring-your-own task file that cannot be used; the message names each bad line and the fix."""


def register_from_jsonl(env_id: str, jsonl_path: str | Path, *, description: str = "", allow_outside: bool = False,
                        **defaults: Any) -> EnvCard:
    """Validate `jsonl_path` and register it as `env_id` (`defaults` become env kwargs).

    `allow_outside=True` accepts `db` paths outside the JSONL's folder (absolute, `../`, symlinks).
    """
    path = Path(jsonl_path).resolve()
    tasks = load_tasks(path, allow_outside=allow_outside)
    text = description or f"SQL questions from {path.name} ({len(tasks)} tasks)."
    return register(env_id, "cgym.envs.sql.byo:JsonlSqlEnv", description=text, agents="cgym.agents.scripted.sql:FAMILY",
                    tasks_file=str(path), allow_outside=allow_outside, **defaults)


def load_tasks(jsonl_path: str | Path, *, allow_outside: bool = False) -> tuple[SqlTask, ...]:
    """Parse and validate a task file, run every gold query once; cached per file version."""
    path = Path(jsonl_path).resolve()
    if not path.is_file():
        raise TaskFileError(f"task file {str(path)!r} not found")
    key = (path, path.stat().st_mtime_ns, allow_outside)
    if key not in _LOADED:
        _LOADED[key] = _load(path, allow_outside)
    return _LOADED[key]


def _load(path: Path, allow_outside: bool) -> tuple[SqlTask, ...]:
    sandboxes: dict[Path, Sandbox] = {}
    tasks: list[SqlTask] = []
    seen: dict[str, int] = {}
    problems: list[str] = []
    try:
        for number, line in _lines(path):
            try:
                task = _task(path, number, _row(path, number, line), sandboxes, allow_outside)
                if task.id in seen:
                    raise TaskFileError(f"{path.name} line {number}: id {task.id!r} is already used on line {seen[task.id]}")
            except TaskFileError as exc:
                problems.append(str(exc))
                if len(problems) == MAX_REPORTED:
                    problems.append(f"(validation stopped after {MAX_REPORTED} bad lines)")
                    break
                continue
            seen[task.id] = number
            tasks.append(task)
    finally:
        for sandbox in sandboxes.values():
            sandbox.close()
    if problems:
        raise TaskFileError(problems[0] if len(problems) == 1 else f"{path.name} has bad lines:\n" + "\n".join(problems))
    if not tasks:
        raise TaskFileError(f"{path.name} holds no tasks; each line needs {{\"question\", \"gold_sql\", \"db\"}}")
    return tuple(tasks)


def _lines(path: Path) -> list[tuple[int, bytes]]:
    """(line number, bytes) of every non-blank line. Lines end at b"\\n" only: JSON strings may
    hold other characters that `str.splitlines` would split on."""
    lines = path.read_bytes().removeprefix(b"\xef\xbb\xbf").split(b"\n")  # without a UTF-8 byte-order mark
    return [(number, raw) for number, raw in enumerate(lines, 1) if raw.strip()]


def _row(path: Path, number: int, raw: bytes) -> dict[str, Any]:
    where = f"{path.name} line {number}"
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TaskFileError(f"{where}: not valid UTF-8 (byte 0x{raw[exc.start]:02x} at byte {exc.start + 1}); "
                            "save the file as UTF-8") from None
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TaskFileError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    except RecursionError:
        raise TaskFileError(f"{where}: not valid for a task (JSON nested too deeply); each line is one flat object") from None
    except ValueError as exc:  # e.g. an integer past Python's digit limit
        raise TaskFileError(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(row, dict):
        raise TaskFileError(f"{where}: expected a JSON object, got {type(row).__name__}")
    for key in REQUIRED:
        if key not in row:
            raise TaskFileError(f"{where}: missing key {key!r} (each row needs {', '.join(REQUIRED)})")
    for key, value in row.items():
        if key not in REQUIRED + OPTIONAL:
            raise TaskFileError(f"{where}: unknown key {key!r}.{did_you_mean(key, REQUIRED + OPTIONAL)}")
        if not isinstance(value, str) or not value.strip():
            raise TaskFileError(f"{where}: {key!r} must be a non-empty string, got {_short(value)}")
    return row


def _task(path: Path, number: int, row: dict[str, Any], sandboxes: dict[Path, Sandbox], allow_outside: bool) -> SqlTask:
    where = f"{path.name} line {number}"
    if "\x00" in row["db"]:
        raise TaskFileError(f"{where}: db {row['db']!r} holds a NUL byte, which no file name can")
    db_path = (path.parent / row["db"]).resolve()  # symlinks resolved: a link out of the folder is outside
    if not allow_outside and not db_path.is_relative_to(path.parent):
        raise TaskFileError(f"{where}: db {row['db']!r} is outside the task file's folder {str(path.parent)!r} (it is "
                            f"{str(db_path)!r}); give a path relative to the JSONL, or pass allow_outside=True")
    if not db_path.is_file():
        raise TaskFileError(f"{where}: db file {row['db']!r} not found (looked for {str(db_path)!r})")
    sandbox = sandboxes.get(db_path)
    if sandbox is None:
        try:
            sandbox = Sandbox(db_path, time_budget_s=GOLD_BUDGET_S).open()
        except SqlError as exc:
            raise TaskFileError(f"{where}: {row['db']!r} is not a readable SQLite database ([{exc.code}] {exc.message})") from None
        sandboxes[db_path] = sandbox
    try:
        result = sandbox.run(row["gold_sql"], max_rows=SUBMIT_ROW_CAP, time_budget_s=GOLD_BUDGET_S)
    except SqlError as exc:
        raise TaskFileError(f"{where}: gold_sql fails to run: [{exc.code}] {exc.message}") from None
    if result.truncated:
        raise TaskFileError(f"{where}: gold_sql returns more than {SUBMIT_ROW_CAP} rows; no submission could match it")
    return SqlTask(
        id=row.get("id", f"{path.stem}-{number}"),
        db=db_path.stem,
        db_path=db_path,
        question=" ".join(row["question"].split()),
        gold_sql=row["gold_sql"].strip(),
        expected=Expected.from_query(row["gold_sql"], result.columns, result.rows),
        difficulty=row.get("difficulty", "any"),
        split=row.get("split", "any"),
    )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class JsonlSqlEnv(SqlQueryEnv):
    """`SqlQueryEnv` over the tasks of a JSONL file (see `register_from_jsonl`).

    Args:
        tasks_file: Path of the JSONL task file.
        allow_outside: Accept `db` paths outside the task file's folder (see `register_from_jsonl`).
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
        allow_outside: bool = False,
        difficulty: str | None = None,
        split: str | None = None,
        max_turns: int = 8,
        query_timeout_s: float = DEFAULT_TIME_BUDGET_S,
        rubric: Rubric | None = None,
        render_mode: str | None = None,
    ) -> None:
        self.tasks_file = str(tasks_file)
        self.allow_outside = allow_outside
        self.difficulty = difficulty  # type: ignore[assignment]
        self.split = split  # type: ignore[assignment]
        self.schema = None
        self._init_common(query_timeout_s, rubric)
        super(SqlQueryEnv, self).__init__(max_turns=max_turns, render_mode=render_mode)
        self.tasks()  # fail at make() time, not at the first reset

    task_order = "walk"  # a task file is a set to cover: consecutive seeds take its rows in order

    def tasks(self) -> tuple[SqlTask, ...]:
        if self._pool is None:
            tasks = load_tasks(self.tasks_file, allow_outside=self.allow_outside)
            pool = tuple(t for t in tasks if _keeps(t.difficulty, self.difficulty) and _keeps(t.split, self.split))
            if not pool:
                raise TaskFileError(f"{self.tasks_file}: no task has difficulty={self.difficulty!r} and split={self.split!r}")
            self._pool = pool
        return self._pool


def _keeps(label: str, wanted: str | None) -> bool:
    """A row is kept when no filter is asked for, it has no label, or the labels agree."""
    return wanted is None or label in ("any", wanted)
