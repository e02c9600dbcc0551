"""Scripted demonstrations: transcripts for SFT warm starts and text for the tiny tokenizer."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from cgym.agents.base import Conversation
from cgym.agents.critics import refinement_conversation
from cgym.agents.eval.episodes import run_episodes
from cgym.agents.scripted import ScriptedPolicy, family_for
from cgym.envs.critique import CritiqueStyle
from cgym.envs.registration import ScriptedAgentsError, make, takes_kwarg

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
    if episodes < 1 or not 0.0 <= imperfect <= 1.0:
        raise ValueError(f"need episodes >= 1 and imperfect in [0, 1], got {episodes} and {imperfect}")
    kwargs = _train_split(env_id, env_kwargs)
    family = family_for(env_id)
    flawed = sorted(family.near_misses or family.flaw_codes)
    if imperfect > 0 and not flawed:
        raise ScriptedAgentsError(f"the scripted agents of {env_id} have no flawed agents for the imperfect={imperfect} share")
    rng = np.random.default_rng(seed)
    agents = ["oracle" if rng.random() >= imperfect else flawed[int(rng.integers(len(flawed)))] for _ in range(episodes)]
    seeds = [seed * 1_000_000 + i for i in range(episodes)]
    demos: list[Demo] = []
    for agent in sorted(set(agents)):
        mine = [s for s, a in zip(seeds, agents) if a == agent]
        results = run_episodes(lambda: make(env_id, **kwargs), ScriptedPolicy(agent, env_id=env_id), mine, batch_size=64)
        demos += [(r.conversation.messages, r.conversation.tools) for r in results]
    order = rng.permutation(len(demos))
    return [demos[i] for i in order]


def refinement_demos(
    env_id: str,
    env_kwargs: dict[str, Any],
    *,
    episodes: int,
    seed: int = 0,
    style: CritiqueStyle = "step",
) -> list[Demo]:
    """Critique-taking demonstrations: a near-miss agent's failed attempt and its critique in the
    refinement prompt Critique-GRPO uses, then the oracle solving the task from the start.

    Instruction-tuned models already act on feedback; a model warm-started from scratch does not.
    Mixing these into SFT gives it that skill, so refinements of its own failures can succeed.
    """
    kwargs = _train_split(env_id, env_kwargs)
    family = family_for(env_id)
    if not family.near_misses:
        raise ScriptedAgentsError(f"the scripted agents of {env_id} name no near_misses, the failures refinement demos fix")
    rng = np.random.default_rng(seed)
    seeds = [seed * 1_000_000 + 500_000 + i for i in range(episodes)]
    flaws = [family.near_misses[int(rng.integers(len(family.near_misses)))] for _ in seeds]
    solved = {r.seed: r for r in run_episodes(lambda: make(env_id, **kwargs), ScriptedPolicy("oracle", env_id=env_id), seeds, batch_size=64)}
    demos: list[Demo] = []
    for flaw in sorted(set(flaws)):
        mine = [s for s, f in zip(seeds, flaws) if f == flaw]
        for failed in run_episodes(lambda: make(env_id, **kwargs), ScriptedPolicy(flaw, env_id=env_id), mine, batch_size=64):
            if failed.success:
                continue  # some flaws do not bite on every task (e.g. no page to skip)
            oracle = solved[failed.seed].conversation
            opening = Conversation(oracle.messages[:2], oracle.tools, task=oracle.task, env_id=oracle.env_id)
            prompt = refinement_conversation(opening, failed, failed.critique(style))
            demos.append((prompt.messages + oracle.messages[2:], oracle.tools))
    order = rng.permutation(len(demos))
    return [demos[i] for i in order]


def _train_split(env_id: str, env_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The kwargs with `split="train"` for an env that has splits (demos never see test tasks)."""
    return {**env_kwargs, "split": "train"} if takes_kwarg(env_id, "split") else dict(env_kwargs)


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
