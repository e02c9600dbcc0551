"""A small SQL tokenizer: just enough structure to reason about model-written SQL.

It never executes anything. It finds statement boundaries, the leading keyword, top-level
clauses (`ORDER BY`, the select list) and extracts a query from a chat answer, so that the
sandbox, the matcher and the scripted agents agree on what a query "says".

Why not sqlglot (weighed against sqlglot 30.31): on a typical grouped, joined, ordered
query, `top_level_order_by` took 0.4 ms and `sqlglot.parse_one(q, read="sqlite")` 1.0 ms (one
niced core of a loaded machine), and sqlglot raised RecursionError on `SELECT ((...1...))`
nested 200 deep, which this tokenizer reads in 0.5 ms: model-written SQL is hostile input, and
what we need is the token structure, not a full parse tree.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

Kind = Literal["word", "string", "ident", "number", "punct", "param"]

_TOKEN = re.compile(
    r"""
    (?P<ws>\s+)
  | (?P<comment>--[^\n]*|/\*.*?(?:\*/|\Z))
  | (?P<string>'(?:[^']|'')*(?:'|\Z))
  | (?P<ident>"(?:[^"]|"")*(?:"|\Z)|`[^`]*(?:`|\Z)|\[[^\]]*(?:\]|\Z))
  | (?P<number>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?|0[xX][0-9a-fA-F]+)
  | (?P<param>[?:@$][A-Za-z0-9_]*)
  | (?P<word>[A-Za-z_\x80-\U0010ffff][A-Za-z0-9_$\x80-\U0010ffff]*)
  | (?P<punct>\|\||<=|>=|<>|!=|==|<<|>>|.)
    """,
    re.VERBOSE | re.DOTALL,
)

# One run of blanks on each side of the optional tag: two adjacent `[ \t]*` would try every split
# of a long run of spaces (quadratic). Every other pattern here is one left-to-right pass.
_SQL_BLOCK = re.compile(r"```[ \t]*(?:(?:sql|sqlite)[ \t]*)?\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)
_READ_ONLY_STARTS = frozenset({"SELECT", "WITH", "VALUES"})


@dataclass(frozen=True)
class Token:
    """One lexical token; `start`/`end` index the original text, `depth` is the paren depth."""

    kind: Kind
    text: str
    start: int
    end: int
    depth: int

    @property
    def upper(self) -> str:
        return self.text.upper() if self.kind == "word" else self.text


def tokenize(sql: str) -> list[Token]:
    """Tokens of `sql` without whitespace and comments, each tagged with its paren depth."""
    return list(_tokens(sql))


def _tokens(sql: str) -> Iterator[Token]:
    depth = 0
    for m in _TOKEN.finditer(sql):
        kind = m.lastgroup
        if kind in ("ws", "comment"):
            continue
        text = m.group()
        if text == ")":
            depth = max(depth - 1, 0)
        yield Token(kind, text, m.start(), m.end(), depth)  # type: ignore[arg-type]
        if text == "(":
            depth += 1


def split_statements(sql: str, tokens: list[Token] | None = None) -> list[str]:
    """The non-empty statements of `sql`, split on semicolons outside strings and comments."""
    parts: list[str] = []
    begin, has_tokens = 0, False
    for tok in tokenize(sql) if tokens is None else tokens:
        if tok.text == ";":
            if has_tokens:
                parts.append(sql[begin : tok.start].strip())
            begin, has_tokens = tok.end, False
        else:
            has_tokens = True
    if has_tokens:
        parts.append(sql[begin:].strip())
    return parts


def leading_keyword(sql: str, tokens: list[Token] | None = None) -> str:
    """The statement's first keyword, upper-cased, skipping comments and opening parens."""
    for tok in _tokens(sql) if tokens is None else tokens:  # lazily: only the first word is needed
        if tok.text == "(":
            continue
        return tok.upper
    return ""


def is_read_only_form(sql: str) -> bool:
    """True when the statement starts like a query (SELECT / WITH / VALUES)."""
    return leading_keyword(sql) in _READ_ONLY_STARTS


def top_level_order_by(sql: str) -> list[str] | None:
    """The terms of the outermost `ORDER BY`, or None when the query's result is unordered.

    An `ORDER BY` inside a subquery, a window (`OVER (...)`) or a CTE does not order the
    result, so only clauses at paren depth 0 after the last top-level `SELECT` count.
    """
    tokens = [t for t in tokenize(sql) if t.depth == 0]
    start = None
    for i in range(len(tokens) - 1):
        if tokens[i].upper == "ORDER" and tokens[i + 1].upper == "BY":
            start = i + 2
    if start is None:
        return None
    terms: list[str] = []
    current: list[Token] = []
    for tok in tokens[start:]:
        if tok.upper in ("LIMIT", ";"):
            break
        if tok.text == ",":
            terms.append(_join(sql, current))
            current = []
        else:
            current.append(tok)
    terms.append(_join(sql, current))
    return [t for t in terms if t]


def has_top_level_limit(sql: str) -> bool:
    """True when the outermost query has a LIMIT (so its ordering decides which rows appear)."""
    return any(t.depth == 0 and t.upper == "LIMIT" for t in tokenize(sql))


def order_key(term: str) -> str:
    """An ORDER BY term without its direction/collation/nulls modifiers, upper-cased."""
    words = term.split()
    while words and words[-1].upper() in ("ASC", "DESC", "FIRST", "LAST", "NULLS"):
        words.pop()
    if len(words) >= 2 and words[-2].upper() == "COLLATE":
        words = words[:-2]
    return " ".join(words).strip('"`[]').upper()


def select_list(sql: str) -> tuple[int, int, list[str]] | None:
    """The outermost (last top-level) SELECT list: (start, end, expressions), or None."""
    tokens = tokenize(sql)
    top = [i for i, t in enumerate(tokens) if t.depth == 0 and t.upper == "SELECT"]
    if not top:
        return None
    i = top[-1] + 1
    if i < len(tokens) and tokens[i].upper in ("DISTINCT", "ALL"):
        i += 1
    items: list[list[Token]] = [[]]
    j = i
    while j < len(tokens):
        tok = tokens[j]
        if tok.depth == 0 and tok.upper in ("FROM", "WHERE", "GROUP", "ORDER", "LIMIT", "HAVING", "WINDOW", "UNION", "EXCEPT", "INTERSECT"):
            break
        if tok.depth == 0 and tok.text == ",":
            items.append([])
        else:
            items[-1].append(tok)
        j += 1
    if i >= len(tokens) or not items[0]:
        return None
    end = tokens[j - 1].end
    return tokens[i].start, end, [_join(sql, item) for item in items]


_CLAUSE_END = frozenset({"JOIN", "INNER", "LEFT", "RIGHT", "FULL", "CROSS", "NATURAL", "WHERE", "GROUP", "ORDER", "LIMIT",
                         "HAVING", "WINDOW", "UNION", "EXCEPT", "INTERSECT", ")", ",", ";"})
_CONSTANT_WORDS = frozenset({"TRUE", "FALSE", "NULL", "AND", "OR", "NOT", "IS"})


def unconstrained_joins(sql: str) -> list[str]:
    """Tables joined with `JOIN` but no join condition (no ON/USING, or a constant ON).

    Such a join pairs every row with every row, the usual cause of inflated counts and sums.
    `CROSS JOIN` and `NATURAL JOIN` say so on purpose and are not reported.
    """
    tokens = tokenize(sql)
    found: list[str] = []
    for i, tok in enumerate(tokens):
        if tok.upper != "JOIN" or (i > 0 and tokens[i - 1].upper in ("CROSS", "NATURAL")):
            continue
        if i + 1 >= len(tokens):
            break
        table, j = tokens[i + 1].text, i + 2
        while j < len(tokens) and tokens[j].upper not in ("ON", "USING") and tokens[j].upper not in _CLAUSE_END:
            j += 1
        no_condition = j >= len(tokens) or tokens[j].upper not in ("ON", "USING")
        if no_condition or (tokens[j].upper == "ON" and _constant_condition(tokens, j + 1, tok.depth)):
            found.append(table)
    return found


def _constant_condition(tokens: list[Token], start: int, depth: int) -> bool:
    for tok in tokens[start:]:
        if tok.depth == depth and tok.upper in _CLAUSE_END and tok.upper not in (")",):
            break
        if tok.depth < depth:
            break
        if tok.kind == "ident" or (tok.kind == "word" and tok.upper not in _CONSTANT_WORDS):
            return False
    return True


def extract_query(text: str) -> str | None:
    """The SQL in a final answer: the last ```sql block, else the whole text if it is a query."""
    blocks = [b.strip() for b in _SQL_BLOCK.findall(text) if b.strip()]
    if blocks:
        return blocks[-1]
    stripped = text.strip()
    if stripped and is_read_only_form(stripped):
        return stripped
    return None


def _join(sql: str, tokens: list[Token]) -> str:
    return sql[tokens[0].start : tokens[-1].end] if tokens else ""
