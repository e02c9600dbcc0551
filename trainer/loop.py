"""The article's four-line GRPO loop, as public functions over the real machinery::

    responses = sample(policy, "cgym/ApiReport-v0", seed=7, n=5)
    scores = [reward_fn(r) for r in responses]
    advantages = group_normalize(scores)
    update_policy(policy, responses, advantages, optimizer)

`trainer.grpo` is the full loop (batching across tasks, Critique-GRPO, checkpoints, metrics).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from cgym.agents.eval.episodes import run_episodes
from cgym.agents.local.hf import HFPolicy
from cgym.agents.local.sampling import sequence_logprobs
from cgym.envs.registration import make
from cgym.trainer.finite import check_finite
from cgym.trainer.losses import LossType, group_advantages, policy_loss
from cgym.trainer.rollout import Trajectory, pack


def sample(policy: HFPolicy, env_id: str, *, seed: int, n: int = 5, **env_kwargs: Any) -> list[Trajectory]:
    """n multi-turn attempts at the task `seed` draws, sampled together, token-exact."""
    results = run_episodes(lambda: make(env_id, **env_kwargs), policy, [seed] * n, batch_size=n)
    return [Trajectory.from_result(r, group=0) for r in results]


def reward_fn(trajectory: Trajectory) -> float:
    """The env's verifiable episode reward (its rubric, with correctness gating)."""
    return trajectory.reward


def group_normalize(scores: Sequence[float]) -> torch.Tensor:
    """A_i = (R_i - mean) / std over the group."""
    return group_advantages(torch.tensor(scores, dtype=torch.float32), len(scores))


def update_policy(policy: HFPolicy, responses: Sequence[Trajectory], advantages: torch.Tensor, optimizer: torch.optim.Optimizer, *, loss_type: LossType = "dapo") -> float:
    """One clipped policy-gradient step on the sampled tokens; returns the loss.

    A NaN or inf loss or gradient raises `NonFiniteError` before the optimizer step.
    """
    batch = pack(responses, advantages, pad_id=policy.tokenizer.pad_token_id or 0)
    policy.model.train()
    logp = sequence_logprobs(policy.model, batch.ids, batch.attention, policy.params.temperature)
    loss, _ = policy_loss(logp, batch.old_logp, batch.advantages, batch.mask, loss_type=loss_type)
    check_finite("loss", loss.detach())
    loss.backward()
    check_finite("gradient norm", torch.nn.utils.clip_grad_norm_(policy.model.parameters(), float("inf")))  # the norm, unclipped
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    policy.model.eval()
    return loss.item()
