"""A hardened, read-only SQLite executor for model-written (hostile) SQL.

Defences, outermost first:

1. One statement, and it must read like a query (`SELECT` / `WITH` / `VALUES`).
2. The file is opened read-only (`mode=ro` URI) with `PRAGMA query_only`, no attached
   databases (`SQLITE_LIMIT_ATTACHED = 0`) and extension loading off.
3. An authorizer allows only reads, selects, recursive CTEs and ordinary functions; writes,
   DDL, transactions, ATTACH/DETACH, PRAGMA and `load_extension` are denied.
4. A progress handler ends any statement that runs past its time budget (recursive CTEs,
   huge cross joins); SQLite's length limit stops `randomblob` / `printf` bombs.
5. Rows fetched and total result bytes are capped.

Every refusal raises `SqlError` with a stable critique code.
"""

from __future__ import annotations

import difflib
import re
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from envs.sql.lexer import leading_keyword, split_statements, tokenize
from envs.tools import ToolError

DEFAULT_TIME_BUDGET_S = 1.0
MAX_VALUE_BYTES = 100_000  # longest string/blob SQLite may build
MAX_RESULT_BYTES = 2_000_000  # all fetched values together
MAX_SQL_CHARS = 20_000
SAMPLE_ROWS = 3
_TICK_OPS = 1_000  # VM instructions between time checks

_ALLOWED_ACTIONS = frozenset({sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION, sqlite3.SQLITE_RECURSIVE})
_DENIED_FUNCTIONS = frozenset({"load_extension", "fts3_tokenizer", "readfile", "writefile", "edit"})
_NAMED_ACTIONS = ("CREATE_INDEX", "CREATE_TABLE", "CREATE_TEMP_INDEX", "CREATE_TEMP_TABLE", "CREATE_TEMP_TRIGGER",
                   "CREATE_TEMP_VIEW", "CREATE_TRIGGER", "CREATE_VIEW", "CREATE_VTABLE", "DELETE", "DROP_INDEX", "DROP_TABLE",
                   "DROP_TEMP_INDEX", "DROP_TEMP_TABLE", "DROP_TEMP_TRIGGER", "DROP_TEMP_VIEW", "DROP_TRIGGER", "DROP_VIEW",
                   "DROP_VTABLE", "INSERT", "PRAGMA", "TRANSACTION", "UPDATE", "ATTACH", "DETACH", "ALTER_TABLE", "REINDEX",
                   "ANALYZE", "SAVEPOINT")
_ACTION_NAMES = {getattr(sqlite3, f"SQLITE_{name}"): name for name in _NAMED_ACTIONS}  # for refusal messages
_NO_SUCH = re.compile(r"^no such (table|column): (.+)$")
_NEAR = re.compile(r'^near "(.*)": syntax error$', re.DOTALL)
_SYNTAX = ("syntax error", "incomplete input", "unrecognized token")
_OTHER_STARTS = frozenset({"ALTER", "ANALYZE", "ATTACH", "BEGIN", "COMMIT", "CREATE", "DELETE", "DETACH", "DROP", "END",
                           "EXPLAIN", "INSERT", "PRAGMA", "REINDEX", "RELEASE", "REPLACE", "ROLLBACK", "SAVEPOINT",
                           "UPDATE", "VACUUM"})


class SqlError(ToolError):
    """A query that was refused, failed or stopped; `code` is a stable critique code. Raised from
    a tool, it becomes that step's critique like any `ToolError`."""


@dataclass(frozen=True)
class QueryResult:
    """Column names, the fetched rows, and whether more rows existed than were fetched."""

    columns: tuple[str, ...]
    rows: list[tuple[Any, ...]]
    truncated: bool = False


@dataclass(frozen=True)
class TableInfo:
    """What `describe_table` shows: columns with declared types, size, a few sample rows."""

    name: str
    columns: tuple[tuple[str, str], ...]
    row_count: int
    sample: tuple[tuple[Any, ...], ...]


