"""The env-concurrency benchmark: a small run of its CLI writes the JSON it documents."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cgym.benchmarks.env_concurrency import main


@pytest.mark.timing
def test_small_run_writes_rows_per_batch_size_and_concurrency_wins(tmp_path: Path) -> None:
    out = tmp_path / "env_concurrency.json"
    # 100 ms a request, so the waits that overlap outweigh the CPU work even on a loaded machine
    # (at 10 ms a CI run beside a torch job measured a speedup under 1.5)
    main(["--difficulty", "medium", "--latency-ms", "100", "--episodes", "8", "--concurrency", "1", "4", "--note", "test", "--json", str(out)])
    result = json.loads(out.read_text())
    assert result["note"] == "test" and result["env_kwargs"] == {"difficulty": "medium", "latency_s": 0.1}
    one, four = result["rows"]
    assert (one["concurrent_episodes"], four["concurrent_episodes"]) == (1, 4)
    assert all(row["same_results"] and row["success_rate"] == 1.0 for row in [*result["rows"], result["zero_latency"]])
    assert one["requests_per_episode"] >= 2
    assert four["speedup"] > 1.5  # 4 episodes' waits overlap; one core is plenty for that
