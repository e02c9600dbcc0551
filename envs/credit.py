"""Turn rewards from step critiques: which turns of an episode helped and which one broke it.

Every critique names the 1-based turn it concerns, so an episode's critiques already say where
it went wrong. `turn_rewards` maps them to one reward per turn (`TurnCredit`, defaults below):
the turns before the first critiqued turn are credited, the first critiqued turn is penalised,
a later critiqued turn less so, and the clean turns after the first error get nothing. A
successful episode whose every turn was clean is all credit.

These rewards sit beside the episode's reward, not inside it: the env's Gymnasium reward stays
the rubric's score at the last step (0 before it), and the turn rewards are reported in `info`
(`turn_reward` each step, as far as that step knows; `turn_rewards` for every turn at the end).
A trainer may add them as turn-level credit (`cgym train --credit turn`); their sum is not the
episode's return.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TurnCredit:
    """The reward of a turn by where it stands relative to the episode's critiques."""

    before_first_error: float = 0.5
    first_error: float = -1.0
    later_error: float = -0.5
    clean_after_error: float = 0.0


DEFAULT_CREDIT = TurnCredit()


def turn_rewards(turns: int, critiqued: Iterable[int], credit: TurnCredit = DEFAULT_CREDIT) -> list[float]:
    """One reward per turn (1..`turns`) given the turns that have a critique (`critiqued`, 1-based;
    out-of-range turns are ignored)."""
    bad = {t for t in critiqued if 1 <= t <= turns}
    first = min(bad, default=turns + 1)
    rewards = []
    for turn in range(1, turns + 1):
        if turn < first:
            rewards.append(credit.before_first_error)
        elif turn == first:
            rewards.append(credit.first_error)
        else:
            rewards.append(credit.later_error if turn in bad else credit.clean_after_error)
    return rewards


def critiqued_turns(critiques: Iterable[Mapping[str, Any]]) -> list[int]:
    """The turns named by critiques as `info["critiques"]` holds them (dicts with a `step`)."""
    return [int(c["step"]) for c in critiques if isinstance(c.get("step"), int)]
