"""The embedded default model: a tokenizer trained on env text and a tiny Qwen2, built here."""

from __future__ import annotations

from pathlib import Path

from agents.demos import Demo, corpus, demonstrations
from agents.tiny import build_tiny
from envs.registration import registered

TINY_SIZES = {"vocab_size": 4096, "hidden_size": 192, "num_layers": 4, "num_heads": 6, "num_kv_heads": 2}


def tokenizer_corpus(*, episodes_per_difficulty: int = 150, seed: int = 0) -> list[Demo]:
    """Transcripts of scripted agents on every built-in env family and difficulty."""
    demos: list[Demo] = []
    for env_id in (e for e in registered() if e.startswith("cgym/")):
        for difficulty in ("easy", "medium", "hard"):
            demos += demonstrations(env_id, {"difficulty": difficulty}, episodes=episodes_per_difficulty, seed=seed, imperfect=0.3)
    return demos


def build_embedded_model(out: Path, *, seed: int = 0) -> Path:
    """`cgym tiny`: train the tokenizer on env text, initialise the tiny model, save both."""
    return build_tiny(out, corpus(tokenizer_corpus(seed=seed)), seed=seed, **TINY_SIZES)
