"""The headroom benchmark: its split option, and a run that reuses a checkpoint and saves as it goes."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from cgym.benchmarks.headroom import SPLITS, main, parse_split
from cgym.trainer.tiny import build_tiny

from tests.agents.local.test_hf import SIZES, chat_corpus


def test_split_names_env_and_difficulty() -> None:
    assert parse_split("api:medium") == ("cgym/ApiReport-v0", "medium")
    assert parse_split("sql:hard") == ("cgym/SqlQuery-v0", "hard")
    assert len({parse_split(s) for s in SPLITS}) == len(SPLITS)


@pytest.mark.parametrize("bad", ["api", "api:", "web:easy", ":easy"])
def test_bad_split_is_a_usage_error(bad: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="--split"):
        parse_split(bad)


def test_a_reused_checkpoint_skips_the_sft_and_each_step_is_saved(tmp_path: Path) -> None:
    build_tiny(tmp_path / "out" / "ApiReport-v0-easy" / "sft", chat_corpus(), **SIZES)
    out = tmp_path / "headroom.json"
    saved: list[dict] = []
    real_write = Path.write_text

    def spy(path: Path, text: str, *args: object, **kwargs: object) -> int:
        if path == out:
            saved.append(json.loads(text)["splits"][-1])
        return real_write(path, text, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Path, "write_text", spy)
        main(["--split", "api:easy", "--reuse-sft", "--tasks", "1", "--samples", "2", "--max-new-tokens", "8", "--out", str(tmp_path / "out"), "--json", str(out)])

    assert [sorted(row) for row in saved[:2]] == [["difficulty", "env", "model_dir", "sft"], ["difficulty", "env", "greedy", "greedy_codes", "greedy_context_cuts", "greedy_seconds", "model_dir", "sft"]]
    final = json.loads(out.read_text())["splits"][0]
    assert final["sft"] == {"reused": str(tmp_path / "out" / "ApiReport-v0-easy" / "sft")}
    assert {"greedy", "pass@2", "pass^2", "tasks"} <= set(final) and sum(final["tasks"].values()) == 1
