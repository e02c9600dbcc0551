from __future__ import annotations

import pytest
import torch
from cgym.benchmarks.trainer_vs_trl import BenchConfig, every_row_trained, run

pytest.importorskip("trl")
pytest.importorskip("datasets")

TINY = {"vocab_size": 600, "hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2}


@pytest.mark.slow
@pytest.mark.parametrize(("lora_r", "micro_batch"), [(0, 0), (2, 2)], ids=["every-weight", "lora-two-rows-a-pass"])
def test_tiny_run_reports_both_medians_and_ratio(lora_r: int, micro_batch: int) -> None:
    result = run(vs="trl", steps=2, sizes=TINY, demo_episodes=20, group_size=2, tasks_per_step=2, max_new_tokens=8, lora_r=lora_r, micro_batch=micro_batch)
    assert result["config"]["lora_r"] == lora_r and result["config"]["micro_batch"] == micro_batch
    for key in ("ours_step_s", "trl_step_s", "ratio", "ours_tokens_per_step", "trl_tokens_per_step", "peak_rss_gb"):
        assert result[key] > 0, key
    assert result["ratio"] == pytest.approx(result["ours_step_s"] / result["trl_step_s"], rel=1e-2)
    assert len(result["ours_steps_s"]) == len(result["trl_steps_s"]) == 2
    assert result["same_tasks"] and result["same_prompt_ids"]
    assert max(result["ours_tokens_per_step"], result["trl_tokens_per_step"]) <= 2 * 2 * 8
    assert result["ours_trained_rows"] == [4, 4], "TRL's loss pass runs every row: so must ours, for the same work"


@pytest.mark.parametrize("kw", [{"vs": "vllm"}, {"steps": 0}, {"lora_r": -1}, {"micro_batch": 3}], ids=["unknown-baseline", "no-steps", "negative-rank", "uneven-micro-batch"])
def test_bad_arguments_raise(kw: dict) -> None:
    with pytest.raises(ValueError):
        run(**kw)


def test_config_rejects_unknown_loss_type() -> None:
    with pytest.raises(ValueError, match="did you mean|Did you mean"):
        BenchConfig(loss_type="dapoo")


def test_every_row_trained_runs_rows_without_signal_then_restores_the_trainer() -> None:
    import cgym.trainer.grpo as grpo
    from cgym.trainer.rollout import Batch

    chosen = grpo.rows_with_signal
    ids = torch.ones(3, 4, dtype=torch.long)
    flat = Batch(ids, torch.ones_like(ids), torch.ones(3, 3), torch.zeros(3, 3), torch.zeros(3), torch.zeros(3, dtype=torch.bool))
    assert grpo.rows_with_signal(flat) == []
    with every_row_trained(True):
        assert grpo.rows_with_signal(flat) == [0, 1, 2]
    with every_row_trained(False):
        assert grpo.rows_with_signal(flat) == []
    assert grpo.rows_with_signal is chosen
