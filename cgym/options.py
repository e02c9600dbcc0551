"""Command-line options: argparse types that check a range, and options generated from a config dataclass.

A config dataclass is the one place a setting's type, default, choices and help live: the help is
the docstring under the field, as in CleanRL. We generate argparse options from it in-house rather
than with tyro, because the CLI keeps argparse's flag names (`--lr`, `--no-shaping`), its one-line
`error:` format and exit code 2, and per-flag range types, which tyro would restate or change.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import textwrap
import typing
from collections.abc import Callable, Collection, Mapping
from functools import cache
from pathlib import Path
from typing import Any, Literal


def bounded(kind: type, ok: Callable[[Any], bool], rule: str) -> Callable[[str], Any]:
    """An argparse type: `kind(text)` that must pass `ok`; `rule` says how in the error."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'a whole number' if kind is int else 'a number'}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
        return value

    return parse


COUNT = bounded(int, lambda v: v >= 1, ">= 1")
NATURAL = bounded(int, lambda v: v >= 0, ">= 0")
NON_NEGATIVE = bounded(float, lambda v: v >= 0, ">= 0")
POSITIVE = bounded(float, lambda v: v > 0, "> 0")
SHARE = bounded(float, lambda v: 0 <= v <= 1, "in [0, 1]")
TOP_P = bounded(float, lambda v: 0 < v <= 1, "in (0, 1]")


def json_object(text: str) -> dict[str, Any]:
    """An argparse type: a JSON object such as `{"difficulty": "hard"}`."""
    shown = repr(text) if len(text) <= 80 else repr(text[:77]) + "..."
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc.msg} at char {exc.pos}): {shown}") from None
    except RecursionError:
        raise argparse.ArgumentTypeError(f"JSON nested too deeply to read: {shown}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object such as '{{\"difficulty\": \"hard\"}}', got {shown}")
    return value


def add_config_options(
    parser: argparse.ArgumentParser,
    config: type,
    *,
    flags: Mapping[str, str] = {},
    types: Mapping[str, Callable[[str], Any]] = {},
    required: Collection[str] = (),
    skip: Collection[str] = (),
    defaults: Mapping[str, Any] = {},
) -> None:
    """One option per field of `config` (dest = the field's name), except those in `skip`.

    The flag is `--field-name` unless `flags` renames it; a bool that defaults to True becomes
    `--no-field-name`; a `Literal` gives the choices; a field without a default is required.
    `types` replaces the annotation's type (for a range check or JSON). A field that is itself a
    dataclass (`TrainConfig.sampling`) gives one option per field of its own, with its default's
    values (`config_kwargs` builds it back); where the outer config has a field of the same name,
    that field is the option.
    """
    hints, docs = typing.get_type_hints(config), field_docs(config)
    for f in dataclasses.fields(config):
        if f.name in skip:
            continue
        if dataclasses.is_dataclass(hints[f.name]):
            values = dataclasses.asdict(_default(f))
            outer = {g.name for g in dataclasses.fields(config)}  # an outer field of the same name (seed) is the option
            add_config_options(parser, hints[f.name], flags=flags, types=types, skip={*skip, *outer}, defaults=values)
            continue
        flag = "--" + flags.get(f.name, f.name.replace("_", "-"))
        help_ = docs.get(f.name, "").replace("%", "%%") or None
        hint, default = hints[f.name], defaults.get(f.name, _default(f))
        if hint is bool:
            parser.add_argument(flag.replace("--", "--no-") if default else flag, dest=f.name, action="store_false" if default else "store_true", help=help_)
            continue
        if f.name in required or default is dataclasses.MISSING:
            extra: dict[str, Any] = {"required": True}
        else:
            extra = {"default": default}
            help_ = help_ and help_ + " (default: %(default)s)"
        choices = typing.get_args(hint) if typing.get_origin(hint) is Literal else None
        kind = types.get(f.name) or (str if choices else _scalar(config, f.name, hint))
        metavar = None if choices else flag[2:].upper().replace("-", "_")
        parser.add_argument(flag, dest=f.name, type=kind, choices=choices, help=help_, metavar=metavar, **extra)


def config_kwargs(args: argparse.Namespace, config: type) -> dict[str, Any]:
    """The parsed values of `config`'s fields that are options (keyword arguments for `config`);
    a dataclass field is rebuilt from its default and the options of its own fields."""
    hints, kwargs = typing.get_type_hints(config), {}
    for f in dataclasses.fields(config):
        if dataclasses.is_dataclass(hints[f.name]):
            if parsed := config_kwargs(args, hints[f.name]):
                kwargs[f.name] = dataclasses.replace(_default(f), **parsed)
        elif hasattr(args, f.name):
            kwargs[f.name] = getattr(args, f.name)
    return kwargs


@cache
def field_docs(config: type) -> dict[str, str]:
    """Each field's docstring (the string literal right under it), on one line."""
    docs: dict[str, str] = {}
    for klass in [k for k in reversed(config.__mro__) if dataclasses.is_dataclass(k)]:
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body  # type: ignore[attr-defined]
        for node, after in zip(body, body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
                docs[node.target.id] = " ".join(str(after.value.value).split())
    return docs


def _default(f: dataclasses.Field[Any]) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _scalar(config: type, name: str, hint: Any) -> type:
    if hint in (int, float, str, Path):
        return hint
    raise TypeError(f"{config.__name__}.{name}: no option type for {hint!r}; pass one in `types`")
