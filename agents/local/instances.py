"""An attribute set on modules' instances for the length of a block, the way the training passes
adapt a model (frozen weights cast once, LoRA's sums in one product, layers recomputed)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from types import ModuleType
from typing import Any

from torch import nn


@contextmanager
def replaced(modules: Sequence[nn.Module | ModuleType], name: str, value_for: Callable[[Any], Any]) -> Iterator[int]:
    """Within the block, each module's instance holds `value_for(module)` as `name` (a forward
    there goes over its class's; a Python module's global is looked up there at each call);
    afterwards the instance holds what it did before, or nothing. Yields how many modules."""
    saved = [module.__dict__.get(name, _ABSENT) for module in modules]
    for module in modules:
        setattr(module, name, value_for(module))
    try:
        yield len(modules)
    finally:
        for module, before in zip(modules, saved, strict=True):
            if before is _ABSENT:
                delattr(module, name)
            else:
                setattr(module, name, before)


_ABSENT = object()  # no instance attribute before the block (one holding None is given back)
