"""PromptLookup: which ids it drafts from a row's prompt and emitted ids, and from how many live rows."""

from __future__ import annotations

import pytest
import torch
from cgym.agents.local.lookup import LONG_DRAFT_ROWS, LONG_DRAFT_TOKENS, LOOKUP_ROWS, LOOKUP_TOKENS, PromptLookup, draft_length, lookup_rows


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


def test_a_repeating_draft_continues_the_loop_it_matched() -> None:
    """A row repeating (7, 8, 9): the match is three ids back, so a plain draft has three ids and
    padding, a repeating one goes round the loop; where the match has room, both are the same."""
    lookup = PromptLookup([[1, 7, 8, 9, 7, 8, 9]], tokens=8)
    assert lookup.propose({0: []}).tolist() == [[7, 8, 9, 0, 0, 0, 0, 0]]
    assert lookup.propose({0: []}, repeat=True).tolist() == [[7, 8, 9, 7, 8, 9, 7, 8]]
    assert lookup.propose({0: [7]}, 5, repeat=True).tolist() == [[8, 9, 7, 8, 9]]  # (8, 9, 7) three ids back: the loop from 8
    roomy = PromptLookup([[1, 2, 3, 4, 5, 6, 7, 1, 2]], tokens=4)
    assert roomy.propose({0: []}, repeat=True).tolist() == roomy.propose({0: []}).tolist() == [[3, 4, 5, 6]]


def test_draft_lengths_by_live_rows_and_temperature() -> None:
    assert draft_length(LONG_DRAFT_ROWS, 0.0, LOOKUP_TOKENS) == LONG_DRAFT_TOKENS > LOOKUP_TOKENS
    assert draft_length(LONG_DRAFT_ROWS + 1, 0.0, LOOKUP_TOKENS) == LOOKUP_TOKENS
    assert draft_length(1, 0.7, LOOKUP_TOKENS) == LOOKUP_TOKENS  # sampled, one row: as asked
    assert draft_length(2, 0.7, LOOKUP_TOKENS) == draft_length(LOOKUP_ROWS, 1.0, LOOKUP_TOKENS) == 1  # more rows: one id each
    assert draft_length(2, 0.7, 0) == 0
    assert draft_length(1, 0.0, 0) == 0  # drafting off stays off
    assert draft_length(1, 0.0, 30) == 30


def test_greedy_turns_draft_with_more_rows_live_than_sampled_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """12 live rows: a greedy batch drafts (its drafts are mostly kept), a sampled one does not."""
    from cgym.agents.local.sampling import sample_batch
    from cgym.agents.options import SamplingOptions
    from transformers import LlamaConfig, LlamaForCausalLM

    assert lookup_rows(1.0) < 12 <= lookup_rows(0.0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    ).eval()
    asked: list[int] = []
    real = PromptLookup.propose
    monkeypatch.setattr(PromptLookup, "propose", lambda self, emitted, *args, **kwargs: asked.append(len(emitted)) or real(self, emitted, *args, **kwargs))
    prompts = [[1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5 + row] for row in range(12)]
    for temperature, drafts in ((0.0, True), (1.0, False)):
        asked.clear()
        sample_batch(model, prompts, params=SamplingOptions(temperature=temperature, max_new_tokens=6, seed=0), stop_ids=set(), pad_id=0, draft_tokens=4)
        assert bool(asked) == drafts and (not asked or asked[0] == 12)  # from the first step, all 12 live
