"""Rows sample in chunks of similar length within a memory budget, with the same turns."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from cgym.agents.local.batching import LENGTH_RATIO, kv_budgets, kv_bytes_per_token, length_chunks
from cgym.agents.local.hf import HFPolicy
from cgym.agents.options import SamplingOptions
from cgym.envs.errors import ConfigError
from cgym.trainer.tiny import build_tiny
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from tests.agents.local.test_hf import SIZES, chat_corpus
from tests.agents.local.test_turn_cache import conversations, play


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny(tmp_path_factory.mktemp("tiny"), chat_corpus(), **SIZES)


def test_smollm2_keys_and_values_take_23_kb_a_token_in_bf16() -> None:
    config = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=30)
    assert kv_bytes_per_token(config, 2) == 2 * 30 * 3 * 64 * 2 == 23_040


@pytest.mark.parametrize("seed", range(5))
def test_chunks_hold_every_row_once_within_the_ratio_and_budget(seed: int) -> None:
    rng = random.Random(seed)
    lengths = [rng.randint(1, 5000) for _ in range(rng.randint(1, 60))]
    budget = 40_000
    chunks = length_chunks(lengths, room=10, bytes_per_token=1, budget=budget)

    assert sorted(row for chunk in chunks for row in chunk) == list(range(len(lengths)))
    for chunk in chunks:
        longest = lengths[chunk[0]]
        assert longest == max(lengths[row] for row in chunk)
        assert all(lengths[row] * LENGTH_RATIO >= longest for row in chunk)
        assert len(chunk) == 1 or len(chunk) * (longest + 10) <= budget


def test_chunks_cut_at_the_ratio_and_at_the_budget() -> None:
    assert length_chunks([100, 900, 1000, 40, 60], room=0, bytes_per_token=1, budget=10**9) == [[2, 1], [0, 4], [3]]
    assert length_chunks([100] * 5, room=0, bytes_per_token=1, budget=200) == [[0, 1], [2, 3], [4]]
    assert length_chunks([500, 10], room=0, bytes_per_token=1, budget=100) == [[0], [1]]  # alone even when over


def test_budget_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CGYM_KV_BUDGET_GB", "1.5")
    assert kv_budgets() == (1_500_000_000, 3_000_000_000)
    monkeypatch.delenv("CGYM_KV_BUDGET_GB")
    batch, turns = kv_budgets()
    assert 0 < batch and turns == 2 * batch
    for bad in ("lots", "0", "-2", "nan"):
        monkeypatch.setenv("CGYM_KV_BUDGET_GB", bad)
        with pytest.raises(ConfigError, match="CGYM_KV_BUDGET_GB"):
            kv_budgets()


def policy_for(tiny_dir: Path, temperature: float) -> HFPolicy:
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    return HFPolicy(model, AutoTokenizer.from_pretrained(tiny_dir), sampling=SamplingOptions(temperature=temperature, max_new_tokens=10, seed=3))


def test_chunked_greedy_turns_match_one_batch(tiny_dir: Path) -> None:
    whole, chunked = policy_for(tiny_dir, 0.0), policy_for(tiny_dir, 0.0)
    chunked.batch_budget = 1  # every row alone
    calls = []
    sample = chunked._sample
    chunked._sample = lambda model, convs: calls.append(len(convs)) or sample(model, convs)  # type: ignore[method-assign]

    got, want = play(chunked, conversations(), turns=3), play(whole, conversations(), turns=3)

    assert [[t.token_ids for t in row] for row in got] == [[t.token_ids for t in row] for row in want]
    assert calls == [1] * 9


def test_a_full_turn_cache_stores_no_more_and_turns_stay_exact(tiny_dir: Path) -> None:
    full, roomy = policy_for(tiny_dir, 1.0), policy_for(tiny_dir, 1.0)
    assert full.turn_cache is not None and roomy.turn_cache is not None
    play(roomy, conversations(), turns=1)
    one_entry = max(entry.size for entry in roomy.turn_cache.entries.values())
    roomy = policy_for(tiny_dir, 1.0)
    full.turn_cache.max_bytes = one_entry  # room for one conversation

    got, want = play(full, conversations(), turns=3), play(roomy, conversations(), turns=3)

    assert [[t.token_ids for t in row] for row in got] == [[t.token_ids for t in row] for row in want]
    assert full.turn_cache.skipped > 0 and full.turn_cache.bytes <= one_entry
    assert full.turn_cache.bytes == sum(entry.size for entry in full.turn_cache.entries.values())
    full.turn_cache.keep_only(set())
    assert full.turn_cache.bytes == 0 and not full.turn_cache.entries
