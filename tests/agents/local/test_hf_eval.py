"""`cgym eval --policy hf:DIR` on both env families, before and after a short SFT."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cgym.agents.demos import demonstrations
from cgym.trainer.sft import sft

from cgym.cli import main

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def sft_model(tiny_chat_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sft")
    demos = demonstrations("cgym/ApiReport-v0", {"difficulty": "easy"}, episodes=16, seed=0)
    stats = sft(tiny_chat_model, demos, out, epochs=1.0, batch_size=8, progress=False)
    assert stats["final_loss"] < stats["first_loss"]
    return out


@pytest.mark.parametrize("env", ["cgym/ApiReport-v0", "cgym/SqlQuery-v0"])
@pytest.mark.parametrize("which", ["before", "after"])
def test_cli_eval_with_a_local_model(env: str, which: str, tiny_chat_model: Path, sft_model: Path, tmp_path: Path) -> None:
    model = tiny_chat_model if which == "before" else sft_model
    out = tmp_path / "eval.json"
    code = main(["eval", "--env", env, "--policy", f"hf:{model}", "--episodes", "3", "--max-new-tokens", "24", "--json", str(out)])
    assert code == 0
    summary = json.loads(out.read_text())
    assert summary["episodes"] == 3 and summary["policy"] == f"hf:{model}"
    assert summary["mean_sampled_tokens"] > 0
    assert sum(summary["critique_codes"].values()) >= 1  # an untrained tiny model makes mistakes, and they are named
