"""Whether a keyword argument's value fits its annotation: the type check `make` runs before an env
is built, so a JSON kwarg of the wrong type (``{"rubric": "x"}``) is one clear error instead of a
crash at the first step.

Only what can be checked cheaply and surely is checked (plain classes, numbers, strings, None,
unions, `Literal`, and the outer type of containers); an annotation it cannot read passes.
"""

from __future__ import annotations

import collections.abc
import functools
import inspect
import types
import typing
from collections.abc import Callable
from typing import Any

_CONTAINERS: dict[Any, tuple[type, ...]] = {
    list: (list, tuple), tuple: (list, tuple), collections.abc.Sequence: (list, tuple), set: (list, tuple, set, frozenset),
    frozenset: (list, tuple, set, frozenset), dict: (collections.abc.Mapping,), collections.abc.Mapping: (collections.abc.Mapping,),
}  # fmt: skip  # JSON brings tuples and sets as lists


def annotations_of(creator: Callable[..., Any]) -> dict[str, Any]:
    """The resolved parameter annotations of a function or class (its `__init__`); {} when they do
    not resolve. Cached per creator: resolving them took about half of a `make` (240 of 450 us for
    ApiReport), and an eval makes an env per episode. The dict is shared: read it, do not change it."""
    try:
        return _cached_annotations(creator)
    except TypeError:  # an unhashable creator
        return _annotations(creator)


@functools.lru_cache(maxsize=256)
def _cached_annotations(creator: Callable[..., Any]) -> dict[str, Any]:
    return _annotations(creator)


def _annotations(creator: Callable[..., Any]) -> dict[str, Any]:
    target = creator.__init__ if inspect.isclass(creator) else creator
    try:
        return typing.get_type_hints(target)
    except Exception:  # a name only imported under TYPE_CHECKING, a forward reference to nowhere
        return {}


def fits(value: Any, hint: Any) -> bool:
    """Whether `value` can be what `hint` describes (see the module docstring for how deep it looks)."""
    if hint is Any or hint is object:
        return True
    if hint is None or hint is type(None):
        return value is None
    origin = typing.get_origin(hint)
    if origin is typing.Union or origin is types.UnionType:
        return any(fits(value, arg) for arg in typing.get_args(hint))
    if origin is typing.Literal:
        return value in typing.get_args(hint)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if (outer := origin or hint) in _CONTAINERS:
        return isinstance(value, _CONTAINERS[outer])
    if outer is collections.abc.Callable:
        return callable(value)
    if isinstance(hint, type):
        try:
            return isinstance(value, hint)
        except TypeError:  # a Protocol that is not runtime-checkable
            return True
    return True


def choices_of(hint: Any) -> list[Any]:
    """The values a `Literal` (or an optional one) allows; [] when `hint` is not a choice."""
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return list(typing.get_args(hint))
    if origin is typing.Union or origin is types.UnionType:
        members = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        if members and all(typing.get_origin(arg) is typing.Literal for arg in members):
            return [value for arg in members for value in typing.get_args(arg)]
    return []


def describe(hint: Any) -> str:
    """`int | None` -> 'int or None'; a class -> its name."""
    origin = typing.get_origin(hint)
    if origin is typing.Union or origin is types.UnionType:
        return " or ".join(describe(arg) for arg in typing.get_args(hint))
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(arg) for arg in typing.get_args(hint))
    if hint is type(None):
        return "None"
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")
