"""The Critique-GRPO benchmark's bookkeeping: the table (mean, spread, pool figures) and the plot."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from cgym.benchmarks.critique_vs_grpo import parse_arm, plot, summarize, task_split

RUNS = [
    {"arm": "grpo", "seed": 0, "before": 0.2, "after": 0.3, "curve": [(0.0, 0.2), (10.0, 0.3)], "pool_before": 0.1, "pool_after": 0.5},
    {"arm": "grpo", "seed": 1, "before": 0.2, "after": 0.5, "curve": [(0.0, 0.2), (12.0, 0.5)], "pool_before": 0.1, "pool_after": 0.7},
    {"arm": "critique_grpo_step", "seed": 0, "before": 0.2, "after": 0.6, "curve": [(0.0, 0.2), (9.0, 0.6)]},
]


def test_summary_gives_mean_spread_and_pool_figures_where_every_run_has_them() -> None:
    table = summarize(RUNS)
    assert table["grpo"]["final_mean"] == pytest.approx(0.4) and table["grpo"]["final_std"] == pytest.approx(0.1)
    assert table["grpo"]["final_sample_std"] == pytest.approx(0.1 * 2**0.5) and table["critique_grpo_step"]["final_sample_std"] is None
    assert table["grpo"]["pool_mean"] == pytest.approx(0.6) and table["grpo"]["pool_before"] == [0.1, 0.1]
    assert table["critique_grpo_step"]["finals"] == [0.6] and "pool_mean" not in table["critique_grpo_step"]


def test_plot_writes_a_png(tmp_path: Path) -> None:
    plot(RUNS, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_arm_option_reads_name_and_config_overrides_and_rejects_the_rest() -> None:
    assert parse_arm('lr_1e-3={"learning_rate": 0.001, "critique": "none"}') == ("lr_1e-3", {"learning_rate": 0.001, "critique": "none"})
    for bad in ("grpo", "grpo=", '={"steps": 3}', "grpo={steps: 3}", "grpo=[1]"):
        with pytest.raises(argparse.ArgumentTypeError, match="--arm"):
            parse_arm(bad)


def test_plot_draws_the_start_model_reference_lines(tmp_path: Path) -> None:
    plot(RUNS, tmp_path / "p.png", start={"greedy": 0.44, "pass@8": 0.75})
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_task_split_counts_tasks_solved_never_sometimes_always() -> None:
    tries = [False, False, False] + [True, False, True] + [True, True, True] + [False, True, False]
    assert task_split(tries, 3) == {"never": 1, "sometimes": 2, "always": 1}
    assert task_split([True, False], 1) == {"never": 1, "sometimes": 0, "always": 1}


def test_sft_arm_trains_for_the_budget_on_unseen_demos_and_reports_like_the_other_arms(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import cgym.agents.demos
    import cgym.benchmarks.critique_vs_grpo as bench
    import cgym.trainer.sft

    seen: dict = {}
    monkeypatch.setattr(cgym.agents.demos, "demonstrations", lambda env_id, kwargs, *, episodes, seed: seen.update(env=env_id, seed=seed) or ["demo"])
    monkeypatch.setattr(cgym.trainer.sft, "sft", lambda model, demos, out, **kw: seen.update(budget=kw["time_budget_s"]) or {"steps": 3, "seconds": 42.0, "tokens": 900})
    monkeypatch.setattr(bench, "test_success", lambda model, setting: {"success_rate": 0.5})
    setting = bench.Setting("m", "medium", 120.0, 0, 16, 8, 2, tmp_path, env_id=bench.ENVS["sql"])
    run = bench.run_sft_arm(1, setting, start=0.25)
    assert seen == {"env": "cgym/SqlQuery-v0", "seed": 101, "budget": 120.0}  # demo seeds no warm start used
    assert run["arm"] == bench.SFT_ARM and (run["before"], run["after"]) == (0.25, 0.5)
    assert run["curve"] == [(0.0, 0.25), (42.0, 0.5)]
    assert bench.summarize([run])[bench.SFT_ARM]["final_mean"] == 0.5
