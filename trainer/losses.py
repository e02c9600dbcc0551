"""GRPO / Critique-GRPO math as pure tensor functions: advantages, KL, shaped ratio, policy loss.

References: GRPO (DeepSeekMath, arXiv 2402.03300), DAPO (arXiv 2503.14476), Dr. GRPO
(arXiv 2503.20783), Critique-GRPO (arXiv 2506.03106), k3 (Schulman, "Approximating KL divergence").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from cgym.envs.errors import ConfigError, did_you_mean
from cgym.trainer.config import ADVANTAGE_SCALES, LOSS_TYPES, AdvantageScale, LossType
from torch import Tensor


def _check_choice(value: str, choices: tuple[str, ...], what: str) -> None:
    if value not in choices:
        raise ConfigError(f"unknown {what} {value!r}; valid choices: {', '.join(choices)}.{did_you_mean(value, choices)}")


def check_loss_type(loss_type: str) -> LossType:
    """Return `loss_type` if it is a valid `LossType`, else raise ConfigError (a ValueError) with a did-you-mean."""
    _check_choice(loss_type, LOSS_TYPES, "loss_type")
    return loss_type  # type: ignore[return-value]


def group_advantages(
    rewards: Tensor, group_size: int, scale: AdvantageScale = "group", eps: float = 1e-4
) -> Tensor:
    """(N,) rewards, group after group -> (N,) advantages (R - mean_group) / (std + eps).

    std is Bessel-corrected over the group ("group") or the batch ("batch"); "none" only centres.
    A one-sample group gets advantage 0. GRPO: DeepSeekMath (arXiv 2402.03300), sec. 4.1.2.
    """
    _check_choice(scale, ADVANTAGE_SCALES, "scale")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (N,), got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"group_size must be >= 1 and divide the number of rewards; "
            f"got {rewards.numel()} rewards and group_size={group_size}"
        )
    # float64 inside: with near-equal rewards, a float32 group mean is off by more than the spread
    # divided by the std allows (the centred advantages would no longer sum to zero).
    grouped = rewards.double().view(-1, group_size)  # (G, n)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale == "none":
        return centred.flatten().float()
    sample = grouped if scale == "group" else grouped.flatten()
    std = sample.std(dim=-1, keepdim=True) if sample.shape[-1] > 1 else grouped.new_ones(1)
    # One-sample and zero-variance groups centre to 0: divide by 1 so they stay 0 even at eps=0.
    std = torch.where(std > 0, std, 1.0)
    return (centred / (std.view(-1, 1) + eps)).flatten().float()


def unified_advantages(rewards: Tensor, groups: Tensor, scale: AdvantageScale = "group", eps: float = 1e-4) -> Tensor:
    """Advantages for groups of different sizes, one baseline per group: (R - mean_g) / (std_g + eps).

    `groups` (N,) holds each reward's group id. Critique-GRPO (arXiv 2506.03106, sec. 3.3) puts
    a task's initial attempts and its refinements in one group, so they share one baseline.
    """
    _check_choice(scale, ADVANTAGE_SCALES, "scale")
    rewards = rewards.double()  # as in group_advantages: float32 means drift on near-equal rewards
    out = torch.zeros_like(rewards)
    batch_std = rewards.std() if rewards.numel() > 1 else rewards.new_tensor(0.0)
    for g in torch.unique(groups):
        rows = groups == g
        group = rewards[rows]
        centred = group - group.mean()
        if scale == "none":
            out[rows] = centred
            continue
        std = (group.std() if group.numel() > 1 else group.new_tensor(0.0)) if scale == "group" else batch_std
        out[rows] = centred / ((std if std > 0 else 1.0) + eps)
    return out.float()


def rft_weights(success: Tensor) -> Tensor:
    """(N,) verified outcomes -> (N,) per-trajectory weights for rejection-sampling fine-tuning:
    1 for a success, 0 for a failure (the trainer drops failures before the loss).

    With the importance ratio at 1 on fresh samples, the policy loss then reduces to the negative
    log-likelihood of the policy's own successes: RAFT (arXiv 2504.11343), expert iteration
    (arXiv 2403.04642).
    """
    return success.float()


def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(pi || ref): exp(ref - logp) - (ref - logp) - 1, >= 0; shape kept.

    Schulman, "Approximating KL divergence" (2020); as used by GRPO (arXiv 2402.03300, eq. 4).
    """
    delta = ref_logp - logp
    return torch.exp(delta) - delta - 1