class Sandbox:
    """A read-only connection to one SQLite file that runs untrusted queries safely.

    Use it as a context manager (or `open()` / `close()`); one connection serves any number of
    queries, so keep it for the life of an env.
    """

    def __init__(self, path: str | Path, *, time_budget_s: float = DEFAULT_TIME_BUDGET_S) -> None:
        self.path = Path(path)
        self.time_budget_s = time_budget_s
        self.tables: dict[str, TableInfo] = {}
        self._conn: sqlite3.Connection | None = None
        self._deadline = 0.0
        self._timed_out = False
        self._denied: list[str] = []

    # -- lifetime -----------------------------------------------------------------------
    def open(self) -> Sandbox:
        """Connect read-only, read the schema, then lock the connection down."""
        if self._conn is not None:
            return self
        if not self.path.is_file():
            raise FileNotFoundError(f"no SQLite database at {str(self.path)!r}")
        conn = sqlite3.connect(f"{self.path.resolve().as_uri()}?mode=ro", uri=True, isolation_level=None, check_same_thread=False)
        try:
            conn.execute("PRAGMA query_only = ON")
            self.tables = _read_schema(conn)
        except sqlite3.Error:
            conn.close()
            raise
        conn.setlimit(sqlite3.SQLITE_LIMIT_ATTACHED, 0)
        conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, MAX_VALUE_BYTES)
        conn.setlimit(sqlite3.SQLITE_LIMIT_SQL_LENGTH, MAX_SQL_CHARS)
        conn.set_authorizer(self._authorize)
        conn.set_progress_handler(self._tick, _TICK_OPS)
        self._conn = conn
        return self

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __enter__(self) -> Sandbox:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def columns(self) -> dict[str, list[str]]:
        """Every column name, mapped to the tables that have it."""
        found: dict[str, list[str]] = {}
        for table in self.tables.values():
            for name, _ in table.columns:
                found.setdefault(name, []).append(table.name)
        return found

    # -- running queries ----------------------------------------------------------------
    def run(self, sql: str, *, max_rows: int, time_budget_s: float | None = None) -> QueryResult:
        """Run one read-only query and fetch at most `max_rows` rows. Raises `SqlError`."""
        conn = self.open()._conn
        assert conn is not None
        statement = self._admit(sql)
        self._deadline = time.perf_counter() + (self.time_budget_s if time_budget_s is None else time_budget_s)
        self._timed_out = False
        self._denied = []
        cursor: sqlite3.Cursor | None = None
        try:
            cursor = conn.execute(statement)
            columns = tuple(d[0] for d in cursor.description or ())
            rows = cursor.fetchmany(max_rows + 1)
        except sqlite3.Error as exc:
            raise self._classify(exc, statement) from None
        except (ValueError, OverflowError, MemoryError) as exc:  # driver-level refusals
            raise SqlError("sql_error", f"The query could not be run: {type(exc).__name__}: {exc}") from None
        finally:
            if cursor is not None:
                cursor.close()
        _check_size(rows)
        return QueryResult(columns, rows[:max_rows], truncated=len(rows) > max_rows)

    def _admit(self, sql: str) -> str:
        if not isinstance(sql, str):
            raise SqlError("sql_syntax_error", f"The query must be a string, got {type(sql).__name__}.", got=repr(sql)[:80])
        if "\x00" in sql or not _encodable(sql):
            raise SqlError("sql_syntax_error", "The query contains a NUL character or text that is not valid Unicode.")
        if len(sql) > MAX_SQL_CHARS:
            raise SqlError("forbidden_statement", f"The query is {len(sql)} characters long; the limit is {MAX_SQL_CHARS}.")
        tokens = tokenize(sql)
        if any(t.kind == "param" for t in tokens):
            raise SqlError("sql_error", "Query parameters (?, :name, @name, $name) are not supported; write the values into the query.")
        statements = split_statements(sql, tokens)
        if not statements:
            raise SqlError("sql_syntax_error", "The query is empty.", expected="one SELECT statement", got=sql[:80])
        if len(statements) > 1:
            raise SqlError("forbidden_statement", f"Run one statement at a time; got {len(statements)}.",
                           expected="one SELECT statement", got=len(statements))
        keyword = leading_keyword(sql, [t for t in tokens if t.text != ";"])
        if keyword in _OTHER_STARTS:
            raise SqlError("forbidden_statement", f"Only read-only queries (SELECT / WITH) are allowed; got {keyword or 'nothing'}.",
                           expected="SELECT", got=keyword)
        return statements[0]

    # -- SQLite callbacks ---------------------------------------------------------------
    def _authorize(self, action: int, arg1: str | None, arg2: str | None, db_name: str | None, source: str | None) -> int:
        if action in _ALLOWED_ACTIONS:
            if action == sqlite3.SQLITE_FUNCTION and (arg2 or "").lower() in _DENIED_FUNCTIONS:
                self._denied.append(f"the function {arg2}()")
                return sqlite3.SQLITE_DENY
            return sqlite3.SQLITE_OK
        self._denied.append(_ACTION_NAMES.get(action, f"action {action}"))
        return sqlite3.SQLITE_DENY

    def _tick(self) -> int:
        if time.perf_counter() > self._deadline:
            self._timed_out = True
            return 1  # non-zero interrupts the statement
        return 0

    # -- errors -------------------------------------------------------------------------
    def _classify(self, exc: sqlite3.Error, statement: str) -> SqlError:
        message = str(exc)
        name = getattr(exc, "sqlite_errorname", "")
        if self._timed_out or name == "SQLITE_INTERRUPT":
            return SqlError("timeout", "The query ran longer than its time budget and was stopped.", got=statement[:200])
        if self._denied or name in ("SQLITE_AUTH", "SQLITE_READONLY"):
            what = ", ".join(dict.fromkeys(self._denied)) or "writing"
            return SqlError("forbidden_statement", f"The query was refused: {what} is not allowed (read-only sandbox).", got=what)
        if name == "SQLITE_TOOBIG":
            return SqlError("result_too_large", f"A value in the result grew past {MAX_VALUE_BYTES} bytes.")
        if isinstance(exc, sqlite3.ProgrammingError):  # e.g. a second statement SQLite found after ours
            return SqlError("forbidden_statement", f"The query was refused: {message}")
        # SQLite reports the rest under the generic SQLITE_ERROR: its message is the only detail.
        missing = _NO_SUCH.match(message)
        if missing:
            return self._unknown(missing.group(1), missing.group(2))
        if any(marker in message for marker in _SYNTAX):
            return SqlError("sql_syntax_error", f"SQLite: {message}{_where(message, statement)}", got=statement[:200])
        return SqlError("sql_error", f"SQLite: {message}", got=statement[:200])

    def _unknown(self, kind: str, name: str) -> SqlError:
        bare = name.rsplit(".", 1)[-1]
        choices = list(self.tables) if kind == "table" else list(self.columns)
        close = difflib.get_close_matches(bare, choices, n=1, cutoff=0.5)
        if kind == "column" and close:
            hint = f" Did you mean {close[0]!r} (in {', '.join(self.columns[close[0]])})?"
        elif close:
            hint = f" Did you mean {close[0]!r}?"
        else:
            hint = f" Known {kind}s: {', '.join(sorted(choices)[:12])}."
        return SqlError(f"unknown_{kind}", f"There is no {kind} {name!r}.{hint}",
                        expected=close[0] if close else None, got=name)


