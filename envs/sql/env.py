"""`cgym/SqlQuery-v0`: answer a question about a SQLite database with one SQL query.

Tools: `list_tables`, `describe_table`, `run_query` (rows capped) and `submit_query`; a final
answer with the query in a ```sql block counts as a submission too. Every query, exploratory or
submitted, runs in a hardened read-only `Sandbox`. One sandbox per database file is opened per
env and reused across episodes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from cgym.envs.core import AgentEnv
from cgym.envs.episode import Episode
from cgym.envs.errors import CgymError, check_choice, did_you_mean
from cgym.envs.rubric import Rubric
from cgym.envs.sql.checks import default_rubric, judge
from cgym.envs.sql.lexer import extract_query
from cgym.envs.sql.match import render_row
from cgym.envs.sql.sandbox import DEFAULT_TIME_BUDGET_S, Sandbox, SqlError, TableInfo
from cgym.envs.sql.schemas import SCHEMAS, SchemaName
from cgym.envs.sql.tasks import SPLITS, Split, SqlTask, task_pool
from cgym.envs.sql.templates import DIFFICULTIES, Difficulty
from cgym.envs.tools import Tool, ToolError

SHOWN_ROWS = 20
MAX_CELL_CHARS = 60

SYSTEM_PROMPT = (
    "You are a careful data analyst. Answer the question with one SQLite query. Use list_tables, "
    "describe_table and run_query to explore, then call submit_query with your final query. "
    "Return exactly the columns the question asks for, in that order."
)


class DatabaseError(CgymError, RuntimeError):
    """A task's database that no longer opens (replaced or removed after the env was made)."""


