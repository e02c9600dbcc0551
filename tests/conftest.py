"""Shared fixtures: a tiny chat model (built once per session, no download)."""

from __future__ import annotations

from pathlib import Path

import pytest
from cgym.agents.local.precision import DTYPE_ENV


@pytest.fixture(autouse=True)
def fp32_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests compare log-probs at 1e-4, so they run in fp32 unless a test asks for bf16."""
    monkeypatch.setenv(DTYPE_ENV, "float32")


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A very small model whose tokenizer knows the env's text (built from scripted transcripts)."""
    from cgym.agents.demos import corpus, demonstrations
    from cgym.trainer.tiny import build_tiny

    demos = demonstrations("cgym/ApiReport-v0", {"difficulty": "easy"}, episodes=40, seed=0)
    return build_tiny(tmp_path_factory.mktemp("tiny-chat"), corpus(demos), vocab_size=600, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, max_positions=2048)
