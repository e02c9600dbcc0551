"""PromptLookup: which ids it drafts from a row's prompt and emitted ids."""

from __future__ import annotations

from cgym.agents.local.lookup import PromptLookup


def test_drafts_follow_the_latest_earlier_match_in_the_prompt() -> None:
    prompt = [1, 2, 3, 10, 11, 12, 13, 1, 2, 3, 20, 21, 22, 23, 24, 9, 2, 3]
    lookup = PromptLookup([prompt], tokens=4)
    drafts = lookup.propose({0: []})  # the row ends in (9, 2, 3): no earlier 3-gram, so (2, 3)
    assert drafts is not None and drafts.tolist() == [[20, 21, 22, 23]]  # the latest (2, 3)


def test_emitted_ids_extend_the_context_and_the_index() -> None:
    lookup = PromptLookup([[5, 6, 7, 8]], tokens=3)
    assert lookup.propose({0: []}) is None  # (7, 8) never occurred before
    assert lookup.propose({0: [40, 41, 42, 7, 8]}).tolist() == [[40, 41, 42]]  # (7, 8) was followed by 40
    assert lookup.propose({0: [40, 41, 42, 7, 8, 40, 41]}).tolist() == [[42, 7, 8]]  # 3-gram (8, 40, 41)


def test_short_drafts_are_padded_and_rows_keep_their_own_context() -> None:
    lookup = PromptLookup([[1, 2, 3, 1, 2], [7, 8, 9]], tokens=4)
    drafts = lookup.propose({0: [], 1: []})
    assert drafts is not None and drafts.tolist() == [[3, 1, 2, 0], [0, 0, 0, 0]]  # row 1: nothing to draft
