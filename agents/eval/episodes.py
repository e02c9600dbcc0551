"""Run a policy on many episodes at once: every active conversation is one row of a batch.

All live episodes take their turn together (one `policy.act` call), envs step (one after
another, or concurrently with `workers`), finished episodes leave and new seeds take their
slots. A policy that can `play` (`HFPolicy`) takes turns as a stream instead: an env steps as
soon as its turn is sampled, and the next turn joins the rows still decoding (continuous
batching), so no episode waits for the longest turn of the others. Used by eval, audit, compare
and the trainer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

import gymnasium as gym
from cgym.agents.base import Conversation, Policy, Turn
from cgym.envs.critique import Critique, CritiqueStyle, render
from cgym.envs.episode import Episode

T = TypeVar("T")


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


class _Lanes:
    """Runs calls on envs concurrently, each env pinned to one of `workers` threads for the life of
    the lanes; with one worker, inline on the calling thread (no threads at all).

    Pinning keeps what an env made on its thread (a sqlite3 connection) on that thread, and one
    env's calls run one after another on its lane, so no env is ever called from two threads at once.
    """

    def __init__(self, workers: int) -> None:
        self._threads = [ThreadPoolExecutor(1, thread_name_prefix=f"cgym-env-{i}") for i in range(workers)] if workers > 1 else []
        self._lane_of: dict[int, ThreadPoolExecutor] = {}

    def map(self, calls: Sequence[tuple[gym.Env, Callable[[], T]]]) -> list[T]:
        """The results of `calls`, in their order; the first call (in that order) to fail raises."""
        if not self._threads:
            return [call() for _, call in calls]
        futures = [self._lane(env).submit(call) for env, call in calls]
        wait(futures)  # none still running on an env once this returns, even when one raised
        return [future.result() for future in futures]

    def _lane(self, env: gym.Env) -> ThreadPoolExecutor:
        return self._lane_of.setdefault(id(env), self._threads[len(self._lane_of) % len(self._threads)])

    def close(self) -> None:
        for thread in self._threads:
            thread.shutdown()


def run_episodes(
    make_env: Callable[[], gym.Env],
    policy: Policy,
    seeds: Iterable[int],
    *,
    batch_size: int = 32,
    workers: int = 1,
    on_done: Callable[[EpisodeResult], None] | None = None,
    conversation_for: Callable[[int, Conversation], Conversation] | None = None,
    pool: list[gym.Env] | None = None,
    options_for: Callable[[int], dict[str, Any] | None] | None = None,
) -> list[EpisodeResult]:
    """Play one episode per seed; results come back in the order of `seeds`.

    `workers` > 1 resets and steps the live envs concurrently on that many threads, each env
    pinned to one of them: worth it when steps wait on I/O (an HTTP API with latency), not for
    CPU-bound envs under the GIL. The pinning lasts this call (a `pool` env may move thread between
    calls). Results and the order of `on_done` are those of `workers=1`. With one worker, a
    policy that has `play` streams its turns (each env steps as its turn ends), unless its
    `continuous` is False (`HFPolicy`'s default); `on_done` then hears episodes in the order they
    finish.
    `conversation_for(i, conv)` may replace the opening conversation of the i-th episode (e.g.
    with a refinement prompt); the env still scores the episode it started from that seed.
    `pool` reuses (and grows) a caller-owned list of envs instead of building new ones.
    `options_for(i)` gives the i-th episode's reset options (e.g. `{"task_id": ...}`).
    """
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be an int >= 1 (1 steps the envs one after another), got {workers!r}")
    pending = list(seeds)
    queue = list(enumerate(pending))[::-1]
    needed = min(batch_size, len(pending))
    if pool is not None:
        pool.extend(make_env() for _ in range(needed - len(pool)))
    envs = pool[:needed] if pool is not None else [make_env() for _ in range(needed)]
    free = list(envs)
    live: dict[int, _Slot] = {}
    results: dict[int, EpisodeResult] = {}
    if workers == 1 and callable(getattr(policy, "play", None)) and getattr(policy, "continuous", True):
        _stream(policy, queue, envs, results, on_done, conversation_for, options_for)
        if pool is None:
            for env in envs:
                env.close()
        return [results[i] for i in range(len(pending))]
    lanes = _Lanes(min(workers, len(envs)))
    try:
        while queue or live:
            starts = [(*queue.pop(), free.pop()) for _ in range(min(len(queue), len(free)))]
            opened = lanes.map([(env, partial(env.reset, seed=seed, options=options_for(index) if options_for else None)) for index, seed, env in starts])
            for (index, seed, env), (_, info) in zip(starts, opened):
                conv = _opening(env, info)
                live[index] = _Slot(env, seed, conversation_for(index, conv) if conversation_for else conv, [])
            keys = list(live)
            turns = policy.act([live[k].conversation for k in keys])
            stepped = lanes.map([(live[k].env, partial(live[k].env.step, turn.text)) for k, turn in zip(keys, turns)])
            for key, turn, (_, reward, terminated, truncated, info) in zip(keys, turns, stepped):
                slot = live[key]
                slot.turns.append(turn)
                slot.conversation.extend_from_env(info["messages"])
                if terminated or truncated:
                    result = _result(slot, reward, bool(truncated), info)
                    results[key] = result
                    del live[key]
                    free.append(slot.env)
                    if on_done is not None:
                        on_done(result)
        if pool is None:
            lanes.map([(env, env.close) for env in envs])
    finally:
        lanes.close()
    return [results[i] for i in range(len(pending))]


def _stream(
    policy: Any,
    queue: list[tuple[int, int]],
    envs: list[gym.Env],
    results: dict[int, EpisodeResult],
    on_done: Callable[[EpisodeResult], None] | None,
    conversation_for: Callable[[int, Conversation], Conversation] | None,
    options_for: Callable[[int], dict[str, Any] | None] | None,
) -> None:
    """Play the queued (index, seed) episodes through `policy.play`: each env steps as soon as
    its turn is sampled, and a finished episode's slot takes the next seed."""
    live: dict[int, tuple[int, _Slot]] = {}  # slot -> (episode index, its slot state)

    def start(slot: int, env: gym.Env) -> Conversation | None:
        if not queue:
            return None
        index, seed = queue.pop()
        _, info = env.reset(seed=seed, options=options_for(index) if options_for else None)
        conv = _opening(env, info)
        live[slot] = (index, _Slot(env, seed, conversation_for(index, conv) if conversation_for else conv, []))
        return live[slot][1].conversation

    def follow(slot: int, turn: Turn) -> Conversation | None:
        index, state = live[slot]
        state.turns.append(turn)
        _, reward, terminated, truncated, info = state.env.step(turn.text)
        state.conversation.extend_from_env(info["messages"])
        if not (terminated or truncated):
            return state.conversation
        result = _result(state, reward, bool(truncated), info)
        results[index] = result
        del live[slot]
        if on_done is not None:
            on_done(result)
        return start(slot, state.env)

    opening = [start(slot, env) for slot, env in enumerate(envs)]  # as many envs as seeds at most: none is None
    policy.play([conv for conv in opening if conv is not None], follow)


def _opening(env: gym.Env, info: dict[str, Any]) -> Conversation:
    env_id = env.spec.id if env.spec is not None else None
    return Conversation(list(info["messages"]), info["tools"], task=info.get("task"), env_id=env_id, env_seen=len(info["messages"]))


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
