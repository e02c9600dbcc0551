"""A hardened, read-only SQLite executor for model-written (hostile) SQL.

Defences, outermost first:

1. One statement, and it must read like a query (`SELECT` / `WITH` / `VALUES`).
2. The file is opened read-only (`mode=ro` URI) with `PRAGMA query_only`, no attached
   databases and extension loading off.
3. SQLite's own limits (`LIMITS`) bound every string or blob, the SQL text, expression depth,
   compound selects, LIKE/GLOB patterns, function arguments and result columns. Temporary data
   (sorts, DISTINCT, CTE queues) stays in memory under SQLite's hard heap limit.
4. An authorizer allows only reads, selects, recursive CTEs, the built-in functions in
   `ALLOWED_FUNCTIONS` and the table-valued functions `json_each` / `json_tree`.
5. Time. A progress handler and a watchdog thread's `interrupt()` stop a statement at its
   deadline. SQLite heeds them only between rows or inside its own loops, so the work of one
   row is bounded too: the compiled program may hold at most `MAX_PROGRAM_OPS` instructions and
   `MAX_FUNCTION_CALLS` calls, and the built-ins whose cost grows faster than their input (LIKE,
   GLOB, instr, replace, trim with a character set, printf/format) run behind guards that check
   the deadline before every call and refuse inputs that no limit bounds. Compiling is bounded
   by the limits and the heap ceiling alone.
6. Rows are streamed: the fetch stops at the row cap or at `MAX_RESULT_BYTES`.

The schema (names, columns, row counts, sample rows) is read once, under the same limits and one
time budget. Every refusal raises `SqlError` with a stable critique code and names what it refused.
"""

from __future__ import annotations

import itertools
import re
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from cgym.envs.errors import closest, did_you_mean
from cgym.envs.sql.lexer import leading_keyword, split_statements, tokenize
from cgym.envs.tools import ToolError

DEFAULT_TIME_BUDGET_S = 1.0
MAX_VALUE_BYTES = 100_000  # longest string/blob SQLite may build or read
MAX_RESULT_BYTES = 2_000_000  # all fetched values together
MAX_SQL_CHARS = 20_000
MAX_COLUMNS = 200  # so one fetched row holds at most MAX_COLUMNS * MAX_VALUE_BYTES
MAX_PROGRAM_OPS = 10_000  # instructions of the compiled query
MAX_FUNCTION_CALLS = 128  # function calls in the compiled query: the work of one row
MAX_TRIM_WORK = 10_000_000  # len(X) * len(Y) for trim(X, Y), which compares every pair (~40 ms)
HEAP_LIMIT_BYTES = 256 * 2**20  # SQLite's heap, process-wide
SAMPLE_ROWS = 3
MAX_TABLES = 10_000
_TICK_OPS = 1_000  # VM instructions between time checks
_MOST_COLUMNS = 2_000  # SQLite's own ceiling on a table's columns

LIMITS: dict[int, int] = {
    sqlite3.SQLITE_LIMIT_LENGTH: MAX_VALUE_BYTES,
    sqlite3.SQLITE_LIMIT_SQL_LENGTH: 4 * MAX_SQL_CHARS + 64,  # bytes; `_admit` counts characters
    sqlite3.SQLITE_LIMIT_COLUMN: MAX_COLUMNS,
    sqlite3.SQLITE_LIMIT_EXPR_DEPTH: 100,
    sqlite3.SQLITE_LIMIT_COMPOUND_SELECT: 50,
    sqlite3.SQLITE_LIMIT_LIKE_PATTERN_LENGTH: 100,  # one LIKE costs up to len(value) * len(pattern)
    sqlite3.SQLITE_LIMIT_FUNCTION_ARG: 32,
    sqlite3.SQLITE_LIMIT_VDBE_OP: 100 * MAX_PROGRAM_OPS,  # a backstop; `_check_program` refuses, naming the limit
    sqlite3.SQLITE_LIMIT_ATTACHED: 0,
    sqlite3.SQLITE_LIMIT_WORKER_THREADS: 0,  # sorts stay on the thread the progress handler watches
}