def shaped_ratio(logp: Tensor, gamma: float = 0.1) -> Tensor:
    """Critique-GRPO policy shaping p / (p + gamma), p = exp(logp); d/dp = gamma / (p + gamma)^2.

    Up-weights low-probability tokens of refinements. Critique-GRPO (arXiv 2506.03106), eq. 5.
    """
    if not gamma > 0:
        raise ValueError(f"gamma must be > 0, got {gamma}")
    p = torch.exp(logp)
    return p / (p + gamma)


# Each normaliser counts the full batch; each aggregator divides a micro-batch's sum by it.
_NORMALIZERS: dict[str, Callable[[Tensor, int | None], float]] = {
    "grpo": lambda mask, max_len: float(mask.shape[0]),  # sequences
    "bnpo": lambda mask, max_len: max(float(mask.sum()), 1.0),  # masked tokens
    "dapo": lambda mask, max_len: max(float(mask.sum()), 1.0),
    "dr_grpo": lambda mask, max_len: float(mask.shape[0] * max_len),  # B * L, a constant
}


def _sequence_means(loss: Tensor, mask: Tensor, normalizer: float) -> Tensor:
    return ((loss * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)).sum() / normalizer


def _token_sum(loss: Tensor, mask: Tensor, normalizer: float) -> Tensor:
    return (loss * mask).sum() / normalizer


_AGGREGATORS: dict[str, Callable[[Tensor, Tensor, float], Tensor]] = {
    "grpo": _sequence_means,  # GRPO, arXiv 2402.03300 eq. 3
    "bnpo": _token_sum,
    "dapo": _token_sum,  # DAPO token-level loss, arXiv 2503.14476 eq. 8
    "dr_grpo": _token_sum,  # Dr. GRPO, arXiv 2503.20783 eq. 4
}


def token_normalizer(
    mask: Tensor, loss_type: LossType, max_completion_length: int | None = None
) -> float:
    """(B, T) mask of the FULL batch -> the divisor `policy_loss` uses for `loss_type`.

    grpo: B sequences; bnpo/dapo: masked tokens (>= 1); dr_grpo: B * max_completion_length.
    Pass it as `policy_loss(..., normalizer=...)` to every micro-batch and sum their losses.
    """
    check_loss_type(loss_type)
    if loss_type == "dr_grpo" and max_completion_length is None:
        raise ValueError("loss_type='dr_grpo' needs max_completion_length")
    return max(_NORMALIZERS[loss_type](mask, max_completion_length), 1.0)


