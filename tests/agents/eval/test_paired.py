from __future__ import annotations

import math

import numpy as np
import pytest
from cgym.agents.eval.paired import paired_difference


def test_gains_and_losses_are_counted_in_full() -> None:
    before = [0.0] * 50 + [1.0] * 50
    after = [1.0] * 100  # half the episodes gained: sd of the difference 0.5, se 0.05
    d = paired_difference(before, after)
    assert d.mean == 0.5
    assert d.low == pytest.approx(0.5 - 1.96 * 0.05, abs=0.02) and d.high == pytest.approx(0.5 + 1.96 * 0.05, abs=0.02)
    assert d.gained == 50 and d.lost == 0 and d.differing == 50


def test_the_interval_matches_the_normal_approximation_on_a_known_case() -> None:
    """40 of 100 episodes gained, none lost: mean +0.40, standard error sqrt(0.4 * 0.6 / 100)."""
    before = np.zeros(100)
    after = np.r_[np.ones(40), np.zeros(60)]
    d = paired_difference(before, after, resamples=20_000)
    se = math.sqrt(0.4 * 0.6 / 100)
    assert d.mean == pytest.approx(0.4)
    assert d.low == pytest.approx(0.4 - 1.96 * se, abs=0.02)
    assert d.high == pytest.approx(0.4 + 1.96 * se, abs=0.02)
    assert d.points().startswith("+40.0 points [+3")


def test_no_difference_gives_an_interval_around_zero() -> None:
    rng = np.random.default_rng(1)
    before = rng.integers(0, 2, size=(3, 120))
    swap = rng.permutation(before.T).T  # the same success rate, paired at random
    d = paired_difference(before, swap)
    assert d.low < 0 < d.high


def test_seeds_pool_and_their_spread_widens_the_interval() -> None:
    """Three seeds of which one gained a lot: pooled mean is the average, and the interval is
    wider than if every seed had the average gain."""
    before = np.zeros((3, 100))
    uneven = np.zeros((3, 100))
    uneven[0, :60] = 1
    even = np.zeros((3, 100))
    even[:, :20] = 1
    wide, narrow = paired_difference(before, uneven), paired_difference(before, even)
    assert wide.mean == pytest.approx(narrow.mean) == pytest.approx(0.2)
    assert wide.high - wide.low > 2 * (narrow.high - narrow.low)
    assert wide.seeds == 3 and wide.episodes == 100 and wide.gained == 60


@pytest.mark.parametrize(("before", "after"), [([1, 0], [1, 0, 1]), ([], []), ([[1, 0], [1, 1]], [1, 0])], ids=["unpaired", "empty", "shape"])
def test_unpaired_outcomes_are_refused(before: list, after: list) -> None:
    with pytest.raises(ValueError, match="episode"):
        paired_difference(before, after)