# Built-ins whose cost is at most linear in their (bounded) arguments, plus the guarded ones below.
# Anything else (load_extension, fts3_tokenizer, sqlite_log, json_patch, full-text and r-tree
# helpers, functions of newer SQLite versions) is refused until it has been checked.
ALLOWED_FUNCTIONS = frozenset("""
    abs char coalesce glob hex ifnull iif instr length like likelihood likely lower ltrim max min nullif
    printf format quote random randomblob replace round rtrim sign soundex substr substring trim typeof
    unicode unlikely upper zeroblob sqlite_version
    avg count group_concat sum total
    row_number rank dense_rank percent_rank cume_dist ntile lag lead first_value last_value nth_value
    date time datetime julianday strftime unixepoch current_date current_time current_timestamp
    acos acosh asin asinh atan atan2 atanh ceil ceiling cos cosh degrees exp floor ln log log10 log2 mod pi
    pow power radians sin sinh sqrt tan tanh trunc
    json json_array json_array_length json_extract json_insert json_object json_quote json_remove
    json_replace json_set json_type json_valid json_group_array json_group_object -> ->>
""".split())
TABLE_FUNCTIONS = ("json_each", "json_tree")

_ALLOWED_ACTIONS = frozenset({sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_RECURSIVE})
_NAMED_ACTIONS = ("CREATE_INDEX", "CREATE_TABLE", "CREATE_TEMP_INDEX", "CREATE_TEMP_TABLE", "CREATE_TEMP_TRIGGER",
                   "CREATE_TEMP_VIEW", "CREATE_TRIGGER", "CREATE_VIEW", "CREATE_VTABLE", "DELETE", "DROP_INDEX", "DROP_TABLE",
                   "DROP_TEMP_INDEX", "DROP_TEMP_TABLE", "DROP_TEMP_TRIGGER", "DROP_TEMP_VIEW", "DROP_TRIGGER", "DROP_VIEW",
                   "DROP_VTABLE", "INSERT", "PRAGMA", "TRANSACTION", "UPDATE", "ATTACH", "DETACH", "ALTER_TABLE", "REINDEX",
                   "ANALYZE", "SAVEPOINT")
_ACTION_NAMES = {getattr(sqlite3, f"SQLITE_{name}"): name for name in _NAMED_ACTIONS}  # for refusal messages
_SCHEMA_TABLES = frozenset({"sqlite_master", "sqlite_temp_master"})
_TABLE_FUNCTION = "a table-valued function"  # placeholder in `_denied`, named in `_refused`
_CALL_OPCODES = frozenset({b"Function", b"PureFunc", b"AggStep", b"AggStep1", b"AggValue", b"AggInverse", b"AggFinal"})
_NO_SUCH = re.compile(r"^no such (table|column): (.+)$")
_NEAR = re.compile(r'^near "(.*)": syntax error$', re.DOTALL)
_SYNTAX = ("syntax error", "incomplete input", "unrecognized token")
_OTHER_STARTS = frozenset({"ALTER", "ANALYZE", "ATTACH", "BEGIN", "COMMIT", "CREATE", "DELETE", "DETACH", "DROP", "END",
                           "EXPLAIN", "INSERT", "PRAGMA", "REINDEX", "RELEASE", "REPLACE", "ROLLBACK", "SAVEPOINT",
                           "UPDATE", "VACUUM"})
# A printf directive as SQLite reads it: flags, width, precision, length, conversion.
_DIRECTIVE = re.compile(r"%[-+ #!,0]*(\*|\d*)(?:\.(\*|\d*))?(?:ll?)?(.?)", re.DOTALL)
_CONVERSIONS = frozenset("dsgzqQwcouxXfeEGinp%")  # SQLite stops formatting at any other character


