"""Prompt-lookup drafts for greedy decoding: guess a row's next ids from its own context.

A decode step of few rows is bound by reading the weights, so checking a few drafted ids in the
same forward costs little more than one id (on 2 cores a decode step of under 10 rows took
~52 ms, most of it reading SmolLM2's 270 MB of bf16 weights). The sampler keeps the drafts that
match its argmax, so drafting changes how many forwards a turn takes, not its ids.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

LOOKUP_TOKENS = 4  # ids drafted per step
LOOKUP_ROWS = 8  # draft only while at most this many rows are live
LOOKUP_NGRAMS = (3, 2)  # match the row's last 3 ids, else its last 2


class PromptLookup:
    """Drafts for greedy rows: the ids that followed the latest earlier occurrence of a row's
    last few ids, in its prompt or its own output (tool results and reports repeat each other)."""

    def __init__(self, prompts: Sequence[Sequence[int]], tokens: int) -> None:
        self.tokens = tokens
        self.context = [list(p) for p in prompts]
        self.index: list[dict[tuple[int, ...], int] | None] = [None] * len(prompts)

    def extend(self, rows: list[int], new: list[list[int]]) -> None:
        """Append each row's newly emitted ids to its context (and its n-gram index, once built)."""
        for row, ids in zip(rows, new):
            context, index = self.context[row], self.index[row]
            for token in ids:
                context.append(token)
                if index is not None:
                    for n in LOOKUP_NGRAMS:  # the n ids before `token` are followed by it
                        if len(context) > n:
                            index[tuple(context[-n - 1 : -1])] = len(context) - 1

    def propose(self, rows: list[int]) -> Tensor | None:
        """(b, tokens) drafts, or None when there are too many rows or nothing matches."""
        if len(rows) > LOOKUP_ROWS:
            return None
        drafts = [self._draft(row) for row in rows]
        if not any(drafts):
            return None
        filler = [0] * self.tokens  # any id: a wrong draft is rejected, a right one kept
        return torch.tensor([(d + filler)[: self.tokens] for d in drafts], dtype=torch.long)

    def _draft(self, row: int) -> list[int]:
        """Up to `tokens` ids after the latest earlier match of the row's last ids ([] if none);
        the row's n-gram index is built on its first draft, when few rows are left."""
        context = self.context[row]
        index = self.index[row]
        if index is None:
            index = self.index[row] = {}
            for n in LOOKUP_NGRAMS:
                for end in range(n, len(context)):
                    index[tuple(context[end - n : end])] = end
        for n in LOOKUP_NGRAMS:
            at = index.get(tuple(context[-n:]))
            if at is not None:
                return context[at : at + self.tokens]
        return []
