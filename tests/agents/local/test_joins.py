"""Continuous batching: turns that join a running batch sample as they would in lockstep."""

from __future__ import annotations

import json
from pathlib import Path

import gymnasium as gym
import pytest
import torch
from cgym.agents.base import Conversation, Turn
from cgym.agents.eval.episodes import EpisodeResult, run_episodes
from cgym.agents.local import joins as joins_module
from cgym.agents.local.hf import HFPolicy
from cgym.agents.local.joins import Joins, Request
from cgym.agents.local.kv_cache import GrowingLayer
from cgym.agents.local.sampling import Sample, sample_turns
from cgym.agents.options import SamplingOptions
from cgym.trainer.tiny import build_tiny
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.agents.local.test_hf import SIZES, TOOLS, assert_ledger_reproduced, chat_corpus

TURNS = [3, 1, 2, 3, 2]  # each conversation's number of turns


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny(tmp_path_factory.mktemp("tiny"), chat_corpus(), **SIZES)


def conversations() -> list[Conversation]:
    users = [
        "Report customer 7's orders.",
        "Orders of customer 12, shipped only, as a table please.",
        "Customer 3?",
        "All of customer 40's pending orders, newest first.",
        "Customer 9.",
    ]
    system = {"role": "system", "content": "You are an API agent. Call tools, then report. " * 3}
    return [Conversation([system, {"role": "user", "content": u}], TOOLS) for u in users]


class Stopping(HFPolicy):
    """A policy whose turns end on any of a fifth of the ids, so that rows end their turns at
    different steps (the tiny model never ends a turn itself)."""

    @property
    def stop_ids(self) -> set[int]:
        return {*super().stop_ids, *range(0, self.model.config.vocab_size, 5)}


def policy_for(tiny_dir: Path, temperature: float, attention: str = "sdpa", continuous: bool = True) -> HFPolicy:
    """The tiny model with weights drawn wider, so that its greedy ids vary (as built, it says
    the same id over and over)."""
    model = widened(AutoModelForCausalLM.from_pretrained(tiny_dir, attn_implementation=attention))
    return Stopping(
        model, AutoTokenizer.from_pretrained(tiny_dir), sampling=SamplingOptions(temperature=temperature, max_new_tokens=10, seed=3), continuous=continuous
    )


def widened(model: torch.nn.Module) -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0, 0.2)
    return model


def reply(slot: int, turn: int) -> dict[str, str]:
    """The 'env's answer: a tool message whose length differs by conversation and turn."""
    return {"role": "tool", "content": json.dumps({"turn": turn, "rows": list(range(7 * slot + 5 * turn))})}


def streamed(policy: HFPolicy, convs: list[Conversation]) -> list[list[Turn]]:
    """`play`: conversation i takes TURNS[i] turns, each answered as soon as it is sampled."""
    history: list[list[Turn]] = [[] for _ in convs]

    def follow(slot: int, turn: Turn) -> Conversation | None:
        history[slot].append(turn)
        convs[slot].messages.append({"role": "assistant", "content": turn.text})
        if len(history[slot]) == TURNS[slot]:
            return None
        convs[slot].messages.append(reply(slot, len(history[slot]) - 1))
        return convs[slot]

    policy.play(convs, follow)
    return history


def lockstep(policy: HFPolicy, convs: list[Conversation]) -> list[list[Turn]]:
    """The same conversations through `act`, every live one taking its turn together."""
    history: list[list[Turn]] = [[] for _ in convs]
    live = list(range(len(convs)))
    while live:
        for slot, turn in zip(live, policy.act([convs[s] for s in live]), strict=True):
            history[slot].append(turn)
            convs[slot].messages.append({"role": "assistant", "content": turn.text})
            if len(history[slot]) < TURNS[slot]:
                convs[slot].messages.append(reply(slot, len(history[slot]) - 1))
        live = [s for s in live if len(history[s]) < TURNS[s]]
    return history


