"""Rollouts as token-exact trajectories, and their packing into padded tensors."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch
from cgym.agents.eval.episodes import EpisodeResult
from cgym.agents.local.precision import compute_dtype
from cgym.agents.local.prefix_tree import tree_size
from cgym.agents.local.sampling import MIN_SHARED_PREFIX, common_prefix_len
from torch import Tensor


@dataclass
class Trajectory:
    """One episode as the trainer sees it: ids, which were sampled, their sampling log-probs.

    `refined` marks Critique-GRPO refinements (trained with the shaped ratio); `group` is the
    index of the task the trajectory belongs to in this step.
    """

    ids: list[int]
    mask: list[int]
    logprobs: list[float]
    reward: float
    success: bool
    group: int
    truncated: bool
    refined: bool = False
    result: EpisodeResult | None = None

    @classmethod
    def from_result(cls, result: EpisodeResult, group: int, *, refined: bool = False) -> Trajectory:
        conv = result.conversation
        assert len(conv.token_ids) == len(conv.loss_mask) == len(conv.logprobs), "ledger out of sync"
        cut = any(turn.truncated for turn in result.turns)
        return cls(list(conv.token_ids), list(conv.loss_mask), list(conv.logprobs), result.reward, result.success, group, cut, refined, result)

    @property
    def sampled_tokens(self) -> int:
        return sum(self.mask)


@dataclass(frozen=True)
class Batch:
    """Right-padded tensors for a list of trajectories; targets are shifted by one.

    ids/attention: (B, T); mask/old_logp: (B, T-1) aligned with `sequence_logprobs` output.
    """

    ids: Tensor
    attention: Tensor
    mask: Tensor
    old_logp: Tensor
    advantages: Tensor
    shaped: Tensor

    def to(self, device: torch.device | str) -> Batch:
        """The same batch on `device` (itself when it is there already)."""
        if self.ids.device == torch.device(device):
            return self
        return Batch(*(getattr(self, f.name).to(device) for f in fields(self)))


def spread_over_tokens(mask: Sequence[int], turn_lengths: Sequence[int], per_turn: Sequence[float]) -> list[float] | None:
    """Each sampled token's turn value, in ledger order: the first `turn_lengths[0]` sampled
    tokens (mask 1) are turn 0's, and so on; unsampled positions get 0. None when the ledger and
    the turns disagree (the caller then keeps the episode's advantage)."""
    if len(turn_lengths) != len(per_turn) or sum(turn_lengths) != sum(mask):
        return None
    owners = [turn for turn, length in enumerate(turn_lengths) for _ in range(length)]
    values = [0.0] * len(mask)
    sampled = (i for i, m in enumerate(mask) if m)
    for position, owner in zip(sampled, owners):
        values[position] = float(per_turn[owner])
    return values


def pack(trajectories: Sequence[Trajectory], advantages: Tensor, *, pad_id: int, token_advantages: Sequence[Sequence[float] | None] | None = None) -> Batch:
    """Pad trajectories into one batch (CPU tensors). With `token_advantages` (a value per
    position, or None to spread the row's own advantage), `Batch.advantages` is per token."""
    width = max(len(t.ids) for t in trajectories)
    B = len(trajectories)
    ids = torch.full((B, width), pad_id, dtype=torch.long)
    attention = torch.zeros((B, width), dtype=torch.long)
    mask = torch.zeros((B, width), dtype=torch.float32)
    logp = torch.zeros((B, width), dtype=torch.float32)
    for row, t in enumerate(trajectories):
        n = len(t.ids)
        ids[row, :n] = torch.tensor(t.ids)
        attention[row, :n] = 1
        mask[row, :n] = torch.tensor(t.mask, dtype=torch.float32)
        logp[row, :n] = torch.tensor(t.logprobs, dtype=torch.float32)
    shaped = torch.tensor([t.refined for t in trajectories], dtype=torch.bool)
    if token_advantages is not None:
        per_token = advantages.to(torch.float32).unsqueeze(1).repeat(1, width)
        for row, values in enumerate(token_advantages):
            if values is not None:
                per_token[row, : len(values)] = torch.tensor(values, dtype=torch.float32)
        advantages = per_token[:, 1:]  # aligned with the shifted targets, like mask and old_logp
    return Batch(ids, attention, mask[:, 1:], logp[:, 1:], advantages, shaped)


ATTENTION_BUDGET = 3 * 1024**2  # rows x width^2 per micro-batch: the attention a backward pass keeps
TOKEN_BUDGET = 2048  # rows x width per micro-batch: the activations a backward pass keeps


def tree_budget(model: torch.nn.Module) -> int:
    """Prefix-tree nodes per micro-batch of `model`'s loss pass: `TOKEN_BUDGET` where it keeps
    bf16 activations (bf16 autocast, or a bf16 model), half where they are fp32 (a CPU without
    native bf16), so a micro-batch holds the same bytes. On a 2-core Ice Lake an ApiReport
    medium step peaked at 7.35 GiB with 2,048 fp32 nodes and 4.82 GiB with 1,024."""
    param = next(model.parameters(), None)
    if param is None:
        return TOKEN_BUDGET
    dtype = param.dtype if param.dtype != torch.float32 else compute_dtype(param.device)
    return TOKEN_BUDGET if dtype.itemsize <= 2 else TOKEN_BUDGET // 2


def rows_within_budget(width: int, most: int) -> int:
    """Rows per micro-batch for sequences of `width` tokens: at most `most`, fewer for long ones.
    The attention weights kept for the backward pass grow with rows x width^2 (SmolLM2 on
    1,400-token medium demos held 11.5 GB at 4 rows), the other activations with rows x width:
    ~1.3 MB a token for SmolLM2-135M in fp32 (30 layers of ~11,000 numbers), so 4 rows of 900
    tokens held ~4.7 GB and `TOKEN_BUDGET` tokens hold ~2.7 GB. Rows of 2,048 tokens still make
    a matmul tall enough to run at full speed."""
    width = max(width, 1)
    return max(1, min(most, ATTENTION_BUDGET // width**2, TOKEN_BUDGET // width))


def micro_batches(lengths: Sequence[int], most: int) -> list[list[int]]:
    """Row indices in micro-batches, longest rows first: each takes `rows_within_budget` rows of its
    longest's width, so rows of like length share one (little padding) and long rows go few at a time."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    chunks: list[list[int]] = []
    while order:
        take = rows_within_budget(lengths[order[0]], most)
        chunks.append(order[:take])
        order = order[take:]
    return chunks


def group_micro_batches(ids: Sequence[Sequence[int]], groups: Sequence[int], most: int) -> list[list[int]]:
    """`micro_batches`, or micro-batches that keep each group's rows together where that runs
    fewer columns (`loss_pass_columns`). A GRPO group's rows share their task prompt, and often
    their first turns, which the loss pass runs once per micro-batch (`sequence_logprobs`); rows
    sorted by length across groups pad less but share only the system prompt."""
    by_length = micro_batches([len(row) for row in ids], most)
    by_group = [[rows[i] for i in chunk] for rows in group_rows(groups).values() for chunk in micro_batches([len(ids[row]) for row in rows], most)]
    return min(by_length, by_group, key=lambda plan: loss_pass_columns(ids, plan))


def tree_micro_batches(ids: Sequence[Sequence[int]], groups: Sequence[int], budget: int = TOKEN_BUDGET) -> list[list[int]]:
    """Row indices in micro-batches for the prefix-tree loss pass (`agents.local.prefix_tree`):
    a group's rows, which share the most, in sorted order (neighbours share the most), cut where
    the tree past the batch's shared head would outgrow `budget` nodes (a longer row alone).
    Groups never share a micro-batch, so a rank of a distributed run, which holds whole groups,
    runs the micro-batches one process would, and gets its gradients to the bit."""
    head = common_prefix_len(ids) if len(ids) > 1 else 0
    chunks: list[list[int]] = []
    for rows in group_rows(groups).values():
        chunk: list[int] = []
        for row in sorted(rows, key=lambda r: list(ids[r])):
            if chunk and tree_size([ids[r][head:] for r in (*chunk, row)]) > budget:
                chunks.append(chunk)
                chunk = []
            chunk.append(row)
        chunks.append(chunk)
    return chunks


def group_rows(groups: Sequence[int]) -> dict[int, list[int]]:
    """Each group's row indices, groups in order of first appearance."""
    members: dict[int, list[int]] = {}
    for row, group in enumerate(groups):
        members.setdefault(group, []).append(row)
    return members


def loss_pass_columns(ids: Sequence[Sequence[int]], plan: Sequence[Sequence[int]]) -> int:
    """Columns a loss pass over `plan`'s micro-batches runs after the head all rows share: the
    columns a micro-batch's rows share after it once (where there are `MIN_SHARED_PREFIX` of
    them), then each row's columns after those, padded to its micro-batch's longest row."""
    head = common_prefix_len(ids) if len(ids) > 1 else 0
    total = 0
    for chunk in plan:
        rows = [ids[row] for row in chunk]
        shared = common_prefix_len(rows) if len(rows) > 1 else head
        shared = shared if shared - head >= MIN_SHARED_PREFIX else head
        total += shared - head + len(rows) * (max(len(row) for row in rows) - shared)
    return total


def rows_with_signal(batch: Batch, *, with_kl: bool = False) -> list[int]:
    """Indices of the rows whose policy loss has a gradient: those with a sampled token of nonzero
    advantage, or every row when a KL term (`with_kl`) pulls on all sampled tokens."""
    if with_kl:
        return list(range(batch.ids.shape[0]))
    advantages = batch.advantages if batch.advantages.dim() == 2 else batch.advantages[:, None].expand_as(batch.mask)
    return ((advantages != 0) & batch.mask.bool()).any(1).nonzero().squeeze(1).tolist()


def slice_batch(batch: Batch, rows: slice | Sequence[int]) -> Batch:
    """A micro-batch (a slice or a list of row indices), trimmed to its own longest row."""
    rows = rows if isinstance(rows, slice) else torch.as_tensor(rows, dtype=torch.long)
    width = int(batch.attention[rows].sum(-1).max())
    return Batch(
        batch.ids[rows, :width],
        batch.attention[rows, :width],
        batch.mask[rows, : width - 1],
        batch.old_logp[rows, : width - 1],
        batch.advantages[rows, : width - 1] if batch.advantages.dim() == 2 else batch.advantages[rows],
        batch.shaped[rows],
    )