class SqlError(ToolError):
    """A query that was refused, failed or stopped; `code` is a stable critique code. Raised from
    a tool, it becomes that step's critique like any `ToolError`."""


class _Stopped(Exception):
    """Raised inside a guard to abort the statement; the reason is in `Sandbox._stop`."""


@dataclass(frozen=True)
class QueryResult:
    """Column names, the fetched rows, and whether more rows existed than were fetched."""

    columns: tuple[str, ...]
    rows: list[tuple[Any, ...]]
    truncated: bool = False


@dataclass(frozen=True)
class TableInfo:
    """What `describe_table` shows: columns with declared types, size, a few sample rows.

    `row_count` is None when counting did not finish within the schema's time budget or limits.
    """

    name: str
    columns: tuple[tuple[str, str], ...]
    row_count: int | None
    sample: tuple[tuple[Any, ...], ...]


class Sandbox:
    """A read-only connection to one SQLite file that runs untrusted queries safely.

    Use it as a context manager (or `open()` / `close()`); one connection serves any number of
    queries, so keep it for the life of an env. Opening lowers SQLite's hard heap limit for the
    whole process to `HEAP_LIMIT_BYTES` (a lower limit already set is kept).
    """

    def __init__(self, path: str | Path, *, time_budget_s: float = DEFAULT_TIME_BUDGET_S) -> None:
        self.path = Path(path)
        self.time_budget_s = time_budget_s
        self.tables: dict[str, TableInfo] = {}
        self._conn: sqlite3.Connection | None = None
        self._helper: sqlite3.Connection | None = None  # runs the guarded built-ins
        self._modules: frozenset[str] = frozenset()  # virtual-table modules, to name a refused one
        self._budget_s = time_budget_s
        self._deadline = 0.0
        self._stop: SqlError | None = None  # why a callback stopped the statement
        self._denied: list[str] = []

    # -- lifetime -----------------------------------------------------------------------
    def open(self) -> Sandbox:
        """Connect read-only, lock the connection down, read the schema. Raises `SqlError` when
        the file is not a database or its schema cannot be read within the limits."""
        if self._conn is not None:
            return self
        if not self.path.is_file():
            raise FileNotFoundError(f"no SQLite database at {str(self.path)!r}")
        conn = sqlite3.connect(f"{self.path.resolve().as_uri()}?mode=ro", uri=True, isolation_level=None, check_same_thread=False)
        try:
            self._configure(conn)
            self.tables = self._read_schema(conn)
        except BaseException:
            conn.close()
            self._close_helper()
            raise
        conn.set_authorizer(self._authorize)
        self._conn = conn
        return self

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        self._close_helper()

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

    def _configure(self, conn: sqlite3.Connection) -> None:
        conn.execute("PRAGMA query_only = ON")
        conn.execute("PRAGMA temp_store = MEMORY")  # spilled sorts count against the heap limit, not the disk
        _cap_heap(conn)
        conn.set_progress_handler(self._tick, _TICK_OPS)
        self._start(self.time_budget_s)
        with self._translated("reading the schema"):
            conn.execute("SELECT count(*) FROM sqlite_master").fetchone()  # parses the schema: wide tables must precede the column limit
            for limit, value in LIMITS.items():
                conn.setlimit(limit, value)
            # Register the allowed table-valued functions now: the authorizer refuses registering others.
            conn.execute(f"SELECT 1 FROM {', '.join(f'{name}(1)' for name in TABLE_FUNCTIONS)}").fetchall()
            self._modules = frozenset(name for (name,) in conn.execute("SELECT name FROM pragma_module_list"))
        self._helper = _helper_connection()
        for name, n_args, check in _GUARDED:
            conn.create_function(name, n_args, partial(self._guarded, name, check), deterministic=True)

    def _close_helper(self) -> None:
        if self._helper is not None:
            self._helper.close()
            self._helper = None

    # -- running queries ----------------------------------------------------------------
    def run(self, sql: str, *, max_rows: int, time_budget_s: float | None = None) -> QueryResult:
        """Run one read-only query and fetch at most `max_rows` rows. Raises `SqlError`."""
        conn = self.open()._conn
        assert conn is not None
        statement = self._admit(sql)
        self._start(self.time_budget_s if time_budget_s is None else time_budget_s)
        self._check_program(conn, statement)
        return self._fetch(conn, statement, max_rows)

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

    def _check_program(self, conn: sqlite3.Connection, statement: str) -> None:
        """Compile `statement` (the authorizer sees it here) and refuse a program so large, or
        with so many calls, that one row of it could outlast the deadline."""
        ops = calls = 0
        with self._translated(statement):
            conn.text_factory = bytes  # the listing shows literals, and a blob literal is not UTF-8 text
            cursor = conn.execute(f"EXPLAIN {statement}")
            try:
                for _, opcode, *_ in cursor:
                    ops += 1
                    calls += opcode in _CALL_OPCODES
                    if ops > MAX_PROGRAM_OPS:
                        raise SqlError("query_too_complex", f"The query was refused: it compiles to more than {MAX_PROGRAM_OPS} "
                                       "instructions; simplify it.", expected=MAX_PROGRAM_OPS, got=ops)
            finally:
                cursor.close()
                conn.text_factory = str
        if calls > MAX_FUNCTION_CALLS:
            raise SqlError("query_too_complex", f"The query was refused: it makes {calls} function calls per row (the limit is "
                           f"{MAX_FUNCTION_CALLS}); simplify it.", expected=MAX_FUNCTION_CALLS, got=calls)

    def _fetch(self, conn: sqlite3.Connection, sql: str, max_rows: int) -> QueryResult:
        """Run `sql` under the current deadline, streaming rows until `max_rows` or `MAX_RESULT_BYTES`."""
        if time.perf_counter() > self._deadline:  # compiling is out of the progress handler's reach
            raise self._timeout()
        with self._translated(sql), _WATCHDOG.armed(conn, self._deadline):
            cursor = conn.execute(sql)
            try:
                columns = tuple(d[0] for d in cursor.description or ())
                rows: list[tuple[Any, ...]] = []
                size = 0
                for row in cursor:  # one sqlite3_step per row: nothing beyond the caps is fetched
                    if len(rows) == max_rows:
                        return QueryResult(columns, rows, truncated=True)
                    size += _row_bytes(row)
                    if size > MAX_RESULT_BYTES:
                        raise SqlError("result_too_large", f"The result is larger than {MAX_RESULT_BYTES} bytes after "
                                       f"{len(rows)} rows; select fewer rows or columns.", expected=MAX_RESULT_BYTES)
                    rows.append(row)
            finally:
                cursor.close()
        return QueryResult(columns, rows)

    def _start(self, budget_s: float) -> None:
        self._budget_s = budget_s
        self._deadline = time.perf_counter() + budget_s
        self._stop = None
        self._denied = []

    @contextmanager
    def _translated(self, statement: str) -> Iterator[None]:
        """Turn whatever SQLite or the driver raises into a `SqlError`."""
        try:
            yield
        except sqlite3.Error as exc:
            raise self._classify(exc, statement) from None
        except MemoryError:
            raise self._stop or _out_of_memory() from None
        except (ValueError, OverflowError) as exc:  # driver-level refusals
            raise SqlError("sql_error", f"The query could not be run: {type(exc).__name__}: {exc}") from None

    # -- the schema ---------------------------------------------------------------------
    def _read_schema(self, conn: sqlite3.Connection) -> dict[str, TableInfo]:
        """Names, columns, row counts and samples, all within one time budget: tables come before
        views, and what fails, or is left when the budget is spent, is left out."""
        self._start(self.time_budget_s)
        names = self._fetch(conn, "SELECT name FROM sqlite_master WHERE type IN ('table', 'view') "
                            "AND name NOT LIKE 'sqlite\\_%' ESCAPE '\\' ORDER BY type = 'view', name", MAX_TABLES).rows
        tables: dict[str, TableInfo] = {}
        sampled = 0  # bytes of all samples together: past MAX_RESULT_BYTES the rest go unsampled
        for (name,) in names:
            quoted = '"' + name.replace('"', '""') + '"'
            columns = self._try(conn, f"PRAGMA table_info({quoted})", _MOST_COLUMNS)
            count = self._try(conn, f"SELECT count(*) FROM {quoted}", 1)
            sample = self._try(conn, f"SELECT * FROM {quoted} LIMIT {SAMPLE_ROWS}", SAMPLE_ROWS) if sampled < MAX_RESULT_BYTES else []
            sampled += sum(map(_row_bytes, sample))
            tables[name] = TableInfo(name, tuple((r[1], r[2] or "") for r in columns), count[0][0] if count else None, tuple(sample))
        return dict(sorted(tables.items()))

    def _try(self, conn: sqlite3.Connection, sql: str, max_rows: int) -> list[tuple[Any, ...]]:
        """The rows of one schema query, or none if it failed. It gets a quarter of the budget at
        most, so one endless view cannot starve the tables after it."""
        deadline = self._deadline
        self._deadline = min(deadline, time.perf_counter() + self.time_budget_s / 4)
        try:
            return self._fetch(conn, sql, max_rows).rows
        except SqlError:
            return []
        finally:
            self._deadline, self._stop, self._denied = deadline, None, []

    # -- SQLite callbacks ---------------------------------------------------------------
    def _authorize(self, action: int, arg1: str | None, arg2: str | None, db_name: str | None, source: str | None) -> int:
        if action in _ALLOWED_ACTIONS:
            return sqlite3.SQLITE_OK
        if action == sqlite3.SQLITE_FUNCTION:
            if (arg2 or "").lower() in ALLOWED_FUNCTIONS:
                return sqlite3.SQLITE_OK
            self._denied.append(f"the function {arg2}()")
        elif action == sqlite3.SQLITE_UPDATE and arg1 in _SCHEMA_TABLES:
            # Naming an unregistered table-valued function (dbstat, sqlite_stmt, pragma_*) makes
            # SQLite register it in its in-memory schema first; only json_each/json_tree are.
            self._denied.append(_TABLE_FUNCTION)
        else:
            self._denied.append(_ACTION_NAMES.get(action, f"action {action}"))
        return sqlite3.SQLITE_DENY

    def _tick(self) -> int:
        if time.perf_counter() > self._deadline:
            self._stop = self._timeout()
            return 1  # non-zero interrupts the statement
        return 0

    def _guarded(self, name: str, check: _Check | None, *args: Any) -> Any:
        """Run the built-in `name` on the helper connection, after the deadline and cost checks."""
        assert self._helper is not None
        if time.perf_counter() > self._deadline:
            self._stop = self._timeout()
            raise _Stopped
        refusal = check(args, partial(_as_number, self._helper)) if check else None
        if refusal:
            self._stop = SqlError("query_too_complex", f"The query was refused: the function {name}() {refusal}.", got=name)
            raise _Stopped
        try:
            return self._helper.execute(f"SELECT {name}({', '.join('?' * len(args))})", args).fetchone()[0]
        except sqlite3.Error as exc:
            self._stop = self._classify(exc, f"{name}()")
            raise _Stopped from None
        except MemoryError:
            self._stop = _out_of_memory()
            raise _Stopped from None

    # -- errors -------------------------------------------------------------------------
    def _classify(self, exc: sqlite3.Error, statement: str) -> SqlError:
        if self._stop is not None:
            return self._stop
        message = str(exc)
        name = getattr(exc, "sqlite_errorname", "")
        if name == "SQLITE_INTERRUPT":
            return self._timeout()
        if self._denied or name in ("SQLITE_AUTH", "SQLITE_READONLY"):
            what, hint = self._refused(statement)
            return SqlError("forbidden_statement", f"The query was refused: {what} is not allowed in the read-only sandbox{hint}.",
                            got=what)
        if name == "SQLITE_TOOBIG":
            return SqlError("result_too_large", f"A string or blob grew past the sandbox's limit of {MAX_VALUE_BYTES} bytes "
                            "(or is stored larger than that).", expected=MAX_VALUE_BYTES)
        if isinstance(exc, sqlite3.ProgrammingError):  # e.g. a second statement SQLite found after ours
            return SqlError("forbidden_statement", f"The query was refused: {message}")
        # SQLite reports the rest under the generic SQLITE_ERROR: its message is the only detail.
        missing = _NO_SUCH.match(message)
        if missing:
            return self._unknown(missing.group(1), missing.group(2))
        if any(marker in message for marker in _SYNTAX):
            return SqlError("sql_syntax_error", f"SQLite: {message}{_where(message, statement)}", got=statement[:200])
        return SqlError("sql_error", f"SQLite: {message}", got=statement[:200])

    def _timeout(self) -> SqlError:
        return SqlError("timeout", f"The query ran longer than its time budget ({self._budget_s:g} s) and was stopped.",
                        expected=self._budget_s)

    def _refused(self, statement: str) -> tuple[str, str]:
        """What the authorizer denied (a table-valued function named from the statement), and a hint."""
        refused = list(dict.fromkeys(self._denied))
        if _TABLE_FUNCTION not in refused:
            return ", ".join(refused) or "writing", ""
        named = [t.text for t in tokenize(statement) if t.text.lower() in self._modules or t.text.lower().startswith("pragma_")]
        if named:
            refused[refused.index(_TABLE_FUNCTION)] = f"the table-valued function {', '.join(dict.fromkeys(named))}"
        return ", ".join(refused), f"; only {' and '.join(TABLE_FUNCTIONS)} are"

    def _unknown(self, kind: str, name: str) -> SqlError:
        bare = name.rsplit(".", 1)[-1]
        choices = list(self.tables) if kind == "table" else list(self.columns)
        close = closest(bare, choices)
        if kind == "column" and close:
            hint = f" Did you mean {close!r} (in {', '.join(self.columns[close])})?"
        elif close:
            hint = did_you_mean(bare, choices)
        else:
            hint = f" Known {kind}s: {', '.join(sorted(choices)[:12])}."
        return SqlError(f"unknown_{kind}", f"There is no {kind} {name!r}.{hint}", expected=close, got=name)


