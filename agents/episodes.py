"""Run a policy on many episodes at once: every active conversation is one row of a batch.

All live episodes take their turn together (one `policy.act` call), envs step, finished
episodes leave and new seeds take their slots. Used by eval, audit, compare and the trainer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym

from agents.base import Conversation, Policy, Turn
from envs.critique import Critique, CritiqueStyle, render
from envs.episode import Episode


@dataclass
class EpisodeResult:
    """One finished episode: outcome, critiques, the conversation (with its token ledger)."""

    seed: int
    success: bool
    reward: float
    truncated: bool
    breakdown: dict[str, float]
    passed: dict[str, bool]
    critiques: list[dict[str, Any]]
    conversation: Conversation
    turns: list[Turn] = field(default_factory=list)
    record: Episode | None = None
    task_id: str | None = None

    @property
    def codes(self) -> list[str]:
        return [c["code"] for c in self.critiques]

    @property
    def sampled_tokens(self) -> int:
        return sum(len(t.token_ids) for t in self.turns)

    def critique(self, style: CritiqueStyle) -> str:
        """This episode's critique in one of the env's three renderings."""
        assert self.record is not None
        objs = [Critique(**c) for c in self.critiques]
        return render(style, self.record, objs, self.success)

    def summary(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "task_id": self.task_id,
            "success": self.success,
            "reward": self.reward,
            "truncated": self.truncated,
            "turns": len(self.turns),
            "codes": self.codes,
        }


@dataclass
class _Slot:
    env: gym.Env
    seed: int
    conversation: Conversation
    turns: list[Turn]


def run_episodes(
    make_env: Callable[[], gym.Env],
    policy: Policy,
    seeds: Iterable[int],
    *,
    batch_size: int = 32,
    on_done: Callable[[EpisodeResult], None] | None = None,
    conversation_for: Callable[[int, Conversation], Conversation] | None = None,
    pool: list[gym.Env] | None = None,
) -> list[EpisodeResult]:
    """Play one episode per seed; results come back in the order of `seeds`.

    `conversation_for(i, conv)` may replace the opening conversation of the i-th episode (e.g.
    with a refinement prompt); the env still scores the episode it started from that seed.
    `pool` reuses (and grows) a caller-owned list of envs instead of building new ones.
    """
    pending = list(seeds)
    order = {i: s for i, s in enumerate(pending)}
    queue = list(enumerate(pending))[::-1]
    needed = min(batch_size, len(pending))
    if pool is not None:
        pool.extend(make_env() for _ in range(needed - len(pool)))
    envs = pool[:needed] if pool is not None else [make_env() for _ in range(needed)]
    free = list(envs)
    live: dict[int, _Slot] = {}
    results: dict[int, EpisodeResult] = {}
    while queue or live:
        while queue and free:
            index, seed = queue.pop()
            env = free.pop()
            _, info = env.reset(seed=seed)
            env_id = env.spec.id if env.spec is not None else None
            conv = Conversation(list(info["messages"]), info["tools"], task=info.get("task"), env_id=env_id, env_seen=len(info["messages"]))
            live[index] = _Slot(env, seed, conversation_for(index, conv) if conversation_for else conv, [])
        keys = list(live)
        turns = policy.act([live[k].conversation for k in keys])
        for key, turn in zip(keys, turns):
            slot = live[key]
            slot.turns.append(turn)
            _, reward, terminated, truncated, info = slot.env.step(turn.text)
            slot.conversation.extend_from_env(info["messages"])
            if terminated or truncated:
                result = _result(slot, reward, bool(truncated), info)
                results[key] = result
                del live[key]
                free.append(slot.env)
                if on_done is not None:
                    on_done(result)
    if pool is None:
        for env in envs:
            env.close()
    return [results[i] for i in sorted(order)]


def _result(slot: _Slot, reward: float, truncated: bool, info: dict[str, Any]) -> EpisodeResult:
    return EpisodeResult(
        seed=slot.seed,
        success=bool(info.get("success", False)),
        reward=float(reward),
        truncated=truncated,
        breakdown=dict(info.get("reward_breakdown", {})),
        passed=dict(info.get("checks_passed", {})),
        critiques=list(info.get("critiques", [])),
        conversation=slot.conversation,
        turns=slot.turns,
        record=info.get("episode"),
        task_id=info.get("task_id"),
    )
