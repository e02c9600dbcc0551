"""Critique-GRPO refinements (arXiv 2506.03106, section 3) for multi-turn tool use.

When every attempt at a task failed, each failure's critique goes into a refinement prompt;
the current policy retries in a fresh env with the same seed (so the refinement is verified
like any attempt, tool calls included); up to k refinements are kept, correct ones first; their
tokens are re-based onto the original prompt, so training never sees the critique.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from cgym.trainer.rollout import Trajectory

__all__ = ["rebase", "sample_subset", "select_refinements", "should_refine"]


def should_refine(group: Sequence[Trajectory], fail_fraction: float) -> bool:
    """Refine a group when at least `fail_fraction` of its attempts failed (1.0: all failed)."""
    failed = sum(not t.success for t in group)
    return failed > 0 and failed / len(group) >= fail_fraction


def rebase(refined: Trajectory, prompt_ids: Sequence[int]) -> Trajectory:
    """Move a refinement's response onto the original prompt's ids, token for token.

    Everything after the refinement prompt (sampled turns and env replies) is kept as sampled;
    the refinement prompt, with the critique and the previous attempt, is dropped.
    """
    assert refined.result is not None
    start = refined.result.conversation.prompt_len
    n = len(prompt_ids)
    return Trajectory(
        ids=list(prompt_ids) + refined.ids[start:],
        mask=[0] * n + refined.mask[start:],
        logprobs=[0.0] * n + refined.logprobs[start:],
        reward=refined.reward,
        success=refined.success,
        group=refined.group,
        truncated=refined.truncated,
        refined=True,
        result=refined.result,
    )


def select_refinements(candidates: Sequence[Trajectory], k: int, rng: np.random.Generator) -> list[Trajectory]:
    """Up to k refinements: correct ones first (sampled if more than k), then sampled others."""
    correct = [t for t in candidates if t.success]
    wrong = [t for t in candidates if not t.success]
    chosen = sample_subset(correct, k, rng)
    return chosen + sample_subset(wrong, k - len(chosen), rng)


def sample_subset(items: list[Trajectory], k: int, rng: np.random.Generator) -> list[Trajectory]:
    """Up to k items, drawn without replacement, in their original order."""
    if k <= 0 or not items:
        return []
    if len(items) <= k:
        return list(items)
    return [items[i] for i in sorted(rng.choice(len(items), size=k, replace=False))]