# -- guarded built-ins: a check returns why a call is refused, or None --------------------------
_Check = Callable[[tuple[Any, ...], Callable[[Any], float]], "str | None"]


def _trim_cost(args: tuple[Any, ...], number: Callable[[Any], float]) -> str | None:
    """trim(X, Y) compares every character of X's ends with every character of Y."""
    work = _length(args[0]) * _length(args[1])
    if work > MAX_TRIM_WORK:
        return (f"with a {_length(args[1])}-character set on a {_length(args[0])}-character string needs {work} "
                f"comparisons (at most {MAX_TRIM_WORK})")
    return None


def _printf_sizes(args: tuple[Any, ...], number: Callable[[Any], float]) -> str | None:
    """printf/format loop once per unit of width or precision, whatever the result's limit."""
    fmt = args[0] if args else None
    if not isinstance(fmt, (str, bytes)):
        return None  # a NULL or numeric format holds no directives
    text = fmt if isinstance(fmt, str) else fmt.decode("utf-8", "replace")
    values, used = args[1:], 0
    for directive in _DIRECTIVE.finditer(text):
        width, precision, conversion = directive.groups()
        for part in (width, precision):
            if part == "*":  # the next argument is the width or precision
                size = abs(number(values[used])) if used < len(values) else 0.0
                used += 1
            else:
                size = float(part or 0)
            if size > MAX_VALUE_BYTES:
                return f"has a width or precision of {size:.0f} (at most {MAX_VALUE_BYTES})"
        if conversion not in _CONVERSIONS:
            break
        used += conversion not in "n%"
    return None


