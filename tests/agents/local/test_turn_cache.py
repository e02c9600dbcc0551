"""A conversation's keys/values kept between turns give the same turns as prefilling it again."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from cgym.agents.base import Conversation, Turn
from cgym.agents.local.hf import HFPolicy
from cgym.agents.local.sampling import sample_batch
from cgym.agents.local.turn_cache import TurnCache
from cgym.agents.options import SamplingOptions
from cgym.trainer.tiny import build_tiny
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.agents.local.test_hf import SIZES, TOOLS, assert_ledger_reproduced, chat_corpus


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny(tmp_path_factory.mktemp("tiny"), chat_corpus(), **SIZES)


def conversations() -> list[Conversation]:
    users = ["Report customer 7's orders.", "Orders of customer 12, shipped only, as a table please.", "Customer 3?"]
    system = {"role": "system", "content": "You are an API agent. Call tools, then report. " * 3}
    return [Conversation([system, {"role": "user", "content": u}], TOOLS) for u in users]


def play(policy: HFPolicy, convs: list[Conversation], turns: int) -> list[list[Turn]]:
    """Act `turns` times; after each turn every row gets a tool reply of a different length."""
    history: list[list[Turn]] = [[] for _ in convs]
    for t in range(turns):
        for i, (conv, turn) in enumerate(zip(convs, policy.act(convs), strict=True)):
            history[i].append(turn)
            conv.messages.append({"role": "assistant", "content": turn.text})
            conv.messages.append({"role": "tool", "content": json.dumps({"turn": t, "rows": list(range(3 * i + t))})})
    return history


def policy_for(tiny_dir: Path, temperature: float, *, cached: bool, attention: str = "sdpa") -> HFPolicy:
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, attn_implementation=attention)
    policy = HFPolicy(model, AutoTokenizer.from_pretrained(tiny_dir), sampling=SamplingOptions(temperature=temperature, max_new_tokens=10, seed=3))
    if not cached:
        policy.turn_cache = None
    return policy


@pytest.mark.parametrize("attention", ["sdpa", "eager"], ids=["served-prefix", "copied-prefix"])
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_cached_turns_match_recomputed_turns(tiny_dir: Path, temperature: float, attention: str) -> None:
    cached, plain = policy_for(tiny_dir, temperature, cached=True, attention=attention), policy_for(tiny_dir, temperature, cached=False, attention=attention)
    convs_cached, convs_plain = conversations(), conversations()
    got, want = play(cached, convs_cached, turns=3), play(plain, convs_plain, turns=3)

    assert [[t.token_ids for t in row] for row in got] == [[t.token_ids for t in row] for row in want]
    for row_got, row_want in zip(got, want, strict=True):
        for a, b in zip(row_got, row_want, strict=True):
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)
    assert cached.turn_cache.hits == 2 * len(convs_cached)  # every row, every turn after the first
    assert cached.turn_cache.reused_tokens > 0
    for conv in convs_cached:
        assert_ledger_reproduced(cached.model, conv, temperature if temperature > 0 else 1.0)


def test_a_weight_update_or_an_edited_history_is_a_miss(tiny_dir: Path) -> None:
    policy = policy_for(tiny_dir, 0.0, cached=True)
    convs = conversations()
    play(policy, convs, turns=1)
    with torch.no_grad():
        next(policy.model.parameters()).add_(0.01)
    play(policy, convs, turns=1)
    assert policy.turn_cache.hits == 0  # stale keys/values are never read

    play(policy, convs, turns=1)
    assert policy.turn_cache.hits == len(convs)
    edited = copy.deepcopy(convs[0])  # a new conversation: a key the cache does not know
    play(policy, [edited, *convs[1:]], turns=1)
    assert policy.turn_cache.hits == 2 * len(convs) - 1


def test_entries_never_outlive_the_batch(tiny_dir: Path) -> None:
    policy = policy_for(tiny_dir, 0.0, cached=True)
    convs = conversations()
    play(policy, convs, turns=1)
    assert len(policy.turn_cache.entries) == len(convs)
    play(policy, convs[:1], turns=1)
    assert list(policy.turn_cache.entries) == [id(convs[0])]
    policy.drop_caches()  # what a trainer does between its rollout and its update
    assert not policy.turn_cache.entries and policy.turn_cache.bytes == 0


def test_reuse_leaves_an_id_to_compute_and_checks_the_ids(tiny_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_dir).eval()
    cache = TurnCache()
    prompt = list(range(5, 40))
    params = SamplingOptions(temperature=0.0, max_new_tokens=3)
    first = sample_batch(model, [prompt], params=params, stop_ids={0}, pad_id=0, turn_cache=cache, turn_keys=["a"], share_prefix=False)[0]
    longer = prompt + first.ids
    assert len(cache.entries["a"].ids) == len(prompt) + len(first.ids) - 1  # the last id was never fed
    again = sample_batch(model, [longer], params=params, stop_ids={0}, pad_id=0, turn_cache=cache, turn_keys=["a"], share_prefix=False)[0]
    fresh = sample_batch(model, [longer], params=params, stop_ids={0}, pad_id=0, share_prefix=False)[0]
    assert again.ids == fresh.ids and cache.hits == 1
    changed = [longer[0] + 1, *longer[1:]]
    sample_batch(model, [changed], params=params, stop_ids={0}, pad_id=0, turn_cache=cache, turn_keys=["a"], share_prefix=False)
    assert cache.hits == 1  # different leading ids: recomputed
    with pytest.raises(ValueError, match="turn keys"):
        sample_batch(model, [prompt, prompt], params=params, stop_ids={0}, pad_id=0, turn_cache=cache, turn_keys=["a"])


def test_a_drafted_turn_leaves_the_same_cache_as_one_id_at_a_time(tiny_dir: Path) -> None:
    """Prompt-lookup drafts leave masked-out columns in the cache (rejected drafts) and may feed
    ids past a stop id or max_new_tokens; the saved entry holds exactly the row's fed ids, so the
    next turn matches."""
    model = AutoModelForCausalLM.from_pretrained(tiny_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    prompt = tokenizer.encode("<|im_start|>user\n" + "customer 7 ordered 3 items. " * 4 + "<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    params = SamplingOptions(temperature=0.0, max_new_tokens=31)  # the last drafts overrun the room: fed, not saved
    stop = {tokenizer.convert_tokens_to_ids("<|im_end|>")}
    entries = []
    for draft_tokens in (0, 4):
        cache = TurnCache()
        first = sample_batch(model, [prompt, prompt[1:]], params=params, stop_ids=stop, pad_id=0, turn_cache=cache, turn_keys=["a", "b"], share_prefix=False, draft_tokens=draft_tokens)
        entries.append((first, cache.entries["a"]))
        longer = prompt + first[0].ids + prompt[-8:]
        again = sample_batch(model, [longer], params=params, stop_ids=stop, pad_id=0, turn_cache=cache, turn_keys=["a"], share_prefix=False, draft_tokens=draft_tokens)[0]
        fresh = sample_batch(model, [longer], params=params, stop_ids=stop, pad_id=0, share_prefix=False, draft_tokens=0)[0]
        assert again.ids == fresh.ids and cache.hits == 1
    (plain, plain_entry), (drafted, drafted_entry) = entries
    assert [s.ids for s in drafted] == [s.ids for s in plain]
    assert drafted_entry.ids == plain_entry.ids
    for a, b in zip(drafted_entry.keys, plain_entry.keys, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
