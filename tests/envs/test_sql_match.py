from __future__ import annotations

import pytest
from cgym.envs.sql.lexer import extract_query, split_statements, top_level_order_by, unconstrained_joins
from cgym.envs.sql.match import Expected, compare, sort_positions, values_equal
from hypothesis import given
from hypothesis import strategies as st

ROWS = [("Ada", 3, 1.5), ("Ben", 2, 2.25), ("Cleo", 2, None)]


def gold(sql: str = "SELECT name, n, x FROM t", rows=ROWS, columns=("name", "n", "x")) -> Expected:
    return Expected.from_query(sql, columns, list(rows))


def code(expected: Expected, rows, columns=("name", "n", "x"), query: str | None = None) -> str | None:
    mismatch = compare(expected, columns, list(rows), query=query)
    return None if mismatch is None else mismatch.code


def test_unordered_results_match_as_multisets() -> None:
    assert code(gold(), list(reversed(ROWS))) is None
    assert code(gold(), ROWS + [ROWS[0]]) == "extra_rows"  # a duplicate row is an extra row


def test_floats_within_tolerance_and_ints_equal_floats() -> None:
    assert code(gold(), [("Ada", 3.0, 1.5000000001), ("Ben", 2, 2.25), ("Cleo", 2, None)]) is None
    assert code(gold(), [("Ada", 3, 1.51), ("Ben", 2, 2.25), ("Cleo", 2, None)]) == "result_mismatch"
    assert not values_equal("3", 3) and values_equal(3, 3.0) and not values_equal(None, 0)


@pytest.mark.parametrize(
    ("rows", "columns", "expected_code"),
    [
        ([r[:2] for r in ROWS], ("name", "n"), "wrong_columns"),
        ([(r[1], r[0], r[2]) for r in ROWS], ("n", "name", "x"), "wrong_columns"),
        (ROWS[:2], ("name", "n", "x"), "missing_rows"),
        (ROWS + [("Dan", 1, 0.0)], ("name", "n", "x"), "extra_rows"),
        (ROWS[:2] + [("Dan", 1, 0.0), ("Eve", 1, 0.0)], ("name", "n", "x"), "row_count_mismatch"),
        (ROWS[:2] + [("Cleo", 2, 0.0)], ("name", "n", "x"), "result_mismatch"),
    ],
    ids=["too-few-columns", "swapped-columns", "missing", "extra", "count", "values"],
)
def test_mismatch_codes(rows, columns, expected_code: str) -> None:
    assert code(gold(), rows, columns) == expected_code


def test_missing_and_extra_rows_are_shown_as_examples() -> None:
    mismatch = compare(gold(), ("name", "n", "x"), ROWS[:2] + [("Cleo", 2, 0.0)])
    assert mismatch is not None
    assert "['Cleo', 2, None]" in mismatch.message and "['Cleo', 2, 0.0]" in mismatch.message


def test_order_matters_only_when_the_gold_orders() -> None:
    ordered = gold("SELECT name, n, x FROM t ORDER BY name")
    assert ordered.order_by == (0,)
    assert code(ordered, ROWS) is None
    assert code(ordered, list(reversed(ROWS))) == "order_mismatch"
    assert code(gold(), list(reversed(ROWS))) is None


def test_rows_tied_on_the_sort_key_may_come_in_any_order() -> None:
    ordered = gold("SELECT name, n, x FROM t ORDER BY n DESC")
    assert ordered.order_by == (1,)
    assert code(ordered, [ROWS[0], ROWS[2], ROWS[1]]) is None  # Ben and Cleo tie on n = 2
    assert code(ordered, [ROWS[1], ROWS[0], ROWS[2]]) == "order_mismatch"


def test_missing_order_by_is_named_as_the_cause() -> None:
    ordered = gold("SELECT name, n, x FROM t ORDER BY name DESC LIMIT 3")
    mismatch = compare(ordered, ("name", "n", "x"), ROWS[::-1], query="SELECT name, n, x FROM t LIMIT 3")
    assert mismatch is not None and mismatch.code == "order_mismatch" and "no ORDER BY" in mismatch.message
    # a coincidentally right order is still an execution match
    assert compare(gold("SELECT name, n, x FROM t ORDER BY name"), ("name", "n", "x"), ROWS, query="SELECT name, n, x FROM t") is None


@pytest.mark.parametrize(
    ("sql", "positions"),
    [
        ("SELECT a, b FROM t", None),
        ("SELECT a, b FROM t ORDER BY b DESC, a", (1, 0)),
        ("SELECT a, b FROM t ORDER BY 2", (1,)),
        ("SELECT t.a, b FROM t ORDER BY t.a COLLATE NOCASE ASC", (0,)),
        ("SELECT a, b FROM t ORDER BY length(a)", ()),
        ("SELECT a, (SELECT max(x) FROM u ORDER BY x) AS b FROM t", None),
        ("SELECT a, row_number() OVER (ORDER BY a) AS b FROM t", None),
    ],
    ids=["unordered", "two-keys", "position", "qualified", "expression", "subquery", "window"],
)
def test_sort_positions(sql: str, positions) -> None:
    assert sort_positions(sql, ("a", "b")) == positions


def test_lexer_helpers() -> None:
    assert split_statements("SELECT ';'; -- x\n SELECT 2;") == ["SELECT ';'", "-- x\n SELECT 2"]
    assert top_level_order_by("SELECT a FROM t ORDER BY a DESC LIMIT 2") == ["a DESC"]
    assert extract_query("Here it is:\n```sql\nSELECT 1\n```") == "SELECT 1"
    assert extract_query("SELECT 2") == "SELECT 2" and extract_query("no idea") is None
    assert unconstrained_joins("SELECT * FROM a JOIN b ON a.x = b.y JOIN c JOIN d ON 1 = 1") == ["c", "d"]
    assert unconstrained_joins("SELECT * FROM a CROSS JOIN b LEFT JOIN c USING (x)") == []


values = st.one_of(st.none(), st.integers(-5, 5), st.sampled_from([0.5, 1.25, -2.0]), st.sampled_from(["a", "b", ""]))
row_lists = st.lists(st.tuples(values, values), max_size=8)


@given(rows=row_lists, data=st.data())
def test_unordered_match_is_permutation_invariant(rows, data) -> None:
    expected = Expected(("p", "q"), rows)
    shuffled = data.draw(st.permutations(rows))
    assert compare(expected, ("p", "q"), list(shuffled)) is None


@given(rows=row_lists, extra=st.tuples(values, values))
def test_adding_a_row_never_matches(rows, extra) -> None:
    mismatch = compare(Expected(("p", "q"), rows), ("p", "q"), rows + [extra])
    assert mismatch is not None and mismatch.code in {"extra_rows", "row_count_mismatch"}
