"""The rollout-shape counts: decode steps by schedule, and the loss pass's columns by plan."""

from __future__ import annotations

from cgym.benchmarks.rollout_shape import chained_steps, lockstep_steps, shape


def test_lockstep_waits_for_each_turns_longest_row_and_chained_for_the_longest_episode() -> None:
    turns = [[30, 90], [30, 10, 70], [20]]
    assert lockstep_steps(turns) == 30 + 90 + 70
    assert chained_steps(turns) == 30 + 90  # the first episode: 120 sampled ids
    assert lockstep_steps([]) == chained_steps([]) == 0


def test_shape_counts_a_groups_shared_columns_once() -> None:
    head = list(range(100, 130))
    ids, groups = [], []
    for group in range(2):
        task = [500 + 40 * group + i for i in range(40)]  # 40 ids a group's rows share past the head
        for row in range(4):
            ids.append(head + task + [900 + 10 * row + i for i in range(5 + row)])
            groups.append(group)
    turns = [[5 + row % 4] for row in range(8)]
    result = shape(turns, ids, groups, most=4)
    assert result["decode"]["lockstep_steps"] == result["decode"]["chained_steps"] == 8
    assert result["sampled_tokens"] == 2 * (5 + 6 + 7 + 8)
    loss = result["loss_pass"]
    assert loss["head_columns"] == 30
    assert loss["shared_past_head_by_group"] == {"0": 40, "1": 40}
    assert loss["plan_keeps_groups_together"]
    assert loss["columns_planned"] == 2 * (40 + 4 * 8) < loss["columns_by_length"]
    assert loss["tree_nodes"] == 2 * (40 + 5 + 6 + 7 + 8) < loss["columns_planned"]  # each row's own ids, no padding
    assert loss["micro_batches"]["trees"] == 2
