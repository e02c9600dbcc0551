"""Benchmark a policy on an env: success, reward per check, critique codes, pass@k."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from math import comb
from typing import Any

from cgym.agents.base import Policy
from cgym.agents.eval.episodes import EpisodeResult, run_episodes
from cgym.envs.errors import ConfigError
from cgym.envs.registration import make


@dataclass(frozen=True)
class EvalConfig:
    """One evaluation: which env (and kwargs), how many episodes, which seeds."""

    env_id: str
    """The env to evaluate on."""
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    """Env kwargs as JSON (difficulty, faults, split, ...)."""
    episodes: int = 100
    """Tasks to run (each `samples` times)."""
    seed: int = 0
    """The first task seed; task i gets seed + i."""
    samples: int = 1
    """Tries per task, for pass@k."""
    batch_size: int = 128
    """Episodes run at once (a finished one's place goes to the next): larger batches feed the
    matmuls better, and 100 episodes in one batch took 76 s against 94 s in batches of 64."""
    workers: int = 1
    """Threads stepping the batch's envs (pays when tools wait on I/O; 1: inline)."""
    task_ids: tuple[str, ...] = ()
    """These tasks, each once (times `samples`), instead of `episodes` seeds (`cgym eval --tasks`)."""

    def __post_init__(self) -> None:
        for name in ("episodes", "samples", "batch_size", "workers"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.seed < 0:
            raise ConfigError(f"seed must be >= 0, got {self.seed}")

    @property
    def seeds(self) -> list[int]:
        """Task seeds: each repeated `samples` times, so pass@k sees k tries per task."""
        count = len(self.task_ids) if self.task_ids else self.episodes
        return [self.seed + i for i in range(count) for _ in range(self.samples)]

    def options_for(self, index: int) -> dict[str, Any] | None:
        """The reset options of the `index`-th episode: its task id when `task_ids` are given."""
        return {"task_id": self.task_ids[index // self.samples]} if self.task_ids else None


def evaluate(policy: Policy, config: EvalConfig, *, on_done: Callable[[EpisodeResult], None] | None = None) -> tuple[dict[str, Any], list[EpisodeResult]]:
    """Run the episodes and return the DESIGN.md eval summary plus the raw results."""
    start = time.perf_counter()
    cuts = getattr(policy, "context_cuts", None)  # a local model's turns not sampled: context full
    options_for = config.options_for if config.task_ids else None
    results = run_episodes(lambda: make(config.env_id, **config.env_kwargs), policy, config.seeds, batch_size=config.batch_size, on_done=on_done, workers=config.workers, options_for=options_for)
    summary = summarize(results, samples=config.samples)
    summary.update(env=config.env_id, env_kwargs=config.env_kwargs, policy=getattr(policy, "name", type(policy).__name__), seed=config.seed, wall_s=round(time.perf_counter() - start, 3))
    if cuts is not None:
        summary["context_cuts"] = policy.context_cuts - cuts
    return summary, results


def summarize(results: Sequence[EpisodeResult], *, samples: int = 1) -> dict[str, Any]:
    """Aggregate episode results (grouped by `samples` consecutive tries per task)."""
    n = len(results)
    checks = sorted({name for r in results for name in r.breakdown})
    codes = Counter(code for r in results for code in r.codes)
    summary: dict[str, Any] = {
        "episodes": n,
        "success_rate": sum(r.success for r in results) / n,
        "mean_reward": sum(r.reward for r in results) / n,
        "reward_breakdown": {c: sum(r.breakdown.get(c, 0.0) for r in results) / n for c in checks},
        "check_pass_rates": check_pass_rates(results),
        "critique_codes": dict(codes.most_common()),
        "truncated_rate": sum(r.truncated for r in results) / n,
        "mean_turns": sum(len(r.turns) for r in results) / n,
        "mean_sampled_tokens": sum(r.sampled_tokens for r in results) / n,
        "per_episode": [r.summary() for r in results],
    }
    if samples > 1:
        groups = [results[i : i + samples] for i in range(0, n, samples)]
        summary[f"pass@{samples}"] = sum(pass_at_k(len(g), sum(r.success for r in g), samples) for g in groups) / len(groups)
        summary["pass@1"] = sum(pass_at_k(len(g), sum(r.success for r in g), 1) for g in groups) / len(groups)
        summary[f"pass^{samples}"] = sum(pass_hat_k(len(g), sum(r.success for r in g), samples) for g in groups) / len(groups)
    return summary


def check_pass_rates(results: Sequence[EpisodeResult]) -> dict[str, float]:
    """Share of episodes in which each check passed."""
    names = sorted({name for r in results for name in r.passed})
    return {name: sum(r.passed.get(name, False) for r in results) / len(results) for name in names}


def pass_hat_k(n: int, c: int, k: int) -> float:
    """pass^k, tau-bench's consistency measure: the chance that k of the n tries, drawn without
    replacement, all succeed (C(c, k) / C(n, k)); 1 for a task solved every time."""
    return comb(c, k) / comb(n, k)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n tries with c successes (Chen et al., 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)
