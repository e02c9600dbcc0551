"""Self-critique at inference: the policy critiques its own finished attempt, then refines once.

Only attempts whose self-critique ends in `incorrect [END]` are retried (in a fresh env with the
same seed); an unreadable critique leaves the attempt as it was.
"""

from __future__ import annotations

from typing import Any

from cgym.agents.base import Policy
from cgym.agents.critics import ModelCritic, parse_verdict, run_refinements
from cgym.agents.eval.episodes import EpisodeResult
from cgym.agents.eval.evaluate import EvalConfig, evaluate, summarize
from cgym.envs.registration import make


def evaluate_with_self_critique(policy: Policy, config: EvalConfig) -> dict[str, Any]:
    """Eval summary without and with one round of self-critique + refinement."""
    without, results = evaluate(policy, config)
    critiques = ModelCritic(policy).critique(results)
    retry = [(i, c) for i, c in enumerate(critiques) if c and parse_verdict(c) == "incorrect"]
    final: list[EpisodeResult] = list(results)
    attempts = [(results[index], critique) for index, critique in retry]
    refined = run_refinements(lambda: make(config.env_id, **config.env_kwargs), policy, attempts, batch_size=config.batch_size)
    for (index, _), result in zip(retry, refined):
        final[index] = result
    with_ = summarize(final, samples=config.samples)
    self_flagged = sum(1 for c in critiques if c and parse_verdict(c) == "incorrect")
    return {
        "without": without,
        "with_self_critique": with_ | {"refined_episodes": len(retry), "unreadable_critiques": sum(c is None for c in critiques)},
        "self_critique_flagged_incorrect": self_flagged,
        "self_critique_agreement": sum((parse_verdict(c) == "correct") == r.success for c, r in zip(critiques, results) if c) / max(1, sum(c is not None for c in critiques)),
    }
