"""The rollout-batching benchmark: both arms run on the same tasks, alternated, and the JSON compares them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cgym.benchmarks.rollout_batching import main


def test_both_arms_alternate_on_the_same_tasks_and_the_json_compares_them(tiny_chat_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "batching.json"
    main(["--model", str(tiny_chat_model), "--tasks", "2", "--group", "2", "--lora-r", "4", "--rounds", "2", "--json", str(out)])
    result = json.loads(out.read_text())
    assert [(r["round"], r["arm"]) for r in result["runs"]] == [(0, "lockstep"), (0, "continuous"), (1, "lockstep"), (1, "continuous")]
    assert all(r["sampled_ids"] > 0 and r["forwards"] > 0 and r["seconds"] > 0 for r in result["runs"])
    per_id = result["ms_per_sampled_id"]
    assert result["speedup_per_sampled_id"] == pytest.approx(per_id["lockstep"] / per_id["continuous"], abs=0.01)
    assert result["round_speedups"]["min"] <= result["round_speedups"]["median"] <= result["round_speedups"]["max"]
