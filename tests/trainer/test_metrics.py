"""The reward-hacking monitor: top-quartile failures, and failures paid like successes."""

from __future__ import annotations

import pytest
from cgym.trainer.metrics import HackingMonitor, failed_outscoring, top_quartile_failed
from cgym.trainer.rollout import Trajectory


def traj(reward: float, success: bool) -> Trajectory:
    return Trajectory([1], [1], [0.0], reward, success, group=0, truncated=False)


# rare successes, near misses fill the top quartile, but the gate keeps them below every success
GATED = [traj(4.0, True)] + [traj(2.8, False)] * 5 + [traj(2.2, False)] * 2
# a failure scores as high as a success: the rubric pays a wrong answer
HACKED = [traj(4.0, True), traj(4.5, False), traj(4.5, False), traj(1.0, False)]


def test_top_quartile_failed_counts_the_top_quarter() -> None:
    assert top_quartile_failed(GATED) == pytest.approx(5 / 6)
    assert top_quartile_failed(HACKED) == pytest.approx(1.0)
    assert top_quartile_failed([traj(1.0, True)] * 4) == 0.0
    assert top_quartile_failed([]) == 0.0


def test_failed_outscoring_needs_both_outcomes() -> None:
    assert failed_outscoring(GATED) == 0.0
    assert failed_outscoring(HACKED) == pytest.approx(2 / 3)
    assert failed_outscoring([traj(3.0, False)] * 3) == 0.0
    assert failed_outscoring([traj(3.0, True)] * 3) == 0.0


def test_monitor_warns_after_patience_only_when_failures_are_paid_like_successes() -> None:
    monitor = HackingMonitor(threshold=0.5, patience=3)
    for _ in range(10):  # the quickstart's situation: a top quartile of near misses, gated
        assert monitor.update(top_quartile_failed(GATED), failed_outscoring(GATED)) is None
    shares = (top_quartile_failed(HACKED), failed_outscoring(HACKED))
    assert monitor.update(*shares) is None and monitor.update(*shares) is None
    with pytest.warns(UserWarning, match="reward hacking"):
        assert "scored as high as a success" in monitor.update(*shares)
    assert monitor.update(top_quartile_failed(GATED), 0.0) is None  # the streak resets


def test_rolling_mean_averages_what_it_has() -> None:
    from cgym.trainer.metrics import rolling_mean

    assert rolling_mean([1.0, 2.0, 3.0, 4.0], 2) == [1.0, 1.5, 2.5, 3.5]
    assert rolling_mean([5.0], 10) == [5.0] and rolling_mean([], 3) == []


def test_step_bar_shows_generation_and_update_speeds() -> None:
    from cgym.agents.eval.progress import speeds

    row = {"tokens_per_s": 96.4, "train_tokens": 1000, "step_time_s": 30.0, "rollout_time_s": 20.0}
    assert speeds(row) == "gen 96 tok/s train 100 tok/s"
    assert speeds({"tokens_per_s": 50.0}) == "gen 50 tok/s"  # no update this step


def test_peak_rss_is_a_high_water_mark_in_gib() -> None:
    from cgym.trainer.metrics import peak_rss_gb

    before = peak_rss_gb()
    block = bytearray(64 * 2**20)  # touch 64 MiB
    block[:: 4096] = b"x" * len(block[:: 4096])
    after = peak_rss_gb()
    assert 0.01 < before <= after < 1024
    del block
    assert peak_rss_gb() >= after
