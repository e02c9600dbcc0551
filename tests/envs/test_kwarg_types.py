"""The type check `make` runs on env kwargs: what fits, what does not, and what it leaves alone."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, Optional, Protocol

import pytest
from cgym.envs.kwarg_types import annotations_of, choices_of, describe, fits
from cgym.envs.rubric import Rubric


class _Shape(Protocol):
    def area(self) -> float: ...


@pytest.mark.parametrize(
    ("value", "hint", "expected"),
    [
        (3, int, True), (True, int, False), (3.0, int, False),
        (3, float, True), (2.5, float, True), (False, float, False), ("2.5", float, False),
        (None, int | None, True), (None, Optional[int], True), (None, int, False),  # noqa: UP045 - typing.Union, as older code writes it
        ("easy", Literal["easy", "hard"], True), ("hrad", Literal["easy", "hard"], False),
        ([1, 2], tuple[int, ...], True), ([1, 2], list[int], True), ({"a": 1}, list[int], False), ("ab", Sequence[str], False),
        ({"a": 1}, dict[str, int], True), ({"a": 1}, Mapping[str, Any], True), ([1], dict, False),
        (len, Callable[..., int], True), (3, Callable[..., int], False),
        ("x", Rubric | None, False), (None, Rubric | None, True),
        ("anything", Any, True), (object(), _Shape, True),  # a Protocol it cannot check passes
    ],
)  # fmt: skip
def test_fits(value: object, hint: object, expected: bool) -> None:
    assert fits(value, hint) is expected


def test_choices_and_descriptions() -> None:
    assert choices_of(Literal["a", "b"]) == ["a", "b"]
    assert choices_of(Optional[Literal["a", "b"]]) == ["a", "b"]  # noqa: UP045
    assert choices_of(int | None) == []
    assert describe(int | None) == "int or None"
    assert describe(Literal["a", "b"]) == "one of 'a', 'b'"


def test_annotations_that_do_not_resolve_are_skipped_not_raised() -> None:
    def creator(x: NoSuchName = None) -> None:  # type: ignore[name-defined]  # noqa: F821
        pass

    assert annotations_of(creator) == {}

    class Env:
        def __init__(self, *, difficulty: Literal["easy"] = "easy") -> None:
            pass

    assert annotations_of(Env)["difficulty"] == Literal["easy"]