class SqlQueryEnv(AgentEnv):
    """Write a SQL query whose result matches the gold query's result.

    Args:
        difficulty: "easy" (one-table filters), "medium" (aggregates, GROUP BY / HAVING,
            ORDER BY / LIMIT) or "hard" (joins, nested queries, NULLs, ties).
        split: "train" or "test"; they use disjoint entities for every question template.
        schema: "shop", "hr", "flights", or None to mix all three.
        max_turns: turn limit; exploration is free until it runs out.
        query_timeout_s: time budget of every query before the sandbox stops it; the queries of
            one turn also share the turn's time budget (`AgentEnv.turn_time_s`).
        rubric: replace the default rubric (see `envs.sql.checks`).
    """

    system_prompt: ClassVar[str] = SYSTEM_PROMPT
    truncation_code: ClassVar[str] = "no_submission"

    def __init__(
        self,
        *,
        difficulty: Difficulty = "easy",
        split: Split = "train",
        schema: SchemaName | None = None,
        max_turns: int = 8,
        query_timeout_s: float = DEFAULT_TIME_BUDGET_S,
        rubric: Rubric | None = None,
        render_mode: str | None = None,
    ) -> None:
        check_choice("difficulty", difficulty, DIFFICULTIES)
        check_choice("split", split, SPLITS)
        if schema is not None:
            check_choice("schema", schema, SCHEMAS)
        self.difficulty = difficulty
        self.split = split
        self.schema = schema
        self._init_common(query_timeout_s, rubric)
        super().__init__(max_turns=max_turns, render_mode=render_mode)

    def _init_common(self, query_timeout_s: float, rubric: Rubric | None) -> None:
        if isinstance(query_timeout_s, bool) or not isinstance(query_timeout_s, (int, float)) or not 0 < query_timeout_s <= 30:
            raise ValueError(f"query_timeout_s must be a number of seconds in (0, 30], got {query_timeout_s!r}")
        self.query_timeout_s = float(query_timeout_s)
        self.rubric = rubric or default_rubric()
        self._sandboxes: dict[Path, Sandbox] = {}
        self._db: Sandbox | None = None
        self._pool: tuple[SqlTask, ...] | None = None

    # -- episode setup -------------------------------------------------------------------
    task_order = "draw"  # the built-in pools are drawn from, as when the recorded SqlQuery figures were measured

    def tasks(self) -> tuple[SqlTask, ...]:
        """The tasks this env samples from (built on first use); `sample_task` draws from them."""
        if self._pool is None:
            self._pool = task_pool(self.difficulty, self.split, self.schema)
        return self._pool

    def begin_episode(self, task: SqlTask) -> None:  # type: ignore[override]
        sandbox = self._sandboxes.get(task.db_path)
        if sandbox is None:
            try:
                sandbox = Sandbox(task.db_path, time_budget_s=self.query_timeout_s).open()
            except SqlError as exc:
                raise DatabaseError(f"task {task.id!r}: its database {str(task.db_path)!r} does not open ([{exc.code}] {exc.message}); was it replaced or removed after the env was made?") from None
            self._sandboxes[task.db_path] = sandbox
        self._db = sandbox

    def close(self) -> None:
        for sandbox in self._sandboxes.values():
            sandbox.close()
        self._sandboxes.clear()
        self._db = None
        super().close()

    def tools(self) -> list[Tool]:
        return [Tool.from_function(m) for m in (self.list_tables, self.describe_table, self.run_query, self.submit_query)]

    # -- tools ---------------------------------------------------------------------------
    def list_tables(self) -> str:
        """List the database's tables with their row counts."""
        db = self._sandbox()
        return "\n".join(f"{t.name} ({_rows(t)})" for t in db.tables.values()) or "(no tables)"

    def describe_table(self, table: str) -> str:
        """Show a table's columns with their types, and a few sample rows.

        Args:
            table: The table's name, as list_tables shows it.
        """
        db = self._sandbox()
        info = db.tables.get(table) or next((t for name, t in db.tables.items() if name.lower() == table.lower()), None)
        if info is None:
            raise ToolError("unknown_table", f"There is no table {table!r}.{did_you_mean(table, db.tables)}",
                            expected=sorted(db.tables), got=table)
        columns = ", ".join(f"{name} {kind}".strip() for name, kind in info.columns)
        sample = _table([name for name, _ in info.columns], list(info.sample))
        return f"Table {info.name} ({_rows(info)})\nColumns: {columns}\nSample rows:\n{sample}"

    def run_query(self, query: str) -> str:
        """Run a read-only SQL query and show up to 20 rows of its result.

        Args:
            query: One SQLite SELECT statement.
        """
        result = self._sandbox().run(query, max_rows=SHOWN_ROWS, time_budget_s=self._query_time())  # a SqlError is a ToolError: it becomes the critique
        count = f"(first {SHOWN_ROWS} rows shown; there are more)" if result.truncated else f"({len(result.rows)} rows)"
        return f"{_table(list(result.columns), result.rows)}\n{count}"

    def submit_query(self, query: str) -> str:
        """Submit your final SQL query; this ends the episode.

        Args:
            query: The SQLite SELECT statement that answers the question.
        """
        assert self.episode is not None, "reset() first"
        self.episode.extras["submitted"] = query
        self.finish(query)
        return "Submitted."

    # -- judging -------------------------------------------------------------------------
    def before_score(self, episode: Episode) -> None:
        """Judge the submission once: the submitted query, else the final answer's ```sql block."""
        if episode.final_answer is None:
            return  # truncated: nothing was submitted
        assert isinstance(episode.task, SqlTask)
        query = episode.extras["submitted"] if "submitted" in episode.extras else extract_query(episode.final_answer)
        if query is not None and "```" in query:
            query = extract_query(query)
        episode.extras["verdict"] = judge(episode.task, query, self._sandbox(), time_budget_s=self._query_time())

    def _query_time(self) -> float:
        """A query's time budget: `query_timeout_s`, within what is left of the turn's budget."""
        return min(self.query_timeout_s, self.turn_time_left())

    def _sandbox(self) -> Sandbox:
        assert self._db is not None, "reset() first"
        return self._db


def _rows(table: TableInfo) -> str:
    """'240 rows', or why there is no count (the sandbox gave up counting within its limits)."""
    return "row count unknown: counting ran past the sandbox's limits" if table.row_count is None else f"{table.row_count} rows"


def _table(columns: list[str], rows: list[tuple[Any, ...]]) -> str:
    """A compact pipe table: header, then one line per row; NULL spelled out."""
    lines = [" | ".join(columns)]
    for row in rows:
        lines.append(" | ".join(_cell(v) for v in render_row(row)))
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if value is None:
        return "NULL"
    text = str(value).replace("\n", " ")
    return text if len(text) <= MAX_CELL_CHARS else text[: MAX_CELL_CHARS - 3] + "..."
