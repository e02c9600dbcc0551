"""The sandbox's time and memory bounds, attacked by class rather than by example.

Each class (string blow-ups, row-doubling CTEs, costly patterns, deep or wide statements, wide
results, cartesian joins, work multiplied inside one row, large sorts, refused functions) has
several members. Every one must end within `LIMIT_S` of wall time, grow the process's memory by
less than `MEMORY_LIMIT_BYTES`, and come back as a `SqlError` whose message names what stopped it;
through the env, as a critique, never an exception.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from cgym.envs.sql import SqlQueryEnv, schemas
from cgym.envs.sql.sandbox import HEAP_LIMIT_BYTES, MAX_FUNCTION_CALLS, MAX_TRIM_WORK, MAX_VALUE_BYTES, Sandbox, SqlError

BUDGET_S = 0.5
LIMIT_S = 2.0  # the budget, plus one guarded call or a compile stopped by the heap ceiling, on a busy machine
MEMORY_LIMIT_BYTES = HEAP_LIMIT_BYTES + 150 * 2**20  # SQLite's heap ceiling, plus fetched rows and allocator slack

BIG = "printf('%.*c', 99000, 'a')"  # a string just under the value limit, built cheaply
ROWS_4K = "WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r WHERE i < 4000)"


CODE_WORDS = {"timeout": "time budget", "memory_limit": "MB of memory", "result_too_large": "bytes",
              "query_too_complex": "refused", "forbidden_statement": "refused", "sql_error": "SQLite: "}


def fan_out(expression: str, copies: int) -> str:
    """`copies` uses of one column whose definition SQLite copies into each use (flattening)."""
    return f"SELECT {', '.join(['y'] * copies)} FROM (SELECT {expression} AS y FROM (SELECT random() AS x))"


# (id, SQL, codes it may end with, words the message must contain: "" for the code's own words)
ATTACKS: list[tuple[str, str, set[str], str]] = [
    # one call that builds a huge string
    ("printf-precision", "SELECT length(printf('%.*c', 2000000000, 'x'))", {"query_too_complex"}, "printf()"),
    ("printf-width", "SELECT length(printf('%2000000000d', 1))", {"query_too_complex"}, "width or precision"),
    ("format-star-text", "SELECT length(format('%.*c', '2000000000', 'x'))", {"query_too_complex"}, "format()"),
    ("zeroblob", "SELECT zeroblob(2000000000)", {"result_too_large"}, f"{MAX_VALUE_BYTES} bytes"),
    ("randomblob", "SELECT length(randomblob(1500000000))", {"result_too_large"}, f"{MAX_VALUE_BYTES} bytes"),
    ("replace-growth", "SELECT length(replace(hex(zeroblob(49000)), '0', 'aaaaaaaa'))", {"result_too_large"}, "bytes"),
    ("substr-of-bomb", "SELECT substr(zeroblob(900000000), 1, 5)", {"result_too_large"}, "bytes"),
    ("doubling-string", "WITH RECURSIVE r(s) AS (SELECT 'ab' UNION ALL SELECT s || s FROM r) SELECT max(length(s)) FROM r",
     {"result_too_large"}, "bytes"),
    ("group-concat", "SELECT length(group_concat(randomblob(9000))) FROM order_items a, order_items b",
     {"result_too_large", "timeout"}, ""),
    ("json-array", "SELECT length(json_group_array(hex(randomblob(9000)))) FROM order_items", {"result_too_large"}, "bytes"),
    # work quadratic in the values' length, inside one call
    ("trim-charset", f"WITH s(c) AS MATERIALIZED (SELECT {BIG} || 'b') SELECT length(trim(c, substr(c, 1, 9000) || 'c')) FROM s",
     {"query_too_complex"}, "comparisons"),
    ("ltrim-charset", f"SELECT length(ltrim({BIG}, printf('%.*c', 9000, 'b') || 'a'))", {"query_too_complex"}, "ltrim()"),
    ("instr-rows", f"SELECT count(*) FROM (SELECT 1 FROM order_items a, order_items b) WHERE instr({BIG} || random(), "
     "printf('%.*c', 49000, 'a') || 'b')", {"timeout"}, "time budget"),
    ("replace-rows", f"SELECT count(replace({BIG} || random(), printf('%.*c', 49000, 'a') || 'b', '')) "
     "FROM order_items a, order_items b", {"timeout"}, "time budget"),
    # LIKE / GLOB patterns
    ("like-long-pattern", f"SELECT {BIG} LIKE printf('%.*c', 5000, '%') || 'b'", {"sql_error"}, "pattern too complex"),
    ("glob-long-pattern", f"SELECT {BIG} GLOB replace(printf('%.*c', 500, 'x'), 'x', '*a') || 'b'", {"sql_error"}, "pattern too complex"),
    ("like-quadratic-rows", f"SELECT count(*) FROM order_items a, order_items b WHERE {BIG} || a.id LIKE "
     "'%' || printf('%.*c', 97, 'a') || 'b'", {"timeout"}, "time budget"),
    ("glob-class-rows", f"SELECT count(*) FROM order_items a, order_items b WHERE {BIG} || a.id GLOB "
     "'*[' || printf('%.*c', 95, 'b') || ']*'", {"timeout"}, "time budget"),
    # work multiplied inside one row, out of the progress handler's reach
    # (3 calls per copy: the copies of LIKE or instr that fit under MAX_FUNCTION_CALLS outlast the budget
    # on a slow machine; a fast one finishes the LIKE copies (about 0.4 s) inside it, so None: may complete)
    ("like-fan-out", fan_out(f"{BIG} || x LIKE '%' || printf('%.*c', 97, 'a') || 'b'", MAX_FUNCTION_CALLS // 3), {"timeout", None}, "time budget"),
    ("instr-fan-out", fan_out(f"instr({BIG} || x, printf('%.*c', 49000, 'a') || 'b')", MAX_FUNCTION_CALLS // 3), {"timeout"}, "time budget"),
    ("calls-fan-out", fan_out(f"length(upper({BIG} || x))", 190), {"query_too_complex"}, "function calls"),
    ("or-chain", f"WITH v(x) AS MATERIALIZED (SELECT {BIG}) SELECT " + " OR ".join(["x LIKE '%b%'"] * 400) + " FROM v",
     {"sql_error", "query_too_complex"}, "too large"),
    # row-doubling CTEs and cartesian joins
    ("cte-doubling-recursive", "WITH RECURSIVE r(x) AS (SELECT 1 UNION ALL SELECT x FROM r, (VALUES (1), (2))) SELECT count(*) FROM r",
     {"timeout", "memory_limit"}, ""),
    ("cte-doubling-levels", "WITH a(x) AS (VALUES (1), (2)), b AS (SELECT 1 FROM a, a y), c AS (SELECT 1 FROM b, b y), "
     "d AS (SELECT 1 FROM c, c y), e AS (SELECT 1 FROM d, d y), f AS (SELECT 1 FROM e, e y) SELECT count(*) FROM f",
     {"timeout"}, "time budget"),
    ("cte-doubling-blobs", "WITH RECURSIVE r(x, b) AS (SELECT 1, randomblob(90000) UNION ALL SELECT x, b FROM r, (VALUES (1), (2))) "
     "SELECT count(*) FROM (SELECT b FROM r ORDER BY b)", {"timeout", "memory_limit"}, ""),
    ("cte-doubling-chain", "WITH c0 AS (SELECT 1 AS x), " + ", ".join(f"c{i} AS (SELECT a.x FROM c{i - 1} a, c{i - 1} b)" for i in range(1, 21))
     + " SELECT count(*) FROM c20", {"memory_limit", "timeout", "sql_error"}, ""),
    ("cte-distinct-queue", "WITH RECURSIVE r(i) AS (SELECT 1 UNION SELECT i + 1 FROM r) SELECT count(*) FROM r", {"timeout", "memory_limit"}, ""),
    ("correlated-cubic", "SELECT count(*) FROM order_items a WHERE (SELECT count(*) FROM order_items b, order_items c WHERE b.id < a.id) > 0",
     {"timeout"}, "time budget"),
    ("cartesian-count", "SELECT count(*) FROM order_items a, order_items b, order_items c, order_items d", {"timeout"}, "time budget"),
    ("cartesian-sorted", "SELECT a.id FROM order_items a, order_items b, order_items c ORDER BY random() LIMIT 1", {"timeout"}, "time budget"),
    # large sorts and sets: the heap ceiling
    ("sort-wide-keys", f"{ROWS_4K} SELECT i FROM r ORDER BY zeroblob(90000) || i LIMIT 1 OFFSET 3999",
     {"memory_limit", "timeout"}, ""),
    ("distinct-wide", f"{ROWS_4K} SELECT count(DISTINCT zeroblob(90000) || i) FROM r", {"memory_limit", "timeout"}, ""),
    # wide results: streamed and capped while fetched
    ("wide-blob-rows", "SELECT randomblob(99000), randomblob(99000) FROM order_items a, order_items b", {"result_too_large"}, "2000000 bytes"),
    ("wide-columns", "SELECT " + ", ".join(["b"] * 150) + " FROM (SELECT randomblob(90000) AS b)", {"result_too_large"}, "bytes"),
    ("too-many-columns", "SELECT " + ", ".join(["1"] * 500), {"sql_error"}, "too many columns"),
    # deep or long statements
    ("deep-parens", "SELECT " + "(" * 3000 + "1" + ")" * 3000, {"sql_error"}, "stack overflow"),
    ("deep-functions", "SELECT " + "abs(" * 300 + "1" + ")" * 300, {"sql_error", "query_too_complex"}, ""),
    ("deep-subqueries", "SELECT " + "(SELECT " * 200 + "1" + ")" * 200, {"sql_error"}, ""),
    ("long-sum", "SELECT " + " + ".join(["1"] * 3000), {"sql_error"}, "depth"),
    ("compound-selects", " UNION ".join(f"SELECT {i}" for i in range(600)), {"sql_error"}, "compound"),
    ("huge-program", "SELECT 5 IN (" + ", ".join(["1"] * 6000) + ")", {"query_too_complex"}, "instructions"),
    # functions and table-valued functions outside the allowlist
    ("sqlite-log", "SELECT sqlite_log(1, 'x')", {"forbidden_statement"}, "sqlite_log()"),
    ("json-patch", "SELECT json_patch('{}', '{}')", {"forbidden_statement"}, "json_patch()"),
    ("fts3-tokenizer", "SELECT fts3_tokenizer('simple')", {"forbidden_statement"}, "fts3_tokenizer()"),
    ("load-extension", "SELECT load_extension('/tmp/evil.so')", {"forbidden_statement"}, "load_extension()"),
    ("dbstat", "SELECT count(*) FROM dbstat", {"forbidden_statement"}, "table-valued function dbstat"),
    ("sqlite-stmt", "SELECT sql FROM sqlite_stmt", {"forbidden_statement"}, "sqlite_stmt"),
    ("pragma-function", "SELECT * FROM pragma_table_info('orders')", {"forbidden_statement"}, "pragma_table_info"),
]


@pytest.fixture(scope="module")
def shop_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hostile") / "shop.sqlite"
    schemas.build("shop", schemas.DEFAULT_SEED, path)
    return path


@pytest.fixture(scope="module")
def sandbox(shop_db: Path) -> Iterator[Sandbox]:
    with Sandbox(shop_db, time_budget_s=BUDGET_S) as opened:
        yield opened


@contextmanager
def peak_memory_growth() -> Iterator[list[int]]:
    """The most this process's resident memory grew while the block ran, sampled by a thread
    (SQLite releases the GIL while it steps, so the sampler sees its heap too)."""
    if not os.path.exists("/proc/self/statm"):
        pytest.skip("needs /proc to read resident memory")
    page = os.sysconf("SC_PAGE_SIZE")

    def resident() -> int:
        return int(Path("/proc/self/statm").read_text().split()[1]) * page

    base, peak, done = resident(), [0], threading.Event()

    def sample() -> None:
        while not done.wait(0.002):
            peak[0] = max(peak[0], resident() - base)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    growth = [0]
    try:
        yield growth
    finally:
        done.set()
        sampler.join()
        growth[0] = max(peak[0], resident() - base)


def test_there_are_several_attacks_per_class() -> None:
    assert len(ATTACKS) >= 40 and len({name for name, *_ in ATTACKS}) == len(ATTACKS)


@pytest.mark.timing
@pytest.mark.parametrize(("sql", "codes", "named"), [a[1:] for a in ATTACKS], ids=[a[0] for a in ATTACKS])
def test_attack_ends_fast_in_bounded_memory_with_a_named_refusal(sandbox: Sandbox, sql: str, codes: set[str], named: str) -> None:
    start = time.perf_counter()
    refusal: SqlError | None = None
    with peak_memory_growth() as growth:
        try:
            sandbox.run(sql, max_rows=10_000)
        except SqlError as exc:
            refusal = exc
    elapsed = time.perf_counter() - start
    assert elapsed < LIMIT_S, f"{elapsed:.2f} s"
    assert growth[0] < MEMORY_LIMIT_BYTES, f"grew {growth[0] / 2**20:.0f} MB"
    if refusal is None:
        assert None in codes, "the attack ran to completion instead of being refused"
    else:
        assert refusal.code in codes, (refusal.code, refusal.message)
        assert (named or CODE_WORDS[refusal.code]) in refusal.message
    assert sandbox.run("SELECT count(*) FROM orders", max_rows=1).rows == [(240,)]  # still usable afterwards


@pytest.mark.timing
def test_attacks_through_the_env_become_critiques() -> None:
    """Both tools answer every attack with a critique naming its code: no exception leaves `step`."""
    env = SqlQueryEnv(schema="shop", query_timeout_s=0.2)
    for name, sql, codes, _ in ATTACKS:
        for tool in ("run_query", "submit_query"):
            env.reset(seed=0)
            start = time.perf_counter()
            _, reward, _, _, info = env.step(f'<tool_call>{json.dumps({"name": tool, "arguments": {"query": sql}})}</tool_call>')
            assert time.perf_counter() - start < LIMIT_S, (name, tool)
            critique = info["critique"] if tool == "run_query" else info["critiques"][-1]
            if None in codes and (critique is None or critique["code"] not in codes):
                continue  # it finished inside the budget, which this attack may do on a fast machine
            assert critique["code"] in codes, (name, tool, critique)
            assert tool == "run_query" or reward == -1.0
    env.close()


# -- what the limits must not break ------------------------------------------------------------
GUARDED_CASES = [
    "SELECT 'Abc' LIKE 'a%', 'abc' LIKE 'A_C', 'é' LIKE 'É', x'616263' LIKE 'abc', NULL LIKE 'a', 12 LIKE '1%'",
    "SELECT 'a%c' LIKE 'a!%c' ESCAPE '!', 'abc' GLOB 'a*', 'abc' GLOB 'A*', 'a]' GLOB '*[]]', 3.5 GLOB '3.*'",
    "SELECT instr('hello', 'l'), instr(x'00ff01', x'ff01'), instr(12345, 34), instr('héllo', 'l'), instr(NULL, 'a')",
    "SELECT replace('aXbXc', 'X', '--'), replace(1.5, '.', ','), replace('abc', '', 'x'), replace(x'6162', 'a', 'z')",
    "SELECT trim('xxhixx', 'x'), ltrim('  a ', ' '), rtrim('abcba', 'ab'), trim('ééaéé', 'é'), trim(12.0, '0'), trim(NULL, 'x')",
    "SELECT printf('%5.2f|%-4d|%s|%q|%c|%x', 3.14159, 7, 'hi', 'it''s', 'zed', 255), format('%.*s', 2, 'abc'), printf(NULL)",
    "SELECT printf('%*d|%%|%n%d', 3, 1, 2), printf('%.3c', 'é'), printf('%!.20g', 0.1), printf('%,d', 1234567), printf('%z')",
]


@pytest.mark.parametrize("sql", GUARDED_CASES, ids=["like", "glob-escape", "instr", "replace", "trim", "printf", "printf-more"])
def test_guarded_builtins_answer_exactly_as_sqlite_does(sandbox: Sandbox, sql: str) -> None:
    expected = sqlite3.connect(":memory:").execute(sql).fetchall()
    assert sandbox.run(sql, max_rows=5).rows == expected


@pytest.mark.parametrize(
    ("sql", "rows"),
    [
        ("SELECT value FROM json_each('[10, 20, 30]') ORDER BY value DESC", [(30,), (20,), (10,)]),
        ("SELECT key, atom FROM json_tree('{\"a\": {\"b\": 2}}') WHERE atom IS NOT NULL", [("b", 2)]),
        ("SELECT c.name, j.value FROM customers c, json_each(json_array(c.id, c.id * 2)) j WHERE c.id = 1", None),
        ("SELECT json_extract('{\"a\": [1, 2]}', '$.a[1]'), '{\"a\": 3}' ->> '$.a', json_array_length('[1,2]')", [(2, 3, 2)]),
        (f"SELECT length({BIG}), length(trim({BIG}, 'a')), printf('%.2f', 2.5)", [(99000, 0, "2.50")]),
        ("SELECT status, count(*) FROM orders WHERE status LIKE '%e%' GROUP BY status ORDER BY 1 LIMIT 1", None),
    ],
    ids=["json-each", "json-tree", "json-each-join", "json-scalars", "big-values", "like-in-where"],
)
def test_ordinary_queries_still_run(sandbox: Sandbox, sql: str, rows: list[tuple[object, ...]] | None) -> None:
    result = sandbox.run(sql, max_rows=20)
    assert result.rows if rows is None else result.rows == rows


def test_the_limits_leave_the_trim_and_call_caps_reachable(sandbox: Sandbox) -> None:
    """Just under each cap runs; the caps are not set so low that they refuse ordinary work."""
    side = int(MAX_TRIM_WORK ** 0.5)
    assert sandbox.run(f"SELECT length(trim(printf('%.*c', {side}, 'a'), printf('%.*c', {side - 1}, 'b') || 'a'))",
                       max_rows=1).rows == [(0,)]
    calls = ", ".join(["upper('a')"] * (MAX_FUNCTION_CALLS - 2))
    assert len(sandbox.run(f"SELECT {calls}", max_rows=1).rows[0]) == MAX_FUNCTION_CALLS - 2


@pytest.mark.timing
def test_rows_stream_and_stop_at_the_row_cap(sandbox: Sandbox) -> None:
    """A result far past the cap is not fetched: stopping at 5 rows of an endless CTE is instant."""
    start = time.perf_counter()
    result = sandbox.run("WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r) SELECT i FROM r", max_rows=5)
    assert result.truncated and result.rows == [(i,) for i in range(1, 6)]
    assert time.perf_counter() - start < 0.2


def test_one_long_instruction_is_interrupted_at_the_deadline(tmp_path: Path) -> None:
    """`count(*)` walks the whole table inside one instruction, where the progress handler never
    runs; the watchdog's interrupt stops it."""
    path = tmp_path / "wide.sqlite"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE t (b BLOB)")
    conn.execute("WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r WHERE i < 300000) INSERT INTO t SELECT randomblob(150) FROM r")
    conn.commit()
    conn.close()
    with Sandbox(path) as sandbox:
        start = time.perf_counter()
        assert sandbox.run("SELECT count(*) FROM t", max_rows=1).rows == [(300_000,)]
        unbounded = time.perf_counter() - start
        with pytest.raises(SqlError, match="time budget"):
            sandbox.run("SELECT count(*) FROM t", max_rows=1, time_budget_s=unbounded / 20)
        assert sandbox.run("SELECT count(*) FROM t", max_rows=1).rows == [(300_000,)]  # no interrupt left behind
