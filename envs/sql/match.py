"""Execution match: compare a query's result with the gold result, explain any difference.

Rows are compared as multisets, numbers with a tolerance (`3 == 3.0`, float noise ignored),
columns by position (the question fixes their order). Order matters only when the gold query
orders its result; rows that tie on the gold sort key may come in any order.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cgym.envs.sql.lexer import has_top_level_limit, order_key, top_level_order_by

Row = tuple[Any, ...]
REL_TOL = 1e-6
ABS_TOL = 1e-6
EXAMPLES = 3


@dataclass(frozen=True)
class Expected:
    """The gold result. `order_by` holds the result positions of the gold sort key: None when
    the result is unordered, () when it is ordered by something outside the result (then the
    whole row sequence must match)."""

    columns: tuple[str, ...]
    rows: list[Row]
    order_by: tuple[int, ...] | None = None
    limited: bool = False

    @classmethod
    def from_query(cls, gold_sql: str, columns: Sequence[str], rows: list[Row]) -> Expected:
        """Build the gold result, reading the sort key and LIMIT from the gold query."""
        return cls(tuple(columns), list(rows), sort_positions(gold_sql, columns), has_top_level_limit(gold_sql))

    @property
    def ordered(self) -> bool:
        return self.order_by is not None


@dataclass(frozen=True)
class Mismatch:
    """Why a result differs: a stable critique code, the cause, and compact expected/got."""

    code: str
    message: str
    expected: Any = None
    got: Any = None


def sort_positions(gold_sql: str, columns: Sequence[str]) -> tuple[int, ...] | None:
    """Result positions of the gold ORDER BY terms; () when a term is not a result column."""
    terms = top_level_order_by(gold_sql)
    if terms is None:
        return None
    names = [c.upper() for c in columns]
    positions: list[int] = []
    for term in terms:
        key = order_key(term)
        if key.isdigit() and 1 <= int(key) <= len(columns):
            positions.append(int(key) - 1)
        elif key in names:
            positions.append(names.index(key))
        elif "." in key and key.rsplit(".", 1)[1].strip('"`[]') in names:
            positions.append(names.index(key.rsplit(".", 1)[1].strip('"`[]')))
        else:
            return ()
    return tuple(positions)


def compare(expected: Expected, columns: Sequence[str], rows: list[Row], *, query: str | None = None) -> Mismatch | None:
    """None when `rows` match the gold result, else the first reason they do not.

    With the submitted `query`, a missing ORDER BY is named as the cause when the gold result
    is ordered and the rows come back in another order (or, under a LIMIT, as other rows).
    """
    if len(columns) != len(expected.columns):
        return Mismatch(
            "wrong_columns",
            f"The result has {len(columns)} column(s) ({_names(columns)}) but the question asks for "
            f"{len(expected.columns)}: {_names(expected.columns)}.",
            expected=list(expected.columns),
            got=list(columns),
        )
    unordered = expected.ordered and query is not None and top_level_order_by(query) is None
    missing, extra = _difference(expected.rows, rows)
    if missing or extra:
        if _permuted_columns_match(expected.rows, rows, len(columns)):
            return Mismatch(
                "wrong_columns",
                f"The right values, but the columns are in the wrong order; return them as ({_names(expected.columns)}).",
                expected=list(expected.columns),
                got=list(columns),
            )
        if unordered and expected.limited and len(rows) == len(expected.rows):
            return _missing_order_by(expected, "so the LIMIT keeps other rows than the answer's")
        return _row_mismatch(expected, rows, missing, extra)
    if not expected.ordered:
        return None
    wrong_order = _order_mismatch(expected, rows)
    if wrong_order is not None and unordered:
        return _missing_order_by(expected, "and the rows come back in another order")
    return wrong_order


def values_equal(a: Any, b: Any) -> bool:
    """SQL value equality with numeric tolerance; text never equals a number."""
    if _is_number(a) and _is_number(b):
        return a == b or math.isclose(a, b, rel_tol=REL_TOL, abs_tol=ABS_TOL)
    return type(a) is type(b) and a == b


def rows_equal(a: Row, b: Row) -> bool:
    return len(a) == len(b) and all(values_equal(x, y) for x, y in zip(a, b))


def render_row(row: Row) -> list[Any]:
    """A row as JSON-friendly values (blobs shown as hex, long text clipped)."""
    out: list[Any] = []
    for value in row:
        if isinstance(value, bytes):
            value = "x'" + value[:16].hex() + ("..." if len(value) > 16 else "") + "'"
        elif isinstance(value, str) and len(value) > 60:
            value = value[:57] + "..."
        elif isinstance(value, float):
            value = round(value, 6)
        out.append(value)
    return out


# -- internals ------------------------------------------------------------------------------
def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _key(value: Any) -> Any:
    if isinstance(value, float) and math.isfinite(value):
        return round(value, 6)
    return value


def _row_key(row: Row) -> tuple[Any, ...]:
    return tuple((type(v) is str, _key(v)) for v in row)  # the flag keeps '3' apart from 3


def _difference(expected: list[Row], got: list[Row]) -> tuple[list[Row], list[Row]]:
    """(expected rows not in got, got rows not in expected), as multisets with tolerance."""
    pending: dict[tuple[Any, ...], list[Row]] = {}
    for row in got:
        pending.setdefault(_row_key(row), []).append(row)
    missing: list[Row] = []
    for row in expected:
        bucket = pending.get(_row_key(row))
        if bucket:
            bucket.pop()
        else:
            missing.append(row)
    extra = [row for bucket in pending.values() for row in bucket]
    if missing and extra:  # rounding edges: fall back to pairwise tolerance on the leftovers
        still_missing = []
        for row in missing:
            hit = next((i for i, cand in enumerate(extra) if rows_equal(row, cand)), None)
            if hit is None:
                still_missing.append(row)
            else:
                extra.pop(hit)
        missing = still_missing
    return missing, extra


def _permuted_columns_match(expected: list[Row], got: list[Row], width: int) -> bool:
    if width < 2 or len(expected) != len(got):
        return False
    exp_cols = [Counter(_key(r[j]) for r in expected) for j in range(width)]
    got_cols = [Counter(_key(r[j]) for r in got) for j in range(width)]
    mapping: list[int] = []
    for j in range(width):
        match = next((k for k in range(width) if k not in mapping and got_cols[k] == exp_cols[j]), None)
        if match is None:
            return False
        mapping.append(match)
    if mapping == list(range(width)):
        return False
    reordered = [tuple(row[k] for k in mapping) for row in got]
    missing, extra = _difference(expected, reordered)
    return not missing and not extra


def _row_mismatch(expected: Expected, rows: list[Row], missing: list[Row], extra: list[Row]) -> Mismatch:
    n_exp, n_got = len(expected.rows), len(rows)
    counts = {"expected_rows": n_exp, "got_rows": n_got}
    miss = f"missing e.g. {_examples(missing)}"
    more = f"unexpected e.g. {_examples(extra)}"
    if n_exp == n_got:
        return Mismatch("result_mismatch", f"The result has the right number of rows ({n_got}) but different values; {miss}; {more}.",
                        expected={**counts, "missing": _examples(missing)}, got={**counts, "unexpected": _examples(extra)})
    if not missing:
        return Mismatch("extra_rows", f"The result has {n_got} rows but the answer has {n_exp}: every expected row is there, "
                        f"plus {len(extra)} extra, e.g. {_examples(extra)}.", expected=n_exp, got=n_got)
    if not extra:
        return Mismatch("missing_rows", f"The result has {n_got} rows but the answer has {n_exp}: "
                        f"{len(missing)} expected rows are missing, e.g. {_examples(missing)}.", expected=n_exp, got=n_got)
    return Mismatch("row_count_mismatch", f"The result has {n_got} rows but the answer has {n_exp}; {miss}; {more}.",
                    expected=n_exp, got=n_got)


def _order_mismatch(expected: Expected, rows: list[Row]) -> Mismatch | None:
    positions = expected.order_by or tuple(range(len(expected.columns)))
    for i, (want, have) in enumerate(zip(expected.rows, rows)):
        if not rows_equal(tuple(want[p] for p in positions), tuple(have[p] for p in positions)):
            sort_key = ", ".join(expected.columns[p] for p in positions) if expected.order_by else "the question's ordering"
            return Mismatch(
                "order_mismatch",
                f"The right rows in the wrong order (the answer is ordered by {sort_key}); the first difference is at "
                f"row {i + 1}: expected {render_row(want)}, got {render_row(have)}.",
                expected=render_row(want),
                got=render_row(have),
            )
    return None


def _missing_order_by(expected: Expected, consequence: str) -> Mismatch:
    key = ", ".join(expected.columns[p] for p in expected.order_by or ()) or "the order the question asks for"
    return Mismatch(
        "order_mismatch",
        f"The question asks for the rows ordered by {key}, but the query has no ORDER BY, {consequence}.",
        expected=f"ORDER BY {key}",
        got="no ORDER BY",
    )


def _examples(rows: list[Row]) -> list[list[Any]]:
    return [render_row(r) for r in rows[:EXAMPLES]]


def _names(columns: Sequence[str]) -> str:
    return ", ".join(columns) if columns else "none"
