from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path

import pytest
from cgym.envs.sql import schemas
from cgym.envs.sql.sandbox import MAX_SQL_CHARS, Sandbox, SqlError

# Statements a hostile (or merely confused) model might write. Each must be refused or stopped.
HOSTILE: list[str] = [
    "DROP TABLE customers",
    "DELETE FROM orders",
    "INSERT INTO orders (id) VALUES (100000)",
    "UPDATE customers SET name = 'pwned'",
    "REPLACE INTO products (id, name) VALUES (1, 'x')",
    "CREATE TABLE pwned (x)",
    "CREATE TEMP TABLE scratch AS SELECT * FROM customers",
    "CREATE VIEW v AS SELECT 1",
    "CREATE INDEX idx ON customers (name)",
    "CREATE TRIGGER t AFTER INSERT ON orders BEGIN DELETE FROM orders; END",
    "ALTER TABLE customers ADD COLUMN x",
    "ATTACH DATABASE '{tmp}/attached.db' AS pwn",
    "DETACH DATABASE main",
    "PRAGMA writable_schema = ON",
    "PRAGMA query_only = OFF",
    "VACUUM",
    "VACUUM INTO '{tmp}/vacuumed.db'",
    "BEGIN IMMEDIATE",
    "SAVEPOINT s1",
    "ANALYZE",
    "REINDEX",
    "EXPLAIN SELECT 1",
    "SELECT load_extension('/tmp/evil.so')",
    "SELECT 1; DROP TABLE customers",
    "/* harmless */ DROP TABLE orders",
    "DELETE FROM customers -- '; SELECT 1",
    "WITH x AS (SELECT 1) DELETE FROM orders",
    "WITH x AS (SELECT 1) INSERT INTO orders (id) SELECT 99999",
    "SELECT * FROM pragma_table_info('customers')",
    "WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r) SELECT max(i) FROM r",
    "WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r) SELECT i FROM r ORDER BY i DESC LIMIT 1",
    "SELECT count(*) FROM order_items a, order_items b, order_items c",
    "SELECT * FROM order_items a CROSS JOIN order_items b CROSS JOIN order_items c ORDER BY random() LIMIT 1",
    "SELECT randomblob(1000000000)",
    "SELECT zeroblob(2000000000)",
    "SELECT replace(hex(zeroblob(60000)), '0', 'aaaa')",
    "SELECT length(randomblob(50000)) FROM order_items a, order_items b ORDER BY random()",
    "SELECT group_concat(hex(randomblob(1000))) FROM order_items a, order_items b",
    "SELECT writefile('/tmp/cgym-pwn.txt', 'x')",
    "SELECT " + "(" * 3000 + "1" + ")" * 3000,
    "SELECT 1 -- " + "x" * MAX_SQL_CHARS,
    "SELECT '\x00'; DROP TABLE orders",
    "SELECT * FROM customers WHERE id = ?",
]

CODES = {"forbidden_statement", "timeout", "result_too_large", "sql_error", "sql_syntax_error"}


@pytest.fixture(scope="module")
def shop_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private copy of the shop database, so the hash check sees only this module's work."""
    path = tmp_path_factory.mktemp("sandbox") / "shop.sqlite"
    schemas.build("shop", schemas.DEFAULT_SEED, path)
    return path


def test_there_are_at_least_thirty_hostile_statements() -> None:
    assert len(HOSTILE) >= 30


@pytest.mark.timing
def test_hostile_statements_are_refused_quickly_and_never_write(shop_db: Path, tmp_path: Path) -> None:
    before = schemas.file_digest(shop_db)
    with Sandbox(shop_db, time_budget_s=0.3) as sandbox:
        for sql in HOSTILE:
            sql = sql.replace("{tmp}", str(tmp_path))
            start = time.perf_counter()
            with pytest.raises(SqlError) as caught:
                sandbox.run(sql, max_rows=20)
            assert time.perf_counter() - start < 2.0, sql[:80]
            assert caught.value.code in CODES, (sql[:80], caught.value.code)
        assert sandbox.run("SELECT count(*) FROM orders", max_rows=1).rows == [(240,)]  # still usable
    assert schemas.file_digest(shop_db) == before
    assert list(tmp_path.iterdir()) == []  # no ATTACH / VACUUM INTO file appeared


