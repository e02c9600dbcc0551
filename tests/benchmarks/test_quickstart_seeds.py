"""Pooling quickstart runs: GRPO's own gain per seed and over seeds, paired on the same episodes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cgym.benchmarks.quickstart_seeds import plot, summarize

LABELS = ["prompt-only (the instruct model as shipped)", "SFT", "SFT + GRPO"]


def _fake_run(directory: Path, outcomes: dict[str, list[int]]) -> Path:
    directory.mkdir(parents=True)
    arms = {label: {"per_episode": [{"seed": 10_000 + i, "success": bool(v)} for i, v in enumerate(outcomes[label.split(" (")[0]])]} for label in LABELS}
    (directory / "compare.json").write_text(json.dumps({"labels": LABELS, "arms": arms}))
    rates = {label.split(" (")[0]: sum(v) / len(v) for label, v in ((lbl, outcomes[lbl.split(" (")[0]]) for lbl in LABELS)}
    (directory / "quickstart.json").write_text(json.dumps({"arms": rates, "grpo_gain": {}, "timings_s": {"total": 500.0}}))
    return directory


def test_gains_pool_over_seeds_on_the_same_episodes(tmp_path: Path) -> None:
    runs = {
        0: _fake_run(tmp_path / "s0", {"prompt-only": [0, 0, 0, 0], "SFT": [0, 1, 0, 1], "SFT + GRPO": [1, 1, 1, 1]}),
        1: _fake_run(tmp_path / "s1", {"prompt-only": [0, 0, 0, 0], "SFT": [1, 1, 0, 1], "SFT + GRPO": [1, 1, 0, 1]}),
    }
    result = summarize(runs)
    gain = result["pooled"]["grpo_gain (SFT + GRPO - SFT)"]
    assert result["seeds"] == [0, 1] and gain["seeds"] == 2 and gain["episodes"] == 4
    assert gain["mean"] == pytest.approx(2 / 8) and gain["gained"] == 2 and gain["lost"] == 0
    assert result["pooled"]["SFT + GRPO - prompt-only"]["mean"] == pytest.approx(7 / 8)
    assert result["total_s"] == {0: 500.0, 1: 500.0}
    for seed in result["per_seed"].values():  # as a real run's quickstart.json holds it
        seed["grpo_gain"] = {"mean": 0.25, "low": 0.0, "high": 0.5}
    plot(result, tmp_path / "seeds.png")
    assert (tmp_path / "seeds.png").stat().st_size > 1000


def test_each_missing_seed_runs_in_a_process_of_its_own_and_kept_ones_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A seed with a quickstart.json is kept; each other one is `cgym quickstart` in a child
    process (its peak memory its own), with the layout asked for; memory passes into the result."""
    import subprocess
    import sys

    import cgym.benchmarks.quickstart_seeds as bench

    kept = _fake_run(tmp_path / "seed0", {"prompt-only": [0, 0], "SFT": [0, 1], "SFT + GRPO": [1, 1]})
    summary = json.loads((kept / "quickstart.json").read_text())
    (kept / "quickstart.json").write_text(json.dumps(summary | {"peak_rss_gb": {"sft": 5.1}}))
    launched: list[list[str]] = []

    def child(command: list[str], check: bool) -> None:
        assert check and command[:3] == [sys.executable, "-m", "cgym"]
        launched.append(command[3:])
        _fake_run(Path(command[command.index("--out") + 1]), {"prompt-only": [0, 0], "SFT": [1, 0], "SFT + GRPO": [1, 1]})

    monkeypatch.setattr(subprocess, "run", child)
    bench.main(["--seeds", "0", "1", "--out", str(tmp_path), "--tool-layout", "json", "--json", str(tmp_path / "seeds.json")])
    assert launched == [["quickstart", "--out", str(tmp_path / "seed1"), "--model", "smollm2-135m", "--tool-layout", "json", "--seed", "1"]]
    result = json.loads((tmp_path / "seeds.json").read_text())
    assert result["plan"]["tool_layout"] == "json" and result["seeds"] == [0, 1]
    assert result["per_seed"]["0"]["peak_rss_gb"] == {"sft": 5.1} and "peak_rss_gb" not in result["per_seed"]["1"]