_GUARDED: tuple[tuple[str, int, _Check | None], ...] = (
    ("like", 2, None), ("like", 3, None), ("glob", 2, None),  # up to len(X) * pattern limit: ~40 ms a call
    ("instr", 2, None), ("replace", 3, None),  # a memcmp at every position: ~70 ms a call at the value limit
    ("trim", 2, _trim_cost), ("ltrim", 2, _trim_cost), ("rtrim", 2, _trim_cost),
    ("printf", -1, _printf_sizes), ("format", -1, _printf_sizes),
)


class _Watchdog:
    """One daemon thread that calls `interrupt()` on connections whose deadline has passed.

    SQLite checks the interrupt flag inside single long instructions that the progress handler
    cannot reach (counting a huge table is one). One thread serves every sandbox: a timer thread
    per query would cost a millisecond each.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._armed: dict[int, tuple[float, sqlite3.Connection]] = {}
        self._tokens = itertools.count()
        self._thread: threading.Thread | None = None

    @contextmanager
    def armed(self, conn: sqlite3.Connection, deadline: float) -> Iterator[None]:
        with self._cond:
            token = next(self._tokens)
            self._armed[token] = (deadline, conn)
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="sql-sandbox-watchdog", daemon=True)
                self._thread.start()
            self._cond.notify()
        try:
            yield
        finally:
            with self._cond:  # interrupts happen under this lock: none can land after we leave
                self._armed.pop(token, None)

    def _watch(self) -> None:
        with self._cond:
            while True:
                if not self._armed:
                    self._cond.wait()
                    continue
                token, (deadline, conn) = min(self._armed.items(), key=lambda item: item[1][0])
                wait = deadline - time.perf_counter()
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                del self._armed[token]
                try:
                    conn.interrupt()
                except sqlite3.ProgrammingError:  # closed meanwhile
                    pass


_WATCHDOG = _Watchdog()


def _helper_connection() -> sqlite3.Connection:
    """A private in-memory connection where the guarded built-ins run, under the same limits."""
    helper = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
    for limit in (sqlite3.SQLITE_LIMIT_LENGTH, sqlite3.SQLITE_LIMIT_LIKE_PATTERN_LENGTH, sqlite3.SQLITE_LIMIT_FUNCTION_ARG):
        helper.setlimit(limit, LIMITS[limit])
    return helper


def _as_number(helper: sqlite3.Connection, value: Any) -> float:
    """`value` read as a number the way SQLite reads a printf `*` argument (text by its prefix)."""
    if isinstance(value, (int, float)):
        return float(value)
    if value is None:
        return 0.0
    return float(helper.execute("SELECT CAST(? AS REAL)", (value,)).fetchone()[0])


def _row_bytes(row: tuple[Any, ...]) -> int:
    return sum(len(v) if isinstance(v, (str, bytes)) else 8 for v in row)


def _length(value: Any) -> int:
    return len(value) if isinstance(value, (str, bytes)) else 32


def _cap_heap(conn: sqlite3.Connection) -> None:
    """Lower SQLite's process-wide hard heap limit to `HEAP_LIMIT_BYTES`, keeping a lower one."""
    current = conn.execute("PRAGMA hard_heap_limit").fetchone()[0]
    if current == 0 or current > HEAP_LIMIT_BYTES:
        conn.execute(f"PRAGMA hard_heap_limit = {HEAP_LIMIT_BYTES}")


def _out_of_memory() -> SqlError:
    return SqlError("memory_limit", f"The query needed more than the sandbox's {HEAP_LIMIT_BYTES // 2**20} MB of memory and "
                    "was stopped; sort, group or select fewer or smaller rows.", expected=HEAP_LIMIT_BYTES)


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


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
