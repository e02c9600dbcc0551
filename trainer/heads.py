"""The shared head of a training batch: the leading ids every row shares, run once an optimizer step."""

from __future__ import annotations

import torch
from cgym.agents.local.precision import autocast
from cgym.agents.local.sampling import MIN_SHARED_PREFIX, SharedHead, shared_head, shared_prefix_len
from cgym.trainer.recompute import recomputed_past_budget
from torch import Tensor


def batch_head(model: torch.nn.Module, ids: Tensor, attention: Tensor, targets: Tensor) -> SharedHead | None:
    """The leading ids every row of (B, T) `ids` shares (system prompt, tool schemas), up to the
    first column (B, T-1) `targets` scores, as a `SharedHead` that every micro-batch reads:
    without it each micro-batch ran them again (on ApiReport easy, 39% of a GRPO step's training
    tokens). None when they are too few to pay. When the batch's widest row is recomputed, so
    is the head: its layers keep only their inputs until its backward pass (the head's
    activations would otherwise be most of what the update holds)."""
    length = shared_prefix_len(ids, attention)
    wanted = targets.bool().any(0).nonzero()
    length = min(length, int(wanted[0])) if wanted.numel() else length
    if length < MIN_SHARED_PREFIX:
        return None
    with autocast(model), recomputed_past_budget(model, ids.shape[1]):
        return shared_head(model, ids[0, :length])
