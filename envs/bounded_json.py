"""JSON from model-written text, parsed at a cost linear in its length, never raising oddly.

`json.loads` recurses once per nesting level (so JSON nested thousands deep raises
`RecursionError`) and converts digits to `int` in quadratic time (refusing past 4,300 digits
with a bare `ValueError`). `loads` scans the text once first and refuses nesting deeper than
`MAX_DEPTH` or a number longer than `MAX_NUMBER_CHARS`; every refusal, like any syntax
error, is a `json.JSONDecodeError` that names the position.
"""

from __future__ import annotations

import json
import re
from typing import Any

MAX_DEPTH = 64
MAX_NUMBER_CHARS = 100

# Strings are skipped whole; every alternative always succeeds once started (the closing quote
# is optional), so nothing backtracks and the scan is one pass.
_SCAN = re.compile(r'"(?:[^"\\]|\\.)*"?|(?P<open>[\[{])|(?P<close>[\]}])|(?P<number>-?[0-9][-+.0-9eE]*)', re.DOTALL)


def loads(text: str) -> Any:
    """`json.loads` within the bounds above. Raises `json.JSONDecodeError` only."""
    _check_bounds(text)
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise
    except (RecursionError, ValueError, OverflowError) as exc:  # out of reach after the scan; never let one escape
        raise json.JSONDecodeError(f"{type(exc).__name__}: {exc}", text, 0) from None


def _check_bounds(text: str) -> None:
    depth = 0
    for match in _SCAN.finditer(text):
        kind = match.lastgroup
        if kind == "open":
            depth += 1
            if depth > MAX_DEPTH:
                raise json.JSONDecodeError(f"nesting deeper than {MAX_DEPTH} levels", text, match.start())
        elif kind == "close":
            depth = max(depth - 1, 0)
        elif kind == "number" and match.end() - match.start() > MAX_NUMBER_CHARS:
            raise json.JSONDecodeError(f"a number longer than {MAX_NUMBER_CHARS} characters", text, match.start())
