"""The errors a user of critique-gym can cause, each with a message that names the fix."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class CgymError(Exception):
    """Base class of every error critique-gym raises on purpose."""


class UnknownEnvError(CgymError, KeyError):
    """An env id that is not registered."""

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0])


class InvalidEnvKwargError(CgymError, TypeError):
    """A keyword argument an env does not accept, or a value outside its choices."""


class InvalidChoiceError(CgymError, ValueError):
    """A value outside a fixed set of choices (difficulty, split, ...)."""


class MissingExtraError(CgymError, ImportError):
    """An optional feature whose library is not installed; the message names the pip extra."""


class ConfigError(CgymError, ValueError):
    """A setting of a config (training, evaluation, sampling) outside its range or choices; the message names the field."""


def closest(value: str, choices: Iterable[str]) -> str | None:
    """The choice closest to `value` (difflib, cutoff 0.5), or None when nothing is close."""
    close = difflib.get_close_matches(str(value), list(choices), n=1, cutoff=0.5)
    return close[0] if close else None


def did_you_mean(value: str, choices: Iterable[str]) -> str:
    """' Did you mean X?' for the closest choice, or '' when nothing is close: the one did-you-mean of every message."""
    close = closest(value, choices)
    return f" Did you mean {close!r}?" if close else ""


def check_choice(name: str, value: object, choices: Iterable[str]) -> None:
    """Raise `InvalidChoiceError` unless `value` is one of `choices`."""
    options = list(choices)
    if value not in options:
        raise InvalidChoiceError(
            f"{name}={value!r} is not valid; choose one of {options}.{did_you_mean(str(value), options)}"
        )


def first_line(exc: BaseException, limit: int | None = None) -> str:
    """The first line of an exception's message (cut to `limit` characters), or '' when it has none:
    the part of a library's error worth putting in a one-line message."""
    text = str(exc).strip()
    line = text.splitlines()[0] if text else ""
    return line[:limit] if limit is not None else line
