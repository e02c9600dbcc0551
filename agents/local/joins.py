"""Continuous batching: a conversation's next turn joins the batch that is still decoding.

In lockstep, every turn of a batch waits for its longest row: a GRPO rollout of 4 x 8 ApiReport
episodes took 327 decode steps, against 200 for its longest episode alone, and most of the extra
steps ran a few rows, where a step costs about as much as a full one (it reads every weight).
Here a row whose turn ends hands its sample to the caller (`Follow`, which steps the env), and the
caller's next prompt for that conversation waits to join the running batch. `Joins` decides when
the waiting turns join and which: once they are at least `1 / JOIN_SHARE` of the running rows
(each join is one prefill call and one copy of the batch's cache), within the batch's byte
budget, and within `LENGTH_RATIO` of its width (so that no row is mostly padding). A turn that
does not start with the batch's shared head cannot join at all; it is handed back as left over.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cgym.agents.local.batching import LENGTH_RATIO

if TYPE_CHECKING:
    from cgym.agents.local.sampling import Sample

JOIN_SHARE = 4  # turns join once they are at least a quarter as many as the running rows

Follow = Callable[[Hashable, "Sample"], "tuple[Sequence[int], Hashable] | None"]
"""`follow(key, sample)`: the turn of the conversation under `key` ended with `sample`; returns
that conversation's next prompt and key (the same conversation, or another in its place), or None."""


@dataclass(frozen=True)
class Request:
    """A turn to sample: its prompt, and the caller's key for its conversation."""

    prompt: Sequence[int]
    key: Hashable


@dataclass
class Joins:
    """The turns that wait to join a running batch whose rows share `head` (their leading ids)."""

    follow: Follow
    head: tuple[int, ...]
    bytes_per_token: int
    budget: int  # bytes the batch's keys and values may take, room included
    room: int  # columns a row may still add (its turn's ids)
    waiting: list[Request] = field(default_factory=list)
    left_over: list[Request] = field(default_factory=list)  # turns that cannot join: a new batch's

    def hear(self, key: Hashable, sample: Sample) -> None:
        """The turn under `key` ended: its conversation's next turn, if any, waits (or is left over)."""
        after = self.follow(key, sample)
        if after is None:
            return
        self.wait(Request(*after))

    def wait(self, request: Request) -> None:
        """`request` waits to join, or is left over if it cannot (it does not start with the head,
        or has no id of its own before its last)."""
        fits = len(request.prompt) >= len(self.head) + 2 and tuple(request.prompt[: len(self.head)]) == self.head
        (self.waiting if fits else self.left_over).append(request)

    def take(self, rows: int, width: int) -> list[Request]:
        """The waiting turns that join a batch of `rows` rows, `width` columns wide, now: none
        while they are too few, else those that fit; an empty batch takes at least one."""
        if not self.waiting or (rows and len(self.waiting) * JOIN_SHARE < rows):
            return []
        chosen: list[Request] = []
        for request in self.waiting:
            wide = max(width, len(request.prompt))
            fits = (rows + len(chosen) + 1) * (wide + self.room) * self.bytes_per_token <= self.budget
            near = not rows or min(width, len(request.prompt)) * LENGTH_RATIO >= wide
            if (fits and near) or not (rows or chosen):
                chosen.append(request)
                width = wide
        self.waiting = [r for r in self.waiting if all(r is not c for c in chosen)]
        return chosen
