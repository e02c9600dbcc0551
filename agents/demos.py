"""Scripted demonstrations: transcripts for SFT warm starts and text for the tiny tokenizer."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from agents.episodes import run_episodes
from agents.scripted import ScriptedPolicy, family_of
from envs.registration import make

Demo = tuple[list[dict[str, Any]], list[dict[str, Any]]]  # (messages, tools)


def demonstrations(
    env_id: str,
    env_kwargs: dict[str, Any],
    *,
    episodes: int,
    seed: int = 0,
    imperfect: float = 0.3,
) -> list[Demo]:
    """Train-split transcripts: mostly the oracle, `imperfect` of them from flawed agents.

    The flawed share keeps the warm-started model good but not perfect, leaving room for RL.
    """
    kwargs = {**env_kwargs, "split": "train"}
    probe = make(env_id, **kwargs)
    _, info = probe.reset(seed=seed)
    probe.close()
    family = family_of(info["tools"])
    if family is None:
        raise ValueError(f"{env_id} has no scripted agents to demonstrate with")
    flawed = sorted(family.near_misses or family.flaw_codes)
    rng = np.random.default_rng(seed)
    agents = ["oracle" if rng.random() >= imperfect else flawed[int(rng.integers(len(flawed)))] for _ in range(episodes)]
    seeds = [seed * 1_000_000 + i for i in range(episodes)]
    demos: list[Demo] = []
    for agent in sorted(set(agents)):
        mine = [s for s, a in zip(seeds, agents) if a == agent]
        results = run_episodes(lambda: make(env_id, **kwargs), ScriptedPolicy(agent), mine, batch_size=64)
        demos += [(r.conversation.messages, r.conversation.tools) for r in results]
    order = rng.permutation(len(demos))
    return [demos[i] for i in order]


def corpus(demos: Sequence[Demo]) -> Iterator[str]:
    """Every text a model will read or write in these envs (for training a tokenizer)."""
    seen_tools: set[str] = set()
    for messages, tools in demos:
        schema = json.dumps(tools)
        if schema not in seen_tools:
            seen_tools.add(schema)
            yield schema
        for message in messages:
            yield message["content"]
