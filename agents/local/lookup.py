"""Prompt-lookup drafts: guess a row's next ids from its own context.

A decode step of few rows is bound by reading the weights, so checking a few drafted ids in the
same forward costs little more than one id (on 2 cores a decode step of under 10 rows took
~52 ms, most of it reading SmolLM2's 270 MB of bf16 weights). The sampler checks the drafts
(`agents.local.sampling.accept_drafts`): greedy turns keep the ids they would emit anyway, sampled turns
keep ids drawn from the same distribution, so drafting changes how many forwards a turn takes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

LOOKUP_TOKENS = 4  # ids drafted per step
# Sampled turns keep about half of each drafted id (2.0 ids a row from 4-id drafts), and a step
# is bound by its products past ~10 query ids (on the 2-core Ice Lake's fp32 products a step took
# ~15 ms up to 5 ids, then ~1.45 ms more an id: 4 rows x 5 ids 40 ms, 5.6 ms an emitted id against
# 4.1 with no drafts). So one live row drafts `tokens` ids, two to four rows one id each, more
# rows none: 4 x 8 sampled rollouts took 3.42-3.46 ms a sampled id against 3.74 drafting 4 ids
# from 8 rows, and 3.84 drafting one id from 8 rows (alternated steps on the same tasks).
LOOKUP_ROWS = 4  # sampled turns draft only while at most this many rows are live
# Greedy rows keep more of their drafts (a turn that copies a tool result, or repeats itself until
# it is cut, keeps most), so drafting pays with more of them live: the 100-episode greedy eval of
# ApiReport easy took 26.5-27.3 s drafting from 16 rows against 29.0-30.6 s from 8, with the same
# ids (the AVX512-BF16 machine).
LOOKUP_ROWS_GREEDY = 16


# A greedy step of a few rows drafts longer, and a draft that runs into the row's last id repeats
# the ids since its match: the eval's tail is rows that repeat a line until the length cap (4 of
# 100 in ApiReport easy's greedy eval: "Sofia Costa\n" 60 times), whose loop of 3-4 ids capped
# each draft at 3-4 ids. Such a step is bound by its products already (4 rows x 21 ids ran at
# ~205 GFLOP/s on 2 cores), so longer drafts save the weights' reads and the steps' overheads:
# that tail took 1.5-1.7 s against 2.0-2.5 s with 4 ids.
LONG_DRAFT_ROWS = 4
LONG_DRAFT_TOKENS = 20


def lookup_rows(temperature: float) -> int:
    """How many live rows drafting starts from: more for greedy turns."""
    return LOOKUP_ROWS_GREEDY if temperature == 0 else LOOKUP_ROWS


def draft_length(rows: int, temperature: float, tokens: int) -> int:
    """Ids a step of `rows` live rows drafts per row. Greedy: `tokens`, or `LONG_DRAFT_TOKENS`
    for a step of at most `LONG_DRAFT_ROWS` (a greedy row keeps a draft exactly where it is the
    id it would emit, so only the number of steps changes). Sampled: `tokens` for one row, one id
    for more (each drafted id is kept only with its probability: see `LOOKUP_ROWS`)."""
    if temperature != 0:
        return tokens if rows == 1 else min(tokens, 1)
    return max(tokens, LONG_DRAFT_TOKENS) if 0 < tokens and rows <= LONG_DRAFT_ROWS else tokens


LOOKUP_NGRAMS = (3, 2)  # match the row's last 3 ids, else its last 2


class PromptLookup:
    """Drafts for each row: the ids that followed the latest earlier occurrence of a row's
    last few ids, in its prompt or its own output (tool results and reports repeat each other).

    A row's context and n-gram index are built on its first draft, when few rows are left, and
    then follow the ids it emits."""

    def __init__(self, prompts: Sequence[Sequence[int]], tokens: int) -> None:
        self.prompts = prompts
        self.tokens = tokens
        self.context: dict[int, list[int]] = {}  # row -> prompt + emitted ids, once it drafts
        self.index: dict[int, dict[tuple[int, ...], int]] = {}  # row -> n-gram -> where the id after it is

    def propose(self, emitted: dict[int, list[int]], tokens: int | None = None, *, repeat: bool = False) -> Tensor | None:
        """(b, tokens) drafts for the live rows, given each one's emitted ids so far (row -> ids,
        in batch order); None when nothing matches. `tokens` defaults to the lookup's own;
        `repeat` continues a match that runs into the row's last id with the ids since it, as a
        loop would (otherwise such a draft is padded). The sampler asks only while at most
        `lookup_rows(temperature)` rows are live."""
        tokens = self.tokens if tokens is None else tokens
        drafts = [self._draft(row, ids, tokens, repeat) for row, ids in emitted.items()]
        if not any(drafts):
            return None
        filler = [0] * tokens  # any id: a wrong draft is rejected, a right one kept
        return torch.tensor([(d + filler)[:tokens] for d in drafts], dtype=torch.long)

    def _draft(self, row: int, emitted: list[int], tokens: int, repeat: bool) -> list[int]:
        """Up to `tokens` ids after the latest earlier match of the row's last ids ([] if none)."""
        prompt = self.prompts[row]
        fresh = row not in self.context
        if fresh:
            self.context[row], self.index[row] = list(prompt), {}
        context, index = self.context[row], self.index[row]
        start = 0 if fresh else len(context)  # the ids `end` whose preceding n-grams are not indexed yet
        context.extend(emitted[len(context) - len(prompt) :])
        for n in LOOKUP_NGRAMS:  # the n ids before `end` are followed by it; the latest wins
            for end in range(max(n, start), len(context)):
                index[tuple(context[end - n : end])] = end
        for n in LOOKUP_NGRAMS:
            at = index.get(tuple(context[-n:]))
            if at is not None:
                if not repeat:
                    return context[at : at + tokens]
                period = len(context) - at  # the ids since the match: a loop's next ones
                return [context[at + i % period] for i in range(tokens)]
        return []