def _read_schema(conn: sqlite3.Connection) -> dict[str, TableInfo]:
    names = [r[0] for r in conn.execute(
        "SELECT name FROM sqlite_master WHERE type IN ('table', 'view') AND name NOT LIKE 'sqlite\\_%' ESCAPE '\\' ORDER BY name")]
    tables: dict[str, TableInfo] = {}
    for name in names:
        quoted = '"' + name.replace('"', '""') + '"'
        columns = tuple((r[1], r[2] or "") for r in conn.execute(f"PRAGMA table_info({quoted})"))
        count = conn.execute(f"SELECT count(*) FROM {quoted}").fetchone()[0]
        sample = tuple(conn.execute(f"SELECT * FROM {quoted} LIMIT {SAMPLE_ROWS}").fetchall())
        tables[name] = TableInfo(name, columns, count, sample)
    return tables


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_size(rows: list[tuple[Any, ...]]) -> None:
    total = 0
    for row in rows:
        for value in row:
            total += len(value) if isinstance(value, (str, bytes)) else 8
    if total > MAX_RESULT_BYTES:
        raise SqlError("result_too_large", f"The result is larger than {MAX_RESULT_BYTES} bytes; select fewer rows or columns.")


def _where(message: str, statement: str) -> str:
    """' (at line L, column C)' for a `near "...": syntax error`, when the token can be found."""
    near = _NEAR.match(message)
    if not near or not near.group(1):
        return " (at the end of the query)" if "incomplete input" in message else ""
    offset = statement.find(near.group(1))
    if offset < 0:
        return ""
    line = statement.count("\n", 0, offset) + 1
    column = offset - (statement.rfind("\n", 0, offset) + 1) + 1
    return f" (at line {line}, column {column})"
