"""Activation recomputation for rows too long to keep a loss pass's activations.

A training pass keeps what each decoder layer computed until the backward pass needs it: about
1.3 MB a token for SmolLM2-135M in fp32, so one 3,500-token ApiReport medium row held ~4.5 GB.
Under `recomputed_layers` each layer keeps only its input (~69 KB a token over SmolLM2's 30
layers) and runs again, one layer at a time, when the backward pass reaches it: one more forward
pass for those rows, and the same gradients. Caches the layers read must not grow when a layer
runs twice (`agents.local.kv_cache.ReadOnlyLayer`), which is how `sequence_logprobs` hands its
prefix and shared head to the rows.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from functools import partial

import torch
from cgym.agents.local.instances import replaced
from cgym.agents.local.kv_cache import attention_on_pairs, attention_pairs_on
from cgym.trainer.rollout import TOKEN_BUDGET
from torch.utils.checkpoint import checkpoint
from transformers.modeling_layers import GradientCheckpointingLayer


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """`model`'s decoder layers (through any wrapper, e.g. peft's): transformers' checkpointable layers."""
    return [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]


def _same_attention() -> tuple[AbstractContextManager[None], AbstractContextManager[None]]:
    """The forward as it runs, and its recomputation in the backward pass under the attention
    the forward had (`attention_on_pairs`, which autocast's own state does not carry)."""
    return nullcontext(), attention_on_pairs(attention_pairs_on())


@contextmanager
def recomputed_layers(model: torch.nn.Module) -> Iterator[int]:
    """Within the block, `model`'s decoder layers keep only their inputs for the backward pass and
    recompute the rest there. Yields how many layers that covers (0: none found, nothing changes)."""
    with replaced(decoder_layers(model), "forward", lambda layer: partial(checkpoint, layer.forward, use_reentrant=False, context_fn=_same_attention)) as count:
        yield count


def recomputed_past_budget(model: torch.nn.Module, tokens: int) -> AbstractContextManager[int | None]:
    """`recomputed_layers(model)` for a pass over more than `TOKEN_BUDGET` tokens (rows x width),
    a block that changes nothing otherwise. Micro-batches are sized within the budget, so a pass
    past it is one long row (or the shared head of a batch holding one)."""
    return recomputed_layers(model) if tokens > TOKEN_BUDGET else nullcontext()