def _masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    return ((values * mask).sum() / mask.sum().clamp(min=1)).detach()


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    loss_type: LossType = "dapo",
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    max_completion_length: int | None = None,
    ref_logp: Tensor | None = None,
    beta: float = 0.0,
    shaped: Tensor | None = None,
    gamma: float = 0.1,
    normalizer: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """(B, T) log-probs, (B,) or (B, T) advantages, (B, T) mask -> scalar clipped-surrogate loss, metrics.

    Rows with `shaped[b]` (refinements) use -shaped_ratio(logp) * A, unclipped, old_logp ignored
    (Critique-GRPO, arXiv 2506.03106 eq. 5); others -min(r A, clip(r) A), r = exp(logp - old_logp)
    (GRPO arXiv 2402.03300, DAPO arXiv 2503.14476 for eps_low/eps_high). `beta` > 0 adds k3 KL.
    Aggregation follows `loss_type` and divides by `normalizer` (default: this batch's
    `token_normalizer`). For gradient accumulation pass the full batch's `token_normalizer` to
    every micro-batch: the sum of micro-batch losses then equals the full-batch loss exactly.
    Metrics (detached): clip_frac_low/high and ratio_mean over masked unshaped tokens, kl.
    """
    check_loss_type(loss_type)
    if beta > 0 and ref_logp is None:
        raise ValueError("beta > 0 needs ref_logp")
    if loss_type == "dr_grpo" and max_completion_length is None:
        raise ValueError("loss_type='dr_grpo' needs max_completion_length")
    assert logp.shape == old_logp.shape == mask.shape and advantages.shape in (logp.shape[:1], logp.shape)
    mask = mask.to(logp.dtype)
    if normalizer is None:
        normalizer = token_normalizer(mask, loss_type, max_completion_length)
    adv = advantages.to(logp.dtype) if advantages.dim() == 2 else advantages.to(logp.dtype).unsqueeze(1)  # (B, T) or (B, 1)
    if shaped is None:
        shaped = torch.zeros(logp.shape[0], dtype=torch.bool, device=logp.device)
    shaped_tok = shaped.bool().unsqueeze(1).expand_as(logp)  # (B, T)

    # A shaped row's old log-probs came from another prompt: neutralise them (r = 1) so they
    # cannot overflow exp and poison gradients through the unselected branch.
    old_logp = torch.where(shaped_tok, logp.detach(), old_logp)
    ratio = torch.exp(logp - old_logp)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    per_token = -torch.minimum(ratio * adv, clipped * adv)
    per_token = torch.where(shaped_tok, -shaped_ratio(logp, gamma) * adv, per_token)
    kl = kl_k3(logp, ref_logp) if ref_logp is not None else torch.zeros_like(logp)
    if beta > 0:
        per_token = per_token + beta * kl

    loss = _AGGREGATORS[loss_type](per_token, mask, normalizer)
    # The clipped branch is active when r left the trust region on the side A pushes it to.
    unshaped = mask * (~shaped_tok).to(mask.dtype)
    clipped_low = ((ratio < 1 - epsilon_low) & (adv < 0)).to(mask.dtype)
    clipped_high = ((ratio > 1 + epsilon_high) & (adv > 0)).to(mask.dtype)
    metrics = {
        "clip_frac_low": _masked_mean(clipped_low, unshaped),
        "clip_frac_high": _masked_mean(clipped_high, unshaped),
        "kl": _masked_mean(kl, mask),
        "ratio_mean": _masked_mean(ratio, unshaped),
    }
    return loss, metrics


def discounted_returns(rewards: Sequence[float], gamma: float) -> list[float]:
    """G_t = r_t + gamma * G_{t+1}: each turn's return to the end of its episode."""
    returns: list[float] = []
    running = 0.0
    for reward in reversed(rewards):
        running = reward + gamma * running
        returns.append(running)
    return returns[::-1]


def turn_advantages(
    episode_advantages: Sequence[float], turn_rewards: Sequence[Sequence[float]], groups: Sequence[int], *, gamma: float, weight: float, eps: float = 1e-6
) -> list[list[float]]:
    """Per-turn advantages: each episode's group-relative advantage plus `weight` times its turn's
    discounted return-to-go, standardised over every turn of the group pooled together.

    The turn term is REINFORCE on per-turn rewards with return batch normalisation (GEM, arXiv
    2510.01051), pooled within the group rather than per turn index: a per-index baseline compares
    turn t of an episode only with the episodes that lasted t turns, so when the policy decides
    when to stop, which episodes share a baseline depends on its actions (the bias verl's per-turn
    RFC points out). The pooled mean and std depend on no single turn's position. A group whose turn
    returns are all equal adds nothing; an episode without turn rewards keeps its own advantage
    (the caller spreads it over its tokens).
    """
    returns = [discounted_returns(r, gamma) for r in turn_rewards]
    pooled: dict[int, list[float]] = {}
    for group, values in zip(groups, returns):
        pooled.setdefault(group, []).extend(values)
    stats = {g: (float(np.mean(v)), float(np.std(v))) for g, v in pooled.items() if v}
    out: list[list[float]] = []
    for advantage, group, values in zip(episode_advantages, groups, returns):
        mean, std = stats.get(group, (0.0, 0.0))
        out.append([advantage + (weight * (g - mean) / (std + eps) if std > eps else 0.0) for g in values])
    return out
