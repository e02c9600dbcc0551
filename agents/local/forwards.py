"""Modules' forwards replaced for the length of a block, the way the training passes adapt them
(frozen weights cast once, LoRA's sums in one product, layers recomputed)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from torch import nn


@contextmanager
def replaced_forwards(modules: Sequence[nn.Module], forward_for: Callable[[nn.Module], Callable[..., Any]]) -> Iterator[int]:
    """Within the block, each module's calls go to `forward_for(module)`, set on the instance over
    its class's forward; afterwards the instance has what it had before. Yields how many modules."""
    saved = [module.__dict__.get("forward") for module in modules]
    for module in modules:
        module.forward = forward_for(module)
    try:
        yield len(modules)
    finally:
        for module, before in zip(modules, saved, strict=True):
            if before is None:
                del module.forward
            else:
                module.forward = before
