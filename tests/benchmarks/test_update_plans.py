"""Switching a GRPO update's micro-batch plan for a timing, and putting it back."""

from __future__ import annotations

import pytest
from cgym.benchmarks import update_plans


def test_the_by_length_plan_is_swapped_in_for_the_block_and_the_default_comes_back() -> None:
    import cgym.trainer.grpo as grpo

    planner, logprobs = grpo.group_micro_batches, grpo.sequence_logprobs
    ids = [[1] * 20 + [2, 3], [1] * 20 + [2, 4, 5], [1] * 20 + [6]]
    with update_plans.plan("by_length"):
        assert grpo.group_micro_batches is update_plans.by_length
        assert grpo.group_micro_batches(ids, [0, 0, 1], 2) == [[1, 0], [2]]
    assert (grpo.group_micro_batches, grpo.sequence_logprobs) == (planner, logprobs)
    with update_plans.plan("grouped"):
        assert (grpo.group_micro_batches, grpo.sequence_logprobs) == (planner, logprobs)
    with pytest.raises(ValueError, match="unknown plan"), update_plans.plan("random"):
        pass
