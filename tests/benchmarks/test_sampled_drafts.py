"""The sampled-drafts benchmark: both arms run, alternated, and the JSON compares them per sampled id."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cgym.agents.local.lookup import LOOKUP_TOKENS
from cgym.benchmarks.sampled_drafts import main
from cgym.trainer.tiny import build_tiny

from tests.agents.local.test_hf import SIZES, chat_corpus


def test_both_arms_alternate_and_the_json_compares_them(tmp_path: Path) -> None:
    model = build_tiny(tmp_path / "tiny", chat_corpus(), **SIZES)
    out = tmp_path / "drafts.json"
    main(["--model", str(model), "--episodes", "2", "--rounds", "2", "--json", str(out)])
    result = json.loads(out.read_text())
    assert [r["draft_tokens"] for r in result["runs"]] == [LOOKUP_TOKENS, 0, LOOKUP_TOKENS, 0]
    assert all(r["sampled_ids"] > 0 and r["seconds"] > 0 for r in result["runs"])
    per_id = result["ms_per_sampled_id"]
    assert set(per_id) == {str(LOOKUP_TOKENS), "0"}
    assert result["speedup_per_sampled_id"] == pytest.approx(per_id["0"] / per_id[str(LOOKUP_TOKENS)], abs=0.01)


def test_two_draft_counts_compare_and_equal_ones_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = build_tiny(tmp_path / "tiny", chat_corpus(), **SIZES)
    out = tmp_path / "drafts.json"
    main(["--model", str(model), "--episodes", "1", "--rounds", "1", "--drafts", "8", "--against", "4", "--json", str(out)])
    result = json.loads(out.read_text())
    assert [r["draft_tokens"] for r in result["runs"]] == [8, 4] and set(result["ms_per_sampled_id"]) == {"8", "4"}
    with pytest.raises(SystemExit):
        main(["--model", str(model), "--drafts", "4", "--against", "4"])
    assert "two different counts" in capsys.readouterr().err