@pytest.mark.parametrize(
    ("sql", "code"),
    [
        ("DROP TABLE customers", "forbidden_statement"),
        ("WITH x AS (SELECT 1) DELETE FROM orders", "forbidden_statement"),
        ("SELECT load_extension('x')", "forbidden_statement"),
        ("WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r) SELECT max(i) FROM r", "timeout"),
        ("SELECT randomblob(1000000000)", "result_too_large"),
        ("SELECT nme FROM customers", "unknown_column"),
        ("SELECT * FROM customer", "unknown_table"),
        ("SELECT name FROM customers WHERE", "sql_syntax_error"),
        ("SELEC name FROM customers", "sql_syntax_error"),
        ("   -- only a comment", "sql_syntax_error"),
        ("SELECT nosuchfn(1)", "sql_error"),
    ],
    ids=["write", "cte-write", "extension", "runaway", "blob-bomb", "column", "table", "incomplete", "typo", "empty", "function"],
)
def test_errors_have_stable_codes(shop_db: Path, sql: str, code: str) -> None:
    with Sandbox(shop_db, time_budget_s=0.2) as sandbox, pytest.raises(SqlError) as caught:
        sandbox.run(sql, max_rows=5)
    assert caught.value.code == code


@pytest.mark.timing
def test_default_budget_stops_a_runaway_query_within_about_a_second(shop_db: Path) -> None:
    with Sandbox(shop_db) as sandbox:
        start = time.perf_counter()
        with pytest.raises(SqlError, match="time budget"):
            sandbox.run("SELECT count(*) FROM order_items a, order_items b, order_items c", max_rows=1)
        assert 0.5 < time.perf_counter() - start < 2.0


def test_did_you_mean_for_tables_and_columns(shop_db: Path) -> None:
    with Sandbox(shop_db) as sandbox:
        with pytest.raises(SqlError) as table:
            sandbox.run("SELECT * FROM order_item", max_rows=1)
        with pytest.raises(SqlError) as column:
            sandbox.run("SELECT c.emial FROM customers c", max_rows=1)
    assert "Did you mean 'order_items'?" in table.value.message and table.value.expected == "order_items"
    assert "Did you mean 'email' (in customers)?" in column.value.message and column.value.got == "c.emial"


def test_syntax_error_says_where(shop_db: Path) -> None:
    with Sandbox(shop_db) as sandbox, pytest.raises(SqlError) as caught:
        sandbox.run("SELECT name\nFROM customers\nWHERE city = 'Oslo' AND AND tier = 'gold'", max_rows=1)
    assert 'near "AND": syntax error (at line 3, column' in caught.value.message


def test_rows_are_capped_and_truncation_reported(shop_db: Path) -> None:
    with Sandbox(shop_db) as sandbox:
        capped = sandbox.run("SELECT id FROM orders ORDER BY id", max_rows=20)
        small = sandbox.run("SELECT id FROM orders WHERE id <= 3 ORDER BY id", max_rows=20)
    assert capped.truncated and capped.rows == [(i,) for i in range(1, 21)]
    assert not small.truncated and small.columns == ("id",) and len(small.rows) == 3


def test_schema_is_read_once_with_samples(shop_db: Path) -> None:
    with Sandbox(shop_db) as sandbox:
        orders = sandbox.tables["orders"]
    assert [name for name, _ in orders.columns][:3] == ["id", "customer_id", "order_date"]
    assert orders.row_count == 240 and len(orders.sample) == 3
    assert set(sandbox.tables) == {"customers", "orders", "order_items", "products"}


def test_connection_is_really_read_only_underneath(shop_db: Path) -> None:
    """Even past the authorizer (here: the raw connection) the file cannot be written."""
    with Sandbox(shop_db) as sandbox:
        conn = sandbox._conn
        assert conn is not None
        conn.set_authorizer(None)
        with pytest.raises(sqlite3.OperationalError):
            conn.execute("DELETE FROM orders")
    assert not os.path.exists(str(shop_db) + "-journal")


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no SQLite database"):
        Sandbox(tmp_path / "nope.sqlite").open()
