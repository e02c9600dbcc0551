"""The non-finite guard: a NaN or inf loss or gradient stops training before the optimizer step.

An update with a NaN gradient turns every weight NaN, and a run that goes on from there
"trains" for hours and saves garbage. Stopping at the first bad value keeps the last
checkpoint good and tells the user where it went wrong.
"""

from __future__ import annotations

import math

import torch
from cgym.envs.errors import CgymError


class NonFiniteError(CgymError, FloatingPointError):
    """The loss or the gradient norm is NaN or inf; nothing of that step was applied."""


def check_finite(what: str, value: torch.Tensor | float, *, step: int | None = None) -> None:
    """Raise `NonFiniteError` when `value` (a loss or a gradient norm) is NaN or inf."""
    number = float(value)
    if math.isfinite(number):
        return
    where = f"step {step}: " if step is not None else ""
    raise NonFiniteError(
        f"{where}the {what} is {number} (the weights or the update diverged); the optimizer step was skipped and nothing "
        "was saved; lower the learning rate, or resume from the last checkpoint (a damaged one is skipped)"
    )