@pytest.fixture
def moves(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Every join of two batches' cache layers: how far each side moved right."""
    seen: list[tuple[int, int]] = []
    join = GrowingLayer.join

    def spy(self: GrowingLayer, other: GrowingLayer, room: int) -> tuple[int, int]:
        moved = join(self, other, room)
        seen.append(moved)
        return moved

    monkeypatch.setattr(GrowingLayer, "join", spy)
    monkeypatch.setattr(joins_module, "JOIN_SHARE", 8)  # join as soon as any turn waits
    return seen


@pytest.mark.parametrize("attention", ["sdpa", "eager"], ids=["served-prefix", "copied-prefix"])
def test_greedy_turns_that_join_are_the_lockstep_turns(tiny_dir: Path, attention: str, moves: list[tuple[int, int]]) -> None:
    """The same greedy ids and log-probs as `act` in lockstep. With the head served apart,
    turns join the running rows, moving either side right; with a copied head they cannot
    (the head would move), and each batch's next turns run as the next batch."""
    policy = policy_for(tiny_dir, 0.0, attention)
    convs = conversations()
    got = streamed(policy, convs)
    want = lockstep(policy_for(tiny_dir, 0.0, attention), conversations())

    assert [[t.token_ids for t in row] for row in got] == [[t.token_ids for t in row] for row in want]
    for row_got, row_want in zip(got, want, strict=True):
        for a, b in zip(row_got, row_want, strict=True):
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)
    if attention == "sdpa":
        layers = policy.model.config.num_hidden_layers
        assert len(moves) >= 2 * layers  # at least two joins
        assert any(old > 0 for old, _ in moves) and any(new > 0 for _, new in moves)
        assert policy.turn_cache is not None and policy.turn_cache.hits == sum(TURNS) - len(TURNS)
    else:
        assert not moves
    assert policy.turn_cache is not None and not policy.turn_cache.entries  # every conversation ended: nothing kept


def test_episodes_play_in_lockstep_unless_asked(tiny_chat_model: Path, moves: list[tuple[int, int]], monkeypatch: pytest.MonkeyPatch) -> None:
    """By default `run_episodes` takes turns through `act`, every live conversation together;
    `continuous=True` streams them through `play`, where turns join."""
    model = widened(AutoModelForCausalLM.from_pretrained(tiny_chat_model))
    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_model)
    played: list[int] = []
    play = HFPolicy.play

    def spy(self: HFPolicy, batch: list[Conversation], follow: object) -> None:
        played.append(len(batch))
        play(self, batch, follow)  # type: ignore[arg-type]

    monkeypatch.setattr(HFPolicy, "play", spy)
    make = lambda: gym.make("cgym/ApiReport-v0", difficulty="easy")  # noqa: E731
    policy = Stopping(model, tokenizer, sampling=SamplingOptions(temperature=1.0, max_new_tokens=24))
    assert policy.continuous is False
    run_episodes(make, policy, [5, 6, 7, 8, 9, 10], batch_size=4)
    assert not played and not moves
    policy.continuous = True
    run_episodes(make, policy, [5, 6, 7, 8, 9, 10], batch_size=4)
    assert played == [4] and moves


def test_sampled_turns_that_join_keep_an_exact_ledger(tiny_dir: Path, moves: list[tuple[int, int]]) -> None:
    """At temperature 1, every stored log-prob is the one a training forward pass recomputes."""
    policy = policy_for(tiny_dir, 1.0)
    convs = conversations()
    history = streamed(policy, convs)
    assert [len(row) for row in history] == TURNS and moves
    for conv in convs:
        assert_ledger_reproduced(policy.model, conv)


