"""Compare policies on the same episodes: prompt-only vs guarded vs trained, side by side."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from agents.base import Policy
from agents.episodes import EpisodeResult
from agents.evaluate import EvalConfig, evaluate

MAX_DISAGREEMENTS = 40


def compare(arms: Sequence[tuple[str, Policy]], config: EvalConfig, *, on_arm: Callable[[str], Any] | None = None) -> dict[str, Any]:
    """Evaluate every arm on the same seeds; `before`/`after` are the first and last arms.

    `disagreements` lists episodes (by seed) where the first and last arm differ in success,
    with both transcripts and their critiques.
    """
    if len(arms) < 2:
        raise ValueError("compare needs at least two policies (e.g. --before and --after)")
    summaries: dict[str, dict[str, Any]] = {}
    results: dict[str, list[EpisodeResult]] = {}
    for label, policy in arms:
        if on_arm:
            on_arm(label)
        summaries[label], results[label] = evaluate(policy, config)
    first, last = arms[0][0], arms[-1][0]
    return {
        "env": config.env_id,
        "env_kwargs": config.env_kwargs,
        "episodes": config.episodes,
        "seed": config.seed,
        "labels": [label for label, _ in arms],
        "before": _strip(summaries[first]),
        "after": _strip(summaries[last]),
        "arms": {label: _strip(s) for label, s in summaries.items()},
        "disagreements": disagreements(results[first], results[last], first, last),
    }


def _strip(summary: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in summary.items() if k != "per_episode"} | {"per_episode": summary["per_episode"]}


def disagreements(before: Sequence[EpisodeResult], after: Sequence[EpisodeResult], before_label: str, after_label: str) -> list[dict[str, Any]]:
    """Episodes where exactly one side succeeded, with both transcripts (first ones first)."""
    rows = []
    for a, b in zip(before, after):
        if a.success != b.success:
            rows.append({"seed": a.seed, "task_id": a.task_id, before_label: episode_view(a), after_label: episode_view(b)})
    return rows[:MAX_DISAGREEMENTS]


def episode_view(result: EpisodeResult) -> dict[str, Any]:
    """What a report shows of one episode: messages, critiques, outcome, the first failing step."""
    steps = [c["step"] for c in result.critiques]
    return {
        "success": result.success,
        "reward": result.reward,
        "messages": result.conversation.messages,
        "critiques": result.critiques,
        "first_failing_step": min(steps) if steps and not result.success else None,
    }
