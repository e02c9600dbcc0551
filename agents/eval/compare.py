"""Compare policies on the same episodes: prompt-only vs guarded vs trained, side by side."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from cgym.agents.base import Policy
from cgym.agents.eval.episodes import EpisodeResult
from cgym.agents.eval.evaluate import EvalConfig, evaluate
from cgym.agents.eval.paired import PairedDifference, paired_difference

MAX_DISAGREEMENTS = 40


Arm = Policy | Callable[[], Policy]
"""A policy, or a function that loads one: a loaded arm is dropped once evaluated, so a
comparison of local models holds one of them at a time."""


def compare(arms: Sequence[tuple[str, Arm]], config: EvalConfig, *, on_arm: Callable[[str], Any] | None = None) -> dict[str, Any]:
    """Evaluate every arm on the same seeds; `before`/`after` are the first and last arms.

    `disagreements` lists episodes (by seed) where the first and last arm differ in success,
    with both transcripts and their critiques (the first MAX_DISAGREEMENTS); `paired` holds every
    arm's paired difference in success against the first arm, counted over all episodes.
    """
    if len(arms) < 2:
        raise ValueError("compare needs at least two policies (e.g. --before and --after)")
    summaries: dict[str, dict[str, Any]] = {}
    results: dict[str, list[EpisodeResult]] = {}
    for label, arm in arms:
        if on_arm:
            on_arm(label)
        summaries[label], results[label] = evaluate(arm if isinstance(arm, Policy) else arm(), config)
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
        "differing": sum(a.success != b.success for a, b in zip(results[first], results[last])),
        "paired": {label: paired_arms(summaries[first], summaries[label]).to_dict() for label, _ in arms[1:]},
    }


def paired_arms(before: dict[str, Any], after: dict[str, Any]) -> PairedDifference:
    """`after - before` in success over the same episodes (two arms' eval summaries), with its
    bootstrap interval."""
    a, b = before["per_episode"], after["per_episode"]
    if [e["seed"] for e in a] != [e["seed"] for e in b]:
        raise ValueError("the two arms were not evaluated on the same episodes")
    return paired_difference([float(e["success"]) for e in a], [float(e["success"]) for e in b])


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