def test_episodes_played_continuously_are_those_played_in_lockstep(tiny_chat_model: Path, moves: list[tuple[int, int]]) -> None:
    """`run_episodes` with a policy that can `play`: more seeds than envs (a finished episode's
    env takes the next seed), the same episodes as in lockstep, in seed order, each reported once;
    and turns do join."""
    model = widened(AutoModelForCausalLM.from_pretrained(tiny_chat_model))
    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_model)
    results = {}
    for arm in ("continuous", "lockstep"):
        policy = Stopping(model, tokenizer, sampling=SamplingOptions(temperature=0.0, max_new_tokens=24), continuous=arm == "continuous")
        done: list[EpisodeResult] = []
        results[arm] = run_episodes(lambda: gym.make("cgym/ApiReport-v0", difficulty="easy"), policy, [5, 6, 7, 8, 9, 10], batch_size=4, on_done=done.append)
        assert sorted(r.seed for r in done) == [5, 6, 7, 8, 9, 10]
    assert [r.seed for r in results["continuous"]] == [5, 6, 7, 8, 9, 10] and moves
    for a, b in zip(results["continuous"], results["lockstep"], strict=True):
        assert (a.reward, a.success, a.codes) == (b.reward, b.success, b.codes)
        assert [t.token_ids for t in a.turns] == [t.token_ids for t in b.turns]


def test_a_turn_that_does_not_share_the_head_is_left_over(tiny_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    head = list(range(3, 40))
    heard: list[str] = []

    def follow(key: object, sample: Sample) -> tuple[list[int], object] | None:
        heard.append(str(key))
        if key == "a":
            return [7, *head[1:], 9, 9], "a2"  # a different first id
        if key == "b":
            return [*head, 5], "b2"  # no id of its own before its last
        return None

    params = SamplingOptions(temperature=0.0, max_new_tokens=3)
    left = sample_turns(model, [[*head, 1, 2], [*head, 4]], ["a", "b"], follow, params=params, stop_ids={0}, pad_id=0, bytes_per_token=64, budget=10**9)
    assert sorted(heard) == ["a", "b"]
    assert sorted(str(r.key) for r in left) == ["a2", "b2"]


def _joins(budget: int = 10**9) -> Joins:
    return Joins(lambda key, sample: None, head=(1, 2), bytes_per_token=1, budget=budget, room=10)


def test_turns_join_once_enough_wait_within_the_budget_and_the_width() -> None:
    joins = _joins()
    joins.wait(Request([1, 2, 3, 4], "a"))
    assert joins.take(rows=joins_module.JOIN_SHARE + 1, width=4) == []  # too few wait yet
    assert [r.key for r in joins.take(rows=joins_module.JOIN_SHARE, width=4)] == ["a"]

    joins.wait(Request([1, 2] + [3] * 20, "long"))  # over twice the batch's width
    joins.wait(Request([1, 2, 3, 4, 5], "near"))
    assert [r.key for r in joins.take(rows=1, width=6)] == ["near"]
    assert [r.key for r in joins.take(rows=0, width=6)] == ["long"]  # an empty batch takes it

    tight = _joins(budget=3 * (8 + 10))  # three rows of 8 columns and their room
    for key in "xyz":
        tight.wait(Request([1, 2, 3, 4, 5, 6, 7, 8], key))
    assert [r.key for r in tight.take(rows=1, width=8)] == ["x", "y"]
    assert [r.key for r in tight.take(rows=0, width=0)] == ["z"]


def test_a_turn_without_the_head_or_an_own_id_is_left_over() -> None:
    joins = _joins()
    for prompt, key in (([9, 2, 3, 4], "other head"), ([1, 2, 3], "one id"), ([1, 2, 3, 4], "fits")):
        joins.wait(Request(prompt, key))
    assert [r.key for r in joins.waiting] == ["fits"]
    assert [r.key for r in joins.left_over] == ["other head", "one id"]


def test_growing_layers_join_right_aligned() -> None:
    top, bottom = GrowingLayer(), GrowingLayer()
    top.update(torch.ones(2, 1, 3, 2), torch.ones(2, 1, 3, 2))
    bottom.update(torch.full((1, 1, 5, 2), 2.0), torch.full((1, 1, 5, 2), 2.0))
    assert top.join(bottom, room=4) == (2, 0)
    assert top.keys.shape == (3, 1, 5, 2) and top.get_seq_length() == 5
    assert (top.keys[:2, :, :2] == 0).all() and (top.keys[:2, :, 2:] == 1).all() and (top.values[2] == 2).all()
    top.update(torch.zeros(3, 1, 4, 2), torch.zeros(3, 1, 4, 2))  # the room: no new buffer
    assert top.keys.shape[2] == 9
