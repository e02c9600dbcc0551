"""Packing trajectories into micro-batches."""

from __future__ import annotations

import pytest
import torch
from cgym.trainer.rollout import (
    ATTENTION_BUDGET,
    TOKEN_BUDGET,
    Trajectory,
    group_micro_batches,
    loss_pass_columns,
    micro_batches,
    pack,
    rows_with_signal,
    rows_within_budget,
    slice_batch,
)


@pytest.mark.parametrize(
    "lengths,most,expected",
    [
        ([10, 30, 20, 30], 2, [[1, 3], [2, 0]]),  # longest first, ties in row order
        ([100] * 5, 4, [[0, 1, 2, 3], [4]]),
        ([2000, 900, 800, 100], 4, [[0], [1, 2], [3]]),  # 2,000 tokens: one row (4 x 2000^2 passes the budget); 900: two (2 x 900 tokens)
        ([500] * 5, 4, [[0, 1, 2, 3], [4]]),  # 4 x 500 tokens: within both budgets
        ([], 4, []),
    ],
)
def test_micro_batches_take_every_row_once_longest_first(lengths: list[int], most: int, expected: list[list[int]]) -> None:
    chunks = micro_batches(lengths, most)
    assert chunks == expected
    assert sorted(i for chunk in chunks for i in chunk) == list(range(len(lengths)))
    for chunk in chunks:
        width = max(lengths[i] for i in chunk)
        assert len(chunk) <= rows_within_budget(width, most)
        assert len(chunk) == 1 or (len(chunk) * width**2 <= ATTENTION_BUDGET and len(chunk) * width <= TOKEN_BUDGET)


def _grouped_rows(past_head: int, tails: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """Rows of a 50-id head, then per group `past_head` ids its rows share, then each row's own tail."""
    head = list(range(1000, 1050))
    ids, groups = [], []
    for group, lengths in enumerate(tails):
        task = [2000 + 100 * group + i for i in range(past_head)]
        for row, n in enumerate(lengths):
            ids.append(head + task + [3000 + 50 * row + i for i in range(n)])
            groups.append(group)
    return ids, groups


def test_rows_of_a_group_share_micro_batches_where_that_runs_fewer_columns() -> None:
    # each group's rows share 80 ids past the head; lengths interleave across the two groups
    ids, groups = _grouped_rows(80, [[10, 40, 70, 100], [20, 50, 80, 110]])
    plan = group_micro_batches(ids, groups, most=4)
    assert sorted(row for chunk in plan for row in chunk) == list(range(8))
    assert all(len({groups[row] for row in chunk}) == 1 for chunk in plan)  # no micro-batch mixes groups
    by_length = micro_batches([len(row) for row in ids], 4)
    assert loss_pass_columns(ids, plan) < loss_pass_columns(ids, by_length)
    # group 0 alone: 80 shared columns once, then 4 rows padded to the longest tail (100)
    assert loss_pass_columns(ids, [[0, 1, 2, 3]]) == 80 + 4 * 100
    # a micro-batch mixing the groups shares nothing past the head
    assert loss_pass_columns(ids, [[0, 4]]) == 2 * (80 + 20)


def test_rows_sharing_too_little_past_the_head_stay_in_length_order() -> None:
    ids, groups = _grouped_rows(8, [[10, 40, 70, 100], [20, 50, 80, 110]])  # 8 < MIN_SHARED_PREFIX
    assert group_micro_batches(ids, groups, most=4) == micro_batches([len(row) for row in ids], 4)


def test_a_micro_batch_of_listed_rows_is_trimmed_to_its_longest() -> None:
    trajs = [Trajectory(ids=list(range(n)), mask=[0] + [1] * (n - 1), logprobs=[0.0] * n, reward=1.0, success=True, group=0, truncated=False) for n in (3, 9, 5)]
    batch = pack(trajs, torch.tensor([1.0, -1.0, 0.5]), pad_id=0)
    mb = slice_batch(batch, [2, 0])
    assert mb.ids.shape == (2, 5) and mb.mask.shape == (2, 4)
    assert mb.advantages.tolist() == [0.5, 1.0]


def _row(n: int, group: int) -> Trajectory:
    return Trajectory(ids=list(range(n)), mask=[0, 0] + [1] * (n - 2), logprobs=[0.0] * n, reward=0.0, success=False, group=group, truncated=False)


def test_rows_with_signal_are_those_with_a_nonzero_advantage_on_a_sampled_token() -> None:
    trajs = [_row(n, g) for n, g in ((6, 0), (4, 0), (5, 1), (6, 1))]
    per_row = pack(trajs, torch.tensor([0.0, 0.0, 1.5, -1.5]), pad_id=0)
    assert rows_with_signal(per_row) == [2, 3]
    assert rows_with_signal(per_row, with_kl=True) == [0, 1, 2, 3]  # the KL term pulls on every sampled token
    # Per token: row 0's only nonzero value sits on an unsampled position, row 1's on a sampled one.
    per_token = pack(trajs, torch.zeros(4), pad_id=0, token_advantages=[[0.7, 0, 0, 0, 0, 0], [0, 0, 0, 0.7], None, None])
    assert rows_with_signal(per_token) == [1]
    assert rows_with_signal(pack(trajs, torch.zeros(4), pad_id=0)) == []


def test_the_tree_budget_holds_the_same_bytes_of_fp32_activations(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32 activations are twice bf16's bytes: an fp32 loss pass (a CPU without native bf16)
    takes half the prefix-tree nodes a micro-batch, a bf16 one (autocast or a bf16 model) all."""
    from cgym.agents.local.precision import DTYPE_ENV
    from cgym.trainer.rollout import TOKEN_BUDGET, tree_budget

    model = torch.nn.Linear(4, 4)
    monkeypatch.setenv(DTYPE_ENV, "float32")
    assert tree_budget(model) == TOKEN_BUDGET // 2
    assert tree_budget(model.to(torch.bfloat16)) == TOKEN_BUDGET
    monkeypatch.setenv(DTYPE_ENV, "bfloat16")
    assert tree_budget(torch.nn.Linear(4, 4)) == TOKEN_BUDGET
